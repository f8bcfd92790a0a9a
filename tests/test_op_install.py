"""``pip install rl_engine`` is the op alone: torch and numpy, nothing of the workflow's.

A trainer installs rl_engine for the op (``rl_engine.logprob``, the GRPO loss, the TRL and verl
integrations); Snakemake, jsonschema, rich and PyYAML come with the ``workflow`` extra, which the
``test`` extra (the README's two commands) includes. Checked here:

- quick: the package's metadata says so, and importing the op's modules (and calling it) loads none
  of the workflow's modules (a fresh interpreter's ``sys.modules``);
- slow: a fresh virtual environment that sees nothing of this one (``python -m venv`` without
  ``--system-site-packages``), torch from the local wheel, then ``pip install`` of this checkout with
  ``constraints/cpu.txt``: the workflow's packages are not installed, ``selected_logprob`` runs and
  gives this environment's bytes, and a verb of ``python -m rl_engine`` says which extra it needs.
  The environment with torch is kept in ``.ci/op-env`` and reused (rl_engine is installed anew).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW_MODULES = ("snakemake", "jsonschema", "referencing", "rich", "yaml", "in_toto_attestation", "rocrate")
# the workflow extra includes the provenance extra's packages: the archive stage writes with them
WORKFLOW_DISTRIBUTIONS = ("snakemake", "jsonschema", "rich", "pyyaml", "in-toto-attestation", "rocrate")
OP_MODULES = ("rl_engine.logprob", "rl_engine.logprob.hidden", "rl_engine.logprob.api", "rl_engine.grpo",
              "rl_engine.integrations.trl", "rl_engine.integrations.verl", "rl_engine.arith.temperature")

# run by a fresh interpreter: the op's modules, one call, and what got imported
PROBE = """
import importlib, json, sys
import torch
for name in {modules!r}:
    importlib.import_module(name)
from rl_engine.logprob import selected_logprob
g = torch.Generator().manual_seed(3)
logits = torch.randn(5, 1024, generator=g).to(torch.bfloat16)
out = selected_logprob(logits, torch.randint(0, 1000, (5,), generator=g), real_vocab_size=1000, temperature=0.7,
                       compute_entropy=True)
print(json.dumps({{"loaded": sorted({{m.split(".")[0] for m in sys.modules}} & set({workflow!r})),
                  "logp": out.selected_logp.numpy().tobytes().hex(), "entropy": out.entropy.numpy().tobytes().hex(),
                  "backend": out.provenance["actual_backend"], "rl_engine": importlib.import_module("rl_engine").__file__}}))
"""


def _probe(python: str, env: dict[str, str], cwd: Path) -> dict:
    code = PROBE.format(modules=OP_MODULES, workflow=WORKFLOW_MODULES)
    done = subprocess.run([python, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_package_needs_torch_and_numpy_and_the_test_extra_brings_the_workflow() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert [d.split(">")[0].split("=")[0] for d in project["dependencies"]] == ["torch", "numpy"]
    extras = project["optional-dependencies"]
    assert sorted(d.split(">")[0] for d in extras["workflow"]) == sorted(WORKFLOW_DISTRIBUTIONS)
    assert "rl_engine[workflow]" in extras["test"] and "rl_engine[workflow]" in extras["slurm"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.count("pip install -q -c constraints/cpu.txt -e '.[test]' && ") == 2  # the two commands


def test_importing_and_calling_the_op_loads_nothing_of_the_workflow(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    got = _probe(sys.executable, env, tmp_path)
    assert got["loaded"] == [], got["loaded"]
    assert got["rl_engine"].startswith(str(ROOT))


def test_a_verb_without_the_workflow_extra_names_it(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Simulated here (the module import fails as it does without PyYAML); the slow test runs it for real."""
    import importlib

    from rl_engine import cli

    real = importlib.import_module

    def without_yaml(name: str, *args: object) -> object:
        if name == "rl_engine.evidence.verify":
            raise ModuleNotFoundError("No module named 'yaml'", name="yaml")
        return real(name, *args)

    monkeypatch.setattr(cli.importlib, "import_module", without_yaml)
    assert cli.main(["verify", "x.tar.gz"]) == 2
    assert "pip install 'rl_engine[workflow]'" in capsys.readouterr().err


def _op_env(python_dir: Path) -> Path:
    """A plain virtual environment with torch (the local CPU wheel, by pip's find-links) and numpy,
    made once and reused while it holds none of the workflow's modules."""
    python = python_dir / "bin" / "python"
    check = f"import importlib.util, torch, numpy; assert not any(importlib.util.find_spec(m) for m in {WORKFLOW_MODULES!r})"
    if python.is_file() and subprocess.run([str(python), "-c", check], capture_output=True,
                                           timeout=300).returncode == 0:
        return python
    shutil.rmtree(python_dir, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(python_dir)], check=True, timeout=300)
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints" / "cpu.txt"),
                           "torch", "numpy"], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return python


def _source_copy(dest: Path) -> Path:
    """What `pip install .` reads, copied (pip builds in the source tree: not in this checkout)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "rl_engine", dest / "rl_engine", ignore=ignore)
    return dest


@contextlib.contextmanager
def _held(python_dir: Path) -> Iterator[None]:
    """The environment to one test at a time: a second copy of the suite (or a second checkout whose
    ``.ci/op-env`` is the same folder) would install into it while this one installs or probes, and
    pip's own checks fail on the other's half-written files. The lock file sits beside the folder it
    guards, where its real path is."""
    lock = python_dir.resolve().parent / f"{python_dir.name}.lock"
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.mark.slow
def test_a_fresh_environment_installs_the_op_without_the_workflow_s_packages(tmp_path: Path) -> None:
    with _held(ROOT / ".ci" / "op-env"):
        _install_probe_and_run_a_verb(tmp_path)


def _install_probe_and_run_a_verb(tmp_path: Path) -> None:
    python = _op_env(ROOT / ".ci" / "op-env")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    (tmp_path / "src").mkdir()
    source = _source_copy(tmp_path / "src")
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints" / "cpu.txt"),
                           str(source)], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], env=env, capture_output=True,
                            text=True, timeout=300, check=True)
    installed = {entry["name"].lower() for entry in json.loads(listed.stdout)}
    assert "rl_engine" in installed or "rl-engine" in installed
    assert installed.isdisjoint(WORKFLOW_DISTRIBUTIONS), sorted(installed & set(WORKFLOW_DISTRIBUTIONS))

    run = tmp_path / "run"
    run.mkdir()
    theirs = _probe(str(python), env, run)
    assert theirs["loaded"] == [] and "site-packages" in theirs["rl_engine"], theirs
    ours = _probe(sys.executable, dict(os.environ, PYTHONPATH=str(ROOT)), run)
    assert (theirs["logp"], theirs["entropy"], theirs["backend"]) == (ours["logp"], ours["entropy"], ours["backend"])

    verb = subprocess.run([str(python), "-m", "rl_engine", "verify", "missing.tar.gz"], env=env, cwd=run,
                          capture_output=True, text=True, timeout=300)
    assert verb.returncode == 2, verb.stderr[-2000:]
    assert "pip install 'rl_engine[workflow]'" in verb.stderr, verb.stderr[-2000:]
