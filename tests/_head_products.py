"""Counts the fused head's products: each call of ``hidden_chunks.head_logits`` (one chunk's logits,
forward or backward) appends its row count. Used where a test shows that ``keep_logits=True`` makes
no product in the backward and the recomputing head one per chunk."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def count_products(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Wrap ``head_logits`` for the test; the returned list grows with each product's rows."""
    import rl_engine.logprob.hidden_chunks as hidden_chunks

    calls: list[int] = []
    real = hidden_chunks.head_logits

    def counted(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return real(hidden, *args)

    monkeypatch.setattr(hidden_chunks, "head_logits", counted)
    return calls
