"""One agreement step per call: every rank of a group says what it is about to do, or all raise.

A collective pairs with whatever collective its peers enter next. When the ranks of a TP
group disagree on a call (one asks for the entropy, one holds other targets, one rejected
its own input), the first numerical collective either aborts the process (buffers of
different sizes), blocks until the process-group timeout (a rank that raised alone is
missing), or silently returns each rank its own answer. So every call that communicates
starts with the same collective on every rank, whatever each rank's state: one all-gather
of a fixed-size ``uint8`` record (:data:`RECORD_BYTES`) holding

* a magic word and the name of the call (``selected_logprob``, ``gather_tokens``), so two
  ranks in different calls are told apart instead of exchanging garbage;
* the rank's local verdict: ``ok``, or the first line of its local error (truncated);
* one 16-byte slot per field of the call: the value's text when it is short (``true``,
  ``16``, ``zigzag``), else a SHA-256 prefix of it (a contract fingerprint, a digest of the
  targets or of the mask).

Every rank decodes every record the same way and raises the same
:class:`~rl_engine.logprob.contract.LogprobContractError`, naming the field, the values and
the ranks, before any floating-point collective. The cost is one small transport-only
collective per call (measured in ``tests/test_rank_agreement.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rl_engine.distributed.mesh import group_geometry
from rl_engine.logprob.contract import LogprobContractError

MAGIC = b"RLA1"
SLOT_BYTES = 16
MAX_FIELDS = 40
CALL_BYTES = 32
MESSAGE_BYTES = 344
# magic, verdict flag, field count, message length (2 bytes), the call's name, fields, message
RECORD_BYTES = 4 + 1 + 1 + 2 + CALL_BYTES + MAX_FIELDS * SLOT_BYTES + MESSAGE_BYTES
assert RECORD_BYTES == 1024
TEXT, DIGEST = ord("t"), ord("h")
UNKNOWN = "?"  # a field a rank could not compute (its verdict says why)


def encode_slot(text: str) -> bytes:
    """16 bytes: ``t`` + the UTF-8 text when it fits in 15 bytes, else ``h`` + its SHA-256 prefix."""
    raw = text.encode("utf-8")
    if len(raw) < SLOT_BYTES:
        return bytes([TEXT]) + raw.ljust(SLOT_BYTES - 1, b"\0")
    return bytes([DIGEST]) + hashlib.sha256(raw).digest()[: SLOT_BYTES - 1]


def decode_slot(slot: bytes) -> str:
    """The text of a slot, or ``sha256:<prefix>`` for a digest slot."""
    if slot[0] == TEXT:
        return slot[1:].rstrip(b"\0").decode("utf-8", errors="replace")
    return "sha256:" + slot[1:7].hex()


def tensor_digest(tensor: torch.Tensor) -> str:
    """``sha256:<hex>`` of a tensor's dtype, shape and little-endian bytes (copied to the host)."""
    from rl_engine.tensorio import tensor_bytes

    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode("ascii"))
    digest.update(tensor_bytes(tensor))
    return "sha256:" + digest.hexdigest()


def record_device(tensor: Any) -> torch.device:
    """Where a rank's record travels: the device of its input, or the CPU when that is not a
    device (a meta tensor, or not a tensor at all), so a rank refusing such an input still
    takes part in the agreement."""
    if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
        return tensor.device
    return torch.device("cpu")


@dataclass(frozen=True)
class CallRecord:
    """What one rank is about to do: the call, its verdict and its fields (name, value text)."""

    call: str
    verdict: str | None
    fields: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if len(self.fields) > MAX_FIELDS:
            raise ValueError(f"{len(self.fields)} fields exceed MAX_FIELDS={MAX_FIELDS}")
        if not self.call.isascii() or len(self.call) > CALL_BYTES:
            raise ValueError(f"call={self.call!r} must be ASCII of at most {CALL_BYTES} characters")

    def encode(self) -> bytes:
        message = b""
        if self.verdict is not None:
            message = self.verdict.encode("utf-8")[:MESSAGE_BYTES]
            message = message.decode("utf-8", errors="ignore").encode("utf-8")  # whole chars
        head = MAGIC + bytes([0 if self.verdict is None else 1, len(self.fields)])
        head += len(message).to_bytes(2, "little") + self.call.encode("ascii").ljust(CALL_BYTES, b"\0")
        body = b"".join(encode_slot(value) for _, value in self.fields)
        body = body.ljust(MAX_FIELDS * SLOT_BYTES, b"\0")
        out = head + body + message.ljust(MESSAGE_BYTES, b"\0")
        assert len(out) == RECORD_BYTES
        return out


@dataclass(frozen=True)
class Received:
    """One peer's record as decoded (field values as slot texts)."""

    magic_ok: bool
    call: str
    failed: bool
    message: str
    values: tuple[str, ...]


