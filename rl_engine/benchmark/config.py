"""Benchmark configuration: what to run, validated before anything starts."""

from __future__ import annotations

from dataclasses import dataclass

from rl_engine.arith.tiles import default_chunk_rows
from rl_engine.logprob.contract import LOGITS_DTYPES, LogprobContract
from rl_engine.tables import BENCH_PATHS, BENCH_PHASES

PATHS: tuple[str, ...] = BENCH_PATHS
# From the last hidden state and the lm_head weight (--hidden-size): the logits made whole
# (lm_head) or chunk by chunk (fused_lm_head, selected_logprob_from_hidden; fused_lm_head_kept with
# keep_logits=True); asked for by name.
HEAD_PATHS: tuple[str, ...] = ("lm_head", "fused_lm_head", "fused_lm_head_kept", "naive_lm_head")
# The eager candidate computing processed logprobs (docs/arithmetic.md section 13) with these
# parameters on every row, against the candidate's raw logprob in the same run; asked for by name.
PROCESSED_PATH = "processed"
PROCESSED_PARAMS: dict[str, float] = {"top_k": 0, "top_p": 0.9, "min_p": 0.0}
# The benchmarked backends: path name -> backend id ("candidate" is the eager reference).
BACKEND_PATHS: dict[str, str] = {
    "candidate": "pytorch-vocab-parallel-logp-ws2",
    "fused": "cpu-vocab-parallel-logp-ws2",
    "triton": "triton-vocab-parallel-logp-ws2",
}
DEVICES: tuple[str, ...] = ("cpu", "cuda")
# The paths a configuration runs unless told otherwise: triton is asked for by name (on the cpu it
# runs only under Triton's interpreter, whose timings are not a GPU's).
CPU_PATHS: tuple[str, ...] = tuple(p for p in PATHS if p not in ("triton", PROCESSED_PATH) and p not in HEAD_PATHS)
PHASES: tuple[str, ...] = BENCH_PHASES


