"""The TP x CP matrix on a captured file: each rank reads only its own tokens and vocabulary
columns (rl_engine.capture.shard) and the outputs are the same bytes at every topology.

The capture comes from a tiny transformers model (bf16, eager attention); every topology runs
on real gloo process groups (tests/_multiproc.py). A campaign on a capture runs
through the same reader (tests/test_capture_campaign.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rl_engine.capture import CaptureError, read_capture, read_header, write_capture
from rl_engine.capture.hf import capture_causal_lm
from rl_engine.capture.shard import rank_inputs
from rl_engine.logprob import LogprobContract
from rl_engine.logprob.backends.eager.vocab_parallel import VocabParallelLogprob
from rl_engine.tensorio import fingerprint

from _multiproc import run_workers
from _tiny_lm import VOCAB, padded, tiny_model, variant

TILES = 16
LENGTHS = (7, 11, 9, 5)  # 6 + 10 + 8 + 4 = 28 tokens: splits for CP=2 contiguous and zigzag
TOKENS = sum(n - 1 for n in LENGTHS)
TOPOLOGIES = ((2, 1, "contiguous"), (1, 2, "zigzag"), (2, 2, "contiguous"))


def _contract(tp: int = 1, cp: int = 1, tp_rank: int = 0, cp_rank: int = 0, layout: str = "contiguous",
              seq_len: int = TOKENS) -> LogprobContract:
    return LogprobContract(real_vocab_size=VOCAB, padded_vocab_size=VOCAB, num_vocab_tiles=TILES,
                           num_sequences=TOKENS // seq_len, seq_len=seq_len, tp_world_size=tp, tp_rank=tp_rank,
                           cp_world_size=cp, cp_rank=cp_rank, cp_layout=layout, logits_dtype="bf16")


def _run(contract: LogprobContract, logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor,
         group: Any = None) -> dict[str, Any]:
    x = logits.clone().requires_grad_(True)
    out = VocabParallelLogprob()(x, targets, active, contract, group=group, compute_entropy=True)
    out.selected_logp.backward(torch.ones_like(out.selected_logp))
    assert x.grad is not None and out.entropy is not None
    return {"tokens": list(contract.token_indices), "cols": (contract.vocab_start, contract.vocab_end),
            "shape": tuple(logits.shape), "logp": out.selected_logp.detach(), "lse": out.lse.detach(),
            "entropy": out.entropy.detach(), "grad": x.grad.detach(), "tp_rank": contract.tp_rank}


def _worker(rank: int, path: str, tp: int, cp: int, layout: str) -> dict[str, Any]:
    from rl_engine.distributed.mesh import init_mesh

    mesh = init_mesh(tp=tp, cp=cp)
    contract = LogprobContract.from_mesh(mesh, real_vocab_size=VOCAB, num_vocab_tiles=TILES, num_sequences=1,
                                         seq_len=TOKENS, cp_layout=layout, logits_dtype="bf16")
    logits, targets, active = rank_inputs(path, contract)
    return _run(contract, logits, targets, active, group=mesh.tp_group)


@pytest.fixture(scope="module")
def capture_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENGTHS]
    cap = capture_causal_lm(variant(tiny_model(), torch.bfloat16, "eager"), *padded(seqs, left=False))
    path = tmp_path_factory.mktemp("shards") / "capture.safetensors"
    write_capture(path, cap)
    assert cap.num_tokens == TOKENS
    return path


def _assemble(results: list[dict[str, Any]]) -> dict[str, str]:
    out = {name: torch.zeros(TOKENS) for name in ("logp", "lse", "entropy")}
    grad = torch.zeros(TOKENS, VOCAB, dtype=torch.bfloat16)
    cover = torch.zeros(TOKENS, VOCAB, dtype=torch.int64)
    for r in results:
        idx = torch.tensor(r["tokens"])
        start, end = r["cols"]
        assert r["shape"] == (len(r["tokens"]), end - start)  # the rank held only its block
        grad[idx, start:end] = r["grad"]
        cover[idx, start:end] += 1
        if r["tp_rank"] == 0:
            for name in out:
                out[name][idx] = r[name]
    assert bool((cover == 1).all())
    return {**{name: fingerprint(t) for name, t in out.items()}, "grad": fingerprint(grad)}


@pytest.mark.slow  # eight gloo processes: about 15 s on the loaded 2-core development machine
def test_every_topology_gives_the_single_rank_bytes_on_a_capture(capture_path: Path) -> None:
    cap = read_capture(capture_path)
    reference = _assemble([_run(_contract(), cap.logits, cap.targets, cap.active)])
    for tp, cp, layout in TOPOLOGIES:
        results = run_workers(_worker, tp * cp, str(capture_path), tp, cp, layout, timeout_s=180)
        assert _assemble(results) == reference, (tp, cp, layout)


def test_a_rank_reads_only_its_block_in_process(capture_path: Path) -> None:
    cap = read_capture(capture_path)
    header = read_header(capture_path)
    contract = _contract(tp=2, cp=2, tp_rank=1, cp_rank=1, layout="zigzag")
    logits, targets, active = rank_inputs(capture_path, contract, header)
    rows = list(contract.token_indices)
    assert logits.shape == (len(rows), VOCAB // 2) and len(rows) == TOKENS // 2
    want = cap.logits[rows, VOCAB // 2:].contiguous()
    assert logits.view(torch.int16).numpy().tobytes() == want.view(torch.int16).numpy().tobytes()
    assert targets.numpy().tobytes() == cap.targets[rows].numpy().tobytes()


@pytest.mark.parametrize("change, message", [
    ({"seq_len": 14, "num_sequences": 3}, r"num_sequences \* seq_len = 3 \* 14 = 42 must be the capture's 28 tokens"),
    ({"logits_dtype": "fp32"}, r"logits_dtype='fp32' must be the capture's 'bf16'"),
    ({"real_vocab_size": 4000}, r"real_vocab_size=4000 and padded_vocab_size=4096 must both be"),
])
def test_a_contract_that_does_not_describe_the_capture_is_refused(capture_path: Path, change: dict[str, Any],
                                                                  message: str) -> None:
    fields = dict(real_vocab_size=VOCAB, padded_vocab_size=VOCAB, num_vocab_tiles=TILES, num_sequences=1,
                  seq_len=TOKENS, logits_dtype="bf16")
    fields.update(change)
    with pytest.raises(CaptureError, match=message):
        rank_inputs(capture_path, LogprobContract(**fields))
