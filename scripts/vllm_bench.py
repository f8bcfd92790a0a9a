"""What rl_engine costs inside vLLM (run with vLLM's python; docs/performance.md, "Inside vLLM").

    PYTHONPATH=. .ci/vllm-env/bin/python scripts/vllm_bench.py [--vocab 151936] [--requests 8] [--tokens 8]

One engine on a tiny Qwen2 with Qwen's vocabulary, interleaved repeats of the same generate call:
plain vLLM (its own raw logprob), our logprob returned (``logprobs="raw"``), our capture
(rows kept, vLLM's logprob returned), and, in a second engine, ``logprobs_mode="raw_logits"`` with
``logprobs=-1`` (every row as Python objects, vLLM's own way to get the rows). Then the logprob step
alone on the captured rows: vLLM's (``Sampler.compute_logprobs`` + ``gather_logprobs``) against
``selected_logprob`` (auto backend, auto tiles), as medians and ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout; the report is the only output


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", help="also write the report (JSON) to this file")
    args = parser.parse_args()
    import torch
    import vllm_rollout as ex
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.sample.sampler import Sampler

    from rl_engine.integrations import vllm as rv
    from rl_engine.logprob import selected_logprob

    work = Path(tempfile.mkdtemp())
    ex.make_model(work / "model", args.vocab)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ex.prompts(args.vocab, tuple(5 + i % 7 for i in range(args.requests)))]
    params = SamplingParams(temperature=0.7, max_tokens=args.tokens, logprobs=0, seed=1, ignore_eos=True)
    rows = args.requests * args.tokens
    llm = ex.engine(str(work / "model"))
    llm.generate(prompts, params)  # warm-up
    modes = {"vllm": None, "ours": dict(capture=False, logprobs="raw"), "capture": dict(capture=True)}
    times: dict[str, list[float]] = {k: [] for k in modes}
    captured = None
    for _ in range(args.repeats):
        for name, opts in modes.items():
            if opts is None:
                rv.uninstall(llm)
            else:
                rv.install(llm, **opts)
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            times[name].append(time.perf_counter() - t)
            if name == "capture":
                captured = rv.collect(llm, outs)
    rv.uninstall(llm)
    del llm
    logits, targets = captured.logits, captured.targets
    step: dict[str, list[float]] = {"vllm_step": [], "ours_step": []}
    for _ in range(5):
        t = time.perf_counter()
        lp = Sampler.compute_logprobs(logits)
        Sampler.gather_logprobs(lp, 0, targets)
        step["vllm_step"].append(time.perf_counter() - t)
        t = time.perf_counter()
        selected_logprob(logits, targets, torch.ones(rows, dtype=torch.bool), real_vocab_size=args.vocab)
        step["ours_step"].append(time.perf_counter() - t)
    raw = ex.engine(str(work / "model"), logprobs_mode="raw_logits", max_logprobs=-1)
    raw_params = SamplingParams(temperature=0.7, max_tokens=args.tokens, logprobs=-1, seed=1, ignore_eos=True)
    raw.generate(prompts[:1], SamplingParams(max_tokens=1))
    t = time.perf_counter()
    raw.generate(prompts, raw_params)
    raw_s = time.perf_counter() - t
    med = {k: statistics.median(v) for k, v in {**times, **step}.items()}
    report = {
        "vocab": args.vocab, "requests": args.requests, "tokens_per_request": args.tokens, "sampled_rows": rows,
        "threads": torch.get_num_threads(), "median_s": med, "raw_logits_generate_s": raw_s,
        "per_token_ms": {k: 1e3 * med[k] / rows for k in ("vllm", "ours", "capture")},
        "ratios": {
            "generate_ours_over_vllm": med["ours"] / med["vllm"],
            "generate_capture_over_vllm": med["capture"] / med["vllm"],
            "logprob_step_ours_over_vllm": med["ours_step"] / med["vllm_step"],
            "raw_logits_mode_over_capture": raw_s / med["capture"],
        },
        "per_row_ms": {"capture_extra": 1e3 * (med["capture"] - med["vllm"]) / rows,
                       "raw_logits_mode_extra": 1e3 * (raw_s - med["vllm"]) / rows},
    }
    text = json.dumps(report, indent=1, allow_nan=False)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
