"""Benchmark configuration: what to run, validated before anything starts."""

from __future__ import annotations

from dataclasses import dataclass

from rl_engine.logprob.contract import LOGITS_DTYPES, LogprobContract
from rl_engine.logprob.tiles import default_chunk_rows

PATHS: tuple[str, ...] = ("candidate", "fused", "naive", "floor")
# The benchmarked backends: path name -> backend id ("candidate" is the eager reference).
BACKEND_PATHS: dict[str, str] = {
    "candidate": "pytorch-vocab-parallel-logp-ws2",
    "fused": "cpu-vocab-parallel-logp-ws2",
}
PHASES: tuple[str, ...] = ("forward", "forward_backward")


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
    paths: tuple[str, ...] = PATHS
    phases: tuple[str, ...] = PHASES
    tp: tuple[int, ...] = ()

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
        if "fused" in self.paths:
            from rl_engine.logprob.fused_cpu import kernel_unavailable

            reason = kernel_unavailable()
            if reason is not None:
                raise BenchError(
                    f"paths contains 'fused' but backend {BACKEND_PATHS['fused']} is unavailable "
                    f"here: {reason}; build it or leave 'fused' out of --paths"
                )
        for degree in self.tp:
            if degree < 1 or self.tiles % degree:
                raise BenchError(
                    f"tp degree {degree} must be >= 1 and divide tiles={self.tiles} (tile-aligned shards)"
                )

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
            "--paths", *self.paths, "--phases", *self.phases,
        ]
        if self.chunk_rows is not None:
            out += ["--chunk-rows", str(self.chunk_rows)]
        if not self.validate:
            out.append("--no-validate")
        return out
