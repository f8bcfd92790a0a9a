"""``python -m rl_engine parity ROLLOUT TRAINER --output-dir DIR``: where two engines' logprobs part.

Two captures of the same tokens (``docs/capture.md``), one from the rollout engine and one from
the trainer, are compared in five sections (six when the rollout carries sampling parameters),
each per token and in aggregate:

1. targets and mask: must be identical, else the verb refuses naming the first differing token;
2. logits: bitwise equal or not, tokens and columns that differ, max abs and relative difference;
3. our logprob (the candidate backend, recorded) on each side's logits, their difference, and a
   control: the rollout's logits again in reversed row order give the same bytes;
4. each engine's ``reported_logp`` against our recompute on that engine's logits;
5. the importance ratio ``exp(logp_trainer - logp_rollout)``;
6. when the rollout capture carries its sampling parameters: our processed logprob on the rollout's
   logits (temperature, top-k, top-p, min-p per row), against the engine's
   ``reported_processed_logp`` when it has one, and how much of the gap between the engine's report
   and our raw logprob the sampler's processing explains (:func:`processed_section`).

Writes ``DIR/parity.json`` (``schemas/parity.schema.json``) and ``DIR/parity.png`` and prints
a short table. Exit 0: our logprobs of the two sides are bitwise equal (and the control holds);
1: the report shows a difference (``--difference-exit-code N`` makes it N: the workflow's parity
stage passes 0, since a difference is a finding the report records, not a failed stage); 2:
refused (bad capture, different tokens, bad option), with nothing written. :func:`check_pair`
is what the workflow's config check runs on a ``parity:`` section before any job: every refusal
that needs no logits.

How each figure is computed: logits are compared as their binary32 upcasts (exact from bf16 and
fp16), bit patterns for equality and float64 for the differences. Differences of logprobs are
binary32 subtractions. The ratio is the project's portable binary32 ``E`` (docs/arithmetic.md)
of the binary32 difference: a report statistic, not the candidate's path, but the same bits on
any machine. Means are ``math.fsum`` (exact, order free) of float64 values over active tokens,
divided by their count.
"""

from __future__ import annotations

import io
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from rl_engine import jsonio, schemas
from rl_engine.arith import portable
from rl_engine.capture.format import Capture, CaptureError, read_capture, read_header, read_tokens
from rl_engine.distributed.bounds import AUTO_TILES, BoundsError, tile_width
from rl_engine.logprob.api import resolve_vocab_tiles
from rl_engine.logprob.backends.description import backend_devices
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.rundir import PARITY_JSON, PARITY_PNG
from rl_engine.tables import AUTO, EAGER_BACKEND, PARITY_RATIO_BOUNDS, SCHEMA_VERSION
from rl_engine.tensorio import tensor_bytes
from rl_engine.verb_parsers import parity_parser

SCHEMA = "parity"
SIDES = ("rollout", "trainer")
DEFAULT_RATIO_BOUNDS = PARITY_RATIO_BOUNDS  # PPO-style clip of the ratio; TIS users pass their own
ROW_BLOCK = 32  # rows of logits compared at a time (bounds the float64 temporaries)
RATIO_METHOD = ("binary32 E(logp_trainer - logp_rollout): the portable exp of docs/arithmetic.md "
                "on the binary32 difference (a report statistic, not the candidate's path)")
MEAN_METHOD = "math.fsum of float64 values over active tokens, divided by their count"
PROCESSED_METHOD = (
    "per active token, binary32 subtractions: gap = engine_reported_processed - our_raw, explained = "
    "our_processed - our_raw (= temperature_part + truncation_part up to rounding: temperature_part = "
    "our_tempered - our_raw, truncation_part = our_processed - our_tempered), residual = "
    "engine_reported_processed - our_processed; our_raw is section 3's logprob of the rollout's logits, "
    "our_tempered at the row's temperature only, our_processed with the row's top_k / top_p / min_p too "
    "(docs/arithmetic.md section 13). Aggregates over the counted tokens: active, our target kept and the "
    "engine's report finite. fraction_explained = 1 - fsum|residual| / fsum|gap|")


class ParityError(ValueError):
    """Two captures that cannot be compared, or a bad option; nothing is written."""


@dataclass(frozen=True)
class ParityOptions:
    """The verb's options. ``num_vocab_tiles`` defaults to ``auto``, resolved for the captures'
    vocabulary by the API's own resolver (:func:`rl_engine.logprob.api.resolve_vocab_tiles`, the
    rule ``selected_logprob`` applies by default): an engine that reports our logprob computed with
    the API's defaults gets the same bytes here, so its section 4 reads "bitwise equal"."""

    backend: str = EAGER_BACKEND
    num_vocab_tiles: int | str = AUTO_TILES
    ratio_bounds: tuple[float, float] = DEFAULT_RATIO_BOUNDS

    def __post_init__(self) -> None:
        tiles = self.num_vocab_tiles
        if tiles != AUTO_TILES and (isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1):
            raise ParityError(f"--num-vocab-tiles={tiles!r} must be {AUTO_TILES!r} or a positive "
                              "integer that divides the vocabulary")
        low, high = self.ratio_bounds
        if not (math.isfinite(low) and math.isfinite(high) and 0 < low < 1 < high):
            raise ParityError(f"--ratio-bounds={low} {high} must be finite with 0 < LOW < 1 < HIGH "
                              "(for example 0.8 1.2)")


