"""Helpers for tests that run the real workflow with snakemake in a temporary copy of the repo.

Not a test module (no ``test_`` prefix). The copy has no ``.git``, so its run is named
``<campaign>-nogit-case-<hash>`` (:func:`run_name_of`); ``PYTHONPATH`` points at the copy, so the
copy's code is what runs.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
_IGNORED_NAMES = shutil.ignore_patterns(
    ".git", "results", ".snakemake", "__pycache__", "*.egg-info", ".pytest_cache", "build"
)
# .ci/run installs the oldest supported Triton into .ci/triton-3.6 (ignored by git, about 640 MB) and
# builds the environments of the vLLM, DeepSpeed and op-install tests (.ci/vllm-env, a link or about
# 3.5 GB; .ci/deepspeed-env; .ci/op-env, about 1 GB): no workflow run reads them (their tests use the
# checkout's own), and copying them cost every copy of the repository gigabytes (7.8 GB a copy filled
# the disk in one full run).
_CI_INSTALLS = shutil.ignore_patterns("triton-*", "*-env")


def _ignore(directory: str, names: list[str]) -> set[str]:
    """``shutil.copytree``'s ignore: the names above anywhere, and ``.ci``'s installed Triton and
    test environments."""
    ignored = set(_IGNORED_NAMES(directory, names))
    if Path(directory).resolve() == (REPO / ".ci").resolve():
        ignored |= set(_CI_INSTALLS(directory, names))
    return ignored


CONFIG = "test-config.yaml"
# A fast focused regression for workflow tests (the default config runs the guide's six files): two
# real tests by node id (the whole contract file took 8.6 s of every workflow run, pytest's start 3 s).
SHORT_REGRESSION = {"tests": ["tests/test_logprob_contract.py::test_auto_on_cpu_takes_the_fused_backend_without_fallback",
                              "tests/test_logprob_contract.py::test_auto_takes_the_eager_backend_where_the_fused_kernel_is_missing"],
                    "pytest_args": ["-x"]}
SMALL_VOCAB = {"real_vocab": 1000, "padded_vocab": 1024, "num_vocab_tiles": 8}


def copy_repo(dest: Path, name: str = "repo") -> Path:
    """A copy of the working tree at ``dest/name`` with an empty ``results/``."""
    repo = dest / name
    shutil.copytree(REPO, repo, ignore=_ignore)
    (repo / "results").mkdir(exist_ok=True)
    return repo


def merged(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``overrides`` as Snakemake merges a ``--configfile`` or ``--config`` into the
    config it has: a mapping into a mapping key by key, anything else replaced (so a test's
    ``regression: {tests: [...]}`` keeps config.yaml's ``regression.pytest_args``)."""
    out = dict(config)
    for key, value in overrides.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def write_config(repo: Path, overrides: dict[str, Any], name: str = CONFIG) -> Path:
    """The repo's ``config.yaml`` with ``overrides`` (:func:`merged`) at ``repo/name``: the config the
    workflow runs with ``--configfile name``."""
    config = merged(yaml.safe_load((repo / "config.yaml").read_text()), overrides)
    path = repo / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_name_of(repo: Path, configfile: str = CONFIG, **overrides: Any) -> str:
    """The run name the workflow gives ``repo``'s ``configfile`` with ``--config`` ``overrides``."""
    from rl_engine.workflow import run_name

    config = merged(yaml.safe_load((repo / "config.yaml").read_text()), yaml.safe_load((repo / configfile).read_text()))
    return run_name(merged(config, overrides), repo)


