"""Reuse of the environment capture and the focused suite across runs of the same code.

A new case (another seed, topology list or vocabulary) is a new run directory, so its
``environment`` and ``regression`` jobs run; neither stage reads the case. Their verbs
(``env --reuse-dir``, ``regression --reuse-dir``) therefore look in a cache keyed by what the
stage really depends on, and copy a previous run's files instead of capturing or testing again:

- **environment key**: the SHA-256 of the record ``environment.json`` holds, made by the same
  probe that writes it (:func:`rl_engine.record.environment.probe`): the git commit and status,
  Python, torch and its CUDA build, the GPUs torch sees, the CPU, host, platform, package
  versions, the NVIDIA driver's version and GPUs, and ``nvcc``. A field the probe gains is in the
  key with nothing else to change; a reused ``environment.json`` is this probe's record.
- **regression key** (static, checked first): the same record but its git fields, every installed
  distribution (its metadata directory's name, so its version), the interpreter's environment
  variables that change what the suite computes or collects (:data:`KEY_ENV_PREFIXES`,
  :data:`KEY_ENV_NAMES`), the bytes of every file the suite can read (:func:`suite_files`: the
  package as imported, built objects included; every tracked file and every untracked source
  file of the checkout; the tests' directories; ``conftest.py`` and pytest's configuration files
  above them), the package's and the checkout's location, and the test list and pytest arguments.
- **what the suite loaded** (checked second): the focused run records, in ``regression.json``'s
  ``imported``, every file its pytest processes imported or mapped (modules, extension modules,
  shared libraries: :mod:`rl_engine.record.suite_imports`) with its SHA-256. A cached pass is
  reused only if every one of them still has those bytes (:func:`changed_imports`); otherwise the
  entry is dropped and the suite runs.

Every field is read before the stage would run (the regression key in about a second, plus the
SHA-256 of what the earlier suite loaded). A cached suite is reused only if it passed and its
imports were recorded; a failed or interrupted stage stores nothing. The copies in the run
directory say what they are: ``environment.json`` and ``regression.json`` carry ``reused`` (the
key, the run that captured the files, when, and its commit); the stage's log says so too, and
SUMMARY.md, ``verify``'s table and JSON and the workflow's closing table print it. What a reuse
cannot show is named in docs/workflow.md: the copied ``environment.txt`` holds the commands'
output at the first capture (``nvidia-smi``'s utilisation and temperature included), a file a
test's subprocess loads that the package, the checkout and the pytest processes do not hold is
not seen, and a flaky test runs once per key, not once per run. Delete the cache
(``results/.reuse``) to capture and test again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from rl_engine import jsonio
from rl_engine.record.gitstate import is_source

KEY_VERSION = 2  # bumped when what a key covers changes
REUSED = "reused"
TOOL_TIMEOUT_S = 10.0
PACKAGE = "rl_engine"
# pytest's configuration files: the rootdir's ini file is the first of these above the tests
PYTEST_CONFIG_FILES = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg", "setup.py")
SKIPPED_PARTS = frozenset({"__pycache__", ".pytest_cache", ".git", ".snakemake", "results", "build", "dist"})
SKIPPED_SUFFIXES = (".pyc", ".pyo")
# Environment variables in the regression key: the project's own (fault injection, Triton mode), the
# thread and math libraries' (OpenMP, MKL, OpenBLAS), torch's, CUDA's, NCCL's, gloo's and Triton's
# settings, pytest's (PYTEST_ADDOPTS adds arguments, PYTEST_PLUGINS plugins), Python's (PYTHONPATH
# chooses what is imported, PYTHONHASHSEED orders sets), the dynamic loader's (LD_PRELOAD,
# LD_LIBRARY_PATH) and malloc's; by name: PATH (which tools the tests find), torchrun's rendezvous
# variables and the locale. Others (HOME, TERM, SSH_*, SLURM_* job ids) are left out.
KEY_ENV_PREFIXES = ("RL_ENGINE_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "GOTO_", "VECLIB_", "NUMEXPR_",
                    "TORCH", "PYTORCH_", "CUDA_", "CUBLAS", "CUDNN_", "NCCL_", "NVIDIA_", "TRITON_", "GLOO_",
                    "PYTEST_", "PYTHON", "LD_", "MALLOC_")
KEY_ENV_NAMES = frozenset({"PATH", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                           "LOCAL_WORLD_SIZE", "LANG", "LC_ALL", "LC_CTYPE", "LC_NUMERIC", "TZ"})
# set by pytest in the process that calls the verb in-process (a test), and by an outer regression verb
# for its pytest (rl_engine.record.suite_imports, a temporary directory): not inputs of the suite
KEY_ENV_IGNORED = frozenset({"PYTEST_CURRENT_TEST", "RL_ENGINE_SUITE_IMPORTS_DIR"})


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def without_reused(record: Any) -> Any:
    """A stage's record without its ``reused`` field (what a fresh capture writes)."""
    return {k: v for k, v in record.items() if k != REUSED} if isinstance(record, dict) else record


