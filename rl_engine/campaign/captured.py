"""A campaign on a captured file (config ``inputs: {capture: PATH}``) instead of the input recipe.

:func:`capture_record` reads a capture's header (``rl_engine.capture``: every structural rule,
the metadata), hashes the file and returns the case's ``capture`` record: absolute path,
SHA-256, size, tokens, vocabulary, logits dtype, metadata, and whether the archive holds it.
The case's own rules (:func:`rl_engine.campaign.case.capture_problems`) then require its
``batch * seq``, ``real_vocab`` = ``padded_vocab`` and ``dtype`` to be the capture's.

Where the file is read (every rank before any collective, rank 0 for the oracle, ``verify
--recompute``), :func:`check_file` first requires it to be the recorded bytes (size, then
SHA-256). Each rank then reads only its own tokens and vocabulary columns
(:func:`rl_engine.capture.shard.rank_inputs`); rank 0 also reads the whole capture (values
checked) for the FP32 oracle and the report's ``inputs_sha256``. The capture's ``active`` is
the mask: ``prompt_tokens``, ``seed`` and ``logit_scale`` do not shape a captured case's inputs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

from rl_engine import jsonio
from rl_engine.campaign import inputs  # inputs.make_inputs looked up at call time (a test spies on it)
from rl_engine.capture.format import CaptureError, read_capture, read_header
from rl_engine.rundir import CAPTURE


def capture_record(path: str | os.PathLike[str], archive: bool = False) -> dict[str, Any]:
    """The case's ``capture`` record of a file: raises :class:`CaptureError` naming what is wrong."""
    where = Path(path)
    if not where.is_file():
        raise CaptureError(f"inputs.capture={str(path)!r}: no such file; give the path of a capture "
                           "written by rl_engine.capture.write_capture (docs/capture.md)")
    header = read_header(where)
    return {
        "path": str(where.resolve()),
        "sha256": jsonio.sha256_file(where),
        "size": header.file_size,
        "tokens": header.num_tokens,
        "vocab": header.vocab,
        "dtype": header.logits_dtype,
        "metadata": dict(header.metadata),
        "archive": bool(archive),
    }


def check_file(record: Mapping[str, Any], path: str | os.PathLike[str] | None = None) -> Path:
    """``path`` (default: the recorded one) holds the recorded capture's bytes; else refuse."""
    where = Path(path if path is not None else record["path"])
    expected = f"the case's capture (sha256 {record['sha256']}, {record['size']} bytes)"
    if not where.is_file():
        raise CaptureError(f"capture {where}: no such file; {expected} must be there (or pass "
                           "its copy where the command takes one)")
    size = where.stat().st_size
    if size != record["size"]:
        raise CaptureError(f"capture {where} has {size} bytes, not those of {expected}; "
                           "give the file the case was made from")
    digest = jsonio.sha256_file(where)
    if digest != record["sha256"]:
        raise CaptureError(f"capture {where} has sha256 {digest}, not that of {expected}; "
                           "give the file the case was made from")
    return where


def full_capture(record: Mapping[str, Any],
                 path: str | os.PathLike[str] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(FP32 logits [tokens, vocab], targets, active)`` of the whole capture, after the hash:
    the oracle's and ``inputs_sha256``'s view (the upcast is exact from bf16/fp16)."""
    capture = read_capture(check_file(record, path))
    return capture.logits.to(torch.float32), capture.targets, capture.active


def case_inputs(case: Mapping[str, Any], path: str | os.PathLike[str] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole case's ``(FP32 logits, targets, active)``: the recipe's (``make_inputs``), or its
    capture's (at ``path``, default the recorded path), after the capture's hash."""
    record = case.get("capture")
    return inputs.make_inputs(case) if record is None else full_capture(record, path)


def replay_source(record: Mapping[str, Any], root: str | os.PathLike[str],
                  given: str | os.PathLike[str] | None) -> Path:
    """The capture ``verify --recompute`` replays from: ``given`` (``--capture PATH``), else the
    archive's own copy (``capture.safetensors``); each must hold the recorded bytes. Neither:
    refuse, naming the file and its hash."""
    if given is not None:
        return check_file(record, given)
    archived = Path(root) / CAPTURE
    if archived.is_file():
        return check_file(record, archived)
    held = ("the case says the archive holds it (inputs.archive: true) but it has no "
            f"{CAPTURE}: the archive is incomplete" if record.get("archive") is True
            else "the archive does not hold it (inputs.archive was false)")
    raise CaptureError(f"the case runs on the capture {record['path']} (sha256 {record['sha256']}, "
                       f"{record['size']} bytes); {held}: pass --capture PATH to a copy of that file")


__all__ = ["capture_record", "case_inputs", "check_file", "full_capture", "replay_source"]
