"""The plan: one entry per topology of a case, and the torchrun command that runs it.

``python -m rl_engine plan --case case.json --output DIR/plan.json`` (the workflow's plan rule)
builds it from a case file; the guide's command (the same verb, or
``python rl_engine/testing/distributed_logprob_comparison.py --plan``) builds it from one flag
per case field instead. Either way the plan holds the case and, per topology, its report's file
name (beside the plan), the ``argv`` that writes it and, as ``command``, ``shlex.join(argv)``::

    torchrun --standalone --nproc-per-node=<T*C> -m rl_engine.campaign.run DIR/plan.json --tp T --cp C

``launch`` runs that argv (:func:`interpreter_argv`: ``torchrun`` as this interpreter's
``-m torch.distributed.run``, which is what the ``torchrun`` script runs). A topology runs from
the plan plus its ``--tp``/``--cp`` (:mod:`rl_engine.campaign.run`), so nothing of the case is
written twice; the report repeats the command as its ``launch_command``. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

from rl_engine import jsonio, schemas
from rl_engine.campaign.case import (
    Case,
    CaseError,
    check_matrix,
    load_case_file,
    parse_topologies,
)
from rl_engine.rundir import Topology, report_tensors
from rl_engine.tables import (
    CP_LAYOUTS,
    DEFAULT_TOLERANCES,
    DEFAULT_TOPOLOGIES,
    DEVICE_DIST_BACKENDS,
    DTYPES,
    SCHEMA_VERSION,
)

RUNNER_MODULE = "rl_engine.campaign.run"


class PlanError(CaseError):
    """A plan that cannot be built or read (no topology, conflicting flags, a bad plan file, a
    topology it does not hold); a :class:`CaseError`, so one ``except CaseError`` refuses both."""

# A topology run's exit codes (the runner's ranks; launch restores them from the artifacts).
EXIT_PASSED = 0  # the report was written and passed
EXIT_FAILED = 1  # the report was written and failed acceptance (kept, with its failures)
EXIT_NO_REPORT = 2  # no valid report; nothing is left at the output paths


def runner_args(plan_path: str | os.PathLike[str], tp: int, cp: int) -> list[str]:
    return ["-m", RUNNER_MODULE, str(plan_path), "--tp", str(tp), "--cp", str(cp)]


TORCHRUN = "torchrun"


def launch_argv(plan_path: str | os.PathLike[str], tp: int, cp: int) -> list[str]:
    """The argv that writes this topology's report (the plan records it as ``argv``)."""
    return [TORCHRUN, "--standalone", f"--nproc-per-node={tp * cp}", *runner_args(plan_path, tp, cp)]


def launch_command(plan_path: str | os.PathLike[str], tp: int, cp: int) -> str:
    """The shell-ready command of :func:`launch_argv`: ``shlex.join`` of it (the plan's ``command``)."""
    return shlex.join(launch_argv(plan_path, tp, cp))


def interpreter_argv(argv: Sequence[str]) -> list[str]:
    """A planned argv as this interpreter runs it: ``torchrun`` becomes ``sys.executable -m
    torch.distributed.run`` (what the ``torchrun`` script runs), so the interpreter and torch that
    run the ranks are the ones that launch them; every other word is the plan's."""
    if not argv or argv[0] != TORCHRUN:
        raise PlanError(f"the planned argv {list(argv)!r} does not start with {TORCHRUN!r}; plan again with "
                        "`python -m rl_engine plan`")
    return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]


def check_argv_plan(argv: Sequence[str], plan_path: str | os.PathLike[str]) -> None:
    """The planned argv runs the plan at ``plan_path`` (a plan copied elsewhere would run the original)."""
    runner = planned_runner_args(argv)
    named = runner[2] if len(runner) > 2 and runner[1] == RUNNER_MODULE else None
    if named is None or Path(named).resolve() != Path(plan_path).resolve():
        raise PlanError(f"the plan {plan_path} records an argv that runs the plan {named!r}, not itself (a plan "
                        f"moved or copied from elsewhere?); write the plan here with `python -m rl_engine plan`")


