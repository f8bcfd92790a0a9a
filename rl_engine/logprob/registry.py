"""Backend registry and fail-closed dispatch.

Each backend declares what it can do. Dispatch returns the op with provenance; an explicit
request for an unavailable or incapable backend raises with every reason, and nothing ever
falls back silently: ``fallback`` is true only when ``auto`` skipped an eligible candidate.

``auto`` takes the fastest backend that serves the device, in priority order: the Triton
kernels on cuda, the fused C kernel on cpu, the eager backend otherwise. Every one of them
computes ``docs/arithmetic.md`` and gives the same bytes (``tests/test_fused_cpu.py``,
``tests/test_triton_backend.py``), so the choice changes speed, never a result; it is recorded
with its reason in the provenance. A backend is chosen by ``auto`` only on its
``auto_devices`` (the Triton interpreter, a CPU mode its user selects, never is).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rl_engine.logprob.backends.description import (
    BackendDescription,
    descriptions,
    interpreter_devices,
)
from rl_engine.logprob.backends.description import backend_devices as described_devices
from rl_engine.logprob.backends.triton.triton_backend import env_mode
from rl_engine.logprob.contract import DETERMINISM_SCOPES, LogprobContract, LogprobContractError
from rl_engine.tables import AUTO, DTYPES


class BackendUnavailableError(LogprobContractError):
    """An explicitly requested backend cannot serve the call; lists every reason."""


@dataclass(frozen=True)
class BackendCapabilities:
    dtypes: frozenset[str]
    max_tp_world_size: int
    supports_padding: bool
    mask_modes: frozenset[str]
    exports_lse: bool
    determinism_scopes: frozenset[str]
    devices: frozenset[str]
    processed_logprobs: bool = False  # top_k / top_p / min_p (docs/arithmetic.md section 13)
    processed_row_temperature: bool = False  # ... together with a temperature per row, in one call

    def reasons_incapable(self, contract: LogprobContract, device: str, processed: bool = False,
                          row_temperature: bool = False) -> list[str]:
        reasons = []
        if processed and not self.processed_logprobs:
            reasons.append("processed logprobs (top_k / top_p / min_p) not supported yet")
        elif processed and row_temperature and not self.processed_row_temperature:
            reasons.append("processed logprobs (top_k / top_p / min_p) with a temperature per row not supported")
        if contract.logits_dtype not in self.dtypes:
            reasons.append(f"dtype {contract.logits_dtype} not in {sorted(self.dtypes)}")
        if contract.tp_world_size > self.max_tp_world_size:
            reasons.append(
                f"tp_world_size {contract.tp_world_size} > max {self.max_tp_world_size}"
            )
        if contract.padded_vocab_size != contract.real_vocab_size and not self.supports_padding:
            reasons.append("padded vocabulary not supported")
        if contract.mask_mode not in self.mask_modes:
            reasons.append(f"mask_mode {contract.mask_mode} not in {sorted(self.mask_modes)}")
        if contract.determinism_scope not in self.determinism_scopes:
            reasons.append(
                f"determinism_scope {contract.determinism_scope} not in "
                f"{sorted(self.determinism_scopes)}"
            )
        if device not in self.devices:
            reasons.append(f"device {device} not in {sorted(self.devices)}")
        return reasons

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtypes": sorted(self.dtypes),
            "max_tp_world_size": self.max_tp_world_size,
            "supports_padding": self.supports_padding,
            "mask_modes": sorted(self.mask_modes),
            "exports_lse": self.exports_lse,
            "determinism_scopes": sorted(self.determinism_scopes),
            "devices": sorted(self.devices),
            "processed_logprobs": self.processed_logprobs,
            "processed_row_temperature": self.processed_row_temperature,
        }


@dataclass(frozen=True)
class BackendSpec:
    backend_id: str
    capabilities: BackendCapabilities
    availability: Callable[[], str | None]  # None when available, else the reason
    build: Callable[[], Any]
    priority: int = 0
    auto_devices: frozenset[str] | None = None  # where auto may pick it (None: its devices)
    mode: Callable[[], str | None] = lambda: None  # how it runs (recorded in the provenance)


@dataclass(frozen=True)
class Dispatch:
    """The op chosen for a call and how it was chosen."""

    op: Any
    requested_backend: str
    actual_backend: str
    fallback: bool
    rejections: tuple[tuple[str, str], ...] = field(default=())
    reason: str = "requested explicitly"
    mode: str | None = None  # e.g. the Triton backend's "compiled" or "interpreter"

    def provenance(self) -> dict[str, Any]:
        return {
            "requested_backend": self.requested_backend,
            "actual_backend": self.actual_backend,
            "fallback": self.fallback,
            "rejections": [{"backend": b, "reason": r} for b, r in self.rejections],
            "reason": self.reason,
            "mode": self.mode,
        }


def backend_table_devices(backend_id: str, root: str | os.PathLike[str] | None = None) -> tuple[str, ...]:
    """The devices ``backend_id`` serves in this process: its description's, or, for a backend
    with an interpreter and ``RL_ENGINE_TRITON_MODE=interpreter``, its interpreter's (a bad value
    of the variable keeps the description's; the backend's availability then names the error)."""
    interpreted = interpreter_devices(root)
    if backend_id in interpreted:
        try:
            if env_mode() == "interpreter":
                return interpreted[backend_id]
        except LogprobContractError:
            pass
    return described_devices(root)[backend_id]


def _arith_capabilities(backend_id: str, root: str | os.PathLike[str] | None = None) -> BackendCapabilities:
    """What every backend of docs/arithmetic.md serves; they differ only in their devices
    (:func:`backend_table_devices`) and in what their descriptions say of processed logprobs."""
    described = {d.backend_id: d for d in descriptions(root)}[backend_id]
    return BackendCapabilities(
        dtypes=frozenset(DTYPES),
        max_tp_world_size=1 << 16,
        supports_padding=True,
        mask_modes=frozenset({"explicit"}),
        exports_lse=True,
        determinism_scopes=frozenset(DETERMINISM_SCOPES),
        devices=frozenset(backend_table_devices(backend_id, root)),
        processed_logprobs=described.processed_logprobs,
        processed_row_temperature=described.processed_row_temperature,
    )


def _spec(description: BackendDescription, root: str | os.PathLike[str] | None) -> BackendSpec:
    availability = description.load("availability")
    mode = description.load("mode")
    return BackendSpec(
        backend_id=description.backend_id,
        capabilities=_arith_capabilities(description.backend_id, root),
        availability=availability if availability is not None else lambda: None,
        build=lambda: description.load("engine")(),  # type: ignore[misc]
        priority=description.priority,
        auto_devices=frozenset(description.auto_devices) if description.auto_devices is not None else None,
        mode=mode if mode is not None else lambda: None,
    )


def default_registry(root: str | os.PathLike[str] | None = None) -> dict[str, BackendSpec]:
    """The backends described under ``root`` (default: ``rl_engine/logprob/backends/``), highest
    priority first for ``auto``; each from its folder's one description."""
    specs = [_spec(description, root) for description in descriptions(root)]
    return {spec.backend_id: spec for spec in sorted(specs, key=lambda s: -s.priority)}


