"""Processed logprobs (``docs/arithmetic.md`` section 13) in the fused CPU kernels.

The kept set of a row is a prefix of the key order (tempered logit descending, ties by the
lower token id): min-p keeps every column at or above a value, and top-k and top-p keep
prefixes of what min-p kept. So each row's kept set is one key, its last, a value and a token
id (:class:`KeptKeys`); a column is dropped iff its logit is below the value, or equal to it
with a larger id. NaN is never dropped, and ``(-inf, KEEP_ALL_ID)`` drops nothing.

Why keys and not masks: a key is two numbers per row however the vocabulary is sharded, so the
same key reaches every rank and every kernel (the masked forward and backward here, the Triton
kernels, the eager loop), and the search for it is the only place that looks at more than one
column at a time. The kernels (``_fused_cpu_kept.h``) compute min-p's set and top-k's rank-local
candidates per shard, top-p's search on full rows (TP = 1), and the masked forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.fused_cpu import (
    _DTYPE_CODES,
    ISA_NAMES,
    _c_operand,
    _ptr,
    _threads,
    load_kernel,
)
from rl_engine.logprob.portable import log as portable_log
from rl_engine.logprob.tiles import rows_finite
from rl_engine.logprob.vocab_parallel import BackwardTerms, real_local_columns

KEEP_ALL_ID = 2**63 - 1  # with the value -inf: no column is dropped


@dataclass(frozen=True)
class KeptKeys:
    """Each row's kept set as its last key: ``value`` (binary32) and ``column`` (global token id)."""

    value: torch.Tensor
    column: torch.Tensor

    def __post_init__(self) -> None:
        if self.value.dtype != torch.float32 or self.column.dtype != torch.int64:
            raise LogprobContractError(
                f"KeptKeys needs float32 values and int64 columns, got {self.value.dtype} and "
                f"{self.column.dtype}"
            )
        if self.value.dim() != 1 or self.value.shape != self.column.shape:
            raise LogprobContractError(
                f"KeptKeys needs two [rows] tensors, got {tuple(self.value.shape)} and "
                f"{tuple(self.column.shape)}"
            )

    @staticmethod
    def keep_all(rows: int) -> "KeptKeys":
        return KeptKeys(torch.full((rows,), float("-inf")), torch.full((rows,), KEEP_ALL_ID, dtype=torch.int64))

    def local(self, contract: LogprobContract) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys with this shard's local columns (the global id minus the first column; the
        saturated keep-all id stays above every column)."""
        start = contract.vocab_start
        column = torch.where(self.column == KEEP_ALL_ID, self.column, self.column - start)
        return self.value.contiguous(), column.contiguous()


def fused_kept_partials(
    logits: torch.Tensor,
    contract: LogprobContract,
    with_entropy: bool,
    validate: bool,
    keys: KeptKeys,
    shift: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
    *,
    threads: int | None = None,
    isa: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(m, s, t, finite)`` of the local shard with ``x_c = -inf`` outside each row's kept set.

    ``count`` (int32 ``[rows, local tiles]``, optional) receives each tile's number of kept real
    columns (top-k's search on the key).

    With ``shift`` (binary32 ``[rows]``, the row max ``B``) every tile is shifted by it instead of
    its own maximum: ``s`` is then section 13's lane sum of ``E(RN32(x_c - B))`` over the kept
    columns of each tile (top-p's ``Z`` is ``F`` of it over the tiles in global order). The
    validation flag reads every real column, kept or not."""
    kernel = load_kernel()
    x = _c_operand("logits", logits)
    rows = x.shape[0]
    width = contract.tile_width
    real_local = real_local_columns(contract)
    tiles = contract.local_vocab_size // width
    m = torch.empty(rows, tiles, dtype=torch.float32)
    s = torch.empty_like(m)
    t = torch.empty_like(m) if with_entropy else None
    row_min = torch.empty(rows, dtype=torch.float32) if validate else None
    kv, kid = keys.local(contract)
    sh = None if shift is None else _c_operand("shift", shift.float())
    if count is not None and (count.dtype != torch.int32 or tuple(count.shape) != (rows, tiles)
                              or not count.is_contiguous()):
        raise LogprobContractError(
            f"count must be a contiguous int32 tensor of shape {(rows, tiles)}, got {count.dtype} "
            f"{tuple(count.shape)}"
        )
    if rows:
        status = kernel.lib.rle_forward_kept(
            x.data_ptr(), _DTYPE_CODES[x.dtype], rows, x.stride(0), contract.local_vocab_size,
            width, real_local, m.data_ptr(), s.data_ptr(), _ptr(t), _ptr(row_min),
            contract.temperature32, kv.data_ptr(), kid.data_ptr(), _ptr(sh), _ptr(count),
            _threads(threads), ISA_NAMES[isa],
        )
        kernel.check(status, "processed forward")
    finite = rows_finite(m, row_min, width, real_local) if row_min is not None else None
    return m, s, t, finite


