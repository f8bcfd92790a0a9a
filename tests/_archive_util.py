"""Helpers for the verifier's tests: one real archive read into memory, archives rebuilt from
its members, a sandbox that catches any file written outside the verifier's temporary
directory, and one verify run inside it.

Not a test module (no ``test_`` prefix); shared by tests/conftest.py, tests/test_verify.py and
tests/test_gates_archives.py.
"""

from __future__ import annotations

import gzip
import io
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rl_engine import jsonio, schemas
from rl_engine.evidence import archive, verify
from rl_engine.rundir import CRATE, STATEMENT, SUMS, Run

Entry = tuple[tarfile.TarInfo, bytes | None]


@dataclass(frozen=True)
class Good:
    """A real, verified-good archive and its members (info, bytes) in archive order."""

    archive: Path
    name: str
    entries: tuple[Entry, ...]

    def data(self, rel: str) -> bytes:
        found = [d for i, d in self.entries if i.name == f"{self.name}/{rel}"]
        assert len(found) == 1 and found[0] is not None, rel
        return found[0]


def read_archive(out: Path, name: str) -> Good:
    """A real archive (``conftest.tiny_archive``: the tiny run through the real verbs) read into memory."""
    entries = []
    with tarfile.open(out) as tar:
        for member in tar.getmembers():
            data = tar.extractfile(member).read() if member.isfile() else None  # type: ignore[union-attr]
            entries.append((member, data))
    return Good(out, name, tuple(entries))


@dataclass(frozen=True)
class Sandbox:
    """``tmp`` is where tempfile puts the verifier's directory; ``cwd`` the working directory."""

    root: Path
    tmp: Path
    cwd: Path


def make_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Sandbox:
    tmp, cwd = tmp_path / "tmp", tmp_path / "cwd"
    tmp.mkdir()
    cwd.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.chdir(cwd)
    return Sandbox(root=tmp_path, tmp=tmp, cwd=cwd)


def file_entry(name: str, data: bytes) -> Entry:
    """A regular member ``name`` holding ``data`` (mode 0644)."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    return info, data


def resummed(good: Good, entries: list[Entry]) -> list[Entry]:
    """``entries`` with SHA256SUMS recomputed over their files (a tamperer covering the tracks)."""
    sums_name = f"{good.name}/{archive.SUMS}"
    files = [(i.name[len(good.name) + 1:], d) for i, d in entries if d is not None and i.name != sums_name]
    text = archive.sums_text(files).encode()
    return [file_entry(i.name, text) if i.name == sums_name else (i, d) for i, d in entries]


def restated(name: str, entries: list[Entry], work: Path) -> list[Entry]:
    """``entries`` with the RO-Crate, the provenance statement and SHA256SUMS made again from the entries' own
    files by the archive verb's :func:`rl_engine.evidence.archive.described`, under the statement's
    ``sourceDateEpoch``: a forger with the project's tools covering every track (the statement is not signed).
    ``work`` is an empty directory the entries are written to."""
    own = {f"{name}/{rel}": rel for rel in (CRATE, STATEMENT, SUMS)}
    for info, data in entries:
        if data is not None:
            path = work / info.name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    stated = [jsonio.loads(d.decode()) for i, d in entries if i.name == f"{name}/{STATEMENT}" and d is not None]
    epoch = stated[0]["predicate"]["buildDefinition"]["externalParameters"]["sourceDateEpoch"] if stated else 0
    digests = {i.name[len(name) + 1:]: jsonio.sha256_bytes(d) for i, d in entries if d is not None and i.name not in own}
    made = dict(archive.described(Run.load(work / name), name, digests, epoch))
    return [file_entry(i.name, made[own[i.name]]) if i.name in own else (i, d) for i, d in entries]


def write_archive(path: Path, entries: list[Entry], sidecar: bool = True, fmt: int = tarfile.GNU_FORMAT,
                  tail: bytes = b"") -> Path:
    """``entries`` as a gzipped tar at ``path`` (``tail`` appended after the gzip stream) and, with
    ``sidecar``, a correct ``.sha256`` beside it, so the check under test, not the outer checksum,
    has to catch what was changed."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w|", format=fmt) as tar:  # type: ignore[call-overload]
            for info, data in entries:
                tar.addfile(info, None if data is None else io.BytesIO(data))
    data = buffer.getvalue() + tail
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if sidecar:
        path.with_name(path.name + ".sha256").write_text(f"{jsonio.sha256_bytes(data)}  {path.name}\n")
    return path


def run_verify(path: Path, box: Sandbox, capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str, dict[str, Any]]:
    """``verify PATH --json`` in the sandbox: its exit code, what it printed and its schema-valid
    result; fails when it left anything in its temporary or the working directory."""
    out = box.root / "verify.json"
    out.unlink(missing_ok=True)
    code = verify.main([str(path), "--json", str(out), *flags])
    captured = capsys.readouterr()
    assert list(box.tmp.iterdir()) == [], "verify left files in its temporary directory"
    assert list(box.cwd.iterdir()) == [], "verify wrote into the working directory"
    result = jsonio.load(out)
    assert schemas.errors(result, "verify") == []
    assert result["passed"] is (code == 0)
    return code, captured.out + captured.err, result
