"""Processed logprobs in the campaign: the case carries ``top_k`` / ``top_p`` /
``min_p``; reports, the reviewer's replays (eager and NumPy) and ``verify --recompute`` use them;
the default case's hash, id and fingerprints are unchanged; a ``top_p: 0.9`` campaign runs to
VERIFIED (slow: the real workflow)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rl_engine import schemas
from rl_engine.campaign import plan as planmod
from rl_engine.campaign.case import Case, CaseError, case_problems
from rl_engine.campaign.run import build_report, compute_rank
from rl_engine.tables import EAGER_BACKEND
from rl_engine.tensorio import fingerprint

CASE = dict(device="cpu", dtype="bf16", backend=EAGER_BACKEND, real_vocab=1000, padded_vocab=1024, num_vocab_tiles=8,
            batch=2, seq=16, prompt_tokens=8, seed=123, cp_layout="contiguous", logit_scale=1.0, threads_per_rank=1)
CPU = torch.device("cpu")


def _case(**overrides: Any) -> Case:
    return Case.create(**{**CASE, **overrides})


def _report(case: Case) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    results = [compute_rank(case, 1, 1, 0, 0, 0, None, CPU)]
    output = Path("/nonexistent") / "tp1-cp1.json"
    timings = {"setup_s": 0.0, "forward_s": 0.0, "backward_s": 0.0, "total_s": 0.0}
    report, tensors = build_report(case, 1, 1, output, planmod.launch_command(output.with_name("plan.json"), 1, 1),
                                   results, None, timings)
    return report, tensors


def test_parameters_off_are_the_case_without_them() -> None:
    base = _case()
    off = _case(top_k=0, top_p=1.0, min_p=0.0)
    assert off.to_dict() == base.to_dict() and off.case_id == base.case_id
    assert off.run_hash([(1, 1), (2, 1)], [], []) == base.run_hash([(1, 1), (2, 1)], [], [])
    assert "top_p" not in base.to_dict() and base.op_sampling(4) == {}


def test_a_processed_case_is_its_own_case_and_replays_from_the_evidence() -> None:
    from rl_engine.arith.portable import SPEC_VERSION
    from rl_engine.campaign.replay import replay_candidate, replay_numpy

    case = _case(top_p=0.9, top_k=50, min_p=0.01, temperature=0.7)
    assert case.case_id.endswith("-temp0.7-topk50-topp0.9-minp0.01")
    report, tensors = _report(case)
    assert schemas.errors(report, "report") == [] and report["passed"] is True, report["failures"]
    assert report["case"]["top_p"] == 0.9 and report["case"]["top_k"] == 50
    assert bool(torch.isneginf(tensors["logp"]).any())  # some sampled targets fall outside the kept set
    assert report["drift"]["fp64_oracle"]["dlogp"]["max_abs"] <= 1e-6
    replayed = replay_candidate(case.to_dict(), spec=SPEC_VERSION)
    by_numpy = replay_numpy(case.to_dict(), SPEC_VERSION)
    for name in ("logp", "lse", "entropy"):
        assert fingerprint(replayed.tensors[name]) == fingerprint(tensors[name]) == fingerprint(by_numpy.tensors[name])
    assert fingerprint(replayed.grad) == fingerprint(by_numpy.grad) == report["bitwise_fingerprints"]["candidate_grad_sha256"]
    raw, _ = _report(_case(temperature=0.7))
    assert raw["bitwise_fingerprints"]["candidate_lse_sha256"] != report["bitwise_fingerprints"]["candidate_lse_sha256"]


@pytest.mark.parametrize("field, value, match", [
    ("top_k", -1, "vLLM's 'off'.*use top_k: 0"),
    ("top_k", 2.5, "top_k=2.5 must be an integer"),
    ("top_p", 0.0, r"top_p=0.0 .* must lie in \(0, 1\]"),
    ("top_p", 1.5, "top_p"),
    ("min_p", -0.5, r"min_p=-0.5 .* must lie in \[0, 1\]"),
    ("min_p", float("nan"), "min_p=nan must be a finite number"),
])
def test_bad_sampling_parameters_are_refused_naming_field_value_and_fix(field: str, value: Any, match: str) -> None:
    assert [f for f, _ in case_problems({field: value})] == [field]
    with pytest.raises(CaseError, match=match):
        _case(**{field: value})


def test_the_schemas_take_the_parameters_only_when_on() -> None:
    report, _ = _report(_case(top_k=3))
    assert schemas.errors(report, "report") == []
    report["case"]["top_k"] = 0  # a case holds a parameter only when it is on
    assert schemas.errors(report, "report") != []


@pytest.mark.slow  # two topologies and the real verbs end to end
def test_a_top_p_campaign_runs_to_verified_and_passes_verify_recompute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str],
                                                                        tiny_run: Path) -> None:
    """The tiny evidence run's case with ``--top-p 0.9`` (1x1 and 2x2: the ranks' runner on forked gloo
    processes; the ``launch`` verb's torchrun of this case without ``top_p`` is the tiny run's) passes,
    its archive is VERIFIED with ``--recompute``: the inputs, the processed oracle drift and the
    candidate replayed from the case's ``top_p``."""
    from rl_engine import jsonio

    from _archive_util import make_sandbox, run_verify
    from _evidence_run import CASE_FLAGS, build_run, pack

    run = build_run(tmp_path / "rl-engine-test-run", tmp_path / "focused", [*CASE_FLAGS, "--top-p", "0.9"],
                    recorded_from=tiny_run, forked=True)  # the session's environment and focused-suite capture
    report = jsonio.load(run / "tp2-cp2.json")
    assert report["case"]["top_p"] == 0.9 and report["passed"], report["failures"]
    assert 0 < report["drift"]["fp32_oracle"]["dlogp"]["count"] < 10  # some of the 10 active targets dropped
    one = jsonio.load(run / "tp1-cp1.json")
    assert one["bitwise_fingerprints"] == report["bitwise_fingerprints"]
    archived = tmp_path / "out" / f"{run.name}.tar.gz"
    assert pack(run, archived) == 0
    capsys.readouterr()
    (tmp_path / "box").mkdir()
    code, text, result = run_verify(archived, make_sandbox(tmp_path / "box", monkeypatch), capsys, "--recompute")
    assert code == 0 and "VERIFIED" in text, text
    rows = {row["name"]: row["status"] for row in result["checks"]}
    for row in ("report acceptance", "inputs regenerated", "oracle drift recomputed", "candidate replayed"):
        assert rows[row] == "PASS", (row, result)
