"""The GRPO loss contract: a frozen, validated description of one rank's part of one loss call.

It nests the :class:`~rl_engine.logprob.contract.LogprobContract` of the rank's logprob
call (vocabulary shard, tile count, CP token layout, logits dtype) and adds what GRPO needs:

* the sequence layout: ``num_sequences`` global sequences of ``logprob.seq_len`` positions,
  cut into contiguous GRPO groups of ``group_size`` (sequence ``s`` is in group
  ``s // group_size``), and split over ``dp_world_size`` DP ranks by ``dp_sequence_bounds``:
  half-open, contiguous in DP rank order, covering ``[0, num_sequences)``, any sizes
  (a DP shard need not hold whole groups: advantages come from the gathered global
  reward vector). The default is an even split. The nested logprob contract describes the
  rank's local sequences, so its ``num_sequences`` equals this DP rank's share;
* the objective: PPO-style clipping ``min(r A, clip(r, 1 - clip_eps_low, 1 + clip_eps_high) A)``,
  advantages from group rewards (``group_mean_std``: ``(r - mean) / (std + adv_eps)`` with the
  unbiased (n - 1) standard deviation of the group and ``adv_eps > 0`` added to the standard
  deviation, never the variance, so a group of equal rewards gets advantage exactly 0;
  ``group_mean``: ``r - mean``, no epsilon), a KL penalty ``beta * KL(policy || reference)``
  with the ``k3`` (``exp(q - p) - (q - p) - 1``) or ``k1`` (``p - q``) per-token estimator;
* the reduction: ``token_mean`` (sum over every active token of the global batch divided by
  their count), ``sequence_mean`` (each sequence's mean over its active tokens, then the mean
  over sequences) or ``constant`` (the global sum divided by ``constant_normalizer``);
* FP32 accumulation and the fixed summation order (pairwise fold whose grouping depends only
  on the global sizes; see :mod:`rl_engine.grpo.objective`).

:meth:`GRPOContract.cross_rank_fingerprint` leaves out the rank-local fields, so every rank of
one call must produce the same value; the loss op checks that before any numerical collective.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from rl_engine.distributed.bounds import token_indices
from rl_engine.distributed.mesh import ParallelDims
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.validators import choice_problem, finite_float, int_problem, require, shown

ADVANTAGE_MODES: tuple[str, ...] = ("group_mean_std", "group_mean")
KL_ESTIMATORS: tuple[str, ...] = ("k3", "k1")
REDUCTIONS: tuple[str, ...] = ("token_mean", "sequence_mean", "constant")
ACCUMULATION_DTYPE = "fp32"
SUMMATION_ORDER = "global_token_order_pairwise_fold"
DEFAULT_ADV_EPS = 1e-6
# Fields of the nested logprob contract that differ between ranks of one call. The local
# ``num_sequences`` follows from ``dp_sequence_bounds``, which the fingerprint does hold.
LOGPROB_RANK_LOCAL_FIELDS: frozenset[str] = frozenset({"tp_rank", "cp_rank", "num_sequences"})
RANK_LOCAL_FIELDS: frozenset[str] = frozenset({"dp_rank"})


class GRPOContractError(ValueError):
    """A GRPO loss call that cannot be made as described; names the field, the value and the fix."""


def _require_int(name: str, value: Any, minimum: int) -> None:
    require(int_problem(name, value, minimum), GRPOContractError)


def _require_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GRPOContractError(
            f"{name}={value!r} must be a real number (got {type(value).__name__})"
        )
    number = finite_float(value)  # None for NaN, an infinity and an integer beyond binary64 (10**400)
    if number is None:
        beyond = " (an integer beyond binary64's range, about 1.8e308, has no float value)" if isinstance(value, int) else ""
        raise GRPOContractError(f"{name}={shown(value)} must be finite{beyond}")
    return number


def _require_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    require(choice_problem(name, value, choices), GRPOContractError)


def even_sequence_split(num_sequences: int, dp: int) -> tuple[tuple[int, int], ...]:
    """Equal contiguous DP shards of ``[0, num_sequences)``; ``dp`` must divide the count."""
    if num_sequences % dp != 0:
        raise GRPOContractError(
            f"num_sequences={num_sequences} cannot be split evenly over dp_world_size={dp}; "
            f"give dp_sequence_bounds explicitly or use a multiple of {dp} sequences"
        )
    per = num_sequences // dp
    return tuple((r * per, (r + 1) * per) for r in range(dp))


def resolve_sequence_split(
    bounds: Any, num_sequences: int, dp: int
) -> tuple[tuple[int, int], ...]:
    """Explicit DP shards checked, or the even split when ``bounds`` is None."""
    if bounds is None:
        return even_sequence_split(num_sequences, dp)
    try:
        pairs = tuple(tuple(int(v) for v in pair) for pair in bounds)
    except (TypeError, ValueError):
        raise GRPOContractError(
            f"dp_sequence_bounds={bounds!r} must be a sequence of (start, end) integer pairs"
        ) from None
    check_sequence_split(pairs, num_sequences, dp)
    return pairs


def check_sequence_split(
    bounds: tuple[tuple[int, int], ...], num_sequences: int, dp: int
) -> None:
    """DP shards must be non-empty, contiguous in rank order and cover every sequence."""
    if len(bounds) != dp:
        raise GRPOContractError(
            f"dp_sequence_bounds has {len(bounds)} shards but dp_world_size={dp}; give one "
            "(start, end) pair per DP rank"
        )
    expected = 0
    for rank, pair in enumerate(bounds):
        if len(pair) != 2:
            raise GRPOContractError(
                f"dp_sequence_bounds[{rank}]={pair!r} must be a (start, end) pair"
            )
        start, end = pair
        if start != expected:
            raise GRPOContractError(
                f"dp_sequence_bounds[{rank}] starts at {start} but must start at {expected}: "
                "DP shards are half-open, contiguous and in DP rank order"
            )
        if end <= start:
            raise GRPOContractError(
                f"dp_sequence_bounds[{rank}]=({start}, {end}) is empty; every DP rank needs at "
                "least one sequence"
            )
        expected = end
    if expected != num_sequences:
        raise GRPOContractError(
            f"dp_sequence_bounds end at {expected} but must cover [0, num_sequences="
            f"{num_sequences})"
        )


@dataclass(frozen=True)
class GRPOContract:
    """One rank's view of one GRPO loss call over a TP x CP x DP mesh (TP fastest).

    ``logprob`` is this rank's logprob contract (its ``num_sequences`` is the DP share);
    ``dp_rank`` of ``dp_world_size`` holds global sequences ``dp_sequence_bounds[dp_rank]``.
    """

    logprob: LogprobContract
    num_sequences: int
    group_size: int
    dp_world_size: int = 1
    dp_rank: int = 0
    dp_sequence_bounds: tuple[tuple[int, int], ...] | None = None
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    advantage_mode: str = "group_mean_std"
    adv_eps: float | None = None
    kl_estimator: str = "k3"
    beta: float = 0.0
    reduction: str = "token_mean"
    constant_normalizer: float | None = None
    accumulation_dtype: str = ACCUMULATION_DTYPE
    summation_order: str = SUMMATION_ORDER
    _global_token_indices: tuple[int, ...] = field(
        default=(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self._check_batch()
        self._check_clip()
        self._check_advantage()
        self._check_kl()
        self._check_reduction()
        _require_choice("accumulation_dtype", self.accumulation_dtype, (ACCUMULATION_DTYPE,))
        _require_choice("summation_order", self.summation_order, (SUMMATION_ORDER,))
        start = self.dp_sequence_bounds[self.dp_rank][0]
        seq_len = self.logprob.seq_len
        indices = tuple(start * seq_len + i for i in self.logprob.token_indices)
        object.__setattr__(self, "_global_token_indices", indices)

    def _check_batch(self) -> None:
        """The nested logprob contract, the batch's groups and this rank's DP share of it."""
        if not isinstance(self.logprob, LogprobContract):
            raise GRPOContractError(
                f"logprob={self.logprob!r} must be a LogprobContract; build it for this "
                "rank's local sequences (or use GRPOContract.build)"
            )
        _require_int("num_sequences", self.num_sequences, 1)
        _require_int("group_size", self.group_size, 2)
        _require_int("dp_world_size", self.dp_world_size, 1)
        _require_int("dp_rank", self.dp_rank, 0)
        if self.dp_rank >= self.dp_world_size:
            raise GRPOContractError(
                f"dp_rank={self.dp_rank} must be < dp_world_size={self.dp_world_size}"
            )
        if self.num_sequences % self.group_size != 0:
            raise GRPOContractError(
                f"group_size={self.group_size} does not divide num_sequences="
                f"{self.num_sequences}; GRPO groups are contiguous runs of group_size "
                "sequences: pad the batch to whole groups or change group_size"
            )
        bounds = resolve_sequence_split(
            self.dp_sequence_bounds, self.num_sequences, self.dp_world_size
        )
        object.__setattr__(self, "dp_sequence_bounds", bounds)
        start, end = bounds[self.dp_rank]
        if self.logprob.num_sequences != end - start:
            raise GRPOContractError(
                f"logprob.num_sequences={self.logprob.num_sequences} but dp_rank={self.dp_rank} "
                f"holds sequences [{start}, {end}) ({end - start}); build the nested logprob "
                f"contract with num_sequences={end - start}"
            )

    def _check_clip(self) -> None:
        low = _require_real("clip_eps_low", self.clip_eps_low)
        high = _require_real("clip_eps_high", self.clip_eps_high)
        if not 0.0 <= low < 1.0:
            raise GRPOContractError(
                f"clip_eps_low={self.clip_eps_low} must lie in [0, 1) so the lower clip bound "
                "1 - clip_eps_low stays positive; use e.g. 0.2"
            )
        if high < 0.0:
            raise GRPOContractError(
                f"clip_eps_high={self.clip_eps_high} must be >= 0; use e.g. 0.2 (or 0.28)"
            )
        object.__setattr__(self, "clip_eps_low", low)
        object.__setattr__(self, "clip_eps_high", high)

    def _check_advantage(self) -> None:
        _require_choice("advantage_mode", self.advantage_mode, ADVANTAGE_MODES)
        if self.advantage_mode == "group_mean_std":
            eps = DEFAULT_ADV_EPS if self.adv_eps is None else _require_real("adv_eps", self.adv_eps)
            if eps <= 0.0:
                raise GRPOContractError(
                    f"adv_eps={self.adv_eps} must be > 0 with advantage_mode='group_mean_std' "
                    "(it keeps a group of equal rewards at advantage 0 instead of 0/0); "
                    f"use e.g. {DEFAULT_ADV_EPS}"
                )
            object.__setattr__(self, "adv_eps", eps)
        elif self.adv_eps is not None:
            raise GRPOContractError(
                f"adv_eps={self.adv_eps} is set but advantage_mode='group_mean' uses no "
                "epsilon; remove adv_eps or use advantage_mode='group_mean_std'"
            )

    def _check_kl(self) -> None:
        _require_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        beta = _require_real("beta", self.beta)
        if beta < 0.0:
            raise GRPOContractError(f"beta={self.beta} must be >= 0 (0 disables the KL penalty)")
        object.__setattr__(self, "beta", beta)

    def _check_reduction(self) -> None:
        _require_choice("reduction", self.reduction, REDUCTIONS)
        if self.reduction == "constant":
            if self.constant_normalizer is None:
                raise GRPOContractError(
                    "constant_normalizer=None but reduction='constant' needs it; set it to the "
                    "fixed divisor of the summed token loss (e.g. num_sequences * max_tokens)"
                )
            norm = _require_real("constant_normalizer", self.constant_normalizer)
            if norm <= 0.0:
                raise GRPOContractError(
                    f"constant_normalizer={self.constant_normalizer} must be > 0"
                )
            object.__setattr__(self, "constant_normalizer", norm)
        elif self.constant_normalizer is not None:
            raise GRPOContractError(
                f"constant_normalizer={self.constant_normalizer} is set but reduction="
                f"{self.reduction!r} does not use it; remove it or use reduction='constant'"
            )

    # ----- construction -----------------------------------------------------------------
    @classmethod
    def build(
        cls,
        *,
        num_sequences: int,
        seq_len: int,
        group_size: int,
        logprob: Mapping[str, Any],
        dp_world_size: int = 1,
        dp_rank: int = 0,
        dp_sequence_bounds: tuple[tuple[int, int], ...] | None = None,
        **objective: Any,
    ) -> "GRPOContract":
        """Build the rank's contract from global sizes; ``logprob`` holds the other logprob fields.

        The nested contract gets ``num_sequences`` = this DP rank's share and ``seq_len``.
        """
        for key in ("num_sequences", "seq_len"):
            if key in logprob:
                raise GRPOContractError(
                    f"logprob[{key!r}] is derived from the GRPO sequence layout; pass "
                    f"{key}= to GRPOContract.build instead"
                )
        _require_int("num_sequences", num_sequences, 1)
        _require_int("dp_world_size", dp_world_size, 1)
        _require_int("dp_rank", dp_rank, 0)
        if dp_rank >= dp_world_size:
            raise GRPOContractError(f"dp_rank={dp_rank} must be < dp_world_size={dp_world_size}")
        bounds = resolve_sequence_split(dp_sequence_bounds, num_sequences, dp_world_size)
        start, end = bounds[dp_rank]
        try:
            nested = LogprobContract(num_sequences=end - start, seq_len=seq_len, **logprob)
        except LogprobContractError as exc:
            raise GRPOContractError(f"logprob: {exc}") from None
        return cls(
            logprob=nested,
            num_sequences=num_sequences,
            group_size=group_size,
            dp_world_size=dp_world_size,
            dp_rank=dp_rank,
            dp_sequence_bounds=bounds,
            **objective,
        )

    # ----- derived geometry -------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        return self.logprob.seq_len

    @property
    def num_groups(self) -> int:
        return self.num_sequences // self.group_size

    @property
    def tp_world_size(self) -> int:
        return self.logprob.tp_world_size

    @property
    def cp_world_size(self) -> int:
        return self.logprob.cp_world_size

    @property
    def world_size(self) -> int:
        return self.dp_world_size * self.cp_world_size * self.tp_world_size

    @property
    def dims(self) -> ParallelDims:
        """The loss's (dp, cp, tp) world as the mesh's one definition of rank coordinates."""
        return ParallelDims(dp=self.dp_world_size, cp=self.cp_world_size, tp=self.tp_world_size,
                            world_size=self.world_size)

    def rank_of(self, dp_rank: int, cp_rank: int, tp_rank: int) -> int:
        """Rank in the loss's world group (TP fastest): :meth:`ParallelDims.rank_of`."""
        return self.dims.rank_of(dp_rank, cp_rank, tp_rank)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, cp_rank, tp_rank)`` of a rank of the world group: :meth:`ParallelDims.coords`."""
        return self.dims.coords(rank)

    @property
    def rank(self) -> int:
        return self.rank_of(self.dp_rank, self.logprob.cp_rank, self.logprob.tp_rank)

    @property
    def sequence_range(self) -> tuple[int, int]:
        """Half-open range of global sequences held by this DP rank."""
        assert self.dp_sequence_bounds is not None
        return self.dp_sequence_bounds[self.dp_rank]

    @property
    def local_num_sequences(self) -> int:
        start, end = self.sequence_range
        return end - start

    @property
    def num_tokens(self) -> int:
        """Local token rows (this DP rank's sequences, this CP rank's positions)."""
        return self.logprob.num_tokens

    @property
    def global_num_tokens(self) -> int:
        return self.num_sequences * self.seq_len

    @property
    def global_token_indices(self) -> tuple[int, ...]:
        """Global flat token index (``sequence * seq_len + position``) of each local row."""
        return self._global_token_indices

    def rank_token_indices(self, rank: int) -> tuple[int, ...]:
        """Global token indices held by any rank of the world group, in its local row order."""
        dp_rank, cp_rank, _ = self.coords(rank)
        assert self.dp_sequence_bounds is not None
        start, end = self.dp_sequence_bounds[dp_rank]
        return token_indices(
            range(start, end),
            self.seq_len,
            self.cp_world_size,
            cp_rank,
            self.logprob.cp_layout,
        )

    # ----- serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field (the nested logprob contract included), JSON-ready."""
        assert self.dp_sequence_bounds is not None
        return {
            "logprob": self.logprob.to_dict(),
            "num_sequences": self.num_sequences,
            "seq_len": self.seq_len,
            "group_size": self.group_size,
            "dp_world_size": self.dp_world_size,
            "dp_rank": self.dp_rank,
            "dp_sequence_bounds": [list(pair) for pair in self.dp_sequence_bounds],
            "clip_eps_low": self.clip_eps_low,
            "clip_eps_high": self.clip_eps_high,
            "advantage_mode": self.advantage_mode,
            "adv_eps": self.adv_eps,
            "kl_estimator": self.kl_estimator,
            "beta": self.beta,
            "reduction": self.reduction,
            "constant_normalizer": self.constant_normalizer,
            "accumulation_dtype": self.accumulation_dtype,
            "summation_order": self.summation_order,
        }

    def shared_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` without the rank-local fields (what every rank must agree on)."""
        shared = {k: v for k, v in self.to_dict().items() if k not in RANK_LOCAL_FIELDS}
        shared["logprob"] = {
            k: v for k, v in shared["logprob"].items() if k not in LOGPROB_RANK_LOCAL_FIELDS
        }
        return shared

    def cross_rank_fingerprint(self) -> str:
        """SHA-256 of the canonical JSON of :meth:`shared_dict`; equal on every rank of a call."""
        canonical = json.dumps(
            self.shared_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False
        )
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


__all__ = [
    "ADVANTAGE_MODES",
    "DEFAULT_ADV_EPS",
    "GRPOContract",
    "GRPOContractError",
    "KL_ESTIMATORS",
    "REDUCTIONS",
    "SUMMATION_ORDER",
    "check_sequence_split",
    "even_sequence_split",
    "resolve_sequence_split",
]