def backend_ids(registry: dict[str, BackendSpec] | None = None) -> list[str]:
    return list((registry or default_registry()).keys())


def backend_devices(backend_id: str, registry: dict[str, BackendSpec] | None = None) -> frozenset[str]:
    """The devices a registered backend declares (empty for an unknown id)."""
    spec = (registry or default_registry()).get(backend_id)
    return spec.capabilities.devices if spec is not None else frozenset()


def machine_lacks(device: str) -> str | None:
    """Why this machine cannot run anything on ``device`` (None when it can)."""
    if device == "cuda" and not torch.cuda.is_available():
        return "device cuda is not available on this machine"
    return None


def _rejection(spec: BackendSpec, contract: LogprobContract, device: str, processed: bool = False,
               row_temperature: bool = False) -> str | None:
    reasons = spec.capabilities.reasons_incapable(contract, device, processed, row_temperature)
    if reasons:
        return "incapable: " + "; ".join(reasons)
    unavailable = spec.availability() or machine_lacks(device)
    if unavailable is not None:
        return "unavailable: " + unavailable
    return None


def _build(spec: BackendSpec) -> Any:
    try:
        return spec.build()
    except Exception as exc:  # noqa: BLE001 - a backend that cannot be built fails closed
        raise BackendUnavailableError(
            f"backend={spec.backend_id!r} could not be built: {type(exc).__name__}: {exc}; "
            "nothing falls back"
        ) from exc


def dispatch(
    requested: str,
    contract: LogprobContract,
    device: str,
    registry: dict[str, BackendSpec] | None = None,
    processed: bool = False,
    row_temperature: bool = False,
) -> Dispatch:
    """Choose the backend for ``contract`` on ``device``; explicit ids never fall back.

    ``processed``: the call has sampling parameters (section 13); a backend without processed
    logprobs is incapable of it (``auto`` passes over it, an explicit request raises).
    ``row_temperature``: the call has a temperature per row; with ``processed``, a backend whose
    description lacks ``processed_row_temperature`` is incapable of it in the same way."""
    registry = registry if registry is not None else default_registry()
    if requested != AUTO:
        if requested not in registry:
            raise BackendUnavailableError(
                f"backend={requested!r} is not registered; use one of {list(registry)} "
                f"or {AUTO!r}"
            )
        reason = _rejection(registry[requested], contract, device, processed, row_temperature)
        if reason is not None:
            raise BackendUnavailableError(
                f"backend={requested!r} was requested explicitly and cannot serve this call "
                f"({reason}); nothing falls back: request a capable backend"
            )
        spec = registry[requested]
        return Dispatch(_build(spec), requested, requested, False, mode=spec.mode())
    rejections: list[tuple[str, str]] = []
    eligible_rejected = False
    for spec in registry.values():
        reason = _rejection(spec, contract, device, processed, row_temperature)
        if reason is None and spec.auto_devices is not None and device not in spec.auto_devices:
            reason = f"not chosen by auto on device {device} (auto takes it on {sorted(spec.auto_devices)})"
        if reason is None:
            why = (
                f"auto: the highest-priority backend capable and available on device {device} "
                f"(priority order {list(registry)}; every one gives the same bytes)"
            )
            return Dispatch(
                _build(spec), AUTO, spec.backend_id, eligible_rejected, tuple(rejections), why,
                spec.mode(),
            )
        rejections.append((spec.backend_id, reason))
        eligible_rejected = eligible_rejected or reason.startswith("unavailable")
    raise BackendUnavailableError(
        "backend='auto' found no capable, available backend: "
        + "; ".join(f"{b}: {r}" for b, r in rejections)
    )
