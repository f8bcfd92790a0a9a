"""Processed logprobs (``docs/arithmetic.md`` section 13) in the Triton kernels.

Launches of :mod:`rl_engine.logprob.backends.triton.triton_kernels`' ``kept_partials_kernel`` (the masked forward,
and with the row max as the shift the top-p sums and top-k counts of the search on the key),
``minp_kernel`` (min-p's set per tile) and ``kept_zero_kernel`` (the masked backward: the raw
backward's launches, then ``+0`` on the dropped columns). The kept set of each row is its last key
(:class:`rl_engine.logprob.processed.KeptCut`), found by :func:`rl_engine.logprob.kept_search.kept_keys`
with :class:`TritonKeptScan`: no per-row sort.

The engine (``TritonEngine`` in ``triton_backend.py``, which imports this module) hands in how to
launch and the raw backward as a :class:`TritonCall`; a launch here is a :class:`LaunchSpec`
(``triton_backend.Launch``'s fields), so this module needs nothing from ``triton_backend.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

import torch

from rl_engine.logprob.backends.eager.vocab_parallel import BackwardTerms, real_local_columns
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.kept_search import engine_cut
from rl_engine.logprob.processed import KeptCut, Sampling


class LaunchSpec(NamedTuple):
    """One launch: the kernel's name, grid, arguments, constants and warps per program."""

    kernel: str
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    meta: dict[str, Any]
    warps: int


@dataclass(frozen=True)
class TritonCall:
    """What the processed launches need from the engine: ``run`` launches a :class:`LaunchSpec` in
    the engine's mode, ``raw`` gives the logits as the kernels read them, ``backward`` is the raw
    backward (its launches), and the launch geometry and dtype codes of the backend."""

    run: Callable[[LaunchSpec], None]
    raw: Callable[[torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor, torch.Tensor, BackwardTerms], torch.Tensor]
    dtype_codes: Mapping[torch.dtype, int]
    forward_warps: int
    backward_warps: int
    backward_block: int


def _cut(keep: KeptCut, vocab_start: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(value, local column)`` of each row's cut on ``device`` (the global id minus the shard's first column)."""
    return keep.value.float().to(device).contiguous(), (keep.index.to(device) - vocab_start).contiguous()


def kept_launch(
    call: TritonCall, x: torch.Tensor, contract: LogprobContract, kv: torch.Tensor, kid: torch.Tensor,
    shift: torch.Tensor | None, m: torch.Tensor, s: torch.Tensor, t: torch.Tensor | None, bad: torch.Tensor | None,
    count: torch.Tensor, with_entropy: bool, validate: bool, logits_dtype: torch.dtype,
) -> LaunchSpec:
    """The masked forward's launch (with ``shift``: one step of the search), one program per (row, tile)."""
    width = contract.tile_width
    tiles = contract.local_tile_count
    real_local = real_local_columns(contract)
    sh = shift.float().contiguous() if shift is not None else m
    args = (x, kv, kid, sh, m, s, t if t is not None else m, bad if bad is not None else m, count,
            x.stride(0), real_local, contract.temperature32)
    meta = {"TILES": tiles, "WIDTH": width, "DTYPE": call.dtype_codes[logits_dtype],
            "WITH_ENTROPY": with_entropy, "VALIDATE": validate,
            "PADDED": real_local < contract.local_grid_width, "TEMPERED": contract.tempered,
            "SHIFTED": shift is not None, "MAXIMA": shift is None or validate or with_entropy}
    return LaunchSpec("kept_partials_kernel", (x.shape[0] * tiles,), args, meta, call.forward_warps)


def min_p_launch(call: TritonCall, x: torch.Tensor, contract: LogprobContract, row_max: torch.Tensor,
                 lmp: torch.Tensor, least: torch.Tensor, count: torch.Tensor, logits_dtype: torch.dtype) -> LaunchSpec:
    """min-p's launch, one program per (row, tile)."""
    width = contract.tile_width
    tiles = contract.local_tile_count
    real_local = real_local_columns(contract)
    args = (x, row_max, lmp, least, count, x.stride(0), real_local, contract.temperature32)
    meta = {"TILES": tiles, "WIDTH": width, "DTYPE": call.dtype_codes[logits_dtype],
            "PADDED": real_local < contract.local_grid_width, "TEMPERED": contract.tempered}
    return LaunchSpec("minp_kernel", (x.shape[0] * tiles,), args, meta, call.forward_warps)


