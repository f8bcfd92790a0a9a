"""Helpers for the verifier's tests: one real archive read into memory, and a sandbox that
catches any file written outside the verifier's temporary directory.

Not a test module (no ``test_`` prefix); shared by tests/conftest.py, tests/test_verify.py and
tests/test_gates_archives.py.
"""

from __future__ import annotations

import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

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
