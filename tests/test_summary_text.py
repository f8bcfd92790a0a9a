"""SUMMARY.md's capture line names the engine once, whatever its capture recorded as the version."""

from __future__ import annotations

import pytest

from rl_engine.evidence.summary import engine_text


@pytest.mark.parametrize(("meta", "shown"), [
    ({"engine": "transformers", "engine_version": "transformers 5.25.0, torch 2.9.1"}, "transformers 5.25.0, torch 2.9.1"),
    ({"engine": "vllm", "engine_version": "0.6.3"}, "vllm 0.6.3"),
    ({"engine": "vllm", "engine_version": "vllm-fork 1"}, "vllm vllm-fork 1"),  # a prefix of a word is not the name
])
def test_the_engine_is_named_once(meta: dict, shown: str) -> None:
    assert engine_text(meta) == shown
