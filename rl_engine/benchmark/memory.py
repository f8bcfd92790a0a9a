"""Peak resident memory above the inputs, one fresh interpreter per (path, phase, tokens).

The probe builds the inputs, warms torch up on a tiny tensor (thread pool, autograd
engine), resets the kernel's peak-RSS mark (``/proc/self/clear_refs``), reads ``VmRSS``,
runs the path once and reads ``VmHWM``: the difference counts everything the path touched
(its outputs and the gradient included) and nothing of another path.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import torch

from rl_engine import jsonio
from rl_engine.benchmark.config import BenchConfig, BenchError
from rl_engine.benchmark.inputs import make_inputs
from rl_engine.benchmark.paths import build_step
from rl_engine.logprob.contract import LOGITS_DTYPES

MEMORY_METHOD = (
    "peak RSS above the inputs: fresh subprocess per (path, phase, tokens); inputs built, "
    "torch warmed up on a tiny tensor, /proc/self/clear_refs reset, VmHWM - VmRSS around "
    "one run"
)


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise BenchError(f"/proc/self/status has no {field_name}; peak memory needs Linux (or pass --no-memory)")


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
    except OSError as exc:
        raise BenchError(
            f"cannot reset the peak RSS through /proc/self/clear_refs ({exc}); peak memory "
            "needs Linux >= 4.0 with a writable /proc (or pass --no-memory)"
        ) from None


def torch_warmup() -> None:
    """Start the intra-op thread pool and the autograd engine on a tiny tensor."""
    x = torch.ones(1 << 16, requires_grad=True)
    torch.exp(x).sum().backward()
    gc.collect()


def probe_memory(path: str, phase: str, tokens: int, config: BenchConfig) -> dict[str, int]:
    """Peak RSS above the inputs of one run (call in a fresh process)."""
    torch.set_num_threads(config.threads)
    inputs = make_inputs(tokens, config.vocab, config.dtype, config.seed, hidden_size=config.hidden_size)
    step, reset = build_step(path, phase, inputs, config)
    torch_warmup()
    reset_peak_rss()
    base_kib = _status_kib("VmRSS")
    kept = step()
    peak_kib = _status_kib("VmHWM")
    del kept
    reset()
    return {"peak_mem_bytes": max(0, peak_kib - base_kib) * 1024, "inputs_bytes": inputs.nbytes}


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# Peak bytes above the inputs per byte of logits, as measured at 2048 x 151936 bf16
# (naive: FP32 copy + FP32 log_softmax = 8 B per element; with backward 12 B).
_MEM_FACTOR = {"naive": {"forward": 4.0, "forward_backward": 6.0}}
_MEM_MARGIN = 1.1


def check_memory_headroom(tokens: int, config: BenchConfig) -> None:
    """Refuse, before starting, a size the machine's free memory cannot hold."""
    available = mem_available()
    if available is None:
        return
    logits_bytes = tokens * config.vocab * LOGITS_DTYPES[config.dtype].itemsize
    factor = max(
        [_MEM_FACTOR.get(p, {}).get(ph, 2.0) for p in config.paths for ph in config.phases]
    )
    need = int(logits_bytes * (1 + factor) * _MEM_MARGIN)
    if need > available:
        raise BenchError(
            f"tokens={tokens} at vocab={config.vocab} {config.dtype} needs about "
            f"{need / 2**30:.1f} GiB (inputs plus the heaviest path) but MemAvailable is "
            f"{available / 2**30:.1f} GiB; run fewer --tokens, drop --paths naive, or free memory"
        )


def run_memory_probe(path: str, phase: str, tokens: int, config: BenchConfig) -> int:
    """Run :func:`probe_memory` in a fresh interpreter and return its peak bytes."""
    argv = [sys.executable, "-m", "rl_engine", "bench", *config.flags(), "--no-memory",
            "--probe", path, phase, str(tokens)]
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    if proc.returncode != 0:
        raise BenchError(
            f"memory probe for path={path} phase={phase} tokens={tokens} failed with exit code "
            f"{proc.returncode}:\n{proc.stderr[-2000:]}"
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise BenchError(f"memory probe for path={path} phase={phase} tokens={tokens} printed no result")
    return int(jsonio.loads(lines[-1])["peak_mem_bytes"])
