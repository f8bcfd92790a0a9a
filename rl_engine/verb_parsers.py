"""The command lines of the verbs whose modules import torch, built without it.

``python -m rl_engine <verb> --help`` answers from here at once (:mod:`rl_engine.cli` builds
the parser and never imports the verb's module for ``--help``); each verb's module parses its
arguments with the same function, so the help shown and the arguments accepted are one
definition. Only the standard library and torch-free tables are imported here (a test imports
every verb's ``--help`` in a fresh interpreter and requires ``torch`` absent from ``sys.modules``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rl_engine.rundir import CAPTURE
from rl_engine.tables import AUTO_TILES, BENCH_PATHS, BENCH_PHASES, DTYPES, EAGER_BACKEND, PARITY_RATIO_BOUNDS


def copy_capture_parser() -> argparse.ArgumentParser:
    """``copy-capture`` (rl_engine.campaign.captured)."""
    p = argparse.ArgumentParser(
        prog="python -m rl_engine copy-capture",
        description="Copy the case's captured file into the run directory (config inputs.archive: true), "
                    "checking its SHA-256 against the case while it is copied. Exit 0 copied, 2 refused.")
    p.add_argument("--case", required=True, type=Path, help="the case file (case.json) of a capture case")
    p.add_argument("--output", required=True, type=Path, help=f"where the copy goes (RUN/{CAPTURE})")
    return p


def run_parser() -> argparse.ArgumentParser:
    """``run`` (rl_engine.campaign.run)."""
    p = argparse.ArgumentParser(
        prog="python -m rl_engine run",
        description="Run one topology of a plan under torchrun (its command: torchrun ... -m rl_engine.campaign.run "
                    "PLAN --tp T --cp C): every rank computes its part, rank 0 writes the report beside the plan. "
                    "Exit 0 passed, 1 failed acceptance (report kept), 2 no valid report.",
    )
    p.add_argument("plan", help="plan.json (python -m rl_engine plan)")
    p.add_argument("--tp", type=int, required=True, help="TP degree of a planned topology")
    p.add_argument("--cp", type=int, required=True, help="CP degree of a planned topology")
    return p



def bench_parser() -> argparse.ArgumentParser:
    """``bench`` (rl_engine.benchmark.cli)."""
    p = argparse.ArgumentParser(
        prog="python -m rl_engine bench",
        description="Benchmark every backend available here (candidate: the eager one; fused: the "
        "compiled CPU one) against naive log_softmax and a one-pass floor; with --tp, the same paths "
        "on vocabulary shards under torchrun (naive: a vocab-parallel log_softmax).",
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tiles", type=int, default=64)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per path first")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--chunk-rows", type=int, default=None, help="rows per chunk of candidate and floor (fused streams rows)")
    p.add_argument("--no-validate", action="store_true", help="backends with validate=False")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paths", nargs="+", default=None, choices=BENCH_PATHS,
                   help="default: every path this machine runs on --device (cpu: fused where its kernel loads; "
                   "cuda: triton where it compiles); triton on the cpu needs RL_ENGINE_TRITON_MODE=interpreter")
    p.add_argument("--phases", nargs="+", default=list(BENCH_PHASES), choices=BENCH_PHASES)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the inputs live and the backends run (cuda: --no-memory, no fused, no --tp)")
    p.add_argument("--tp", type=int, nargs="+", default=[], help="TP degrees: run the torchrun mode")
    p.add_argument("--hidden-size", type=int, default=None,
                   help="the hidden size of the head paths (lm_head, fused_lm_head[_kept], naive_lm_head: asked for by name)")
    p.add_argument("--output", default=None, help="write the JSON document here")
    p.add_argument("--probe", nargs=3, metavar=("PATH", "PHASE", "TOKENS"), help=argparse.SUPPRESS)
    p.add_argument("--tp-worker", metavar="OUTPUT", help=argparse.SUPPRESS)
    return p



def vocab_tiles_argument(text: str) -> int | str:
    """``--num-vocab-tiles``: ``auto`` (kept as the name, resolved by the verb as the API resolves
    it) or an integer (the verb checks that it divides the vocabulary)."""
    if text == AUTO_TILES:
        return AUTO_TILES
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither {AUTO_TILES!r} nor an integer") from None


def parity_parser() -> argparse.ArgumentParser:
    """``parity`` (rl_engine.capture.parity)."""
    p = argparse.ArgumentParser(
        prog="python -m rl_engine parity",
        description="Compare two captures of the same tokens (a rollout engine's and a trainer's): "
        "targets and mask, logits, our logprob on each side's logits, each engine's reported "
        "logprob against ours, and the importance ratio. Writes parity.json and parity.png; exit "
        "0 bitwise equal, 1 different, 2 refused (nothing written).")
    p.add_argument("rollout", type=Path, help="the rollout engine's capture (safetensors)")
    p.add_argument("trainer", type=Path, help="the trainer's capture of the same tokens")
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--backend", default=EAGER_BACKEND, help="our logprob's backend (explicit id)")
    p.add_argument("--num-vocab-tiles", type=vocab_tiles_argument, default=AUTO_TILES,
                   help="tiles of our logprob (default auto: the count selected_logprob's default rule gives for "
                        "the captures' vocabulary, so an engine reporting our logprob with the API's defaults "
                        "compares bitwise; or an integer dividing the vocabulary)")
    p.add_argument("--ratio-bounds", type=float, nargs=2, default=list(PARITY_RATIO_BOUNDS),
                        metavar=("LOW", "HIGH"))
    p.add_argument("--difference-exit-code", type=int, choices=(0, 1), default=1,
                        help="the exit code when the report shows a difference (default 1; the workflow's "
                             "parity stage passes 0: a difference is a finding, not a failed stage)")
    return p


def gpu_smoke_parser() -> argparse.ArgumentParser:
    """``gpu-smoke`` (rl_engine.gpu_smoke)."""
    p = argparse.ArgumentParser(
        prog="python -m rl_engine gpu-smoke",
        description="Portable bits on a GPU, in one command: the campaign on cuda, the same case on the CPU, "
                    "identical fingerprints required; the Triton backend's bytes against the fused CPU bytes "
                    "at bf16/fp16/fp32 and T = 1 and 0.7; forward and forward+backward times of every backend "
                    "(Triton: default, with entropy, without validation), naive log_softmax(x.float()).gather, "
                    "the read floor (amax in the logits' dtype: each byte read once) and the copy floor (one "
                    "read and one write), as ratios to the floor, to naive and (cuda) to the roofline's "
                    "prediction, with the GPU's clocks, power and temperature sampled beside each (NVML or "
                    "nvidia-smi; recorded as absent otherwise); on cuda the SASS of the kernels the process "
                    "launched (instructions, registers, spills) beside the roofline's; how often the kernels' "
                    "guard takes the IEEE division's path at T = 0.7 (or the config's temperature). Writes "
                    "<output-dir>/smoke.json (schemas/smoke.schema.json). --cpu-only is the "
                    "dry run: gloo ranks, the Triton kernels under the interpreter, no roofline. Exit 0 all "
                    "bytes equal, 1 a difference or a failed topology, 2 cannot start.")
    p.add_argument("--config", default="config.yaml", help="the campaign (default config.yaml)")
    p.add_argument("--output-dir", default="results/gpu-smoke", help="where runs and smoke.json go")
    p.add_argument("--cpu-only", action="store_true", help="everything but CUDA: the campaign on the CPU")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the timed forward (default 8192)")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per backend (median)")
    p.add_argument("--max-ranks", type=int, default=None,
                   help="largest TP*CP to run (default: the GPU count; no limit with --cpu-only)")
    p.add_argument("--timeout-s", type=int, default=900, help="time limit of one topology")
    p.add_argument("--bitwise-tokens", type=int, default=64,
                   help="tokens of the Triton-vs-CPU byte comparison per dtype and temperature (default 64)")
    p.add_argument("--backends", default=None,
                   help="campaign backends, comma separated (default: on cuda the Triton and the "
                        "eager backend, on the CPU the config's)")
    return p



# verb -> its parser, for rl_engine.cli's --help
PARSERS = {"copy-capture": copy_capture_parser, "run": run_parser, "bench": bench_parser,
           "parity": parity_parser, "gpu-smoke": gpu_smoke_parser}

__all__ = ["PARSERS", "bench_parser", "copy_capture_parser", "gpu_smoke_parser", "parity_parser", "run_parser"]
