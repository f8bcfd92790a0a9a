"""Processed logprobs (``docs/arithmetic.md`` section 13): the kept set of top-k, top-p, min-p.

What the sampler keeps is a prefix of the row's key order (column ``c`` precedes ``d`` iff
``x_c > x_d``, or ``x_c == x_d`` and ``c < d``): min-p keeps every column at or above a value,
top-k the first ``k`` of those, top-p the shortest prefix of those whose ``Z`` reaches ``tau``.
So the kept set ``K`` of a row is one *cut* on the key, ``(value, index)``:

    column c is dropped  iff  x_c < value  or  (x_c == value and c > index)

which every engine applies after section 6 step 0 (``x_c := -inf`` where dropped) without
knowing how the cut was found. ``value = -inf, index = KEEP_ALL`` drops nothing (a real ``-inf``
column stays, as in the raw forward; a NaN ``x_c`` is never dropped: both comparisons are false).

The engine interface (what a backend engine sees):

* :class:`Sampling`: the per-row parameters, three tensors of the local rows, int64 ``top_k``
  (0 = off), binary32 ``top_p`` (``p32``, 1 = off) and binary32 ``min_p`` (``mp32``, 0 = off), or
  ``None`` for a call with every parameter off (the raw bytes, no extra pass).
* :meth:`rl_engine.logprob.backends.eager.vocab_parallel.LocalEngine.kept_cut`: the cut of every local row,
  called on every TP rank in the same order (it runs collectives on the TP group); the default
  is :func:`kept_cut` here, torch operations and all-gathers of transport only.
* ``local_partials(..., keep=KeptCut)`` and ``BackwardTerms.keep``: the engine's forward partials
  and gradient on the logits with the dropped columns at ``-inf`` (gradient ``+0`` there).
* ``target_kept`` is not an engine's output: the shared code derives it from the copied target
  logit and the cut (:meth:`KeptCut.dropped` on one column), the same comparison on every rank.

An engine that cannot compute processed logprobs says so (``supports_processed = False``) and
the op refuses the call naming the backend; nothing falls back.
"""

from __future__ import annotations

import hashlib
import numbers
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rl_engine.arith.portable import exp as portable_exp
from rl_engine.arith.portable import log as portable_log
from rl_engine.arith.tiles import fold_sum_, lane_sum, temperature_divisor
from rl_engine.logprob.contract import LogprobContract, LogprobContractError

KEEP_ALL = (1 << 62)  # a cut index above every column id: nothing dropped by the index
_ORD_FLIP = 0x7FFFFFFF
_NONE = torch.iinfo(torch.int64).min  # a key below every column's (not a member)
# Elements of one block of the kept-set search: bounds the FP32 copies of the local logits.
SEARCH_BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Sampling:
    """Per-row sampling parameters of the local rows, as every engine takes them.

    ``top_k`` int64 ``[rows]`` (>= 0; 0 = off), ``top_p`` float32 ``[rows]`` (``p32`` in
    ``(0, 1]``; 1 = off), ``min_p`` float32 ``[rows]`` (``mp32`` in ``[0, 1]``; 0 = off), on the
    logits' device. Validated here (one host sync), before any collective.
    """

    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor

    def __post_init__(self) -> None:
        for name, value, dtype in (("top_k", self.top_k, torch.int64), ("top_p", self.top_p, torch.float32),
                                   ("min_p", self.min_p, torch.float32)):
            if not isinstance(value, torch.Tensor) or value.dtype != dtype or value.dim() != 1:
                got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise LogprobContractError(f"Sampling.{name} must be a 1-D {dtype} tensor (one per row), got {got}")
        rows = self.top_k.shape[0]
        if self.top_p.shape[0] != rows or self.min_p.shape[0] != rows:
            raise LogprobContractError(
                f"Sampling tensors must have one value per row: top_k {rows}, top_p {self.top_p.shape[0]}, "
                f"min_p {self.min_p.shape[0]}")
        if len({self.top_k.device, self.top_p.device, self.min_p.device}) != 1:
            raise LogprobContractError("Sampling tensors must be on one device (the logits')")
        _check_ranges(self.top_k, self.top_p, self.min_p)

    @property
    def rows(self) -> int:
        return int(self.top_k.shape[0])

    def rows_slice(self, start: int, stop: int) -> "Sampling":
        return Sampling(self.top_k[start:stop], self.top_p[start:stop], self.min_p[start:stop])

    def digest(self) -> str:
        """SHA-256 of the three tensors' bytes (the TP peers' agreement record compares it)."""
        h = hashlib.sha256()
        for t in (self.top_k, self.top_p, self.min_p):
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def _first_bad(bad: torch.Tensor) -> int | None:
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None


