"""Counts the fused head's products: each call of ``hidden_chunks.head_logits`` (one chunk's logits,
forward or backward) appends its row count. Used where a test shows that ``keep_logits=True`` makes
no product in the backward and the recomputing head one per chunk, in the test's process
(:func:`count_products`) or in a gloo rank (:func:`products_counted`)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch


def _counted(calls: list[int], real: Any) -> Any:
    def counted(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return real(hidden, *args)

    return counted


def count_products(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Wrap ``head_logits`` for the test; the returned list grows with each product's rows."""
    import rl_engine.logprob.hidden_chunks as hidden_chunks

    calls: list[int] = []
    monkeypatch.setattr(hidden_chunks, "head_logits", _counted(calls, hidden_chunks.head_logits))
    return calls


@contextlib.contextmanager
def products_counted() -> Iterator[list[int]]:
    """The products made inside the block (a rank's worker has no ``monkeypatch``); restored after it."""
    import rl_engine.logprob.hidden_chunks as hidden_chunks

    calls: list[int] = []
    real = hidden_chunks.head_logits
    hidden_chunks.head_logits = _counted(calls, real)
    try:
        yield calls
    finally:
        hidden_chunks.head_logits = real
