"""The TP=1 comparison harness and the drift statistics the campaign reports."""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine import jsonio
from rl_engine.campaign.inputs import make_inputs
from rl_engine.logprob.backends.eager.vocab_parallel import BACKEND_ID
from rl_engine.logprob.comparison import (
    DEFAULT_TOLERANCES,
    ComparisonError,
    compare_single_rank,
    default_tolerance,
    drift_failures,
    drift_stats,
    oracle_drift,
    require_no_fallback,
)
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.registry import BackendUnavailableError, Dispatch, dispatch
from rl_engine.tensorio import fingerprint

SMALL = dict(batch=2, seq=8, prompt_tokens=3, real_vocab=1000, padded_vocab=1024, seed=11, logit_scale=1.0)


def _compare(**overrides: object) -> dict:
    logits, targets, active = make_inputs(SMALL)
    kwargs = dict(real_vocab=1000, num_vocab_tiles=8, dtype="bf16", backend=BACKEND_ID, num_sequences=2)
    kwargs.update(overrides)
    return compare_single_rank(logits, targets, active, **kwargs)


# ----- drift statistics -----------------------------------------------------------------
def test_drift_stats_values_on_a_hand_made_case() -> None:
    reference = torch.tensor([1.0, -2.0, 0.0, 4.0, 10.0])
    candidate = torch.tensor([1.5, -2.0, 0.25, 3.0, 99.0])
    rows = torch.tensor([True, True, True, True, False])  # the huge last diff is not selected
    targets = torch.tensor([7, 8, 9, 10, 11])
    stats = drift_stats(candidate, reference, rows, targets, atol=1.0, rtol=0.0)
    assert stats["count"] == 4
    assert stats["max_abs"] == 1.0
    assert stats["mean_abs"] == pytest.approx((0.5 + 0.0 + 0.25 + 1.0) / 4)
    assert stats["p95_abs"] == 1.0 and stats["p99_abs"] == 1.0  # nearest rank from above
    assert stats["worst_token"] == 3 and stats["worst_target"] == 10
    # reference 0.0 at token 2: relative error divides by a floor, stays finite
    assert math.isfinite(stats["max_rel"]) and stats["max_rel"] > 1e30
    assert stats["passed"] is True  # 1.0 <= atol 1.0
    tighter = drift_stats(candidate, reference, rows, targets, atol=0.999, rtol=0.0)
    assert tighter["passed"] is False
    with_rtol = drift_stats(candidate, reference, rows, targets, atol=0.5, rtol=0.125)
    assert with_rtol["passed"] is True  # token 3: 1.0 <= 0.5 + 0.125 * 4
    assert drift_stats(candidate, reference, rows, targets, atol=0.5, rtol=0.12)["passed"] is False
    jsonio.dumps(stats)  # strict JSON


def test_drift_stats_percentiles_are_observed_values() -> None:
    diffs = torch.arange(1, 101, dtype=torch.float32)  # 1..100
    stats = drift_stats(diffs, torch.zeros(100), torch.ones(100, dtype=torch.bool), torch.zeros(100, dtype=torch.int64), 1e9, 0.0)
    assert stats["p95_abs"] == 96.0 and stats["p99_abs"] == 100.0 and stats["max_abs"] == 100.0
    assert stats["mean_abs"] == pytest.approx(50.5)


def test_drift_stats_no_rows() -> None:
    stats = drift_stats(torch.ones(3), torch.zeros(3), torch.zeros(3, dtype=torch.bool), torch.zeros(3, dtype=torch.int64), 0.0, 0.0)
    assert stats == {
        "count": 0, "max_abs": 0.0, "mean_abs": 0.0, "p95_abs": 0.0, "p99_abs": 0.0, "max_rel": 0.0,
        "worst_token": None, "worst_target": None, "atol": 0.0, "rtol": 0.0, "passed": True,
    }


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_drift_stats_refuses_non_finite_values(bad: float) -> None:
    cand = torch.tensor([0.0, bad])
    with pytest.raises(ComparisonError, match="non-finite value at global token 1"):
        drift_stats(cand, torch.zeros(2), torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.int64), 0.1, 0.0)
    # the same value in an unselected row does not count
    drift_stats(cand, torch.zeros(2), torch.tensor([True, False]), torch.zeros(2, dtype=torch.int64), 0.1, 0.0)