def zero_launch(call: TritonCall, x: torch.Tensor, kv: torch.Tensor, kid: torch.Tensor, out: torch.Tensor,
                real_local: int, t32: float, logits_dtype: torch.dtype) -> LaunchSpec:
    """The masked backward's last launch: ``+0`` on the dropped real columns."""
    rows, local_vocab = x.shape
    block = min(call.backward_block, 1 << max(0, (real_local - 1).bit_length()))
    blocks = -(-real_local // block)
    return LaunchSpec("kept_zero_kernel", (rows * blocks,),
                      (x, kv, kid, out, x.stride(0), local_vocab, real_local, t32),
                      {"BLOCKS": blocks, "BLOCK": block, "DTYPE": call.dtype_codes[logits_dtype],
                       "TEMPERED": t32 != 1.0}, call.backward_warps)


def triton_kept_partials(
    call: TritonCall, logits: torch.Tensor, contract: LogprobContract, with_entropy: bool, validate: bool,
    keep: KeptCut, shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """``(m, s, t, finite, count)`` of the local shard with ``x_c = -inf`` outside each row's kept
    set; ``count`` (int32 ``[rows, tiles]``) is each tile's number of kept real columns. With
    ``shift`` (the row max ``B``) ``s`` is section 13's lane sum of ``E(RN32(x_c - B))``, and without
    validation or entropy (a search step) ``m`` is not computed (left uninitialised)."""
    x = call.raw(logits)
    rows = x.shape[0]
    tiles = contract.local_tile_count
    dev = logits.device
    m = torch.empty(rows, tiles, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    t = torch.empty_like(m) if with_entropy else None
    bad = torch.zeros(rows, tiles, dtype=torch.int8, device=dev) if validate else None
    count = torch.zeros(rows, tiles, dtype=torch.int32, device=dev)
    if rows and tiles:
        kv, kid = _cut(keep, contract.vocab_start, dev)
        call.run(kept_launch(call, x, contract, kv, kid, shift, m, s, t, bad, count, with_entropy, validate,
                             logits.dtype))
    finite = None
    if bad is not None:  # every real column, kept or not
        finite = bad.amax(dim=1) == 0 if tiles else torch.ones(rows, dtype=torch.bool, device=dev)
    return m, s, t, finite, count


def triton_min_p(
    call: TritonCall, logits: torch.Tensor, contract: LogprobContract, row_max: torch.Tensor, lmp: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile: the count of ``K1 = {c : RN32(x_c - B) >= lmp}`` (int32) and its least logit."""
    x = call.raw(logits)
    rows = x.shape[0]
    tiles = contract.local_tile_count
    dev = logits.device
    least = torch.full((rows, tiles), float("inf"), device=dev)
    count = torch.zeros(rows, tiles, dtype=torch.int32, device=dev)
    if rows and tiles:
        call.run(min_p_launch(call, x, contract, row_max.float().contiguous(), lmp.float().contiguous(), least,
                              count, logits.dtype))
    return count, least


def triton_kept_backward(
    call: TritonCall, logits: torch.Tensor, lse: torch.Tensor, terms: BackwardTerms,
) -> torch.Tensor:
    """Section 13 step 5: the raw backward's launches (``terms`` are the processed ones, ``terms.keep``
    the cut), then ``+0`` on every dropped real column (one more launch, after them on the same stream)."""
    if terms.keep is None:
        raise LogprobContractError("triton_kept_backward needs terms.keep (the kept set's cut)")
    grad = call.backward(logits, lse, terms)  # the raw launches (terms carry gl = 0 for dropped targets)
    x = call.raw(logits)
    rows, local_vocab = x.shape
    if rows and local_vocab and terms.real_local:
        out = grad if grad.dtype == torch.float32 else grad.view(torch.int16)
        kv, kid = _cut(terms.keep, terms.vocab_start, logits.device)
        call.run(zero_launch(call, x, kv, kid, out, terms.real_local, terms.t32, logits.dtype))
    return grad


class TritonKeptScan:
    """:class:`rl_engine.logprob.kept_search.KeptScan` on the Triton kernels (one launch a step)."""

    def __init__(self, call: TritonCall, logits: torch.Tensor, contract: LogprobContract) -> None:
        self.call = call
        self.logits = logits
        self.contract = contract

    def prefix(self, keep: KeptCut, row_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, z, _, _, count = triton_kept_partials(self.call, self.logits, self.contract, False, False, keep, row_max)
        return count, z

    def min_p(self, row_max: torch.Tensor, lmp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_min_p(self.call, self.logits, self.contract, row_max, lmp)


def triton_kept_cut(call: TritonCall, logits: torch.Tensor, contract: LogprobContract, sampling: Sampling,
                    group: Any, local_max: torch.Tensor) -> KeptCut:
    """The engine's ``kept_cut`` (``local_max``: this shard's max of the real tempered columns, from the
    raw forward's tile maxima): the search on the key (:func:`rl_engine.logprob.kept_search.engine_cut`)
    with :class:`TritonKeptScan` at every TP."""
    return engine_cut(TritonKeptScan(call, logits, contract), local_max, contract, sampling, group)


__all__ = [
    "LaunchSpec",
    "TritonCall",
    "TritonKeptScan",
    "kept_launch",
    "min_p_launch",
    "triton_kept_backward",
    "triton_kept_cut",
    "triton_kept_partials",
    "triton_min_p",
    "zero_launch",
]
