"""Each backend's one description, and the tables built from them.

A backend lives in its own folder, ``rl_engine/logprob/backends/<name>/``, whose
``description.py`` holds one :class:`BackendDescription` named ``DESCRIPTION``. The registry
(:func:`rl_engine.logprob.registry.default_registry`), the device table
(:func:`backend_devices`), the schema enum of ``schemas/defs.schema.json`` (:func:`schema_enum`,
checked by ``tests/test_backend_descriptions.py``) and the replay's list of backends the eager
reference replays (:func:`arith_backends`) are all read from these descriptions, so a new
backend touches its folder and nothing else in the engine.

Torch-free: a description names its engine and its availability check as ``"module:attribute"``
strings, imported only when the registry builds or probes the backend, so the harness (the
case rules, the workflow's config check) reads the device table without importing torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

DESCRIPTION_FILE = "description.py"
DESCRIPTION_NAME = "DESCRIPTION"
DEVICES = ("cpu", "cuda")
_REFERENCE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_ID = re.compile(r"^[a-z0-9][a-z0-9-]*$")


class BackendDescriptionError(ValueError):
    """A backend's description that cannot be used; the message names the field, the value and the fix."""


def _devices_problem(name: str, value: Any, empty_ok: bool) -> str | None:
    if not isinstance(value, tuple) or not all(isinstance(d, str) for d in value):
        return f"{name}={value!r} must be a tuple of device names from {list(DEVICES)}"
    if not value and not empty_ok:
        return f"{name}=() names no device; give at least one of {list(DEVICES)}"
    unknown = [d for d in value if d not in DEVICES]
    if unknown or len(set(value)) != len(value):
        return f"{name}={value!r} must name distinct devices from {list(DEVICES)}"
    return None


@dataclass(frozen=True)
class BackendDescription:
    """What the engine knows about one backend, written once in its folder.

    ``engine``, ``availability`` and ``mode`` are ``"module:attribute"``: the engine class
    (called with no argument), a function returning ``None`` when the backend can run here or
    the reason it cannot, and a function returning how it runs (recorded in the provenance).
    ``arith_versions`` are the versions of ``docs/arithmetic.md`` the backend computes: the eager
    reference replays a case of any backend computing the current version.
    ``interpreter_devices`` are served only when the user selects the interpreter
    (``RL_ENGINE_TRITON_MODE=interpreter``); ``auto_devices`` are where ``auto`` may choose it
    (``None``: its ``devices``).
    """

    backend_id: str
    summary: str
    devices: tuple[str, ...]
    engine: str
    availability: str | None = None
    priority: int = 0
    arith_versions: tuple[str, ...] = ()
    interpreter_devices: tuple[str, ...] = ()
    auto_devices: tuple[str, ...] | None = None
    mode: str | None = None
    processed_logprobs: bool = False  # top_k / top_p / min_p (docs/arithmetic.md section 13); else refused by name
    # processed logprobs with a temperature per row in one call (a rollout capture's sampling tensors,
    # a campaign's ``sampling: capture``); else the engine refuses that call by name
    processed_row_temperature: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.backend_id, str) or not _ID.match(self.backend_id):
            problems.append(f"backend_id={self.backend_id!r} must be lower-case letters, digits and '-'")
        if not isinstance(self.summary, str) or not self.summary.strip():
            problems.append(f"summary={self.summary!r} must say in a few words what the backend is")
        for name, empty_ok in (("devices", False), ("interpreter_devices", True)):
            problem = _devices_problem(name, getattr(self, name), empty_ok)
            if problem:
                problems.append(problem)
        if self.auto_devices is not None:
            problem = _devices_problem("auto_devices", self.auto_devices, True)
            if problem:
                problems.append(problem)
        for name in ("engine", "availability", "mode"):
            value = getattr(self, name)
            if (value is not None or name == "engine") and not (isinstance(value, str) and _REFERENCE.match(value)):
                problems.append(f"{name}={value!r} must be 'package.module:attribute'")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            problems.append(f"priority={self.priority!r} must be an int (auto tries the highest first)")
        if not isinstance(self.arith_versions, tuple) or not all(isinstance(v, str) for v in self.arith_versions):
            problems.append(f"arith_versions={self.arith_versions!r} must be a tuple of version strings "
                            "such as 'rl-engine-arith/2' (empty: computes none)")
        for name in ("processed_logprobs", "processed_row_temperature"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r} must be True or False")
        if self.processed_row_temperature and not self.processed_logprobs:
            problems.append("processed_row_temperature=True needs processed_logprobs=True (it is processed "
                            "logprobs with a temperature per row)")
        if problems:
            raise BackendDescriptionError(f"backend description {self.backend_id!r}: " + "; ".join(problems))

    def load(self, name: str) -> Callable[..., Any] | None:
        """The object one of ``engine``, ``availability`` or ``mode`` names (None when unset)."""
        reference = getattr(self, name)
        if reference is None:
            return None
        module, attribute = reference.split(":")
        return getattr(importlib.import_module(module), attribute)


