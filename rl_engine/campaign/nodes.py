"""Topologies that span nodes: how ranks split over nodes, and the Slurm side of a launch.

A topology of ``TP*CP`` ranks takes ``ceil(ranks / ranks_per_node)`` nodes
(:class:`NodeLayout`), with the same number of ranks on every node (``torchrun`` starts
``--nproc-per-node`` ranks on each). On one node ``launch`` runs ``torchrun --standalone``
as it always did. On several, ``launch`` runs inside a Slurm job of that many nodes and starts
one ``torchrun`` per node under ``srun``: a c10d rendezvous on the first node's address
(Slurm's ``NodeAddr`` of the job's first node) and a port the first node's kernel hands out
for this job, so concurrent jobs never share one. :func:`node_name` is what a report records
per rank: Slurm's node name when the process runs in a Slurm step, else the hostname.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

SLURM_NODE_VAR = "SLURMD_NODENAME"
SCONTROL_TIMEOUT_S = 30.0
MAX_RANKS_PER_NODE = 64


class NodeLayoutError(ValueError):
    """Ranks that cannot be laid out on nodes; names the field, the value and the fix."""


class SlurmError(RuntimeError):
    """A multi-node launch that Slurm cannot serve; names what was asked, what was found, the fix."""


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NodeLayoutError(f"{name}={value!r} must be a positive integer")
    return value


def layout_problem(ranks: int, ranks_per_node: int) -> str | None:
    """Why ``ranks`` cannot run at ``ranks_per_node`` (None when they can)."""
    nodes = -(-ranks // ranks_per_node)
    if ranks % nodes == 0:
        return None
    return (
        f"{ranks} ranks at ranks_per_node={ranks_per_node} take ceil({ranks}/{ranks_per_node})={nodes} "
        f"nodes, over which {ranks} ranks do not split evenly (torchrun starts the same number of "
        "ranks on every node); use a ranks_per_node at which they do"
    )


def fitting_ranks_per_node(rank_counts: Sequence[int]) -> list[int]:
    """Every ``ranks_per_node`` up to the largest count at which each count splits evenly."""
    top = min(max(rank_counts), MAX_RANKS_PER_NODE)
    return [r for r in range(1, top + 1) if all(n % -(-n // r) == 0 for n in rank_counts)]


@dataclass(frozen=True)
class NodeLayout:
    """``ranks`` ranks at most ``ranks_per_node`` per node: ``nodes`` nodes of ``ranks_on_node``."""

    ranks: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        _positive_int("ranks", self.ranks)
        _positive_int("ranks_per_node", self.ranks_per_node)
        if self.ranks_per_node > MAX_RANKS_PER_NODE:
            raise NodeLayoutError(
                f"ranks_per_node={self.ranks_per_node} must be <= {MAX_RANKS_PER_NODE}; use the "
                "number of GPUs (cuda) or cores (cpu) of one node"
            )
        problem = layout_problem(self.ranks, self.ranks_per_node)
        if problem is not None:
            raise NodeLayoutError(f"{problem}, one of {fitting_ranks_per_node([self.ranks])}")

    @property
    def nodes(self) -> int:
        return -(-self.ranks // self.ranks_per_node)

    @property
    def ranks_on_node(self) -> int:
        return self.ranks // self.nodes


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """Slurm's name of this node (``SLURMD_NODENAME``, set in every Slurm step), else the hostname."""
    env = os.environ if environ is None else environ
    name = env.get(SLURM_NODE_VAR, "").strip()
    return name or socket.gethostname()


