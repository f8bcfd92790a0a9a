"""``python -m rl_engine launch --plan RUN/plan.json --tp T --cp C --timeout-s S [--log FILE]``.

Runs one planned topology (the plan's torchrun command, through this interpreter) as a subprocess in its own process
group, with ``OMP_NUM_THREADS`` set to the case's threads per rank, and turns the outcome
into an exit code a workflow can act on:

* ``0``: the runner succeeded and its report says ``passed``;
* ``1``: a report was written and failed acceptance (kept for the evidence);
* ``2``: no valid report: the plan or topology is bad, the runner failed, or the report is
  missing, unreadable, or inconsistent with the runner's exit status;
* ``124``: the time limit passed; the runner and every process it started were killed;
* ``128 + N``: ``launch`` received signal ``N`` (SIGTERM, SIGHUP or SIGINT: a cancelled
  Snakemake job, a CI time limit, a closed terminal); the runner and every process it
  started were killed before ``launch`` exited.

``torchrun`` folds every failing worker's exit code into 1, so the distinction between 1
and 2 is taken from the artifacts: a readable report with ``passed=false`` is 1. Before
starting, the topology's report and raw tensors are removed, and after any outcome other
than 0 or 1 they are removed again, so a failure never leaves a stale or partial output.
``torchrun`` starts every rank in a session of its own, so stopping means the whole tree
(:func:`rl_engine.proctree.stop_tree`), not only torchrun's process group.

Topologies that span nodes (``--ranks-per-node R`` below the topology's ranks; see
:mod:`rl_engine.campaign.nodes`) run only inside a Slurm job of that many nodes. ``launch``
then starts ``srun`` with one task per node, each task a ``launch`` of that node's part (the
internal ``--rdzv-endpoint``/``--rdzv-id`` flags): one ``torchrun`` of the node's ranks joining
a c10d rendezvous on the first node. Every node's ``launch`` keeps the guarantees above for
its own tree (time limit, stop signals, exit codes 0, 2, 124 and 128+N; it also stops on
SIGUSR1, which is how the outer ``launch`` stops it through srun); a node whose ranks fail
fails its task, ``srun --kill-on-bad-exit`` ends the other nodes' tasks, and the outer
``launch`` judges the report and removes the outputs exactly as on one node.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, TextIO

from rl_engine import jsonio, schemas
from rl_engine.campaign.case import CaseError
from rl_engine.campaign.nodes import (
    NodeLayout,
    NodeLayoutError,
    SlurmError,
    SlurmJob,
    free_port,
    node_address,
    node_name,
    node_torchrun_argv,
    srun_argv,
)
from rl_engine.campaign.plan import (
    EXIT_FAILED,
    EXIT_NO_REPORT,
    EXIT_PASSED,
    check_argv_plan,
    interpreter_argv,
    load_plan,
    planned_entry,
    planned_runner_args,
    remove_outputs,
    report_path,
)
from rl_engine.proctree import (
    EXIT_TIMEOUT,
    KILL_GRACE_S,
    STOP_SIGNALS,
    StopSignals,
    SupervisionError,
    stop_tree,
    supervise,
)
from rl_engine.rundir import Topology

# srun turns SIGTERM, SIGHUP and SIGINT into an immediate SIGKILL of the whole step, which no
# node's launch can catch, but forwards SIGUSR1 to every task. So a multi-node launch stops its
# srun with SIGUSR1 first, each node's launch (which also stops on SIGUSR1) kills its own tree
# and exits, and srun is killed outright only after SRUN_GRACE_S.
NODE_STOP_SIGNAL = signal.SIGUSR1
SRUN_GRACE_S = 30.0


class LaunchError(ValueError):
    """A launch that cannot start; names the field, the value and the fix."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rl_engine launch",
        description="Run one planned topology (its torchrun command from plan.json) under a wall-clock limit, "
                    "killing the runner and its ranks on the limit or a signal. Exit 0 passed, 1 failed "
                    "acceptance (report kept), 2 no valid report (outputs removed), 124 time limit, 128+N signal N.")
    p.add_argument("--plan", required=True, help="plan.json written by the plan verb")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--cp", type=int, required=True)
    p.add_argument("--timeout-s", type=float, required=True, help="wall-clock limit of the run")
    p.add_argument("--log", help="file for the runner's stdout and stderr (default: inherit)")
    p.add_argument("--ranks-per-node", type=int,
                   help="most ranks per node (default: all on one node); fewer than TP*CP needs a Slurm job")
    p.add_argument("--rdzv-endpoint", help=argparse.SUPPRESS)  # internal: one node's part, under srun
    p.add_argument("--rdzv-id", help=argparse.SUPPRESS)
    return p


