"""What the fused head's fixed-order logits cost against the library's product (docs/performance.md).

    PYTHONPATH=. python scripts/head_matmul_bench.py [--tokens 512] [--hidden-size 896] [--vocab 151936] \
        [--dtypes fp32 bf16] [--repeats 2] [--threads 2] [--output head_matmul.json]

One process, interleaved repeats, medians and ratios from the same run: the product of one chunk
(``chunk_tokens`` rows of ``hidden`` by the whole weight) by :func:`fixed_logits` and by
``hidden @ weight.T``; then ``selected_logprob_from_hidden`` forward and forward+backward with
``matmul="fixed"`` and ``matmul="library"`` (every token active, 256 tokens per chunk). First,
``differing_fraction``: how many logits change their bytes when the same product is made in
chunks of rows or in TP shards of the weight (bytes compared as integers, so NaN and -0 count).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _measure(args: argparse.Namespace, dtype: Any) -> dict[str, dict[str, float]]:
    import torch

    from rl_engine.logprob import selected_logprob_from_hidden
    from rl_engine.logprob.head_matmul import fixed_logits

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(args.vocab, args.hidden_size, generator=gen) * 0.02).to(dtype)
    ids = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    chunk = hidden[:args.chunk_tokens]

    def head(matmul: str, backward: bool) -> Callable[[], Any]:
        def run() -> Any:
            h = hidden.detach().requires_grad_(backward)
            w = weight.detach().requires_grad_(backward)
            with torch.set_grad_enabled(backward):
                out = selected_logprob_from_hidden(h, w, ids, chunk_tokens=args.chunk_tokens, matmul=matmul)
                if backward:
                    out.selected_logp.sum().backward()
        return run

    steps = {
        ("product", "fixed"): lambda: fixed_logits(chunk, weight),
        ("product", "library"): lambda: chunk @ weight.T,
        ("forward", "fixed"): head("fixed", False),
        ("forward", "library"): head("library", False),
        ("forward_backward", "fixed"): head("fixed", True),
        ("forward_backward", "library"): head("library", True),
    }
    times: dict[tuple[str, str], list[float]] = {key: [] for key in steps}
    for fn in steps.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for key, fn in steps.items():
            times[key].append(_time(fn))
    rows = {}
    for phase in ("product", "forward", "forward_backward"):
        fixed = statistics.median(times[(phase, "fixed")])
        library = statistics.median(times[(phase, "library")])
        rows[phase] = {"fixed_s": fixed, "library_s": library, "fixed_vs_library": fixed / library}
    return rows


def _invariance(args: argparse.Namespace, dtype: Any) -> dict[str, dict[str, float]]:
    """Per product, the fraction of the logits of 256 rows by 4096 weight rows whose bytes change
    when the rows are multiplied in chunks of 1, 7 or 64, or the weight in TP shards of 2, 4, 8."""
    import torch

    from rl_engine.logprob.head_matmul import fixed_logits

    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(256, args.hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(4096, args.hidden_size, generator=gen) * 0.02).to(dtype)
    products = {"fixed": fixed_logits, "library": lambda h, w: h @ w.T}
    found = {}
    for name, product in products.items():
        whole = product(hidden, weight)
        row = {}
        bits = torch.int16 if dtype != torch.float32 else torch.int32
        for chunk in (1, 7, 64):
            parts = torch.cat([product(hidden[i:i + chunk], weight) for i in range(0, 256, chunk)])
            row[f"rows_in_chunks_of_{chunk}"] = float((parts.view(bits) != whole.view(bits)).float().mean())
        for tp in (2, 4, 8):
            width = 4096 // tp
            shards = torch.cat([product(hidden, weight[r * width:(r + 1) * width]) for r in range(tp)], dim=1)
            row[f"tp_{tp}_shards"] = float((shards.view(bits) != whole.view(bits)).float().mean())
        found[name] = row
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", help="also write the report (JSON) to this file")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    report: dict[str, Any] = {"config": vars(args), "torch": torch.__version__,
                              "differing_fraction": {name: _invariance(args, dtypes[name]) for name in args.dtypes},
                              "rows": {name: _measure(args, dtypes[name]) for name in args.dtypes}}
    text = json.dumps(report, indent=2, allow_nan=False)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
