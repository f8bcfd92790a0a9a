"""The files the focused suite's pytest processes loaded, with their SHA-256 (a pytest plugin).

The regression verb runs pytest with ``-p rl_engine.record.suite_imports`` and the folder ``DIR`` in the
environment variable ``RL_ENGINE_SUITE_IMPORTS_DIR`` (which pytest-xdist's workers inherit).
When a pytest process ends (``pytest_unconfigure``: the main process, and each pytest-xdist worker,
after the session's last hook), this plugin writes ``DIR/imports-<pid>.json``: every file that
process loaded, with its SHA-256 at that moment:

- the ``__file__`` of every module in ``sys.modules``: the package's modules, its compiled kernel
  (an extension module), the tests, every ``conftest.py``, pytest and its plugins, torch's Python;
- every shared object mapped into the process (``/proc/self/maps`` on Linux: torch's libraries,
  the OpenMP runtime, a library loaded by ``ctypes``) and the interpreter itself.

:func:`collect` merges the processes' lists into ``regression.json``'s ``imported``, and a later run
reuses the pass only when every one of these files still has these bytes
(:func:`rl_engine.record.reuse.changed_imports`). What a test's own subprocesses (torchrun ranks,
``python -m rl_engine`` verbs) load is not in it; the regression key's package and checkout
files cover their code.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from rl_engine.record.reuse import file_sha256

PLUGIN = "rl_engine.record.suite_imports"
ENV_DIR = "RL_ENGINE_SUITE_IMPORTS_DIR"
PREFIX = "imports-"
MAPS = Path("/proc/self/maps")
SHARED_OBJECT = re.compile(r"\.so(\.[0-9A-Za-z_]+)*$")


def pytest_unconfigure(config: Any) -> None:
    folder = os.environ.get(ENV_DIR)
    if folder:
        write(Path(folder))


def loaded_files() -> list[str]:
    """The real paths of every file this process loaded (the module docstring's list), sorted."""
    found = {sys.executable}
    for module in list(sys.modules.values()):
        try:
            name = vars(module).get("__file__")
        except TypeError:  # an object in sys.modules without a __dict__
            continue
        if isinstance(name, str):
            found.add(name)
    try:
        maps = MAPS.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
    except OSError:
        maps = []
    for line in maps:
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith("/") and SHARED_OBJECT.search(fields[5]):
            found.add(fields[5])
    return sorted({os.path.realpath(f) for f in found if os.path.isfile(f)})


def write(folder: Path) -> Path:
    """``folder/imports-<pid>.json`` with every loaded file's SHA-256 (written whole, then renamed)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for path in loaded_files():
        try:
            files[path] = file_sha256(path)
        except OSError as exc:
            files[path] = f"unreadable: {type(exc).__name__}"
    target = folder / f"{PREFIX}{os.getpid()}.json"
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "files": files}, sort_keys=True), encoding="utf-8",
                   errors="surrogateescape")
    os.replace(tmp, target)
    return target


def collect(folder: Path) -> list[dict[str, str]] | None:
    """Every process's list merged (``{"path", "sha256"}`` sorted by path; a file two processes saw
    with different bytes appears twice, and so can never be found unchanged); None when no pytest
    process wrote one (pytest stopped before its end, or the plugin was not loaded)."""
    written = sorted(folder.glob(f"{PREFIX}*.json"))
    if not written:
        return None
    pairs: set[tuple[str, str]] = set()
    for path in written:
        data = json.loads(path.read_text(encoding="utf-8", errors="surrogateescape"))
        pairs.update((name, digest) for name, digest in data["files"].items())
    return [{"path": name, "sha256": digest} for name, digest in sorted(pairs)]


__all__ = ["ENV_DIR", "PLUGIN", "collect", "loaded_files", "write"]
