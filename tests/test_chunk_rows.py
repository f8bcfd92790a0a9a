"""Rows per chunk come from the device: cache sized on a CPU, a memory budget on accelerators.

``rl_engine.arith.tiles.chunk_rows_for_device`` is the op's default ``chunk_rows``; the
bytes of every output do not depend on it (checked here at the accelerator's chunk size,
run on the CPU).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rl_engine.arith import tiles
from rl_engine.arith.tiles import (
    ACCELERATOR_CHUNK_BYTES,
    ACCELERATOR_MAX_ROWS,
    WORKSPACE_BYTES_PER_COLUMN,
    chunk_rows_for_device,
    default_chunk_rows,
)
from rl_engine.logprob.backends.eager import vocab_parallel
from rl_engine.logprob.backends.eager.vocab_parallel import VocabParallelLogprob
from rl_engine.logprob.contract import LogprobContract
from rl_engine.tensorio import tensor_bytes

GiB = 1 << 30


def test_cpu_rows_are_cache_sized() -> None:
    assert chunk_rows_for_device(151936, "cpu") == default_chunk_rows(151936) == 3
    assert chunk_rows_for_device(151936 // 8, torch.device("cpu")) == default_chunk_rows(151936 // 8)


def test_accelerator_rows_fill_a_memory_budget() -> None:
    # plenty free: the 1 GiB budget; 25 bytes of workspace per column
    assert chunk_rows_for_device(151936, "cuda", free_bytes=140 * GiB) == 282
    assert 282 * WORKSPACE_BYTES_PER_COLUMN * 151936 <= ACCELERATOR_CHUNK_BYTES
    # little free: a quarter of it
    assert chunk_rows_for_device(151936, "cuda", free_bytes=400 << 20) == (100 << 20) // (25 * 151936)
    # almost nothing free: still one row; a tiny vocabulary: capped
    assert chunk_rows_for_device(151936, "cuda", free_bytes=0) == 1
    assert chunk_rows_for_device(8, "cuda", free_bytes=140 * GiB) == ACCELERATOR_MAX_ROWS
    # a device without a free-memory query gets the fixed budget
    assert chunk_rows_for_device(151936, "meta") == 282


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="local_vocab=0 must be a positive integer"):
        chunk_rows_for_device(0, "cpu")
    with pytest.raises(ValueError, match="free_bytes=-1 must be >= 0"):
        chunk_rows_for_device(10, "cuda", free_bytes=-1)


def test_the_op_takes_its_default_from_the_logits_device(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    def spy(local_vocab: int, device: Any, free_bytes: Any = None) -> int:
        seen.append((local_vocab, torch.device(device).type))
        return 2

    monkeypatch.setattr(vocab_parallel, "chunk_rows_for_device", spy)
    c = LogprobContract(real_vocab_size=60, padded_vocab_size=64, num_vocab_tiles=4, num_sequences=1,
                        seq_len=5, logits_dtype="fp32")
    VocabParallelLogprob()(torch.randn(5, 64), torch.zeros(5, dtype=torch.int64),
                           torch.ones(5, dtype=torch.bool), c)
    assert seen == [(64, "cpu")]


def test_an_accelerator_sized_chunk_gives_the_cpu_chunk_bytes() -> None:
    g = torch.Generator().manual_seed(3)
    rows, vocab = 300, 4096
    x = (torch.randn(rows, vocab, generator=g) * 3).bfloat16()
    targets = torch.randint(0, 4000, (rows,), generator=g)
    active = torch.ones(rows, dtype=torch.bool)
    c = LogprobContract(real_vocab_size=4000, padded_vocab_size=vocab, num_vocab_tiles=16,
                        num_sequences=1, seq_len=rows, logits_dtype="bf16")
    big = chunk_rows_for_device(vocab, "cuda", free_bytes=140 * GiB)
    assert big > rows  # one chunk holds every row
    found = []
    for chunk in (tiles.default_chunk_rows(vocab), big):
        xx = x.clone().requires_grad_(True)
        out = VocabParallelLogprob()(xx, targets, active, c, compute_entropy=True, chunk_rows=chunk)
        (out.selected_logp.sum() + out.lse.sum()).backward()
        found.append([tensor_bytes(t) for t in (out.selected_logp, out.lse, out.entropy, xx.grad)])
    assert found[0] == found[1]
