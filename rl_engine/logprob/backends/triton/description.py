"""The Triton backend's one description (see :mod:`rl_engine.logprob.backends.description`).

Its interpreter runs the kernels on CPU tensors when ``RL_ENGINE_TRITON_MODE=interpreter``;
``auto`` never chooses that mode, so ``auto_devices`` is its compiled mode's device alone.
"""

from __future__ import annotations

from rl_engine.logprob.backends.description import BackendDescription
from rl_engine.tables import TRITON_BACKEND

DESCRIPTION = BackendDescription(
    backend_id=TRITON_BACKEND,
    summary="the eager backend's bytes from Triton kernels",
    devices=("cuda",),
    engine="rl_engine.logprob.backends.triton.triton_backend:TritonLogprob",
    availability="rl_engine.logprob.backends.triton.triton_backend:triton_unavailable",
    priority=20,
    arith_versions=("rl-engine-arith/2",),
    interpreter_devices=("cpu",),
    auto_devices=("cuda",),
    mode="rl_engine.logprob.backends.triton.description:recorded_mode",
)


def recorded_mode() -> str | None:
    """The mode the provenance records: ``compiled`` or ``interpreter`` (None for a bad
    ``RL_ENGINE_TRITON_MODE``, which the backend's availability then names)."""
    from rl_engine.logprob.backends.triton.triton_backend import triton_mode
    from rl_engine.logprob.contract import LogprobContractError

    try:
        return triton_mode()
    except LogprobContractError:
        return None