def fused_kept_backward(
    logits: torch.Tensor,
    lse: torch.Tensor,
    terms: BackwardTerms,
    keys: KeptKeys,
    contract: LogprobContract,
    *,
    threads: int | None = None,
    isa: str = "auto",
) -> torch.Tensor:
    """The local gradient of section 7 on the masked logits: ``+0`` on every dropped column.

    ``terms`` are the processed ones (a row whose target is dropped has ``gl = 0``)."""
    kernel = load_kernel()
    x = _c_operand("logits", logits)
    rows, local_vocab = x.shape
    grad = torch.empty((rows, local_vocab), dtype=x.dtype)
    if rows:
        kv, kid = keys.local(contract)
        lse_c = _c_operand("lse", lse.float())
        coef = _c_operand("coef", terms.coef.float())
        col = _c_operand("target_col", terms.target_col.to(torch.int64))
        add = _c_operand("target_add", terms.target_add.float())
        g_ent = None if terms.g_ent is None else _c_operand("grad_entropy", terms.g_ent.float())
        mb = None if terms.mb is None else _c_operand("mb", terms.mb.float())
        status = kernel.lib.rle_backward_kept(
            x.data_ptr(), _DTYPE_CODES[x.dtype], rows, x.stride(0), local_vocab,
            terms.real_local, lse_c.data_ptr(), coef.data_ptr(), col.data_ptr(),
            add.data_ptr(), grad.data_ptr(), terms.t32, _ptr(g_ent), _ptr(mb), kv.data_ptr(),
            kid.data_ptr(), _threads(threads), ISA_NAMES[isa],
        )
        kernel.check(status, "processed backward")
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
    logits: torch.Tensor,
    contract: LogprobContract,
    row_max: torch.Tensor,
    lmp: torch.Tensor,
    top_k: torch.Tensor,
    *,
    threads: int | None = None,
    isa: str = "auto",
) -> Candidates:
    """Section 13 steps 1-2 on this shard: ``K1 = {c : RN32(x_c - B) >= lmp}`` (every real column
    where ``lmp`` is ``-inf``) and its first ``top_k`` columns in key order (none where 0)."""
    kernel = load_kernel()
    x = _c_operand("logits", logits)
    rows = x.shape[0]
    kmax = int(top_k.max()) if rows else 0
    count = torch.zeros(rows, dtype=torch.int64)
    least = torch.full((rows,), float("inf"))
    value = torch.full((rows, kmax), float("-inf"))
    column = torch.full((rows, kmax), -1, dtype=torch.int64)
    if rows:
        b = _c_operand("row_max", row_max.float())
        lm = _c_operand("lmp", lmp.float())
        k = _c_operand("top_k", top_k.to(torch.int64))
        status = kernel.lib.rle_kept_candidates(
            x.data_ptr(), _DTYPE_CODES[x.dtype], rows, x.stride(0), real_local_columns(contract),
            contract.temperature32, b.data_ptr(), lm.data_ptr(), k.data_ptr(), kmax,
            count.data_ptr(), least.data_ptr(), value.data_ptr(), column.data_ptr(),
            _threads(threads), ISA_NAMES[isa],
        )
        kernel.check(status, "min-p / top-k candidates")
    column = torch.where(column >= 0, column + contract.vocab_start, column)
    return Candidates(count, least, value, column)