@dataclass(frozen=True)
class Tokens:
    """What section 1 compares of a capture: its shape, targets and mask (no logits)."""

    num_tokens: int
    vocab: int
    targets: torch.Tensor
    active: torch.Tensor


def _check_backend(backend: str) -> None:
    cpu = sorted(b for b, d in backend_devices().items() if "cpu" in d)
    if backend != AUTO and backend not in backend_devices():
        raise ParityError(f"backend={backend!r} is not registered; name one registered for the cpu "
                          f"(our logprob runs here): one of {cpu}")
    if backend == AUTO or "cpu" not in backend_devices()[backend]:
        raise ParityError(f"backend={backend!r} must be a backend registered for the cpu (our logprob "
                          f"runs here, and auto is not a name): one of {cpu}")


def vocab_tiles(vocab: int, options: ParityOptions) -> dict[str, Any]:
    """The tile count our logprob uses on captures of ``vocab`` columns, as
    :func:`rl_engine.logprob.api.resolve_vocab_tiles` gives it (``requested``, ``resolved``,
    ``rule``, ``max_tp``): ``auto`` is the API's default rule at its default ``max_tp``; an explicit
    count must divide the vocabulary. :class:`ParityError` names the option and the fix."""
    try:
        tiles = resolve_vocab_tiles(options.num_vocab_tiles, vocab)
        tile_width(vocab, tiles["resolved"])
    except (BoundsError, LogprobContractError) as exc:
        raise ParityError(f"num_vocab_tiles: {exc} (the captures have {vocab} columns; pass "
                          "--num-vocab-tiles N with N dividing them, e.g. 1)") from None
    return tiles


def check_pair(rollout: Path, trainer: Path, options: ParityOptions) -> int:
    """Every refusal of :func:`run` that needs no logits: each file a capture (header checked), the
    same tokens, targets and mask (section 1), a tile count that divides the vocabulary (``auto``
    resolved as the API resolves it), and a backend registered for the CPU. Raises
    :class:`ParityError` naming the side and the fix; returns the tile count the verb will use."""
    _check_backend(options.backend)
    sides = []
    for side, path in zip(SIDES, (rollout, trainer)):
        try:
            header = read_header(path)
            targets, active = read_tokens(path)
        except (CaptureError, OSError) as exc:
            raise ParityError(f"{side} capture: {exc}") from None
        sides.append(Tokens(header.num_tokens, header.vocab, targets, active))
    check_same_tokens(*sides)
    return int(vocab_tiles(sides[0].vocab, options)["resolved"])


