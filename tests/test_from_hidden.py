"""``selected_logprob_from_hidden``: the active rows' logits made chunk by chunk from ``hidden`` and the weight.

The logits are the fixed-order product (docs/arithmetic.md section 12; ``tests/test_head_matmul.py``
checks the product itself), so the logprob, LSE and entropy of an active token are the op's bytes on
that token's fixed-order logits, whatever the chunk size, the other active rows, the thread count
and the TP degree; inactive rows are not computed (``+0`` outputs, ``+0`` gradient rows). The
gradients are the op's gradient to those logits turned into ``hidden``'s (the library's product,
chunk by chunk) and ``weight``'s (added in binary32 by default). Under autocast the logits are made
in autocast's dtype, as the model's own head makes them. On two gloo ranks, in one launch: TP with
``group=``, the ranks disagreeing on the mask, an FSDP2 (``fully_shard``) lm_head and a
``ColwiseParallel`` one, both DTensor weights.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rl_engine.logprob import selected_logprob, selected_logprob_from_hidden
from rl_engine.logprob.contract import LogprobContractError
from rl_engine.logprob.head_matmul import fixed_logits
from rl_engine.tensorio import tensor_bytes

from _head_products import products_counted
from _multiproc import run_workers

VOCAB, REAL, HIDDEN, CHUNK = 1024, 1000, 64, 16


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(3, 50, HIDDEN, generator=gen).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.3).to(dtype)
    ids = torch.randint(0, REAL, (3, 50), generator=gen)
    ids[:, :3] = -100
    ids[1, 20:24] = -100
    return hidden, weight, ids


def _loss(out: Any) -> torch.Tensor:
    return out.selected_logp.sum() + 0.1 * out.lse.sum() - 0.05 * out.entropy.sum()


def _zeros_bytes(n: int) -> bytes:
    return tensor_bytes(torch.zeros(n))


def _reference(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, **options: Any) -> dict[str, Any]:
    """The op on the active rows' fixed-order logits (one call: the product is row-invariant), its
    gradient to them, and that gradient turned into the head's gradients as the head does it."""
    flat, flat_ids = hidden.reshape(-1, HIDDEN), ids.reshape(-1)
    rows = (flat_ids != -100).nonzero().reshape(-1)
    logits = fixed_logits(flat[rows], weight).requires_grad_(True)
    out = selected_logprob(logits, flat_ids[rows], real_vocab_size=REAL, compute_entropy=True, **options)
    _loss(out).backward()
    assert logits.grad is not None
    grad_logits = logits.grad
    grad_hidden = torch.zeros_like(flat)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32)
    for i in range(0, rows.numel(), CHUNK):
        grad_hidden[rows[i:i + CHUNK]] = grad_logits[i:i + CHUNK] @ weight
        grad_weight.addmm_(grad_logits[i:i + CHUNK].T.float(), flat[rows[i:i + CHUNK]].float())
    return {"rows": rows, "out": out, "grad_hidden": grad_hidden.reshape(hidden.shape),
            "grad_weight": grad_weight.to(weight.dtype)}


