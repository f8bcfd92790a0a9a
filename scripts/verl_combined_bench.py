"""Times verl's two calls against the one (rl_engine.integrations.verl), forward and forward+backward.

    python scripts/verl_combined_bench.py [--tokens 2048] [--vocab 151936] [--dtype bf16] [--threads 2]

``two``: ``logprobs_from_logits`` then ``entropy_from_logits`` on the same logits, as verl's actor
calls them; ``one``: ``logprobs_and_entropy_from_logits``. The loss is GRPO-shaped (advantage-weighted
log-probs plus an entropy bonus), the backward one ``loss.backward()``. Each case runs once after a
small warm-up (the fused kernel's load); the output is one JSON object with the seconds and the
ratios. A timing, never a test's threshold: docs/performance.md records a run.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from rl_engine.integrations.verl import entropy_from_logits, logprobs_and_entropy_from_logits, logprobs_from_logits

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _case(name: str, logits: torch.Tensor, labels: torch.Tensor, adv: torch.Tensor, backward: bool) -> float:
    leaf = logits.detach().requires_grad_(backward)
    start = time.perf_counter()
    if name == "two":
        logp = logprobs_from_logits(leaf, labels, temperature=0.7)
        entropy = entropy_from_logits(leaf, temperature=0.7)
    else:
        logp, entropy = logprobs_and_entropy_from_logits(leaf, labels, temperature=0.7)
    if backward:
        (-(adv * logp).sum() - 0.001 * entropy.sum()).backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.tokens, args.vocab, generator=g).to(DTYPES[args.dtype])
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    adv = torch.randn(args.tokens, generator=g)
    for name in ("two", "one"):  # warm-up: the kernel's load, the allocator
        _case(name, logits[:16], labels[:16], adv[:16], True)
    seconds = {f"{phase}_{name}": _case(name, logits, labels, adv, phase == "forward_backward")
               for phase in ("forward", "forward_backward") for name in ("two", "one")}
    ratios = {phase: seconds[f"{phase}_two"] / seconds[f"{phase}_one"] for phase in ("forward", "forward_backward")}
    print(json.dumps({"tokens": args.tokens, "vocab": args.vocab, "dtype": args.dtype, "threads": args.threads,
                      "torch": torch.__version__, "seconds": seconds, "ratio_two_over_one": ratios}, indent=1))


if __name__ == "__main__":
    main()
