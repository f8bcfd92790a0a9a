"""A campaign case, its topologies and its plan: the pure, plan-time half of the runner.

A :class:`Case` holds every input parameter of a run except the topology, named as the
runner's flags with underscores; :func:`case_problems` holds every rule about those
parameters (a Case refuses to exist while any is broken). :func:`check_topology` holds every
rule that makes a ``TP x CP`` run impossible, and :func:`check_matrix` the rule for a matrix
of topologies. The planner refuses a bad plan with them before anything launches, each rank
refuses the same things before any collective, and the workflow's ``check_config`` runs the
very same functions at parse time. :func:`build_plan` gives the plan's JSON: one entry per
topology with the report path, the argv that runs it and the shell-ready ``torchrun``
command, which the report repeats as its ``launch_command``.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from rl_engine.distributed.bounds import BoundsError, check_cp_split, even_vocab_shards, tile_width
from rl_engine.logprob.comparison import default_tolerance
from rl_engine.logprob.registry import AUTO, backend_devices, backend_ids

SCHEMA_VERSION = "1"
MAX_TP = 8
MAX_CP = 4
MIN_MATRIX_TOPOLOGIES = 2  # the cross-topology check compares at least two
DEFAULT_TOPOLOGIES: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2))
DEVICE_DIST_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl"}
DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
CP_LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")
DEFAULT_TIMEOUT_S = 300.0
RUNNER_PATH = Path(__file__).resolve().with_name("distributed_logprob_comparison.py")


class PlanError(ValueError):
    """A case or topology that cannot run; the message names the field, the value and the fix."""


def _int_problem(name: str, value: Any, minimum: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{name}={value!r} must be an integer"
    if value < minimum:
        return f"{name}={value} must be >= {minimum}"
    return None


def _number_problem(name: str, value: Any, positive: bool) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"{name}={value!r} must be a finite number"
    if value < 0 or (positive and value == 0):
        return f"{name}={value!r} must be {'> 0' if positive else '>= 0'}"
    return None


def _int(name: str, value: Any, minimum: int) -> None:
    problem = _int_problem(name, value, minimum)
    if problem is not None:
        raise PlanError(problem)


def parse_topology(item: str) -> tuple[int, int]:
    """``"2x1"`` -> ``(2, 1)``: positive integers, no leading zero."""
    part = item.strip().lower()
    pieces = part.split("x")
    if len(pieces) != 2 or not all(p.isdigit() and p[0] != "0" for p in pieces):
        raise PlanError(
            f"--topologies item {item!r} is not <TP>x<CP> with positive integers; "
            "write e.g. 1x1,2x2,8x1"
        )
    return int(pieces[0]), int(pieces[1])


def parse_topologies(items: str | Sequence[str]) -> tuple[tuple[int, int], ...]:
    """``"1x1,2x2,8x1"`` (or ``["1x1", "2x2", "8x1"]``) -> ``((1, 1), (2, 2), (8, 1))``.

    In the given order, each topology once.
    """
    out: list[tuple[int, int]] = []
    for item in items.split(",") if isinstance(items, str) else items:
        pair = parse_topology(item)
        if pair in out:
            raise PlanError(f"--topologies lists {pair[0]}x{pair[1]} twice; list each topology once")
        out.append(pair)
    return tuple(out)


def matrix_problem(count: int) -> str | None:
    """Why a matrix of ``count`` topologies cannot be a campaign (None when it can)."""
    if count >= MIN_MATRIX_TOPOLOGIES:
        return None
    return (
        f"{count} topolog{'y' if count == 1 else 'ies'} listed, but the cross-topology check "
        f"compares at least {MIN_MATRIX_TOPOLOGIES}; list {MIN_MATRIX_TOPOLOGIES} or more "
        "(e.g. 1x1 and 2x1)"
    )


def check_matrix(topologies: Sequence[tuple[int, int]]) -> None:
    """A campaign matrix (``--topologies``, the workflow's ``topologies``) lists at least two."""
    problem = matrix_problem(len(topologies))
    if problem is not None:
        raise PlanError(f"--topologies: {problem}; to plan one topology alone use --tp T --cp C")


def case_problems(values: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Every broken rule of a case's parameters, as ``(field, message)`` in field order.

    ``values`` holds :class:`Case`'s fields. A rule that involves several fields is only
    checked when each of them passed its own checks, and is reported under the field
    named first in its message. Each message names the field, the value and the fix.
    """
    found: list[tuple[str, str]] = []

    def add(name: str, problem: str | None) -> None:
        if problem is not None:
            found.append((name, problem))

    device, dist_backend = values["device"], values["dist_backend"]
    if device not in DEVICE_DIST_BACKENDS:
        add("device", f"device={device!r} is unknown; use one of {list(DEVICE_DIST_BACKENDS)}")
    elif dist_backend != DEVICE_DIST_BACKENDS[device]:
        add("dist_backend",
            f"dist_backend={dist_backend!r} does not serve device={device!r}; use "
            f"{DEVICE_DIST_BACKENDS[device]!r} (gloo on cpu, nccl on cuda; nothing falls back)")
    if values["dtype"] not in DTYPES:
        add("dtype", f"dtype={values['dtype']!r} is unknown; use one of {list(DTYPES)}")
    backend = values["backend"]
    if backend == AUTO:
        add("backend",
            "backend='auto' is refused: a campaign validates one named backend (evidence must "
            f"name what it tested); name it explicitly, one of {backend_ids()}")
    elif backend not in backend_ids():
        add("backend", f"backend={backend!r} is not registered; use one of {backend_ids()}")
    elif device in DEVICE_DIST_BACKENDS and device not in backend_devices(backend):
        add("backend",
            f"backend={backend!r} does not run on device={device!r} (its devices: "
            f"{sorted(backend_devices(backend))}); choose a backend for {device!r} or change "
            "the device")
    for name, minimum in (("real_vocab", 1), ("padded_vocab", 1), ("num_vocab_tiles", 1),
                          ("batch", 1), ("seq", 1), ("prompt_tokens", 0), ("seed", 0),
                          ("threads_per_rank", 1)):
        add(name, _int_problem(name, values[name], minimum))
    bad = {name for name, _ in found}
    if "threads_per_rank" not in bad and values["threads_per_rank"] > 64:
        add("threads_per_rank", f"threads_per_rank={values['threads_per_rank']} must be <= 64")
    add("logit_scale", _number_problem("logit_scale", values["logit_scale"], positive=True))
    add("atol", _number_problem("atol", values["atol"], positive=False))
    add("rtol", _number_problem("rtol", values["rtol"], positive=False))
    add("timeout_s", _number_problem("timeout_s", values["timeout_s"], positive=True))
    if values["cp_layout"] not in CP_LAYOUTS:
        add("cp_layout", f"cp_layout={values['cp_layout']!r} is unknown; use one of {list(CP_LAYOUTS)}")
    real, padded, tiles = values["real_vocab"], values["padded_vocab"], values["num_vocab_tiles"]
    if not bad & {"real_vocab", "padded_vocab"} and real > padded:
        add("real_vocab",
            f"real_vocab={real} exceeds padded_vocab={padded}; the padded vocabulary must be "
            ">= the real one")
    if not bad & {"padded_vocab", "num_vocab_tiles"}:
        try:
            tile_width(padded, tiles)
        except BoundsError as exc:
            add("num_vocab_tiles", str(exc))
    prompt, seq = values["prompt_tokens"], values["seq"]
    if not bad & {"prompt_tokens", "seq"} and prompt >= seq:
        add("prompt_tokens",
            f"prompt_tokens={prompt} must be < seq={seq}: with no active token there is no "
            "logprob to compare; lower prompt_tokens or raise seq")
    return found


# The case fields the topology rules read: check_topology needs each of them valid.
TOPOLOGY_FIELDS: tuple[str, ...] = ("padded_vocab", "num_vocab_tiles", "seq", "cp_layout")


def check_topology(
    tp: int, cp: int, *, padded_vocab: int, num_vocab_tiles: int, seq: int, cp_layout: str
) -> None:
    """Every reason a ``tp x cp`` run cannot be made from valid case fields, before anything starts."""
    _int("tp", tp, 1)
    _int("cp", cp, 1)
    if tp > MAX_TP:
        raise PlanError(f"tp={tp} exceeds the supported maximum {MAX_TP}; use tp <= {MAX_TP}")
    if cp > MAX_CP:
        raise PlanError(f"cp={cp} exceeds the supported maximum {MAX_CP}; use cp <= {MAX_CP}")
    if tp * cp > num_vocab_tiles:
        raise PlanError(
            f"tp*cp={tp * cp} ranks exceed num_vocab_tiles={num_vocab_tiles}; use at "
            f"most {num_vocab_tiles} ranks or more tiles"
        )
    try:
        even_vocab_shards(padded_vocab, num_vocab_tiles, tp)
        check_cp_split(seq, cp, cp_layout)
    except BoundsError as exc:
        raise PlanError(f"topology {tp}x{cp}: {exc}") from None


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
        problems = case_problems({f.name: getattr(self, f.name) for f in fields(self)})
        if problems:
            raise PlanError("; ".join(message for _, message in problems))

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
        check_topology(tp, cp, **{name: getattr(self, name) for name in TOPOLOGY_FIELDS})

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
    "MIN_MATRIX_TOPOLOGIES",
    "PlanError",
    "RUNNER_PATH",
    "SCHEMA_VERSION",
    "TOPOLOGY_FIELDS",
    "build_plan",
    "case_problems",
    "check_matrix",
    "check_topology",
    "matrix_problem",
    "parse_topologies",
    "parse_topology",
    "report_path",
]
