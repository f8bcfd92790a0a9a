"""``python -m rl_engine bench``: every backend against what users would write instead.

TP=1 mode (default): :mod:`rl_engine.benchmark.single`; TP mode (``--tp 2 4``, under
torchrun): :mod:`rl_engine.benchmark.tp`. The hidden ``--probe`` (one memory measurement) and
``--tp-worker`` (one rank) flags are how those modes call this command in subprocesses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from rl_engine.benchmark.config import PATHS, PHASES, BenchConfig, BenchError
from rl_engine.benchmark.memory import probe_memory
from rl_engine.benchmark.paths import default_paths
from rl_engine.benchmark.report import render_table, write_document
from rl_engine.benchmark.single import run_tp1
from rl_engine.benchmark.tp import run_tp, tp_worker
from rl_engine.logprob.contract import LOGITS_DTYPES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rl_engine bench",
        description="Benchmark every backend available here (candidate: the eager one; fused: the "
        "compiled CPU one) against naive log_softmax and a one-pass floor; with --tp, the same paths "
        "on vocabulary shards under torchrun (naive: a vocab-parallel log_softmax).",
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tiles", type=int, default=64)
    p.add_argument("--dtype", default="bf16", choices=sorted(LOGITS_DTYPES))
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per path first")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--chunk-rows", type=int, default=None, help="rows per chunk of candidate and floor (fused streams rows)")
    p.add_argument("--no-validate", action="store_true", help="backends with validate=False")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paths", nargs="+", default=None, choices=PATHS,
                   help="default: every path this machine runs on --device (cpu: fused where its kernel loads; "
                   "cuda: triton where it compiles); triton on the cpu needs RL_ENGINE_TRITON_MODE=interpreter")
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the inputs live and the backends run (cuda: --no-memory, no fused, no --tp)")
    p.add_argument("--tp", type=int, nargs="+", default=[], help="TP degrees: run the torchrun mode")
    p.add_argument("--hidden-size", type=int, default=None,
                   help="the hidden size of the head paths (lm_head, fused_lm_head: asked for by name in --paths)")
    p.add_argument("--output", default=None, help="write the JSON document here")
    p.add_argument("--probe", nargs=3, metavar=("PATH", "PHASE", "TOKENS"), help=argparse.SUPPRESS)
    p.add_argument("--tp-worker", metavar="OUTPUT", help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        tokens=tuple(args.tokens), vocab=args.vocab, tiles=args.tiles, dtype=args.dtype,
        repeats=args.repeats, warmup=args.warmup,
        threads=args.threads if args.threads is not None else torch.get_num_threads(),
        chunk_rows=args.chunk_rows, validate=not args.no_validate, memory=not args.no_memory,
        seed=args.seed, paths=tuple(args.paths) if args.paths else default_paths(args.device), phases=tuple(args.phases),
        tp=tuple(args.tp), device=args.device, hidden_size=args.hidden_size,
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        if args.probe:
            path, phase, tokens = args.probe
            print(json.dumps(probe_memory(path, phase, int(tokens), config)))
            return 0
        if args.tp_worker:
            output = args.tp_worker.format(rank=os.environ.get("RANK", "0"))
            return tp_worker(config, output)
        doc = run_tp(config) if config.tp else run_tp1(config)
        write_document(doc, args.output)
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    from rich.console import Console

    console = Console() if sys.stdout.isatty() else Console(width=132)
    console.print(render_table(doc))
    if doc["targets"]:
        for t in doc["targets"]:
            verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
            value = "-" if t["value"] is None else f"{t['value']:.3f}"
            print(f"tokens={t['tokens']}: {t['target']}: {value} ({verdict})")
    if args.output:
        print(f"wrote {args.output}")
    return 0
