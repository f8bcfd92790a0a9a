"""The capture file: one engine's logits, targets and mask of a token batch, in safetensors.

A capture is a safetensors file (``docs/capture.md``) holding

* ``logits``: ``[tokens, vocab]``, bf16, fp16 or fp32, finite;
* ``targets``: ``[tokens]``, int64; on active tokens within ``[0, vocab)``;
* ``active``: ``[tokens]``, bool, at least one true;
* ``reported_logp`` (optional): ``[tokens]``, fp32, finite on active tokens: what the engine
  itself reported for each target, as a raw logprob (temperature 1, no truncation);
* the sampling parameters (optional, all four or none): ``temperature`` (fp32, finite, ``> 0``),
  ``top_k`` (int64, ``>= 0``, 0 = off), ``top_p`` (fp32, in ``(0, 1]``) and ``min_p`` (fp32, in
  ``[0, 1]``), each ``[tokens]``: the distribution the engine sampled each row's target from, as
  :func:`rl_engine.logprob.selected_logprob` takes them (docs/arithmetic.md section 13);
* ``reported_processed_logp`` (optional, only with the sampling parameters): ``[tokens]``, fp32,
  finite or ``-inf`` on active tokens: the engine's logprob of each target under those parameters
  (vLLM's ``processed_logprobs``; ``-inf``: a target outside the kept set);

and, in the header's ``__metadata__`` (strings only, as safetensors requires), ``format``
(:data:`FORMAT`), ``engine``, ``engine_version``, ``model``, ``dtype`` (the logits' dtype
name), ``tp`` (the engine's TP degree, a positive decimal) and ``notes`` (free text). Every
metadata value is one line of printable text: a control character (ESC, BEL, newline, tab, C1)
or a bidirectional override is refused when a capture is built or written and when a file is
read, since the values reach SUMMARY.md and a reviewer's terminal.

:func:`read_capture` checks the file before any tensor is used: the header is parsed and
checked here (sizes, offsets, dtypes, shapes), so a truncated or padded file is refused with
its byte counts instead of a library's message, then the values are checked. Every refusal
is a :class:`CaptureError` naming the tensor (or metadata key), the value and the fix.
:func:`write_capture` runs the same checks and writes atomically: a refused capture leaves
nothing at the path.
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Mapping

import torch

from rl_engine import jsonio
from rl_engine.tables import UNPRINTABLE_CLASS

FORMAT = "rl-engine-capture/1"
LOGITS = "logits"
TARGETS = "targets"
ACTIVE = "active"
REPORTED = "reported_logp"
TEMPERATURE, TOP_K, TOP_P, MIN_P = "temperature", "top_k", "top_p", "min_p"
SAMPLING = (TEMPERATURE, TOP_K, TOP_P, MIN_P)
REPORTED_PROCESSED = "reported_processed_logp"
TENSORS = (LOGITS, TARGETS, ACTIVE, REPORTED, *SAMPLING, REPORTED_PROCESSED)
REQUIRED_TENSORS = (LOGITS, TARGETS, ACTIVE)
METADATA_KEYS = ("format", "engine", "engine_version", "model", "dtype", "tp", "notes")

# safetensors dtype codes <-> torch dtypes, and the logits dtype names of the project.
ST_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
    "I64": torch.int64, "BOOL": torch.bool,
}
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "BOOL": 1}
LOGITS_ST = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
DTYPE_NAMES = {v: k for k, v in {"bf16": torch.bfloat16, "fp16": torch.float16,
                                 "fp32": torch.float32}.items()}
_EXPECTED_ST = {TARGETS: "I64", ACTIVE: "BOOL", REPORTED: "F32", TEMPERATURE: "F32", TOP_K: "I64", TOP_P: "F32",
                MIN_P: "F32", REPORTED_PROCESSED: "F32"}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own cap on the JSON header
_UNPRINTABLE = re.compile(f"[{UNPRINTABLE_CLASS}]")  # refused in every metadata value, at write and read


class CaptureError(ValueError):
    """A capture (file or tensors) that does not follow the format; names the tensor and the fix."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's record in a safetensors header."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A checked safetensors header: entries by name, metadata, and where the data starts."""

    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int

    @property
    def num_tokens(self) -> int:
        return self.entries[LOGITS].shape[0]

    @property
    def vocab(self) -> int:
        return self.entries[LOGITS].shape[1]

    @property
    def logits_dtype(self) -> str:
        return LOGITS_ST[self.entries[LOGITS].dtype]


def _check_metadata(metadata: Mapping[str, Any], logits_dtype: str, where: str) -> dict[str, str]:
    meta = dict(metadata)
    missing = [k for k in METADATA_KEYS if k not in meta]
    if missing:
        raise CaptureError(f"{where}: metadata is missing {missing}; write the capture with "
                           "rl_engine.capture.write_capture (it fills format and dtype) and give "
                           "engine, engine_version, model, tp and notes")
    unknown = sorted(set(meta) - set(METADATA_KEYS))
    if unknown:
        raise CaptureError(f"{where}: metadata has unknown keys {unknown}; the keys are "
                           f"{list(METADATA_KEYS)} (put anything else in notes)")
    for key, value in meta.items():
        if not isinstance(value, str):
            raise CaptureError(f"{where}: metadata {key}={value!r} must be a string")
        bad = _UNPRINTABLE.search(value)
        if bad:
            raise CaptureError(f"{where}: metadata {key} holds the control or bidirectional character "
                               f"U+{ord(bad.group()):04X} at position {bad.start()} ({value[:80]!r}); capture "
                               "metadata is one line of printable text, since it reaches SUMMARY.md and a "
                               "reviewer's terminal: remove it (no ESC, BEL, newline or tab; write an escape "
                               "such as '\\x1b' as text if you must name one)")
    if meta["format"] != FORMAT:
        raise CaptureError(f"{where}: metadata format={meta['format']!r} is not {FORMAT!r}; "
                           "this reader knows only that format")
    for key in ("engine", "engine_version", "model"):
        if not meta[key].strip():
            raise CaptureError(f"{where}: metadata {key}={meta[key]!r} is empty; name it "
                               "(write 'unknown' when you do not know)")
    if not (meta["tp"].isdecimal() and meta["tp"].isascii() and int(meta["tp"]) >= 1
            and meta["tp"] == str(int(meta["tp"]))):
        raise CaptureError(f"{where}: metadata tp={meta['tp']!r} must be the engine's TP degree "
                           "as a positive decimal such as '1'")
    if meta["dtype"] != logits_dtype:
        raise CaptureError(f"{where}: metadata dtype={meta['dtype']!r} disagrees with tensor "
                           f"logits, which is {logits_dtype}; a capture records the logits' "
                           "own dtype: fix the metadata or the tensor")
    return meta


def _dtype_rule(name: str) -> str:
    if name == LOGITS:
        return "it must be BF16, F16 or F32 (bf16, fp16, fp32): the logits as the LM head gave them"
    if name in _EXPECTED_ST:
        want = _EXPECTED_ST[name]
        hint = (" (targets are token ids: a float targets tensor is refused, NaN or not)"
                if name == TARGETS else "")
        return (f"it must be {want}{hint}: convert it before writing (e.g. .to(torch."
                f"{str(ST_DTYPES[want]).replace('torch.', '')}))")
    return f"a capture holds only {list(TENSORS)}"


def _entry(name: str, raw: Any, where: str) -> TensorEntry:
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise CaptureError(f"{where}: tensor {name}: header record {raw!r} is not a safetensors "
                           "record (dtype, shape, data_offsets); rewrite the file with safetensors")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ST_DTYPES:
        raise CaptureError(f"{where}: tensor {name} has dtype {dtype}; {_dtype_rule(name)}")
    # type() is int, not isinstance: a JSON true is a bool, which Python counts as an int and
    # safetensors refuses
    if (not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
        raise CaptureError(f"{where}: tensor {name}: shape {shape!r} or data_offsets {offsets!r} "
                           "is malformed; rewrite the file with safetensors")
    count = 1
    for d in shape:
        count *= d
    if offsets[1] - offsets[0] != count * _ITEMSIZE[dtype]:
        raise CaptureError(f"{where}: tensor {name}: data_offsets {offsets} hold "
                           f"{offsets[1] - offsets[0]} bytes, but shape {shape} of {dtype} needs "
                           f"{count * _ITEMSIZE[dtype]}; the file is damaged: capture it again")
    return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_layout(entries: dict[str, TensorEntry], where: str) -> None:
    missing = [n for n in REQUIRED_TENSORS if n not in entries]
    if missing:
        raise CaptureError(f"{where}: tensor(s) {missing} missing; a capture holds {list(REQUIRED_TENSORS)} "
                           f"and optionally {REPORTED!r}, the sampling parameters {list(SAMPLING)} and "
                           f"{REPORTED_PROCESSED!r}")
    present = [n for n in SAMPLING if n in entries]
    if present and len(present) != len(SAMPLING):
        raise CaptureError(f"{where}: the sampling parameter tensor(s) {[n for n in SAMPLING if n not in entries]} "
                           f"are missing while {present} are present; a capture carries all of {list(SAMPLING)} "
                           "or none (off is temperature 1, top_k 0, top_p 1, min_p 0)")
    if REPORTED_PROCESSED in entries and not present:
        raise CaptureError(f"{where}: tensor {REPORTED_PROCESSED} is present without the sampling parameters "
                           f"{list(SAMPLING)} it was computed under; add them, or name the tensor {REPORTED!r} "
                           "if it is a raw logprob (temperature 1, no truncation)")
    unknown = sorted(set(entries) - set(TENSORS))
    if unknown:
        raise CaptureError(f"{where}: unknown tensor(s) {unknown}; a capture holds only {list(TENSORS)}")
    logits = entries[LOGITS]
    if logits.dtype not in LOGITS_ST:
        raise CaptureError(f"{where}: tensor logits has dtype {logits.dtype}; {_dtype_rule(LOGITS)}")
    if len(logits.shape) != 2 or logits.shape[0] < 1 or logits.shape[1] < 2:
        raise CaptureError(f"{where}: tensor logits has shape {list(logits.shape)}; it must be "
                           "[tokens, vocab] with tokens >= 1 and vocab >= 2: flatten [batch, seq, "
                           "vocab] to [batch * seq, vocab]")
    for name, want in _EXPECTED_ST.items():
        entry = entries.get(name)
        if entry is None:
            continue
        if entry.dtype != want:
            raise CaptureError(f"{where}: tensor {name} has dtype {entry.dtype}; {_dtype_rule(name)}")
        if entry.shape != (logits.shape[0],):
            raise CaptureError(f"{where}: tensor {name} has shape {list(entry.shape)}; it must be "
                               f"[{logits.shape[0]}] (one per row of logits)")


def read_header(path: str | os.PathLike[str]) -> Header:
    """Parse and check a capture's safetensors header without reading the tensors (the path must be
    a regular file: :func:`rl_engine.jsonio.open_regular`, so a FIFO never blocks)."""
    with jsonio.open_regular(path) as handle:
        return parse_header(handle, os.fstat(handle.fileno()).st_size, str(path))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise CaptureError(f"the safetensors header repeats the key(s) "
                           f"{sorted({k for k in keys if keys.count(k) > 1})!r}")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise CaptureError(f"the safetensors header holds the literal {name}, which is not JSON")


def _strings_are_utf8(value: Any, where: str) -> None:
    """Every string of the parsed header encodes as UTF-8 (a lone surrogate escape such as
    ``"\\ud800"`` parses in Python but not in safetensors' reader)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise CaptureError(f"{where}: the safetensors header holds the string {item!r}, which "
                                   "is not valid Unicode (a lone surrogate); safetensors refuses it: "
                                   "write the capture again") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def parse_header(handle: BinaryIO, size: int, where: str) -> Header:
    """:func:`read_header` of an open binary file (or buffer) of ``size`` bytes."""
    head = handle.read(8)
    if len(head) < 8:
        raise CaptureError(f"{where}: {size} bytes is too short for a safetensors file (the "
                           "8-byte header length is missing): the file is truncated, copy it again")
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise CaptureError(f"{where}: the header claims {length} bytes but the file has "
                           f"{size - 8} after the length field: the file is truncated or not "
                           "a safetensors file; copy or capture it again")
    text = handle.read(length)
    try:
        raw = json.loads(text.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CaptureError(f"{where}: the safetensors header is not JSON ({exc}): the file is "
                           "damaged or not a capture") from None
    except RecursionError:
        raise CaptureError(f"{where}: the safetensors header nests arrays or objects deeper than a JSON "
                           "parser allows (a capture's header is 3 levels deep): the file is damaged or "
                           "not a capture") from None
    except CaptureError as exc:
        raise CaptureError(f"{where}: {exc}; safetensors refuses it: the file is damaged or not a "
                           "capture") from None
    _strings_are_utf8(raw, where)
    if not isinstance(raw, dict):
        raise CaptureError(f"{where}: the safetensors header is not an object: not a capture")
    metadata = raw.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise CaptureError(f"{where}: __metadata__={metadata!r} must be an object of strings")
    entries = {name: _entry(name, rec, where) for name, rec in raw.items()}
    _check_layout(entries, where)
    data_start = 8 + length
    end = 0
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != end:
            raise CaptureError(f"{where}: tensor {entry.name} starts at data byte {entry.begin}, "
                               f"but the tensor before it ends at {end}: tensors must follow each "
                               "other without gaps or overlaps; the file is damaged, capture it again")
        end = entry.end
    if data_start + end != size:
        state = "truncated" if data_start + end > size else "longer than its header says"
        raise CaptureError(f"{where}: the header's tensors end at byte {data_start + end} but the "
                           f"file has {size} bytes: the file is {state}; copy or capture it again")
    meta = _check_metadata(metadata, LOGITS_ST[entries[LOGITS].dtype], where)
    return Header(entries, meta, data_start, size)


@dataclass(frozen=True)
class RowSampling:
    """Each row's sampling parameters (tensors ``[tokens]``): what the engine sampled the row's
    target from, in :func:`rl_engine.logprob.selected_logprob`'s terms (off: temperature 1,
    top_k 0, top_p 1, min_p 0). Dtypes, shapes and values are checked by :class:`Capture`."""

    temperature: torch.Tensor  # fp32
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # fp32
    min_p: torch.Tensor  # fp32

    def tensors(self) -> dict[str, torch.Tensor]:
        return {TEMPERATURE: self.temperature, TOP_K: self.top_k, TOP_P: self.top_p, MIN_P: self.min_p}

    def rows(self, index: torch.Tensor) -> "RowSampling":
        """The parameters of the rows ``index`` (int64)."""
        return RowSampling(*(t.index_select(0, index) for t in self.tensors().values()))


@dataclass(frozen=True)
class Capture:
    """The tensors and metadata of one capture, checked on construction."""

    logits: torch.Tensor
    targets: torch.Tensor
    active: torch.Tensor
    reported_logp: torch.Tensor | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    source: str = "<memory>"
    sampling: RowSampling | None = None
    reported_processed_logp: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the capture by its name in the file."""
        tensors = {LOGITS: self.logits, TARGETS: self.targets, ACTIVE: self.active}
        if self.reported_logp is not None:
            tensors[REPORTED] = self.reported_logp
        if self.sampling is not None:
            tensors.update(self.sampling.tensors())
        if self.reported_processed_logp is not None:
            tensors[REPORTED_PROCESSED] = self.reported_processed_logp
        return tensors

    def __post_init__(self) -> None:
        where = self.source
        if self.sampling is not None and not isinstance(self.sampling, RowSampling):
            raise CaptureError(f"{where}: sampling is a {type(self.sampling).__name__}; give a RowSampling "
                               "(temperature, top_k, top_p, min_p tensors) or None")
        tensors = self.tensors()
        entries = {}
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise CaptureError(f"{where}: tensor {name} is a {type(tensor).__name__}; give a torch.Tensor")
            codes = [c for c, d in ST_DTYPES.items() if d == tensor.dtype]
            if not codes:
                raise CaptureError(f"{where}: tensor {name} has dtype {tensor.dtype}; {_dtype_rule(name)}")
            entries[name] = TensorEntry(name, codes[0], tuple(tensor.shape), 0, 0)
        _check_layout(entries, where)
        meta = _check_metadata(self.metadata, LOGITS_ST[entries[LOGITS].dtype], where)
        object.__setattr__(self, "metadata", meta)
        check_values(self.logits, self.targets, self.active, self.reported_logp, where)
        check_sampling(self.active, self.sampling, self.reported_processed_logp, where)
        _require_active(self.active, where)

    @property
    def num_tokens(self) -> int:
        return self.logits.shape[0]

    @property
    def vocab(self) -> int:
        return self.logits.shape[1]

    @property
    def logits_dtype(self) -> str:
        return DTYPE_NAMES[self.logits.dtype]


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def check_values(logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor,
                 reported: torch.Tensor | None, where: str, row_offset: int = 0) -> None:
    """The value rules (finite logits, targets in range, a non-empty mask, finite reports).

    ``logits`` may be a block of rows starting at global row ``row_offset`` (the checks then
    name global rows); the non-empty-mask rule is the caller's when it checks blocks.
    """
    vocab = logits.shape[1]
    bad_rows = ~torch.isfinite(logits).all(dim=1)
    if bool(bad_rows.any()):
        row = _first(bad_rows)
        col = int((~torch.isfinite(logits[row])).nonzero()[0, 0])
        raise CaptureError(f"{where}: tensor logits has a non-finite value ({float(logits[row, col])}) "
                           f"at token {row + row_offset}, column {col} ({int(bad_rows.sum())} such "
                           "row(s)); capture the raw LM-head logits, before any sampling processor "
                           "masks columns with -inf")
    out = active & ((targets < 0) | (targets >= vocab))
    if bool(out.any()):
        row = _first(out)
        raise CaptureError(f"{where}: tensor targets holds {int(targets[row])} at active token "
                           f"{row + row_offset}, outside [0, {vocab}) (the logits' vocab); "
                           "targets must be token ids of the logits' vocabulary (shifted by one "
                           "position: the token that follows)")
    if reported is not None:
        bad = active & ~torch.isfinite(reported)
        if bool(bad.any()):
            row = _first(bad)
            raise CaptureError(f"{where}: tensor reported_logp is {float(reported[row])} at active "
                               f"token {row + row_offset}; it must be finite there (leave "
                               "reported_logp out when the engine reported nothing)")


def check_sampling(active: torch.Tensor, sampling: RowSampling | None, reported_processed: torch.Tensor | None,
                   where: str) -> None:
    """The value rules of the sampling parameters (every row, so that a per-row call of
    ``selected_logprob`` accepts them) and of ``reported_processed_logp`` (finite or ``-inf`` on
    active tokens: a target the engine's sampler removed has logprob ``-inf``, never NaN)."""
    if sampling is not None:
        t, k, p, m = sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
        rules = ((TEMPERATURE, ~(torch.isfinite(t) & (t > 0)), "finite and > 0 (1 = off)"),
                 (TOP_K, k < 0, ">= 0 (0 = off; write vLLM's -1 as 0)"),
                 (TOP_P, ~((p > 0) & (p <= 1)), "in (0, 1] (1 = off)"),
                 (MIN_P, ~((m >= 0) & (m <= 1)), "in [0, 1] (0 = off)"))
        for name, bad, rule in rules:
            if bool(bad.any()):
                row = _first(bad)
                value = getattr(sampling, name)[row].item()
                raise CaptureError(f"{where}: tensor {name} is {value} at token {row} ({int(bad.sum())} such "
                                   f"token(s)); it must be {rule} on every token (inactive ones too: write the "
                                   "off value there)")
    if reported_processed is not None:
        bad = active & (torch.isnan(reported_processed) | (reported_processed == float("inf")))
        if bool(bad.any()):
            row = _first(bad)
            raise CaptureError(f"{where}: tensor {REPORTED_PROCESSED} is {float(reported_processed[row])} at "
                               f"active token {row}; it must be finite, or -inf for a target outside the "
                               "kept set (leave the tensor out when the engine reported nothing)")


def _require_active(active: torch.Tensor, where: str) -> None:
    if not bool(active.any()):
        raise CaptureError(f"{where}: tensor active has no true value; a capture must mark at "
                           "least one token to compare")


def build_metadata(*, engine: str, engine_version: str, model: str, dtype: str, tp: int = 1,
                   notes: str = "") -> dict[str, str]:
    """The header metadata of a capture, with ``format`` filled in."""
    return {"format": FORMAT, "engine": engine, "engine_version": engine_version,
            "model": model, "dtype": dtype, "tp": str(tp), "notes": notes}


def canonical_header(data: bytes) -> bytes:
    """safetensors bytes with the header's keys sorted (metadata and tensors), compact, padded with
    spaces to a multiple of 8 bytes; the tensor data is unchanged (its offsets are relative to the end
    of the header). safetensors writes the metadata in hash-map order, which changes from one call to
    the next: the same capture would get another SHA-256, so another case hash, each time it is written."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length].decode("utf-8"))
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + length:]


def write_capture(path: str | os.PathLike[str], capture: Capture) -> str:
    """Write ``capture`` to ``path`` atomically; returns the file's SHA-256.

    The capture was checked when it was built; its bytes are built in memory (the file's size
    once more), their header made canonical (:func:`canonical_header`: the same capture always
    gives the same bytes, so the same SHA-256) and checked as :func:`read_header` checks a file,
    then written to a temporary name beside ``path`` and renamed.
    """
    from safetensors.torch import save

    tensors = capture.tensors()
    data = canonical_header(save({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                                 metadata=dict(capture.metadata)))
    parse_header(io.BytesIO(data), len(data), str(path))
    jsonio.atomic_write_bytes(path, data)
    return jsonio.sha256_bytes(data)


def _open(path: str | os.PathLike[str]) -> Any:
    from safetensors import safe_open

    jsonio.require_regular(path)
    return safe_open(str(path), framework="pt", device="cpu")


def read_capture(path: str | os.PathLike[str]) -> Capture:
    """Read and check a whole capture (header first, then every value)."""
    header = read_header(path)
    with _open(path) as handle:
        tensors = {name: handle.get_tensor(name) for name in header.entries}
    sampling = RowSampling(*(tensors[n] for n in SAMPLING)) if TEMPERATURE in tensors else None
    return Capture(tensors[LOGITS], tensors[TARGETS], tensors[ACTIVE], tensors.get(REPORTED),
                   header.metadata, source=str(path), sampling=sampling,
                   reported_processed_logp=tensors.get(REPORTED_PROCESSED))


def read_tokens(path: str | os.PathLike[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(targets, active)`` of a capture whose header is checked, without reading its logits."""
    read_header(path)
    with _open(path) as handle:
        return handle.get_tensor(TARGETS), handle.get_tensor(ACTIVE)


def read_rows(path: str | os.PathLike[str], header: Header, rows: list[int] | range,
              columns: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Only the given token rows and vocabulary columns ``[start, end)`` of a checked capture.

    safetensors maps the file and slices lazily, so a TP rank reads its own columns and a CP
    rank its own tokens; the value rules are checked on what was read.
    """
    start, end = columns
    if not (0 <= start < end <= header.vocab):
        raise CaptureError(f"{path}: columns [{start}, {end}) are outside the capture's vocab "
                           f"{header.vocab}; shard within [0, vocab)")
    index = torch.tensor(list(rows), dtype=torch.int64)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= header.num_tokens):
        raise CaptureError(f"{path}: rows outside [0, {header.num_tokens}) requested")
    out: dict[str, torch.Tensor] = {}
    runs: list[tuple[int, int]] = []  # consecutive rows, read as one slice each
    for row in index.tolist():
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    with _open(path) as handle:
        view = handle.get_slice(LOGITS)
        blocks = [view[lo:hi, start:end] for lo, hi in runs]
        out[LOGITS] = (torch.cat(blocks) if blocks else
                       torch.empty(0, end - start, dtype=ST_DTYPES[header.entries[LOGITS].dtype]))
        for name in (TARGETS, ACTIVE, REPORTED):
            if name in header.entries:
                out[name] = handle.get_tensor(name)[index]
    return out


def read_sampling(path: str | os.PathLike[str], header: Header,
                  rows: list[int] | range | None = None) -> RowSampling:
    """The sampling tensors of the rows ``rows`` (default: every row) of a checked capture, their values
    checked (:func:`check_sampling`); a capture without them is refused naming the four tensors."""
    missing = [name for name in SAMPLING if name not in header.entries]
    if missing:
        raise CaptureError(f"{path}: the capture carries no sampling tensors ({', '.join(SAMPLING)}): its rollout's "
                           "per-row sampling parameters were not captured; capture it again with them "
                           "(Capture(..., sampling=RowSampling(temperature, top_k, top_p, min_p)), docs/capture.md), "
                           "or run at the case's own sampling")
    with _open(path) as handle:
        tensors = {name: handle.get_tensor(name) for name in SAMPLING}
    sampling = RowSampling(*(tensors[name] for name in SAMPLING))
    # checked whole, so a refusal names the capture's token, not its index among a rank's rows
    check_sampling(torch.zeros(sampling.temperature.shape[0], dtype=torch.bool), sampling, None, str(path))
    return sampling if rows is None else sampling.rows(torch.tensor(list(rows), dtype=torch.int64))


__all__ = [
    "Capture", "CaptureError", "FORMAT", "Header", "RowSampling", "build_metadata", "canonical_header",
    "check_sampling", "check_values",
    "read_capture", "read_header", "read_rows", "read_sampling", "read_tokens", "write_capture",
]
