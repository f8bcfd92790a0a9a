"""The TP mode: the candidate under ``torchrun`` on gloo, one run per TP degree.

Each rank holds its vocabulary shard of seeded logits, times forward and
forward+backward (median of the repeats after warm-up, ranks aligned by a barrier before
every repeat) and the wall time spent inside ``torch.distributed.all_gather`` (waiting for
slower peers included); the launcher collects one part file per rank.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from rl_engine import jsonio
from rl_engine.benchmark.config import BenchConfig, BenchError
from rl_engine.benchmark.paths import make_inputs
from rl_engine.benchmark.report import config_dict, loadavg, machine
from rl_engine.logprob.vocab_parallel import BACKEND_ID, VocabParallelLogprob


@contextmanager
def timed_collectives() -> Iterator[list[float]]:
    """Accumulate the wall time spent inside ``torch.distributed.all_gather`` calls."""
    import torch.distributed as dist

    spent = [0.0]
    original = dist.all_gather

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    dist.all_gather = timed  # type: ignore[assignment]
    try:
        yield spent
    finally:
        dist.all_gather = original  # type: ignore[assignment]


def tp_worker(config: BenchConfig, output: str) -> int:
    """One rank of a TP run (launched by torchrun): time the candidate on this rank's shard."""
    import torch.distributed as dist

    from rl_engine.distributed.mesh import destroy, init_mesh

    torch.set_num_threads(config.threads)
    mesh = init_mesh(tp=int(os.environ.get("WORLD_SIZE", "1")))
    tp, rank = dist.get_world_size(mesh.tp_group), mesh.tp_rank
    rows: list[dict[str, Any]] = []
    try:
        for tokens in config.tokens:
            contract = config.contract(tokens, tp=tp, tp_rank=rank)
            full_seed = config.seed * 1000 + rank
            local = make_inputs(tokens, contract.local_vocab_size, config.dtype, full_seed)
            gen = torch.Generator().manual_seed(config.seed)
            targets = torch.randint(0, config.vocab, (tokens,), generator=gen)
            active = local.active
            op = VocabParallelLogprob()
            leaf = local.logits.detach().requires_grad_(True)

            def forward() -> Any:
                with torch.no_grad():
                    return op(local.logits, targets, active, contract, group=mesh.tp_group,
                              validate=config.validate)

            def forward_backward() -> Any:
                out = op(leaf, targets, active, contract, group=mesh.tp_group, validate=config.validate)
                out.selected_logp.sum().backward()
                grad = leaf.grad
                leaf.grad = None
                return grad

            for phase, step in (("forward", forward), ("forward_backward", forward_backward)):
                if phase not in config.phases:
                    continue
                for _ in range(config.warmup):
                    step()
                times: list[float] = []
                comms: list[float] = []
                for _ in range(config.repeats):
                    dist.barrier(group=mesh.tp_group)
                    with timed_collectives() as spent:
                        start = time.perf_counter()
                        kept = step()
                        elapsed = time.perf_counter() - start
                    del kept
                    times.append(elapsed)
                    comms.append(spent[0])
                median = statistics.median(times)
                comm = statistics.median(comms)
                rows.append({
                    "path": "candidate", "phase": phase, "tokens": tokens, "vocab": config.vocab,
                    "dtype": config.dtype, "median_s": median, "min_s": min(times),
                    "times_s": times, "peak_mem_bytes": None, "repeats": len(times),
                    "tp": tp, "rank": rank, "local_vocab": contract.local_vocab_size,
                    "comm_median_s": comm, "comm_s": comms,
                    "comm_share": comm / median if median > 0 else 0.0,
                    "threads_per_rank": config.threads,
                })
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
    rows.sort(key=lambda r: (r["tokens"], r["tp"], r["phase"], r["rank"]))
    return {
        "schema_version": "1",
        "mode": "tp",
        "backend": BACKEND_ID,
        "threads": config.threads,
        "config": config_dict(config),
        "machine": machine(),
        "loadavg": {"before": load_before, "after": loadavg()},
        "memory_method": None,
        "rows": rows,
        "ratios": {},
        "targets": [],
    }
