"""Which tokens of a case are active: the one owner of the mask, wherever evidence is judged.

A case's inputs own its mask. The input recipe's is a rule of the case's integers,
:func:`recipe_active` (the first ``prompt_tokens`` positions of every sequence are a prompt: what
:func:`rl_engine.campaign.inputs.make_input_part` makes). A capture's is its own ``active`` tensor,
which need not follow any rule (prompts of 5 and 11 tokens in one batch, padding, several turns):
``prompt_tokens`` does not shape it. So a report of a case on a capture records the mask the run
used (``active_mask``: :func:`pack_mask`, one bit per token), and its bytes must hash to the
report's ``inputs_sha256.mask`` (which ``verify --recompute`` ties to the capture itself).

:func:`report_active` is what report acceptance reads (the values each raw tensor may hold, the
count of active rows): the recipe's rule or the recorded mask, checked; never ``prompt_tokens``
on a capture. NumPy only (the gates run without torch).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np

MASK_FIELD = "active_mask"  # the report's record of a capture case's mask
_HEX = re.compile(r"(?:[0-9a-f]{2})*")


class MaskError(ValueError):
    """A recorded mask that is not the mask of its case's inputs; names the field and the fix."""


def recipe_active(rows: np.ndarray, seq: int, prompt_tokens: int) -> np.ndarray:
    """The input recipe's mask of global token indices ``rows``: position ``row % seq`` of its
    sequence is active from ``prompt_tokens`` on (``docs/arithmetic.md`` section 10)."""
    return (np.asarray(rows, dtype=np.int64) % seq) >= prompt_tokens


def pack_mask(active: np.ndarray) -> str:
    """``active_mask`` of a bool mask: one bit per token in global token order, 8 to a byte, least
    significant bit first (``numpy.packbits(..., bitorder="little")``), as lowercase hex; a byte's
    bits past the last token are 0. 2**20 tokens (the case's bound) are 256 KiB of text."""
    return np.packbits(np.asarray(active, dtype=bool), bitorder="little").tobytes().hex()


def mask_sha256(active: np.ndarray) -> str:
    """SHA-256 of the mask's bytes as a bool tensor holds them (one byte, 0 or 1, per token): the
    report's ``inputs_sha256.mask``."""
    return hashlib.sha256(np.ascontiguousarray(active, dtype=bool).tobytes()).hexdigest()


def unpack_mask(text: Any, tokens: int, mask_hash: Any) -> np.ndarray:
    """The mask ``active_mask`` records for ``tokens`` tokens, after every check: hex of
    ``ceil(tokens / 8)`` bytes, no bit set past the last token, at least one token active, and its
    bytes hashing to ``mask_hash`` (the report's ``inputs_sha256.mask``); :class:`MaskError` otherwise."""
    size = (tokens + 7) // 8
    if not isinstance(text, str) or len(text) != 2 * size or not _HEX.fullmatch(text):
        shown = f"a string of {len(text)} characters" if isinstance(text, str) else repr(text)[:80]
        raise MaskError(f"is {shown}; it must be the lowercase hex of {size} bytes, one bit per token of the "
                        f"case's {tokens} tokens (rl_engine.campaign.mask.pack_mask)")
    bits = np.unpackbits(np.frombuffer(bytes.fromhex(text), dtype=np.uint8), bitorder="little")
    if bits[tokens:].any():
        raise MaskError(f"sets a bit past the case's {tokens} tokens; a byte's bits past the last token are 0")
    active = bits[:tokens].astype(bool)
    if not active.any():
        raise MaskError("holds no active token; a capture has at least one")
    if mask_sha256(active) != mask_hash:
        raise MaskError(f"hashes to {mask_sha256(active)}, not to inputs_sha256.mask {mask_hash!r}: it is not the "
                        "mask the run's inputs had")
    return active


def report_active(report: Any) -> tuple[np.ndarray | None, str | None]:
    """``(mask, None)``: which tokens of a report's case are active; ``(None, why)`` when the report
    cannot say (the shape and schema checks name a malformed case, the message a missing or wrong
    ``active_mask``). The input recipe's mask comes from the case's integers; a capture's from the
    report's ``active_mask`` (:func:`unpack_mask`), never from ``prompt_tokens``."""
    case = report.get("case") if isinstance(report, dict) else None
    if not isinstance(case, dict):
        return None, None
    batch, seq, prompt = case.get("batch"), case.get("seq"), case.get("prompt_tokens")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (batch, seq, prompt)) or batch < 1 or seq < 1:
        return None, None  # the schema and the shape checks name a bad case
    tokens = batch * seq
    if case.get("capture") is None:
        if MASK_FIELD in report:
            return None, (f"present on a case of the input recipe, whose mask is its rule (the first "
                          f"prompt_tokens={prompt} positions of each sequence inactive); only a case on a capture "
                          "records its mask; remove active_mask from the report (or run the campaign on the capture)")
        return recipe_active(np.arange(tokens), seq, prompt), None
    if MASK_FIELD not in report:
        return None, ("missing: a case on a capture records the capture's active mask (which tokens are active is "
                      "the capture's, not prompt_tokens'); run the campaign again with this rl_engine")
    hashes = report.get("inputs_sha256")
    try:
        return unpack_mask(report[MASK_FIELD], tokens, hashes.get("mask") if isinstance(hashes, dict) else None), None
    except MaskError as exc:
        return None, str(exc)


__all__ = ["MASK_FIELD", "MaskError", "mask_sha256", "pack_mask", "recipe_active", "report_active", "unpack_mask"]
