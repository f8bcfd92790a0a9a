"""The integer and choice checks every contract and the case make (one wording, one rule).

Each returns the problem (naming the field and the value) or ``None``; the caller raises its own
domain's error with it (:func:`require`). ``bool`` is never an integer here, though Python's is.
No imports beyond the standard library: the lowest layer, beside :mod:`rl_engine.tables`.

:func:`finite_float` is the one conversion of a user's number (a config value, an API argument) to
a binary64 float: Python's ``float()`` of an integer beyond binary64's range (``10**400``, which a
YAML config or a call may hold) raises a bare ``OverflowError``, and ``math.isfinite`` does too.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

SHOWN_DIGITS = 40  # an integer longer than this is named by its digit count in a message


def shown(value: Any) -> str:
    """``repr(value)``, except that an integer of more than :data:`SHOWN_DIGITS` digits is shown by
    its first digits and its digit count (a 400-digit value would bury the message)."""
    if isinstance(value, int) and not isinstance(value, bool):
        digits = str(abs(value))
        if len(digits) > SHOWN_DIGITS:
            sign = "-" if value < 0 else ""
            return f"{sign}{digits[:12]}... (an integer of {len(digits)} digits)"
    return repr(value)


def finite_float(value: Any) -> float | None:
    """``value`` as a finite binary64 float, or None: a bool, a non-number, NaN, an infinity, or an
    integer whose magnitude is beyond binary64's range (about 1.8e308)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def real_problem(name: str, value: Any) -> str | None:
    """``name=value`` is not a finite real number (:func:`finite_float`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name}={value!r} must be a finite number (got {type(value).__name__})"
    if finite_float(value) is None:
        if isinstance(value, int):
            return (f"{name}={shown(value)} must be a finite number: an integer beyond binary64's range "
                    "(about 1.8e308) has no float value; give a value in range")
        return f"{name}={value!r} must be a finite number"
    return None


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


__all__ = ["SHOWN_DIGITS", "choice_problem", "finite_float", "int_problem", "real_problem", "require", "shown"]