def _mean(values: list[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def check_same_tokens(rollout: Capture | Tokens, trainer: Capture | Tokens) -> None:
    """Section 1: identical targets and mask, else :class:`ParityError` naming the first token."""
    if rollout.num_tokens != trainer.num_tokens:
        raise ParityError(f"rollout has {rollout.num_tokens} tokens, trainer {trainer.num_tokens}; "
                          "capture the same tokens on both sides (same sequences, same order)")
    if rollout.vocab != trainer.vocab:
        raise ParityError(f"rollout's logits have vocab {rollout.vocab}, trainer's {trainer.vocab}; "
                          "capture the real vocabulary columns on both sides (drop TP padding)")
    for name in ("active", "targets"):
        a, b = getattr(rollout, name), getattr(trainer, name)
        differ = a != b
        if name == "targets":
            differ &= rollout.active  # inactive targets are not compared (e.g. -100 vs 0)
        if bool(differ.any()):
            row = int(differ.nonzero()[0, 0])
            raise ParityError(f"tensor {name} differs at token {row} (rollout {a[row].item()}, "
                              f"trainer {b[row].item()}; {int(differ.sum())} token(s) differ); "
                              "parity compares captures of the same tokens: join both sides' "
                              "batches in the same sequence order")


def our_logprob(capture: Capture, options: ParityOptions, order: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, Any]]:
    """Our selected logprob of a capture (rows in ``order`` when given, returned in file order)."""
    from rl_engine.logprob.registry import dispatch

    logits, targets, active = capture.logits, capture.targets, capture.active
    if order is not None:
        logits, targets, active = logits[order], targets[order], active[order]
    tiles = vocab_tiles(capture.vocab, options)["resolved"]
    try:
        contract = LogprobContract(
            real_vocab_size=capture.vocab, padded_vocab_size=capture.vocab,
            num_vocab_tiles=tiles, num_sequences=1,
            seq_len=capture.num_tokens, logits_dtype=capture.logits_dtype,
        )
        chosen = dispatch(options.backend, contract, "cpu")
    except LogprobContractError as exc:
        raise ParityError(f"{capture.source}: {exc}") from None
    out = chosen.op(logits.contiguous(), targets, active, contract).selected_logp
    if order is not None:
        restored = torch.empty_like(out)
        restored[order] = out
        out = restored
    return out, chosen.provenance()


_INT_VIEWS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: the binary32 upcasts' bit patterns differ (for one dtype: the raw bits,
    which is the same test since the upcast is injective, and much cheaper)."""
    if a.dtype == b.dtype:
        view = _INT_VIEWS[a.dtype]
        return a.contiguous().view(view) != b.contiguous().view(view)
    return (a.to(torch.float32).contiguous().view(torch.int32)
            != b.to(torch.float32).contiguous().view(torch.int32))


def _logits_section(rollout: Capture, trainer: Capture) -> dict[str, Any]:
    n, vocab = rollout.num_tokens, rollout.vocab
    differing_cols = torch.zeros(vocab, dtype=torch.bool)
    per_cols, per_abs, per_rel = [], [], []
    for lo in range(0, n, ROW_BLOCK):
        a, b = rollout.logits[lo:lo + ROW_BLOCK], trainer.logits[lo:lo + ROW_BLOCK]
        differ = _differ(a, b)
        act = rollout.active[lo:lo + ROW_BLOCK]
        differing_cols |= (differ & act.unsqueeze(1)).any(dim=0)
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
        diff = a64.sub(b64).abs_()
        scale = torch.maximum(a64.abs_(), b64.abs_(), out=a64)
        rel = diff.div(scale.clamp_(min=torch.finfo(torch.float64).tiny))  # 0 / tiny = 0 where both are 0
        per_cols += differ.sum(dim=1).tolist()
        per_abs += diff.max(dim=1).values.tolist()
        per_rel += rel.max(dim=1).values.tolist()
    active = rollout.active.tolist()
    act_rows = [i for i in range(n) if active[i]]
    same_dtype = rollout.logits.dtype == trainer.logits.dtype
    return {
        "same_dtype": same_dtype,
        "bitwise_equal": same_dtype and all(per_cols[i] == 0 for i in act_rows),
        "tokens_differing": sum(1 for i in act_rows if per_cols[i]),
        "columns_differing": int(differing_cols.sum()),
        "max_abs_diff": max(per_abs[i] for i in act_rows),
        "max_rel_diff": max(per_rel[i] for i in act_rows),
        "per_token": {"columns_differing": per_cols, "max_abs_diff": per_abs,
                      "max_rel_diff": per_rel},
    }


def _finite_or_none(values: list[float]) -> list[float | None]:
    """A per-token list for strict JSON: a non-finite value (an overflow) becomes null."""
    return [v if math.isfinite(v) else None for v in values]


def _diff_stats(a: torch.Tensor, b: torch.Tensor, active: torch.Tensor) -> dict[str, Any]:
    """``b - a`` per token (binary32) and its aggregate over active tokens. A difference that is not
    finite (a logprob that overflowed to -inf on fp32 logits near the format's range, or its NaN
    difference) is counted in ``non_finite`` and shown as null; the aggregates that it would make
    meaningless are then null too, as docs/capture.md says."""
    diff = b - a
    differ = (a.view(torch.int32) != b.view(torch.int32)) & active
    act = [d for d, on in zip(diff.tolist(), active.tolist()) if on]
    finite = [d for d in act if math.isfinite(d)]
    whole = len(finite) == len(act)
    return {
        "bitwise_equal": not bool(differ.any()),
        "tokens_differing": int(differ.sum()),
        "non_finite": len(act) - len(finite),
        "max_abs_diff": max(abs(d) for d in act) if whole else None,
        "mean_abs_diff": _mean([abs(d) for d in act]) if whole else None,
        "mean_diff": _mean(act) if whole else None,
        "per_token": {"diff": _finite_or_none(diff.tolist()), "bitwise_equal": (~differ | ~active).tolist()},
    }


def _ratio(log_new: torch.Tensor, log_old: torch.Tensor, active: torch.Tensor,
           bounds: tuple[float, float]) -> dict[str, Any]:
    ratio = portable.exp((log_new - log_old).contiguous())
    values = [r for r, on in zip(ratio.tolist(), active.tolist()) if on]
    finite = [r for r in values if math.isfinite(r)]
    low, high = bounds
    outside = sum(1 for r in values if not (low <= r <= high))
    return {
        "mean": _mean(finite) if len(finite) == len(values) else None,
        "min": min(finite) if finite else None, "max": max(values) if len(finite) == len(values) else None,
        "non_finite": len(values) - len(finite),
        "outside_bounds": outside,
        "share_outside_bounds": outside / len(values),
        "per_token": [r if math.isfinite(r) else None for r in ratio.tolist()],
    }


def compute(rollout: Capture, trainer: Capture, options: ParityOptions) -> dict[str, Any]:
    """Every section of the report (sections 1-6) from two checked captures."""
    check_same_tokens(rollout, trainer)
    active = rollout.active
    ours: dict[str, torch.Tensor] = {}
    provenance: dict[str, Any] = {}
    for side, cap in zip(SIDES, (rollout, trainer)):
        ours[side], provenance[side] = our_logprob(cap, options)
    reversed_rows = torch.arange(rollout.num_tokens - 1, -1, -1)
    again, _ = our_logprob(rollout, options, order=reversed_rows)
    control_equal = tensor_bytes(again) == tensor_bytes(ours["rollout"])
    logits = _logits_section(rollout, trainer)
    logp = _diff_stats(ours["rollout"], ours["trainer"], active)
    rows_equal = [c == 0 for c in logits["per_token"]["columns_differing"]]
    logp_equal = logp["per_token"]["bitwise_equal"]
    act = active.tolist()
    unexplained = [i for i in range(len(act)) if act[i] and rows_equal[i] and not logp_equal[i]]
    engines: dict[str, Any] = {}
    for side, cap in zip(SIDES, (rollout, trainer)):
        if cap.reported_logp is None:
            engines[side] = None
        else:
            stats = _diff_stats(ours[side], cap.reported_logp, active)
            # an engine's report on an inactive token is not part of the format (it may be NaN)
            for key, values in (("diff", stats["per_token"]["diff"]),
                                ("reported_logp", cap.reported_logp.tolist())):
                stats["per_token"][key] = [v if on else None for v, on in zip(values, act)]
            engines[side] = stats
    both = rollout.reported_logp is not None and trainer.reported_logp is not None
    return {
        "targets_and_mask": {"identical": True, "tokens": rollout.num_tokens,
                             "active_tokens": int(active.sum()),
                             "per_token": {"active": act, "targets": rollout.targets.tolist()}},
        "logits": logits,
        "our_logprob": {
            **logp,
            "rollout_logp": _finite_or_none(ours["rollout"].tolist()),
            "trainer_logp": _finite_or_none(ours["trainer"].tolist()),
            "from_logits_only": not unexplained,
            "tokens_equal_logits_different_logp": unexplained,
            "control": {"what": "the rollout's logits again, rows in reversed order, bytes "
                                "compared with the first computation",
                        "bitwise_equal": control_equal},
            "provenance": provenance,
        },
        "engine_vs_ours": engines,
        "importance_ratio": {
            "method": RATIO_METHOD, "bounds": list(options.ratio_bounds),
            "ours": _ratio(ours["trainer"], ours["rollout"], active, options.ratio_bounds),
            "engines": (_ratio(trainer.reported_logp, rollout.reported_logp, active,  # type: ignore[arg-type]
                               options.ratio_bounds) if both else None),
        },
        "processed": processed_section(rollout, ours["rollout"], options),
    }


def _side_record(path: Path, cap: Capture) -> dict[str, Any]:
    return {"path": str(path), "sha256": jsonio.sha256_file(path), "metadata": dict(cap.metadata),
            "has_reported_logp": cap.reported_logp is not None, "has_sampling": cap.sampling is not None,
            "has_reported_processed_logp": cap.reported_processed_logp is not None}


def sampled_logprob(capture: Capture, options: ParityOptions, truncate: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Our logprob of the distribution each row of ``capture`` was sampled from, with the row's
    sampling parameters (the capture must carry them): at its temperature, and with its top-k,
    top-p and min-p when ``truncate``. One call of the op per distinct temperature, the truncation
    parameters per row (the op is batch invariant: the grouping changes no byte). Returns
    ``(logp, target_kept)`` in capture order (``target_kept`` all true without truncation)."""
    from rl_engine.logprob.processed import sampling_from
    from rl_engine.logprob.registry import dispatch

    sampling = capture.sampling
    if sampling is None:
        raise ParityError(f"{capture.source}: the capture carries no sampling parameters")
    tiles = vocab_tiles(capture.vocab, options)["resolved"]
    logp = torch.empty(capture.num_tokens, dtype=torch.float32)
    kept = torch.ones(capture.num_tokens, dtype=torch.bool)
    temps = sampling.temperature
    for t in sorted(set(temps.tolist())):
        rows = (temps == t).nonzero().flatten()
        part = sampling.rows(rows)
        try:
            contract = LogprobContract(
                real_vocab_size=capture.vocab, padded_vocab_size=capture.vocab, num_vocab_tiles=tiles,
                num_sequences=1, seq_len=rows.numel(), logits_dtype=capture.logits_dtype, temperature=t)
            sampler = (sampling_from(part.top_k, part.top_p, part.min_p, (rows.numel(),), torch.device("cpu"))
                       if truncate else None)
            chosen = dispatch(options.backend, contract, "cpu", processed=sampler is not None)
        except LogprobContractError as exc:
            raise ParityError(f"{capture.source}: the rows at temperature {t}: {exc}") from None
        out = chosen.op(capture.logits.index_select(0, rows).contiguous(), capture.targets.index_select(0, rows),
                        capture.active.index_select(0, rows), contract,
                        **({"sampling": sampler} if sampler is not None else {}))
        logp.index_copy_(0, rows, out.selected_logp)
        if out.target_kept is not None:
            kept.index_copy_(0, rows, out.target_kept)
    return logp, kept


