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


@pytest.mark.parametrize("ours, mode", [("raw", "raw_logits"), ("raw", "processed_logprobs"),
                                        ("processed", "raw_logits"), ("processed", "processed_logits")])
def test_our_logprob_is_refused_where_vllm_returns_values_of_another_kind(ours: str, mode: str) -> None:
    with pytest.raises(rv.VLLMIntegrationError, match=f"logprobs_mode='{mode}'"):
        rv.Options(logprobs=ours, vllm_logprobs_mode=mode)


@pytest.mark.parametrize("tiles", [0, -8, True, 2.5, "eight"])
def test_a_bad_tile_count_is_refused_on_the_driver(tiles: object) -> None:
    with pytest.raises(rv.VLLMIntegrationError, match="num_vocab_tiles="):
        rv.Options(num_vocab_tiles=tiles)


def _recorder(logprobs: str | None, capture: bool = True, **params: object) -> rv._Recorder:
    defaults = dict(top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                    logit_bias=None, allowed_token_ids=None, bad_words=[], min_tokens=0, structured_outputs=None)
    request = SimpleNamespace(sampling_params=SimpleNamespace(**{**defaults, **params}))
    runner = SimpleNamespace(requests={"0-aaaaaaaa": request})
    return rv._Recorder(runner, rv.Options(capture=capture, logprobs=logprobs))


@pytest.mark.parametrize("param, value", [("presence_penalty", 0.5), ("frequency_penalty", 0.1),
                                          ("repetition_penalty", 1.1), ("logit_bias", {3: 1.0}),
                                          ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]), ("min_tokens", 2)])
def test_processed_logprobs_refuse_every_parameter_beyond_temperature_and_truncation(param: str, value: object) -> None:
    with pytest.raises(rv.VLLMIntegrationError, match=f"sets {param}="):
        _recorder("processed", **{param: value})._check_processing(["0-aaaaaaaa"])
    _recorder("raw", **{param: value})._check_processing(["0-aaaaaaaa"])  # raw logprobs ignore them: accepted
    _recorder("processed")._check_processing(["0-aaaaaaaa"])  # the control: the neutral values pass
    assert _recorder(None, **{param: value})._unmodelled("0-aaaaaaaa").startswith(f"{param}=")  # a capture names it


@pytest.mark.parametrize("param, value", [("top_k", 5), ("top_k", -1), ("top_p", 0.9), ("min_p", 0.05)])
def test_processed_logprobs_accept_the_samplers_truncation(param: str, value: object) -> None:
    recorder = _recorder("processed", **{param: value})
    recorder._check_processing(["0-aaaaaaaa"])
    assert recorder._unmodelled("0-aaaaaaaa") == ""


def _requests(*params: dict) -> dict:
    defaults = dict(top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                    logit_bias=None, allowed_token_ids=None, bad_words=[], min_tokens=0, structured_outputs=None)
    return {f"{i}-aaaaaaaa": SimpleNamespace(sampling_params=SimpleNamespace(**{**defaults, **p}))
            for i, p in enumerate(params)}


def test_each_requests_truncation_becomes_per_row_parameters_of_our_processed_logprob() -> None:
    """Three requests in one step, each with its own temperature and truncation (vLLM's top_k=-1 is off):
    the values written over vLLM's are, byte for byte, selected_logprob of each row alone with that row's
    parameters (the op is batch invariant); raw logprobs ignore the parameters (the control)."""
    import torch

    from rl_engine.logprob import selected_logprob
    from rl_engine.tensorio import tensor_bytes

    requests = _requests(dict(top_k=5), dict(top_k=-1, top_p=0.8), dict(min_p=0.1))
    reqs = list(requests)
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(3, 256, generator=gen) * 3).to(torch.bfloat16)  # bf16: ties among the large values
    temps = torch.tensor([0.7, 1.0, 0.7])
    ids = torch.stack([logits[r].float().argsort(descending=True)[[9, 0, 1]] for r in range(3)])  # 9th: outside top-5
    got = {}
    for mode in ("processed", "raw"):
        recorder = rv._Recorder(SimpleNamespace(requests=requests), rv.Options(capture=False, logprobs=mode))
        params = recorder._sampler_params(reqs)
        assert params[0].tolist() == [5, 0, 0] and params[1].tolist() == [1.0, pytest.approx(0.8), 1.0]
        assert params[2].tolist() == [0.0, 0.0, pytest.approx(0.1)]
        tensors = SimpleNamespace(logprobs=torch.zeros(3, 3), logprob_token_ids=ids.to(torch.int32))
        recorder._replace(logits, ids[:, 0], temps, tensors, params)
        got[mode] = tensors.logprobs
    for r, (t, kwargs) in enumerate([(0.7, dict(top_k=5)), (1.0, dict(top_p=0.8)), (0.7, dict(min_p=0.1))]):
        alone = selected_logprob(logits[r:r + 1].expand(3, -1).contiguous(), ids[r], temperature=t, **kwargs)
        assert tensor_bytes(got["processed"][r]) == tensor_bytes(alone.selected_logp), r
        raw = selected_logprob(logits[r:r + 1].expand(3, -1).contiguous(), ids[r])
        assert tensor_bytes(got["raw"][r]) == tensor_bytes(raw.selected_logp), r
    assert got["processed"][0, 0] == float("-inf")  # the 10th largest is outside top_k=5
    assert tensor_bytes(got["processed"]) != tensor_bytes(got["raw"])


@pytest.mark.parametrize("ours, mode, kind", [(None, "raw_logprobs", "raw"), (None, "processed_logprobs", "processed"),
                                              (None, "raw_logits", None), (None, "processed_logits", None),
                                              ("raw", "raw_logprobs", "raw"), ("processed", "raw_logprobs", "processed"),
                                              ("processed", "processed_logprobs", "processed")])
def test_the_returned_values_go_to_the_captures_tensor_of_their_kind(ours: str | None, mode: str, kind: str | None) -> None:
    """raw: reported_logp (temperature 1); processed: reported_processed_logp; logits: neither."""
    recorder = rv._Recorder(SimpleNamespace(requests={}), rv.Options(logprobs=ours, vllm_logprobs_mode=mode))
    assert recorder._reported_kind() == kind


def test_a_capture_refuses_structured_outputs_whose_masks_are_applied_to_the_rows() -> None:
    with pytest.raises(rv.VLLMIntegrationError, match="structured outputs"):
        _recorder(None, structured_outputs=object())._check_processing(["0-aaaaaaaa"])
    _recorder("raw", capture=False, structured_outputs=object())._check_processing(["0-aaaaaaaa"])
