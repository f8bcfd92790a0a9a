"""GRPO loss on the deterministic vocab-parallel logprob, bitwise across TP, CP and DP."""

from rl_engine.grpo.contract import GRPOContract, GRPOContractError
from rl_engine.grpo.loss import DEFAULT_BACKEND, GRPOLoss, GRPOOutput, SequenceStats

__all__ = [
    "DEFAULT_BACKEND",
    "GRPOContract",
    "GRPOContractError",
    "GRPOLoss",
    "GRPOOutput",
    "SequenceStats",
]