def _load_file(path: Path) -> BackendDescription:
    spec = importlib.util.spec_from_file_location(f"_backend_description_{path.parent.name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = getattr(module, DESCRIPTION_NAME, None)
    if not isinstance(found, BackendDescription):
        raise BackendDescriptionError(
            f"{path} defines {DESCRIPTION_NAME}={found!r}; it must define {DESCRIPTION_NAME} = BackendDescription(...)")
    return found


@lru_cache(maxsize=None)
def _descriptions(root: Path) -> tuple[BackendDescription, ...]:
    found: list[BackendDescription] = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and (p / DESCRIPTION_FILE).is_file()):
        if root == Path(__file__).parent:
            module = importlib.import_module(f"{__package__}.{folder.name}.description")
            description = getattr(module, DESCRIPTION_NAME)
        else:
            description = _load_file(folder / DESCRIPTION_FILE)
        found.append(description)
    ids = [d.backend_id for d in found]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise BackendDescriptionError(f"backend_id {duplicates} is described twice under {root}; each id names one backend")
    return tuple(found)


def descriptions(root: str | os.PathLike[str] | None = None) -> tuple[BackendDescription, ...]:
    """Every backend described under ``root`` (default: this package's folders), by folder name."""
    return _descriptions(Path(root).resolve() if root is not None else Path(__file__).parent)


def backend_devices(root: str | os.PathLike[str] | None = None) -> dict[str, tuple[str, ...]]:
    """The device table: each backend's id and the devices it runs on."""
    return {d.backend_id: d.devices for d in descriptions(root)}


def interpreter_devices(root: str | os.PathLike[str] | None = None) -> dict[str, tuple[str, ...]]:
    """The devices a backend serves only in its interpreter mode, for the backends that have one."""
    return {d.backend_id: d.interpreter_devices for d in descriptions(root) if d.interpreter_devices}


def schema_enum(root: str | os.PathLike[str] | None = None) -> list[str]:
    """The ``backend_id`` enum ``schemas/defs.schema.json`` must hold."""
    return [d.backend_id for d in descriptions(root)]


def processed_row_temperature_backends(root: str | os.PathLike[str] | None = None) -> tuple[str, ...]:
    """The backends whose engines take processed-logprob parameters and a temperature per row in one
    call: the ones a campaign at a capture's per-row sampling (``sampling: capture``) may name."""
    return tuple(d.backend_id for d in descriptions(root) if d.processed_row_temperature)


def arith_backends(version: str, root: str | os.PathLike[str] | None = None) -> tuple[str, ...]:
    """The backends computing arithmetic ``version``: the eager reference replays any of their cases."""
    return tuple(d.backend_id for d in descriptions(root) if version in d.arith_versions)
