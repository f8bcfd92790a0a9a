"""The TP=1 mode (default): every path of :mod:`rl_engine.benchmark.paths`, each for ``forward``
and ``forward_backward``, at every ``--tokens``, in this process.

Time: :func:`rl_engine.benchmark.timing.time_round_robin`; the median is reported with all
samples. Memory: peak RSS above the inputs, one fresh subprocess per (path, phase, tokens)
(:mod:`rl_engine.benchmark.memory`), run before the timing so the two never share the
machine's memory. Ratios and the targets come from the rows of this run
(:mod:`rl_engine.benchmark.report`).
"""

from __future__ import annotations

import gc
from typing import Any, Callable

import torch

from rl_engine.benchmark.config import BenchConfig
from rl_engine.benchmark.inputs import make_inputs
from rl_engine.benchmark.memory import check_memory_headroom, run_memory_probe
from rl_engine.benchmark.paths import build_step
from rl_engine.benchmark.report import document, loadavg, timing_row
from rl_engine.benchmark.timing import time_round_robin


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
        inputs = make_inputs(tokens, config.vocab, config.dtype, config.seed,
                             hidden_size=config.hidden_size).to(config.device)
        log(f"timing  tokens={tokens}: {config.warmup} warm-up + {config.repeats} rounds")
        steps = {(p, ph): build_step(p, ph, inputs, config) for p in config.paths for ph in config.phases}
        sync = torch.cuda.synchronize if config.device == "cuda" else None
        samples, _ = time_round_robin(steps, config.warmup, config.repeats, sync=sync)
        del steps, inputs
        gc.collect()
        for (path, phase), times in samples.items():
            rows.append(timing_row(path, phase, tokens, config, times, peaks[(path, phase)]))
    return document(config, "tp1", rows, load_before)