def _abs_stats(values: list[float]) -> dict[str, float | None]:
    return {"max_abs": max((abs(v) for v in values), default=None), "mean_abs": _mean([abs(v) for v in values]),
            "mean": _mean(values)}


def _per_token(values: torch.Tensor, active: list[bool]) -> list[float | None]:
    return [v if on and math.isfinite(v) else None for v, on in zip(values.tolist(), active)]


def processed_section(rollout: Capture, raw: torch.Tensor, options: ParityOptions) -> dict[str, Any] | None:
    """Section 6 (None when the rollout capture carries no sampling parameters): our processed
    logprob of the rollout's rows, its split from our raw logprob ``raw`` (section 3's) into the
    temperature's part and the truncation's, and, when the capture has ``reported_processed_logp``,
    the engine's report against it and the share of the engine's raw-to-processed gap our processing
    explains (:data:`PROCESSED_METHOD`). Active tokens whose target is outside our kept set (our
    logprob ``-inf``) or outside the engine's (its report ``-inf``) are counted and listed, and left
    out of the aggregates."""
    sampling = rollout.sampling
    if sampling is None:
        return None
    tempered, _ = sampled_logprob(rollout, options, truncate=False)
    processed, kept = sampled_logprob(rollout, options)
    reported = rollout.reported_processed_logp
    act = rollout.active.tolist()
    kept_list = kept.tolist()
    truncating = ((sampling.top_k > 0) | (sampling.top_p < 1) | (sampling.min_p > 0)) & rollout.active
    not_kept = [i for i, on in enumerate(act) if on and not kept_list[i]]
    engine_not_kept = ([] if reported is None else
                       [i for i, on in enumerate(act) if on and reported[i].item() == float("-inf")])
    counted = [i for i, on in enumerate(act) if on and kept_list[i] and i not in set(engine_not_kept)]
    parts = {"explained": processed - raw, "temperature_part": tempered - raw, "truncation_part": processed - tempered}
    if reported is not None:
        parts["gap"] = reported - raw
        parts["residual"] = reported - processed
    stats: dict[str, Any] = {}
    for name in ("gap", "explained", "temperature_part", "truncation_part", "residual"):
        stats[name] = None if name not in parts else _abs_stats([parts[name][i].item() for i in counted])
    fraction = None
    if reported is not None:
        gap = math.fsum(abs(parts["gap"][i].item()) for i in counted)
        residual = math.fsum(abs(parts["residual"][i].item()) for i in counted)
        fraction = 1.0 - residual / gap if gap > 0 else None
        differ = [i for i in counted if reported[i:i + 1].view(torch.int32).item()
                  != processed[i:i + 1].view(torch.int32).item()]
        stats["residual"].update(bitwise_equal=not differ and not engine_not_kept and not not_kept,
                                 tokens_differing=len(differ))
    return {
        "method": PROCESSED_METHOD,
        "parameters_from": "rollout",
        "active_tokens": int(rollout.active.sum()),
        "truncated_tokens": int(truncating.sum()),
        "counted_tokens": len(counted),
        "engine_reported": reported is not None,
        "target_not_kept": {"count": len(not_kept), "tokens": not_kept},
        "engine_target_not_kept": None if reported is None else {"count": len(engine_not_kept),
                                                                  "tokens": engine_not_kept},
        **stats,
        "fraction_explained": fraction,
        "per_token": {
            "processed_logp": _per_token(processed, act), "tempered_logp": _per_token(tempered, act),
            "target_kept": [bool(k) or not on for k, on in zip(kept_list, act)],
            "reported_processed_logp": None if reported is None else _per_token(reported, act),
            **{name: (_per_token(parts[name], act) if name in parts else None)
               for name in ("gap", "explained", "residual")},
        },
    }


