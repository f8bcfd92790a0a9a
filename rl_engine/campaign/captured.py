"""A campaign on a captured file (config ``inputs: {capture: PATH}``) instead of the input recipe.

:func:`capture_record` reads a capture's header (``rl_engine.capture``: every structural rule,
the metadata), hashes the file and returns the case's ``capture`` record: absolute path,
SHA-256, size, tokens, vocabulary, logits dtype, metadata, and whether the archive holds it.
The case's own rules (:func:`rl_engine.campaign.case.capture_problems`) then require its
``batch * seq``, ``real_vocab`` = ``padded_vocab`` and ``dtype`` to be the capture's.

Where the file is read (every rank before any collective, rank 0 for the oracle, ``verify
--recompute``), :func:`check_file` first requires it to be the recorded bytes (size, then
SHA-256). A process hashes a file once: :func:`check_file` remembers the digest of the file it
hashed by its identity (device, inode, size, modification time in ns), so rank 0's check before
the collectives, its oracle's read and ``verify``'s two replays hash it once each process; a
rewritten file has a new modification time and is hashed again. Each rank then reads only its own tokens and vocabulary columns
(:func:`rl_engine.capture.shard.rank_inputs`); rank 0 also reads the whole capture (values
checked) for the FP32 oracle and the report's ``inputs_sha256``. The capture's ``active`` is
the mask: ``prompt_tokens``, ``seed`` and ``logit_scale`` do not shape a captured case's inputs.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

from rl_engine import jsonio
from rl_engine.campaign import inputs  # inputs.make_inputs looked up at call time (a test spies on it)
from rl_engine.campaign.case import captures_sampling
from rl_engine.capture.format import CaptureError, Header, RowSampling, read_capture, read_header, read_sampling
from rl_engine.capture.shard import rank_inputs
from rl_engine.rundir import CAPTURE
from rl_engine.verb_parsers import copy_capture_parser

COPY_CHUNK = 1 << 20  # bytes read at a time when hashing or copying a capture
# (device, inode, size, mtime_ns) of a file this process hashed -> its SHA-256
_HASHED: dict[tuple[int, int, int, int], str] = {}


def _identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The file's SHA-256, hashed at most once per process while its identity stays the same."""
    with jsonio.open_regular(path) as handle:
        before = _identity(os.fstat(handle.fileno()))
        if before in _HASHED:
            return _HASHED[before]
        digest = _hash_stream(handle)
        if _identity(os.fstat(handle.fileno())) == before:  # not rewritten while it was read
            _HASHED[before] = digest
    return digest


def _hash_stream(handle: Any) -> str:
    """SHA-256 of what is left to read of an open binary file, read in chunks (the one place a capture is hashed)."""
    digest = hashlib.sha256()
    while block := handle.read(COPY_CHUNK):
        digest.update(block)
    return digest.hexdigest()


def _require_file(path: Path, what: str, fix: str) -> None:
    """``path`` exists and is a regular file, else :class:`CaptureError`: "no such file" (saying
    where it looked) or "not a regular file" (a directory, a FIFO, a device)."""
    if not path.exists():
        raise CaptureError(f"{what}: no such file (looked for {path.absolute()}); {fix}")
    try:
        jsonio.require_regular(path)
    except jsonio.NotRegularFileError as exc:
        raise CaptureError(f"{what}: {exc}; {fix}") from None


