"""Strict JSON, SHA-256, atomic writes and regular-file opens: the one place artifacts are written and read.

:func:`open_regular` is how a file the project reads is opened: with ``O_NONBLOCK``, so a FIFO or
a device never blocks the ``open``, then refused by ``fstat`` unless it is a regular file
(:class:`NotRegularFileError`, an ``OSError`` naming the path and what it is). Checking the open
descriptor rather than the path first leaves no window for the path to change in between.

Strict means ``allow_nan=False`` on write and, on read, a refusal of ``NaN``/``Infinity``
literals, of a number that overflows binary64 (``1e999`` reads as infinity otherwise) and of an
integer longer than :data:`MAX_INT_DIGITS` digits (no artifact value needs more; Python refuses
past 4300 digits with a bare ``ValueError``), so no artifact can carry a non-finite or absurd
number in disguise.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator


class StrictJSONError(ValueError):
    """A value or a file that is not strict JSON."""


def dumps(obj: Any) -> str:
    """Canonical-ish, human-readable strict JSON (sorted keys, 2-space indent, final newline)."""
    try:
        return json.dumps(obj, allow_nan=False, sort_keys=True, indent=2) + "\n"
    except ValueError as exc:
        raise StrictJSONError(f"value is not strict JSON ({exc}); replace NaN/Infinity") from None


def find_leaves(value: Any, match: Callable[[Any], bool],
                parts: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    """``(path, leaf)`` of every leaf of nested dicts/lists for which ``match(leaf)`` holds.

    The one walker behind every "where is the non-finite number" question (config values,
    in-memory artifacts, lenient parses of files); ``path`` holds keys and list indices.
    """
    if match(value):
        yield parts, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from find_leaves(item, match, parts + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from find_leaves(item, match, parts + (index,))


def is_non_finite_float(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


MAX_INT_DIGITS = 100


def _reject_constant(name: str) -> Any:
    raise StrictJSONError(f"non-finite literal {name} is not strict JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise StrictJSONError(f"the number {shown} is not finite as a binary64 value (it overflows to infinity)")
    return value


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise StrictJSONError(f"an integer of {digits} digits is not an rl_engine value (at most {MAX_INT_DIGITS})")
    return int(text)


class NotRegularFileError(OSError):
    """A path the project was asked to read that is not a regular file (a FIFO, a device, a directory)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``open(path, "rb")`` of a regular file (symlinks followed), never blocking on a FIFO or a
    device; raises :class:`NotRegularFileError` naming the path, or the ``OSError`` of the open."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(f"{os.fspath(path)} is {_kind(mode)}, not a regular file; "
                                      "give the path of a file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def require_regular(path: str | os.PathLike[str]) -> None:
    """Raise as :func:`open_regular` does unless ``path`` is a regular file (for a library that opens
    the path itself: safetensors, tarfile)."""
    open_regular(path).close()


def loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float, parse_int=_bounded_int)


def load(path: str | os.PathLike[str]) -> Any:
    try:
        with open_regular(path) as handle:
            return loads(handle.read().decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise StrictJSONError(f"{path}: invalid JSON ({exc})") from None
    except StrictJSONError as exc:
        raise StrictJSONError(f"{path}: {exc}") from None


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write to a temporary file in the same directory, fsync, then rename into place."""
    atomic_write_stream(path, lambda handle: handle.write(data))


def atomic_write_stream(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """:func:`atomic_write_bytes` of what ``write(handle)`` writes to the open temporary file (for
    content too large to hold in memory): nothing is at ``path`` until it is complete."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; artifacts are meant to be shared
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Strict JSON written atomically: a crash never leaves a partial file at ``path``."""
    atomic_write_text(path, dumps(obj))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
