"""The kept set's search on the key (``docs/arithmetic.md`` section 13), for any engine and any TP.

A row's kept set is a prefix of the key order, so it is found by bisection on the key without a
sort: the key ``(value, id)`` is split into the value's place in the descending order of binary32
values (an integer ``u``, both zeros equal) and the token id. Each step asks the engine for the
tiles of every row's prefix up to a trial key (:class:`KeptScan`): the number of its real columns
(top-k) and the lane sums ``G`` of ``e_c = E(RN32(x_c - B))`` (top-p); the tiles of all TP ranks
are brought together by ``exchange`` (an all-gather: transport only) and reduced in global tile
order, integers by a sum and the lane sums by the fold ``F``. Predicates on nested prefixes are
monotone (``Z`` of a prefix never decreases: binary32 addition of non-negative terms is
monotone), so bisection finds the shortest prefix the definition asks for, the one the NumPy
spec's sort finds.

Cost: one scan per step, per stage (top-k, then top-p) up to 32 steps on the value (16 for bf16
and binary16 logits, bisected on their own order) and ``ceil(log2(V + 1))`` on the id; min-p is
one scan.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from rl_engine.arith.portable import log as portable_log
from rl_engine.arith.tiles import fold_sum_, temperature_divisor
from rl_engine.logprob.contract import LogprobContract
from rl_engine.logprob.processed import KEEP_ALL, KeptCut, Sampling, _gather, _gather_tiles

_LOW32 = 0xFFFFFFFF
_SIGN = 0x80000000


class KeptScan(Protocol):
    """What an engine computes on its shard for the search (``[rows, local tiles]`` each)."""

    def prefix(self, keep: KeptCut, row_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per tile: the count of real columns in each row's prefix up to ``keep``, and the lane
        sum ``G`` of ``E(RN32(x_c - B))`` over them (``B = row_max``)."""
        ...

    def min_p(self, row_max: torch.Tensor, lmp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per tile: the count of ``{c : RN32(x_c - B) >= lmp}`` and its least logit (``+inf``)."""
        ...


Exchange = Callable[[torch.Tensor], torch.Tensor]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def order_of(value: torch.Tensor) -> torch.Tensor:
    """``u``: the place of each binary32 value in the descending order (int64; smaller is
    earlier; ``+0`` and ``-0`` are both ``+0``'s place)."""
    bits = value.contiguous().view(torch.int32).to(torch.int64) & _LOW32
    bits = torch.where(value == 0, torch.zeros_like(bits), bits)
    asc = torch.where((bits & _SIGN) != 0, (~bits) & _LOW32, bits | _SIGN)
    return (~asc) & _LOW32


def value_of(u: torch.Tensor) -> torch.Tensor:
    """The binary32 value at place ``u`` (the inverse of :func:`order_of`)."""
    asc = (~u) & _LOW32
    bits = torch.where((asc & _SIGN) != 0, asc & 0x7FFFFFFF, (~asc) & _LOW32)
    bits = torch.where(bits >= _SIGN, bits - (1 << 32), bits)
    return bits.to(torch.int32).view(torch.float32)


_SIGN16 = 0x8000
_LOW16 = 0xFFFF


def order_of16(bits: torch.Tensor) -> torch.Tensor:
    """``u`` of 16-bit values (bf16 or binary16 bits, int64): their place in the descending order."""
    bits = bits & _LOW16
    asc = torch.where((bits & _SIGN16) != 0, (~bits) & _LOW16, bits | _SIGN16)
    return (~asc) & _LOW16


def _tempered16(u: torch.Tensor, dtype: torch.dtype, t32: float | torch.Tensor) -> torch.Tensor:
    """The tempered binary32 value ``RN32(f32(X) / T32)`` of the 16-bit value ``X`` at place ``u``."""
    asc = (~u) & _LOW16
    bits = torch.where((asc & _SIGN16) != 0, asc & 0x7FFF, (~asc) & _LOW16)
    bits = torch.where(bits >= _SIGN16, bits - (1 << 16), bits)
    value = bits.to(torch.int16).view(dtype).float()
    if isinstance(t32, torch.Tensor):  # a temperature per row: each row's T32
        return value / t32.float()
    divisor = temperature_divisor(t32, value.device)  # a tensor: CUDA divides too (IEEE)
    return value / divisor if divisor is not None else value


def _bisect(pred: Callable[[KeptCut], torch.Tensor], search: torch.Tensor, row_max: torch.Tensor,
            upper: KeptCut, real_vocab: int, dtype: torch.dtype = torch.float32,
            t32: float | torch.Tensor = 1.0) -> KeptCut:
    """The least key ``K <= upper`` with ``pred(K)`` on the rows in ``search`` (``upper`` elsewhere),
    given that ``pred`` is monotone, false on the empty prefix and true at ``upper``.

    The value first: for binary32 logits on the binary32 order between ``B`` and ``upper``; for
    bf16 and binary16 logits on the order of the 16-bit values themselves (16 steps), each trial
    value the tempered one, ``RN32(f32(X) / T32)``: the division is monotone and every ``x_c`` is
    such a value, so the least passing place gives the least passing value among the columns'."""
    rows = row_max.shape[0]
    all_ids = torch.full((rows,), KEEP_ALL, dtype=torch.int64, device=row_max.device)
    if dtype in (torch.bfloat16, torch.float16):
        ends = torch.tensor([float("inf"), float("-inf")], dtype=dtype).view(torch.int16).to(torch.int64)
        first, last = (int(u) for u in order_of16(ends))
        hi = torch.where(search, torch.full_like(all_ids, last), torch.zeros_like(all_ids))
        lo = torch.where(search, torch.full_like(all_ids, first - 1), hi - 1)

        def value_at(u: torch.Tensor) -> torch.Tensor:
            return _tempered16(u, dtype, t32)
    else:
        hi = order_of(upper.value)
        lo = torch.where(search, order_of(row_max) - 1, hi - 1)
        value_at = value_of
    while bool((hi - lo > 1).any()):
        mid = torch.where(hi - lo > 1, (lo + hi) // 2, hi)
        ok = pred(KeptCut(value_at(mid), all_ids))
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid)
    value = value_at(hi) + 0.0  # one zero
    hi_id = torch.where(search, torch.full_like(all_ids, real_vocab - 1), upper.index)
    lo_id = torch.where(search, torch.full_like(all_ids, -1), upper.index - 1)
    while bool((hi_id - lo_id > 1).any()):
        mid = torch.where(hi_id - lo_id > 1, (lo_id + hi_id) // 2, hi_id)
        ok = pred(KeptCut(value, mid))
        hi_id = torch.where(ok, mid, hi_id)
        lo_id = torch.where(ok, lo_id, mid)
    return KeptCut(torch.where(search, value, upper.value), torch.where(search, hi_id, upper.index))


def kept_keys(
    scan: KeptScan,
    row_max: torch.Tensor,
    top_k: torch.Tensor,
    p32: torch.Tensor,
    mp32: torch.Tensor,
    real_vocab: int,
    exchange: Exchange = _same,
    dtype: torch.dtype = torch.float32,
    t32: float | torch.Tensor = 1.0,
) -> KeptCut:
    """Each row's kept set (section 13 steps 1-3) as its last key.

    ``row_max`` is ``B`` (the max of every rank's tile maxima); a row whose ``B`` is not finite (a
    NaN, or no finite logit: only inactive rows pass validation so) keeps every column. ``dtype`` and
    ``t32``: the logits' dtype and the temperature's ``T32`` (16-bit logits bisect their own order)."""
    rows = row_max.shape[0]
    dev = row_max.device
    finite = torch.isfinite(row_max)
    inf = torch.full((rows,), float("-inf"), device=dev)
    all_ids = torch.full((rows,), KEEP_ALL, dtype=torch.int64, device=dev)
    minp = (mp32 > 0) & finite
    count = torch.full((rows,), real_vocab, dtype=torch.int64, device=dev)
    least = inf
    if bool(minp.any()):
        lmp = portable_log(mp32.float().contiguous())  # L(mp32); rows with mp32 = 0 are not read
        n, low = scan.min_p(row_max, torch.where(mp32 > 0, lmp, torch.full_like(lmp, float("-inf"))))
        count = torch.where(minp, exchange(n).to(torch.int64).sum(dim=1), count)
        least = torch.where(minp, exchange(low).amin(dim=1), inf)
    k1 = KeptCut(least, all_ids)
    k = top_k.to(torch.int64)
    cut = (k > 0) & (k < count) & finite
    k2 = k1
    if bool(cut.any()):
        def enough(keys: KeptCut) -> torch.Tensor:
            n, _ = scan.prefix(keys, row_max)
            return exchange(n).to(torch.int64).sum(dim=1) >= k

        k2 = _bisect(enough, cut, row_max, k1, real_vocab, dtype, t32)
    k3 = top_p_cut(scan, row_max, k2, p32, real_vocab, exchange, dtype, t32)
    return KeptCut(torch.where(finite, k3.value, inf), torch.where(finite, k3.index, all_ids))


def top_p_cut(scan: KeptScan, row_max: torch.Tensor, k2: KeptCut, p32: torch.Tensor, real_vocab: int,
              exchange: Exchange = _same, dtype: torch.dtype = torch.float32,
              t32: float | torch.Tensor = 1.0) -> KeptCut:
    """Section 13 step 3: ``tau = RN32(p32 * Z(K2))`` and the least key with ``Z(prefix) >= tau``, on
    the rows with ``p32 < 1`` and a finite ``B`` (``k2`` elsewhere)."""
    nucleus = (p32 < 1) & torch.isfinite(row_max)
    if not bool(nucleus.any()):
        return k2

    def z_of(keys: KeptCut) -> torch.Tensor:
        _, z = scan.prefix(keys, row_max)
        return fold_sum_(exchange(z).contiguous())

    tau = p32.float() * z_of(k2)  # RN32(p32 * Z(K2))
    return _bisect(lambda keys: z_of(keys) >= tau, nucleus, row_max, k2, real_vocab, dtype, t32)


def engine_cut(scan: KeptScan, local_max: torch.Tensor, contract: LogprobContract, sampling: Sampling,
               group: Any, row_t32: torch.Tensor | None = None) -> KeptCut:
    """An engine's :meth:`~rl_engine.logprob.vocab_parallel.LocalEngine.kept_cut` by the search on the
    key: ``B`` is the max of every rank's ``local_max`` (the max of its real tempered columns, NaN
    propagating), and each step's tiles travel by all-gather (transport only) in global tile order.
    Every rank makes the same collectives: each loop's condition reads gathered values only."""
    big = torch.stack(_gather(local_max, contract, group), dim=1).amax(dim=1)

    def exchange(piece: torch.Tensor) -> torch.Tensor:
        return _gather_tiles(piece, contract, group)

    return kept_keys(scan, big, sampling.top_k, sampling.top_p, sampling.min_p, contract.real_vocab_size,
                     exchange, contract.torch_dtype, contract.temperature32 if row_t32 is None else row_t32)


__all__ = ["Exchange", "KeptScan", "engine_cut", "kept_keys", "order_of", "order_of16", "top_p_cut", "value_of"]
