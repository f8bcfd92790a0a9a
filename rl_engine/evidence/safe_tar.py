"""Extracting an untrusted ``.tar.gz`` without trusting it.

:func:`safe_extract` reads the archive as a stream and writes member by member into a
directory the caller owns (``verify`` uses a fresh temporary directory); it never calls
``extractall``. Before anything of a member is written its header is checked, and the whole
archive is refused with an :class:`UnsafeArchiveError` whose message a reviewer can act on:

* a path that is absolute, contains ``..``, ``.`` or empty components, a backslash or a
  control character, or is not under the single top folder shared by every member;
* a symbolic link, hard link, character or block device, FIFO, sparse file or any member that
  is neither a regular file nor a directory;
* a name that appears twice;
* a member larger than :attr:`Limits.max_member_bytes`, members adding up to more than
  :attr:`Limits.max_total_bytes`, more than :attr:`Limits.max_members` members, or a
  decompressed stream that grows past what those limits allow (a decompression bomb);
* a GNU long name or long link name, or a PAX extended or global header, that declares more
  than :attr:`Limits.max_header_bytes` (default 64 KiB): refused from the declared size, before
  any of it is read (a name is never longer than a few KiB; tarfile would read the whole header
  into memory); a GNU sparse header is refused before its extension blocks are read;
* a gzip or tar stream that is truncated or corrupt (the gzip stream is read to its end, so
  its CRC and length are checked), or non-zero data after the tar end-of-archive marker;
* a member the file system refuses to create (an ``OSError`` such as a file named like a
  directory an earlier member implied, ``a/b`` then ``a``, or a name component longer than the
  file system allows): the message names the member and the system's reason.

Files are created with ``O_EXCL | O_NOFOLLOW`` under paths built from checked components
only, with owner-only permissions, whatever modes the archive declares. Every member name a
refusal quotes is cut to :data:`MAX_QUOTED_NAME` characters (:func:`quoted`), with its length.
"""

from __future__ import annotations

import gzip
import os
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

MIB = 1 << 20
CHUNK = MIB
TAR_BLOCK = 512
MAX_QUOTED_NAME = 200
HEADER_KINDS: dict[bytes, str] = {
    tarfile.GNUTYPE_LONGNAME: "GNU long name",
    tarfile.GNUTYPE_LONGLINK: "GNU long link name",
    tarfile.XHDTYPE: "PAX extended",
    tarfile.XGLTYPE: "PAX global",
    tarfile.SOLARIS_XHDTYPE: "Solaris extended",
}


class UnsafeArchiveError(ValueError):
    """An archive refused as unsafe or damaged; the message says why in a reviewer's words."""


@dataclass(frozen=True)
class Limits:
    """Caps on what an archive may unpack to (defaults: 256 MiB a member, 2 GiB in all, 64 KiB a
    long-name or PAX header)."""

    max_member_bytes: int = 256 * MIB
    max_total_bytes: int = 2048 * MIB
    max_members: int = 10_000
    max_header_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for name in ("max_member_bytes", "max_total_bytes", "max_members", "max_header_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")

    @property
    def max_stream_bytes(self) -> int:
        """Decompressed bytes the tar stream may hold: data plus headers, padding and EOF."""
        return self.max_total_bytes + (self.max_members + 1) * 3 * TAR_BLOCK + 20 * TAR_BLOCK


@dataclass(frozen=True)
class Extracted:
    """What :func:`safe_extract` wrote: the top folder and every file (POSIX, under it)."""

    root: Path
    top: str
    files: tuple[str, ...] = field(default_factory=tuple)
    directories: tuple[str, ...] = field(default_factory=tuple)
    total_bytes: int = 0


class _CappedReader:
    """A read-only stream that refuses to yield more than ``cap`` bytes."""

    def __init__(self, inner: IO[bytes], cap: int) -> None:
        self._inner = inner
        self._cap = cap
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            raise ValueError("an unbounded read of an untrusted stream is not supported; read in chunks")
        want = min(size, self._cap - self.count + 1)
        data = self._inner.read(want)
        self.count += len(data)
        if self.count > self._cap:
            raise UnsafeArchiveError(
                f"the decompressed archive exceeds {self._cap} bytes, more than the size limits "
                "allow: refused as a possible decompression bomb"
            )
        return data