def test_drift_stats_refuses_bad_arguments() -> None:
    ok = (torch.zeros(2), torch.zeros(2), torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ComparisonError, match="reference.shape"):
        drift_stats(ok[0], torch.zeros(3), ok[2], ok[3], 0.1, 0.0)
    with pytest.raises(ComparisonError, match="rows_mask.dtype"):
        drift_stats(ok[0], ok[1], torch.ones(2), ok[3], 0.1, 0.0)
    with pytest.raises(ComparisonError, match="atol"):
        drift_stats(*ok, atol=-1.0, rtol=0.0)
    with pytest.raises(ComparisonError, match="rtol"):
        drift_stats(*ok, atol=0.1, rtol=float("nan"))


def test_default_tolerances() -> None:
    assert DEFAULT_TOLERANCES == {"bf16": (0.05, 0.0), "fp16": (0.005, 0.0), "fp32": (1e-5, 0.0)}
    with pytest.raises(ComparisonError, match="dtype='fp8'"):
        default_tolerance("fp8")


# ----- the TP=1 harness -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_single_rank_comparison_passes_against_both_oracles(dtype: str) -> None:
    result = _compare(dtype=dtype)
    assert result["passed"] is True and result["failures"] == []
    assert result["requested_backend"] == result["actual_backend"] == BACKEND_ID
    assert result["fallback"] is False and result["rejections"] == []
    fp32, fp64 = result["drift"]["fp32_oracle"], result["drift"]["fp64_oracle"]
    assert fp32["lse"]["count"] == 16 and fp32["dlogp"]["count"] == 10  # 2 x (8 - 3) active
    atol = DEFAULT_TOLERANCES[dtype][0]
    for stats in (fp32["lse"], fp32["dlogp"], fp64["lse"], fp64["dlogp"]):
        assert stats["atol"] == atol and stats["passed"] is True
    if dtype != "fp32":
        # the FP64 oracle sees the rounded inputs: it isolates the kernel's error, which is far
        # smaller than the input rounding the FP32 oracle includes
        assert fp64["dlogp"]["max_abs"] < fp32["dlogp"]["max_abs"] / 10
    text = jsonio.dumps(result)
    assert jsonio.loads(text) == result  # strict JSON round trip
    fps = result["bitwise_fingerprints"]
    assert fps["shape"] == [16] and fps["grad_shape"] == [16, 1024]
    assert fps["grad_dtype"] == {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]


def test_single_rank_comparison_is_deterministic_and_input_sensitive() -> None:
    first, again = _compare(), _compare()
    assert first["bitwise_fingerprints"] == again["bitwise_fingerprints"]
    logits, targets, active = make_inputs(SMALL)
    logits[5, 17] += 0.5  # one input changed: the bytes must change
    other = compare_single_rank(logits, targets, active, real_vocab=1000, num_vocab_tiles=8, dtype="bf16",
                                backend=BACKEND_ID, num_sequences=2)
    assert other["bitwise_fingerprints"]["candidate_lse_sha256"] != first["bitwise_fingerprints"]["candidate_lse_sha256"]


def test_tolerance_negative_control_fails_with_named_quantities() -> None:
    result = _compare(atol=1e-12)
    assert result["passed"] is False
    assert any(f.startswith("drift: lse") for f in result["failures"])
    assert any(f.startswith("drift: dlogp") for f in result["failures"])


def test_padding_is_excluded_and_its_inclusion_would_be_caught() -> None:
    logits, targets, active = make_inputs(SMALL)
    result = _compare()
    assert result["drift"]["fp32_oracle"]["lse"]["max_abs"] < 0.05
    # a candidate whose LSE counted the padding columns (value 100) fails the drift check
    wrong_lse = torch.logsumexp(logits.to(torch.bfloat16).float(), dim=-1)
    wrong_logp = torch.where(active, logits.gather(1, targets.unsqueeze(1)).squeeze(1) - wrong_lse, torch.zeros(16))
    drift = oracle_drift(wrong_logp, wrong_lse, logits, targets, active, 1000, "bf16", 0.05, 0.0)
    assert drift["fp32_oracle"]["lse"]["passed"] is False and drift["fp32_oracle"]["lse"]["max_abs"] > 50
    assert len(drift_failures(drift)) == 2


