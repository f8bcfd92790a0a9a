"""The logprob engine's one error type, below the contract and its storage checks.

:mod:`rl_engine.logprob.contract` checks the tensors' storage with
:func:`rl_engine.logprob.storage.require_readable`, which raises this error: kept in its own
module, neither of the two imports the other back (``tests/test_layers.py`` refuses import circles).
"""

from __future__ import annotations


class LogprobContractError(ValueError):
    """A logprob call that cannot be made as described; the message names field, value and fix."""