def planned_runner_args(argv: Sequence[str]) -> list[str]:
    """What follows torchrun's own flags in a planned argv (``-m rl_engine.campaign.run PLAN --tp T --cp C``)."""
    words = list(argv)
    if "-m" not in words:
        raise PlanError(f"the planned argv {words!r} runs no module; plan again with `python -m rl_engine plan`")
    return words[words.index("-m"):]


def build_plan(case: Case, topologies: Sequence[tuple[int, int]], plan_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The plan's JSON; ``plan_path`` is where it will be written, as the commands name it."""
    if not topologies:
        raise PlanError("no topology to plan; pass --topologies, or --tp and --cp")
    for tp, cp in topologies:
        case.check_topology(tp, cp)
    return {
        "schema_version": SCHEMA_VERSION,
        "case_id": case.case_id,
        "case": case.to_dict(),
        "topologies": [
            {"tp": tp, "cp": cp, "world_size": tp * cp, "output": Topology(tp, cp).report,
             "argv": launch_argv(plan_path, tp, cp), "command": launch_command(plan_path, tp, cp)}
            for tp, cp in topologies
        ],
    }


def load_plan(plan_path: str | os.PathLike[str]) -> tuple[Case, dict[str, Any]]:
    """A plan's case and JSON: strict JSON, schema-valid, and a case that keeps every rule."""
    try:
        plan = jsonio.load(plan_path)
        schemas.require_valid(plan, "plan", what=str(plan_path))
        return Case(**plan["case"]), plan
    except (jsonio.StrictJSONError, schemas.ArtifactSchemaError, OSError) as exc:
        raise PlanError(f"plan {plan_path}: {exc}; write it with `python -m rl_engine plan`") from None
    except CaseError as exc:
        raise PlanError(f"plan {plan_path}: {exc}") from None


def planned_entry(plan: dict[str, Any], tp: int, cp: int, plan_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The plan's entry for ``tp x cp``; refused, naming the planned ones, when there is none."""
    for entry in plan["topologies"]:
        if (entry["tp"], entry["cp"]) == (tp, cp):
            return entry
    planned = ", ".join(f"{e['tp']}x{e['cp']}" for e in plan["topologies"])
    raise PlanError(f"topology {tp}x{cp} is not in the plan {plan_path} (planned: {planned}); "
                    "run a planned topology or plan this one")


def report_path(plan_path: str | os.PathLike[str], entry: dict[str, Any]) -> Path:
    return Path(plan_path).parent / entry["output"]


def remove_outputs(output: str | os.PathLike[str]) -> None:
    """Remove a topology's report and raw tensors, so a failed run leaves nothing stale."""
    for path in (Path(output), *report_tensors(output).values()):
        path.unlink(missing_ok=True)


# ----- the verb -----------------------------------------------------------------------------
CASE_FLAGS: tuple[str, ...] = (
    "device", "dist_backend", "dtype", "backend", "real_vocab", "padded_vocab", "num_vocab_tiles",
    "batch", "seq", "prompt_tokens", "seed", "cp_layout", "logit_scale", "atol", "rtol",
    "threads_per_rank", "timeout_s", "temperature", "top_k", "top_p", "min_p",
)


def build_parser(prog: str = "python -m rl_engine plan") -> argparse.ArgumentParser:
    tolerances = ", ".join(f"{d} {DEFAULT_TOLERANCES[d][0]:g}" for d in DTYPES)
    p = argparse.ArgumentParser(
        prog=prog,
        description="Write plan.json for a case (a case file, or one flag per case field) and print "
                    "the torchrun command of every topology.",
    )
    p.add_argument("--plan", action="store_true", help="accepted for the guide's command (planning is all this does)")
    p.add_argument("--case", help="the case file (case.json) to plan: the workflow's way; no case flags with it")
    p.add_argument("--output", required=True, help="the plan to write (plan.json); reports land beside it")
    p.add_argument("--topologies", help="<TP>x<CP>,... at least 2 (default: the case file's, else "
                   + ",".join(f"{t}x{c}" for t, c in DEFAULT_TOPOLOGIES) + ")")
    p.add_argument("--tp", type=int, help="with --cp: plan one topology")
    p.add_argument("--cp", type=int, help="with --tp: plan one topology")
    flags = p.add_argument_group("case flags (the guide's command; without --case)")
    flags.add_argument("--device", choices=sorted(DEVICE_DIST_BACKENDS))
    flags.add_argument("--dist-backend", choices=sorted(set(DEVICE_DIST_BACKENDS.values())),
                       help="default: gloo on cpu, nccl on cuda")
    flags.add_argument("--dtype", choices=DTYPES)
    flags.add_argument("--backend", help="explicit backend id ('auto' is refused)")
    for name in ("real-vocab", "padded-vocab", "num-vocab-tiles", "batch", "seq", "prompt-tokens", "seed"):
        flags.add_argument(f"--{name}", type=int)
    flags.add_argument("--cp-layout", choices=CP_LAYOUTS, help="default contiguous")
    flags.add_argument("--logit-scale", type=float, help="default 1.0")
    flags.add_argument("--temperature", type=float,
                       help="default 1.0 (none): docs/arithmetic.md section 6 step 0, every logit times RN32(1/RN32(T))")
    flags.add_argument("--top-k", type=int, help="default 0 (off): docs/arithmetic.md section 13, processed logprobs")
    flags.add_argument("--top-p", type=float, help="default 1.0 (off): docs/arithmetic.md section 13")
    flags.add_argument("--min-p", type=float, help="default 0.0 (off): docs/arithmetic.md section 13")
    flags.add_argument("--atol", type=float, help=f"default by dtype: {tolerances}")
    flags.add_argument("--rtol", type=float, help="default 0")
    flags.add_argument("--threads-per-rank", type=int, help="default 1")
    flags.add_argument("--timeout-s", type=float, help="process-group timeout in seconds (default 120)")
    return p


def _topologies(args: argparse.Namespace, default: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    if args.topologies is not None:
        if args.tp is not None or args.cp is not None:
            raise PlanError("give either --topologies or --tp/--cp, not both")
        topologies = parse_topologies(args.topologies)
        check_matrix(topologies)  # a matrix is what the cross-topology check compares
        return topologies
    if (args.tp is None) != (args.cp is None):
        raise PlanError("--tp and --cp plan one topology together; give both or neither")
    if args.tp is not None:
        return ((args.tp, args.cp),)
    return default


def case_from_args(args: argparse.Namespace) -> tuple[Case, tuple[tuple[int, int], ...]]:
    given = {name: getattr(args, name) for name in CASE_FLAGS if getattr(args, name) is not None}
    if args.case is not None:
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise PlanError(f"--case {args.case} holds the whole case; drop {flags} (or drop --case)")
        case, topologies = load_case_file(args.case)
        return case, _topologies(args, topologies)
    missing = [name for name in ("device", "dtype", "backend", "real_vocab", "padded_vocab", "num_vocab_tiles",
                                 "batch", "seq", "prompt_tokens", "seed") if name not in given]
    if missing:
        raise PlanError("the case needs " + ", ".join("--" + m.replace("_", "-") for m in missing)
                        + " (or --case FILE)")
    return Case.create(**given), _topologies(args, DEFAULT_TOPOLOGIES)


def main(argv: list[str] | None = None, prog: str = "python -m rl_engine plan") -> int:
    """0: the plan was written; 2: refused (the reason on stderr, nothing written)."""
    try:
        args = build_parser(prog).parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    try:
        case, topologies = case_from_args(args)
        plan = build_plan(case, topologies, args.output)
        schemas.write_validated(args.output, plan, "plan")
    except (CaseError, schemas.ArtifactSchemaError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"# plan {plan['case_id']}: {len(plan['topologies'])} topologies -> {args.output}")
    for entry in plan["topologies"]:
        print(entry["command"])
    return 0


__all__ = [
    "PlanError",
    "RUNNER_MODULE",
    "build_plan",
    "launch_argv",
    "launch_command",
    "interpreter_argv",
    "check_argv_plan",
    "planned_runner_args",
    "load_plan",
    "main",
    "planned_entry",
    "report_path",
]