def build_report(rollout_path: Path, trainer_path: Path, options: ParityOptions) -> dict[str, Any]:
    caps = {}
    for side, path in zip(SIDES, (rollout_path, trainer_path)):
        try:
            caps[side] = read_capture(path)
        except (CaptureError, OSError) as exc:
            raise ParityError(f"{side} capture: {exc}") from None
    sections = compute(caps["rollout"], caps["trainer"], options)
    equal = sections["our_logprob"]["bitwise_equal"] and sections["our_logprob"]["control"]["bitwise_equal"]
    tiles = vocab_tiles(caps["rollout"].vocab, options)
    return {
        "schema_version": SCHEMA_VERSION,
        "verdict": "bitwise_equal" if equal else "different",
        "captures": {side: _side_record(p, caps[side])
                     for side, p in zip(SIDES, (rollout_path, trainer_path))},
        "backend": options.backend, "num_vocab_tiles": tiles["resolved"],
        "num_vocab_tiles_rule": {"requested": tiles["requested"], "rule": tiles["rule"], "max_tp": tiles["max_tp"]},
        "arithmetic_spec": portable.SPEC_VERSION, "mean_method": MEAN_METHOD,
        **sections,
    }


@dataclass(frozen=True)
class Panel:
    """One panel of parity.png: per-token values of the active tokens, the exact zeros counted apart
    (they are not in the histogram), the tokens whose value is not finite, and lines to mark.
    ``log_scale``: the histogram's bins and axis are logarithmic (the values are then positive), so
    values many decades apart, or all within 1e-5 of each other near 0, each get their own bins."""

    title: str
    xlabel: str
    values: tuple[float, ...]  # the finite values the histogram shows (exact zeros left out when zeros_apart)
    zeros: int  # active tokens whose value is exactly 0 (bitwise equal), counted apart; -1: not counted apart
    non_finite: int
    active: int
    marks: tuple[float, ...] = ()  # vertical lines (the ratio's truncation bounds)
    log_scale: bool = False
    zero_label: str = "exactly 0"  # what a value counted in ``zeros`` is, in the note's words

    def __post_init__(self) -> None:
        if self.log_scale and any(not v > 0 for v in self.values):
            raise ValueError(f"Panel {self.title!r}: a log-scale histogram needs positive values "
                             "(count the zeros apart)")

    def note(self) -> str:
        """What the panel's annotation says: the counts a reviewer reads at a glance."""
        parts = [] if self.zeros < 0 else [f"{self.zero_label}: {self.zeros} of {self.active} active tokens "
                                           f"({100.0 * self.zeros / self.active:.1f}%), not in the histogram"]
        if self.log_scale and self.values:
            parts.append(f"smallest {_g(min(self.values))}, largest {_g(max(self.values))}")
        if self.non_finite:
            parts.append(f"not finite: {self.non_finite}")
        if self.marks:
            outside = sum(1 for v in self.values if v < self.marks[0] or v > self.marks[1]) + self.non_finite
            parts.append(f"outside [{_g(self.marks[0])}, {_g(self.marks[1])}]: {outside} of {self.active}")
        return "\n".join(parts)


