"""Candidate against oracle: drift statistics, acceptance and the TP=1 comparison harness.

Drift statistics (:func:`drift_stats`) compare a candidate tensor with a reference over a
set of rows: max, mean, p95 and p99 of the absolute difference, the worst row's global
token index and target, and the largest relative difference. Everything is finite:
differences are taken in FP64, and the relative difference divides by
``max(|reference|, REL_FLOOR)`` so an exact-zero reference cannot produce an infinity.
Percentiles are nearest-rank from above (``torch.quantile(..., interpolation="higher")``):
each is a difference that really occurred. A row passes when
``|candidate - reference| <= atol + rtol * |reference|``.

:func:`oracle_drift` gives the report's ``drift``: LSE over all rows and the selected
logprob ("dlogp") over active rows, against the FP32 oracle (the guide's reference, on the
unrounded FP32 logits) and the FP64 oracle (on the dtype-rounded logits). Only the FP32
statistics gate acceptance, as in the guide; the FP64 ones separate the kernel's own error
from the rounding of its inputs and are recorded with their own ``passed`` for diagnosis.

:func:`compare_single_rank` is the TP=1 harness: explicit dispatch (a fallback is an
error), candidate forward and backward, both oracles, fingerprints, a strict-JSON dict.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.logprob.contract import LOGITS_DTYPES, LogprobContract
from rl_engine.logprob.oracle import fp32_oracle, fp64_oracle
from rl_engine.logprob.registry import Dispatch, dispatch
from rl_engine.tables import DEFAULT_TOLERANCES, GATING_ORACLE
from rl_engine.tensorio import DTYPE_NAMES, fingerprint
from rl_engine.validators import real_problem

REL_FLOOR = float(torch.finfo(torch.float32).tiny)


class ComparisonError(ValueError):
    """A comparison that cannot be made or reported honestly (e.g. a backend fell back)."""


def default_tolerance(dtype: str) -> tuple[float, float]:
    """``(atol, rtol)`` for a logits dtype: bf16 0.05, fp16 0.005, fp32 1e-5; rtol 0."""
    if dtype not in DEFAULT_TOLERANCES:
        raise ComparisonError(f"dtype={dtype!r} has no default tolerance; use one of {list(DEFAULT_TOLERANCES)}")
    return DEFAULT_TOLERANCES[dtype]


def _check_tolerance(atol: float, rtol: float) -> None:
    for name, value in (("atol", atol), ("rtol", rtol)):
        problem = real_problem(name, value)
        if problem is not None:
            raise ComparisonError(f"{problem}; give a tolerance >= 0")
        if value < 0:
            raise ComparisonError(f"{name}={value!r} must be a finite number >= 0")


def drift_stats(
    candidate: torch.Tensor,
    reference: torch.Tensor,
    rows_mask: torch.Tensor,
    targets: torch.Tensor,
    atol: float,
    rtol: float,
) -> dict[str, Any]:
    """Drift of ``candidate`` against ``reference`` over the rows where ``rows_mask`` is true.

    All four tensors are 1-D over the global token order, so ``worst_token`` is a global
    token index and ``worst_target`` its target. With no selected rows every statistic is
    0, the worst token and target are ``None`` and the set passes. A non-finite value in a
    selected row raises :class:`ComparisonError`: it cannot be summarised as a finite drift.
    """
    _check_tolerance(atol, rtol)
    n = candidate.shape[0] if candidate.dim() == 1 else -1
    for name, tensor in (("candidate", candidate), ("reference", reference), ("rows_mask", rows_mask), ("targets", targets)):
        if tensor.dim() != 1 or tensor.shape[0] != n:
            raise ComparisonError(
                f"{name}.shape={tuple(tensor.shape)} must be 1-D of the candidate's length {n}"
            )
    if rows_mask.dtype != torch.bool:
        raise ComparisonError(f"rows_mask.dtype={rows_mask.dtype} must be torch.bool")
    rows = rows_mask.nonzero().squeeze(1)
    count = int(rows.numel())
    if count == 0:
        return {
            "count": 0, "max_abs": 0.0, "mean_abs": 0.0, "p95_abs": 0.0, "p99_abs": 0.0,
            "max_rel": 0.0, "worst_token": None, "worst_target": None,
            "atol": float(atol), "rtol": float(rtol), "passed": True,
        }
    cand = candidate.detach().to(torch.float64)[rows]
    ref = reference.detach().to(torch.float64)[rows]
    bad = ~(torch.isfinite(cand) & torch.isfinite(ref))
    if bool(bad.any()):
        token = int(rows[bad.nonzero()[0, 0]])
        raise ComparisonError(
            f"non-finite value at global token {token} (candidate {float(candidate[token])!r}, "
            f"reference {float(reference[token])!r}); drift cannot be summarised as a finite number"
        )
    diff = (cand - ref).abs()
    rel = diff / ref.abs().clamp_min(REL_FLOOR)
    worst = int(diff.argmax())
    worst_token = int(rows[worst])
    bound = atol + rtol * ref.abs()
    return {
        "count": count,
        "max_abs": float(diff[worst]),
        "mean_abs": float(diff.mean()),
        "p95_abs": float(torch.quantile(diff, 0.95, interpolation="higher")),
        "p99_abs": float(torch.quantile(diff, 0.99, interpolation="higher")),
        "max_rel": float(rel.max()),
        "worst_token": worst_token,
        "worst_target": int(targets[worst_token]),
        "atol": float(atol),
        "rtol": float(rtol),
        "passed": bool((diff <= bound).all()),
    }


def oracle_drift(
    candidate_logp: torch.Tensor,
    candidate_lse: torch.Tensor,
    logits_fp32: torch.Tensor,
    targets: torch.Tensor,
    active: torch.Tensor,
    real_vocab: int,
    dtype: str,
    atol: float,
    rtol: float,
    temperature: float | torch.Tensor = 1.0,
    sampling: Any = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """The report's ``drift``: LSE (all rows) and dlogp (active rows) against both oracles.

    FP32 oracle: the unrounded FP32 logits. FP64 oracle: the logits rounded to ``dtype``
    (what the candidate saw), computed in FP64. With a ``temperature`` both see the logits
    divided by ``T`` in binary64 (the distribution the candidate's ``x / T32`` approximates);
    a binary32 tensor ``[rows]`` is each row's ``T32`` (a rollout's per-row temperature).

    With ``sampling`` (a :class:`~rl_engine.logprob.processed.Sampling`: processed logprobs,
    docs/arithmetic.md section 13) the kept set is the FP64 oracle's own
    (:func:`~rl_engine.logprob.oracle.processed_fp64_oracle`, on the candidate's tempered binary32
    logits); the FP32 oracle is the unrounded logits' ``log_softmax`` over that set. The candidate's
    dropped targets (``-inf``) must be exactly the oracle's (else :class:`ComparisonError` names the
    first token that differs); dlogp is taken over the active rows whose target is kept.
    """
    if dtype not in LOGITS_DTYPES:
        raise ComparisonError(f"dtype={dtype!r} is unknown; use one of {list(LOGITS_DTYPES)}")
    if logits_fp32.dtype != torch.float32:
        raise ComparisonError(f"logits_fp32.dtype={logits_fp32.dtype} must be torch.float32")
    all_rows = torch.ones_like(active)
    if sampling is not None:
        return _processed_drift(candidate_logp, candidate_lse, logits_fp32, targets, active, real_vocab, dtype,
                                atol, rtol, temperature, sampling)
    rounded = logits_fp32.to(LOGITS_DTYPES[dtype])
    unrounded = logits_fp32
    if _tempered(temperature):
        divisor = _divisor64(temperature)
        unrounded = (logits_fp32.double() / divisor).float()
        rounded = rounded.double() / divisor
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, oracle in (("fp32_oracle", fp32_oracle(unrounded, targets, active, real_vocab)),
                         ("fp64_oracle", fp64_oracle(rounded, targets, active, real_vocab))):
        out[name] = {
            "lse": drift_stats(candidate_lse, oracle.lse, all_rows, targets, atol, rtol),
            "dlogp": drift_stats(candidate_logp, oracle.selected_logp, active, targets, atol, rtol),
        }
    return out


def _tempered(temperature: float | torch.Tensor) -> bool:
    """Whether the oracle divides: a number other than 1, or a per-row tensor (each row its own ``T32``)."""
    return isinstance(temperature, torch.Tensor) or temperature != 1.0


def _divisor64(temperature: float | torch.Tensor) -> float | torch.Tensor:
    """``T`` as the FP64 oracles divide by it: the number, or a per-row binary32 tensor as a binary64 column."""
    if isinstance(temperature, torch.Tensor):
        if temperature.dtype != torch.float32 or temperature.dim() != 1:
            raise ComparisonError(f"a per-row temperature must be a 1-D float32 tensor (each row's T32), got "
                                  f"{temperature.dtype} {tuple(temperature.shape)}")
        return temperature.double().unsqueeze(1)
    return temperature


def _processed_drift(candidate_logp: torch.Tensor, candidate_lse: torch.Tensor, logits_fp32: torch.Tensor,
                     targets: torch.Tensor, active: torch.Tensor, real_vocab: int, dtype: str, atol: float,
                     rtol: float, temperature: float | torch.Tensor,
                     sampling: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """:func:`oracle_drift` of a processed case (section 13): both oracles on the FP64 oracle's kept set,
    with each row's parameters (and, for a per-row ``temperature``, each row's ``T32``)."""
    from rl_engine.arith.temperature import temperature32
    from rl_engine.logprob.oracle import processed_fp64_oracle

    x32 = logits_fp32.to(LOGITS_DTYPES[dtype]).float()
    if isinstance(temperature, torch.Tensor):
        x32 = x32 / _divisor64(temperature).float()  # each row's T32, in binary32 as the candidate divides
    elif temperature32(temperature) != 1.0:
        x32 = x32 / torch.tensor(temperature32(temperature), dtype=torch.float32)  # section 6 step 0
    ref64, keep = processed_fp64_oracle(x32, targets, active, real_vocab, sampling.top_k, sampling.top_p,
                                        sampling.min_p)
    unrounded = logits_fp32 if not _tempered(temperature) else (logits_fp32.double() / _divisor64(temperature)).float()
    masked = torch.where(keep, unrounded[:, :real_vocab], torch.full_like(unrounded[:, :real_vocab], float("-inf")))
    ref32 = fp32_oracle(masked, targets, active, real_vocab)
    safe = torch.where(active, targets, torch.zeros_like(targets)).clamp(0, real_vocab - 1)
    dropped = active & ~keep.gather(1, safe.unsqueeze(1)).squeeze(1)
    mismatch = dropped != (active & torch.isneginf(candidate_logp))
    if bool(mismatch.any()):
        token = int(mismatch.nonzero()[0, 0])
        raise ComparisonError(
            f"global token {token}: the candidate's logprob is {float(candidate_logp[token])!r} but the FP64 "
            f"oracle's kept set {'drops' if bool(dropped[token]) else 'keeps'} its target {int(targets[token])} "
            "(docs/arithmetic.md section 13); the kept sets differ")
    kept_rows = active & ~dropped
    all_rows = torch.ones_like(active)
    return {name: {"lse": drift_stats(candidate_lse, oracle.lse, all_rows, targets, atol, rtol),
                   "dlogp": drift_stats(candidate_logp, oracle.selected_logp, kept_rows, targets, atol, rtol)}
            for name, oracle in (("fp32_oracle", ref32), ("fp64_oracle", ref64))}


def drift_failures(drift: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Acceptance failures from the gating (FP32) oracle's statistics."""
    failures = []
    for quantity, rows in (("lse", "all rows"), ("dlogp", "active rows")):
        stats = drift[GATING_ORACLE][quantity]
        if not stats["passed"]:
            failures.append(
                f"drift: {quantity} against the FP32 oracle exceeds atol={stats['atol']} "
                f"rtol={stats['rtol']} over {rows} (max_abs={stats['max_abs']!r} at global token "
                f"{stats['worst_token']}, target {stats['worst_target']})"
            )
    return failures


