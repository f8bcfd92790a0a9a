"""The session fixtures' one build (tests/_once.py): under xdist the second worker reads what the
first built, a failed build is not recorded, and a run without xdist keeps its own folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from _once import built_once


class Factory:
    """A stand-in for one xdist worker's ``tmp_path_factory``: its folder ``<session>/<worker>``."""

    def __init__(self, session: Path, worker: str) -> None:
        self.base = session / worker
        self.base.mkdir(parents=True, exist_ok=True)
        self.made = 0

    def getbasetemp(self) -> Path:
        return self.base

    def mktemp(self, name: str) -> Path:
        self.made += 1
        path = self.base / f"{name}{self.made}"
        path.mkdir()
        return path


def test_the_second_worker_reads_what_the_first_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    builds: list[Path] = []

    def build(folder: Path) -> Path:
        builds.append(folder)
        (folder / "run").mkdir()
        return folder / "run"

    first = built_once(Factory(tmp_path, "popen-gw0"), "tiny-run", build)
    second = built_once(Factory(tmp_path, "popen-gw1"), "tiny-run", build)
    assert first == second == builds[0] / "run" and len(builds) == 1
    other = built_once(Factory(tmp_path / "another-session", "popen-gw0"), "tiny-run", build)
    assert other != first and len(builds) == 2  # another session's folder: its own build


def test_a_failed_build_is_built_again_by_the_next_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")

    def broken(folder: Path) -> Path:
        raise RuntimeError("a rank failed")

    with pytest.raises(RuntimeError, match="a rank failed"):
        built_once(Factory(tmp_path, "popen-gw0"), "tiny-run", broken)
    assert not (tmp_path / "tiny-run.path").exists()
    assert built_once(Factory(tmp_path, "popen-gw1"), "tiny-run", lambda folder: folder).parent.name == "popen-gw1"


def test_without_xdist_each_call_builds_in_its_own_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    factory = Factory(tmp_path, "pytest-1")
    first = built_once(factory, "tiny-run", lambda folder: folder)
    second = built_once(factory, "tiny-run", lambda folder: folder)
    assert first != second and not (tmp_path / "tiny-run.path").exists()  # nothing written outside its folder
