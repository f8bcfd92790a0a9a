"""Deterministic vocab-parallel selected-token logprob: what a trainer calls.

The one-rank op (:func:`selected_logprob`), the fused head (:func:`selected_logprob_from_hidden`),
the TP x CP entry with its mesh (:func:`init_mesh`, :func:`selected_logprob_tp`,
:func:`gather_tokens`), the output and the contract. Everything else (the registry and
``dispatch``, the backends under ``backends/``, the oracles, agreement, comparison) stays
importable from its own module.

The names load on first use, so that ``rl_engine.logprob.backends``' torch-free descriptions
(read by the harness, which must import without torch) do not pull in torch through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_engine.distributed.mesh import init_mesh
    from rl_engine.logprob.api import gather_tokens, selected_logprob, selected_logprob_tp
    from rl_engine.logprob.backends.eager.vocab_parallel import LogprobOutput
    from rl_engine.logprob.contract import LogprobContract, LogprobContractError
    from rl_engine.logprob.hidden import selected_logprob_from_hidden

_HOME = {
    "selected_logprob": "rl_engine.logprob.api",
    "selected_logprob_from_hidden": "rl_engine.logprob.hidden",
    "init_mesh": "rl_engine.distributed.mesh",
    "selected_logprob_tp": "rl_engine.logprob.api",
    "gather_tokens": "rl_engine.logprob.api",
    "LogprobOutput": "rl_engine.logprob.backends.eager.vocab_parallel",
    "LogprobContract": "rl_engine.logprob.contract",
    "LogprobContractError": "rl_engine.logprob.contract",
}

__all__ = [
    "LogprobContract",
    "LogprobContractError",
    "LogprobOutput",
    "gather_tokens",
    "init_mesh",
    "selected_logprob",
    "selected_logprob_from_hidden",
    "selected_logprob_tp",
]


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(
        f"module 'rl_engine.logprob' has no attribute {name!r}; its public names are {__all__} "
        "(internals are imported from their own modules, e.g. rl_engine.logprob.registry.dispatch)")


def __dir__() -> list[str]:
    return sorted(__all__)