def require_no_fallback(selected: Dispatch) -> None:
    """Silent fallback is forbidden: a dispatch that did not materialise the request raises."""
    if selected.fallback or selected.actual_backend != selected.requested_backend:
        raise ComparisonError(
            f"silent fallback is forbidden: requested {selected.requested_backend!r} but "
            f"dispatch materialised {selected.actual_backend!r} (fallback={selected.fallback}, "
            f"rejections={list(selected.rejections)}); request an explicit, available backend"
        )


def compare_single_rank(
    logits_fp32: torch.Tensor,
    targets: torch.Tensor,
    active: torch.Tensor,
    *,
    real_vocab: int,
    num_vocab_tiles: int,
    dtype: str,
    backend: str,
    num_sequences: int = 1,
    atol: float | None = None,
    rtol: float | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """TP=1, CP=1 comparison of ``backend`` with both oracles; a strict-JSON-ready dict.

    ``logits_fp32`` is ``[num_sequences * seq, padded]``. Raises :class:`ComparisonError`
    when dispatch falls back, and :class:`LogprobContractError` on bad input (for example
    an active target equal to ``ignore_index``).
    """
    if logits_fp32.dim() != 2 or logits_fp32.dtype != torch.float32:
        raise ComparisonError(
            f"logits_fp32 must be a 2-D float32 tensor, got {logits_fp32.dtype} {tuple(logits_fp32.shape)}"
        )
    tokens, padded = logits_fp32.shape
    if tokens % num_sequences:
        raise ComparisonError(f"{tokens} rows are not {num_sequences} equal sequences")
    d_atol, d_rtol = default_tolerance(dtype)
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    _check_tolerance(atol, rtol)
    contract = LogprobContract(
        real_vocab_size=real_vocab,
        padded_vocab_size=padded,
        num_vocab_tiles=num_vocab_tiles,
        num_sequences=num_sequences,
        seq_len=tokens // num_sequences,
        logits_dtype=dtype,
    )
    selected = dispatch(backend, contract, device)
    require_no_fallback(selected)
    torch_device = torch.device(device)
    logits = logits_fp32.to(device=torch_device, dtype=contract.torch_dtype).requires_grad_(True)
    out = selected.op(
        logits, targets.to(torch_device), active.to(torch_device), contract, compute_entropy=True
    )
    out.selected_logp.sum().backward()
    assert logits.grad is not None and out.entropy is not None
    logp, lse = out.selected_logp.detach().cpu(), out.lse.detach().cpu()
    drift = oracle_drift(logp, lse, logits_fp32, targets, active, real_vocab, dtype, atol, rtol)
    failures = drift_failures(drift)
    return {
        "passed": not failures,
        "failures": failures,
        **selected.provenance(),
        "contract": contract.to_dict(),
        "contract_fingerprint": contract.cross_rank_fingerprint(),
        "bitwise_fingerprints": {
            "dtype": "float32",
            "shape": [tokens],
            "candidate_logp_sha256": fingerprint(logp),
            "candidate_lse_sha256": fingerprint(lse),
            "candidate_entropy_sha256": fingerprint(out.entropy),
            "candidate_grad_sha256": fingerprint(logits.grad),
            "grad_dtype": DTYPE_NAMES[logits.grad.dtype],
            "grad_shape": list(logits.grad.shape),
        },
        "drift": drift,
    }


__all__ = [
    "DEFAULT_TOLERANCES",
    "ComparisonError",
    "GATING_ORACLE",
    "compare_single_rank",
    "default_tolerance",
    "drift_failures",
    "drift_stats",
    "oracle_drift",
    "require_no_fallback",
]