def figure_panels(report: dict[str, Any]) -> list[Panel]:
    """The panels of parity.png, every number from the report (parity.json): our logprob difference
    (trainer - rollout), the logits' largest difference per token, our importance ratio with its
    truncation bounds, the same ratio's distance from 1 on a log scale (ratios within 1e-5 of 1 are
    one bar on the linear panel, whose axis spans the bounds; here each decade has its bins), each
    engine's reported logprob against ours where the capture has one, and the rollout engine's
    processed logprob against our processed one (section 6) where the capture has it."""
    act = report["targets_and_mask"]["per_token"]["active"]
    active = sum(1 for on in act if on)

    def diff_panel(title: str, per_token: list[float | None], xlabel: str) -> Panel:
        on = [d for d, a in zip(per_token, act) if a]
        finite = [d for d in on if d is not None]
        return Panel(title, xlabel, tuple(d for d in finite if d != 0), sum(1 for d in finite if d == 0),
                     len(on) - len(finite), active)

    panels = [diff_panel("our logprob: trainer - rollout", report["our_logprob"]["per_token"]["diff"],
                         "logprob difference (nats)"),
              diff_panel("logits: largest |trainer - rollout| of the row",
                         report["logits"]["per_token"]["max_abs_diff"], "max |logit difference|")]
    ratio = report["importance_ratio"]
    on = [r for r, a in zip(ratio["ours"]["per_token"], act) if a]
    finite = tuple(r for r in on if r is not None)
    panels.append(Panel("importance ratio (ours): exp(logp_trainer - logp_rollout)", "ratio", finite, -1,
                        len(on) - len(finite), active, tuple(ratio["bounds"])))
    # |r - 1| in binary64 is exact for a binary32 r in [0.5, 2] (Sterbenz), the ratios a parity run shows
    panels.append(Panel("importance ratio (ours): |ratio - 1|, log scale", "|ratio - 1|",
                        tuple(abs(r - 1.0) for r in finite if r != 1.0), sum(1 for r in finite if r == 1.0),
                        len(on) - len(finite), active, log_scale=True, zero_label="exactly 1"))
    for side in SIDES:
        stats = report["engine_vs_ours"][side]
        if stats is not None:
            panels.append(diff_panel(f"{side} engine's reported logprob - ours", stats["per_token"]["diff"],
                                     "logprob difference (nats)"))
    processed = report.get("processed")
    if processed is not None and processed["engine_reported"]:
        panels.append(diff_panel("rollout engine's processed logprob - our processed", processed["per_token"]["residual"],
                                 "logprob difference (nats)"))
    return panels