def _head(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, **options: Any) -> tuple[Any, Any, Any]:
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = selected_logprob_from_hidden(h, w, ids, real_vocab_size=REAL, compute_entropy=True, **options)
    _loss(out).backward()
    return out, h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_active_rows_get_the_op_s_bytes_on_their_fixed_order_logits_and_inactive_rows_plus_zero(
        dtype: torch.dtype) -> None:
    hidden, weight, ids = _inputs(dtype)
    ref = _reference(hidden, weight, ids)
    got, grad_hidden, grad_weight = _head(hidden, weight, ids, chunk_tokens=CHUNK)
    rows = ref["rows"]
    inactive = (ids.reshape(-1) == -100).nonzero().reshape(-1)
    for name in ("selected_logp", "lse", "entropy"):
        flat = getattr(got, name).reshape(-1)
        assert tensor_bytes(flat[rows]) == tensor_bytes(getattr(ref["out"], name)), name
        assert tensor_bytes(flat[inactive]) == _zeros_bytes(inactive.numel()), name  # +0: no logits made
    assert tensor_bytes(grad_hidden) == tensor_bytes(ref["grad_hidden"])  # +0 rows where inactive
    assert tensor_bytes(grad_weight) == tensor_bytes(ref["grad_weight"])  # binary32 sum, one rounding
    assert got.provenance["matmul"] == {"requested": "auto", "used": "fixed", "reason": "the CPU's fixed-order kernel"}
    assert got.provenance["chunk_tokens"] == CHUNK and got.provenance["grad_weight_fp32"] is True
    assert got.provenance["autocast"] is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_bytes_do_not_depend_on_the_chunk_size_the_other_active_rows_or_the_threads(dtype: torch.dtype) -> None:
    hidden, weight, ids = _inputs(dtype)
    base = selected_logprob_from_hidden(hidden, weight, ids, real_vocab_size=REAL, compute_entropy=True,
                                        chunk_tokens=CHUNK)
    fewer = ids.clone()
    fewer[0, 10:40] = -100  # a subset of the active rows
    previous = torch.get_num_threads()
    try:
        for chunk, threads in ((1, 1), (7, 2), (64, 1), (150, 2)):
            torch.set_num_threads(threads)
            for mask_ids in (ids, fewer):
                got = selected_logprob_from_hidden(hidden, weight, mask_ids, real_vocab_size=REAL,
                                                   compute_entropy=True, chunk_tokens=chunk)
                keep = (mask_ids.reshape(-1) != -100).nonzero().reshape(-1)
                for name in ("selected_logp", "lse", "entropy"):
                    want = getattr(base, name).reshape(-1)[keep]
                    assert tensor_bytes(getattr(got, name).reshape(-1)[keep]) == tensor_bytes(want), (chunk, name)
    finally:
        torch.set_num_threads(previous)


def test_computing_only_the_active_rows_gives_the_bytes_of_computing_every_row() -> None:
    """Every row made active (its logits computed) leaves the bytes of the rows that were active."""
    hidden, weight, ids = _inputs(torch.bfloat16)
    some = selected_logprob_from_hidden(hidden, weight, ids, real_vocab_size=REAL, compute_entropy=True)
    every = ids.clone()
    every[every == -100] = 5
    allrows = selected_logprob_from_hidden(hidden, weight, every, real_vocab_size=REAL, compute_entropy=True)
    keep = ids != -100
    for name in ("selected_logp", "lse", "entropy"):
        assert tensor_bytes(getattr(some, name)[keep]) == tensor_bytes(getattr(allrows, name)[keep]), name
    assert bool((allrows.lse[~keep] != 0).all())  # negative control: computed rows have an LSE
    none = selected_logprob_from_hidden(hidden, weight, torch.full_like(ids, -100), real_vocab_size=REAL)
    assert tensor_bytes(none.selected_logp) == tensor_bytes(torch.zeros(3, 50))


def test_a_temperature_is_applied_as_the_op_applies_it() -> None:
    """At ``T = 0.7``: the op's bytes at the same temperature on the same logits, gradients included;
    not the bytes at 1."""
    hidden, weight, ids = _inputs(torch.bfloat16)
    ref = _reference(hidden, weight, ids, temperature=0.7)
    got, grad_hidden, grad_weight = _head(hidden, weight, ids, chunk_tokens=CHUNK, temperature=0.7)
    rows = ref["rows"]
    for name in ("selected_logp", "lse", "entropy"):
        assert tensor_bytes(getattr(got, name).reshape(-1)[rows]) == tensor_bytes(getattr(ref["out"], name)), name
    assert tensor_bytes(grad_hidden) == tensor_bytes(ref["grad_hidden"])
    assert tensor_bytes(grad_weight) == tensor_bytes(ref["grad_weight"])
    cold = selected_logprob_from_hidden(hidden, weight, ids, real_vocab_size=REAL, chunk_tokens=CHUNK)
    assert tensor_bytes(cold.selected_logp) != tensor_bytes(got.selected_logp)


