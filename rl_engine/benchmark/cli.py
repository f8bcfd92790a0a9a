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

from rl_engine.benchmark.config import BenchConfig, BenchError
from rl_engine.benchmark.memory import probe_memory
from rl_engine.benchmark.paths import default_paths
from rl_engine.benchmark.report import render_table, write_document
from rl_engine.benchmark.single import run_tp1
from rl_engine.benchmark.tp import run_tp, tp_worker
from rl_engine.verb_parsers import bench_parser as build_parser


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
