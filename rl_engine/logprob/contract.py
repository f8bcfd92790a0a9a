"""The logprob contract: a frozen, validated description of one selected-token logprob call.

The contract is the numerical identity of a call. Everything that can change the output
bits (vocabulary sizes, the tile count, the shard bounds, the dtype, the token layout)
lives here and in :meth:`LogprobContract.cross_rank_fingerprint`, so ranks that disagree
are caught by the op's agreement step (:mod:`rl_engine.logprob.agreement`) before any
numerical collective.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_engine.arith.temperature import TemperatureError, inverse_temperature, temperature32
from rl_engine.distributed.bounds import (
    AUTO_TILES,
    CP_LAYOUTS,
    BoundsError,
    auto_vocab_tiles,
    check_cp_split,
    check_vocab_shards,
    even_vocab_shards,
    grid_tile_width,
    token_indices,
)
from rl_engine.logprob.errors import LogprobContractError
from rl_engine.logprob.storage import require_readable
from rl_engine.tables import DTYPES, MAX_TP, TORCH_DTYPE_NAMES
from rl_engine.validators import choice_problem, int_problem, require

LOGITS_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, TORCH_DTYPE_NAMES[name]) for name in DTYPES}
DETERMINISM_SCOPES: tuple[str, ...] = ("cross_tp_bitwise", "fixed_topology")
MASK_MODES: tuple[str, ...] = ("explicit",)
ACCUMULATION_DTYPE = "fp32"
OUTPUT_DTYPE = "fp32"
# Fields that differ between ranks of one call; left out of the cross-rank fingerprint.
RANK_LOCAL_FIELDS: frozenset[str] = frozenset({"tp_rank", "cp_rank"})


def _require_int(name: str, value: Any, minimum: int) -> None:
    require(int_problem(name, value, minimum), LogprobContractError)


def _require_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    require(choice_problem(name, value, choices), LogprobContractError)


def _shard_bounds(value: Any) -> tuple[tuple[int, int], ...]:
    """``vocab_shard_bounds`` as a tuple of integer pairs; anything else is an error, not cast."""
    try:
        pairs = [tuple(pair) for pair in value]
    except TypeError:
        raise LogprobContractError(
            f"vocab_shard_bounds={value!r} must be a sequence of (start, end) integer pairs, "
            "one per TP rank, or None for the even tile-aligned split"
        ) from None
    for rank, pair in enumerate(pairs):
        integers = all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in pair)
        if len(pair) != 2 or not integers:
            raise LogprobContractError(
                f"vocab_shard_bounds[{rank}]={pair!r} must be a (start, end) pair of integers"
            )
    return tuple((int(pair[0]), int(pair[1])) for pair in pairs)


@dataclass(frozen=True)
class LogprobContract:
    """One rank's view of one vocab-parallel, context-parallel selected-token logprob call.

    Vocabulary: TP rank ``tp_rank`` of ``tp_world_size`` holds columns
    ``vocab_shard_bounds[tp_rank]`` of the padded vocabulary; columns ``>= real_vocab_size``
    are padding. ``vocab_shard_bounds`` defaults to an even tile-aligned split.

    Tokens: ``num_sequences`` sequences of ``seq_len`` positions; CP rank ``cp_rank`` of
    ``cp_world_size`` holds the positions its ``cp_layout`` gives it in every sequence
    (``contiguous``: chunk r of CP; ``zigzag``: chunks r and 2*CP-1-r of 2*CP).
    """

    real_vocab_size: int
    padded_vocab_size: int
    num_vocab_tiles: int
    num_sequences: int
    seq_len: int
    tp_world_size: int = 1
    tp_rank: int = 0
    vocab_shard_bounds: tuple[tuple[int, int], ...] | None = None
    cp_world_size: int = 1
    cp_rank: int = 0
    cp_layout: str = "contiguous"
    logits_dtype: str = "bf16"
    mask_mode: str = "explicit"
    ignore_index: int = -100
    determinism_scope: str = "cross_tp_bitwise"
    accumulation_dtype: str = ACCUMULATION_DTYPE
    output_dtype: str = OUTPUT_DTYPE
    temperature: float = 1.0  # docs/arithmetic.md section 6 step 0 (rl_engine.arith.temperature)
    _token_indices: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _require_int("real_vocab_size", self.real_vocab_size, 1)
        _require_int("padded_vocab_size", self.padded_vocab_size, 1)
        _require_int("num_vocab_tiles", self.num_vocab_tiles, 1)
        _require_int("num_sequences", self.num_sequences, 1)
        _require_int("seq_len", self.seq_len, 1)
        _require_int("tp_world_size", self.tp_world_size, 1)
        _require_int("tp_rank", self.tp_rank, 0)
        _require_int("cp_world_size", self.cp_world_size, 1)
        _require_int("cp_rank", self.cp_rank, 0)
        try:
            temperature32(self.temperature)
        except TemperatureError as exc:
            raise LogprobContractError(str(exc)) from None
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise LogprobContractError(f"ignore_index={self.ignore_index!r} must be an integer")
        if 0 <= self.ignore_index < self.real_vocab_size:
            raise LogprobContractError(
                f"ignore_index={self.ignore_index} is a real vocabulary id (inside [0, "
                f"real_vocab_size={self.real_vocab_size})), so it could not tell ignored rows "
                "from real targets; use a value outside that range, e.g. -100"
            )
        if self.real_vocab_size > self.padded_vocab_size:
            raise LogprobContractError(
                f"real_vocab_size={self.real_vocab_size} exceeds padded_vocab_size="
                f"{self.padded_vocab_size}; the padded vocabulary must be >= the real one"
            )
        try:
            grid_tile_width(self.padded_vocab_size, self.num_vocab_tiles)
        except BoundsError as exc:
            raise LogprobContractError(str(exc).replace("padded_vocab=", "padded_vocab_size=")) from None
        if self.tp_rank >= self.tp_world_size:
            raise LogprobContractError(
                f"tp_rank={self.tp_rank} must be < tp_world_size={self.tp_world_size}"
            )
        if self.cp_rank >= self.cp_world_size:
            raise LogprobContractError(
                f"cp_rank={self.cp_rank} must be < cp_world_size={self.cp_world_size}"
            )
        if self.tp_world_size > self.num_vocab_tiles:
            raise LogprobContractError(
                f"tp_world_size={self.tp_world_size} exceeds num_vocab_tiles="
                f"{self.num_vocab_tiles}; every TP rank needs at least one whole tile"
            )
        _require_choice("cp_layout", self.cp_layout, CP_LAYOUTS)
        _require_choice("logits_dtype", self.logits_dtype, tuple(LOGITS_DTYPES))
        _require_choice("mask_mode", self.mask_mode, MASK_MODES)
        _require_choice("determinism_scope", self.determinism_scope, DETERMINISM_SCOPES)
        _require_choice("accumulation_dtype", self.accumulation_dtype, (ACCUMULATION_DTYPE,))
        _require_choice("output_dtype", self.output_dtype, (OUTPUT_DTYPE,))
        try:
            if self.vocab_shard_bounds is None:
                if self.num_vocab_tiles % self.tp_world_size:
                    raise LogprobContractError(
                        f"tp_world_size={self.tp_world_size} does not divide num_vocab_tiles="
                        f"{self.num_vocab_tiles}, so the even split would not be tile aligned; "
                        "use a TP degree that divides the tile count or give vocab_shard_bounds"
                    )
                bounds = even_vocab_shards(
                    self.padded_vocab_size, self.num_vocab_tiles, self.tp_world_size
                )
            else:
                bounds = _shard_bounds(self.vocab_shard_bounds)
                if len(bounds) != self.tp_world_size:
                    raise BoundsError(
                        f"vocab_shard_bounds has {len(bounds)} shards but tp_world_size="
                        f"{self.tp_world_size}; give one (start, end) pair per TP rank"
                    )
                check_vocab_shards(bounds, self.padded_vocab_size, self.num_vocab_tiles)
            check_cp_split(self.seq_len, self.cp_world_size, self.cp_layout)
            indices = token_indices(
                range(self.num_sequences),
                self.seq_len,
                self.cp_world_size,
                self.cp_rank,
                self.cp_layout,
            )
        except BoundsError as exc:
            raise LogprobContractError(str(exc)) from None
        object.__setattr__(self, "vocab_shard_bounds", bounds)
        object.__setattr__(self, "_token_indices", indices)

    @classmethod
    def from_mesh(
        cls,
        mesh: Any,
        *,
        real_vocab_size: int,
        num_sequences: int,
        seq_len: int,
        num_vocab_tiles: int | str = AUTO_TILES,
        padded_vocab_size: int | None = None,
        max_tp: int = MAX_TP,
        **fields: Any,
    ) -> "LogprobContract":
        """This rank's contract on ``mesh`` (:func:`rl_engine.distributed.mesh.init_mesh`).

        The TP and CP degrees and this rank's coordinates come from the mesh, so they are
        never typed twice. ``padded_vocab_size`` defaults to ``real_vocab_size``; every other
        field (``cp_layout``, ``logits_dtype``, ``vocab_shard_bounds``, ...) passes through.
        ``num_sequences`` counts the sequences this rank's DP shard holds. ``num_vocab_tiles``
        defaults to ``"auto"``: :func:`rl_engine.distributed.bounds.auto_vocab_tiles` of the
        padded vocabulary and ``max_tp`` (default 8), the count ``selected_logprob`` takes too,
        so every TP degree dividing ``max_tp`` computes with the same tiles.
        """
        taken = sorted(set(fields) & {"tp_world_size", "tp_rank", "cp_world_size", "cp_rank"})
        if taken:
            raise LogprobContractError(
                f"from_mesh takes {taken} from the mesh; do not pass them (or build the "
                "contract with LogprobContract(...) directly)"
            )
        try:
            tp, cp = mesh.dims.tp, mesh.dims.cp
            tp_rank, cp_rank = mesh.tp_rank, mesh.cp_rank
        except AttributeError:
            raise LogprobContractError(
                f"mesh={mesh!r} is not a mesh: pass the one init_mesh(...) returned"
            ) from None
        padded = real_vocab_size if padded_vocab_size is None else padded_vocab_size
        if num_vocab_tiles == AUTO_TILES:
            if isinstance(max_tp, int) and not isinstance(max_tp, bool) and max_tp >= 1 and max_tp % tp:
                raise LogprobContractError(
                    f"the mesh's tp={tp} does not divide max_tp={max_tp}, so num_vocab_tiles='auto' "
                    f"would not split evenly; pass max_tp as a multiple of {tp} (the largest TP degree "
                    "the run uses) or give num_vocab_tiles")
            try:
                num_vocab_tiles = auto_vocab_tiles(padded, max_tp)
            except BoundsError as exc:
                raise LogprobContractError(str(exc)) from None
        return cls(
            real_vocab_size=real_vocab_size,
            padded_vocab_size=padded,
            num_vocab_tiles=num_vocab_tiles,
            num_sequences=num_sequences,
            seq_len=seq_len,
            tp_world_size=tp,
            tp_rank=tp_rank,
            cp_world_size=cp,
            cp_rank=cp_rank,
            **fields,
        )

    # ----- derived geometry -------------------------------------------------------------
    @property
    def tile_width(self) -> int:
        """``w = ceil(padded_vocab_size / num_vocab_tiles)`` (docs/arithmetic.md section 6): the
        quotient where the count divides the vocabulary; otherwise the last tile ends past it."""
        return -(-self.padded_vocab_size // self.num_vocab_tiles)

    @property
    def vocab_start(self) -> int:
        assert self.vocab_shard_bounds is not None
        return self.vocab_shard_bounds[self.tp_rank][0]

    @property
    def vocab_end(self) -> int:
        assert self.vocab_shard_bounds is not None
        return self.vocab_shard_bounds[self.tp_rank][1]

    @property
    def local_vocab_size(self) -> int:
        return self.vocab_end - self.vocab_start

    @property
    def local_tiles(self) -> tuple[int, int]:
        """Half-open range of global tile indices this TP rank computes."""
        return self.vocab_start // self.tile_width, -(-self.vocab_end // self.tile_width)

    @property
    def local_tile_count(self) -> int:
        """Tiles this TP rank computes."""
        first, end = self.local_tiles
        return end - first

    @property
    def local_grid_width(self) -> int:
        """Columns of this rank's whole tiles: ``local_vocab_size``, plus the grid's padding past the
        vocabulary on the rank holding the last tile when the tiles do not divide it (those columns
        are never stored: they read as ``-inf``)."""
        return self.local_tile_count * self.tile_width

    @property
    def token_indices(self) -> tuple[int, ...]:
        """Global flat token indices of the local rows, in local row order."""
        return self._token_indices

    @property
    def num_tokens(self) -> int:
        return len(self._token_indices)

    @property
    def global_num_tokens(self) -> int:
        return self.num_sequences * self.seq_len

    @property
    def torch_dtype(self) -> torch.dtype:
        return LOGITS_DTYPES[self.logits_dtype]

    # ----- serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field plus derived local geometry, JSON-ready (for reports)."""
        assert self.vocab_shard_bounds is not None
        return {
            "real_vocab_size": self.real_vocab_size,
            "padded_vocab_size": self.padded_vocab_size,
            "num_vocab_tiles": self.num_vocab_tiles,
            "tile_width": self.tile_width,
            "num_sequences": self.num_sequences,
            "seq_len": self.seq_len,
            "tp_world_size": self.tp_world_size,
            "tp_rank": self.tp_rank,
            "vocab_shard_bounds": [list(pair) for pair in self.vocab_shard_bounds],
            "cp_world_size": self.cp_world_size,
            "cp_rank": self.cp_rank,
            "cp_layout": self.cp_layout,
            "logits_dtype": self.logits_dtype,
            "mask_mode": self.mask_mode,
            "ignore_index": self.ignore_index,
            "determinism_scope": self.determinism_scope,
            "accumulation_dtype": self.accumulation_dtype,
            "output_dtype": self.output_dtype,
            # only when not 1: the dict (and every fingerprint of it) of a call without a temperature is unchanged
            **({"temperature": float(self.temperature)} if self.tempered else {}),
        }

    @property
    def temperature32(self) -> float:
        """``T32 = RN32(temperature)``, the divisor of section 6 step 0; 1.0 without a temperature."""
        return temperature32(self.temperature)

    @property
    def tempered(self) -> bool:
        """Whether section 6 step 0 divides (``T32 != 1``); without it the step is skipped."""
        return self.temperature32 != 1.0

    @property
    def inverse_temperature(self) -> float:
        """``r = RN32(1 / T32)``: not a step of the specification, the Triton kernels' reciprocal for
        Markstein's exact division (docs/arithmetic.md section 6 step 0); 1.0 without a temperature."""
        return inverse_temperature(self.temperature)

    def cross_rank_fingerprint(self) -> str:
        """SHA-256 of the canonical JSON of every field shared by all ranks of the call."""
        shared = {k: v for k, v in self.to_dict().items() if k not in RANK_LOCAL_FIELDS}
        canonical = json.dumps(shared, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def tp_group_fingerprint(self) -> str:
        """Fingerprint that ranks of one TP group must share: the call plus their tokens."""
        digest = hashlib.sha256(self.cross_rank_fingerprint().encode("ascii"))
        digest.update(f"cp_rank={self.cp_rank}".encode("ascii"))
        return digest.hexdigest()

    # ----- tensor checks ----------------------------------------------------------------
    def check_inputs(
        self, logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor
    ) -> None:
        """Shape, dtype, device and memory checks that need no reduction over the data.

        Memory (:func:`rl_engine.logprob.storage.require_readable`): strided layout, real
        storage, every element inside it; what compiled code and collectives read.
        """
        for name, value in (("logits", logits), ("targets", targets), ("active", active)):
            if not isinstance(value, torch.Tensor):
                raise LogprobContractError(
                    f"{name} must be a torch.Tensor, got {type(value).__name__}"
                )
        expected = (self.num_tokens, self.local_vocab_size)
        if logits.dim() != 2 or tuple(logits.shape) != expected:
            raise LogprobContractError(
                f"logits.shape={tuple(logits.shape)} must be [num_tokens, local_vocab]="
                f"{list(expected)} for tp_rank={self.tp_rank} (columns "
                f"[{self.vocab_start}, {self.vocab_end})) and cp_rank={self.cp_rank}"
            )
        if logits.dtype != self.torch_dtype:
            raise LogprobContractError(
                f"logits.dtype={logits.dtype} does not match logits_dtype={self.logits_dtype!r}; "
                f"cast the logits to {self.torch_dtype} or declare the dtype in the contract"
            )
        if targets.dtype != torch.int64 or tuple(targets.shape) != (self.num_tokens,):
            raise LogprobContractError(
                f"targets must be int64 of shape [{self.num_tokens}], got dtype={targets.dtype} "
                f"shape={tuple(targets.shape)}"
            )
        if active.dtype != torch.bool or tuple(active.shape) != (self.num_tokens,):
            raise LogprobContractError(
                f"active mask must be bool of shape [{self.num_tokens}], got dtype={active.dtype} "
                f"shape={tuple(active.shape)}"
            )
        for name, tensor in (("targets", targets), ("active", active)):
            if tensor.device != logits.device:
                raise LogprobContractError(
                    f"{name}.device={tensor.device} differs from logits.device={logits.device}; "
                    "move every input to the same device"
                )
        for name, tensor in (("logits", logits), ("targets", targets), ("active", active)):
            require_readable(name, tensor)

    def check_targets(self, targets: torch.Tensor, active: torch.Tensor) -> None:
        """Active targets must be real vocabulary ids (one host sync)."""
        if self.num_tokens == 0:
            return
        bad = active & ((targets < 0) | (targets >= self.real_vocab_size))
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            value = int(targets[row])
            hint = (
                f"; it equals ignore_index={self.ignore_index}: mark that row inactive"
                if value == self.ignore_index
                else ""
            )
            raise LogprobContractError(
                f"targets[{row}]={value} (global token {self.token_indices[row]}) is an active "
                f"target outside [0, real_vocab_size={self.real_vocab_size}){hint}"
            )
