"""Runs in vLLM's own environment (scripts/vllm-cpu-env.sh), called by tests/test_vllm.py.

``python tests/_vllm_driver.py OUT`` makes the tiny Qwen2 of examples/vllm_rollout.py and writes,
into OUT, what the tests check in rl_engine's environment:

- ``A`` (bf16) and ``A32`` (float32): vLLM with ``logprobs_mode="raw_logits"``: our capture (prompt
  rows included) and the full raw logits vLLM itself returned for the same rows (``logprobs=-1``,
  ``prompt_logprobs=-1``);
- ``B``/``C``: our logprob inside vLLM (``raw``, ``processed`` at T = 0.7): the capture and the
  token ids and logprob values vLLM returned (the sampled token first, then the top 2);
- ``rollout``: the example's ragged rollout (vLLM's default ``raw_logprobs``), and ``rollout-ours``,
  the same requests with our raw logprob returned;
- ``stopped``: a greedy rollout that stops on a token (vLLM's asynchronous scheduling samples once more);
- ``P``: vLLM's own ``processed_logprobs`` on requests that mix temperature, top-k, top-p and min-p in
  one batch: the capture (its ``reported_processed_logp`` is vLLM's) and vLLM's full processed rows
  (``logprobs=-1``: ``-inf`` outside vLLM's kept set), for the measurement of docs/capture.md;
- ``Q``: the same requests with our processed logprob returned (``logprobs="processed"``, top 2);
- ``refused.json``: the messages of what must be refused (our logprob under ``raw_logits``, missing
  prompt rows, a processed-logprob request with a repetition penalty).

``python tests/_vllm_driver.py OUT processed`` runs only ``P`` and ``Q``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def returned(outputs) -> dict:
    """vLLM's returned sampled-token logprobs: ids [rows, 3] and values [rows, 3] (sampled first)."""

    ids, values = [], []
    for out in outputs:
        for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
            order = [token] + sorted(entry, key=lambda k: entry[k].rank)[:2]  # the sampled token may be one of them
            ids.append(order)
            values.append([entry[k].logprob for k in order])
    return {"ids": torch.tensor(ids, dtype=torch.int64), "values": torch.tensor(values, dtype=torch.float32)}


def raw_rows(outputs) -> torch.Tensor:
    """The full raw logits rows vLLM returned (prompt rows, then sampled rows, per request)."""

    rows = []
    for out in outputs:
        for entry in (out.prompt_logprobs or [])[1:]:
            rows.append(_dense(entry))
        for entry in out.outputs[0].logprobs:
            rows.append(_dense(entry))
    return torch.stack(rows)


def _dense(entry) -> torch.Tensor:

    row = torch.full((len(entry),), float("nan"), dtype=torch.float32)
    for k, v in entry.items():
        row[k] = v.logprob
    return row


def _refusal(call) -> str:
    """The message of the exception ``call()`` raises ("not refused" when it returns)."""
    try:
        call()
    except Exception as exc:  # a worker's refusal travels through vLLM's engine
        return f"{type(exc).__name__}: {exc}"
    return "not refused"


# (temperature, top_k, top_p, min_p) of the processed requests, each on every prompt, all in one batch
PROCESSED_PARAMS = ((0.7, 5, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (0.7, 0, 1.0, 0.05), (0.8, 50, 0.8, 0.02), (1.0, 2, 1.0, 0.0))


def processed(out: Path, model: Path, prompts: list) -> None:
    """``P`` and ``Q`` (module docstring)."""
    import vllm_rollout as ex
    from safetensors.torch import save_file
    from vllm import SamplingParams

    from rl_engine.capture import write_capture
    from rl_engine.integrations import vllm as rv

    def params(logprobs: int) -> list:
        return [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, max_tokens=8, seed=11 + i, ignore_eos=True,
                               logprobs=logprobs) for i, (t, k, p, m) in enumerate(PROCESSED_PARAMS) for _ in prompts]

    batch = [prompt for _ in PROCESSED_PARAMS for prompt in prompts]
    llm = ex.engine(str(model), logprobs_mode="processed_logprobs", max_logprobs=-1)
    rv.install(llm, capture=True)
    outs = llm.generate(batch, params(-1))
    write_capture(out / "P.safetensors", rv.collect(llm, outs, model_name="tiny-qwen2"))
    save_file({"rows": raw_rows(outs)}, str(out / "P-vllm.safetensors"))
    rv.uninstall(llm)
    del llm
    llm = ex.engine(str(model))
    rv.install(llm, capture=True, logprobs="processed")
    outs = llm.generate(batch, params(2))
    write_capture(out / "Q.safetensors", rv.collect(llm, outs, model_name="tiny-qwen2"))
    save_file(returned(outs), str(out / "Q-vllm.safetensors"))


