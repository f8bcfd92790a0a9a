"""``selected_logprob_from_hidden``: the logits made chunk by chunk from ``hidden @ weight.T``.

What holds always: the logprob, LSE and entropy are the op's bytes on each chunk's logits (the
chunks' products concatenated), and the gradients are the op's gradient to those logits turned
into ``hidden``'s and ``weight``'s. What holds where the matmul is row-invariant (each row's
bits independent of how many rows are multiplied together; measured here, per dtype): the
bytes of ``selected_logprob(hidden @ weight.T)`` and of its gradient to ``hidden``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from rl_engine.logprob import selected_logprob, selected_logprob_from_hidden
from rl_engine.logprob.contract import LogprobContractError
from rl_engine.tensorio import tensor_bytes

from _multiproc import run_workers

VOCAB, REAL, HIDDEN, CHUNK = 1024, 1000, 64, 16


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(3, 50, HIDDEN, generator=gen).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.3).to(dtype)
    ids = torch.randint(0, REAL, (3, 50), generator=gen)
    ids[:, :3] = -100
    return hidden, weight, ids


def _loss(out: Any) -> torch.Tensor:
    return out.selected_logp.sum() + 0.1 * out.lse.sum()


def _chunked_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    flat = hidden.reshape(-1, HIDDEN)
    return torch.cat([flat[i:i + CHUNK] @ weight.T for i in range(0, flat.shape[0], CHUNK)]).reshape(3, 50, VOCAB)


def _row_invariant(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    return tensor_bytes(hidden @ weight.T) == tensor_bytes(_chunked_logits(hidden, weight))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_outputs_are_the_op_s_bytes_on_the_chunks_logits(dtype: torch.dtype) -> None:
    hidden, weight, ids = _inputs(dtype)
    logits = _chunked_logits(hidden, weight).requires_grad_(True)
    ref = selected_logprob(logits, ids, real_vocab_size=REAL, compute_entropy=True)
    _loss(ref).backward()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    got = selected_logprob_from_hidden(h, w, ids, real_vocab_size=REAL, compute_entropy=True, chunk_tokens=CHUNK)
    _loss(got).backward()
    assert got.entropy is not None and ref.entropy is not None
    for name in ("selected_logp", "lse", "entropy"):
        assert tensor_bytes(getattr(got, name)) == tensor_bytes(getattr(ref, name)), name
    assert logits.grad is not None and h.grad is not None and w.grad is not None
    grad_logits = logits.grad.reshape(-1, VOCAB)
    flat = hidden.reshape(-1, HIDDEN)
    rows = [grad_logits[i:i + CHUNK] @ weight for i in range(0, flat.shape[0], CHUNK)]
    assert tensor_bytes(h.grad) == tensor_bytes(torch.cat(rows).reshape(h.shape))
    # the weight's gradient: the chunks' products added in the weight's dtype, one rounding each
    expect = torch.zeros_like(weight)
    for i in range(0, flat.shape[0], CHUNK):
        expect.addmm_(grad_logits[i:i + CHUNK].T, flat[i:i + CHUNK])
    assert tensor_bytes(w.grad) == tensor_bytes(expect)
    assert got.provenance is not None and got.provenance["chunk_tokens"] == CHUNK


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_where_the_matmul_is_row_invariant_the_materialised_bytes(dtype: torch.dtype) -> None:
    hidden, weight, ids = _inputs(dtype)
    if not _row_invariant(hidden, weight):
        pytest.skip(f"this CPU's {dtype} matmul gives a row other bits when fewer rows are multiplied "
                    "(measured): the chunked logits are not the whole product's")
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref = selected_logprob(h @ w.T, ids, real_vocab_size=REAL, compute_entropy=True)
    _loss(ref).backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    got = selected_logprob_from_hidden(h2, w2, ids, real_vocab_size=REAL, compute_entropy=True,
                                       chunk_tokens=CHUNK, grad_weight_fp32=True)
    _loss(got).backward()
    assert got.entropy is not None and ref.entropy is not None
    for name in ("selected_logp", "lse", "entropy"):
        assert tensor_bytes(getattr(got, name)) == tensor_bytes(getattr(ref, name)), name
    assert h.grad is not None and h2.grad is not None and w.grad is not None and w2.grad is not None
    assert tensor_bytes(h2.grad) == tensor_bytes(h.grad)
    # the weight's gradient sums the tokens in another order: equal within the dtype's rounding
    scale = float(w.grad.float().abs().max())
    assert float((w2.grad.float() - w.grad.float()).abs().max()) <= scale * torch.finfo(dtype).eps * 4


def test_one_chunk_gives_the_weight_gradient_of_the_materialised_path() -> None:
    hidden, weight, ids = _inputs(torch.bfloat16)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    _loss(selected_logprob(h @ w.T, ids, real_vocab_size=REAL)).backward()
    w2 = weight.clone().requires_grad_(True)
    _loss(selected_logprob_from_hidden(hidden, w2, ids, real_vocab_size=REAL, chunk_tokens=150)).backward()
    assert w.grad is not None and w2.grad is not None
    assert tensor_bytes(w2.grad) == tensor_bytes(w.grad)


def test_a_temperature_is_applied_as_the_op_applies_it() -> None:
    """One chunk (the logits are then exactly the materialised product) at ``T = 0.7``: the
    materialised call's bytes at the same temperature, gradients included; not the bytes at 1."""
    hidden, weight, ids = _inputs(torch.bfloat16)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref = selected_logprob(h @ w.T, ids, real_vocab_size=REAL, compute_entropy=True, temperature=0.7)
    _loss(ref).backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    got = selected_logprob_from_hidden(h2, w2, ids, real_vocab_size=REAL, compute_entropy=True, chunk_tokens=150,
                                       temperature=0.7)
    _loss(got).backward()
    for name in ("selected_logp", "lse", "entropy"):
        assert tensor_bytes(getattr(got, name)) == tensor_bytes(getattr(ref, name)), name
    assert tensor_bytes(h2.grad) == tensor_bytes(h.grad) and tensor_bytes(w2.grad) == tensor_bytes(w.grad)
    cold = selected_logprob_from_hidden(hidden, weight, ids, real_vocab_size=REAL, chunk_tokens=150)
    assert tensor_bytes(cold.selected_logp) != tensor_bytes(got.selected_logp)