def test_under_autocast_the_logits_are_made_in_autocast_s_dtype_as_the_model_s_own_head_makes_them() -> None:
    """fp32 hidden state and weight under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (TRL's
    ``bf16=True``): with the library's product the logprob, LSE and entropy are the bytes of
    ``selected_logprob(F.linear(hidden, weight))`` under the same autocast (bf16 logits); with the
    fixed-order product, those of the op on the bf16 operands' fixed-order logits. The gradients
    come back in fp32; autocast off gives other (fp32-logit) bytes."""
    hidden, weight, ids = _inputs(torch.float32)
    flat, flat_ids = hidden.reshape(-1, HIDDEN), ids.reshape(-1)
    rows = (flat_ids != -100).nonzero().reshape(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(flat, weight)
        model = selected_logprob(logits, flat_ids, real_vocab_size=REAL, compute_entropy=True)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        library = selected_logprob_from_hidden(h, w, ids, real_vocab_size=REAL, compute_entropy=True,
                                               chunk_tokens=CHUNK, matmul="library")
        _loss(library).backward()
        fixed = selected_logprob_from_hidden(hidden, weight, ids, real_vocab_size=REAL, compute_entropy=True,
                                             chunk_tokens=CHUNK)
    assert logits.dtype == torch.bfloat16 and library.provenance["autocast"] == "bf16"
    for name in ("selected_logp", "lse", "entropy"):
        assert tensor_bytes(getattr(library, name).reshape(-1)[rows]) == tensor_bytes(getattr(model, name)[rows]), name
    assert h.grad is not None and w.grad is not None and h.grad.dtype == w.grad.dtype == torch.float32
    bf16 = selected_logprob(fixed_logits(flat[rows].bfloat16(), weight.bfloat16()), flat_ids[rows],
                            real_vocab_size=REAL, compute_entropy=True)
    assert tensor_bytes(fixed.selected_logp.reshape(-1)[rows]) == tensor_bytes(bf16.selected_logp)
    plain = selected_logprob_from_hidden(hidden, weight, ids, real_vocab_size=REAL, chunk_tokens=CHUNK)
    assert tensor_bytes(plain.selected_logp) != tensor_bytes(fixed.selected_logp)


def test_the_weight_gradient_is_summed_in_binary32_by_default_within_one_bf16_rounding_of_float64() -> None:
    """4096 bf16 tokens in 16 chunks: the default (binary32 sum, rounded once) is within one bf16
    rounding of the float64 sum of the same per-token terms (measured 1.66e-3 relative, the rounding
    of the exact value itself); the per-chunk bf16 sum (``grad_weight_fp32=False``, the old default)
    is several times further (measured 4.8e-3 here, 9.4e-3 at 16384 tokens)."""
    gen = torch.Generator().manual_seed(1)
    tokens, vocab = 4096, 512
    hidden = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(vocab, HIDDEN, generator=gen) * 0.3).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (tokens,), generator=gen)
    advantages = torch.randn(tokens, generator=gen)
    logits = fixed_logits(hidden, weight).requires_grad_(True)
    (selected_logprob(logits, ids).selected_logp * advantages).sum().backward()
    assert logits.grad is not None
    exact = logits.grad.double().T @ hidden.double()  # the same terms, summed in float64

    def error(grad: torch.Tensor) -> float:
        return float((grad.double() - exact).norm() / exact.norm())

    grads = {}
    for fp32 in (True, False):
        w = weight.clone().requires_grad_(True)
        (selected_logprob_from_hidden(hidden, w, ids, grad_weight_fp32=fp32).selected_logp * advantages).sum().backward()
        grads[fp32] = w.grad
    one_rounding = error(exact.to(torch.bfloat16))
    assert error(grads[True]) <= one_rounding * 1.01
    assert error(grads[False]) > 2 * error(grads[True])