def environment_key(record: Mapping[str, Any]) -> str:
    """The key of an environment capture: its whole record (``environment.json`` but ``reused``)."""
    return _digest({"stage": "environment", "key_version": KEY_VERSION, "record": without_reused(dict(record))})


def key_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables in the regression key (the comment above :data:`KEY_ENV_PREFIXES`)."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in sorted(environ.items())
            if name not in KEY_ENV_IGNORED and (name in KEY_ENV_NAMES or name.startswith(KEY_ENV_PREFIXES))}


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


def package_dir() -> Path:
    """The directory of the ``rl_engine`` this interpreter imports (the suite's pytest, started with
    the same interpreter, environment and working directory, imports the same one)."""
    import rl_engine

    return Path(rl_engine.__file__).resolve().parent


def _walk(root: Path) -> list[Path]:
    """Every file under ``root`` but caches, run outputs and hidden directories."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_PARTS and not d.startswith(".")
                         and not d.endswith(".egg-info"))
        found += [Path(folder) / f for f in files if not f.endswith(SKIPPED_SUFFIXES)]
    return found


def _git_listing(repo: Path, *args: str) -> list[str] | None:
    try:
        done = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", *args], capture_output=True,
                              timeout=TOOL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [os.fsdecode(p) for p in done.stdout.split(b"\0") if p]


def checkout_files(repo: Path) -> tuple[str, list[Path]]:
    """The checkout's files the suite can read: in a git checkout every tracked file and every
    untracked, not ignored source file (:func:`rl_engine.record.gitstate.is_source`; untracked data
    such as a capture or a config copy is left out, as it leaves the tree clean); elsewhere every
    source file under ``repo`` (:func:`_walk`'s)."""
    tracked = _git_listing(repo, "--cached")
    untracked = _git_listing(repo, "--others", "--exclude-standard") if tracked is not None else None
    if tracked is None or untracked is None:
        return "walk", [p for p in _walk(repo) if is_source(p.relative_to(repo).as_posix())]
    return "git", [repo / p for p in tracked + [u for u in untracked if is_source(u)]]


def pytest_files(repo: Path, tests: list[str]) -> list[Path]:
    """What pytest reads besides the package: every file under each test's directory, the
    ``conftest.py`` of every directory above them and pytest's configuration files there and above
    the working directory (a root ``conftest.py``, ``pytest.ini``, ``pyproject.toml``, ...)."""
    folders = {(repo / t.split("::", 1)[0]).resolve().parent for t in tests}
    found: list[Path] = []
    for folder in sorted(folders):
        found += _walk(folder)
    for folder in sorted({a for f in folders | {repo.resolve()} for a in (f, *f.parents)}):
        found += [folder / n for n in ("conftest.py", *PYTEST_CONFIG_FILES) if (folder / n).is_file()]
    return found


def suite_files(repo: Path, tests: list[str], package: Path | None = None) -> dict[str, Path]:
    """Every file the focused suite can read, by label (its path relative to the checkout, else
    ``<package>/...`` relative to the package, else absolute): the package as imported, every file
    under it but ``__pycache__`` (built kernels included), :func:`checkout_files` and :func:`pytest_files`."""
    repo, package = repo.resolve(), (package or package_dir()).resolve()
    files: dict[str, Path] = {}
    for path in [*_walk_all(package), *checkout_files(repo)[1], *pytest_files(repo, tests)]:
        if not path.is_file():
            continue  # a tracked file deleted in the working tree: the suite cannot read it
        real = path.resolve()
        if real.is_relative_to(repo):
            label = real.relative_to(repo).as_posix()
        elif real.is_relative_to(package):
            label = f"<package>/{real.relative_to(package).as_posix()}"
        else:
            label = str(real)
        files[label] = real
    return dict(sorted(files.items()))


def _walk_all(root: Path) -> list[Path]:
    """Every file under the package but its bytecode caches (hidden files and built objects included)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found += [Path(folder) / f for f in files if not f.endswith(SKIPPED_SUFFIXES)]
    return found


def regression_key(repo: str | Path, tests: list[str], pytest_args: list[str], record: Mapping[str, Any],
                   package: Path | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The static regression key (the module docstring's list); ``record``: the environment probe's."""
    repo = Path(repo).resolve()
    package = (package or package_dir()).resolve()
    listing = checkout_files(repo)[0]
    files = [[label, file_sha256(path)] for label, path in suite_files(repo, tests, package).items()]
    facts = {k: v for k, v in without_reused(dict(record)).items() if k != "git"}
    return _digest({"stage": "regression", "key_version": KEY_VERSION, "environment": facts,
                    "distributions": installed_distributions(), "environ": key_environ(environ),
                    "repo": str(repo), "package": str(package), "listing": listing, "files": files,
                    "tests": list(tests), "pytest_args": list(pytest_args)})


def changed_imports(imported: Any) -> list[str]:
    """Why the files an earlier suite loaded (``regression.json``'s ``imported``) are not all the same
    bytes now, one line per file (empty: every one is unchanged); a record without them is one line."""
    if not isinstance(imported, list) or not imported:
        return ["the earlier run recorded no list of the files its suite loaded"]
    changed = []
    for item in imported:
        path, recorded = (item.get("path"), item.get("sha256")) if isinstance(item, dict) else (None, None)
        if not isinstance(path, str) or not isinstance(recorded, str):
            changed.append(f"an unreadable entry {item!r}")
            continue
        try:
            now = file_sha256(path)
        except OSError as exc:
            changed.append(f"{path}: gone ({type(exc).__name__})")
            continue
        if now != recorded:
            changed.append(f"{path}: SHA-256 {recorded[:12]}... when it ran, {now[:12]}... now")
    return changed


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


def discard(reuse_dir: Path, stage: str, key: str) -> None:
    """Remove a cache entry that must not be reused (moved aside first, so a reader never sees half of it)."""
    folder = entry(reuse_dir, stage, key)
    aside = reuse_dir / f".discarded-{stage}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.rename(folder, aside)
    except OSError:
        return  # already gone (another run discarded it)
    shutil.rmtree(aside, ignore_errors=True)


def store(reuse_dir: Path | None, stage: str, key: str, files: dict[str, Path], run: str,
          commit: str | None) -> None:
    """Put ``files`` (name -> path) in the cache under ``key`` (atomically: a directory renamed into
    place; a concurrent run that stored the same key first wins, and this one's copy is dropped);
    ``run`` and ``commit``: the run directory's name and the checkout's commit, for ``reused``."""
    if reuse_dir is None:
        return
    reuse_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{stage}-", dir=reuse_dir))
    try:
        for name, path in files.items():
            shutil.copyfile(path, tmp / name)
        origin = {"key": key, "stage": stage, "run": run, "commit": commit,
                  "captured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        jsonio.atomic_write_text(tmp / "origin.json", json.dumps(origin, sort_keys=True) + "\n")
        try:
            os.rename(tmp, entry(reuse_dir, stage, key))
        except OSError:  # already stored by another run
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def reused_record(origin: dict[str, Any]) -> dict[str, Any]:
    """The ``reused`` field of a copied environment.json or regression.json."""
    return {"key": origin["key"], "from_run": origin["run"], "captured_utc": origin["captured_utc"],
            "from_commit": origin.get("commit")}


def reused_text(record: Any) -> str:
    """``run <name> (captured <UTC>, commit <short>)``: where a reused stage's files came from."""
    if not isinstance(record, dict):
        return f"an unreadable record {record!r}"
    commit = record.get("from_commit")
    return (f"run {record.get('from_run')} (captured {record.get('captured_utc')}, "
            f"{'commit ' + str(commit)[:12] if commit else 'no git commit'})")


__all__ = ["KEY_ENV_NAMES", "KEY_ENV_PREFIXES", "REUSED", "changed_imports", "checkout_files", "discard", "entry",
           "environment_key", "file_sha256", "installed_distributions", "key_environ", "lookup", "package_dir",
           "pytest_files", "regression_key", "reused_record", "reused_text", "store", "suite_files",
           "without_reused"]