def env_for(repo: Path, extra: dict[str, str] | None = None, prepend: Path | None = None) -> dict[str, str]:
    """The environment for a run in ``repo``: PYTHONPATH=[prepend:]repo, no inherited fault."""
    env = dict(os.environ)
    env.pop("RL_ENGINE_FAULT", None)
    paths = ([str(prepend)] if prepend else []) + [str(repo), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.update(extra or {})
    return env


# The default profile quiets Snakemake's per-job blocks (``quiet: [rules]``); the tests read them
# (a failed rule's name and wildcards, a dry run's planned files), so they bring them back with
# ``--quiet host`` unless a test looks at the default console itself (``default_console=True``).
JOB_BLOCKS = ("--quiet", "host")


def snakemake_cmd(*args: str, configfile: str = CONFIG, default_console: bool = False) -> list[str]:
    """``args`` (targets, flags) come first: ``--configfile`` and ``--config`` take several values."""
    quiet = () if default_console else JOB_BLOCKS
    return [sys.executable, "-m", "snakemake", *args, *quiet, "--cores", "8", "--configfile", configfile]


def snakemake(repo: Path, *args: str, timeout: float = 900, env: dict[str, str] | None = None,
              configfile: str = CONFIG, default_console: bool = False) -> subprocess.CompletedProcess[str]:
    """``snakemake *args --cores 8 --configfile <configfile>`` in ``repo``. With ``default_console``
    stderr is merged into stdout (the console as a person sees it, in order; ``stderr`` is empty)."""
    cmd = snakemake_cmd(*args, configfile=configfile, default_console=default_console)
    if default_console:
        done = subprocess.run(cmd, cwd=repo, env=env or env_for(repo), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        return subprocess.CompletedProcess(done.args, done.returncode, done.stdout, "")
    return subprocess.run(cmd, cwd=repo, env=env or env_for(repo), capture_output=True, text=True, timeout=timeout)


def verify(repo: Path, archive: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m rl_engine verify <archive> *args`` with the copy's code."""
    return subprocess.run(
        [sys.executable, "-m", "rl_engine", "verify", str(archive), *args],
        cwd=repo, env=env_for(repo), capture_output=True, text=True, timeout=600,
    )


def verify_here(archive: Path, *args: str) -> int:
    """``verify <archive> *args`` in this process (what it prints goes to the test's captured output):
    the verb without a Python start that imports torch again; the workflow's own ``verify_archive`` job
    is the run's verify as a process."""
    from rl_engine.evidence import verify as verb

    return verb.main([str(archive), *args])


def html_report(repo: Path, out: Path, configfile: str = CONFIG) -> tuple[dict[str, Any], str]:
    """``snakemake --report OUT`` in ``repo``; the report's results (file path -> record, its
    ``data_uri`` decoded into ``data``) and its workflow description, read from the HTML."""
    done = subprocess.run([sys.executable, "-m", "snakemake", "--configfile", configfile, "--report", str(out)],
                          cwd=repo, env=env_for(repo), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    html = out.read_text(encoding="utf-8")
    results = json.loads(re.search(r"^\s*var results = (\{.*\});?\s*$", html, re.M).group(1))
    for record in results.values():
        record["data"] = base64.b64decode(record["data_uri"].split("base64,", 1)[1])
    description = json.loads(re.search(r"^\s*var workflow_desc = (\".*\");?\s*$", html, re.M).group(1))
    return results, description


def jobs_run(output: str) -> dict[str, int]:
    """Rule -> job count from snakemake's 'Job stats' table (empty when nothing ran)."""
    counts: dict[str, int] = {}
    match = re.search(r"Job stats:\n(.*?)\n\n", output, re.S)
    if not match:
        return counts
    for line in match.group(1).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("job", "total"):
            counts[parts[0]] = int(parts[1])
    return counts


def archive_of(repo: Path) -> Path:
    found = sorted((repo / "results").glob("*.tar.gz"))
    assert len(found) == 1, found
    return found[0]


__all__ = [
    "CONFIG", "REPO", "SHORT_REGRESSION", "SMALL_VOCAB", "archive_of", "copy_repo", "env_for",
    "jobs_run", "merged", "run_name_of", "snakemake", "snakemake_cmd", "verify", "write_config",
]
