"""Fixtures shared across test modules: one tiny real run and its archive per session (issue 19).

``tests/test_evidence.py``, ``tests/test_verify.py`` and ``tests/test_gates_archives.py`` each
built the same tiny run (two torchrun topologies and a pytest subprocess) in a module fixture;
they now share :func:`tiny_run` and :func:`tiny_archive`, built once, on first use. Tests must
not change them: a test that edits evidence copies the run (test_evidence's ``run`` fixture) or
rebuilds archive members in memory (the verifier tests' ``Good.entries``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _archive_util import Good, read_archive
from _evidence_run import build_run, pack


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete, passing tiny-vocabulary run directory (up to SUMMARY.md), made by the real verbs."""
    base = tmp_path_factory.mktemp("tiny-run")
    return build_run(base / "rl-engine-test-run", base / "focused-tests")


@pytest.fixture(scope="session")
def tiny_archive(tiny_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Good:
    """:func:`tiny_run` packed by the archive verb from the files the workflow's archive rule declares."""
    out = tmp_path_factory.mktemp("tiny-archive") / f"{tiny_run.name}.tar.gz"
    assert pack(tiny_run, out) == 0
    return read_archive(out, tiny_run.name)
