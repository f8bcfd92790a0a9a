"""A campaign run with the fused backend gives the eager backend's fingerprints, every topology.

Real runs: ``plan`` and ``launch`` (torchrun, gloo ranks that each load the compiled kernel)
for TP x CP = 1x1, 2x1, 4x2 with the contiguous layout and 2x2 with zigzag, with backend
``cpu-vocab-parallel-logp-ws2``, of the session's tiny run's case (tests/conftest.py ``tiny_run``:
temperature 0.7); that run is the same case with ``pytorch-vocab-parallel-logp-ws2`` at 1x1 and 2x2,
launched the same way, and is the crosscheck's eager side.
Every report's four fingerprints (logp, LSE, entropy, gradient) equal the eager backend's
single-process replay, and ``crosscheck --against`` passes across the two backends' runs, and
fails when one fingerprint is changed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_engine import cli
from rl_engine.campaign.replay import replay_candidate
from rl_engine.rundir import Run

from _case_argv import case_argv

pytestmark = pytest.mark.slow

EAGER = "pytorch-vocab-parallel-logp-ws2"
FUSED = "cpu-vocab-parallel-logp-ws2"
# the session's tiny run's case (tests/_evidence_run.py TINY_RUN_FLAGS), its backend aside: that run is
# the eager campaign the fused runs are crosschecked against, so no eager launch of its own here
CASE = {"dtype": "bf16", "real_vocab": 1000, "padded_vocab": 1024, "num_vocab_tiles": 8,
        "batch": 2, "seq": 8, "prompt_tokens": 3, "seed": 7, "temperature": 0.7}
# Every rank is a process that imports torch; TP 1-8 shards of the kernel are compared byte for byte
# in-process (tests/test_fused_cpu.py), so these runs cover TP=1/2/4, CP=2 in both layouts and the
# 8-rank topology through the real launcher. The eager campaign is the crosscheck's other side (the
# tiny run); the eager backend's own TP x CP matrix is tests/test_distributed_logprob_comparison.py's.
FIELDS = ("candidate_logp_sha256", "candidate_lse_sha256", "candidate_entropy_sha256",
          "candidate_grad_sha256")


def _flags(backend: str, layout: str) -> list[str]:
    return case_argv(device="cpu", backend=backend, **CASE, cp_layout=layout)


def _campaign(run_dir: Path, backend: str, layout: str, topologies: tuple[str, ...]) -> dict[str, dict]:
    (run_dir / "logs").mkdir(parents=True)
    if len(topologies) == 1:  # a plan of one topology names it alone (crosscheck does not run on it)
        tp, cp = topologies[0].split("x")
        chosen = ["--tp", tp, "--cp", cp]
    else:
        chosen = ["--topologies", ",".join(topologies)]
    assert cli.main(["plan", *_flags(backend, layout), *chosen, "--output", str(run_dir / "plan.json")]) == 0
    reports = {}
    for topology in topologies:
        tp, cp = topology.split("x")
        log = run_dir / "logs" / f"tp{tp}-cp{cp}.log"
        with pytest.MonkeyPatch.context() as env:
            env.delenv("RL_ENGINE_FAULT", raising=False)
            code = cli.main(["launch", "--plan", str(run_dir / "plan.json"), "--tp", tp, "--cp", cp,
                             "--timeout-s", "240", "--log", str(log)])
        assert code == 0, log.read_text(errors="replace")[-3000:] if log.exists() else code
        reports[topology] = json.loads((run_dir / f"tp{tp}-cp{cp}.json").read_text())
    return reports


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_run: Path) -> dict[str, tuple[Path, dict[str, dict]]]:
    base = tmp_path_factory.mktemp("fused-campaign")
    eager = {t: json.loads((tiny_run / "tp{}-cp{}.json".format(*t.split("x"))).read_text()) for t in ("1x1", "2x2")}
    return {
        "fused-contiguous": (base / "fused-contiguous",
                             _campaign(base / "fused-contiguous", FUSED, "contiguous", ("1x1", "2x1", "4x2"))),
        "fused-zigzag": (base / "fused-zigzag", _campaign(base / "fused-zigzag", FUSED, "zigzag", ("2x2",))),
        "eager-contiguous": (tiny_run, eager),  # the session's run: read, never changed
    }


def test_every_topology_and_layout_of_the_fused_campaign_has_the_eager_fingerprints(runs) -> None:
    expected = replay_candidate({**CASE, "backend": EAGER}).fingerprints()
    for name, (_, reports) in runs.items():
        for topology, report in reports.items():
            assert report["passed"] is True, (name, topology, report.get("failures"))
            backend = FUSED if name.startswith("fused") else EAGER
            assert report["requested_backend"] == report["actual_backend"] == backend
            got = {key: report["bitwise_fingerprints"][key] for key in FIELDS}
            assert got == expected, (name, topology)


def test_crosscheck_compares_the_runs_of_two_backends(runs, tmp_path: Path) -> None:
    fused_dir, eager_dir = runs["fused-contiguous"][0], runs["eager-contiguous"][0]
    out = tmp_path / "crosscheck.json"
    assert cli.main(["crosscheck", "--run-dir", str(eager_dir), "--against", str(fused_dir),
                     "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["passed"] is True and result["backend"] == EAGER
    assert result["against"] == [{"run_dir": str(fused_dir), "backend": FUSED,
                                  "reports_compared": 3, "passed": True}]


def test_crosscheck_against_fails_naming_the_run_topology_and_field(runs, tmp_path: Path, capsys) -> None:
    import shutil

    eager_dir = runs["eager-contiguous"][0]
    forged = tmp_path / "forged"
    shutil.copytree(runs["fused-contiguous"][0], forged)
    report_path = forged / "tp4-cp2.json"
    report = json.loads(report_path.read_text())
    report["bitwise_fingerprints"]["candidate_grad_sha256"] = "0" * 64
    report_path.write_text(json.dumps(report))
    out = tmp_path / "crosscheck.json"
    assert cli.main(["crosscheck", "--run-dir", str(eager_dir), "--against", str(forged),
                     "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{forged}:tp4-cp2: bitwise_fingerprints.candidate_grad_sha256:" in err
    result = json.loads(out.read_text())
    assert result["passed"] is False and result["against"][0]["passed"] is False


def test_verify_replays_a_fused_run_with_the_eager_reference_without_the_kernel(
    runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reviewer's machine without the compiled kernel still replays a fused-backend run."""
    from rl_engine.evidence import verify
    from rl_engine.logprob import registry
    from rl_engine.logprob.backends.fused_cpu import fused_cpu

    monkeypatch.setattr(fused_cpu, "kernel_unavailable", lambda: "the compiled module is not built")
    with pytest.raises(registry.BackendUnavailableError):
        registry.dispatch(FUSED, replay_case_contract(), "cpu")
    check = verify.replay(Run.load(runs["fused-zigzag"][0]))
    assert check.passed is True, check.problems
    assert "equals the logp, LSE and entropy bytes and the four fingerprints of all 1" in check.detail


def replay_case_contract():
    from rl_engine.logprob.contract import LogprobContract

    return LogprobContract(real_vocab_size=CASE["real_vocab"], padded_vocab_size=CASE["padded_vocab"],
                           num_vocab_tiles=CASE["num_vocab_tiles"], num_sequences=CASE["batch"],
                           seq_len=CASE["seq"], logits_dtype=CASE["dtype"])
