"""``python -m rl_engine bench``: the deterministic logprob against what users would write instead.

TP=1 mode (default): the paths of :mod:`rl_engine.benchmark.paths` (``candidate``: the eager
backend; ``fused``: the compiled CPU backend, where its kernel loads; ``naive``, ``floor``),
each for ``forward`` and ``forward_backward``, at every ``--tokens``.

Time: every (path, phase) is warmed up, then the repeats run round-robin (one of each per
round, the order rotating), so a busy spell on a shared machine hits every path alike;
the median is reported with all samples. Memory: peak RSS above the inputs, one fresh
subprocess per (path, phase, tokens) (:mod:`rl_engine.benchmark.memory`), run before the
timing so the two never share the machine's memory. The ratios candidate/naive and
candidate/floor come from the rows of this run, and issue 6's targets are checked
against them.

TP mode (``--tp 2 4``): :mod:`rl_engine.benchmark.tp`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

from rl_engine.benchmark.config import BACKEND_PATHS, PATHS, PHASES, BenchConfig, BenchError
from rl_engine.benchmark.memory import MEMORY_METHOD, check_memory_headroom, probe_memory, run_memory_probe
from rl_engine.benchmark.paths import Inputs, build_step, default_paths, make_inputs
from rl_engine.benchmark.report import (
    compute_path_ratios,
    compute_ratios,
    config_dict,
    evaluate_targets,
    loadavg,
    machine,
    render_table,
    write_document,
)
from rl_engine.benchmark.tp import run_tp, tp_worker
from rl_engine.logprob.contract import LOGITS_DTYPES
from rl_engine.logprob.vocab_parallel import BACKEND_ID


def time_paths(inputs: Inputs, config: BenchConfig) -> dict[tuple[str, str], list[float]]:
    """Warm up every (path, phase), then ``repeats`` round-robin rounds; seconds per call."""
    combos = [(p, ph) for p in config.paths for ph in config.phases]
    steps = {combo: build_step(*combo, inputs, config) for combo in combos}
    for step, reset in steps.values():
        for _ in range(config.warmup):
            kept = step()
            del kept
            reset()
    samples: dict[tuple[str, str], list[float]] = {combo: [] for combo in combos}
    for round_index in range(config.repeats):
        shift = round_index % len(combos)
        for combo in combos[shift:] + combos[:shift]:
            step, reset = steps[combo]
            gc.collect()
            start = time.perf_counter()
            kept = step()
            elapsed = time.perf_counter() - start
            del kept
            reset()
            samples[combo].append(elapsed)
    return samples


def run_tp1(config: BenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    torch.set_num_threads(config.threads)
    load_before = loadavg()
    rows: list[dict[str, Any]] = []
    for tokens in config.tokens:
        check_memory_headroom(tokens, config)
        peaks: dict[tuple[str, str], int | None] = {}
        for path in config.paths:
            for phase in config.phases:
                if config.memory:
                    log(f"memory  tokens={tokens} {path}/{phase} (fresh subprocess)")
                    peaks[(path, phase)] = run_memory_probe(path, phase, tokens, config)
                else:
                    peaks[(path, phase)] = None
        inputs = make_inputs(tokens, config.vocab, config.dtype, config.seed)
        log(f"timing  tokens={tokens}: {config.warmup} warm-up + {config.repeats} rounds")
        samples = time_paths(inputs, config)
        del inputs
        gc.collect()
        for (path, phase), times in samples.items():
            rows.append({
                "path": path, "phase": phase, "tokens": tokens, "vocab": config.vocab,
                "dtype": config.dtype, "median_s": statistics.median(times),
                "min_s": min(times), "times_s": times,
                "peak_mem_bytes": peaks[(path, phase)], "repeats": len(times),
            })
    ratios = compute_ratios(rows)
    path_ratios = compute_path_ratios(rows)
    return {
        "schema_version": "1",
        "mode": "tp1",
        "backend": BACKEND_ID,
        "threads": config.threads,
        "config": config_dict(config),
        "machine": machine(),
        "loadavg": {"before": load_before, "after": loadavg()},
        "memory_method": MEMORY_METHOD if config.memory else None,
        "rows": rows,
        "ratios": ratios,
        "backends": {p: BACKEND_PATHS[p] for p in config.paths if p in BACKEND_PATHS},
        "path_ratios": path_ratios,
        "targets": evaluate_targets(ratios, path_ratios),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rl_engine bench",
        description="Benchmark the deterministic logprob (candidate) against naive log_softmax "
        "and a one-pass floor; or, with --tp, the candidate under torchrun.",
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tiles", type=int, default=64)
    p.add_argument("--dtype", default="bf16", choices=sorted(LOGITS_DTYPES))
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per path first")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--chunk-rows", type=int, default=None, help="candidate/floor rows per chunk")
    p.add_argument("--no-validate", action="store_true", help="candidate with validate=False")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paths", nargs="+", default=None, choices=PATHS,
                   help="default: every path this machine runs (fused where its kernel loads)")
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    p.add_argument("--tp", type=int, nargs="+", default=[], help="TP degrees: run the torchrun mode")
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
        seed=args.seed, paths=tuple(args.paths) if args.paths else default_paths(), phases=tuple(args.phases), tp=tuple(args.tp),
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
