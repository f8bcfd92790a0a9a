"""``scripts/gpu-wheels.sh``: the wheels a GPU machine without network needs for the smoke.

Quick: the script's commands (``DRY_RUN=1``) fetch every ``[project]`` dependency but torch, and
the workflow extra's, with the constraints file, plus setuptools for the offline build and this commit as a source
archive. Opt-in (``RL_ENGINE_FETCH_TESTS=1``: it fetches about 50 MB, 4 minutes here): the script
really runs for Python 3.12, and the folder it writes resolves every dependency for Python 3.12
with no index at all (what the offline ``pip install --no-index``
on the GPU machine needs; torch and Triton are the machine's own).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu-wheels.sh"


def _deps() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["workflow"]  # the smoke runs a campaign
    return [d for d in deps if not d.startswith("torch")]


def test_the_script_fetches_every_dependency_but_torch(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "w"), "3.12"], cwd=REPO,
                          env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True,
                          check=True)
    lines = done.stdout.splitlines()
    wheel = next(line for line in lines if " pip wheel " in line)
    assert "-c constraints/cpu.txt" in wheel and "setuptools>=61" in wheel
    assert all(dep in wheel.split() for dep in _deps()) and "torch" not in wheel
    assert any(line.startswith("git archive") and "rl_engine-src.tar.gz" in line for line in lines)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("RL_ENGINE_FETCH_TESTS") != "1",
                    reason="fetches about 50 MB from the package index (4 min on 2 loaded cores); "
                           "set RL_ENGINE_FETCH_TESTS=1 to run it")
def test_the_fetched_folder_resolves_offline_for_python_3_12(tmp_path: Path) -> None:
    out = tmp_path / "wheels"
    subprocess.run(["bash", str(SCRIPT), str(out), "3.12"], cwd=REPO, check=True,
                   capture_output=True, text=True, timeout=1200)
    with tarfile.open(out / "rl_engine-src.tar.gz") as tar:
        assert "rl_engine/pyproject.toml" in tar.getnames()
    offline = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-index", "--find-links", str(out),
         "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
         "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64",
         "--platform", "manylinux_2_17_x86_64", "-d", str(tmp_path / "check"),
         *_deps(), "setuptools>=61"],
        capture_output=True, text=True, check=False, timeout=600,
    )
    assert offline.returncode == 0, offline.stdout[-2000:] + offline.stderr[-2000:]
