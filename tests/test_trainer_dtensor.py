"""Logits that are a DTensor sharded on the vocabulary, on two gloo ranks, against one rank.

Each rank holds ``Shard(-1)`` of the logits (as loss parallel or a ``ColwiseParallel`` lm_head
with ``use_local_output=False`` gives them); ``selected_logprob`` takes the TP group and the
rank's columns from the DTensor's mesh. The logp, LSE and entropy bytes equal the one-rank call's
on every rank, and the gradient, which comes back as a DTensor, holds the one-rank gradient's
columns of the rank, byte for byte.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from rl_engine.logprob import selected_logprob
from rl_engine.logprob.contract import LogprobContractError
from rl_engine.tensorio import tensor_bytes

from _multiproc import run_workers

VOCAB, REAL = 1024, 1000


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 6, VOCAB, generator=gen) * 3).to(torch.bfloat16)
    ids = torch.randint(0, REAL, (2, 6), generator=gen)
    ids[0, :2] = -100
    return logits, ids, torch.ones(2, 6, dtype=torch.bool)


def _one_rank() -> dict[str, bytes]:
    logits, ids, _ = _inputs()
    x = logits.clone().requires_grad_(True)
    out = selected_logprob(x, ids, real_vocab_size=REAL, compute_entropy=True)
    assert out.entropy is not None
    (out.selected_logp.sum() + 0.5 * out.lse.sum()).backward()
    assert x.grad is not None
    return {"logp": tensor_bytes(out.selected_logp), "lse": tensor_bytes(out.lse),
            "entropy": tensor_bytes(out.entropy), "grad": tensor_bytes(x.grad), "grad_tensor": x.grad}


def _worker(rank: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    logits, ids, _ = _inputs()
    half = VOCAB // 2
    local = logits[..., rank * half:(rank + 1) * half].clone().requires_grad_(True)
    sharded = DTensor.from_local(local, mesh, [Shard(2)])
    out = selected_logprob(sharded, ids, real_vocab_size=REAL, compute_entropy=True)
    assert out.entropy is not None and out.provenance is not None
    (out.selected_logp.sum() + 0.5 * out.lse.sum()).backward()
    assert local.grad is not None
    refused = []
    replicated = DTensor.from_local(logits, mesh, [Replicate()])
    for bad in (lambda: selected_logprob(replicated, ids, real_vocab_size=REAL),
                lambda: selected_logprob(sharded, DTensor.from_local(ids[:, :3], mesh, [Shard(1)]),
                                         real_vocab_size=REAL)):
        try:
            bad()
            refused.append(None)
        except LogprobContractError as exc:
            refused.append(str(exc))
    return {"logp": tensor_bytes(out.selected_logp), "lse": tensor_bytes(out.lse),
            "entropy": tensor_bytes(out.entropy), "grad": local.grad.detach().clone(),
            "provenance": out.provenance, "refused": refused}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_workers(_worker, 2, timeout_s=120)


def test_a_vocabulary_sharded_dtensor_gives_the_one_rank_bytes(ranks: list[dict[str, Any]]) -> None:
    one = _one_rank()
    half = VOCAB // 2
    for rank, got in enumerate(ranks):
        for name in ("logp", "lse", "entropy"):
            assert got[name] == one[name], (rank, name)
        columns = one["grad_tensor"][..., rank * half:(rank + 1) * half]
        assert tensor_bytes(got["grad"]) == tensor_bytes(columns), rank
        assert got["provenance"]["dtensor"] == {"mesh_dim": 0, "tp": 2, "tp_rank": rank,
                                                "columns": [rank * half, (rank + 1) * half]}
    # negative control: the other rank's gradient columns are other bytes
    assert tensor_bytes(ranks[0]["grad"]) != tensor_bytes(ranks[1]["grad"])


def test_a_dtensor_not_sharded_on_the_vocabulary_is_refused_naming_its_placements(
        ranks: list[dict[str, Any]]) -> None:
    for got in ranks:
        replicated, sharded_ids = got["refused"]
        assert replicated is not None and "placements [Replicate()]" in replicated and "Shard(-1)" in replicated
        assert sharded_ids is not None and re.search(r"targets is a DTensor with placements \[Shard\(dim=1\)\]",
                                                     sharded_ids), sharded_ids
