"""CPU and wall seconds of the naive head, the fused head and the fused head keeping its logits.

    python scripts/head_cpu_time.py [--tokens 2048] [--hidden-size 896] [--vocab 151936] [--rounds 1]

``naive``: ``log_softmax((hidden @ weight.T).float()).gather`` with autograd; ``recompute``:
``selected_logprob_from_hidden`` (its backward makes each chunk's logits again); ``kept``: the same
with ``keep_logits=True``. fp32, every token active, forward then ``selected_logp.sum().backward()``,
the three interleaved in each round. Why CPU seconds: on a machine shared with other work a
process's wall time moves with the load (a round by up to 5x here), while ``time.process_time()``
(the CPU seconds of all the process's threads) counts the work done; it also counts the library's
threads spinning while they wait, so it is an indicator, not a cost model. The output is one JSON
object; a timing, never a test's threshold: docs/performance.md records a run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from rl_engine.logprob import selected_logprob_from_hidden

PATHS = ("naive", "recompute", "kept")


def _round(path: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    if path == "naive":
        logp = torch.log_softmax((h @ w.T).float(), -1).gather(1, targets.unsqueeze(1)).squeeze(1)
    else:
        logp = selected_logprob_from_hidden(h, w, targets, num_vocab_tiles=64, keep_logits=path == "kept").selected_logp
    wall1, cpu1 = time.perf_counter(), time.process_time()
    logp.sum().backward()
    wall2, cpu2 = time.perf_counter(), time.process_time()
    return {"wall_forward_s": wall1 - wall0, "wall_backward_s": wall2 - wall1, "cpu_forward_s": cpu1 - cpu0,
            "cpu_backward_s": cpu2 - cpu1, "cpu_total_s": cpu2 - cpu0, "wall_total_s": wall2 - wall0,
            "loadavg_1min": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden_size, generator=gen)
    weight = torch.randn(args.vocab, args.hidden_size, generator=gen) * 0.05
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    rounds: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        rounds.append({path: _round(path, hidden, weight, targets) for path in PATHS})
    ratios = {f"{path}_over_naive": [r[path]["cpu_total_s"] / r["naive"]["cpu_total_s"] for r in rounds]
              for path in PATHS[1:]}
    print(json.dumps({"config": vars(args), "rounds": rounds, "cpu_ratios": ratios},
                     indent=1, allow_nan=False))


if __name__ == "__main__":
    main()