def planned_topology(plan_path: str, tp: int, cp: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plan's case and its entry for ``tp x cp``; the plan must match its schema and rules."""
    try:
        case, plan = load_plan(plan_path)
        entry = planned_entry(plan, tp, cp, plan_path)
        check_argv_plan(entry["argv"], plan_path)
        return case.to_dict(), entry
    except CaseError as exc:
        raise LaunchError(str(exc)) from None


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


def _stopped(tp: int, cp: int, output: str, signum: int) -> int:
    remove_outputs(output)
    name = signal.Signals(signum).name
    print(f"error: topology {tp}x{cp}: launch received {name}; the runner and its ranks were "
          "killed and its outputs removed", file=sys.stderr)
    return 128 + signum


def _stop_runner(proc: subprocess.Popen[bytes], forward: signal.Signals | None) -> None:
    """Stop the runner's tree; with ``forward``, first send it that signal and give it SRUN_GRACE_S."""
    if forward is not None and proc.poll() is None:
        try:
            os.kill(proc.pid, forward)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=SRUN_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    stop_tree(proc, KILL_GRACE_S)


def _outcome(proc: subprocess.Popen[bytes], tp: int, cp: int, output: str, timeout_s: float,
             stops: StopSignals, forward: signal.Signals | None = None) -> int:
    """The exit code of a started runner; every path that does not return 0 or 1 cleans up."""
    try:
        ended = supervise(proc, timeout_s, stops, lambda: _stop_runner(proc, forward))
    except BaseException:
        remove_outputs(output)
        raise
    if ended.signum is not None:
        return _stopped(tp, cp, output, ended.signum)
    if ended.timed_out:
        remove_outputs(output)
        print(f"error: topology {tp}x{cp} exceeded --timeout-s={timeout_s:g}; the runner and "
              "its ranks were killed and its outputs removed", file=sys.stderr)
        return EXIT_TIMEOUT
    rc, verdict = ended.code, report_verdict(output)
    if rc == 0 and verdict is True:
        return EXIT_PASSED
    if verdict is False:
        print(f"topology {tp}x{cp}: report written and failed acceptance -> {output}", file=sys.stderr)
        return EXIT_FAILED
    remove_outputs(output)
    why = "no valid report was written" if verdict is None else "the runner failed after writing a passing report"
    print(f"error: topology {tp}x{cp}: runner exited with {rc}; {why}; outputs removed", file=sys.stderr)
    return EXIT_NO_REPORT


def _layout(tp: int, cp: int, ranks_per_node: int | None) -> NodeLayout:
    try:
        return NodeLayout(tp * cp, tp * cp if ranks_per_node is None else ranks_per_node)
    except NodeLayoutError as exc:
        raise LaunchError(f"--ranks-per-node={ranks_per_node} for topology {tp}x{cp}: {exc}") from None


def _job_argv(plan_path: str, tp: int, cp: int, timeout_s: float, case: dict[str, Any],
              layout: NodeLayout, log: TextIO | None) -> list[str]:
    """The ``srun`` that starts every node's part of a topology spanning ``layout.nodes`` nodes."""
    job = SlurmJob.current()
    job.check_nodes(layout.nodes)
    address = node_address(job.nodes[0])
    endpoint = f"{address}:{free_port(address)}"
    node_command = [
        sys.executable, "-m", "rl_engine", "launch", "--plan", str(Path(plan_path).resolve()),
        "--tp", str(tp), "--cp", str(cp), "--timeout-s", repr(float(timeout_s)),
        "--ranks-per-node", str(layout.ranks_per_node),
        "--rdzv-endpoint", endpoint, "--rdzv-id", f"rl-engine-{job.job_id}-{Topology(tp, cp).stem}",
    ]
    gpus = layout.ranks_on_node if case["device"] == "cuda" else 0
    argv = srun_argv(layout, job, layout.ranks_on_node * case["threads_per_rank"], gpus, node_command)
    print(f"launch: topology {tp}x{cp}: {layout.ranks} ranks on {layout.nodes} nodes "
          f"({','.join(job.nodes)}) x {layout.ranks_on_node}, c10d rendezvous at {endpoint}; "
          f"Slurm job {job.job_id}\n{' '.join(argv)}", file=log or sys.stderr, flush=True)
    return argv


def _node_rank(environ: Mapping[str, str]) -> int:
    raw = environ.get("SLURM_NODEID", "")
    if not raw.isdigit():
        raise LaunchError(
            f"SLURM_NODEID={raw!r}: --rdzv-endpoint runs one node's part of a multi-node launch "
            "and only under srun (launch starts it itself); run launch without it"
        )
    return int(raw)


def _node_part(entry: dict[str, Any], case: dict[str, Any], tp: int, cp: int, timeout_s: float,
               log: TextIO | None, layout: NodeLayout, endpoint: str, rdzv_id: str) -> int:
    """This node's ``torchrun`` of a multi-node topology: 0, 2 (its ranks failed), 124 or 128+N.

    The outputs belong to the outer ``launch``, which judges and removes them; this part only
    answers for its own tree.
    """
    node_rank = _node_rank(os.environ)
    argv = node_torchrun_argv(planned_runner_args(entry["argv"]), layout, endpoint, rdzv_id, node_rank)
    where = f"topology {tp}x{cp}, node {node_name()} (node rank {node_rank} of {layout.nodes})"
    with StopSignals(STOP_SIGNALS + (NODE_STOP_SIGNAL,)) as stops:
        if stops.received:
            return 128 + stops.received[0]
        env = {**os.environ, "OMP_NUM_THREADS": str(case["threads_per_rank"])}
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT if log else None,
                                start_new_session=True)
        ended = supervise(proc, timeout_s, stops, lambda: stop_tree(proc, KILL_GRACE_S))
        if ended.timed_out:
            print(f"error: {where} exceeded --timeout-s={timeout_s:g}; its torchrun and ranks were killed",
                  file=sys.stderr)
            return EXIT_TIMEOUT
        if ended.signum is not None:
            print(f"error: {where}: received {signal.Signals(ended.signum).name}; its torchrun and ranks "
                  "were killed", file=sys.stderr)
            return 128 + ended.signum
        if stops.received:
            return 128 + stops.received[0]
    rc = ended.code
    if rc == 0:
        return EXIT_PASSED
    print(f"error: {where}: torchrun exited with {rc}", file=sys.stderr)
    return EXIT_NO_REPORT


