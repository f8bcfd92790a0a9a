"""GPU accounting for the topology rule: one GPU per rank on ``device: cuda``, none on the CPU.

Each topology job claims ``gpus = tp * cp`` (:func:`topology_gpus`) when the campaign runs on
CUDA. Snakemake only limits a resource that the run provides, so :func:`register_gpus` provides
``gpus`` = the GPUs this machine shows (``torch.cuda.device_count()``, which honours
``CUDA_VISIBLE_DEVICES``) unless ``--resources gpus=N`` (command line or profile) already set it.
With ``--cores 8`` on a node with 8 GPUs, TP=4 x CP=2 then never runs beside another topology,
and two 4-rank topologies run together. A topology that needs more GPUs than provided is refused
by Snakemake before any job starts (it names the rule and the resource).
"""

from __future__ import annotations

from typing import Any

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


__all__ = ["GPUS", "machine_gpus", "register_gpus", "topology_gpus"]
