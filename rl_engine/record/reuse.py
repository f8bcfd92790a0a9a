"""Reuse of the environment capture and the focused suite across runs of the same code.

A new case (another seed, topology list or vocabulary) is a new run directory, so its
``environment`` and ``regression`` jobs run; neither stage reads the case. Their verbs
(``env --reuse-dir``, ``regression --reuse-dir``) therefore look in a cache keyed by what the
stage really depends on, and copy a previous run's files instead of capturing or testing again:

- **environment key**: the git commit and the full ``git status`` listing (so the recorded dirty
  flag, counts and data-file list are this tree's), the Python executable and version, the
  platform, the host name, the CPU model and count, every installed distribution with its version
  (torch, its CUDA build and every library are among them), ``nvidia-smi -L`` (the GPUs and their
  UUIDs) and ``CUDA_VISIBLE_DEVICES``, and which of ``nvidia-smi``/``nvcc`` are installed.
- **regression key**: the environment key's fields but git's (the files below are what the
  suite runs, whatever the commit or the untracked data files), the bytes of every file the suite can read
  (``rl_engine/``, ``tests/``, ``pyproject.toml``, ``setup.py``; ``__pycache__`` and built
  kernels aside), and the test list and pytest arguments.

Every field is read in well under a second without importing torch, before the stage would run.
A cached suite is reused only if it passed; a failed or interrupted stage stores nothing. The
copies in the run directory say what they are: ``environment.json`` and ``regression.json`` carry
``reused`` (the key, the run that captured the files and when); the stage's log says so too, and
SUMMARY.md prints it. What a reuse cannot show is named in docs/workflow.md: the copied
``environment.txt`` holds the commands' output at the first capture (``nvidia-smi``'s utilisation
and temperature included), and a flaky test runs once per key, not once per run. Delete the cache
(``results/.reuse``) to capture and test again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rl_engine import jsonio

KEY_VERSION = 1  # bumped when what a key covers changes
SUITE_ROOTS = ("rl_engine", "tests")
SUITE_FILES = ("pyproject.toml", "setup.py")
SKIPPED_PARTS = frozenset({"__pycache__", ".pytest_cache"})
SKIPPED_SUFFIXES = (".so", ".pyd", ".pyc")
TOOL_TIMEOUT_S = 10.0
REUSED = "reused"


def _run(argv: list[str], cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, cwd=cwd, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {type(exc).__name__}"
    return f"exit {done.returncode}\n{done.stdout}"


def _cpu() -> tuple[str, int]:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip(), os.cpu_count() or 0
    except OSError:
        pass
    return platform.processor() or platform.machine(), os.cpu_count() or 0


def environment_facts(repo: Path) -> dict[str, Any]:
    """What the environment capture depends on (the module docstring's list)."""
    distributions = installed_distributions()
    nvidia = shutil.which("nvidia-smi")
    return {
        "key_version": KEY_VERSION,
        "git_head": _run(["git", "-C", str(repo), "rev-parse", "HEAD"]),
        "git_status": _run(["git", "-C", str(repo), "status", "--porcelain=v1", "-z", "--untracked-files=all"]),
        "git_branch": _run(["git", "-C", str(repo), "branch", "--show-current"]),
        "python": [sys.executable, sys.version, platform.python_implementation()],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu": _cpu(),
        "distributions": distributions,
        "gpus": _run([nvidia, "-L"]) if nvidia else None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "tools": [nvidia is not None, shutil.which("nvcc") is not None],
    }


def installed_distributions() -> list[str]:
    """Every installed distribution as its metadata directory's name (``<name>-<version>.dist-info``),
    on each ``sys.path`` entry: a directory listing, not a metadata parse (1.9 s for 173 packages)."""
    found = set()
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        found.update(f"{entry}/{n}" for n in names if n.endswith((".dist-info", ".egg-info")))
    return sorted(found)


def suite_files(repo: Path) -> list[Path]:
    """Every file the focused suite can read: the package, the tests and the packaging files."""
    found = [p for root in SUITE_ROOTS for p in (repo / root).rglob("*")
             if p.is_file() and not SKIPPED_PARTS & set(p.parts) and not p.name.endswith(SKIPPED_SUFFIXES)]
    found += [repo / name for name in SUITE_FILES if (repo / name).is_file()]
    return sorted(found)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


def environment_key(repo: str | Path) -> str:
    return _digest({"stage": "environment", "facts": environment_facts(Path(repo).resolve())})


def regression_key(repo: str | Path, tests: list[str], pytest_args: list[str]) -> str:
    repo = Path(repo).resolve()
    files = [[str(p.relative_to(repo)), hashlib.sha256(p.read_bytes()).hexdigest()] for p in suite_files(repo)]
    facts = {k: v for k, v in environment_facts(repo).items() if not k.startswith("git_")}
    return _digest({"stage": "regression", "environment": facts, "files": files,
                    "tests": list(tests), "pytest_args": list(pytest_args)})


def entry(reuse_dir: Path, stage: str, key: str) -> Path:
    return reuse_dir / f"{stage}-{key[:32]}"


def lookup(reuse_dir: Path | None, stage: str, key: str, names: list[str]) -> dict[str, Any] | None:
    """The cache entry's record (``origin.json``) when every file of ``names`` is there; else None."""
    if reuse_dir is None:
        return None
    folder = entry(reuse_dir, stage, key)
    try:
        origin = jsonio.load(folder / "origin.json")
    except (OSError, ValueError):
        return None
    if not isinstance(origin, dict) or origin.get("key") != key or not all((folder / n).is_file() for n in names):
        return None
    return origin


def store(reuse_dir: Path | None, stage: str, key: str, files: dict[str, Path], run: str) -> None:
    """Put ``files`` (name -> path) in the cache under ``key`` (atomically: a directory renamed into
    place; a concurrent run that stored the same key first wins, and this one's copy is dropped)."""
    if reuse_dir is None:
        return
    reuse_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{stage}-", dir=reuse_dir))
    try:
        for name, path in files.items():
            shutil.copyfile(path, tmp / name)
        origin = {"key": key, "stage": stage, "run": run,
                  "captured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        jsonio.atomic_write_text(tmp / "origin.json", json.dumps(origin, sort_keys=True) + "\n")
        try:
            os.rename(tmp, entry(reuse_dir, stage, key))
        except OSError:  # already stored by another run
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def reused_record(origin: dict[str, Any]) -> dict[str, str]:
    """The ``reused`` field of a copied environment.json or regression.json."""
    return {"key": origin["key"], "from_run": origin["run"], "captured_utc": origin["captured_utc"]}


__all__ = ["REUSED", "entry", "environment_facts", "environment_key", "lookup", "regression_key", "reused_record",
           "store", "suite_files"]