HEADLINE_TOKENS = 6  # token indices the title names before "..."


def _token_list(indices: list[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:HEADLINE_TOKENS])
    return f"token{'s' if len(indices) > 1 else ''} {shown}{', ...' if len(indices) > HEADLINE_TOKENS else ''}"


def headline(report: dict[str, Any]) -> str:
    """The figure's title: the verdict, on how many active tokens our logprob is bitwise equal, and
    what is true of the logits rows: which active tokens have bitwise equal rows (none, or their
    first indices) and whether our logprob bytes are equal on all of them or differ on some (named).
    With no equal row there is nothing to attribute, and the title says so instead of a vacuous yes."""
    act = report["targets_and_mask"]["per_token"]["active"]
    ours, logits = report["our_logprob"], report["logits"]["per_token"]["columns_differing"]
    active = sum(1 for on in act if on)
    equal_logp = sum(1 for on, eq in zip(act, ours["per_token"]["bitwise_equal"]) if on and eq)
    rows = [i for i, (on, cols) in enumerate(zip(act, logits)) if on and cols == 0]
    first = f"parity: {report['verdict']}; our logprob bitwise equal on {equal_logp} of {active} active tokens"
    if not rows:
        return (f"{first}\nlogits rows bitwise equal on 0 of {active} active tokens: no token where equal logits "
                "could give equal logprob bytes")
    where = f"logits rows bitwise equal on {len(rows)} of {active} active tokens ({_token_list(rows)})"
    unexplained = list(ours["tokens_equal_logits_different_logp"])
    if not unexplained:
        return f"{first}\n{where}; our logprob bytes are equal on all {len(rows)}"
    return (f"{first}\n{where}; our logprob bytes DIFFER on {len(unexplained)} of them "
            f"({_token_list(unexplained)})")


FIGURE_COLUMNS = 2
PANEL_SIZE_IN = (6.4, 4.2)  # inches; at 100 dpi each panel is 640 x 420 pixels
FIGURE_DPI = 100
HISTOGRAM_BINS = 50


def _histogram(ax: Any, panel: Panel) -> None:
    """The panel's histogram on ``ax``: linear bins over the values' range, or logarithmic bins and
    axis for a log-scale panel; one distinct value gets an explicit range around it."""
    distinct = sorted(set(panel.values))
    if panel.log_scale:
        import numpy as np

        low, high = (distinct[0] / 2, distinct[0] * 2) if len(distinct) == 1 else (distinct[0], distinct[-1])
        edges = np.geomspace(low, high, min(HISTOGRAM_BINS, max(len(distinct), 2)) + 1)
        ax.hist(panel.values, bins=edges, color="tab:blue")
        ax.set_xscale("log")
        return
    # one distinct value: an explicit range around it (numpy's +-0.5 vanishes at 3e38)
    span = None if len(distinct) > 1 else (distinct[0] - max(abs(distinct[0]) * 1e-3, 0.5),
                                          distinct[0] + max(abs(distinct[0]) * 1e-3, 0.5))
    ax.hist(panel.values, bins=min(HISTOGRAM_BINS, len(distinct)), range=span, color="tab:blue")