@pytest.mark.parametrize("change, needle", [
    (lambda h, w, t: (h.double(), w, t), "hidden must be a bf16, fp16 or fp32 tensor"),
    (lambda h, w, t: (h, w.float(), t), "must share a dtype (the logits') and a device"),
    (lambda h, w, t: (h, w[:, :32], t), "with one hidden_size"),
    (lambda h, w, t: (h, w, t.float()), "targets.dtype=torch.float32 is not a token-id type"),
])
def test_bad_inputs_are_refused_by_name(change: Any, needle: str) -> None:
    with pytest.raises(LogprobContractError, match=re.escape(needle)):
        selected_logprob_from_hidden(*change(*_inputs(torch.bfloat16)), real_vocab_size=REAL)
    with pytest.raises(LogprobContractError, match=re.escape("chunk_tokens=0 must be a positive integer")):
        selected_logprob_from_hidden(*_inputs(torch.bfloat16), real_vocab_size=REAL, chunk_tokens=0)
    with pytest.raises(LogprobContractError, match=re.escape("matmul='cublas' must be one of")):
        selected_logprob_from_hidden(*_inputs(torch.bfloat16), real_vocab_size=REAL, matmul="cublas")
    with pytest.raises(LogprobContractError, match=re.escape("weight_grad_reduce='max' must be one of ('mean', 'sum')")):
        selected_logprob_from_hidden(*_inputs(torch.bfloat16), real_vocab_size=REAL, weight_grad_reduce="max")


@pytest.mark.parametrize("change, keywords, needle", [
    (lambda h, w, t: (h[..., :0], w[:, :0], t), {}, "have hidden_size 0: the logits would be sums of nothing"),
    (lambda h, w, t: (h, w, t), {"group": 1}, "group=1 is not a torch.distributed ProcessGroup; pass the TP group"),
    (lambda h, w, t: (h, w, t), {"group": "tp"}, "group='tp' is not a torch.distributed ProcessGroup"),
    (lambda h, w, t: (h, w, t), {"temperature": 10**400},
     "temperature=100000000000... (an integer of 401 digits) is outside [2**-64, 2**64]"),
])
def test_arguments_that_raised_bare_python_errors_are_refused_by_name(change: Any, keywords: dict[str, Any],
                                                                      needle: str) -> None:
    """``group=1`` was an ``AttributeError``, a hidden size of 0 a reshape ``RuntimeError`` and
    ``temperature=10**400`` an ``OverflowError``: each is the domain's error naming the argument,
    the value and the fix, before anything is computed."""
    with pytest.raises(LogprobContractError, match=re.escape(needle)):
        selected_logprob_from_hidden(*change(*_inputs(torch.bfloat16)), real_vocab_size=REAL, **keywords)


# ---------------------------------------------------------------------------------------- two gloo ranks

class _TinyLM(torch.nn.Module):
    """An embedding, a projection and an lm_head: the fused head reads ``lm_head.weight`` directly
    (as TRL's patched forward does), or the lm_head's own forward makes the logits (``fused=False``)."""

    def __init__(self, fused: bool, **head: Any) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(REAL, 32)
        self.proj = torch.nn.Linear(32, 32)
        self.lm_head = torch.nn.Linear(32, VOCAB, bias=False)
        self.fused, self.head = fused, head

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(self.proj(self.embed(ids)))
        if self.fused:
            out = selected_logprob_from_hidden(hidden, self.lm_head.weight, labels, real_vocab_size=REAL, **self.head)
        else:
            out = selected_logprob(self.lm_head(hidden), labels, real_vocab_size=REAL)
        return out.selected_logp.clone(), hidden


def _model_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, REAL, (2, 7), generator=gen)
    labels = torch.randint(0, REAL, (2, 7), generator=gen)
    labels[0, :2] = -100
    return ids, labels


def _fsdp(rank: int, mesh: Any) -> dict[str, Any]:
    """FSDP2 on the lm_head (its own unit, whose forward the fused head never calls: its weight stays a
    sharded DTensor) and on the model; each rank its own tokens. With the library's product and one
    chunk, the fused head's gradients are FSDP2's own path's bytes (lm_head forward, reduce-scatter);
    with the default product, the rank's full-weight gradient is returned for the parent's mean."""
    from torch.distributed.fsdp import fully_shard

    found: dict[str, Any] = {}
    ids, labels = _model_inputs(100 + rank)
    for name, fused, head in (("library", True, {"matmul": "library", "chunk_tokens": 64}), ("fsdp", False, {}),
                              ("fixed", True, {}), ("fixed_kept", True, {"keep_logits": True})):
        torch.manual_seed(0)
        model = _TinyLM(fused, **head)
        fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        logp, hidden = model(ids, labels)
        with products_counted() as backward_products:
            (-logp.sum()).backward()
        grad = model.lm_head.weight.grad
        found[name] = {"logp": logp.detach(), "grad_type": type(grad).__name__, "placements": str(grad.placements),
                       "lm_head": grad.to_local().clone(), "proj": model.proj.weight.grad.to_local().clone(),
                       "backward_products": len(backward_products)}
        if name == "fixed":
            whole = model.lm_head.weight.full_tensor().detach().requires_grad_(True)
            own = selected_logprob_from_hidden(hidden.detach(), whole, labels, real_vocab_size=REAL)
            (-own.selected_logp.sum()).backward()
            found[name]["own_full_grad"] = whole.grad
            found[name]["own_logp"] = own.selected_logp.detach()
    return found


