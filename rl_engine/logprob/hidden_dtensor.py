"""An lm_head weight that is a DTensor, as FSDP2 and a TP plan hold it, made ready for the fused head.

Both layouts put ``Shard(0)`` on the weight ``[vocab, hidden_size]``: FSDP2 (``fully_shard``)
cuts the parameter's first dimension over the data-parallel mesh, and ``ColwiseParallel`` cuts the
lm_head's output dimension (the vocabulary) over the TP mesh. The placement cannot tell them apart;
what differs is the hidden state (other tokens on every data-parallel rank, the same tokens on
every TP rank), which the caller knows. So the rule is the existing ``group=``:

* ``group=None``: the mesh is data-parallel. The weight is gathered whole for the call (an
  all-gather, as FSDP2's own unshard or TRL's ``full_tensor()``), and its gradient goes back to the
  DTensor as a DTensor of the weight's placements, reduced over the mesh: each rank's gradient of
  the whole weight is a partial sum, averaged (``weight_grad_reduce="mean"``, FSDP2's default) or
  summed (``"sum"``, for a framework that divides by nothing) by one reduce-scatter. (TRL's
  ``full_tensor()`` keeps each rank's own slice instead, unreduced, which leaves the ranks'
  shards diverging unless something else reduces them.)
* ``group`` = the mesh's process group: the mesh is the TP group and the local shard is the rank's
  vocabulary shard (``torch.chunk``'s split, which must fall on tile boundaries); no gather, the
  gradient comes back as a DTensor holding the shard's gradient.

Refused, naming the placement and the fix: a mesh of more than one dimension (HSDP, FSDP2 over
TP: untested here), ``Replicate`` (whether its gradient needs a reduction depends on the tokens,
which a replicated weight cannot say), ``Shard`` of another dimension, ``Partial``, and a ``group``
that is not the mesh's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from rl_engine.logprob.contract import LogprobContractError

WEIGHT_GRAD_REDUCES = ("mean", "sum")


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor, without importing DTensor's package (41 MiB of resident memory the
    first time, which a plain call would pay in its own peak memory): no DTensor exists before
    ``torch.distributed.tensor`` is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


@dataclass(frozen=True)
class HeadWeight:
    """The weight as the fused head will use it, resolved without a collective: the tensor given,
    the TP group (``None`` without TP), the vocabulary, this rank's rows of it, the shard bounds of
    a DTensor's uneven split, whether :meth:`tensor` gathers it (a data-parallel DTensor: the
    gradient's reduction, ``None`` otherwise), and what the provenance records about a DTensor
    (``None`` for a plain tensor)."""

    given: Any
    group: Any
    vocab: int
    rows: tuple[int, int]
    shard_bounds: tuple[tuple[int, int], ...] | None
    gather: str | None
    record: dict[str, Any] | None

    def __post_init__(self) -> None:
        if self.gather not in (None,) + WEIGHT_GRAD_REDUCES:
            raise LogprobContractError(f"gather={self.gather!r} must be None or one of {WEIGHT_GRAD_REDUCES}")

    @property
    def meta(self) -> torch.Tensor:
        """A tensor with the dtype, device and hidden size of the weight as used (no collective)."""
        if is_dtensor(self.given):
            with torch.no_grad():
                return self.given.to_local()
        return self.given

    def tensor(self) -> torch.Tensor:
        """The plain tensor the head multiplies: a data-parallel DTensor gathered whole (its gradient
        reduced back over the mesh), a TP DTensor's local shard, a plain tensor as it is."""
        if not is_dtensor(self.given):
            return self.given
        if self.gather is None:
            return self.given.to_local()  # differentiable: the gradient comes back as a DTensor of the shard
        from torch.distributed.tensor import Partial, Replicate

        reduce = Partial("avg" if self.gather == "mean" else "sum")
        return self.given.redistribute(self.given.device_mesh, [Replicate()]).to_local(grad_placements=[reduce])