def build_figure(report: dict[str, Any]) -> Any:
    """parity.png's matplotlib ``Figure`` (Agg canvas, no pyplot): :func:`figure_panels` on a grid,
    two panels a row, each a histogram of its values with its exact zeros counted apart and its
    counts written on it, in type a reviewer reads at the size the figure is shown."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = figure_panels(report)
    rows = -(-len(panels) // FIGURE_COLUMNS)
    fig = Figure(figsize=(PANEL_SIZE_IN[0] * FIGURE_COLUMNS, PANEL_SIZE_IN[1] * rows + 0.6), dpi=FIGURE_DPI)
    FigureCanvasAgg(fig)
    fig.suptitle(headline(report), fontsize=14)
    for i, panel in enumerate(panels, start=1):
        ax = fig.add_subplot(rows, FIGURE_COLUMNS, i)
        if panel.values:
            _histogram(ax, panel)
        else:
            ax.text(0.5, 0.5, "no value to plot", transform=ax.transAxes, ha="center", fontsize=12)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # headroom for the counts written at the top
        for mark in panel.marks:
            ax.axvline(mark, color="tab:red", linestyle="--", linewidth=1.5)
        ax.set_title(panel.title, fontsize=12)
        ax.set_xlabel(panel.xlabel, fontsize=11)
        ax.set_ylabel("active tokens", fontsize=11)
        ax.tick_params(labelsize=10)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        note = panel.note()
        if note:
            ax.text(0.02, 0.97, note, transform=ax.transAxes, va="top", ha="left", fontsize=10,
                    bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85})
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def render_png(report: dict[str, Any]) -> bytes:
    """parity.png: :func:`build_figure` as PNG bytes (no Software tag)."""
    buf = io.BytesIO()
    build_figure(report).savefig(buf, format="png", dpi=FIGURE_DPI, metadata={"Software": None})
    return buf.getvalue()


def _g(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"parity: {report['verdict']}")
    table.add_column("section")
    table.add_column("result")
    lg, lp, rt = report["logits"], report["our_logprob"], report["importance_ratio"]["ours"]
    table.add_row("1 targets and mask", f"identical ({report['targets_and_mask']['active_tokens']} active tokens)")
    table.add_row("2 logits", "bitwise equal" if lg["bitwise_equal"] else
                  f"{lg['tokens_differing']} tokens, {lg['columns_differing']} columns differ; "
                  f"max abs {lg['max_abs_diff']:.3g}, max rel {lg['max_rel_diff']:.3g}")
    table.add_row("3 our logprob", ("bitwise equal" if lp["bitwise_equal"] else
                  f"{lp['tokens_differing']} tokens differ, max abs {_g(lp['max_abs_diff'])}"
                  + (f", {lp['non_finite']} not finite" if lp["non_finite"] else ""))
                  + ("; from the logits only" if lp["from_logits_only"] else
                     "; NOT from the logits alone") + ("; control ok" if lp["control"]["bitwise_equal"]
                                                        else "; CONTROL FAILED"))
    for side in SIDES:
        st = report["engine_vs_ours"][side]
        table.add_row(f"4 {side} engine vs ours", "no reported_logp" if st is None else
                      ("bitwise equal" if st["bitwise_equal"] else
                       f"{st['tokens_differing']} tokens differ, max abs {_g(st['max_abs_diff'])}"))
    mean = "n/a" if rt["mean"] is None else f"{rt['mean']:.6g}"
    low = "n/a" if rt["min"] is None else f"{rt['min']:.6g}"
    table.add_row("5 ratio (ours)", f"mean {mean}, min {low}, "
                  f"outside {report['importance_ratio']['bounds']}: {rt['share_outside_bounds']:.2%}")
    pr = report.get("processed")
    if pr is not None:
        kept = f"{pr['target_not_kept']['count']} target(s) outside our kept set"
        table.add_row("6 processed (rollout)", kept if not pr["engine_reported"] else
                      f"engine vs ours: {pr['residual']['tokens_differing']} tokens differ, max abs "
                      f"{_g(pr['residual']['max_abs'])}; fraction of the gap explained "
                      f"{_g(pr['fraction_explained'])}; {kept}")
    Console(stderr=False, width=120).print(table)


def run(rollout: Path, trainer: Path, output_dir: Path, options: ParityOptions) -> dict[str, Any]:
    """Build, validate and write the report; raises :class:`ParityError` with nothing written.
    What can be refused without the logits is refused first (the backend, an output directory
    that is a file)."""
    _check_backend(options.backend)
    if output_dir.exists() and not output_dir.is_dir():
        raise ParityError(f"--output-dir {output_dir} exists and is not a directory; name a directory "
                          "(it is made if missing)")
    report = build_report(rollout, trainer, options)
    try:
        schemas.require_valid(report, SCHEMA, what=str(output_dir / PARITY_JSON))
        text = jsonio.dumps(report)
    except (schemas.ArtifactSchemaError, jsonio.StrictJSONError) as exc:
        raise ParityError(str(exc)) from None
    png = render_png(report)
    output_dir.mkdir(parents=True, exist_ok=True)
    jsonio.atomic_write_bytes(output_dir / PARITY_PNG, png)
    jsonio.atomic_write_text(output_dir / PARITY_JSON, text)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parity_parser().parse_args(list(argv) if argv is not None else None)
    try:
        options = ParityOptions(args.backend, args.num_vocab_tiles, tuple(args.ratio_bounds))
        report = run(args.rollout, args.trainer, args.output_dir, options)
    except ParityError as exc:
        print(f"parity: refused, nothing written: {exc}", file=sys.stderr)
        return 2
    print_table(report)
    if report["verdict"] == "bitwise_equal":
        return 0
    if args.difference_exit_code == 0:
        print(f"parity: the report shows a difference (verdict {report['verdict']!r}); exit 0 as asked "
              "(--difference-exit-code 0): a difference is a finding, recorded in parity.json")
    return int(args.difference_exit_code)


__all__ = ["Panel", "ParityError", "ParityOptions", "Tokens", "build_figure", "build_report", "check_pair",
           "check_same_tokens", "compute", "figure_panels", "headline", "main", "run", "vocab_tiles"]
