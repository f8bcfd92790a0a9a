"""What a topology job asks a cluster for (:func:`topology_resources`: nodes, tasks, memory, time
limit, GPUs), and the GPU accounting of a local run (:func:`provide_gpus`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from rl_engine.campaign.nodes import NodeLayout
from rl_engine.workflow.config import WorkflowConfigError, config_topologies

RUNTIME_MARGIN_MIN = 5  # a topology job's Slurm time limit beyond topology_timeout_s
MEM_MB_PER_RANK = 2000  # a topology job's memory per node: this per rank on the node, plus the launchers'
MEM_MB_LAUNCH = 1000


def topology_resources(config: dict[str, Any], tp: int, cp: int) -> dict[str, Any]:
    """What the topology rule of ``tp x cp`` asks a cluster for (Snakemake resources).

    ``nodes`` from ``ranks_per_node``; one task per node (each runs that node's torchrun);
    ``cpus_per_task`` the node's ranks x ``threads_per_rank``; ``mem_mb`` (per node)
    :data:`MEM_MB_PER_RANK` per rank on the node plus :data:`MEM_MB_LAUNCH`; ``runtime`` (minutes) the
    topology's time limit plus :data:`RUNTIME_MARGIN_MIN` for start-up and clean-up, so
    ``launch``'s own limit always fires first; ``mpi="srun"`` when it spans nodes (the
    executor then leaves the srun to the rule); on cuda ``gres=gpu:<ranks on a node>``. One
    node keeps ``tasks=1`` and no ``mpi``: Snakemake's Slurm executor refuses MPI with one task.
    """
    layout = NodeLayout(tp * cp, config["ranks_per_node"])
    resources: dict[str, Any] = {
        "nodes": layout.nodes,
        "tasks": layout.nodes,
        "cpus_per_task": layout.ranks_on_node * config["threads_per_rank"],
        "mem_mb": layout.ranks_on_node * MEM_MB_PER_RANK + MEM_MB_LAUNCH,
        "runtime": math.ceil(config["topology_timeout_s"] / 60) + RUNTIME_MARGIN_MIN,
        "mpi": "srun" if layout.nodes > 1 else None,
        "gres": f"gpu:{layout.ranks_on_node}" if config["device"] == "cuda" else None,
        # with gres the executor would turn `tasks` into --ntasks-per-gpu; 0 keeps it out
        "tasks_per_gpu": 0 if config["device"] == "cuda" else None,
    }
    return resources


TOPOLOGY_RESOURCES = ("nodes", "tasks", "cpus_per_task", "mem_mb", "runtime", "mpi", "gres", "tasks_per_gpu")


def topology_resource_functions(config: dict[str, Any]) -> dict[str, Callable[[Any], Any]]:
    """The topology rule's ``resources:``, one function of the wildcards per resource."""

    def resource(key: str) -> Callable[[Any], Any]:
        return lambda wildcards: topology_resources(config, int(wildcards.tp), int(wildcards.cp))[key]

    return {key: resource(key) for key in TOPOLOGY_RESOURCES}


# ----- GPU accounting ----------------------------------------------------------------------
# GPU accounting for the topology rule: one GPU per rank on ``device: cuda``, none on the CPU.
#
# Each topology job claims ``gpus = tp * cp`` (:func:`topology_gpus`) when the campaign runs on
# CUDA. Snakemake only limits a resource that the run provides, so :func:`register_gpus` provides
# ``gpus`` = the GPUs this machine shows (``torch.cuda.device_count()``, which honours
# ``CUDA_VISIBLE_DEVICES``) unless ``--resources gpus=N`` (command line or profile) already set it.
# With ``--cores 8`` on a node with 8 GPUs, TP=4 x CP=2 then never runs beside another topology,
# and two 4-rank topologies run together. Snakemake scales a claim larger than what is provided
# down to it and starts the job anyway, so a topology with more ranks than GPUs would start ranks
# without a GPU: :func:`provide_gpus` refuses it when the workflow is parsed, naming the topology.

GPUS = "gpus"


def topology_gpus(device: str, tp: int, cp: int) -> int:
    """GPUs one ``tp x cp`` topology job occupies: one per rank on cuda, none on cpu."""
    return tp * cp if device == "cuda" else 0


def machine_gpus() -> int:
    """GPUs this process can use (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def register_gpus(workflow: Any, device: str) -> int | None:
    """Provide ``gpus`` to Snakemake's scheduler for a cuda campaign run on this machine.

    Returns the registered count, or None when nothing was registered: a cpu campaign (no job
    claims a GPU) or a run whose ``--resources`` (command line or profile) already names
    ``gpus``. Snakemake picks its executor after it parses the workflow, so this cannot tell a
    cluster run from a local one: a cluster profile sets ``resources: [gpus=N]`` itself.
    """
    if device != "cuda" or GPUS in workflow.global_resources:
        return None
    count = machine_gpus()
    workflow.register_resource(GPUS, count)
    return count


def provided_gpus(workflow: Any) -> int:
    """The ``gpus`` Snakemake provides (a ``Resource`` holds it in ``.value``)."""
    held = workflow.global_resources[GPUS]
    value = held.value if hasattr(held, "value") else held
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkflowConfigError(f"--resources gpus={value!r} must be an integer number of GPUs")
    return value


def provide_gpus(workflow: Any, config: dict[str, Any]) -> int | None:
    """:func:`register_gpus`, then refuse a cuda topology with more ranks than the GPUs provided.

    Returns the GPUs provided on cuda (None on cpu). Raises :class:`WorkflowConfigError` naming
    each topology that needs more.
    """
    registered = register_gpus(workflow, config["device"])
    if config["device"] != "cuda":
        return None
    provided = provided_gpus(workflow)
    source = ("torch.cuda.device_count() on this machine" if registered is not None
              else "--resources gpus (command line or profile)")
    problems = [
        f"config key 'topologies[{index}]' has value {config['topologies'][index]!r}: needs "
        f"{topology_gpus('cuda', topo.tp, topo.cp)} GPUs (one per rank) but {provided} are provided ({source}); "
        "Snakemake would scale the claim down and start ranks without a GPU: drop the topology, run on a node "
        "with that many GPUs, or set --resources gpus=N for a cluster"
        for index, topo in enumerate(config_topologies(config))
        if topology_gpus("cuda", topo.tp, topo.cp) > provided
    ]
    if problems:
        raise WorkflowConfigError("; ".join(problems))
    return provided
