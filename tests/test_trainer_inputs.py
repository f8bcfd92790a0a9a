"""A trainer's own inputs (int32 ids, integer masks, ``ignore_index``) and ``num_vocab_tiles="auto"``.

Every conversion is exact, so the bytes are compared with the int64/bool call's; every refusal
names the field, the value and the fix. The documented block of docs/trainer.md runs as written.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rl_engine.distributed.bounds import AUTO_TILES_RULE, BoundsError, auto_vocab_tiles
from rl_engine.logprob import selected_logprob
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.tensorio import tensor_bytes

TRAINER_MD = Path(__file__).resolve().parents[1] / "docs" / "trainer.md"
MARK = "<!-- run by tests/test_trainer_inputs.py -->"


def _inputs(dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 7, 1024, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 1000, (3, 7), generator=gen)
    active = torch.rand(3, 7, generator=gen) > 0.3
    return logits, targets, active


def _all_bytes(out: Any) -> tuple[bytes, ...]:
    held = (out.selected_logp, out.lse) + (() if out.entropy is None else (out.entropy,))
    return tuple(tensor_bytes(t) for t in held)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int32_ids_and_integer_masks_give_the_bytes_of_int64_and_bool(dtype: torch.dtype) -> None:
    logits, targets, active = _inputs(dtype)
    ref = selected_logprob(logits, targets, active, num_vocab_tiles=8, real_vocab_size=1000, compute_entropy=True)
    for mask in (active, active.to(torch.uint8), active.to(torch.int32), active.long()):
        got = selected_logprob(logits, targets.int(), mask, num_vocab_tiles=8, real_vocab_size=1000,
                               compute_entropy=True)
        assert _all_bytes(got) == _all_bytes(ref), mask.dtype
    # the mask matters: a control with one token flipped gives other bytes
    flipped = active.clone()
    flipped[0, 0] = ~flipped[0, 0]
    other = selected_logprob(logits, targets, flipped, num_vocab_tiles=8, real_vocab_size=1000, compute_entropy=True)
    assert _all_bytes(other) != _all_bytes(ref)


def test_without_a_mask_ignore_index_makes_a_token_inactive() -> None:
    logits, targets, active = _inputs()
    labels = targets.masked_fill(~active, -100)
    ref = selected_logprob(logits, targets, active, num_vocab_tiles=8, real_vocab_size=1000)
    got = selected_logprob(logits, labels, num_vocab_tiles=8, real_vocab_size=1000)
    assert _all_bytes(got)[:2] == _all_bytes(ref)[:2]
    assert bool((got.selected_logp[~active] == 0).all())
    custom = selected_logprob(logits, targets.masked_fill(~active, -1), num_vocab_tiles=8, real_vocab_size=1000,
                              ignore_index=-1)
    assert _all_bytes(custom)[:2] == _all_bytes(ref)[:2]
    # the gradient flows to the active rows only, whichever way the mask was given
    x = logits.clone().requires_grad_(True)
    selected_logprob(x, labels, num_vocab_tiles=8, real_vocab_size=1000).selected_logp.sum().backward()
    assert x.grad is not None and bool((x.grad[~active] == 0).all()) and bool((x.grad[active] != 0).any())


@pytest.mark.parametrize("change, needle", [
    (lambda l, t, a: (l, t.float(), a), "targets.dtype=torch.float32 is not a token-id type; pass int64 or int32"),
    (lambda l, t, a: (l, t > 0, a), "targets.dtype=torch.bool is not a token-id type"),
    (lambda l, t, a: (l, t, a.float()), "active.dtype=torch.float32 is not a mask type; pass a bool mask or an "
                                        "integer one of 0 and 1"),
    (lambda l, t, a: (l, t, a.long() * 2), "is not 0 or 1; an integer mask holds only 0"),
    (lambda l, t, a: (l, t.masked_fill(a, -100), a), "it equals ignore_index=-100: mark that row inactive"),
    (lambda l, t, a: (l, t[:, :3], None), "targets.shape=(3, 3) must equal logits.shape[:-1]=(3, 7)"),
])
def test_what_a_trainer_might_pass_wrongly_is_refused_by_name(change: Any, needle: str) -> None:
    with pytest.raises(LogprobContractError, match=re.escape(needle)):
        selected_logprob(*change(*_inputs()), num_vocab_tiles=8, real_vocab_size=1000)
    with pytest.raises(LogprobContractError, match=re.escape("ignore_index=True must be an integer")):
        selected_logprob(*_inputs(), num_vocab_tiles=8, real_vocab_size=1000, ignore_index=True)


def test_the_mask_that_holds_a_two_is_named_by_its_index() -> None:
    logits, targets, active = _inputs()
    mask = active.long()
    mask[1, 4] = 2
    with pytest.raises(LogprobContractError, match=re.escape("active[1, 4]=2 is not 0 or 1")):
        selected_logprob(logits, targets, mask, num_vocab_tiles=8, real_vocab_size=1000)


def test_the_documented_shift_by_one_block_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    text = TRAINER_MD.read_text(encoding="utf-8")
    assert text.count(MARK) == 1
    block = re.search(re.escape(MARK) + r"\n```python\n(.*?)^```", text, re.S | re.M)
    assert block is not None
    exec(compile(block.group(1), str(TRAINER_MD), "exec"), {"__name__": "__main__"})
    assert "'requested': 'auto', 'resolved': 8" in capsys.readouterr().out


# ----- num_vocab_tiles="auto" -----------------------------------------------------------------------


TABLE = {151936: 64, 152064: 48, 128256: 32, 50304: 16, 256000: 64, 262144: 64}


def test_auto_tiles_for_the_common_vocabularies_are_the_documented_table() -> None:
    text = TRAINER_MD.read_text(encoding="utf-8")
    for vocab, tiles in TABLE.items():
        assert auto_vocab_tiles(vocab, 8) == tiles
        assert f"| {vocab} | {tiles} | {vocab // tiles} |" in text, vocab
        width = vocab // tiles
        assert 128 <= width <= 4096 and tiles % 8 == 0
        # the smallest: no smaller multiple of 8 divides with tiles of at most 4096 columns
        assert not any(vocab % t == 0 and vocab // t <= 4096 for t in range(8, tiles, 8))
    with pytest.raises(BoundsError, match=re.escape("padded_vocab=50257 and max_tp=8")) as caught:
        auto_vocab_tiles(50257, 8, divisible=True)  # the campaign's rule
    assert "padded_vocab_size=50272, the smallest that has one" in str(caught.value)
    assert auto_vocab_tiles(50272, 8) == 16
    # no count divides 50257: the op's rule takes 16 tiles of ceil(50257 / 16) = 3142 columns
    assert auto_vocab_tiles(50257, 8) == 16
    assert "| 50257 | 16 | 3142 (the last tile 3127" in text


def test_auto_is_the_default_gives_the_explicit_count_s_bytes_and_is_recorded() -> None:
    logits, targets, active = _inputs()
    auto = selected_logprob(logits, targets, active, real_vocab_size=1000)
    given = selected_logprob(logits, targets, active, num_vocab_tiles=8, real_vocab_size=1000)
    other = selected_logprob(logits, targets, active, num_vocab_tiles=16, real_vocab_size=1000)
    assert auto.provenance is not None and auto.provenance["num_vocab_tiles"] == {
        "requested": "auto", "resolved": 8, "rule": AUTO_TILES_RULE, "max_tp": 8}
    assert given.provenance is not None and given.provenance["num_vocab_tiles"]["rule"] == "given"
    assert _all_bytes(auto)[:2] == _all_bytes(given)[:2]
    assert _all_bytes(other)[:2] != _all_bytes(given)[:2]  # the count is part of the numerical identity
    with pytest.raises(LogprobContractError, match="num_vocab_tiles='many' must be a positive integer or 'auto'"):
        selected_logprob(logits, targets, active, num_vocab_tiles="many")
    with pytest.raises(LogprobContractError, match="every count leaves a tile or a TP rank without a column"):
        selected_logprob(torch.zeros(2, 20, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64))


def _mesh(tp: int, tp_rank: int = 0) -> Any:
    return SimpleNamespace(dims=SimpleNamespace(tp=tp, cp=1), tp_rank=tp_rank, cp_rank=0)


def test_from_mesh_auto_takes_the_same_count_at_every_tp_dividing_max_tp() -> None:
    counts = {tp: LogprobContract.from_mesh(_mesh(tp), real_vocab_size=151936, num_sequences=1,
                                            seq_len=4).num_vocab_tiles for tp in (1, 2, 4, 8)}
    assert set(counts.values()) == {64}
    with pytest.raises(LogprobContractError, match=re.escape("the mesh's tp=3 does not divide max_tp=8")):
        LogprobContract.from_mesh(_mesh(3), real_vocab_size=151936, num_sequences=1, seq_len=4)
    assert LogprobContract.from_mesh(_mesh(3), real_vocab_size=1536, num_sequences=1, seq_len=4,
                                     max_tp=3).num_vocab_tiles == 3
