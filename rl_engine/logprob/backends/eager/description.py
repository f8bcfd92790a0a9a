"""The eager backend's one description (see :mod:`rl_engine.logprob.backends.description`)."""

from __future__ import annotations

from rl_engine.logprob.backends.description import BackendDescription
from rl_engine.tables import EAGER_BACKEND

DESCRIPTION = BackendDescription(
    backend_id=EAGER_BACKEND,
    summary="the eager PyTorch reference of docs/arithmetic.md",
    devices=("cpu", "cuda"),
    engine="rl_engine.logprob.backends.eager.vocab_parallel:VocabParallelLogprob",
    priority=0,
    arith_versions=("rl-engine-arith/2",),
    processed_logprobs=True,
    processed_row_temperature=True,
)
