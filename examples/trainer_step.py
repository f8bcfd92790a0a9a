"""One trainer step with the deterministic selected-token logprob on a TP x CP mesh.

Run (CPU, gloo; 4 ranks = TP 2 x CP 2):

    torchrun --standalone --nproc-per-node=4 examples/trainer_step.py --tp 2 --cp 2

On GPUs add ``--device cuda`` (one GPU per rank, nccl). Rank 0 prints one JSON line: the
fingerprints of the global selected logprob and LSE, and whether they, and every rank's
gradient block, are byte-identical to the single-rank call on the same logits
(``tests/test_trainer_example.py`` runs this file and checks that line).

The guarantee needs identical logit bits in: here every rank cuts its block out of the same
full logits. In a real trainer the logits come from a TP-sharded ``lm_head``; a sharded
matmul does not give the same bits as an unsharded one, so making the logits themselves
identical across TP degrees is the caller's side.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from rl_engine.distributed.mesh import destroy
from rl_engine.logprob import LogprobContract, gather_tokens, init_mesh, selected_logprob, selected_logprob_tp
from rl_engine.logprob.backends.eager.vocab_parallel import BACKEND_ID
from rl_engine.tensorio import fingerprint, tensor_bytes

REAL_VOCAB, PADDED_VOCAB, TILES = 1000, 1024, 16  # 24 padding columns, tiles of 64
SEQUENCES, SEQ_LEN, PROMPT = 2, 16, 4  # the first PROMPT positions of a sequence are inactive


def make_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global inputs in global token order (``sequence * SEQ_LEN + position``).

    logits: bf16 ``[SEQUENCES * SEQ_LEN, PADDED_VOCAB]``; targets: int64 ``[SEQUENCES *
    SEQ_LEN]``; active: bool ``[SEQUENCES * SEQ_LEN]``.
    """
    g = torch.Generator().manual_seed(seed)
    tokens = SEQUENCES * SEQ_LEN
    logits = (torch.randn(tokens, PADDED_VOCAB, generator=g) * 2.0).to(torch.bfloat16)
    targets = torch.randint(0, REAL_VOCAB, (tokens,), generator=g, dtype=torch.int64)
    active = (torch.arange(tokens) % SEQ_LEN) >= PROMPT
    return logits, targets, active


def loss_of(logp: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Mean negative logprob over active tokens, in global token order (same on every rank)."""
    return -(logp * active).sum() / active.sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()

    mesh = init_mesh(tp=args.tp, cp=args.cp, device=args.device)  # from torchrun's environment
    contract = LogprobContract.from_mesh(  # degrees and this rank's coordinates from the mesh
        mesh, real_vocab_size=REAL_VOCAB, padded_vocab_size=PADDED_VOCAB,
        num_vocab_tiles=TILES, num_sequences=SEQUENCES, seq_len=SEQ_LEN,
        cp_layout="zigzag", logits_dtype="bf16",
    )

    # This rank's block: its CP tokens (rows) and its TP vocabulary columns.
    full_logits, full_targets, full_active = make_batch()
    rows = torch.tensor(contract.token_indices)
    logits = full_logits[rows, contract.vocab_start : contract.vocab_end].to(mesh.device)
    logits.requires_grad_(True)  # stands for the lm_head output, [num_tokens, local_vocab]
    targets = full_targets[rows].to(mesh.device)  # int64 [num_tokens]
    active = full_active[rows].to(mesh.device)  # bool [num_tokens]

    out = selected_logprob_tp(logits, targets, active, contract, mesh, backend=BACKEND_ID,  # explicit: fails closed
                              compute_entropy=True)
    logp = gather_tokens(out.selected_logp, contract, mesh.cp_group)  # global token order
    lse = gather_tokens(out.lse.detach(), contract, mesh.cp_group)
    loss = loss_of(logp, full_active.to(mesh.device))
    loss.backward()  # logits.grad: this rank's block of d loss / d (full logits)

    # The same step on one rank with the full logits: the bytes must be the same.
    x = full_logits.clone().requires_grad_(True)
    ref = selected_logprob(x, full_targets, full_active, num_vocab_tiles=TILES,
                           real_vocab_size=REAL_VOCAB)
    loss_of(ref.selected_logp, full_active).backward()
    assert x.grad is not None and logits.grad is not None
    block = x.grad[rows, contract.vocab_start : contract.vocab_end]
    mine = {
        "rank": mesh.rank,
        "tp_rank": mesh.tp_rank,
        "cp_rank": mesh.cp_rank,
        "grad_equal": tensor_bytes(logits.grad) == tensor_bytes(block),
        "logp_equal": tensor_bytes(logp) == tensor_bytes(ref.selected_logp),
        "lse_equal": tensor_bytes(lse) == tensor_bytes(ref.lse),
    }
    everyone: list[dict[str, object]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    if mesh.rank == 0:
        print(json.dumps({
            "tp": args.tp,
            "cp": args.cp,
            "loss": float(loss.detach()),
            "logp_sha256": fingerprint(logp),
            "lse_sha256": fingerprint(lse),
            "equal_to_single_rank": all(
                r["grad_equal"] and r["logp_equal"] and r["lse_equal"] for r in everyone
            ),
            "ranks": everyone,
        }, sort_keys=True))
    destroy()


if __name__ == "__main__":
    main()