def _tp_plan(rank: int, mesh: Any, keep_logits: bool = False) -> dict[str, Any]:
    """A ``ColwiseParallel`` lm_head (weight Shard(0) on the TP mesh) read with ``group=`` the mesh's:
    the same tokens on both ranks, the vocabulary split in two."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = _TinyLM(True, group=mesh.get_group(), compute_entropy=True)
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel()})
    ids, labels = _model_inputs(7)
    hidden = torch.tanh(model.proj(model.embed(ids))).detach().requires_grad_(True)
    out = selected_logprob_from_hidden(hidden, model.lm_head.weight, labels, real_vocab_size=REAL,
                                       compute_entropy=True, group=mesh.get_group(), keep_logits=keep_logits)
    with products_counted() as backward_products:
        (-(out.selected_logp.sum()) - 0.01 * out.entropy.sum()).backward()
    grad = model.lm_head.weight.grad
    return {"logp": out.selected_logp.detach(), "lse": out.lse.detach(), "entropy": out.entropy.detach(),
            "hidden": hidden.detach(), "weight": model.lm_head.weight.full_tensor().detach(),
            "grad_type": type(grad).__name__, "grad": grad.to_local().clone(), "grad_hidden": hidden.grad,
            "provenance": out.provenance["dtensor_weight"], "keep_logits": out.provenance["keep_logits"],
            "backward_products": len(backward_products)}


def _ranks_worker(rank: int, case: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    hidden, weight, ids = case["hidden"], case["weight"], case["ids"]
    rows = VOCAB // 2
    shard = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_(True)
    h = hidden.clone().requires_grad_(True)
    out = selected_logprob_from_hidden(h, shard, ids, real_vocab_size=REAL, compute_entropy=True, chunk_tokens=CHUNK,
                                       temperature=0.7, group=dist.group.WORLD)
    with products_counted() as backward_products:
        _loss(out).backward()
    found: dict[str, Any] = {"group": {"backward_products": len(backward_products),
                                       "logp": out.selected_logp.detach(), "lse": out.lse.detach(),
                                       "entropy": out.entropy.detach(), "grad_hidden": h.grad,
                                       "grad_shard": shard.grad}}
    kept_shard, kept_h = shard.detach().clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    kept = selected_logprob_from_hidden(kept_h, kept_shard, ids, real_vocab_size=REAL, compute_entropy=True,
                                        chunk_tokens=CHUNK, temperature=0.7, group=dist.group.WORLD, keep_logits=True)
    with products_counted() as backward_products:
        _loss(kept).backward()
    found["group_kept"] = {"backward_products": len(backward_products), "keep_logits": kept.provenance["keep_logits"],
                           "logp": kept.selected_logp.detach(), "lse": kept.lse.detach(),
                           "entropy": kept.entropy.detach(), "grad_hidden": kept_h.grad, "grad_shard": kept_shard.grad}
    other = ids.clone()
    if rank == 1:
        other[2, 40] = -100  # this rank alone deactivates a row
    try:
        selected_logprob_from_hidden(hidden, shard.detach(), other, real_vocab_size=REAL, group=dist.group.WORLD)
        found["disagree"] = None
    except LogprobContractError as exc:
        found["disagree"] = str(exc)
    found["fsdp"] = _fsdp(rank, mesh)
    found["tp_plan"] = _tp_plan(rank, mesh)
    found["tp_plan_kept"] = _tp_plan(rank, mesh, keep_logits=True)
    found["refused"] = _refusals(mesh, weight, hidden, ids)
    return found


def _refusals(mesh: Any, weight: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor) -> list[str | None]:
    """DTensor weights the head does not take: replicated, sharded on the hidden dimension, on a
    two-dimensional mesh; each refused naming the placement or the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    square = init_device_mesh("cpu", (1, 2))
    found: list[str | None] = []
    for bad in (distribute_tensor(weight, mesh, [Replicate()]), distribute_tensor(weight, mesh, [Shard(1)]),
                distribute_tensor(weight, square, [Replicate(), Shard(0)])):
        try:
            selected_logprob_from_hidden(hidden, bad, ids, real_vocab_size=REAL)
            found.append(None)
        except LogprobContractError as exc:
            found.append(str(exc))
    return found


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    hidden, weight, ids = _inputs(torch.float32)
    return run_workers(_ranks_worker, 2, {"hidden": hidden, "weight": weight, "ids": ids}, timeout_s=240)


