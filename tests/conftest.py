"""Fixtures shared across test modules: one tiny real run and its archive per session.

``tests/test_evidence.py``, ``tests/test_verify.py`` and ``tests/test_gates_archives.py`` each
built the same tiny run (two torchrun topologies and a pytest subprocess) in a module fixture;
they now share :func:`tiny_run` and :func:`tiny_archive`, built once, on first use. Tests must
not change them: a test that edits evidence copies the run (test_evidence's ``run`` fixture) or
rebuilds archive members in memory (the verifier tests' ``Good.entries``).

Under pytest-xdist each worker has its own session fixtures, and the modules that read the tiny run
land on both workers: the first worker to ask builds it (two torchrun topologies, five ranks, and a
pytest) in its temporary folder, under a lock in the folder the workers share, and the other worker
reads the same run (:func:`_once.built_once`). That folder is this session's, so a second copy of the
suite running beside this one builds its own.

The other end-to-end campaigns (top-p, captures, a vLLM rollout) copy the tiny run's
environment and focused-suite files (:func:`_evidence_run.copy_recorded`) instead of running ``env``
(a Python that imports torch) and ``regression`` (a pytest) again: what those record is this checkout,
not the case.
"""

from __future__ import annotations

import os
import sys

# Before anything imports torch (its OpenMP runtime reads this once, when it loads): threads that
# wait at the end of a parallel region sleep instead of spinning. Two pytest workers on two cores,
# each with two intra-op threads, otherwise spin against each other at every barrier: on a loaded
# machine a 16 x 151936 backward took 27.6 s of wall for 0.3 s of work (1.3 s with this). The
# workers, and every process a test starts, inherit it; a value the caller set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

import pytest

from _archive_util import Good, read_archive
from _evidence_run import TINY_RUN_FLAGS, build_run, pack
from _once import built_once

# pytest keeps the test modules it rewrote (for its assert messages) in tests/__pycache__ (ignored by
# git), but not in a Python that may not write bytecode (PYTHONDONTWRITEBYTECODE; this machine's image
# sets it): each worker then rewrote every test module on every run, 8 to 9 s of CPU a worker. The
# processes the tests start keep the setting they inherit.
sys.dont_write_bytecode = False


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete, passing tiny-vocabulary run directory (up to SUMMARY.md), made by the real verbs, of
    a case at temperature 0.7 (:data:`_evidence_run.TINY_RUN_FLAGS`)."""
    return built_once(tmp_path_factory, "tiny-run",
                       lambda base: build_run(base / "rl-engine-test-run", base / "focused-tests", TINY_RUN_FLAGS))


@pytest.fixture(scope="session")
def tiny_archive(tiny_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Good:
    """:func:`tiny_run` packed by the archive verb from the files the workflow's archive rule declares."""
    out = tmp_path_factory.mktemp("tiny-archive") / f"{tiny_run.name}.tar.gz"
    with pytest.MonkeyPatch.context() as env:
        env.delenv("SOURCE_DATE_EPOCH", raising=False)  # the default time, whatever the caller's environment holds
        assert pack(tiny_run, out) == 0
    return read_archive(out, tiny_run.name)


# The full suite runs on two workers, a module to a worker (README: ``-n 2 --dist loadfile``).
# Workers take modules in collection order, so the long ones start first and the short ones fill
# in behind them (longest first: the two workers then end close together); otherwise the Slurm
# module (mostly waiting on the executor's status checks) would start last and run alone at the
# end. Only the order between modules changes: a module's own tests keep their order, and no test
# depends on another module having run. The order after Slurm (CI's) and the op's fresh environment
# (its first build in a checkout) is the modules' summed test time in a full run of 2026-12-07
# (docs/install.md), longest first, down to the modules of about a minute.
LONG_FIRST: tuple[str, ...] = (
    "test_slurm.py", "test_op_install.py", "test_capture_campaign.py", "test_trl_zero3.py", "test_vllm.py",
    "test_portable_arith.py", "test_verify.py", "test_gpu_smoke.py", "test_parity.py", "test_triton_backend.py",
    "test_vocab_parallel_logp.py", "test_gates_workflow.py", "test_provenance.py", "test_trl_grpo.py",
    "test_fused_cpu.py", "test_bench.py", "test_gates_config.py", "test_workflow_signals.py", "test_temperature.py",
    "test_workflow_hostile.py", "test_workflow.py", "test_reuse.py", "test_evidence.py", "test_trainer_compile.py",
    "test_spec_numpy.py", "test_gates_archives.py", "test_fused_campaign.py", "test_triton_campaign.py",
    "test_distributed_logprob_comparison.py", "test_triton_versions.py",
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))  # stable: keeps module order


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist (3.6 and later) reorders the modules by their number of tests before it hands them
    # out, which undoes LONG_FIRST: the Slurm and workflow modules have few tests and would start last.
    config.option.loadscopereorder = False
