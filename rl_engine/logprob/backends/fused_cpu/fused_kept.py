"""Processed logprobs (``docs/arithmetic.md`` section 13) in the fused CPU kernels.

The kept set of a row is a prefix of the key order (tempered logit descending, ties by the
lower token id), so one cut per row describes it (:class:`rl_engine.logprob.processed.KeptCut`:
a column is dropped iff its logit is below the cut's value, or equal to it with a larger id; NaN
is never dropped). The kernels (``_fused_cpu_kept.h``) take the cut with the shard's local
column (the global id minus the shard's first column) and compute the masked forward and
backward, min-p's set and top-k's rank-local candidates per shard (a selection on the 64-bit key),
and the scans of the search on the key (:mod:`rl_engine.logprob.kept_search`, :class:`FusedKeptScan`):
top-p at every TP degree, min-p and top-k under TP. At TP = 1 min-p and top-k come from the
candidates directly (one pass instead of a search).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from rl_engine.arith.portable import log as portable_log
from rl_engine.logprob.backends.eager.vocab_parallel import BackwardTerms, real_local_columns
from rl_engine.logprob.backends.fused_cpu.operands import c_operand, gradient_operands, partials_buffers, ptr
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.kept_search import engine_cut, top_p_cut
from rl_engine.logprob.processed import KEEP_ALL, KeptCut, Sampling


@dataclass(frozen=True)
class KernelCall:
    """How the fused engine calls its loaded library (``FusedCpuEngine.kernel_call``): the ctypes
    library, its status check, the thread count, the instruction set and the dtype codes. Passed
    in, so that this module needs nothing from ``fused_cpu.py``, which imports it."""

    lib: Any
    check: Callable[[int, str], None]
    threads: int
    isa: int
    dtype_codes: Mapping[torch.dtype, int]


def local_cut(keep: KeptCut, vocab_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(value, local column)`` of each row's cut, as the kernels read it: the global id minus the
    shard's first column (``KEEP_ALL`` minus it stays above every column)."""
    if keep.value.dtype != torch.float32 or keep.index.dtype != torch.int64 or keep.value.dim() != 1 \
            or keep.value.shape != keep.index.shape:
        raise LogprobContractError(
            f"a KeptCut needs float32 values and int64 indices of shape [rows], got {keep.value.dtype} "
            f"{tuple(keep.value.shape)} and {keep.index.dtype} {tuple(keep.index.shape)}"
        )
    return keep.value.contiguous(), (keep.index - vocab_start).contiguous()


def kept_rows_finite(m: torch.Tensor, row_min: torch.Tensor, real_local: int) -> torch.Tensor:
    """Per row: every real column finite, from the masked forward's tile maxima and the minimum of
    every real column (the kernels read the logits before the cut drops any). A cut never drops a
    NaN or a ``+inf`` (a row holding either keeps every column), so a masked maximum still shows
    them; a ``-inf`` shows in the minimum, and a shard whose columns were all dropped (maxima
    ``-inf``) is not mistaken for one."""
    if real_local <= 0:
        return torch.ones(m.shape[0], dtype=torch.bool, device=m.device)
    return torch.isfinite(row_min) & ~torch.isnan(m).any(dim=1) & ~(m == float("inf")).any(dim=1)


