"""The GRPO loss's inputs for the tests: one small batch, built the same way for the
single-process tests (tests/test_grpo_loss_contract.py) and the gloo ones
(tests/test_distributed_grpo_loss.py).

Eight sequences of sixteen tokens in groups of four, a real vocabulary of 500 padded to 512;
each sequence has a prompt of 2 to 6 tokens that the loss ignores. Everything comes from one
seeded generator, drawn in a fixed order, so a seed names the same tensors on every machine.
"""

from __future__ import annotations

import torch

SEQS, SEQ_LEN, GROUP = 8, 16, 4
REAL_VOCAB, PADDED_VOCAB, TILES = 500, 512, 8


def grpo_inputs(seed: int, dtype: torch.dtype = torch.float32, *, ragged: bool = False, ignored_old: float = 0.0,
                equal_group: bool = False, advantages: bool = False) -> dict[str, torch.Tensor]:
    """Logits (``dtype``), reference logits, actions (-100 where ignored), the active mask, the
    old log-probabilities and one reward per sequence, in global token order (row
    ``s * SEQ_LEN + p``).

    ``ragged``: each response also ends early (at 9 to 16 tokens), so a sequence's active
    rows are not a suffix; ``ignored_old``: the old log-probability of an ignored row (NaN:
    the loss must never read it); ``equal_group``: the second group's rewards are all equal
    (a zero standard deviation); ``advantages``: one trainer-given advantage per sequence, not
    the group's, under ``"advantages"``.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = SEQS * SEQ_LEN
    logits = (2.0 * torch.randn(tokens, PADDED_VOCAB, generator=gen)).to(dtype)
    ref = (logits.float() + 0.3 * torch.randn(tokens, PADDED_VOCAB, generator=gen)).to(dtype)
    actions = torch.randint(0, REAL_VOCAB, (tokens,), generator=gen)
    position = torch.arange(SEQ_LEN).repeat(SEQS)
    prompt = torch.randint(2, 7, (SEQS,), generator=gen).repeat_interleave(SEQ_LEN)
    active = position >= prompt
    if ragged:
        length = torch.randint(9, SEQ_LEN + 1, (SEQS,), generator=gen).repeat_interleave(SEQ_LEN)
        active &= position < length
    actions = torch.where(active, actions, torch.full_like(actions, -100))
    safe = torch.where(active, actions, torch.zeros_like(actions))
    current = torch.log_softmax(logits.float()[:, :REAL_VOCAB], dim=-1).gather(1, safe[:, None])[:, 0]
    old = torch.where(active, current + 0.25 * torch.randn(tokens, generator=gen), torch.full_like(current, ignored_old))
    rewards = torch.randint(0, 3, (SEQS,), generator=gen).to(torch.float32)
    if equal_group:
        rewards[GROUP : 2 * GROUP] = 1.0
    data = {"logits": logits, "ref": ref, "actions": actions, "active": active, "old": old, "rewards": rewards}
    if advantages:
        data["advantages"] = torch.randn(SEQS, generator=gen)
    return data