def _check_ranges(top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> None:
    """Refuse out-of-range values naming the row, the value and the fix (never clamped)."""
    row = _first_bad(top_k < 0)
    if row is not None:
        value = int(top_k[row])
        fix = "pass 0 to turn top-k off (vLLM's -1 means off; here it is 0)" if value == -1 else "pass k >= 0 (0 = off)"
        raise LogprobContractError(f"top_k[{row}]={value} is negative; {fix}")
    row = _first_bad(~((top_p > 0) & (top_p <= 1)))
    if row is not None:
        raise LogprobContractError(
            f"top_p[{row}]={float(top_p[row])!r} (in binary32) is outside (0, 1]; pass 1.0 to turn top-p off")
    row = _first_bad(~((min_p >= 0) & (min_p <= 1)))
    if row is not None:
        raise LogprobContractError(
            f"min_p[{row}]={float(min_p[row])!r} (in binary32) is outside [0, 1]; pass 0.0 to turn min-p off")


def _per_row(name: str, value: Any, lead: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A Python number for every row, or a tensor of shape ``lead``, as a flat ``dtype`` tensor."""
    if isinstance(value, torch.Tensor):
        if tuple(value.shape) != lead:
            raise LogprobContractError(
                f"{name}.shape={tuple(value.shape)} must equal logits.shape[:-1]={lead} (one value per "
                "token), or pass one Python number for every row")
        if dtype == torch.int64:
            if value.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
                raise LogprobContractError(f"{name}.dtype={value.dtype} must be an integer type (never rounded)")
        elif not value.dtype.is_floating_point:
            raise LogprobContractError(f"{name}.dtype={value.dtype} must be a floating type")
        return value.detach().to(device=device, dtype=dtype).reshape(-1)  # RN32 of a float64 value
    if dtype == torch.int64:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise LogprobContractError(f"{name}={value!r} must be an integer >= 0 (0 = off) or a tensor")
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise LogprobContractError(f"{name}={value!r} must be a number or a tensor")
    rows = 1
    for n in lead:
        rows *= n
    return torch.full((rows,), value, dtype=dtype, device=device)


def sampling_from(top_k: Any, top_p: Any, min_p: Any, lead: tuple[int, ...],
                  device: torch.device) -> Sampling | None:
    """The call's :class:`Sampling` for rows of shape ``lead``, or ``None`` when every row has
    every parameter off (``top_k=0``, ``top_p=1``, ``min_p=0``: the raw bytes).

    ``top_p`` and ``min_p`` are rounded once to binary32 (``p32``, ``mp32``); out-of-range values
    raise :class:`LogprobContractError` (vLLM's ``top_k=-1`` with the fix "pass 0")."""
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k == 0 \
            and isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and top_p == 1 \
            and isinstance(min_p, (int, float)) and not isinstance(min_p, bool) and min_p == 0:
        return None
    sampling = Sampling(_per_row("top_k", top_k, lead, torch.int64, device),
                        _per_row("top_p", top_p, lead, torch.float32, device),
                        _per_row("min_p", min_p, lead, torch.float32, device))
    if not active_rows(sampling).any():
        return None
    return sampling


def active_rows(sampling: Sampling) -> torch.Tensor:
    """Rows with at least one parameter on."""
    return (sampling.top_k > 0) | (sampling.top_p < 1) | (sampling.min_p > 0)


@dataclass(frozen=True)
class KeptCut:
    """The kept set of every local row as one cut on the key (module docstring)."""

    value: torch.Tensor  # float32 [rows]
    index: torch.Tensor  # int64 [rows]: a global column id (KEEP_ALL: none dropped by the index)

    def dropped(self, x: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Which of ``x`` (``[rows, n]`` tempered binary32, columns ``cols`` int64 ``[n]`` or
        ``[rows, n]``) the cut drops."""
        v = self.value.unsqueeze(1)
        return (x < v) | ((x == v) & (cols > self.index.unsqueeze(1)))

    def rows_slice(self, start: int, stop: int) -> "KeptCut":
        return KeptCut(self.value[start:stop], self.index[start:stop])


def keep_all(rows: int, device: torch.device) -> KeptCut:
    return KeptCut(torch.full((rows,), float("-inf"), dtype=torch.float32, device=device),
                   torch.full((rows,), KEEP_ALL, dtype=torch.int64, device=device))


# ---- keys ---------------------------------------------------------------------------------
def ordered(x: torch.Tensor) -> torch.Tensor:
    """Binary32 values as int64 keys in their order (``-0`` just below ``+0``; ``-inf`` lowest)."""
    i = x.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(i < 0, i ^ _ORD_FLIP, i)


def from_ordered(o: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`ordered`."""
    i = torch.where(o < 0, o ^ _ORD_FLIP, o).to(torch.int32)
    return i.view(torch.float32)


# ---- transport ----------------------------------------------------------------------------
def _gather(t: torch.Tensor, contract: LogprobContract, group: Any) -> list[torch.Tensor]:
    """Every TP rank's ``t`` (same shape on every rank), in rank order. Transport only."""
    if contract.tp_world_size == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(contract.tp_world_size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _gather_tiles(piece: torch.Tensor, contract: LogprobContract, group: Any) -> torch.Tensor:
    """``[rows, own_tiles]`` of every rank as ``[rows, num_tiles]`` in global tile order."""
    if contract.tp_world_size == 1:
        return piece
    assert contract.vocab_shard_bounds is not None
    width = contract.tile_width
    # whole tiles: the last rank's last tile may reach past the vocabulary (section 6's grid)
    counts = [-(-(end - start) // width) for start, end in contract.vocab_shard_bounds]
    slot = max(counts)
    buf = piece.new_zeros(piece.shape[0], slot)
    buf[:, : piece.shape[1]] = piece
    parts = _gather(buf, contract, group)
    return torch.cat([p[:, :n] for p, n in zip(parts, counts)], dim=1)


# ---- the search ---------------------------------------------------------------------------
def _z(e: torch.Tensor, member: torch.Tensor, tiles: int, width: int, contract: LogprobContract,
       group: Any) -> torch.Tensor:
    """``Z(P)`` of section 13 for every row: ``F`` over the global tiles of the lane sums ``G`` of
    ``e_c`` on the members (``+0`` elsewhere). ``e``/``member``: ``[rows, local_vocab]``."""
    terms = torch.where(member, e, torch.zeros_like(e))
    grid = tiles * width
    if terms.shape[1] < grid:  # the grid's padding past the vocabulary (section 6): +0 terms
        terms = torch.nn.functional.pad(terms, (0, grid - terms.shape[1]))
    sums = lane_sum(terms.view(e.shape[0], tiles, width))
    full = _gather_tiles(sums, contract, group)
    return fold_sum_(full.clone()).clone()


def _top_p_value(e: torch.Tensor, member: torch.Tensor, x: torch.Tensor, tau: torch.Tensor, use: torch.Tensor,
                 cut_v: torch.Tensor, big: torch.Tensor, dtype: torch.dtype, contract: LogprobContract,
                 group: Any, row_t32: torch.Tensor | None = None) -> torch.Tensor:
    """The largest value ``v`` of ``K2`` (``member``) with ``Z(K2 and x >= v) >= tau``, by bisection.

    Binary32 logits: on the binary32 order between the ``K2`` cut and ``B`` (at most 32 steps). A
    16-bit dtype: on the order of the 16-bit inputs ``X`` (16 steps), each step's ``v`` the tempered
    ``RN32(f32(X) / T32)``: the division is monotone and every ``x_c`` is such a value, so the
    largest ``X`` whose ``v`` passes gives the largest passing value of ``K2`` itself. ``row_t32``:
    each row's ``T32`` (a temperature per row) in place of the contract's."""
    if dtype in (torch.bfloat16, torch.float16):
        def value_of(o: torch.Tensor) -> torch.Tensor:
            bits = torch.where(o < 0, o ^ 0x7FFF, o).to(torch.int16)
            v = bits.view(dtype).float()
            if row_t32 is not None:
                return v / row_t32
            divisor = temperature_divisor(contract.temperature32, v.device)
            return v / divisor if divisor is not None else v

        inf16 = torch.tensor([float("-inf"), float("inf")], dtype=dtype, device=x.device).view(torch.int16)
        ends = inf16.to(torch.int64)
        ends = torch.where(ends < 0, ends ^ 0x7FFF, ends)
        lo = torch.where(use, ends[0], torch.zeros_like(ends[0])).expand(x.shape[0]).clone()
        hi = torch.where(use, ends[1], lo)
    else:
        def value_of(o: torch.Tensor) -> torch.Tensor:
            return from_ordered(o)

        lo = torch.where(use, ordered(cut_v), torch.zeros_like(ordered(cut_v)))
        hi = torch.where(use, ordered(big), lo)
    while bool((hi > lo).any()):
        mid = torch.div(lo + hi + 1, 2, rounding_mode="floor")
        ok = _z(e, member & (x >= value_of(mid).unsqueeze(1)), contract.local_grid_width // contract.tile_width,
                contract.tile_width, contract, group) >= tau
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid - 1)
    return value_of(lo)


def _tempered_block(logits: torch.Tensor, contract: LogprobContract,
                    row_t32: torch.Tensor | None = None) -> torch.Tensor:
    """Section 6 step 0 on a block of rows: the exact upcast, divided by ``T32`` (skipped at 1), or by
    each row's ``T32`` (``row_t32``, binary32 ``[rows]``)."""
    x = logits.float()
    if x.data_ptr() == logits.data_ptr():
        x = x.clone()
    divisor = temperature_divisor(contract.temperature32, x.device) if row_t32 is None else row_t32.unsqueeze(1)
    if divisor is not None:
        x.div_(divisor)
    return x


def kept_cut(logits: torch.Tensor, contract: LogprobContract, sampling: Sampling, group: Any,
             chunk_rows: int | None = None, row_t32: torch.Tensor | None = None) -> KeptCut:
    """The cut of every local row (section 13), on every TP rank of the group alike.

    Blocks of rows in order; per block a fixed sequence of all-gathers whose count depends only
    on gathered values (equal on every rank): the row maxima and minima, the top-k candidates
    (each rank's first ``k`` keys of ``K1``), the tile lane sums of ``Z(K2)``, then a bisection on
    the key, value first (on the binary32 order) and, among ties at the value found, on the
    column id, each step one all-gather of tile lane sums folded by ``F`` in tile order.
    ``row_t32`` (binary32 ``[rows]``): each row's ``T32`` in place of the contract's temperature.
    """
    rows, local = logits.shape
    if rows == 0:
        return keep_all(0, logits.device)
    block = max(1, SEARCH_BLOCK_ELEMENTS // max(1, local))
    values, indices = [], []
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        cut = _block_cut(logits[start:stop], contract, sampling.rows_slice(start, stop), group,
                         None if row_t32 is None else row_t32[start:stop])
        values.append(cut.value)
        indices.append(cut.index)
    return KeptCut(torch.cat(values), torch.cat(indices))


def _block_cut(logits: torch.Tensor, contract: LogprobContract, sampling: Sampling, group: Any,
               row_t32: torch.Tensor | None = None) -> KeptCut:
    rows, local = logits.shape
    device = logits.device
    width = contract.tile_width
    tiles = contract.local_grid_width // width  # whole tiles: the last may reach past the vocabulary
    real = max(0, min(local, contract.real_vocab_size - contract.vocab_start))
    x = _tempered_block(logits, contract, row_t32)
    cols = torch.arange(contract.vocab_start, contract.vocab_start + local, dtype=torch.int64, device=device)
    is_real = (torch.arange(local, device=device) < real).unsqueeze(0)
    neg_inf = torch.full((), float("-inf"), dtype=torch.float32, device=device)
    # B: the max of the real columns (NaN propagates), gathered from every rank
    local_max = x[:, :real].amax(dim=1) if real > 0 else torch.full((rows,), float("-inf"), device=device)
    big = torch.stack(_gather(local_max, contract, group), dim=1).amax(dim=1)
    search = active_rows(sampling) & torch.isfinite(big)  # other rows keep every real column
    k, p32, mp32 = sampling.top_k, sampling.top_p, sampling.min_p
    cut_v = torch.full((rows,), float("-inf"), dtype=torch.float32, device=device)
    cut_i = torch.full((rows,), KEEP_ALL, dtype=torch.int64, device=device)
    # 1. min-p: RN32(x - B) >= L(mp32); L(0) = -inf keeps every column, so "off" needs no branch
    y = x - big.unsqueeze(1)
    member = is_real & (y >= portable_log(mp32.contiguous()).unsqueeze(1)) & search.unsqueeze(1)
    use_min_p = search & (mp32 > 0)
    if bool(use_min_p.any()):
        low = torch.where(member, x, torch.full_like(x, float("inf"))).amin(dim=1)
        low = torch.stack(_gather(low, contract, group), dim=1).amin(dim=1)
        cut_v = torch.where(use_min_p, low, cut_v)
    # 2. top-k: each rank's first k keys of K1, merged by the key
    use_top_k = search & (k > 0)
    if bool(use_top_k.any()):
        kmax = int(k[use_top_k].max())
        most = max(end - start for start, end in contract.vocab_shard_bounds)  # type: ignore[union-attr]
        take = min(kmax, most)
        key = torch.where(member, ordered(x), torch.full_like(cols, _NONE).expand(rows, local))
        if take > local:
            key = torch.cat([key, torch.full((rows, take - local), _NONE, dtype=torch.int64, device=device)], 1)
            ids = torch.cat([cols, torch.full((take - local,), KEEP_ALL, dtype=torch.int64, device=device)])
        else:
            ids = cols
        top, order = torch.sort(key, dim=1, descending=True, stable=True)
        cand = torch.stack([top[:, :take], ids[order[:, :take]]], dim=2)
        merged = torch.cat(_gather(cand, contract, group), dim=1)  # rank order: ids ascending among ties
        mkey, morder = torch.sort(merged[:, :, 0], dim=1, descending=True, stable=True)
        mids = merged[:, :, 1].gather(1, morder)
        at = (k - 1).clamp(0, mkey.shape[1] - 1).unsqueeze(1)
        kth, kth_id = mkey.gather(1, at).squeeze(1), mids.gather(1, at).squeeze(1)
        cuts = use_top_k & (k <= mkey.shape[1]) & (kth != _NONE)  # else |K1| <= k: K2 = K1
        cut_v = torch.where(cuts, from_ordered(kth.clamp(min=int(ordered(neg_inf)))), cut_v)
        cut_i = torch.where(cuts, kth_id, cut_i)
        member = member & ~KeptCut(cut_v, cut_i).dropped(x, cols)
    # 3. top-p: tau = RN32(p32 * Z(K2)); the shortest prefix of K2 with Z >= tau
    use_top_p = search & (p32 < 1)
    if bool(use_top_p.any()):
        e = portable_exp(torch.where(member, y, neg_inf).contiguous())
        tau = p32 * _z(e, member, tiles, width, contract, group)
        value = _top_p_value(e, member, x, tau, use_top_p, cut_v, big, logits.dtype, contract, group, row_t32)
        above = member & (x > value.unsqueeze(1))
        ties = member & (x == value.unsqueeze(1))
        # the index: the smallest id c among the ties with Z(above, ties with id <= c) >= tau
        tie_ids = torch.where(ties, cols.expand(rows, local), torch.full_like(cols, KEEP_ALL).expand(rows, local))
        first = torch.stack(_gather(tie_ids.amin(dim=1), contract, group), dim=1).amin(dim=1)
        last = torch.stack(_gather(torch.where(ties, cols, -1).amax(dim=1), contract, group), dim=1).amax(dim=1)
        lo_i = torch.where(use_top_p, first, torch.zeros_like(first))
        hi_i = torch.where(use_top_p, last, lo_i)
        while bool((hi_i > lo_i).any()):
            mid = torch.div(lo_i + hi_i, 2, rounding_mode="floor")
            ok = _z(e, above | (ties & (cols <= mid.unsqueeze(1))), tiles, width, contract, group) >= tau
            hi_i = torch.where(ok, mid, hi_i)
            lo_i = torch.where(ok, lo_i, mid + 1)
        cut_v = torch.where(use_top_p, value, cut_v)
        cut_i = torch.where(use_top_p, lo_i, cut_i)
    return KeptCut(cut_v, cut_i)


__all__ = [
    "KEEP_ALL",
    "KeptCut",
    "Sampling",
    "active_rows",
    "from_ordered",
    "keep_all",
    "kept_cut",
    "ordered",
    "sampling_from",
]