def quoted(name: str) -> str:
    """``repr`` of a member name for a message, cut to :data:`MAX_QUOTED_NAME` characters."""
    if len(name) <= MAX_QUOTED_NAME:
        return repr(name)
    return f"{name[:MAX_QUOTED_NAME]!r}... ({len(name)} characters)"


def _capped_tarinfo(cap: int) -> type[tarfile.TarInfo]:
    """A TarInfo that refuses an extension header declaring more than ``cap`` bytes before reading it."""

    class CappedTarInfo(tarfile.TarInfo):
        def _refuse_oversized(self) -> None:
            if self.size > cap:
                raise UnsafeArchiveError(
                    f"a {HEADER_KINDS.get(self.type, 'extension')} header declares {self.size} bytes, over the cap of "
                    f"{cap} bytes: no real member name or header needs that much (refused before reading it)")

        def _proc_gnulong(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
            self._refuse_oversized()
            return super()._proc_gnulong(tar)  # type: ignore[misc]

        def _proc_pax(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
            self._refuse_oversized()
            return super()._proc_pax(tar)  # type: ignore[misc]

        def _proc_sparse(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
            raise UnsafeArchiveError(f"member {quoted(self.name)} is a sparse file; only regular files and "
                                     "directories are allowed")

    return CappedTarInfo


def check_member_name(name: str) -> tuple[str, ...]:
    """The components of a safe relative member name, or :class:`UnsafeArchiveError`."""
    if not name:
        raise UnsafeArchiveError("a member has an empty name")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchiveError(f"member {quoted(name)} has an absolute path; a safe archive only holds relative paths")
    if "\\" in name:
        raise UnsafeArchiveError(f"member {quoted(name)} contains a backslash; refused (ambiguous path separator)")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        raise UnsafeArchiveError(f"member {quoted(name)} contains a control character")
    parts = tuple(name.rstrip("/").split("/"))
    if ".." in parts:
        raise UnsafeArchiveError(f"member {quoted(name)} contains '..' and would escape the extraction directory")
    if any(part in ("", ".") for part in parts):
        raise UnsafeArchiveError(f"member {quoted(name)} is not a normalised path (empty or '.' component)")
    return parts


def _kind(member: tarfile.TarInfo) -> str | None:
    """Why a member type is refused, or None for a regular file or directory."""
    if member.issym():
        return f"a symbolic link (to {quoted(member.linkname)})"
    if member.islnk():
        return f"a hard link (to {quoted(member.linkname)})"
    if member.ischr() or member.isblk():
        return "a device file"
    if member.isfifo():
        return "a FIFO"
    if member.issparse():
        return "a sparse file"
    if member.isreg() or member.isdir():
        return None
    return f"of unsupported type {member.type!r}"


def _write_file(target: Path, source: IO[bytes], size: int, name: str) -> None:
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    written = 0
    with os.fdopen(fd, "wb") as out:
        while written < size:
            block = source.read(min(CHUNK, size - written))
            if not block:
                raise UnsafeArchiveError(f"the archive is truncated inside member {quoted(name)}")
            out.write(block)
            written += len(block)


def _ensure_dir(dest: Path, parts: tuple[str, ...]) -> Path:
    current = dest
    for part in parts:
        current = current / part
        if current.is_symlink():  # never created by us; refuse rather than follow
            raise UnsafeArchiveError(f"{quoted('/'.join(parts))}: a path component is a link")
        if current.exists() and not current.is_dir():
            raise UnsafeArchiveError(f"member directory {quoted('/'.join(parts))} clashes with a file of the same name")
        current.mkdir(mode=0o700, exist_ok=True)
    return current


def safe_extract(archive: Path, dest: Path, limits: Limits = Limits()) -> Extracted:
    """Extract ``archive`` (gzip-compressed tar) into the existing, empty directory ``dest``."""
    if not dest.is_dir() or any(dest.iterdir()):
        raise ValueError(f"safe_extract needs an existing empty directory, got {dest}")
    seen: set[str] = set()
    files: list[str] = []
    dirs: list[str] = []
    top: str | None = None
    total = 0
    current: str | None = None  # the member being extracted, for an OSError's message
    try:
        with open(archive, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
            stream = _CappedReader(gz, limits.max_stream_bytes)
            with tarfile.open(fileobj=stream, mode="r|",
                              tarinfo=_capped_tarinfo(limits.max_header_bytes)) as tar:  # type: ignore[call-overload]
                for count, member in enumerate(tar, start=1):
                    if count > limits.max_members:
                        raise UnsafeArchiveError(f"the archive holds more than {limits.max_members} members")
                    name = current = member.name
                    parts = check_member_name(name)
                    clean = "/".join(parts)
                    reason = _kind(member)
                    if reason:
                        raise UnsafeArchiveError(f"member {quoted(name)} is {reason}; only regular files and directories are allowed")
                    if clean in seen:
                        raise UnsafeArchiveError(f"member name {quoted(clean)} appears more than once (duplicate members)")
                    seen.add(clean)
                    if top is None:
                        top = parts[0]
                    elif parts[0] != top:
                        raise UnsafeArchiveError(f"member {quoted(name)} is outside the archive's top folder {quoted(top)}")
                    if member.isdir():
                        _ensure_dir(dest, parts)
                        dirs.append(clean)
                        continue
                    if len(parts) < 2:
                        raise UnsafeArchiveError(f"member {quoted(name)} is a file at the top level; every file must be "
                                                 "inside the top folder")
                    if member.size > limits.max_member_bytes:
                        raise UnsafeArchiveError(
                            f"member {quoted(name)} declares {member.size} bytes, over the per-member limit of "
                            f"{limits.max_member_bytes} bytes: far larger than any real artifact (possible decompression bomb)"
                        )
                    total += member.size
                    if total > limits.max_total_bytes:
                        raise UnsafeArchiveError(
                            f"members add up to more than the total limit of {limits.max_total_bytes} bytes "
                            f"(at {quoted(name)}): refused as a possible decompression bomb"
                        )
                    parent = _ensure_dir(dest, parts[:-1])
                    source = tar.extractfile(member)
                    if source is None:  # pragma: no cover - isreg() members always have data
                        raise UnsafeArchiveError(f"member {quoted(name)} has no data")
                    _write_file(parent / parts[-1], source, member.size, name)
                    files.append(clean)
            current = None
            rest = stream.read(CHUNK)
            while rest:
                if rest.strip(b"\0"):
                    raise UnsafeArchiveError("the archive has data after the tar end-of-archive marker")
                rest = stream.read(CHUNK)
    except UnsafeArchiveError:
        raise
    except (EOFError, tarfile.ReadError, gzip.BadGzipFile, zlib.error, tarfile.HeaderError) as exc:
        raise UnsafeArchiveError(f"the archive is truncated or corrupt and cannot be read to its end ({exc})") from None
    except tarfile.TarError as exc:
        raise UnsafeArchiveError(f"the archive is not a readable tar stream ({exc})") from None
    except OSError as exc:  # after the gzip clause: BadGzipFile is an OSError too
        reason = exc.strerror or type(exc).__name__
        if current is None:
            raise UnsafeArchiveError(f"the archive cannot be read ({reason})") from None
        raise UnsafeArchiveError(f"member {quoted(current)} cannot be extracted: the file system refused it ({reason}); "
                                 "refused as unsafe or malformed (e.g. a file named like a directory an earlier "
                                 "member implied, or a name component too long)") from None
    if top is None:
        raise UnsafeArchiveError("the archive holds no members")
    return Extracted(dest / top, top, tuple(files), tuple(dirs), total)
