"""rl_engine.integrations.vllm without vLLM: what it refuses, and how it names vLLM's version.

The real engine runs in tests/test_vllm.py; these checks need no vLLM (fake workers stand in for
the parts the module wraps), so they run in the quick loop.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rl_engine.integrations import vllm as rv


def test_supported_versions_and_a_refusal_that_names_the_version() -> None:
    for ok in ("0.32.0", "0.32.1", "0.32.0+cpu"):
        rv.check_version(ok)
    for bad in ("0.31.9", "0.33.0", "0.320.1", "1.0.0"):
        with pytest.raises(rv.VLLMIntegrationError, match=rf"vLLM {bad.replace('.', '[.]')} is not a supported"):
            rv.check_version(bad)


@pytest.mark.parametrize("kwargs, field", [
    (dict(logprobs="processed_logprobs"), "logprobs='processed_logprobs'"),
    (dict(capture="yes"), "capture='yes'"),
    (dict(prompt_rows=1), "prompt_rows=1"),
    (dict(capture=False), "capture=False with logprobs=None"),
])
def test_options_refuse_by_name(kwargs: dict, field: str) -> None:
    with pytest.raises(rv.VLLMIntegrationError, match=field.replace("(", r"\(")):
        rv.Options(**kwargs)


def _worker(**missing: bool) -> SimpleNamespace:
    sampler = SimpleNamespace(forward=lambda *a: None, gather_logprobs=lambda *a: None, compute_logprobs=lambda x: x)
    model = SimpleNamespace(compute_logits=lambda h: h)
    parts = dict(sampler=sampler, input_batch=SimpleNamespace(), requests={}, discard_request_mask=None,
                 query_start_loc=None, _get_prompt_logprobs_dict=lambda *a: {}, model=model, speculative_config=None)
    for name in missing:
        parts.pop(name)
    return SimpleNamespace(model_runner=SimpleNamespace(**parts))


@pytest.mark.parametrize("name", ["sampler", "input_batch", "discard_request_mask", "_get_prompt_logprobs_dict"])
def test_a_missing_private_piece_is_named_with_the_version(name: str) -> None:
    with pytest.raises(rv.VLLMIntegrationError, match=rf"vLLM 9\.9\.9: the model runner has no attribute '{name}'"):
        rv._worker_install(_worker(**{name: True}), {}, "9.9.9")


def test_install_wraps_instances_and_uninstall_restores_them() -> None:
    worker = _worker()
    runner = worker.model_runner
    before = (runner.sampler.forward, runner._get_prompt_logprobs_dict, runner.model.compute_logits)
    rv._worker_install(worker, {"capture": True, "prompt_rows": True}, "0.32.0")
    assert runner.sampler.forward is not before[0] and runner._get_prompt_logprobs_dict is not before[1]
    assert rv._worker_uninstall(worker)
    assert (runner.sampler.forward, runner._get_prompt_logprobs_dict, runner.model.compute_logits) == before
    assert not rv._worker_uninstall(worker)  # nothing left to remove


def test_speculative_decoding_is_refused() -> None:
    worker = _worker()
    worker.model_runner.speculative_config = object()
    with pytest.raises(rv.VLLMIntegrationError, match="speculative decoding"):
        rv._worker_install(worker, {}, "0.32.0")


def test_records_match_vllms_suffixed_request_ids_and_refuse_ambiguity() -> None:
    recorded = {"0-1a2b3c4d": "a", "1-00ff00ff": "b", "10-deadbeef": "c"}
    assert rv._record_of(recorded, "0") == "a" and rv._record_of(recorded, "10") == "c"
    assert rv._record_of(recorded, "2") is None
    with pytest.raises(rv.VLLMIntegrationError, match="matches several"):
        rv._record_of({"0-aaaaaaaa": 1, "0-bbbbbbbb": 2}, "0")