def fused_topp(
    logits: torch.Tensor,
    contract: LogprobContract,
    row_max: torch.Tensor,
    k2: KeptKeys,
    p32: torch.Tensor,
    *,
    threads: int | None = None,
    isa: str = "auto",
) -> KeptKeys:
    """Section 13 step 3 on full rows (the shard is the whole vocabulary): K3's last key, by
    bisection on the prefix length of K2 sorted by key, each step the exact ``Z``."""
    if contract.tp_world_size != 1:
        raise LogprobContractError(
            f"fused_topp searches full rows; tp_world_size={contract.tp_world_size} needs the "
            "search on the key with the tile sums all-gathered (fused_kept_partials with a shift)"
        )
    kernel = load_kernel()
    x = _c_operand("logits", logits)
    rows = x.shape[0]
    out_v = torch.empty(rows, dtype=torch.float32)
    out_id = torch.empty(rows, dtype=torch.int64)
    if rows:
        b = _c_operand("row_max", row_max.float())
        v2, id2 = k2.local(contract)
        p = _c_operand("p32", p32.float())
        status = kernel.lib.rle_kept_topp(
            x.data_ptr(), _DTYPE_CODES[x.dtype], rows, x.stride(0), contract.local_vocab_size,
            contract.tile_width, contract.real_vocab_size, contract.temperature32, b.data_ptr(),
            v2.data_ptr(), id2.data_ptr(), p.data_ptr(), out_v.data_ptr(), out_id.data_ptr(),
            _threads(threads), ISA_NAMES[isa],
        )
        kernel.check(status, "top-p search")
    return KeptKeys(out_v, out_id)


def min_p_log(mp32: torch.Tensor) -> torch.Tensor:
    """``L(mp32)`` per row (section 5), ``-inf`` where min-p is off (``mp32 == 0``)."""
    lmp = portable_log(mp32.float().contiguous())
    return torch.where(mp32 > 0, lmp, torch.full_like(lmp, float("-inf")))


def kept_keys_tp1(
    logits: torch.Tensor,
    contract: LogprobContract,
    top_k: torch.Tensor,
    p32: torch.Tensor,
    mp32: torch.Tensor,
    row_max: torch.Tensor,
    *,
    threads: int | None = None,
    isa: str = "auto",
) -> KeptKeys:
    """Each row's kept set (section 13 steps 1-3) on a full row, by the compiled kernels.

    ``row_max`` is ``B`` (the max of the tile maxima of the raw forward); a row whose ``B`` is
    not finite (a NaN, or no finite logit: only inactive rows reach here so) keeps every column."""
    rows = logits.shape[0]
    cand = fused_candidates(logits, contract, row_max, min_p_log(mp32), top_k, threads=threads, isa=isa)
    k = top_k.to(torch.int64)
    use_k = (k > 0) & (k < cand.count)
    at = (k - 1).clamp(min=0).unsqueeze(1)
    kv = cand.value.gather(1, at).squeeze(1) if cand.value.shape[1] else torch.full((rows,), float("-inf"))
    kid = cand.column.gather(1, at).squeeze(1) if cand.column.shape[1] else torch.full((rows,), -1)
    minp = mp32 > 0
    v2 = torch.where(use_k, kv, torch.where(minp, cand.least, torch.full_like(cand.least, float("-inf"))))
    id2 = torch.where(use_k, kid, torch.full_like(kid, KEEP_ALL_ID))
    keys = fused_topp(logits, contract, row_max, KeptKeys(v2, id2), p32, threads=threads, isa=isa)
    finite = torch.isfinite(row_max)
    everything = KeptKeys.keep_all(rows)
    return KeptKeys(torch.where(finite, keys.value, everything.value),
                    torch.where(finite, keys.column, everything.column))


class FusedKeptScan:
    """:class:`rl_engine.logprob.kept_search.KeptScan` on the compiled kernels: the search on the
    key for any shard (at TP = 1, :func:`kept_keys_tp1`'s sort gives the same keys)."""

    def __init__(self, logits: torch.Tensor, contract: LogprobContract, *, threads: int | None = None,
                 isa: str = "auto") -> None:
        self.logits = logits
        self.contract = contract
        self.threads = threads
        self.isa = isa

    def prefix(self, keys: KeptKeys, row_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.logits.shape[0]
        count = torch.zeros(rows, self.contract.local_vocab_size // self.contract.tile_width, dtype=torch.int32)
        _, z, _, _ = fused_kept_partials(self.logits, self.contract, False, False, keys, row_max, count,
                                         threads=self.threads, isa=self.isa)
        return count, z

    def min_p(self, row_max: torch.Tensor, lmp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        zero = torch.zeros(self.logits.shape[0], dtype=torch.int64)
        cand = fused_candidates(self.logits, self.contract, row_max, lmp, zero, threads=self.threads, isa=self.isa)
        return cand.count.unsqueeze(1), cand.least.unsqueeze(1)


__all__ = [
    "Candidates",
    "FusedKeptScan",
    "KEEP_ALL_ID",
    "KeptKeys",
    "fused_candidates",
    "fused_kept_backward",
    "fused_kept_partials",
    "fused_topp",
    "kept_keys_tp1",
    "min_p_log",
]