def test_all_inactive_rows() -> None:
    logits, targets, _ = make_inputs(SMALL)
    active = torch.zeros(16, dtype=torch.bool)
    result = compare_single_rank(logits, targets, active, real_vocab=1000, num_vocab_tiles=8, dtype="bf16",
                                 backend=BACKEND_ID, num_sequences=2)
    assert result["passed"] is True
    dlogp = result["drift"]["fp32_oracle"]["dlogp"]
    assert dlogp["count"] == 0 and dlogp["worst_token"] is None
    assert result["drift"]["fp32_oracle"]["lse"]["count"] == 16
    # every logp is exactly +0.0 (bytes, so -0.0 would not do) and the gradient is all zero
    assert result["bitwise_fingerprints"]["candidate_logp_sha256"] == fingerprint(torch.zeros(16))
    assert result["bitwise_fingerprints"]["candidate_grad_sha256"] == fingerprint(torch.zeros(16, 1024, dtype=torch.bfloat16))
    assert fingerprint(torch.zeros(16)) != fingerprint(-torch.zeros(16))


def test_active_ignore_index_is_rejected_and_inactive_one_is_fine() -> None:
    logits, targets, active = make_inputs(SMALL)
    targets = targets.clone()
    first_active = int(active.nonzero()[0, 0])
    inactive = int((~active).nonzero()[0, 0])
    targets[inactive] = -100
    ok = compare_single_rank(logits, targets, active, real_vocab=1000, num_vocab_tiles=8, dtype="bf16",
                             backend=BACKEND_ID, num_sequences=2)
    assert ok["passed"] is True
    targets[first_active] = -100
    with pytest.raises(LogprobContractError, match=r"ignore_index=-100.*mark that row inactive"):
        compare_single_rank(logits, targets, active, real_vocab=1000, num_vocab_tiles=8, dtype="bf16",
                            backend=BACKEND_ID, num_sequences=2)


def test_silent_fallback_is_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    import rl_engine.logprob.comparison as comparison

    def falling_back(requested: str, contract: LogprobContract, device: str) -> Dispatch:
        real = dispatch(BACKEND_ID, contract, device)
        return Dispatch(real.op, requested, BACKEND_ID, True, (("cpu-vocab-parallel-logp-ws2", "unavailable: test"),))

    monkeypatch.setattr(comparison, "dispatch", falling_back)
    with pytest.raises(ComparisonError, match="silent fallback is forbidden"):
        _compare(backend="auto")
    # a mismatch between requested and materialised is refused even without the flag
    op = dispatch(BACKEND_ID, LogprobContract(8, 8, 1, 1, 1), "cpu").op
    with pytest.raises(ComparisonError, match="silent fallback is forbidden"):
        require_no_fallback(Dispatch(op, "cpu-vocab-parallel-logp-ws2", BACKEND_ID, False))
    require_no_fallback(Dispatch(op, BACKEND_ID, BACKEND_ID, False))  # the honest case passes


def test_unavailable_explicit_backend_raises_with_reason() -> None:
    with pytest.raises(BackendUnavailableError, match="backend='cuda-sm90' is not registered"):
        _compare(backend="cuda-sm90")


def test_bad_harness_inputs() -> None:
    logits, targets, active = make_inputs(SMALL)
    with pytest.raises(ComparisonError, match="2-D float32"):
        compare_single_rank(logits.double(), targets, active, real_vocab=1000, num_vocab_tiles=8, dtype="bf16", backend=BACKEND_ID)
    with pytest.raises(ComparisonError, match="3 equal sequences"):
        compare_single_rank(logits, targets, active, real_vocab=1000, num_vocab_tiles=8, dtype="bf16", backend=BACKEND_ID, num_sequences=3)
    with pytest.raises(ComparisonError, match="atol"):
        _compare(atol=float("inf"))
