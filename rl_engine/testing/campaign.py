"""A campaign case, its topologies and its plan: the pure, plan-time half of the runner.

A :class:`Case` holds every input parameter of a run except the topology, named as the
runner's flags with underscores. :meth:`Case.check_topology` holds every rule that makes a
``TP x CP`` run impossible, so the planner refuses a bad plan before anything launches and
each rank refuses the same things before any collective. :func:`build_plan` gives the
plan's JSON: one entry per topology with the report path, the argv that runs it and the
shell-ready ``torchrun`` command, which the report repeats as its ``launch_command``.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rl_engine.distributed.bounds import BoundsError, check_cp_split, even_vocab_shards, tile_width
from rl_engine.logprob.comparison import default_tolerance
from rl_engine.logprob.registry import AUTO, backend_ids

SCHEMA_VERSION = "1"
MAX_TP = 8
MAX_CP = 4
DEFAULT_TOPOLOGIES: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2))
DEVICE_DIST_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl"}
DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
CP_LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")
DEFAULT_TIMEOUT_S = 300.0
RUNNER_PATH = Path(__file__).resolve().with_name("distributed_logprob_comparison.py")


class PlanError(ValueError):
    """A case or topology that cannot run; the message names the field, the value and the fix."""


def _int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{name}={value!r} must be an integer")
    if value < minimum:
        raise PlanError(f"{name}={value} must be >= {minimum}")


def _number(name: str, value: Any, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlanError(f"{name}={value!r} must be a finite number")
    if value < 0 or (positive and value == 0):
        raise PlanError(f"{name}={value!r} must be {'> 0' if positive else '>= 0'}")


def parse_topologies(text: str) -> tuple[tuple[int, int], ...]:
    """``"1x1,2x2,8x1"`` -> ``((1, 1), (2, 2), (8, 1))``, in the given order, no duplicates."""
    out: list[tuple[int, int]] = []
    for item in text.split(","):
        part = item.strip().lower()
        pieces = part.split("x")
        if len(pieces) != 2 or not all(p.isdigit() and p[0] != "0" for p in pieces):
            raise PlanError(
                f"--topologies item {item!r} is not <TP>x<CP> with positive integers; "
                "write e.g. 1x1,2x2,8x1"
            )
        pair = (int(pieces[0]), int(pieces[1]))
        if pair in out:
            raise PlanError(f"--topologies lists {part} twice; list each topology once")
        out.append(pair)
    return tuple(out)


@dataclass(frozen=True)
class Case:
    """Every input parameter of a campaign case except the topology (the plan's ``case``)."""

    device: str
    dist_backend: str
    dtype: str
    backend: str
    real_vocab: int
    padded_vocab: int
    num_vocab_tiles: int
    batch: int
    seq: int
    prompt_tokens: int
    seed: int
    cp_layout: str
    logit_scale: float
    atol: float
    rtol: float
    threads_per_rank: int
    timeout_s: float

    def __post_init__(self) -> None:
        if self.device not in DEVICE_DIST_BACKENDS:
            raise PlanError(f"device={self.device!r} is unknown; use one of {list(DEVICE_DIST_BACKENDS)}")
        expected = DEVICE_DIST_BACKENDS[self.device]
        if self.dist_backend != expected:
            raise PlanError(
                f"dist_backend={self.dist_backend!r} does not serve device={self.device!r}; "
                f"use {expected!r} (gloo on cpu, nccl on cuda; nothing falls back)"
            )
        if self.dtype not in DTYPES:
            raise PlanError(f"dtype={self.dtype!r} is unknown; use one of {list(DTYPES)}")
        if self.backend == AUTO:
            raise PlanError(
                "backend='auto' is refused: a campaign validates one named backend; pass it "
                f"explicitly, e.g. --backend {backend_ids()[-1]}"
            )
        if self.backend not in backend_ids():
            raise PlanError(f"backend={self.backend!r} is not registered; use one of {backend_ids()}")
        for name, minimum in (("real_vocab", 1), ("padded_vocab", 1), ("num_vocab_tiles", 1),
                              ("batch", 1), ("seq", 1), ("prompt_tokens", 0), ("seed", 0),
                              ("threads_per_rank", 1)):
            _int(name, getattr(self, name), minimum)
        if self.threads_per_rank > 64:
            raise PlanError(f"threads_per_rank={self.threads_per_rank} must be <= 64")
        _number("logit_scale", self.logit_scale, positive=True)
        _number("atol", self.atol, positive=False)
        _number("rtol", self.rtol, positive=False)
        _number("timeout_s", self.timeout_s, positive=True)
        if self.cp_layout not in CP_LAYOUTS:
            raise PlanError(f"cp_layout={self.cp_layout!r} is unknown; use one of {list(CP_LAYOUTS)}")
        if self.real_vocab > self.padded_vocab:
            raise PlanError(
                f"real_vocab={self.real_vocab} exceeds padded_vocab={self.padded_vocab}; "
                "the padded vocabulary must be >= the real one"
            )
        try:
            tile_width(self.padded_vocab, self.num_vocab_tiles)
        except BoundsError as exc:
            raise PlanError(str(exc)) from None
        if self.prompt_tokens >= self.seq:
            raise PlanError(
                f"prompt_tokens={self.prompt_tokens} must be < seq={self.seq}: with no active "
                "token there is no logprob to compare; lower --prompt-tokens or raise --seq"
            )

    @classmethod
    def create(cls, **fields: Any) -> "Case":
        """Fill ``dist_backend`` from the device and ``atol``/``rtol`` from the dtype when None."""
        if fields.get("dist_backend") is None:
            fields["dist_backend"] = DEVICE_DIST_BACKENDS.get(fields.get("device", ""), "")
        if fields.get("atol") is None or fields.get("rtol") is None:
            d_atol, d_rtol = default_tolerance(fields["dtype"]) if fields.get("dtype") in DTYPES else (0.0, 0.0)
            fields["atol"] = d_atol if fields.get("atol") is None else fields["atol"]
            fields["rtol"] = d_rtol if fields.get("rtol") is None else fields["rtol"]
        fields.setdefault("timeout_s", DEFAULT_TIMEOUT_S)
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def case_id(self) -> str:
        """Deterministic id of the numerical case (no topology, no tolerance)."""
        return (
            f"{self.dtype}-v{self.real_vocab}-p{self.padded_vocab}-t{self.num_vocab_tiles}"
            f"-b{self.batch}-s{self.seq}-pt{self.prompt_tokens}-seed{self.seed}"
            f"-{self.cp_layout}-scale{self.logit_scale:g}"
        )

    def check_topology(self, tp: int, cp: int) -> None:
        """Every reason a ``tp x cp`` run of this case cannot be made, before anything starts."""
        _int("tp", tp, 1)
        _int("cp", cp, 1)
        if tp > MAX_TP:
            raise PlanError(f"tp={tp} exceeds the supported maximum {MAX_TP}; use tp <= {MAX_TP}")
        if cp > MAX_CP:
            raise PlanError(f"cp={cp} exceeds the supported maximum {MAX_CP}; use cp <= {MAX_CP}")
        if tp * cp > self.num_vocab_tiles:
            raise PlanError(
                f"tp*cp={tp * cp} ranks exceed num_vocab_tiles={self.num_vocab_tiles}; use at "
                f"most {self.num_vocab_tiles} ranks or more tiles"
            )
        try:
            even_vocab_shards(self.padded_vocab, self.num_vocab_tiles, tp)
            check_cp_split(self.seq, cp, self.cp_layout)
        except BoundsError as exc:
            raise PlanError(f"topology {tp}x{cp}: {exc}") from None

    def runner_flags(self, tp: int, cp: int, output: str) -> list[str]:
        """The runner's flags for one topology; floats as ``repr`` so they parse back exactly."""
        return [
            "--device", self.device,
            "--dist-backend", self.dist_backend,
            "--dtype", self.dtype,
            "--backend", self.backend,
            "--real-vocab", str(self.real_vocab),
            "--padded-vocab", str(self.padded_vocab),
            "--num-vocab-tiles", str(self.num_vocab_tiles),
            "--batch", str(self.batch),
            "--seq", str(self.seq),
            "--prompt-tokens", str(self.prompt_tokens),
            "--seed", str(self.seed),
            "--cp-layout", self.cp_layout,
            "--logit-scale", repr(float(self.logit_scale)),
            "--atol", repr(float(self.atol)),
            "--rtol", repr(float(self.rtol)),
            "--threads-per-rank", str(self.threads_per_rank),
            "--timeout-s", repr(float(self.timeout_s)),
            "--tp", str(tp),
            "--cp", str(cp),
            "--output", output,
        ]

    def launch_command(self, tp: int, cp: int, output: str) -> str:
        """The shell-ready ``torchrun`` command that writes this topology's report."""
        return f"torchrun --standalone --nproc-per-node={tp * cp} " + shlex.join(
            [str(RUNNER_PATH), *self.runner_flags(tp, cp, output)]
        )

    def launch_argv(self, tp: int, cp: int, output: str) -> list[str]:
        """The same launch as an argv, through this interpreter's ``torch.distributed.run``.

        ``python -m torch.distributed.run`` is what the ``torchrun`` script runs; calling it
        through ``sys.executable`` guarantees the interpreter (and torch) that made the plan,
        where a ``torchrun`` on PATH may belong to another environment.
        """
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={tp * cp}", str(RUNNER_PATH), *self.runner_flags(tp, cp, output),
        ]


