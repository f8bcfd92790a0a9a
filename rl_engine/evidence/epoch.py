"""``SOURCE_DATE_EPOCH``: the one time an evidence archive records.

An archive must rebuild byte for byte from the same run, so it holds no clock reading: every time
in it is this one number of seconds since 1970-01-01T00:00:00Z. The tar members' mtimes, the gzip
header's mtime, the in-toto statement's ``startedOn``/``finishedOn`` and the RO-Crate's
``datePublished`` all come from it (:mod:`rl_engine.evidence.archive`,
:mod:`rl_engine.evidence.provenance`, :mod:`rl_engine.evidence.crate`).

It follows the Reproducible Builds convention (https://reproducible-builds.org/specs/source-date-epoch/):
the environment variable ``SOURCE_DATE_EPOCH``, when set, is that time, written as ``date +%s``
writes it (decimal ASCII digits, no sign, no fraction, no leading zero). Unset, the archive uses
:data:`DEFAULT_EPOCH` (0: 1970-01-01T00:00:00Z), the fixed mtime archives always had, so an
archive built without the variable keeps its bytes. A set value that is not such a number, or
that the gzip header cannot hold (its mtime field is an unsigned 32-bit number of seconds), is
refused naming the value and the fix: the convention asks a build to fail on a malformed value
rather than fall back to the clock or to the default. The workflow checks it when it is parsed
(:func:`rl_engine.workflow.config.check_workflow_config`), before any job runs.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping

ENV = "SOURCE_DATE_EPOCH"
DEFAULT_EPOCH = 0  # 1970-01-01T00:00:00Z: the archive's fixed time when the variable is unset
MAX_EPOCH = (1 << 32) - 1  # the gzip header's mtime is an unsigned 32-bit count of seconds (2106-02-07)
DIGITS = re.compile(r"^(0|[1-9][0-9]*)$")


class SourceDateEpochError(ValueError):
    """A ``SOURCE_DATE_EPOCH`` that is not a time the archive can record."""


def source_date_epoch(environ: Mapping[str, str] | None = None) -> int:
    """The archive's time: ``SOURCE_DATE_EPOCH`` of ``environ`` (default: this process's), or
    :data:`DEFAULT_EPOCH` when it is unset; :class:`SourceDateEpochError` on a malformed value."""
    value = (os.environ if environ is None else environ).get(ENV)
    if value is None:
        return DEFAULT_EPOCH
    if not DIGITS.match(value) or int(value) > MAX_EPOCH:
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise SourceDateEpochError(
            f"{ENV}={shown!r} is not a time an archive can record: it must be a whole number of seconds since "
            f"1970-01-01T00:00:00Z from 0 to {MAX_EPOCH}, written as `date +%s` writes it (digits only); set it "
            f"so (e.g. {ENV}=$(git log -1 --format=%ct)) or unset it for the default {DEFAULT_EPOCH} "
            f"({rfc3339(DEFAULT_EPOCH)})")
    return int(value)


def rfc3339(epoch: int) -> str:
    """``epoch`` as an RFC 3339 UTC timestamp with whole seconds, ``1970-01-01T00:00:00Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


__all__ = ["DEFAULT_EPOCH", "ENV", "MAX_EPOCH", "SourceDateEpochError", "rfc3339", "source_date_epoch"]
