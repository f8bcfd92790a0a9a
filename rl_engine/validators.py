"""The integer and choice checks every contract and the case make (one wording, one rule).

Each returns the problem (naming the field and the value) or ``None``; the caller raises its own
domain's error with it (:func:`require`). ``bool`` is never an integer here, though Python's is.
No imports beyond the standard library: the lowest layer, beside :mod:`rl_engine.tables`.
"""

from __future__ import annotations

from typing import Any, Sequence


def int_problem(name: str, value: Any, minimum: int) -> str | None:
    """``name=value`` is not an integer ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{name}={value!r} must be an integer (got {type(value).__name__})"
    if value < minimum:
        return f"{name}={value} must be >= {minimum}"
    return None


def choice_problem(name: str, value: Any, choices: Sequence[str], verdict: str = "is not supported") -> str | None:
    """``name=value`` is not one of ``choices`` (``verdict`` says how: unknown, not supported)."""
    if value not in choices:
        return f"{name}={value!r} {verdict}; use one of {list(choices)}"
    return None


def require(problem: str | None, error: type[Exception]) -> None:
    """Raise ``error(problem)`` when there is a problem."""
    if problem is not None:
        raise error(problem)


__all__ = ["choice_problem", "int_problem", "require"]