def decode_record(raw: bytes) -> Received:
    if len(raw) != RECORD_BYTES or raw[:4] != MAGIC:
        return Received(False, "", False, "", ())
    failed, count = bool(raw[4]), raw[5]
    length = int.from_bytes(raw[6:8], "little")
    call = raw[8 : 8 + CALL_BYTES].rstrip(b"\0").decode("ascii", errors="replace")
    start = 8 + CALL_BYTES
    values = tuple(
        decode_slot(raw[start + i * SLOT_BYTES : start + (i + 1) * SLOT_BYTES]) for i in range(count)
    )
    msg_start = start + MAX_FIELDS * SLOT_BYTES
    message = raw[msg_start : msg_start + length].decode("utf-8", errors="replace")
    return Received(True, call, failed, message, values)


def _rank_names(group: Any, size: int) -> list[str]:
    """``tp_rank r (global g)`` labels for the ranks of ``group``."""
    try:
        ranks = dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - labels only; the group rank alone still names the rank
        ranks = list(range(size))
    return [f"{r} (global {g})" for r, g in enumerate(ranks)]


def _ranks(indices: list[int]) -> str:
    return f"rank {indices[0]}" if len(indices) == 1 else f"ranks {indices}"


def agree(
    record: CallRecord,
    group: Any,
    device: torch.device,
    *,
    role: str = "TP",
    hints: dict[str, str] | None = None,
) -> None:
    """Exchange ``record`` with every rank of ``group``; raise the same error on every rank.

    With a group of one rank (or ``None``) nothing is exchanged and a local verdict raises
    at once. Otherwise: one all-gather of :data:`RECORD_BYTES` bytes per rank, then the
    checks in this order: every record is an agreement record of the same call; no rank
    rejected its inputs; every field is equal on every rank. ``hints`` maps a field name
    (or a prefix ending in ``.``) to the fix that the message suggests.
    """
    size, _ = group_geometry(group)
    if size == 1:
        if record.verdict is not None:
            raise LogprobContractError(record.verdict)
        return
    mine = torch.frombuffer(bytearray(record.encode()), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    host = torch.stack(gathered).cpu().numpy()
    received = [decode_record(host[r].tobytes()) for r in range(size)]
    _judge(record, received, _rank_names(group, size), role, hints or {})


def _judge(
    record: CallRecord, received: list[Received], names: list[str], role: str,
    hints: dict[str, str],
) -> None:
    call = record.call
    strangers = [r for r, got in enumerate(received) if not got.magic_ok or got.call != call]
    if strangers:
        seen = {r: (got.call if got.magic_ok else "another collective") for r, got in enumerate(received)}
        raise LogprobContractError(
            f"{call}: the {role} ranks are not in the same call (per {role} rank: {seen}); "
            f"{_ranks(strangers)} entered another collective. Every rank of the {role} group "
            "must make the same sequence of calls with the same arguments"
        )
    failed = [r for r, got in enumerate(received) if got.failed]
    if failed:
        details = "; ".join(f"{role} rank {names[r]}: {received[r].message}" for r in failed)
        raise LogprobContractError(
            f"{call}: {role} {_ranks(failed)} rejected {'its' if len(failed) == 1 else 'their'} "
            f"inputs, so every rank of the "
            f"{role} group stops before any numerical collective. {details}"
        )
    counts = {len(got.values) for got in received}
    if counts != {len(record.fields)}:  # pragma: no cover - one code version on every rank
        raise LogprobContractError(
            f"{call}: the {role} ranks send different numbers of fields ({sorted(counts)}); "
            "run the same rl_engine version on every rank"
        )
    problems = []
    for i, (name, _) in enumerate(record.fields):
        values = [got.values[i] for got in received]
        if len(set(values)) == 1:
            continue
        groups: dict[str, list[int]] = {}
        for r, value in enumerate(values):
            groups.setdefault(value, []).append(r)
        said = ", ".join(f"{_ranks(rs)}: {name}={value}" for value, rs in groups.items())
        problems.append((name, said))
    if problems:
        fixes = []
        for name, _ in problems:
            hint = hints.get(name) or next(
                (h for key, h in hints.items() if key.endswith(".") and name.startswith(key)), None
            )
            if hint and hint not in fixes:
                fixes.append(hint)
        fields = [name for name, _ in problems]
        raise LogprobContractError(
            f"{call}: the {role} ranks disagree on {', '.join(fields)} ("
            + "; ".join(said for _, said in problems)
            + f"; {role} ranks: {names}). "
            + (" ".join(fixes) if fixes else f"Give every {role} rank the same arguments.")
        )


__all__ = [
    "CallRecord",
    "MAGIC",
    "RECORD_BYTES",
    "Received",
    "UNKNOWN",
    "agree",
    "decode_record",
    "decode_slot",
    "encode_slot",
    "record_device",
    "tensor_digest",
]