def test_under_tp_each_rank_holds_its_vocabulary_shard_and_the_bytes_are_one_rank_s(
        ranks: list[dict[str, Any]]) -> None:
    """TP=2 with ``group=``, the lm_head split in two, T = 0.7, entropy in the loss: every rank's
    logprob, LSE and entropy are the one-rank head's bytes (each shard's fixed-order logits are the
    whole product's columns); the hidden's gradient is all-reduced (equal on both ranks) and close to
    the one-rank one; each shard's gradient is close to the one-rank gradient's rows."""
    hidden, weight, ids = _inputs(torch.float32)
    one, grad_hidden, grad_weight = _head(hidden, weight, ids, chunk_tokens=CHUNK, temperature=0.7)
    for r in ranks:
        for name, want in (("logp", one.selected_logp), ("lse", one.lse), ("entropy", one.entropy)):
            assert tensor_bytes(r["group"][name]) == tensor_bytes(want), name
    assert tensor_bytes(ranks[0]["group"]["grad_hidden"]) == tensor_bytes(ranks[1]["group"]["grad_hidden"])
    torch.testing.assert_close(ranks[0]["group"]["grad_hidden"], grad_hidden, rtol=1e-5, atol=1e-6)
    rows = VOCAB // 2
    for rank, r in enumerate(ranks):
        torch.testing.assert_close(r["group"]["grad_shard"], grad_weight[rank * rows:(rank + 1) * rows],
                                   rtol=1e-5, atol=1e-6)