class BenchError(ValueError):
    """A benchmark that cannot run as asked; the message names the field, value and fix."""


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run (TP=1 mode, or the TP mode when ``tp`` is not empty)."""

    tokens: tuple[int, ...]
    vocab: int = 151936
    tiles: int = 64
    dtype: str = "bf16"
    repeats: int = 5
    warmup: int = 1
    threads: int = 1
    chunk_rows: int | None = None
    validate: bool = True
    memory: bool = True
    seed: int = 0
    paths: tuple[str, ...] = CPU_PATHS
    phases: tuple[str, ...] = PHASES
    tp: tuple[int, ...] = ()
    device: str = "cpu"
    hidden_size: int | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            raise BenchError("tokens=() is empty; pass at least one count, e.g. --tokens 2048")
        for name in ("vocab", "tiles", "repeats", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BenchError(f"{name}={value!r} must be a positive integer")
        for value in self.tokens:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BenchError(f"tokens contains {value!r}; every count must be a positive integer")
        if len(set(self.tokens)) != len(self.tokens):
            raise BenchError(f"tokens={list(self.tokens)} repeats a count; list each once")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise BenchError(f"warmup={self.warmup!r} must be an integer >= 0")
        if self.vocab % self.tiles:
            raise BenchError(
                f"tiles={self.tiles} does not divide vocab={self.vocab}; choose a divisor "
                "(64 for 151936)"
            )
        if self.dtype not in LOGITS_DTYPES:
            raise BenchError(f"dtype={self.dtype!r} is not supported; use one of {list(LOGITS_DTYPES)}")
        if self.chunk_rows is not None and self.chunk_rows < 1:
            raise BenchError(f"chunk_rows={self.chunk_rows} must be >= 1")
        for name, values, allowed in (("paths", self.paths, PATHS), ("phases", self.phases, PHASES)):
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise BenchError(f"{name}={list(values)} must be a non-empty subset of {list(allowed)}")
        self._check_device_and_backends()
        heads = [p for p in self.paths if p in HEAD_PATHS]
        if heads and (isinstance(self.hidden_size, bool) or not isinstance(self.hidden_size, int)
                      or self.hidden_size < 1):
            raise BenchError(f"paths contains {heads} but hidden_size={self.hidden_size!r}; pass --hidden-size N "
                             "(the model's hidden size, e.g. 1024)")
        if self.hidden_size is not None and not heads:
            raise BenchError(f"hidden_size={self.hidden_size} is given but no path uses it; add lm_head and "
                             "fused_lm_head to --paths or drop --hidden-size")
        if heads and self.tp:
            raise BenchError(f"paths contains {heads} with tp={list(self.tp)}: the head paths run in the TP=1 "
                             "mode only; drop --tp")
        for degree in self.tp:
            if degree < 1 or self.tiles % degree:
                raise BenchError(
                    f"tp degree {degree} must be >= 1 and divide tiles={self.tiles} (tile-aligned shards)"
                )

    def _check_device_and_backends(self) -> None:
        """The device and every backend path can run here, as asked: refused before anything runs."""
        import torch

        if self.device not in DEVICES:
            raise BenchError(f"device={self.device!r} is not one of {list(DEVICES)}")
        if self.device == "cuda":
            if not torch.cuda.is_available():
                raise BenchError("device='cuda' but torch.cuda.is_available() is False here; run on a "
                                 "machine with a CUDA GPU and a CUDA build of torch, or use --device cpu")
            if "fused" in self.paths:
                raise BenchError(f"paths contains 'fused' but backend {BACKEND_PATHS['fused']} runs on the "
                                 "cpu only; leave 'fused' out of --paths with --device cuda")
            if self.memory:
                raise BenchError("memory=True measures peak RSS in subprocesses on the cpu; with --device "
                                 "cuda pass --no-memory (gpu-smoke reports peak GPU memory)")
            if self.tp:
                raise BenchError(f"tp={list(self.tp)}: the TP mode runs on the cpu (gloo) only; drop --tp "
                                 "with --device cuda")
        if "fused" in self.paths:
            from rl_engine.logprob.backends.fused_cpu.fused_cpu import kernel_unavailable

            reason = kernel_unavailable()
            if reason is not None:
                raise BenchError(
                    f"paths contains 'fused' but backend {BACKEND_PATHS['fused']} is unavailable "
                    f"here: {reason}; build it or leave 'fused' out of --paths"
                )
        if "triton" in self.paths:
            self._check_triton()

    def _check_triton(self) -> None:
        from rl_engine.logprob.backends.triton.triton_backend import MODE_ENV, env_mode, mode_device, triton_unavailable

        served = mode_device(env_mode())
        if served != self.device:
            fix = (f"set {MODE_ENV}=interpreter to run its kernels under Triton's interpreter (bytes, "
                   "not GPU timings)" if self.device == "cpu" else f"unset {MODE_ENV} for compiled kernels")
            raise BenchError(f"paths contains 'triton' on device={self.device!r} but the backend runs in "
                             f"{env_mode()} mode, which serves {served}; {fix}")
        reason = triton_unavailable()
        if reason is not None:
            raise BenchError(f"paths contains 'triton' but backend {BACKEND_PATHS['triton']} is unavailable "
                             f"here: {reason}; leave 'triton' out of --paths")
        if self.tp:
            raise BenchError(f"paths contains 'triton' with tp={list(self.tp)}: the TP mode runs the cpu "
                             "backends only; bench triton without --tp")

    def triton_mode(self) -> str | None:
        """The Triton backend's mode in this run (None when the run has no triton path)."""
        if "triton" not in self.paths:
            return None
        from rl_engine.logprob.backends.triton.triton_backend import env_mode

        return env_mode()

    def resolved_chunk_rows(self, local_vocab: int | None = None) -> int:
        if self.chunk_rows is not None:
            return self.chunk_rows
        return default_chunk_rows(local_vocab or self.vocab)

    def contract(self, tokens: int, tp: int = 1, tp_rank: int = 0) -> LogprobContract:
        return LogprobContract(
            real_vocab_size=self.vocab,
            padded_vocab_size=self.vocab,
            num_vocab_tiles=self.tiles,
            num_sequences=1,
            seq_len=tokens,
            tp_world_size=tp,
            tp_rank=tp_rank,
            logits_dtype=self.dtype,
        )

    def flags(self) -> list[str]:
        """The command-line flags that rebuild this configuration (for subprocesses)."""
        out = [
            "--tokens", *map(str, self.tokens), "--vocab", str(self.vocab), "--tiles",
            str(self.tiles), "--dtype", self.dtype, "--repeats", str(self.repeats),
            "--warmup", str(self.warmup), "--threads", str(self.threads), "--seed", str(self.seed),
            "--paths", *self.paths, "--phases", *self.phases, "--device", self.device,
        ]
        if self.chunk_rows is not None:
            out += ["--chunk-rows", str(self.chunk_rows)]
        if self.hidden_size is not None:
            out += ["--hidden-size", str(self.hidden_size)]
        if not self.validate:
            out.append("--no-validate")
        return out
