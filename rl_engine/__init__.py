"""rl_engine: deterministic TP/CP-parallel selected-token logprob for RL training."""

__version__ = "0.1.0"
