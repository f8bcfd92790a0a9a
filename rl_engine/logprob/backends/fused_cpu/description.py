"""The fused CPU backend's one description (see :mod:`rl_engine.logprob.backends.description`)."""

from __future__ import annotations

from rl_engine.logprob.backends.description import BackendDescription
from rl_engine.tables import FUSED_CPU_BACKEND

DESCRIPTION = BackendDescription(
    backend_id=FUSED_CPU_BACKEND,
    summary="the eager backend's bytes from a compiled one-pass C kernel",
    devices=("cpu",),
    engine="rl_engine.logprob.backends.fused_cpu.fused_cpu:FusedCpuLogprob",
    availability="rl_engine.logprob.backends.fused_cpu.fused_cpu:kernel_unavailable",
    priority=10,
    processed_logprobs=True,
    processed_row_temperature=True,
    arith_versions=("rl-engine-arith/2",),
)
