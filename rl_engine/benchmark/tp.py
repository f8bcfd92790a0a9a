"""The TP mode (``--tp 2 4``): every path under ``torchrun`` on gloo, one run per TP degree.

Each rank holds its vocabulary shard of the logits that TP=1 sees and times every path and
phase like the TP=1 mode (:func:`rl_engine.benchmark.timing.time_round_robin`, the ranks
aligned by a barrier before every call), recording the wall time spent inside the collectives
(waiting for slower peers included); the launcher collects one part file per rank. Before
timing, each rank checks that the hand-written ``naive`` path computes what the eager
candidate computes, so its ratios compare like with like. No memory probe in this mode.
"""

from __future__ import annotations

import gc
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

from rl_engine import jsonio
from rl_engine.benchmark.config import PATHS, PHASES, BenchConfig, BenchError
from rl_engine.benchmark.inputs import Inputs, make_inputs
from rl_engine.benchmark.paths import build_step
from rl_engine.benchmark.report import document, loadavg, timing_row
from rl_engine.benchmark.timing import time_round_robin
from rl_engine.logprob.contract import LogprobContract

# The naive path and the candidate compute the same function; their FP32 arithmetic differs.
NAIVE_RTOL, NAIVE_ATOL = 1e-3, 1e-4


def check_naive(inputs: Inputs, config: BenchConfig, contract: LogprobContract, group: Any) -> None:
    """Raise :class:`BenchError` unless the naive path's logprob and gradient match the eager
    candidate's on these inputs (so the TP baseline is a correct one)."""
    results = {}
    for path in ("naive", "candidate"):
        forward, _ = build_step(path, "forward", inputs, config, contract, group)
        backward, _ = build_step(path, "forward_backward", inputs, config, contract, group)
        out = forward()
        logp = out if path == "naive" else out.selected_logp
        results[path] = (logp.float(), backward().float())
    for index, what in enumerate(("logprob", "gradient")):
        got, want = results["naive"][index], results["candidate"][index]
        if not torch.allclose(got, want, rtol=NAIVE_RTOL, atol=NAIVE_ATOL):
            worst = (got - want).abs().max().item()
            raise BenchError(
                f"the naive path's {what} differs from the candidate's by up to {worst:g} on "
                f"tp_rank {contract.tp_rank} (rtol={NAIVE_RTOL}, atol={NAIVE_ATOL}): the TP "
                "baseline is wrong; fix NaiveVocabParallelLogp"
            )


def tp_worker(config: BenchConfig, output: str) -> int:
    """One rank of a TP run (launched by torchrun): time every path on this rank's shard."""
    import torch.distributed as dist

    from rl_engine.distributed.mesh import destroy, init_mesh

    torch.set_num_threads(config.threads)
    mesh = init_mesh(tp=int(os.environ.get("WORLD_SIZE", "1")))
    tp, rank = dist.get_world_size(mesh.tp_group), mesh.tp_rank
    rows: list[dict[str, Any]] = []
    try:
        for tokens in config.tokens:
            contract = config.contract(tokens, tp=tp, tp_rank=rank)
            inputs = make_inputs(tokens, config.vocab, config.dtype, config.seed,
                                 columns=(contract.vocab_start, contract.vocab_end))
            if "naive" in config.paths:
                check_naive(inputs, config, contract, mesh.tp_group)
            steps = {(p, ph): build_step(p, ph, inputs, config, contract, mesh.tp_group)
                     for p in config.paths for ph in config.phases}
            times, comms = time_round_robin(steps, config.warmup, config.repeats,
                                            barrier=lambda: dist.barrier(group=mesh.tp_group))
            del steps, inputs
            gc.collect()
            for (path, phase), samples in times.items():
                row = timing_row(path, phase, tokens, config, samples, None)
                median, comm = row["median_s"], statistics.median(comms[(path, phase)])
                row.update({
                    "tp": tp, "rank": rank, "local_vocab": contract.local_vocab_size,
                    "comm_median_s": comm, "comm_s": comms[(path, phase)],
                    "comm_share": comm / median if median > 0 else 0.0,
                    "threads_per_rank": config.threads,
                })
                rows.append(row)
    finally:
        destroy()
    jsonio.write_json(output, {"rank": rank, "tp": tp, "rows": rows})
    return 0


def run_tp(config: BenchConfig, log: Callable[[str], None] = print, timeout_s: float = 3600.0) -> dict[str, Any]:
    load_before = loadavg()
    rows: list[dict[str, Any]] = []
    for degree in config.tp:
        per_rank_threads = max(1, config.threads // degree)
        sub = BenchConfig(**{**asdict(config), "threads": per_rank_threads, "tp": ()})
        with tempfile.TemporaryDirectory(prefix="rl_engine_bench_tp") as tmp:
            argv = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={degree}", "-m", "rl_engine", "bench", *sub.flags(),
                "--no-memory", "--tp-worker", str(Path(tmp) / "rank{rank}.json"),
            ]
            log(f"tp={degree}: torchrun --standalone --nproc-per-node={degree} "
                f"({per_rank_threads} thread(s) per rank)")
            env = {**os.environ, "OMP_NUM_THREADS": str(per_rank_threads)}
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s)
            if proc.returncode != 0:
                raise BenchError(
                    f"torchrun for tp={degree} failed with exit code {proc.returncode}:\n"
                    f"{(proc.stdout + proc.stderr)[-3000:]}"
                )
            for rank in range(degree):
                part = jsonio.load(Path(tmp) / f"rank{rank}.json")
                rows.extend(part["rows"])
    rows.sort(key=lambda r: (r["tokens"], r["tp"], PATHS.index(r["path"]), PHASES.index(r["phase"]), r["rank"]))
    return document(config, "tp", rows, load_before)
