"""The (dp, cp, tp) mesh built from torchrun's environment.

Like torchtitan's ``ParallelDims``: one small validated dataclass holds the degrees and
builds a named :class:`~torch.distributed.device_mesh.DeviceMesh`. TP is the fastest
dimension: ``rank = (dp_rank * cp + cp_rank) * tp + tp_rank``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from rl_engine.distributed.bounds import CP_LAYOUTS
from rl_engine.tables import DEFAULT_PG_TIMEOUT_S, DEVICE_DIST_BACKENDS, MAX_PG_TIMEOUT_S
from rl_engine.validators import finite_float, shown


class MeshError(RuntimeError):
    """A mesh that cannot be built as asked; the message names the field, value and fix."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data, context and tensor parallelism and the world they must fill."""

    dp: int
    cp: int
    tp: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "tp", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MeshError(f"{name}={value!r} must be a positive integer")
        if self.dp * self.cp * self.tp != self.world_size:
            raise MeshError(
                f"WORLD_SIZE={self.world_size} disagrees with dp*cp*tp="
                f"{self.dp}*{self.cp}*{self.tp}={self.dp * self.cp * self.tp}; launch "
                f"torchrun with --nproc-per-node={self.dp * self.cp * self.tp}"
            )

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, cp_rank, tp_rank)`` of a global rank (TP fastest)."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank={rank} must lie in [0, {self.world_size})")
        dp_cp, tp_rank = divmod(rank, self.tp)
        dp_rank, cp_rank = divmod(dp_cp, self.cp)
        return dp_rank, cp_rank, tp_rank

    def rank_of(self, dp_rank: int, cp_rank: int, tp_rank: int) -> int:
        """Global rank of mesh coordinates (inverse of :meth:`coords`)."""
        for name, value, size in (("dp_rank", dp_rank, self.dp), ("cp_rank", cp_rank, self.cp),
                                  ("tp_rank", tp_rank, self.tp)):
            if not 0 <= value < size:
                raise MeshError(f"{name}={value} must lie in [0, {size})")
        return (dp_rank * self.cp + cp_rank) * self.tp + tp_rank


@dataclass(frozen=True)
class LaunchEnv:
    """What torchrun put in the environment."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "LaunchEnv":
        env = os.environ if environ is None else environ
        values = {}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            raw = env.get(key)
            if raw is None:
                raise MeshError(
                    f"environment variable {key} is not set; launch with torchrun "
                    "(e.g. torchrun --standalone --nproc-per-node=N ...)"
                )
            try:
                values[key] = int(raw)
            except ValueError:
                raise MeshError(f"environment variable {key}={raw!r} is not an integer") from None
        return cls(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise MeshError(f"WORLD_SIZE={self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise MeshError(
                f"RANK={self.rank} must lie in [0, WORLD_SIZE={self.world_size}); check the "
                "launcher's environment"
            )
        if self.local_rank < 0:
            raise MeshError(f"LOCAL_RANK={self.local_rank} must be >= 0")


@dataclass
class Mesh:
    """An initialised mesh: degrees, this rank's coordinates, the device mesh and groups."""

    dims: ParallelDims
    rank: int
    device: torch.device
    device_mesh: Any

    @property
    def coords(self) -> tuple[int, int, int]:
        return self.dims.coords(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.coords[0]

    @property
    def cp_rank(self) -> int:
        return self.coords[1]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]

    @property
    def tp_group(self) -> Any:
        return self.device_mesh.get_group("tp")

    @property
    def cp_group(self) -> Any:
        return self.device_mesh.get_group("cp")

    @property
    def dp_group(self) -> Any:
        return self.device_mesh.get_group("dp")

    @property
    def world_group(self) -> Any:
        return dist.group.WORLD


def group_geometry(group: Any) -> tuple[int, int]:
    """``(size, rank)`` of a process group; ``None`` stands for a single-rank group."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def check_device(device: str) -> str:
    """The distributed backend for ``device``; CUDA must really be there (no fallback)."""
    if device not in DEVICE_DIST_BACKENDS:
        raise MeshError(f"device={device!r} is unknown; use one of {list(DEVICE_DIST_BACKENDS)}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise MeshError(
                "device='cuda' was requested but CUDA is not available; nothing falls back "
                "to the CPU: run on a GPU machine or set device: cpu"
            )
        if not dist.is_nccl_available():
            raise MeshError("device='cuda' needs NCCL, which this torch build lacks")
    elif not dist.is_gloo_available():
        raise MeshError("device='cpu' needs gloo, which this torch build lacks")
    return DEVICE_DIST_BACKENDS[device]


def init_mesh(
    tp: int,
    cp: int = 1,
    dp: int = 1,
    device: str = "cpu",
    timeout_s: float = DEFAULT_PG_TIMEOUT_S,
    environ: Mapping[str, str] | None = None,
) -> Mesh:
    """Validate the launch against the degrees, then initialise the process group and mesh.

    Everything is checked before the first collective: a WORLD_SIZE that disagrees with
    ``dp*cp*tp`` raises on every rank without touching the network.
    """
    launch = LaunchEnv.from_environ(environ)
    dims = ParallelDims(dp=dp, cp=cp, tp=tp, world_size=launch.world_size)
    backend = check_device(device)
    if finite_float(timeout_s) is None or not 0 < timeout_s <= MAX_PG_TIMEOUT_S:
        raise MeshError(f"timeout_s={shown(timeout_s)} must be a number > 0 and <= {MAX_PG_TIMEOUT_S:g} s (torch "
                        "holds the process group's timeout in int64 nanoseconds); give e.g. 120")
    if device == "cuda":
        torch.cuda.set_device(launch.local_rank)
        torch_device = torch.device("cuda", launch.local_rank)
    else:
        torch_device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh(
        "cuda" if device == "cuda" else "cpu",
        (dp, cp, tp),
        mesh_dim_names=("dp", "cp", "tp"),
    )
    return Mesh(dims=dims, rank=launch.rank, device=torch_device, device_mesh=device_mesh)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = [
    "CP_LAYOUTS",
    "DEVICE_DIST_BACKENDS",
    "LaunchEnv",
    "Mesh",
    "MeshError",
    "ParallelDims",
    "check_device",
    "destroy",
    "group_geometry",
    "init_mesh",
]
