"""One build per test session, whichever xdist worker asks first (for session fixtures).

Not a test module (no ``test_`` prefix); ``tests/conftest.py`` builds the tiny run with it.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def built_once(tmp_path_factory: Any, name: str, build: Callable[[Path], Path]) -> Path:
    """``build(folder)`` once per test session: without xdist in this process's own temporary folder;
    under xdist the first worker builds it and records where, under a lock in the session's folder
    that every worker shares, and the others read what it built. A failed build records nothing (the
    next worker builds it again and fails on its own)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent  # <basetemp>/popen-gwN: the parent is this session's
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process dies
        where = shared / f"{name}.path"
        if where.exists():
            return Path(where.read_text(encoding="utf-8"))
        built = build(tmp_path_factory.mktemp(name))
        where.write_text(str(built), encoding="utf-8")
        return built