def _same_group(a: Any, b: Any) -> bool:
    if a is b:
        return True
    import torch.distributed as dist

    try:
        return bool(dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b))
    except Exception:  # noqa: BLE001 - not both process groups: not the same group
        return False


def head_weight(weight: Any, group: Any, weight_grad_reduce: str) -> HeadWeight:
    """``weight`` (a plain tensor or a DTensor) resolved by the rule of the module docstring, with no
    collective (the gather is :meth:`HeadWeight.tensor`, after the ranks have agreed)."""
    if weight_grad_reduce not in WEIGHT_GRAD_REDUCES:
        raise LogprobContractError(f"weight_grad_reduce={weight_grad_reduce!r} must be one of {WEIGHT_GRAD_REDUCES} "
                                   "(default 'mean', FSDP2's average over the data-parallel ranks)")
    if not is_dtensor(weight):
        return _plain(weight, group)
    from torch.distributed.tensor import Partial, Replicate, Shard

    mesh, placements = weight.device_mesh, list(weight.placements)
    if weight.dim() != 2:
        raise LogprobContractError(f"weight is a DTensor of shape {tuple(weight.shape)}; the lm_head's weight is "
                                   "[vocab, hidden_size]")
    if mesh.ndim != 1:
        raise LogprobContractError(
            f"weight is a DTensor on a {mesh.ndim}-dimensional mesh with placements {placements}; the fused head "
            "takes a one-dimensional mesh (FSDP2's data-parallel mesh, or the TP mesh with group=): pass "
            "weight.redistribute(...) to one of those, or weight.to_local() with the group of its TP dimension")
    placement = placements[0]
    vocab = int(weight.shape[0])
    mesh_group = mesh.get_group(0)
    record: dict[str, Any] = {"mesh_size": mesh.size(0), "placement": str(placement)}
    if type(placement) is not Shard or placement.dim % weight.dim() != 0:
        fix = ("pass weight.to_local() (every rank holds it whole) and reduce its gradient as your framework "
               "does" if isinstance(placement, Replicate) else
               "redistribute it to Shard(0) (FSDP2's layout, or ColwiseParallel's on the vocabulary)")
        if isinstance(placement, Partial):
            fix = "reduce it first (weight.redistribute(placements=[Replicate()]))"
        raise LogprobContractError(
            f"weight is a DTensor with placements {placements}; the fused head takes an lm_head weight sharded on "
            f"its first dimension, Shard(0): {fix}")
    if group is not None:
        if not _same_group(group, mesh_group):
            raise LogprobContractError(
                "weight is a DTensor sharded on the vocabulary over a mesh whose group is not group=; pass the "
                "mesh's group (weight.device_mesh.get_group(0)) as group=, or group=None for a data-parallel "
                "(FSDP2) mesh, whose weight is gathered")
        tp, rank = mesh.size(0), mesh.get_local_rank(0)
        width = -(-vocab // tp)  # torch.chunk's split
        bounds = tuple((min(r * width, vocab), min((r + 1) * width, vocab)) for r in range(tp))
        return HeadWeight(weight, mesh_group, vocab, bounds[rank], bounds, None,
                          {**record, "use": "tp", "tp_rank": rank, "rows": list(bounds[rank])})
    return HeadWeight(weight, None, vocab, (0, vocab), None, weight_grad_reduce,
                      {**record, "use": "gathered", "weight_grad_reduce": weight_grad_reduce})


def _plain(weight: Any, group: Any) -> HeadWeight:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise LogprobContractError(f"weight={got} must be the lm_head's weight, a tensor [vocab, hidden_size]")
    from rl_engine.distributed.mesh import group_geometry

    tp, rank = group_geometry(group)
    rows = weight.shape[0]
    vocab = rows * tp  # the shards are equal (an even split of the padded vocabulary)
    return HeadWeight(weight, group, vocab, (rank * rows, (rank + 1) * rows), None, None, None)


__all__ = ["HeadWeight", "WEIGHT_GRAD_REDUCES", "head_weight", "is_dtensor"]
