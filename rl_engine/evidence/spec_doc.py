"""The arithmetic specification packed into every archive.

``SUMMARY.md`` and ``REVIEWING.md`` point a reviewer to the specification every report claims
(``arithmetic_spec``); a reviewer without the repository could not read it. The archive packs
``docs/arithmetic.md`` as ``<name>/arithmetic.md`` (:data:`SPEC_DOC`), after checking that its
first line names this installation's version (:func:`spec_version`), and ``REVIEWING.md``
records its version and SHA-256 (:func:`spec_record`); ``verify`` checks all three
(:func:`spec_problems`).
"""

from __future__ import annotations

import hashlib
import re

from rl_engine.rundir import SPEC_DOC  # the packed copy, at the top of the archive beside REVIEWING.md

SPEC_SOURCE = "docs/arithmetic.md"  # where the workflow reads it, relative to the repository
_HEADING = re.compile(r"# [^\n`]*`(rl-engine-arith/[0-9]+)`[ \t]*(?:\n|$)")


class SpecDocError(ValueError):
    """A specification file that does not name the version this installation implements."""


def spec_version(data: bytes) -> str | None:
    """The version the specification's first line names (``# ...: `rl-engine-arith/N```), else None."""
    match = _HEADING.match(data[:400].decode("utf-8", errors="replace"))
    return match.group(1) if match else None


def spec_record(data: bytes) -> str:
    """REVIEWING.md's line that records the packed specification's version and SHA-256."""
    return f"`{SPEC_DOC}` (version `{spec_version(data)}`, SHA-256 `{hashlib.sha256(data).hexdigest()}`)"


def spec_problems(data: bytes | None, expected: str, reviewing: str | None) -> list[str]:
    """What is wrong with a packed specification: missing, another version than ``expected``, or
    bytes other than the ones ``reviewing`` (REVIEWING.md's text) records."""
    if data is None:
        return [f"{SPEC_DOC} is not in the archive: the reports claim {expected}, whose text a reviewer must read; "
                "rebuild the archive with this rl_engine (the archive rule packs docs/arithmetic.md)"]
    problems = []
    version = spec_version(data)
    if version != expected:
        problems.append(f"{SPEC_DOC}: its first line names version {version!r}, but the reports and this verifier "
                        f"use {expected!r}")
    if reviewing is None or spec_record(data) not in reviewing:
        problems.append(f"{SPEC_DOC}: REVIEWING.md does not record its version and SHA-256 "
                        f"({spec_record(data)}): the packed text is not the one the archive was built with")
    return problems


def check_spec_doc(data: bytes, expected: str, source: str) -> None:
    """Refuse (:class:`SpecDocError`) a specification whose first line is not version ``expected``."""
    version = spec_version(data)
    if version != expected:
        raise SpecDocError(f"{source}: its first line names version {version!r}, but this rl_engine computes "
                           f"{expected!r}; pass the docs/arithmetic.md of this checkout (--spec)")