def fused_kept_partials(
    call: KernelCall,
    logits: torch.Tensor,
    contract: LogprobContract,
    with_entropy: bool,
    validate: bool,
    keep: KeptCut,
    shift: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
    row_t32: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(m, s, t, finite)`` of the local shard with ``x_c = -inf`` outside each row's kept set.

    ``count`` (int32 ``[rows, local tiles]``, optional) receives each tile's number of kept real
    columns (top-k's search on the key).

    With ``shift`` (binary32 ``[rows]``, the row max ``B``) every tile is shifted by it instead of
    its own maximum: ``s`` is then section 13's lane sum of ``E(RN32(x_c - B))`` over the kept
    columns of each tile (top-p's ``Z`` is ``F`` of it over the tiles in global order). The
    validation flag reads every real column, kept or not."""
    x = c_operand("logits", logits)
    rows = x.shape[0]
    width = contract.tile_width
    real_local = real_local_columns(contract)
    m, s, t, row_min = partials_buffers(rows, contract, with_entropy, validate)
    tiles = m.shape[1]
    kv, kid = local_cut(keep, contract.vocab_start)
    sh = None if shift is None else c_operand("shift", shift.float())
    rt = None if row_t32 is None else c_operand("temperature", row_t32.float())
    if count is not None and (count.dtype != torch.int32 or tuple(count.shape) != (rows, tiles)
                              or not count.is_contiguous()):
        raise LogprobContractError(
            f"count must be a contiguous int32 tensor of shape {(rows, tiles)}, got {count.dtype} "
            f"{tuple(count.shape)}"
        )
    if rows:
        status = call.lib.rle_forward_kept(
            x.data_ptr(), call.dtype_codes[x.dtype], rows, x.stride(0), contract.local_grid_width,
            width, real_local, m.data_ptr(), s.data_ptr(), ptr(t), ptr(row_min),
            1.0 if rt is not None else contract.temperature32, ptr(rt), kv.data_ptr(), kid.data_ptr(), ptr(sh),
            ptr(count), call.threads, call.isa,
        )
        call.check(status, "processed forward")
    finite = kept_rows_finite(m, row_min, real_local) if row_min is not None else None
    return m, s, t, finite


def fused_kept_backward(
    call: KernelCall,
    logits: torch.Tensor,
    lse: torch.Tensor,
    terms: BackwardTerms,
) -> torch.Tensor:
    """The local gradient of section 7 on the masked logits: ``+0`` on every dropped column.

    ``terms`` are the processed ones (``terms.keep`` the cut; a row whose target is dropped has
    ``gl = 0``)."""
    if terms.keep is None:
        raise LogprobContractError("fused_kept_backward needs terms.keep (the kept set's cut)")
    x = c_operand("logits", logits)
    rows, local_vocab = x.shape
    grad = torch.empty((rows, local_vocab), dtype=x.dtype)
    if rows:
        kv, kid = local_cut(terms.keep, terms.vocab_start)
        lse_c, coef, col, add, g_ent, mb, rt = gradient_operands(lse, terms)
        status = call.lib.rle_backward_kept(
            x.data_ptr(), call.dtype_codes[x.dtype], rows, x.stride(0), local_vocab,
            terms.real_local, lse_c.data_ptr(), coef.data_ptr(), col.data_ptr(),
            add.data_ptr(), grad.data_ptr(), 1.0 if rt is not None else terms.t32, ptr(g_ent), ptr(mb),
            ptr(rt), kv.data_ptr(), kid.data_ptr(), call.threads, call.isa,
        )
        call.check(status, "processed backward")
    return grad


@dataclass(frozen=True)
class Candidates:
    """min-p's and top-k's view of one shard: ``count`` = ``|K1|`` on it, ``least`` = its least
    logit (``+inf`` when empty), and its first ``k`` columns in key order (``value``, global
    ``column``; ``-inf`` and ``-1`` past them)."""

    count: torch.Tensor
    least: torch.Tensor
    value: torch.Tensor
    column: torch.Tensor


def fused_candidates(
    call: KernelCall,
    logits: torch.Tensor,
    contract: LogprobContract,
    row_max: torch.Tensor,
    lmp: torch.Tensor,
    top_k: torch.Tensor,
    row_t32: torch.Tensor | None = None,
) -> Candidates:
    """Section 13 steps 1-2 on this shard: ``K1 = {c : RN32(x_c - B) >= lmp}`` (every real column
    where ``lmp`` is ``-inf``) and its first ``top_k`` columns in key order (none where 0)."""
    x = c_operand("logits", logits)
    rows = x.shape[0]
    kmax = int(top_k.max()) if rows else 0
    count = torch.zeros(rows, dtype=torch.int64)
    least = torch.full((rows,), float("inf"))
    value = torch.full((rows, kmax), float("-inf"))
    column = torch.full((rows, kmax), -1, dtype=torch.int64)
    if rows:
        b = c_operand("row_max", row_max.float())
        lm = c_operand("lmp", lmp.float())
        k = c_operand("top_k", top_k.to(torch.int64))
        rt = None if row_t32 is None else c_operand("temperature", row_t32.float())
        status = call.lib.rle_kept_candidates(
            x.data_ptr(), call.dtype_codes[x.dtype], rows, x.stride(0), real_local_columns(contract),
            1.0 if rt is not None else contract.temperature32, ptr(rt), b.data_ptr(), lm.data_ptr(), k.data_ptr(), kmax,
            count.data_ptr(), least.data_ptr(), value.data_ptr(), column.data_ptr(),
            call.threads, call.isa,
        )
        call.check(status, "min-p / top-k candidates")
    column = torch.where(column >= 0, column + contract.vocab_start, column)
    return Candidates(count, least, value, column)


def min_p_log(mp32: torch.Tensor) -> torch.Tensor:
    """``L(mp32)`` per row (section 5), ``-inf`` where min-p is off (``mp32 == 0``)."""
    lmp = portable_log(mp32.float().contiguous())
    return torch.where(mp32 > 0, lmp, torch.full_like(lmp, float("-inf")))


def kept_keys_tp1(
    call: KernelCall,
    logits: torch.Tensor,
    contract: LogprobContract,
    top_k: torch.Tensor,
    p32: torch.Tensor,
    mp32: torch.Tensor,
    row_max: torch.Tensor,
    row_t32: torch.Tensor | None = None,
) -> KeptCut:
    """Each row's kept set (section 13 steps 1-3) on a full row (TP = 1), by the compiled kernels:
    min-p and top-k from the candidates (one pass), top-p by the search on the key over the masked
    forward's sums (:class:`FusedKeptScan`).

    ``row_max`` is ``B`` (the max of the tile maxima of the raw forward); a row whose ``B`` is
    not finite (a NaN, or no finite logit: only inactive rows reach here so) keeps every column."""
    rows = logits.shape[0]
    cand = fused_candidates(call, logits, contract, row_max, min_p_log(mp32), top_k, row_t32)
    k = top_k.to(torch.int64)
    use_k = (k > 0) & (k < cand.count)
    at = (k - 1).clamp(min=0).unsqueeze(1)
    kv = cand.value.gather(1, at).squeeze(1) if cand.value.shape[1] else torch.full((rows,), float("-inf"))
    kid = cand.column.gather(1, at).squeeze(1) if cand.column.shape[1] else torch.full((rows,), -1)
    minp = mp32 > 0
    v2 = torch.where(use_k, kv, torch.where(minp, cand.least, torch.full_like(cand.least, float("-inf"))))
    id2 = torch.where(use_k, kid, torch.full_like(kid, KEEP_ALL))
    scan = FusedKeptScan(call, logits, contract, row_t32)
    cut = top_p_cut(scan, row_max, KeptCut(v2, id2), p32, contract.real_vocab_size, dtype=contract.torch_dtype,
                    t32=contract.temperature32 if row_t32 is None else row_t32)
    finite = torch.isfinite(row_max)
    return KeptCut(torch.where(finite, cut.value, torch.full_like(cut.value, float("-inf"))),
                   torch.where(finite, cut.index, torch.full_like(cut.index, KEEP_ALL)))


def fused_kept_cut(call: KernelCall, logits: torch.Tensor, contract: LogprobContract, sampling: Sampling,
                   group: Any, local_max: torch.Tensor, row_t32: torch.Tensor | None = None) -> KeptCut:
    """The engine's ``kept_cut`` (``local_max``: the max of this shard's real tempered columns, from
    the raw forward's tile maxima): at TP = 1 :func:`kept_keys_tp1` (min-p and top-k from the
    candidates, top-p by the search on the key), under TP the search on the key with the tiles
    gathered (:func:`rl_engine.logprob.kept_search.engine_cut`)."""
    if contract.tp_world_size == 1:
        return kept_keys_tp1(call, logits, contract, sampling.top_k, sampling.top_p, sampling.min_p, local_max,
                             row_t32)
    return engine_cut(FusedKeptScan(call, logits, contract, row_t32), local_max, contract, sampling, group, row_t32)


class FusedKeptScan:
    """:class:`rl_engine.logprob.kept_search.KeptScan` on the compiled kernels: the search on the
    key for any shard (at TP = 1, :func:`kept_keys_tp1`'s sort gives the same keys)."""

    def __init__(self, call: KernelCall, logits: torch.Tensor, contract: LogprobContract,
                 row_t32: torch.Tensor | None = None) -> None:
        self.call = call
        self.logits = logits
        self.contract = contract
        self.row_t32 = row_t32

    def prefix(self, keep: KeptCut, row_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.logits.shape[0]
        count = torch.zeros(rows, self.contract.local_tile_count, dtype=torch.int32)
        _, z, _, _ = fused_kept_partials(self.call, self.logits, self.contract, False, False, keep, row_max, count,
                                         self.row_t32)
        return count, z

    def min_p(self, row_max: torch.Tensor, lmp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The shard's count and least logit in its first tile (zero and ``+inf`` in the others:
        the sum and the minimum over the tiles are the shard's)."""
        rows = self.logits.shape[0]
        tiles = self.contract.local_tile_count
        zero = torch.zeros(rows, dtype=torch.int64)
        cand = fused_candidates(self.call, self.logits, self.contract, row_max, lmp, zero, self.row_t32)
        count = torch.zeros(rows, tiles, dtype=torch.int64)
        least = torch.full((rows, tiles), float("inf"))
        count[:, 0] = cand.count
        least[:, 0] = cand.least
        return count, least


__all__ = [
    "Candidates",
    "FusedKeptScan",
    "KernelCall",
    "fused_candidates",
    "fused_kept_cut",
    "fused_kept_backward",
    "fused_kept_partials",
    "kept_keys_tp1",
    "kept_rows_finite",
    "local_cut",
    "min_p_log",
]