def test_another_chunk_size_gives_the_same_logprob_bytes_where_the_matmul_is_row_invariant() -> None:
    hidden, weight, ids = _inputs(torch.bfloat16)
    if not _row_invariant(hidden, weight):
        pytest.skip("this CPU's bf16 matmul is not row-invariant (measured)")
    outs = [selected_logprob_from_hidden(hidden, weight, ids, real_vocab_size=REAL, chunk_tokens=c)
            for c in (1, 7, 64, 150)]
    assert len({tensor_bytes(o.selected_logp) for o in outs}) == 1


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


def _tp_head_worker(rank: int, case: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from rl_engine.distributed.mesh import init_mesh

    init_mesh(tp=2, cp=1, timeout_s=60)
    hidden, weight, ids = case["hidden"], case["weight"], case["ids"]
    rows = weight.shape[0] // 2
    shard = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_(True)
    h = hidden.clone().requires_grad_(True)
    out = selected_logprob_from_hidden(h, shard, ids, real_vocab_size=REAL, compute_entropy=True, chunk_tokens=CHUNK,
                                       temperature=0.7, group=dist.group.WORLD)
    (_loss(out) - 0.05 * out.entropy.sum()).backward()
    flat = hidden.reshape(-1, HIDDEN)
    with torch.no_grad():  # this rank's columns of each chunk's logits, as the head made them
        local = torch.cat([flat[i:i + CHUNK] @ shard.detach().T for i in range(0, flat.shape[0], CHUNK)])
    return {"logp": out.selected_logp.detach(), "lse": out.lse.detach(), "entropy": out.entropy.detach(),
            "grad_hidden": h.grad, "grad_shard": shard.grad, "local_logits": local}


def test_under_tp_each_rank_holds_its_vocabulary_shard_and_the_bytes_are_tp1_s_on_those_logits() -> None:
    """TP=2 on gloo, the lm_head split in two: every rank's logprob, LSE and entropy are the bytes of
    the one-rank op on the concatenated shards' logits (at T = 0.7, entropy in the loss); the
    hidden's gradient is the sum of the ranks' partial products (all-reduced, equal on both ranks)
    and each shard's gradient is the shard's (bytes: the same matmul of the same gradient rows)."""
    hidden, weight, ids = _inputs(torch.float32)
    results = run_workers(_tp_head_worker, 2, {"hidden": hidden, "weight": weight, "ids": ids}, timeout_s=240)
    logits = torch.cat([r["local_logits"] for r in results], dim=1).requires_grad_(True)
    ref = selected_logprob(logits, ids.reshape(-1), real_vocab_size=REAL, compute_entropy=True, temperature=0.7)
    (_loss(ref) - 0.05 * ref.entropy.sum()).backward()
    for r in results:
        for name, want in (("logp", ref.selected_logp), ("lse", ref.lse), ("entropy", ref.entropy)):
            assert tensor_bytes(r[name].reshape(-1)) == tensor_bytes(want.detach()), name
    assert tensor_bytes(results[0]["grad_hidden"]) == tensor_bytes(results[1]["grad_hidden"])
    rows = weight.shape[0] // 2
    grad_logits = logits.grad
    flat = hidden.reshape(-1, HIDDEN)
    for rank, r in enumerate(results):
        part = grad_logits[:, rank * rows:(rank + 1) * rows]
        expect = torch.zeros(rows, HIDDEN)
        for i in range(0, flat.shape[0], CHUNK):
            expect.addmm_(part[i:i + CHUNK].T, flat[i:i + CHUNK])
        assert tensor_bytes(r["grad_shard"]) == tensor_bytes(expect)
    partials = [torch.cat([grad_logits[i:i + CHUNK, k * rows:(k + 1) * rows].contiguous() @ weight[k * rows:(k + 1) * rows]
                           for i in range(0, flat.shape[0], CHUNK)]) for k in range(2)]
    # the matmul's bits depend on this process's thread count (the ranks run one thread): compared closely
    torch.testing.assert_close(results[0]["grad_hidden"].reshape(-1, HIDDEN), partials[0] + partials[1],
                               rtol=1e-5, atol=1e-6)