def report_path(output_dir: str | os.PathLike[str], tp: int, cp: int) -> str:
    return str(Path(output_dir) / f"tp{tp}-cp{cp}.json")


def build_plan(case: Case, topologies: tuple[tuple[int, int], ...], plan_output: str) -> dict[str, Any]:
    """The plan's JSON; ``output_dir`` is the absolute directory of ``plan_output``."""
    if not topologies:
        raise PlanError("no topology to plan; pass --topologies, or --tp and --cp")
    for tp, cp in topologies:
        case.check_topology(tp, cp)
    output_dir = str(Path(plan_output).resolve().parent)
    entries = []
    for tp, cp in topologies:
        output = report_path(output_dir, tp, cp)
        entries.append({
            "tp": tp,
            "cp": cp,
            "world_size": tp * cp,
            "output": output,
            "argv": case.launch_argv(tp, cp, output),
            "command": case.launch_command(tp, cp, output),
        })
    return {
        "schema_version": SCHEMA_VERSION,
        "case_id": case.case_id,
        "case": case.to_dict(),
        "output_dir": output_dir,
        "topologies": entries,
    }


__all__ = [
    "CP_LAYOUTS",
    "Case",
    "DEFAULT_TOPOLOGIES",
    "MAX_CP",
    "MAX_TP",
    "PlanError",
    "RUNNER_PATH",
    "SCHEMA_VERSION",
    "build_plan",
    "parse_topologies",
    "report_path",
]