def launch(plan_path: str, tp: int, cp: int, timeout_s: float, log: TextIO | None,
           ranks_per_node: int | None = None, rendezvous: tuple[str, str] | None = None) -> int:
    """Run one planned topology; see the module docstring for the exit codes.

    SIGTERM, SIGHUP and SIGINT are handled from before the runner starts until ``launch``
    returns: the runner's whole tree is killed, the topology's outputs are removed and the
    exit code is ``128 + signal``, whatever the run's own outcome would have been.
    ``ranks_per_node`` below ``tp * cp`` spreads the ranks over nodes of a Slurm job;
    ``rendezvous`` (endpoint, id) runs one node's part of such a launch.
    """
    if not timeout_s > 0:
        raise LaunchError(f"--timeout-s={timeout_s} must be > 0")
    case, entry = planned_topology(plan_path, tp, cp)
    layout = _layout(tp, cp, ranks_per_node)
    if rendezvous is not None:
        if layout.nodes == 1:
            raise LaunchError(f"--rdzv-endpoint is for topologies that span nodes; {tp}x{cp} at "
                              f"--ranks-per-node={layout.ranks_per_node} runs on one node")
        return _node_part(entry, case, tp, cp, timeout_s, log, layout, *rendezvous)
    output = report_path(plan_path, entry)
    with StopSignals() as stops:
        remove_outputs(output)
        if stops.received:
            return _stopped(tp, cp, output, stops.received[0])
        argv, forward = interpreter_argv(entry["argv"]), None  # the plan's argv, by this interpreter
        if layout.nodes > 1:
            argv, forward = _job_argv(plan_path, tp, cp, timeout_s, case, layout, log), NODE_STOP_SIGNAL
        env = {**os.environ, "OMP_NUM_THREADS": str(case["threads_per_rank"])}
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT if log else None,
                                start_new_session=True)
        code = _outcome(proc, tp, cp, output, timeout_s, stops, forward)
        if stops.received and code != 128 + stops.received[0]:
            # a stop that came while the outcome was being settled: the job was cancelled
            return _stopped(tp, cp, output, stops.received[0])
        return code


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_NO_REPORT
    if (args.rdzv_endpoint is None) != (args.rdzv_id is None):
        print("error: --rdzv-endpoint and --rdzv-id go together (one node's part of a multi-node launch)",
              file=sys.stderr)
        return EXIT_NO_REPORT
    rendezvous = None if args.rdzv_endpoint is None else (args.rdzv_endpoint, args.rdzv_id)
    try:
        if args.log:
            Path(args.log).parent.mkdir(parents=True, exist_ok=True)
            with open(args.log, "w", encoding="utf-8") as log:
                return launch(args.plan, args.tp, args.cp, args.timeout_s, log, args.ranks_per_node, rendezvous)
        return launch(args.plan, args.tp, args.cp, args.timeout_s, None, args.ranks_per_node, rendezvous)
    except (LaunchError, SlurmError, SupervisionError, OSError, jsonio.StrictJSONError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NO_REPORT


if __name__ == "__main__":
    sys.exit(main())