# ----- Slurm: the job this launch runs in ----------------------------------------------------
def _scontrol(*args: str) -> str:
    cmd = ["scontrol", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"`{' '.join(cmd)}` failed: {exc}; is this a Slurm node with slurm-client?") from None
    if done.returncode != 0:
        raise SlurmError(f"`{' '.join(cmd)}` exited with {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _fields(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of one ``scontrol show -o`` line (values hold no spaces we read)."""
    return dict(m.groups() for m in re.finditer(r"(\w[\w/:]*)=(\S*)", text))


@dataclass(frozen=True)
class SlurmJob:
    """The Slurm job a multi-node launch runs in: its id and its nodes, first node first."""

    job_id: str
    nodes: tuple[str, ...]

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[0-9]+(_[0-9]+)?", self.job_id):
            raise SlurmError(f"SLURM_JOB_ID={self.job_id!r} is not a Slurm job id")
        if not self.nodes:
            raise SlurmError(f"Slurm job {self.job_id} has no nodes")

    @classmethod
    def current(cls, environ: Mapping[str, str] | None = None) -> "SlurmJob":
        """The job named by ``SLURM_JOB_ID``, its node list read from ``scontrol``."""
        env = os.environ if environ is None else environ
        job_id = env.get("SLURM_JOB_ID", "").strip()
        if not job_id:
            raise SlurmError(
                "SLURM_JOB_ID is not set: a topology that spans nodes runs only inside a Slurm job "
                "of that many nodes; run the workflow with --workflow-profile workflow/profiles/slurm, "
                "or raise ranks_per_node to the topology's ranks to run it on this one machine"
            )
        info = _fields(_scontrol("show", "job", "-o", job_id))
        nodelist = info.get("NodeList", "")
        if not nodelist or nodelist == "(null)":
            raise SlurmError(f"Slurm job {job_id} has no NodeList yet (scontrol show job {job_id})")
        names = tuple(_scontrol("show", "hostnames", nodelist).split())
        return cls(job_id, names)

    def check_nodes(self, wanted: int) -> None:
        if len(self.nodes) != wanted:
            raise SlurmError(
                f"Slurm job {self.job_id} holds {len(self.nodes)} node(s) ({','.join(self.nodes)}) but the "
                f"topology needs {wanted}: the topology rule's `nodes` resource and launch --nodes must agree"
            )


def node_address(name: str) -> str:
    """Slurm's ``NodeAddr`` of node ``name`` (what its peers reach it at)."""
    addr = _fields(_scontrol("show", "node", "-o", name)).get("NodeAddr", "")
    if not addr:
        raise SlurmError(f"scontrol shows no NodeAddr for node {name!r}")
    return addr


def free_port(address: str) -> int:
    """A TCP port free on ``address`` now (the kernel's choice), for one job's rendezvous."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


# ----- argv ----------------------------------------------------------------------------------
def node_torchrun_argv(runner_args: Sequence[str], layout: NodeLayout, endpoint: str, rdzv_id: str,
                       node_rank: int) -> list[str]:
    """One node's ``torchrun``: ``ranks_on_node`` ranks joining a c10d rendezvous at ``endpoint``.

    The first node (``node_rank`` 0) hosts the rendezvous store (``is_host=1``); the others
    only connect to it, so nothing depends on guessing which node owns the address.
    ``runner_args`` is what follows torchrun's own flags (:func:`rl_engine.campaign.plan.runner_args`).
    """
    if not 0 <= node_rank < layout.nodes:
        raise SlurmError(f"node rank {node_rank} must lie in [0, {layout.nodes})")
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={layout.nodes}",
        f"--nproc-per-node={layout.ranks_on_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf=is_host={1 if node_rank == 0 else 0}",
        "--max-restarts=0",
        *runner_args,
    ]


def srun_argv(layout: NodeLayout, job: SlurmJob, cpus_per_task: int, gpus_per_node: int,
              node_command: Sequence[str]) -> list[str]:
    """``srun`` of ``node_command`` once on every node of ``job``; a task that fails ends the step.

    The step asks for its CPUs (and GPUs) explicitly: inside the executor's job step the
    allocation's ``SLURM_*`` defaults are gone, and srun would otherwise give each task one CPU.
    """
    argv = [
        "srun", f"--jobid={job.job_id}", f"--nodes={layout.nodes}", f"--ntasks={layout.nodes}",
        "--ntasks-per-node=1", f"--cpus-per-task={_positive_int('cpus_per_task', cpus_per_task)}",
        "--kill-on-bad-exit=1",
    ]
    if gpus_per_node:
        argv.append(f"--gres=gpu:{_positive_int('gpus_per_node', gpus_per_node)}")
    return [*argv, *node_command]


__all__ = [
    "MAX_RANKS_PER_NODE",
    "NodeLayout",
    "NodeLayoutError",
    "SlurmError",
    "SlurmJob",
    "fitting_ranks_per_node",
    "free_port",
    "layout_problem",
    "node_address",
    "node_name",
    "node_torchrun_argv",
    "srun_argv",
]
