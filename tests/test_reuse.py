"""Reuse of the environment capture and of a passing focused suite across runs (rl_engine.record.reuse).

A new case is a new run directory; its environment and regression stages copy an earlier run's
files when the key of what the stage depends on is the same, and say so in their JSON, their
output and SUMMARY.md. Each test changes one thing the key covers and sees the stage run again.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rl_engine import jsonio, schemas
from rl_engine.record import environment, regression, reuse
from rl_engine.rundir import ENVIRONMENT, ENVIRONMENT_TEXT, JUNIT, PYTEST_LOG, REGRESSION


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false",
                    *args], cwd=repo, check=True, capture_output=True)


def _suite(root: Path, body: str) -> list[str]:
    (root / "tests").mkdir(exist_ok=True)
    (root / "tests" / "test_tiny.py").write_text(body)
    return ["tests/test_tiny.py"]


def test_a_passing_suite_is_reused_by_the_next_run_and_rerun_when_a_test_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    tests = _suite(tmp_path, "def test_one():\n    assert 1 + 1 == 2\n")
    cache = tmp_path / "results" / ".reuse"

    def run(name: str) -> tuple[int, dict, str]:
        code = regression.main(["--output-dir", f"results/{name}", "--tests", *tests, "--reuse-dir", str(cache)])
        return code, jsonio.load(tmp_path / "results" / name / REGRESSION), capsys.readouterr().out

    code, first, _ = run("first")
    assert code == 0 and first["passed"] == 1 and "reused" not in first
    code, second, out = run("second")  # same files, tests, environment: copied, pytest not run
    assert code == 0 and second["reused"]["from_run"] == "first" and "regression: reused" in out, out
    assert {k: v for k, v in second.items() if k != "reused"} == first
    assert schemas.errors(second, "regression") == []
    for name in (PYTEST_LOG, JUNIT):
        assert (tmp_path / "results/second" / name).read_bytes() == (tmp_path / "results/first" / name).read_bytes()
    _suite(tmp_path, "def test_one():\n    assert 2 + 2 == 4\n")  # a changed test: a new key, pytest runs
    code, third, out = run("third")
    assert code == 0 and "reused" not in third and "regression: reused" not in out


def test_a_failing_suite_is_never_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    tests = _suite(tmp_path, "def test_one():\n    assert False\n")
    cache = tmp_path / ".reuse"
    for name in ("a", "b"):
        code = regression.main(["--output-dir", name, "--tests", *tests, "--reuse-dir", str(cache)])
        assert code == 1 and "reused" not in jsonio.load(tmp_path / name / REGRESSION)
    assert not list(cache.glob("regression-*")) and "regression: reused" not in capsys.readouterr().out


def test_the_environment_capture_is_reused_until_the_git_status_changes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.txt").write_text("a\n")
    _git(repo, "add", "a.txt")
    _git(repo, "commit", "-q", "-m", "first")
    cache = tmp_path / ".reuse"

    def run(name: str) -> tuple[dict, str]:
        assert environment.main(["--output-dir", str(tmp_path / name), "--repo", str(repo),
                                 "--reuse-dir", str(cache)]) == 0
        return jsonio.load(tmp_path / name / ENVIRONMENT), capsys.readouterr().out

    first, _ = run("first")
    second, out = run("second")
    assert "environment: reused the capture of run first" in out and second["reused"]["from_run"] == "first"
    assert {k: v for k, v in second.items() if k != "reused"} == first and schemas.errors(second, "environment") == []
    assert (tmp_path / "second" / ENVIRONMENT_TEXT).read_bytes() == (tmp_path / "first" / ENVIRONMENT_TEXT).read_bytes()
    (repo / "capture.safetensors").write_bytes(b"\0")  # untracked data: the record lists it, so a new capture
    third, out = run("third")
    assert "reused" not in third and third["git"]["untracked_data_files"] == ["capture.safetensors"], out


def test_each_key_changes_with_what_it_covers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The regression key follows the package's and the tests' bytes and the test list, and not the
    git status (untracked data); the environment key follows the git status and the environment."""
    tests = _suite(tmp_path, "def test_one():\n    pass\n")
    (tmp_path / "rl_engine").mkdir()
    (tmp_path / "rl_engine" / "mod.py").write_text("x = 1\n")
    base_reg, base_env = reuse.regression_key(tmp_path, tests, []), reuse.environment_key(tmp_path)
    assert reuse.regression_key(tmp_path, tests, ["-x"]) != base_reg
    (tmp_path / "data.bin").write_bytes(b"\0")  # not the suite's: same regression key
    assert reuse.regression_key(tmp_path, tests, []) == base_reg
    (tmp_path / "rl_engine" / "mod.py").write_text("x = 2\n")
    assert reuse.regression_key(tmp_path, tests, []) != base_reg
    (tmp_path / "rl_engine" / "__pycache__").mkdir()
    (tmp_path / "rl_engine" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")  # ignored
    edited = reuse.regression_key(tmp_path, tests, [])
    assert reuse.regression_key(tmp_path, tests, []) == edited
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert reuse.environment_key(tmp_path) != base_env and reuse.regression_key(tmp_path, tests, []) != edited