def test_tp_ranks_that_disagree_on_the_active_rows_raise_together(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["disagree"] is not None and "the TP ranks disagree on active" in r["disagree"], r["disagree"]
        assert "Give every TP rank the same targets and mask." in r["disagree"]


def test_an_fsdp2_lm_head_is_gathered_and_its_gradient_reduced_as_fsdp2_s_own_path_does(
        ranks: list[dict[str, Any]]) -> None:
    """The DTensor weight of ``fully_shard`` works as it is: with the library's product the logprob
    and the gradients of the lm_head (a Shard(0) DTensor) and of the layer below are the bytes of
    FSDP2's own path (the lm_head's forward, FSDP2's reduce-scatter); with the default product the
    lm_head's gradient is the mean over the ranks of each rank's whole-weight gradient (2 ranks:
    exact), on the rank's rows, and the logprob the plain call's bytes."""
    for r in ranks:
        lib, own = r["fsdp"]["library"], r["fsdp"]["fsdp"]
        assert lib["grad_type"] == "DTensor" and lib["placements"] == own["placements"] == "(Shard(dim=0),)"
        for name in ("logp", "lm_head", "proj"):
            assert tensor_bytes(lib[name]) == tensor_bytes(own[name]), name
    mean = (ranks[0]["fsdp"]["fixed"]["own_full_grad"] + ranks[1]["fsdp"]["fixed"]["own_full_grad"]) / 2
    rows = VOCAB // 2
    for rank, r in enumerate(ranks):
        fixed = r["fsdp"]["fixed"]
        assert tensor_bytes(fixed["lm_head"]) == tensor_bytes(mean[rank * rows:(rank + 1) * rows])
        assert tensor_bytes(fixed["logp"]) == tensor_bytes(fixed["own_logp"])
    # negative control: each rank's own gradient is not the reduced one
    assert tensor_bytes(ranks[0]["fsdp"]["fixed"]["own_full_grad"][:rows]) != tensor_bytes(mean[:rows])


def test_a_colwise_parallel_lm_head_takes_the_tp_path_with_the_one_rank_bytes(ranks: list[dict[str, Any]]) -> None:
    """``ColwiseParallel`` on the lm_head, ``group=`` the TP mesh's: no gather; each rank's logprob,
    LSE and entropy are the one-rank head's bytes on the whole weight, and the DTensor's gradient holds
    the shard's rows of the one-rank gradient (close: the library's product of the shard)."""
    rows = VOCAB // 2
    for rank, r in enumerate(ranks):
        plan = r["tp_plan"]
        assert plan["provenance"] == {"mesh_size": 2, "placement": "S(0)", "use": "tp", "tp_rank": rank,
                                      "rows": [rank * rows, (rank + 1) * rows]}
        _, labels = _model_inputs(7)
        h, w = plan["hidden"].clone().requires_grad_(True), plan["weight"].clone().requires_grad_(True)
        one = selected_logprob_from_hidden(h, w, labels, real_vocab_size=REAL, compute_entropy=True)
        (-(one.selected_logp.sum()) - 0.01 * one.entropy.sum()).backward()
        for name, want in (("logp", one.selected_logp), ("lse", one.lse), ("entropy", one.entropy)):
            assert tensor_bytes(plan[name]) == tensor_bytes(want), name
        assert plan["grad_type"] == "DTensor"
        torch.testing.assert_close(plan["grad"], w.grad[rank * rows:(rank + 1) * rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(plan["grad_hidden"], h.grad, rtol=1e-5, atol=1e-6)


def test_kept_logits_give_the_recomputing_bytes_under_tp_fsdp2_and_a_tp_plan(ranks: list[dict[str, Any]]) -> None:
    """``keep_logits=True`` on every TP/DTensor path: ``group=`` with a plain shard (T = 0.7, entropy in
    the loss), an FSDP2 lm_head (gathered) and a ``ColwiseParallel`` one: each rank's outputs and
    gradients (the hidden's all-reduced one, the shard's, the DTensor's, the layer below's) are the
    bytes of the same call without it (``tests/test_keep_logits.py`` has the negative controls)."""
    for r in ranks:
        for name in ("logp", "lse", "entropy", "grad_hidden", "grad_shard"):
            assert tensor_bytes(r["group_kept"][name]) == tensor_bytes(r["group"][name]), name
        for name in ("logp", "lm_head", "proj"):
            assert tensor_bytes(r["fsdp"]["fixed_kept"][name]) == tensor_bytes(r["fsdp"]["fixed"][name]), name
        for name in ("logp", "lse", "entropy", "grad", "grad_hidden"):
            assert tensor_bytes(r["tp_plan_kept"][name]) == tensor_bytes(r["tp_plan"][name]), name
        # the logits were kept on each path: no product in its backward, where the recomputing call makes them again
        for kept, made in ((r["group_kept"], r["group"]), (r["fsdp"]["fixed_kept"], r["fsdp"]["fixed"]),
                           (r["tp_plan_kept"], r["tp_plan"])):
            assert kept["backward_products"] == 0 and made["backward_products"] > 0, (kept, made)
        for kept in (r["group_kept"], r["tp_plan_kept"]):
            assert kept["keep_logits"] == {"requested": True, "kept": True}, kept["keep_logits"]
        assert r["tp_plan"]["keep_logits"] == {"requested": False, "kept": False}
    assert tensor_bytes(ranks[0]["group_kept"]["grad_shard"]) != tensor_bytes(ranks[1]["group_kept"]["grad_shard"])


def test_dtensor_weights_the_head_does_not_take_are_refused_naming_them(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        replicated, hidden_sharded, square = r["refused"]
        assert replicated is not None and "placements [Replicate()]" in replicated and "weight.to_local()" in replicated
        assert "every rank of the DP group stops" in replicated  # both ranks, before the gather
        assert hidden_sharded is not None and "placements [Shard(dim=1)]" in hidden_sharded and "Shard(0)" in hidden_sharded
        assert square is not None and "on a 2-dimensional mesh" in square