def capture_record(path: str | os.PathLike[str], archive: bool = False) -> dict[str, Any]:
    """The case's ``capture`` record of a file: raises :class:`CaptureError` naming what is wrong."""
    where = Path(path)
    _require_file(where, f"inputs.capture={str(path)!r}", "give the path of a capture written by "
                  "rl_engine.capture.write_capture (docs/capture.md)")
    header = read_header(where)
    return {
        "path": str(where.resolve()),
        "sha256": file_sha256(where),
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
    _require_file(where, f"capture {where}", f"{expected} must be there (or pass its copy where the "
                  "command takes one)")
    size = where.stat().st_size
    if size != record["size"]:
        raise CaptureError(f"capture {where} has {size} bytes, not those of {expected}; "
                           "give the file the case was made from")
    digest = file_sha256(where)
    if digest != record["sha256"]:
        raise CaptureError(f"capture {where} has sha256 {digest}, not that of {expected}; "
                           "give the file the case was made from")
    check_header(record, read_header(where), str(where))
    return where


def check_header(record: Mapping[str, Any], header: Header, where: str) -> None:
    """Every field the case records of its capture (tokens, vocabulary, logits dtype, size,
    metadata) is what the file's own header says, else :class:`CaptureError` naming the first
    field that differs: a record edited after the case was made (the same bytes, other claims)
    is refused wherever the file is read, before any tensor is."""
    found = {"tokens": header.num_tokens, "vocab": header.vocab, "dtype": header.logits_dtype,
             "size": header.file_size, "metadata": dict(header.metadata)}
    for key, value in found.items():
        if record.get(key) != value:
            raise CaptureError(f"capture {where}: the case records {key}={record.get(key)!r} but the file's "
                               f"header says {value!r}; the case's capture record does not describe this "
                               "file: make the case again from the file (rerun the workflow)")


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


def case_rank_inputs(case: Mapping[str, Any], contract: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's ``(logits, targets, active)`` under ``contract``: only this rank's tokens and columns,
    made by the recipe (FP32, :func:`rl_engine.campaign.inputs.make_input_part`: the bytes of the same
    slice of :func:`case_inputs`) or read from the capture (in its dtype;
    :func:`rl_engine.capture.shard.rank_inputs`, after the caller checked its hash)."""
    record = case.get("capture")
    if record is not None:
        return rank_inputs(record["path"], contract)
    return inputs.make_input_part(case, contract.token_indices, contract.vocab_start, contract.vocab_end)


def require_sampling_tensors(case: Mapping[str, Any], path: str | os.PathLike[str] | None = None) -> None:
    """A case at its capture's sampling (``sampling: capture``) needs a capture that carries the four
    sampling tensors: refused by name from the header alone, where the file is first read (the
    workflow's config check, every rank before any collective), before any job or collective starts."""
    if captures_sampling(case):
        where = Path(path if path is not None else case["capture"]["path"])
        header = read_header(where)
        if "temperature" not in header.entries:
            read_sampling(where, header)  # raises, naming the tensors and the fix


def case_row_sampling(case: Mapping[str, Any], path: str | os.PathLike[str] | None = None,
                      rows: Any = None) -> RowSampling | None:
    """The capture's per-row sampling tensors (temperature, top_k, top_p, min_p) of the rows ``rows``
    (default: every row) of a case at its capture's sampling (``sampling: capture``), read from
    ``path`` (default: the recorded path; its hash is the caller's to check first), or None for any
    other case (its sampling is its own, :func:`rl_engine.campaign.case.record_op_sampling`)."""
    if not captures_sampling(case):
        return None
    where = Path(path if path is not None else case["capture"]["path"])
    return read_sampling(where, read_header(where), None if rows is None else list(rows))


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


def copy_capture(record: Mapping[str, Any], output: str | os.PathLike[str],
                 source: str | os.PathLike[str] | None = None) -> str:
    """Copy the case's capture (``source``, default its recorded path) to ``output`` in one streamed
    pass, hashing what is written; refuse (nothing left at ``output``) bytes other than the recorded ones.

    The copy is a new file (not a link), so a later change to the source never changes the run's
    copy; it is written under a temporary name beside ``output``, fsynced and renamed into place.
    """
    where = Path(source if source is not None else record["path"])
    target = Path(output)
    if where.absolute() == target.absolute() or (where.exists() and target.exists()
                                                 and os.path.samefile(where, target)):
        raise CaptureError(f"--output {target} is the capture itself ({where}); nothing was copied or "
                           "removed: copy it to another path (the run directory's capture.safetensors)")
    expected = f"the case's capture (sha256 {record['sha256']}, {record['size']} bytes)"
    tmp: str | None = None
    try:  # any refusal leaves nothing at output (which, checked above, is not the source)
        _require_file(where, f"capture {where}", f"{expected} must be there to be archived (restore it, "
                      "or set inputs.archive: false)")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        digest, size = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as dst, jsonio.open_regular(where) as src:
            while block := src.read(COPY_CHUNK):
                digest.update(block)
                dst.write(block)
                size += len(block)
            dst.flush()
            os.fsync(dst.fileno())
        if (size, digest.hexdigest()) != (record["size"], record["sha256"]):
            raise CaptureError(f"capture {where} has {size} bytes and sha256 {digest.hexdigest()}, not those of "
                               f"{expected}: it changed since the case was made; nothing was copied: give the "
                               "file the case was made from, or rerun the workflow to make a case of this file")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        target.unlink(missing_ok=True)
        raise
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    """``python -m rl_engine copy-capture --case case.json --output RUN/capture.safetensors``: the
    workflow's capture rule (config ``inputs.archive: true``). 0 copied, 2 refused (nothing written)."""
    from rl_engine.campaign.case import CaseError, load_case_file

    args = copy_capture_parser().parse_args(argv)
    try:
        case, _ = load_case_file(args.case)
        if case.capture is None or case.capture.get("archive") is not True:
            raise CaseError(f"case file {args.case}: its case has no capture with archive: true; there is "
                            "nothing to copy (config inputs: {capture: PATH, archive: true})")
        digest = copy_capture(case.capture, args.output)
    except (CaseError, CaptureError, OSError) as exc:
        print(f"copy-capture: {exc}", file=sys.stderr)
        return 2
    print(f"copy-capture: {case.capture['path']} -> {args.output} (sha256 {digest})")
    return 0


__all__ = ["capture_record", "case_inputs", "case_rank_inputs", "case_row_sampling",
           "check_file", "require_sampling_tensors", "check_header", "copy_capture", "file_sha256",
           "full_capture", "main", "replay_source"]
