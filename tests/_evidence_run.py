"""Real evidence for the evidence and verifier tests: a tiny-vocabulary run built by the CLI.

Not a test module (no ``test_`` prefix); ``tests/test_evidence.py`` and ``tests/test_verify.py``
import it. Everything here runs the real verbs: ``case``, ``plan``, ``launch`` (torchrun with gloo
ranks), ``env``, ``regression`` (a real pytest subprocess), ``validate``, ``crosscheck``,
``summary`` and ``archive``. :func:`pack` archives a run from the file list the workflow's
``archive`` rule declares (:func:`declared_files`), as the rule does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rl_engine import cli, schemas
from rl_engine.campaign import plan
from rl_engine.campaign.case import case_document

from _case_argv import case_argv

# real 1000 < padded 1024 (so padding columns exist), 8 tiles, 16 tokens of which 10 active
CASE_FLAGS = case_argv(device="cpu", dtype="bf16", backend="pytorch-vocab-parallel-logp-ws2", real_vocab=1000,
                       padded_vocab=1024, num_vocab_tiles=8, batch=2, seq=8, prompt_tokens=3, seed=7)
# The session's tiny run (conftest's ``tiny_run``) is that case at temperature 0.7: every verifier test
# on it then replays a case whose oracle drift, candidate and inputs depend on the temperature (a
# verify that left it out failed "drift.fp32_oracle.lse.passed: reported True, recomputed False").
TINY_RUN_FLAGS = [*CASE_FLAGS, "--temperature", "0.7"]
TOPOLOGIES = ("1x1", "2x2")  # CP=2 and TP=2 against the single-rank reference
TINY_TESTS = '''
import pytest

def test_passes():
    assert sum([1, 2]) == 3

@pytest.mark.skip(reason="demonstrates a recorded skip")
def test_skipped():
    pass
'''
PYTEST_ARGS = ["--pytest-arg=-p", "--pytest-arg=no:cacheprovider"]


def launch(run_dir: Path, topology: str, fault: str | None = None) -> int:
    """Run one planned topology with the real ``launch`` verb, in this process (its torchrun and ranks
    are the processes), under ``RL_ENGINE_FAULT=fault`` (none when None); return its exit code."""
    import pytest

    tp, cp = topology.split("x")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("RL_ENGINE_FAULT", raising=False)
        if fault:
            env.setenv("RL_ENGINE_FAULT", fault)
        return cli.main(["launch", "--plan", str(run_dir / "plan.json"), "--tp", tp, "--cp", cp,
                         "--timeout-s", "180", "--log", str(run_dir / "logs" / f"tp{tp}-cp{cp}.log")])


def logs(run_dir: Path) -> str:
    """Every log of a run, for an assertion message."""
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((run_dir / "logs").glob("*")))


RECORDED = ("environment.json", "environment.txt", "regression.json", "pytest-focused.log", "pytest-junit.xml")


def copy_recorded(source: Path, run_dir: Path) -> None:
    """The ``env`` and ``regression`` verbs' files (:data:`RECORDED`) of the run ``source`` copied into
    ``run_dir``: what they record (this checkout, a one-test suite) is not the case's, so a test whose
    claim is about the campaign shares the session's one capture (the ``env`` verb alone runs a Python
    that imports torch, and the suite is a pytest process)."""
    for name in RECORDED:
        shutil.copy(source / name, run_dir / name)


def run_rank(rank: int, plan: str, tp: int, cp: int) -> int:
    """One rank of ``tp x cp`` of ``plan``: the runner a torchrun rank calls (``run_topology``)."""
    from rl_engine.campaign.run import run_topology

    return run_topology(plan, tp, cp)


def run_forked(plan: Path, topology: str) -> None:
    """Every rank of ``topology`` (``"<tp>x<cp>"``) of ``plan`` as :func:`run_rank`, on gloo processes forked
    from one that imported torch (tests/_multiproc.py), not the ``launch`` verb's torchrun (a process that
    imports torch per rank, and a topology log); asserts each rank's success."""
    from _multiproc import run_workers

    tp, cp = (int(x) for x in topology.split("x"))
    assert run_workers(run_rank, tp * cp, str(plan), tp, cp, timeout_s=120) == [0] * (tp * cp), topology


