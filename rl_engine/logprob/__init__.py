"""Deterministic vocab-parallel selected-token logprob: contract, backends, oracles, dispatch."""

from rl_engine.logprob.api import gather_tokens, selected_logprob
from rl_engine.logprob.backends.eager.vocab_parallel import BACKEND_ID, LogprobOutput, VocabParallelLogprob
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.hidden import selected_logprob_from_hidden
from rl_engine.logprob.oracle import fp32_oracle, fp64_oracle
from rl_engine.logprob.registry import BackendUnavailableError, Dispatch, dispatch

__all__ = [
    "BACKEND_ID",
    "BackendUnavailableError",
    "Dispatch",
    "LogprobContract",
    "LogprobContractError",
    "LogprobOutput",
    "VocabParallelLogprob",
    "dispatch",
    "fp32_oracle",
    "fp64_oracle",
    "gather_tokens",
    "selected_logprob",
    "selected_logprob_from_hidden",
]
