"""``python -m rl_engine launch --plan RUN/plan.json --tp T --cp C --timeout-s S [--log FILE]``.

Runs one planned topology (its ``argv`` from the plan) as a subprocess in its own process
group, with ``OMP_NUM_THREADS`` set to the case's threads per rank, and turns the outcome
into an exit code a workflow can act on:

* ``0``: the runner succeeded and its report says ``passed``;
* ``1``: a report was written and failed acceptance (kept for the evidence);
* ``2``: no valid report: the plan or topology is bad, the runner failed, or the report is
  missing, unreadable, or inconsistent with the runner's exit status;
* ``124``: the time limit passed; the whole process group was killed.

``torchrun`` folds every failing worker's exit code into 1, so the distinction between 1
and 2 is taken from the artifacts: a readable report with ``passed=false`` is 1. Before
starting, the topology's report and raw tensors are removed, and after any outcome other
than 0 or 1 they are removed again, so a failure never leaves a stale or partial output.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, TextIO

from rl_engine import jsonio, schemas
from rl_engine.testing.distributed_logprob_comparison import (
    EXIT_FAILED,
    EXIT_NO_REPORT,
    EXIT_PASSED,
    remove_outputs,
)

EXIT_TIMEOUT = 124
KILL_GRACE_S = 5.0


class LaunchError(ValueError):
    """A launch that cannot start; names the field, the value and the fix."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rl_engine launch", description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="plan.json written by the plan verb")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--cp", type=int, required=True)
    p.add_argument("--timeout-s", type=float, required=True, help="wall-clock limit of the run")
    p.add_argument("--log", help="file for the runner's stdout and stderr (default: inherit)")
    return p


def planned_topology(plan_path: str, tp: int, cp: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plan's case and its entry for ``tp x cp``; the plan must match its schema."""
    plan = jsonio.load(plan_path)
    problems = schemas.errors(plan, "plan")
    if problems:
        raise LaunchError(f"{plan_path} does not match schemas/plan.schema.json: " + "; ".join(problems))
    for entry in plan["topologies"]:
        if (entry["tp"], entry["cp"]) == (tp, cp):
            return plan["case"], entry
    listed = ", ".join(f"{e['tp']}x{e['cp']}" for e in plan["topologies"])
    raise LaunchError(f"topology {tp}x{cp} is not in {plan_path} (planned: {listed}); re-plan or pick one of those")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the whole process group, then SIGKILL what is left after a grace period."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            if sig == signal.SIGTERM:
                os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group, if any
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def report_verdict(output: str) -> bool | None:
    """``passed`` of the report at ``output``; None when it is missing or not a valid report."""
    if not Path(output).is_file():
        return None
    try:
        report = jsonio.load(output)
    except (OSError, jsonio.StrictJSONError):
        return None
    if schemas.errors(report, "report"):
        return None
    return bool(report["passed"])


def launch(plan_path: str, tp: int, cp: int, timeout_s: float, log: TextIO | None) -> int:
    if not timeout_s > 0:
        raise LaunchError(f"--timeout-s={timeout_s} must be > 0")
    case, entry = planned_topology(plan_path, tp, cp)
    output = entry["output"]
    remove_outputs(output)
    env = {**os.environ, "OMP_NUM_THREADS": str(case["threads_per_rank"])}
    stream = log if log is not None else None
    proc = subprocess.Popen(entry["argv"], env=env, stdout=stream, stderr=subprocess.STDOUT if stream else None,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        remove_outputs(output)
        print(f"error: topology {tp}x{cp} exceeded --timeout-s={timeout_s:g}; its process group "
              "was killed and its outputs removed", file=sys.stderr)
        return EXIT_TIMEOUT
    except BaseException:
        _kill_group(proc)
        remove_outputs(output)
        raise
    verdict = report_verdict(output)
    if rc == 0 and verdict is True:
        return EXIT_PASSED
    if verdict is False:
        print(f"topology {tp}x{cp}: report written and failed acceptance -> {output}", file=sys.stderr)
        return EXIT_FAILED
    remove_outputs(output)
    why = "no valid report was written" if verdict is None else "the runner failed after writing a passing report"
    print(f"error: topology {tp}x{cp}: runner exited with {rc}; {why}; outputs removed", file=sys.stderr)
    return EXIT_NO_REPORT


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_NO_REPORT
    try:
        if args.log:
            Path(args.log).parent.mkdir(parents=True, exist_ok=True)
            with open(args.log, "w", encoding="utf-8") as log:
                return launch(args.plan, args.tp, args.cp, args.timeout_s, log)
        return launch(args.plan, args.tp, args.cp, args.timeout_s, None)
    except (LaunchError, OSError, jsonio.StrictJSONError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NO_REPORT


if __name__ == "__main__":
    sys.exit(main())