def build_run(run_dir: Path, tests_dir: Path, case_flags: list[str] = CASE_FLAGS,
              recorded_from: Path | None = None, forked: bool = False) -> Path:
    """A complete, passing run directory (up to SUMMARY.md), like the workflow makes, of the case
    ``case_flags`` (``plan``'s flags) over :data:`TOPOLOGIES`. With ``recorded_from`` (a run this
    function built) its environment and regression files are copied (:func:`copy_recorded`) instead
    of running ``env`` and ``regression`` again. ``forked``: each topology's ranks are the runner a
    torchrun rank calls, on gloo processes forked from one that imported torch (tests/_multiproc.py),
    not the ``launch`` verb's torchrun (a process importing torch per rank, and a topology log): for a
    case whose claim is the numbers, the launch of this case's kind being another run's (the tiny run's)."""
    (run_dir / "logs").mkdir(parents=True)
    args = plan.build_parser().parse_args([*case_flags, "--topologies", ",".join(TOPOLOGIES), "--output", "-"])
    document = case_document(*plan.case_from_args(args))
    assert cli.main(["case", "--json", json.dumps(document), "--output", str(run_dir / "case.json")]) == 0
    assert cli.main(["plan", "--case", str(run_dir / "case.json"), "--output", str(run_dir / "plan.json")]) == 0
    for topology in TOPOLOGIES:
        if forked:
            run_forked(run_dir / "plan.json", topology)
            continue
        code = launch(run_dir, topology)
        assert code == 0, logs(run_dir)
    if recorded_from is not None:
        copy_recorded(recorded_from, run_dir)
    else:
        assert cli.main(["env", "--output-dir", str(run_dir), "--repo", str(Path(__file__).resolve().parent.parent)]) == 0
        tests_dir.mkdir(parents=True, exist_ok=True)
        tiny = tests_dir / "test_tiny_focused.py"
        tiny.write_text(TINY_TESTS, encoding="utf-8")
        assert cli.main(["regression", "--output-dir", str(run_dir), "--tests", str(tiny), *PYTEST_ARGS]) == 0
    assert cli.main(["validate", "--run-dir", str(run_dir), "--output", str(run_dir / "validation.json")]) == 0
    assert cli.main(["crosscheck", "--run-dir", str(run_dir), "--output", str(run_dir / "crosscheck.json")]) == 0
    assert cli.main(["summary", "--run-dir", str(run_dir), "--output", str(run_dir / "SUMMARY.md")]) == 0
    return run_dir


def declared_files(run_dir: Path, topologies: tuple[str, ...] = TOPOLOGIES) -> list[Path]:
    """The run's files that workflow/rules/archive.smk declares as the archive's inputs: environment,
    regression with its log and JUnit XML, case, plan, every report and tensor, the gate results,
    SUMMARY.md and the logs (here the topologies' only: the other verbs ran in-process)."""
    labels = [f"tp{t.split('x')[0]}-cp{t.split('x')[1]}" for t in topologies]
    names = ["environment.json", "environment.txt", "regression.json", "pytest-focused.log", "pytest-junit.xml",
             "case.json", "plan.json", *(f"{label}{suffix}" for label in labels
                            for suffix in (".json", ".logp.f32", ".lse.f32", ".entropy.f32")),
             "validation.json", "crosscheck.json", "SUMMARY.md"]
    return [run_dir / name for name in names] + sorted((run_dir / "logs").glob("*.log"))


def schema_files() -> list[Path]:
    return sorted(schemas.repo_schema_dir().glob("*.schema.json"))


def spec_file() -> Path:
    """The arithmetic specification the archive packs (the workflow's archive rule passes it)."""
    return Path(__file__).resolve().parents[1] / "docs" / "arithmetic.md"


def workflow_files(repo: Path | None = None) -> list[Path]:
    """The workflow's definition the archive packs (the archive rule passes it): the Snakefile and its rules."""
    base = (repo or Path(__file__).resolve().parents[1]) / "workflow"
    return [base / "Snakefile", *sorted((base / "rules").glob("*.smk"))]


def archive_argv(run_dir: Path, output: Path, files: list[Path] | None = None) -> list[str]:
    """The archive verb's arguments for ``files`` of ``run_dir`` (default: :func:`declared_files`), with the
    checkout's specification, workflow and schemas: what the workflow's archive rule gives it."""
    given = declared_files(run_dir) if files is None else files
    return ["archive", "--run-dir", str(run_dir), "--output", str(output), "--spec", str(spec_file()),
            "--workflow", *map(str, workflow_files()), "--schemas", *map(str, schema_files()), "--files", *map(str, given)]


def pack(run_dir: Path, output: Path, files: list[Path] | None = None) -> int:
    """``python -m rl_engine archive`` of ``files`` (default: :func:`declared_files`), in-process."""
    return cli.main(archive_argv(run_dir, output, files))