def main(out: Path, only: str = "") -> None:
    import vllm_rollout as ex
    from safetensors.torch import save_file
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rl_engine.capture import write_capture
    from rl_engine.integrations import vllm as rv

    model = out / "model"
    ex.make_model(model)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ex.prompts(4096)]
    processed(out, model, prompts)
    if only == "processed":
        return
    refused = {}
    # vLLM's own raw logits (logprobs_mode="raw_logits"), bf16 and float32 models: float32 rows are the
    # ones vLLM's sampler divides by the temperature in place
    for name, dtype in (("A", "bfloat16"), ("A32", "float32")):
        llm = ex.engine(str(model), logprobs_mode="raw_logits", max_logprobs=-1, dtype=dtype)
        rv.install(llm, capture=True, prompt_rows=True)
        outs = llm.generate(prompts, SamplingParams(temperature=0.7, max_tokens=4, logprobs=-1, prompt_logprobs=-1,
                                                    seed=3, ignore_eos=True))
        write_capture(out / f"{name}.safetensors", rv.collect(llm, outs, model_name="tiny-qwen2"))
        save_file({"rows": raw_rows(outs)}, str(out / f"{name}-vllm.safetensors"))
        if dtype == "bfloat16":
            refused["raw_logits_mode"] = _refusal(lambda llm=llm: rv.install(llm, logprobs="raw"))
        rv.uninstall(llm)
        del llm

    llm = ex.engine(str(model))
    for name, mode in (("B", "raw"), ("C", "processed")):
        rv.install(llm, capture=True, logprobs=mode)
        outs = llm.generate(prompts, SamplingParams(temperature=0.7, max_tokens=6, logprobs=2, seed=5,
                                                    ignore_eos=True))
        write_capture(out / f"{name}.safetensors", rv.collect(llm, outs, model_name="tiny-qwen2"))
        save_file(returned(outs), str(out / f"{name}-vllm.safetensors"))
    params = SamplingParams(temperature=ex.TEMPERATURE, max_tokens=ex.MAX_TOKENS, logprobs=0, prompt_logprobs=0,
                            seed=1, ignore_eos=True)
    for name, mode in (("rollout", None), ("rollout-ours", "raw")):
        rv.install(llm, capture=True, prompt_rows=True, logprobs=mode)
        outs = llm.generate(prompts, params)
        write_capture(out / f"{name}.safetensors", rv.collect(llm, outs, model_name="tiny-qwen2"))
    # a rollout that stops on a token (as one stops on EOS): greedy, so the stop token is known in advance
    rv.install(llm, capture=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    first = llm.generate(prompts[:1], greedy)[0].outputs[0].token_ids
    rv.collect(llm, llm.generate(prompts[:1], greedy))
    stopped = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, logprobs=0,
                                                       stop_token_ids=[first[2]]))
    write_capture(out / "stopped.safetensors", rv.collect(llm, stopped, model_name="tiny-qwen2"))
    (out / "stopped.json").write_text(json.dumps({"greedy": list(first), "stopped": list(stopped[0].outputs[0].token_ids),
                                                  "finish_reason": stopped[0].outputs[0].finish_reason}))
    rv.install(llm, capture=True, prompt_rows=True)
    refused["prompt_rows"] = _refusal(lambda: rv.collect(llm, llm.generate(prompts[:1], SamplingParams(max_tokens=2))))
    rv.install(llm, capture=True)
    # vLLM computes logprobs for a whole batch when one request asks: the gap is between batches
    asked = llm.generate(prompts[:1], SamplingParams(max_tokens=2, logprobs=0, seed=1))
    unasked = llm.generate(prompts[1:2], SamplingParams(max_tokens=2, seed=2))
    refused["mixed_logprobs"] = _refusal(lambda: rv.collect(llm, asked + unasked))
    rv.install(llm, capture=True, logprobs="processed")
    refused["repetition_penalty"] = _refusal(lambda: llm.generate(prompts[:1], SamplingParams(
        temperature=0.7, top_k=5, repetition_penalty=1.2, max_tokens=2, logprobs=0)))
    (out / "refused.json").write_text(json.dumps(refused))
    (out / "done.json").write_text(json.dumps({"vllm": __import__("vllm").__version__}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:3])
