"""One campaign case: every parameter, every rule about them, and every fact derived from them.

A :class:`Case` holds every input parameter of a run except the topology; it refuses to exist
while any rule of :func:`case_problems` is broken. :func:`check_topology` holds every rule that
makes a ``TP x CP`` run of a case impossible, :func:`check_matrix` the rule for a matrix of
topologies. The constant sets and defaults are in :mod:`rl_engine.tables`.

This module is the one owner of what a case determines (``tests/test_case.py`` reads every other
module for a second one; ``docs/design.md`` draws who calls what):

- its config keys, both ways: :data:`CONFIG_FIELDS`, :meth:`Case.from_config`,
  :func:`config_key_of` (the key an error names), :func:`record_config` (SUMMARY.md's reproduce.yaml);
- a rank's contract: :meth:`Case.contract` (:func:`record_contract` for a record verify replays);
- the oracle's case arguments: :meth:`Case.drift` (:func:`record_oracle_drift` for a record
  verify recomputes);
- the resolved case and its hash, which names the run: :func:`resolved_case`, :func:`case_hash`,
  :meth:`Case.run_hash`;
- not its inputs: :func:`rl_engine.campaign.captured.case_inputs` and ``case_rank_inputs`` make them
  from the case's record (the recipe-or-capture branch imports torch, and the captured module reads
  the case: the case importing it back would close an import circle, ``tests/test_layers.py``).

The case file (``case.json``, ``schemas/case.schema.json``) is a case with its topologies: what
the workflow's resolved config becomes, and what the plan is built from
(:func:`case_document`, :func:`load_case_file`). Torch-free at import.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from typing import Any, Mapping, Sequence

from rl_engine import jsonio, schemas
from rl_engine.arith.temperature import TemperatureError, temperature32
from rl_engine.distributed.bounds import BoundsError, check_cp_split, even_vocab_shards, tile_width
from rl_engine.logprob.backends.description import (
    backend_devices,
    interpreter_devices,
    processed_row_temperature_backends,
)
from rl_engine.tables import (
    AUTO,
    CP_LAYOUTS,
    DEFAULT_PG_TIMEOUT_S,
    DEFAULT_TOLERANCES,
    DEVICE_DIST_BACKENDS,
    DTYPES,
    LOGIT_SCALE_BOUNDS,
    MAX_CP,
    MAX_LOGIT_ELEMENTS,
    MAX_PG_TIMEOUT_S,
    MAX_SEED,
    MAX_THREADS_PER_RANK,
    MAX_TOKENS,
    MAX_TP,
    MIN_MATRIX_TOPOLOGIES,
    SCHEMA_VERSION,
    TRITON_MODE_ENV,
)
from rl_engine.validators import choice_problem, int_problem, real_problem, require


class CaseError(ValueError):
    """A case or topology that cannot run; the message names the field, the value and the fix."""


def case_devices(backend: str) -> tuple[str, ...]:
    """The devices a campaign may run ``backend`` on: its table entry, or its interpreter's
    when the user selected that mode (``RL_ENGINE_TRITON_MODE=interpreter`` for the Triton
    backend, recorded in every report's ``dispatch.mode``)."""
    interpreted = interpreter_devices()
    if backend in interpreted and os.environ.get(TRITON_MODE_ENV) == "interpreter":
        return interpreted[backend]
    return backend_devices()[backend]


def _number_problem(name: str, value: Any, positive: bool) -> str | None:
    problem = real_problem(name, value)
    if problem is not None:
        return problem
    if value < 0 or (positive and value == 0):
        return f"{name}={value!r} must be {'> 0' if positive else '>= 0'}"
    return None


def _int(name: str, value: Any, minimum: int) -> None:
    require(int_problem(name, value, minimum), CaseError)


def parse_topology(item: str) -> tuple[int, int]:
    """``"2x1"`` -> ``(2, 1)``: positive integers, no leading zero."""
    part = item.strip().lower()
    pieces = part.split("x")
    if len(pieces) != 2 or not all(p.isdigit() and p[0] != "0" for p in pieces):
        raise CaseError(
            f"--topologies item {item!r} is not <TP>x<CP> with positive integers; "
            "write e.g. 1x1,2x2,8x1"
        )
    return int(pieces[0]), int(pieces[1])


def parse_topologies(items: str | Sequence[str]) -> tuple[tuple[int, int], ...]:
    """``"1x1,2x2,8x1"`` (or ``["1x1", "2x2", "8x1"]``) -> ``((1, 1), (2, 2), (8, 1))``.

    In the given order, each topology once.
    """
    out: list[tuple[int, int]] = []
    for item in items.split(",") if isinstance(items, str) else items:
        pair = parse_topology(item)
        if pair in out:
            raise CaseError(f"--topologies lists {pair[0]}x{pair[1]} twice; list each topology once")
        out.append(pair)
    return tuple(out)


def matrix_problem(count: int) -> str | None:
    """Why a matrix of ``count`` topologies cannot be a campaign (None when it can)."""
    if count >= MIN_MATRIX_TOPOLOGIES:
        return None
    return (
        f"{count} topolog{'y' if count == 1 else 'ies'} listed, but the cross-topology check "
        f"compares at least {MIN_MATRIX_TOPOLOGIES}; list {MIN_MATRIX_TOPOLOGIES} or more "
        "(e.g. 1x1 and 2x1)"
    )


def check_matrix(topologies: Sequence[tuple[int, int]]) -> None:
    """A campaign matrix (``--topologies``, the workflow's ``topologies``) lists at least two."""
    problem = matrix_problem(len(topologies))
    if problem is not None:
        raise CaseError(f"--topologies: {problem}; to plan one topology alone use --tp T --cp C")


def case_problems(values: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Every broken rule of a case's parameters, as ``(field, message)`` in field order.

    ``values`` holds :class:`Case`'s fields, or a subset of them (the input recipe's
    :class:`~rl_engine.campaign.inputs.InputSpec`): a rule is checked when every field it reads
    is present. A rule that involves several fields is only checked when each of them passed
    its own checks, and is reported under the field named first in its message. Each message
    names the field, the value and the fix.
    """
    found: list[tuple[str, str]] = []

    def add(name: str, problem: str | None) -> None:
        if problem is not None:
            found.append((name, problem))

    def has(*names: str) -> bool:
        return all(name in values for name in names) and not {n for n, _ in found} & set(names)

    if has("device"):
        device = values["device"]
        if device not in DEVICE_DIST_BACKENDS:
            add("device", choice_problem("device", device, list(DEVICE_DIST_BACKENDS), "is unknown"))
        elif has("dist_backend") and values["dist_backend"] != DEVICE_DIST_BACKENDS[device]:
            add("dist_backend",
                f"dist_backend={values['dist_backend']!r} does not serve device={device!r}; use "
                f"{DEVICE_DIST_BACKENDS[device]!r} (gloo on cpu, nccl on cuda; nothing falls back)")
    if has("dtype"):
        add("dtype", choice_problem("dtype", values["dtype"], DTYPES, "is unknown"))
    if has("backend"):
        backend = values["backend"]
        if backend == AUTO:
            add("backend",
                "backend='auto' is refused: a campaign validates one named backend (evidence must "
                f"name what it tested); name it explicitly, one of {list(backend_devices())}")
        elif backend not in backend_devices():
            add("backend", f"backend={backend!r} is not registered; use one of {list(backend_devices())}")
        elif has("device") and values["device"] not in case_devices(backend):
            add("backend",
                f"backend={backend!r} does not run on device={values['device']!r} (its devices: "
                f"{sorted(case_devices(backend))}); choose a backend for {values['device']!r} or "
                "change the device")
    for name, minimum in (("real_vocab", 1), ("padded_vocab", 1), ("num_vocab_tiles", 1),
                          ("batch", 1), ("seq", 1), ("prompt_tokens", 0), ("seed", 0),
                          ("threads_per_rank", 1)):
        if name in values:
            add(name, int_problem(name, values[name], minimum))
    if has("seed") and values["seed"] > MAX_SEED:
        add("seed", f"seed={values['seed']} exceeds {MAX_SEED} (2**64 - 1): the input recipe hashes "
                    "the seed as an unsigned 64-bit integer; use a seed in [0, 2**64 - 1]")
    for name in ("batch", "seq"):
        if has(name) and values[name] > MAX_TOKENS:
            add(name, f"{name}={values[name]} exceeds {MAX_TOKENS} (2**20), the bound of batch*seq "
                      f"tokens of a campaign; use a {name} of at most {MAX_TOKENS}")
    if has("batch", "seq") and values["batch"] * values["seq"] > MAX_TOKENS:
        add("batch", f"batch={values['batch']} x seq={values['seq']} = {values['batch'] * values['seq']} "
                     f"tokens exceed the bound {MAX_TOKENS} (2**20); lower batch or seq")
    if (has("batch", "seq", "padded_vocab")
            and values["batch"] * values["seq"] * values["padded_vocab"] > MAX_LOGIT_ELEMENTS):
        add("padded_vocab",
            f"padded_vocab={values['padded_vocab']} x batch*seq={values['batch'] * values['seq']} tokens = "
            f"{values['batch'] * values['seq'] * values['padded_vocab']} logits exceed the bound "
            f"{MAX_LOGIT_ELEMENTS} (2**32, 16 GiB in FP32); lower the vocabulary, batch or seq")
    if has("threads_per_rank") and values["threads_per_rank"] > MAX_THREADS_PER_RANK:
        add("threads_per_rank",
            f"threads_per_rank={values['threads_per_rank']} must be <= {MAX_THREADS_PER_RANK}")
    for name, positive in (("logit_scale", True), ("atol", False), ("rtol", False), ("timeout_s", True)):
        if name in values:
            add(name, _number_problem(name, values[name], positive))
    if has("timeout_s") and values["timeout_s"] > MAX_PG_TIMEOUT_S:
        add("timeout_s", f"timeout_s={values['timeout_s']!r} exceeds {MAX_PG_TIMEOUT_S:g} s, the longest process-group "
                         "timeout (torch holds it in int64 nanoseconds); use a timeout of at most 1e9 s")
    if has("logit_scale"):
        dtype = values["dtype"] if has("dtype") else "fp32"  # the recipe's own logits are FP32
        bound = LOGIT_SCALE_BOUNDS[dtype] if dtype in LOGIT_SCALE_BOUNDS else None
        if bound is not None and values["logit_scale"] > bound:
            add("logit_scale",
                f"logit_scale={values['logit_scale']!r} exceeds {bound:.6g} for dtype {dtype}: logits reach "
                f"3.47 x logit_scale and must stay finite in {dtype} (the bound is a quarter of its largest "
                f"finite value); use logit_scale <= {bound:.6g}")
    if "temperature" in values:
        try:
            temperature32(values["temperature"])
        except TemperatureError as exc:
            add("temperature", str(exc))
    for name, problem in sampling_problems(values):
        add(name, problem)
    if has("cp_layout"):
        add("cp_layout", choice_problem("cp_layout", values["cp_layout"], CP_LAYOUTS, "is unknown"))
    if has("real_vocab", "padded_vocab") and values["real_vocab"] > values["padded_vocab"]:
        add("real_vocab",
            f"real_vocab={values['real_vocab']} exceeds padded_vocab={values['padded_vocab']}; the "
            "padded vocabulary must be >= the real one")
    if has("padded_vocab", "num_vocab_tiles"):
        try:
            tile_width(values["padded_vocab"], values["num_vocab_tiles"])
        except BoundsError as exc:
            add("num_vocab_tiles", str(exc))
    if has("prompt_tokens", "seq") and values["prompt_tokens"] >= values["seq"]:
        add("prompt_tokens",
            f"prompt_tokens={values['prompt_tokens']} must be < seq={values['seq']}: with no active "
            "token there is no logprob to compare; lower prompt_tokens or raise seq")
    if values.get("capture") is not None:
        found += [("capture", m) for m in capture_problems(values["capture"], values)]
    if "sampling" in values:
        found += [("sampling", m) for m in sampling_source_problems(values, {n for n, _ in found})]
    return found


SAMPLING_SOURCES: tuple[str, ...] = ("case", "capture")  # the case field ``sampling``; "case" (the default) is absent
CAPTURED_SAMPLING = "capture"
# the case's scalar sampling fields and their off values: what sampling: capture takes per row from the capture
SCALAR_SAMPLING: dict[str, Any] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def captures_sampling(record: Mapping[str, Any]) -> bool:
    """Whether a case record runs at its capture's per-row sampling (``sampling: capture``); the
    harness (config check, acceptance, summary) asks without importing torch."""
    return record.get("sampling") == CAPTURED_SAMPLING and record.get("capture") is not None


def sampling_source_problems(values: Mapping[str, Any], broken: set[str]) -> list[str]:
    """Why a case's ``sampling`` cannot be what it says (file-free; that the capture carries the four
    sampling tensors is checked where its header is read: the workflow's config check and every rank
    before any collective, :func:`rl_engine.campaign.captured.require_sampling_tensors`).

    ``sampling: capture`` runs every topology, the replay and the oracle at each row's captured
    ``temperature``, ``top_k``, ``top_p`` and ``min_p``: it needs a capture, no scalar of its own for
    them (one source per parameter), and a backend whose engine takes processed-logprob parameters with
    a temperature per row in one call (the backend descriptions' ``processed_row_temperature``)."""
    source = values["sampling"]
    if not isinstance(source, str) or source not in SAMPLING_SOURCES:
        return [f"sampling={source!r} is unknown; use one of {list(SAMPLING_SOURCES)}: 'capture' takes each "
                "row's temperature, top_k, top_p and min_p from the capture, 'case' (the default) the case's own"]
    if source != CAPTURED_SAMPLING:
        return []
    found = []
    if values.get("capture") is None:
        found.append("sampling='capture' takes each row's temperature, top_k, top_p and min_p from the "
                     "case's capture, but the case has none (the input recipe); set inputs: {capture: PATH} "
                     "to a capture that carries them, or remove sampling")
    scalars = [f"{name}={values[name]!r}" for name, off in SCALAR_SAMPLING.items()
               if name in values and name not in broken and values[name] != off]
    if scalars:
        found.append(f"sampling='capture' takes each row's temperature, top_k, top_p and min_p from the "
                     f"capture, but the case also sets {', '.join(scalars)}: one source per parameter; remove "
                     f"{' and '.join(s.split('=')[0] for s in scalars)} (or remove sampling to use the case's "
                     "own, every row alike)")
    backend = values.get("backend")
    able = processed_row_temperature_backends()
    if "backend" not in broken and isinstance(backend, str) and backend in backend_devices() \
            and backend not in able:
        found.append(f"sampling='capture' needs processed logprobs with a temperature per row in one call, "
                     f"which backend={backend!r} does not compute (its kernels take one temperature per "
                     f"call); use one of {list(able)}, or remove sampling")
    return found


SAMPLING_DEFAULTS: dict[str, Any] = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}  # every one off


def sampling_problems(values: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The processed-logprob parameters of a case (docs/arithmetic.md section 13), where present:
    ``top_k`` an integer >= 0 (vLLM's -1 refused with "use 0"), ``top_p`` in (0, 1] and ``min_p`` in
    [0, 1], each in binary32 (numpy-free: ``struct`` rounds to binary32 as the engine does)."""
    found: list[tuple[str, str]] = []
    if "top_k" in values:
        k = values["top_k"]
        problem = int_problem("top_k", k, 0)
        if problem is not None and k == -1 and not isinstance(k, bool):
            problem = "top_k=-1 is vLLM's 'off'; here top-k is off at 0: use top_k: 0 (or leave it out)"
        if problem is not None:
            found.append(("top_k", problem))
    for name, low_open in (("top_p", True), ("min_p", False)):
        if name not in values:
            continue
        v = values[name]
        problem = real_problem(name, v)
        if problem is None:
            v32 = struct.unpack("f", struct.pack("f", float(v)))[0] if abs(float(v)) < 3.4e38 else float(v)
            ok = (0.0 < v32 <= 1.0) if low_open else (0.0 <= v32 <= 1.0)
            if not ok:
                bounds = "(0, 1]; 1 = off" if low_open else "[0, 1]; 0 = off"
                problem = f"{name}={v!r} (binary32 {v32!r}) must lie in {bounds}"
        if problem is not None:
            found.append((name, problem))
    return found


CAPTURE_KEYS: tuple[str, ...] = ("path", "sha256", "size", "tokens", "vocab", "dtype", "metadata", "archive")


def capture_problems(record: Any, values: Mapping[str, Any]) -> list[str]:
    """Why a case's ``capture`` record (:mod:`rl_engine.campaign.captured`) cannot be its inputs.

    Torch-free and file-free (a reviewer's machine may lack the file): the record's shape, and
    its shape, vocabulary and dtype against the case's ``batch * seq``, ``real_vocab`` =
    ``padded_vocab`` and ``dtype``. The file itself (exists, a valid capture, this SHA-256) is
    checked where it is read (:func:`rl_engine.campaign.captured.capture_record`, ``check_file``).
    """
    if not isinstance(record, Mapping) or sorted(record) != sorted(CAPTURE_KEYS):
        return [f"capture={record!r} must be a record with exactly the keys {list(CAPTURE_KEYS)}; "
                "build it with rl_engine.campaign.captured.capture_record (config: inputs: {capture: PATH})"]
    found = []
    if not isinstance(record["path"], str) or not record["path"]:
        found.append(f"capture.path={record['path']!r} must be a non-empty path")
    sha = record["sha256"]
    if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        found.append(f"capture.sha256={sha!r} must be 64 lowercase hex digits (the file's SHA-256)")
    for key in ("size", "tokens", "vocab"):
        found += [p for p in [int_problem(f"capture.{key}", record[key], 1)] if p is not None]
    if record["dtype"] not in DTYPES:
        found.append(choice_problem("capture.dtype", record["dtype"], DTYPES, "is unknown"))
    if not isinstance(record["metadata"], Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in record["metadata"].items()):
        found.append(f"capture.metadata={record['metadata']!r} must map strings to strings "
                     "(the capture header's metadata)")
    if not isinstance(record["archive"], bool):
        found.append(f"capture.archive={record['archive']!r} must be true or false")
    if found:
        return found
    source = f"the capture {record['path']} (sha256 {record['sha256'][:16]}...)"
    if all(isinstance(values.get(k), int) for k in ("batch", "seq")) and \
            values["batch"] * values["seq"] != record["tokens"]:
        found.append(f"batch * seq = {values['batch']} * {values['seq']} = {values['batch'] * values['seq']} "
                     f"must be the {record['tokens']} tokens of {source}; set batch and seq so that "
                     f"batch * seq = {record['tokens']} (e.g. batch: 1, seq: {record['tokens']})")
    for key in ("real_vocab", "padded_vocab"):
        if isinstance(values.get(key), int) and values[key] != record["vocab"]:
            found.append(f"{key}={values[key]} must be the vocab {record['vocab']} of {source} (every "
                         f"captured column is real); set {key}: {record['vocab']}")
    if "dtype" in values and values["dtype"] != record["dtype"]:
        found.append(f"dtype={values['dtype']!r} must be the logits dtype {record['dtype']!r} of {source} "
                     f"(the candidate sees the captured bits); set dtype: {record['dtype']}")
    return found


FLOAT_FIELDS: tuple[str, ...] = ("logit_scale", "atol", "rtol", "timeout_s", "temperature", "top_p", "min_p")
# (config.yaml key, Case field) of every field the config holds by name: the one mapping both ways
# (the workflow builds a case from a config with it, SUMMARY.md's reproduce.yaml a config from a
# case). dist_backend follows the device, atol/rtol the dtype's tolerances, capture the inputs
# section; OPTIONAL_FIELDS are absent from a case at their default.
CONFIG_FIELDS: tuple[tuple[str, str], ...] = (
    ("device", "device"), ("backend", "backend"), ("dtype", "dtype"), ("real_vocab", "real_vocab"),
    ("padded_vocab", "padded_vocab"), ("num_vocab_tiles", "num_vocab_tiles"), ("batch", "batch"), ("seq", "seq"),
    ("prompt_tokens", "prompt_tokens"), ("seed", "seed"), ("logit_scale", "logit_scale"), ("cp_layout", "cp_layout"),
    ("threads_per_rank", "threads_per_rank"), ("pg_timeout_s", "timeout_s"), ("temperature", "temperature"),
    ("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p"), ("sampling", "sampling"),
)
OPTIONAL_FIELDS: frozenset[str] = frozenset({"temperature", *SAMPLING_DEFAULTS, "sampling"})
# The case fields the topology rules read: check_topology needs each of them valid.
TOPOLOGY_FIELDS: tuple[str, ...] = ("padded_vocab", "num_vocab_tiles", "seq", "cp_layout")


def config_case_fields(config: Mapping[str, Any], capture: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A schema-valid config's :class:`Case` fields, before any case rule (the workflow reports each
    broken rule under its config key, :func:`config_key_of`): dist_backend from the device, atol and
    rtol from the dtype's ``tolerances`` entry (None where it has none), ``capture`` only on a
    capture (the record the workflow built from ``inputs.capture``), ``temperature`` only when it is
    not 1 (a case without one hashes as it did before temperatures existed)."""
    tolerance = config["tolerances"].get(config["dtype"], {})
    return {
        **{field: config[key] for key, field in CONFIG_FIELDS if field not in OPTIONAL_FIELDS},
        "dist_backend": DEVICE_DIST_BACKENDS.get(config["device"], ""),
        "atol": tolerance.get("atol"),
        "rtol": tolerance.get("rtol"),
        **({} if capture is None else {"capture": dict(capture)}),
        # as given: the case's rules check it (Case makes it a float only once they pass)
        **({"temperature": config["temperature"]} if config.get("temperature", 1) != 1 else {}),
        **{name: config[name] for name, off in SAMPLING_DEFAULTS.items()
           if name in config and (config[name] != off or isinstance(config[name], bool))},
        **({"sampling": config["sampling"]} if config.get("sampling", "case") != "case" else {}),
    }


def config_key_of(field: str, config: Mapping[str, Any]) -> tuple[str, Any]:
    """The config key that holds a :class:`Case` field (dotted where nested), and its value there."""
    if field in ("atol", "rtol"):
        return f"tolerances.{config['dtype']}.{field}", config["tolerances"][config["dtype"]][field]
    if field == "capture":
        return "inputs.capture", config["inputs"]["capture"]
    key = "device" if field == "dist_backend" else {f: k for k, f in CONFIG_FIELDS}.get(field, field)
    return key, config[key]


def record_config(record: Mapping[str, Any], topologies: Sequence[Any] = (),
                  regression: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config keys of a case record (a plan's ``case``, read from evidence that may be hostile:
    a missing field is None), its ``topologies`` (``(tp, cp)`` pairs) and, when given, the focused
    ``regression`` section: the inverse of :func:`config_case_fields`, for SUMMARY.md's
    reproduce.yaml. In this order: the case's keys, ``topologies``, ``tolerances``, ``regression``,
    then ``inputs`` on a capture (its recorded path, for a reviewer to replace by their copy's: it
    is not in the case hash)."""
    config: dict[str, Any] = {key: record.get(field) for key, field in CONFIG_FIELDS
                              if field in record or field not in OPTIONAL_FIELDS}
    config["topologies"] = [f"{tp}x{cp}" for tp, cp in topologies]
    config["tolerances"] = {record.get("dtype"): {"atol": record.get("atol"), "rtol": record.get("rtol")}}
    if regression is not None:
        config["regression"] = dict(regression)
    capture = record.get("capture")
    if isinstance(capture, Mapping):
        config["inputs"] = {"capture": capture.get("path"), "archive": capture.get("archive")}
    return config


# ----- the case hash ---------------------------------------------------------------------------
# A run's name ends in the case hash (rl_engine.campaign.casename): the first CASE_HASH_CHARS hex
# digits of the SHA-256 of the resolved case, every value that determines the run's evidence.
CASE_HASH_CHARS = 8
CAPTURE_INFO_KEYS = ("path",)  # of a case's capture record: recorded, not part of the case's identity


class CaseHashError(ValueError):
    """A resolved case that is not strict JSON: it cannot be hashed."""


def _topology_label(item: Any) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, Mapping):
        return f"{item.get('tp')}x{item.get('cp')}"
    tp, cp = item
    return f"{tp}x{cp}"


def resolved_case(case: Mapping[str, Any], topologies: Sequence[Any], tests: Sequence[str],
                  pytest_args: Sequence[str], parity: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The values that determine a run's evidence, in one canonical JSON-ready object.

    ``case``: a case record (:meth:`Case.to_dict`, or a plan's ``case`` read back from evidence);
    its float fields as floats (``logit_scale: 1`` in a config and ``1.0`` in plan.json are one
    case) and a capture record without :data:`CAPTURE_INFO_KEYS` (the same bytes at another path
    are the same case). ``topologies``: ``"<tp>x<cp>"`` strings, ``(tp, cp)`` pairs or plan
    entries, in plan order; ``tests``/``pytest_args``: the focused regression's; ``parity``:
    :func:`rl_engine.campaign.casename.parity_identity`, or None for a run without a parity stage
    (then no key is added, so such a run keeps its name).
    """
    normalized: dict[str, Any] = {}
    for key in sorted(case):
        value = case[key]
        if key in FLOAT_FIELDS and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
        if key == "capture" and isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if k not in CAPTURE_INFO_KEYS}
        normalized[key] = value
    resolved = {
        "case": normalized,
        "topologies": [_topology_label(t) for t in topologies],
        "regression": {"tests": list(tests), "pytest_args": list(pytest_args)},
    }
    if parity is not None:
        resolved["parity"] = dict(parity)
    return resolved


def case_hash(case: Mapping[str, Any], topologies: Sequence[Any], tests: Sequence[str],
              pytest_args: Sequence[str], parity: Mapping[str, Any] | None = None) -> str:
    """The case hash of a run: the first :data:`CASE_HASH_CHARS` hex digits of the SHA-256 of the
    canonical JSON of :func:`resolved_case` (the workflow names a run with it from the config,
    ``verify`` recomputes it from the evidence)."""
    resolved = resolved_case(case, topologies, tests, pytest_args, parity)
    try:
        text = json.dumps(resolved, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CaseHashError(f"the resolved case is not strict JSON: {exc}") from None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:CASE_HASH_CHARS]


def check_topology(
    tp: int, cp: int, *, padded_vocab: int, num_vocab_tiles: int, seq: int, cp_layout: str
) -> None:
    """Every reason a ``tp x cp`` run cannot be made from valid case fields, before anything starts."""
    _int("tp", tp, 1)
    _int("cp", cp, 1)
    if tp > MAX_TP:
        raise CaseError(f"tp={tp} exceeds the supported maximum {MAX_TP}; use tp <= {MAX_TP}")
    if cp > MAX_CP:
        raise CaseError(f"cp={cp} exceeds the supported maximum {MAX_CP}; use cp <= {MAX_CP}")
    if tp * cp > num_vocab_tiles:
        raise CaseError(
            f"tp*cp={tp * cp} ranks exceed num_vocab_tiles={num_vocab_tiles}; use at "
            f"most {num_vocab_tiles} ranks or more tiles"
        )
    try:
        even_vocab_shards(padded_vocab, num_vocab_tiles, tp)
        check_cp_split(seq, cp, cp_layout)
    except BoundsError as exc:
        raise CaseError(f"topology {tp}x{cp}: {exc}") from None


@dataclass(frozen=True)
class Case:
    """Every input parameter of a campaign case except the topology (the plan's ``case``)."""

    device: str
    dist_backend: str
    dtype: str
    backend: str
    real_vocab: int
    padded_vocab: int
    num_vocab_tiles: int
    batch: int
    seq: int
    prompt_tokens: int
    seed: int
    cp_layout: str
    logit_scale: float
    atol: float
    rtol: float
    threads_per_rank: int
    timeout_s: float
    # None: the input recipe (rl_engine.campaign.inputs); else the captured file's record
    # (rl_engine.campaign.captured.capture_record): path, sha256, size, shape, dtype, metadata
    capture: dict[str, Any] | None = None
    # docs/arithmetic.md section 6 step 0 (rl_engine.arith.temperature); 1.0: none
    temperature: float = 1.0
    # docs/arithmetic.md section 13, the processed logprob (every row alike); at their defaults: off
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # where each row's temperature and processed parameters come from: "case" (the four fields above,
    # every row alike) or "capture" (the capture's per-row tensors, as the rollout sampled each row)
    sampling: str = "case"

    def __post_init__(self) -> None:
        problems = case_problems(self.to_dict())
        if problems:
            raise CaseError("; ".join(message for _, message in problems))
        for name in FLOAT_FIELDS:  # 1 and 1.0 are the same case: the case file holds 1.0
            object.__setattr__(self, name, float(getattr(self, name)))

    @classmethod
    def create(cls, **fields: Any) -> "Case":
        """Fill what a case may leave out: ``dist_backend`` from the device, ``atol``/``rtol`` from
        the dtype (:data:`DEFAULT_TOLERANCES`), ``timeout_s``, ``cp_layout``, ``logit_scale`` and
        ``threads_per_rank`` from their defaults; None counts as left out."""
        fields = {name: value for name, value in fields.items() if value is not None}
        fields.setdefault("dist_backend", DEVICE_DIST_BACKENDS.get(fields.get("device", ""), ""))
        d_atol, d_rtol = DEFAULT_TOLERANCES.get(fields.get("dtype", ""), (0.0, 0.0))
        fields.setdefault("atol", d_atol)
        fields.setdefault("rtol", d_rtol)
        fields.setdefault("timeout_s", DEFAULT_PG_TIMEOUT_S)
        fields.setdefault("cp_layout", "contiguous")
        fields.setdefault("logit_scale", 1.0)
        fields.setdefault("threads_per_rank", 1)
        optional = ("capture", "temperature", *SAMPLING_DEFAULTS, "sampling")
        missing = [f.name for f in dataclass_fields(cls) if f.name not in fields and f.name not in optional]
        if missing:
            raise CaseError(f"case fields {missing} are missing; give each of them")
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """The case's fields; ``capture`` only when the case runs on a capture and ``temperature``
        only when it is not 1 (so a recipe case's plan, report and case hash are what they were
        before either existed)."""
        values = asdict(self)
        if values["capture"] is None:
            del values["capture"]
        if values["temperature"] == 1.0:
            del values["temperature"]
        for name, off in SAMPLING_DEFAULTS.items():  # absent when off: the case hashes as before they existed
            if values[name] == off:
                del values[name]
        if values["sampling"] == "case":  # the default: absent, so every case without it hashes as before
            del values["sampling"]
        return values

    @property
    def case_id(self) -> str:
        """Deterministic id of the numerical case (no topology, no tolerance)."""
        return (
            f"{self.dtype}-v{self.real_vocab}-p{self.padded_vocab}-t{self.num_vocab_tiles}"
            f"-b{self.batch}-s{self.seq}-pt{self.prompt_tokens}-seed{self.seed}"
            f"-{self.cp_layout}-scale{self.logit_scale:g}"
            + ("" if self.capture is None else f"-capture{self.capture['sha256'][:16]}")
            + ("" if self.temperature == 1.0 else f"-temp{self.temperature:g}")
            + ("" if self.top_k == 0 else f"-topk{self.top_k}")
            + ("" if self.top_p == 1.0 else f"-topp{self.top_p:g}")
            + ("" if self.min_p == 0.0 else f"-minp{self.min_p:g}")
            + ("" if self.sampling == "case" else "-capturesampling")
        )

    def op_sampling(self, rows: int, device: Any = "cpu", captured: Any = None) -> dict[str, Any]:
        """:func:`record_op_sampling` of this case."""
        return record_op_sampling(self.to_dict(), rows, device, captured)

    def contract(self, tp: int = 1, cp: int = 1, tp_rank: int = 0, cp_rank: int = 0, *,
                 num_sequences: int | None = None, seq_len: int | None = None) -> Any:
        """The :class:`~rl_engine.logprob.contract.LogprobContract` of rank ``(tp_rank, cp_rank)`` of
        a ``tp x cp`` topology of this case: the one place a case becomes a contract (the runner's
        ranks, verify's replays, the GPU smoke's timing shape with ``num_sequences``/``seq_len``)."""
        return record_contract(self.to_dict(), tp, cp, tp_rank, cp_rank, num_sequences=num_sequences, seq_len=seq_len)

    def drift(self, logp: Any, lse: Any, logits_fp32: Any, targets: Any, active: Any,
              captured: Any = None) -> dict[str, Any]:
        """The report's ``drift`` of this case's candidate (:func:`record_oracle_drift`)."""
        return record_oracle_drift(self.to_dict(), logp, lse, logits_fp32, targets, active, captured)

    def check_topology(self, tp: int, cp: int) -> None:
        """Every reason a ``tp x cp`` run of this case cannot be made, before anything starts."""
        check_topology(tp, cp, **{name: getattr(self, name) for name in TOPOLOGY_FIELDS})

    @classmethod
    def from_config(cls, config: Mapping[str, Any], capture: Mapping[str, Any] | None = None) -> "Case":
        """The case of a checked config (:func:`config_case_fields`; ``capture``: the record of its
        ``inputs.capture``, which the workflow builds from the file)."""
        return cls(**config_case_fields(config, capture))

    def to_config(self, topologies: Sequence[Any] = ()) -> dict[str, Any]:
        """The config keys of this case over ``topologies`` (:func:`record_config`)."""
        return record_config(self.to_dict(), topologies)

    def run_hash(self, topologies: Sequence[Any], tests: Sequence[str], pytest_args: Sequence[str],
                 parity: Mapping[str, Any] | None = None) -> str:
        """:func:`case_hash` of a run of this case over ``topologies`` with this focused regression."""
        return case_hash(self.to_dict(), topologies, tests, pytest_args, parity)


def record_contract(record: Mapping[str, Any], tp: int = 1, cp: int = 1, tp_rank: int = 0, cp_rank: int = 0, *,
                    num_sequences: int | None = None, seq_len: int | None = None) -> Any:
    """:meth:`Case.contract` of a case record (a plan's or a report's ``case``, or an archive's, which
    verify replays before trusting it as a :class:`Case`): only the fields a contract reads, each
    checked by the contract itself."""
    from rl_engine.logprob.contract import LogprobContract  # imports torch: not at parse time

    return LogprobContract(
        real_vocab_size=int(record["real_vocab"]), padded_vocab_size=int(record["padded_vocab"]),
        num_vocab_tiles=int(record["num_vocab_tiles"]),
        num_sequences=int(record["batch"]) if num_sequences is None else num_sequences,
        seq_len=int(record["seq"]) if seq_len is None else seq_len,
        tp_world_size=tp, tp_rank=tp_rank, cp_world_size=cp, cp_rank=cp_rank,
        cp_layout=str(record.get("cp_layout", "contiguous")), logits_dtype=str(record["dtype"]),
        temperature=float(record.get("temperature", 1.0)),
    )


def record_sampling(record: Mapping[str, Any], rows: int, device: Any = "cpu") -> Any:
    """The :class:`~rl_engine.logprob.processed.Sampling` of ``rows`` rows of a case record (every row
    alike), or ``None`` when the case has no processed-logprob parameter."""
    import torch  # not at parse time

    from rl_engine.logprob.processed import sampling_from

    params = {name: record.get(name, off) for name, off in SAMPLING_DEFAULTS.items()}
    return sampling_from(int(params["top_k"]), float(params["top_p"]), float(params["min_p"]), (rows,),
                         torch.device(device))


def record_op_sampling(record: Mapping[str, Any], rows: int, device: Any = "cpu",
                       captured: Any = None) -> dict[str, Any]:
    """The op's sampling keywords for ``rows`` rows of a case record: ``{}`` (raw), ``{"sampling":
    Sampling}`` (the case's own parameters, every row alike: :func:`record_sampling`; its scalar
    temperature is the contract's) or, with ``sampling: capture``, each row's captured ``temperature``
    (a binary32 tensor, the contract's temperature being 1) and, when any row truncates, its
    ``Sampling``. ``captured``: the capture's :class:`~rl_engine.capture.format.RowSampling` of these
    rows (:func:`rl_engine.campaign.captured.case_row_sampling`), needed exactly when the case says
    ``sampling: capture``."""
    import torch  # not at parse time

    from rl_engine.logprob.processed import sampling_from

    if record.get("sampling", "case") != CAPTURED_SAMPLING:
        if captured is not None:
            raise CaseError("the capture's per-row sampling was given for a case without sampling: capture; "
                            "pass none (the case's own parameters apply to every row)")
        sampling = record_sampling(record, rows, device)
        return {} if sampling is None else {"sampling": sampling}
    if captured is None or int(captured.temperature.shape[0]) != rows:
        given = "none" if captured is None else f"{int(captured.temperature.shape[0])} rows"
        raise CaseError(f"the case says sampling='capture' but the capture's per-row sampling of its {rows} rows "
                        f"was not given ({given}); read these rows with "
                        "rl_engine.campaign.captured.case_row_sampling")
    where = torch.device(device)
    sampling = sampling_from(captured.top_k.to(where), captured.top_p.to(where), captured.min_p.to(where),
                             (rows,), where)
    return {"temperature": captured.temperature.to(where), **({} if sampling is None else {"sampling": sampling})}


def record_oracle_drift(record: Mapping[str, Any], logp: Any, lse: Any, logits_fp32: Any, targets: Any,
                        active: Any, captured: Any = None) -> dict[str, Any]:
    """The report's ``drift`` of a case record's candidate ``logp``/``lse`` against both oracles on the
    case's whole inputs (:func:`rl_engine.logprob.comparison.oracle_drift`): the one place the oracle's
    case arguments are read from a case (real vocabulary, dtype, tolerance, temperature), for the
    runner's report (:meth:`Case.drift`) and ``verify --recompute`` (a record from an archive), so
    the two cannot judge one case by two oracles."""
    from rl_engine.logprob.comparison import oracle_drift  # imports torch: not at parse time

    op = record_op_sampling(record, int(targets.shape[0]), "cpu", captured)
    return oracle_drift(logp, lse, logits_fp32, targets, active, record["real_vocab"], record["dtype"],
                        record["atol"], record["rtol"], op.get("temperature", record.get("temperature", 1.0)),
                        op.get("sampling"))


def case_document(case: Case, topologies: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """The case file's JSON: the case and its topologies, in report order."""
    for tp, cp in topologies:
        case.check_topology(tp, cp)
    check_matrix(topologies)
    return {
        "schema_version": SCHEMA_VERSION,
        "case_id": case.case_id,
        "case": case.to_dict(),
        "topologies": [{"tp": tp, "cp": cp} for tp, cp in topologies],
    }


def write_case_file(path: str | os.PathLike[str], case: Case, topologies: Sequence[tuple[int, int]]) -> None:
    schemas.write_validated(path, case_document(case, topologies), "case")


def case_from_document(document: Any, what: str) -> tuple[Case, tuple[tuple[int, int], ...]]:
    """The case and topologies of a case file's JSON: every case rule, the topologies of a
    campaign (a matrix of at least two), then the schema, and a ``case_id`` that is the case's own.
    The rules come first: their messages name the field, the value and the fix."""
    try:
        case = Case(**document["case"])
        topologies = tuple((t["tp"], t["cp"]) for t in document["topologies"])
    except (TypeError, KeyError):
        case = None  # not even the shape of a case file: the schema says what is wrong
    except CaseError as exc:
        raise CaseError(f"{what}: {exc}") from None
    try:
        if case is not None:
            for tp, cp in topologies:
                case.check_topology(tp, cp)
            check_matrix(topologies)
        schemas.require_valid(document, "case", what=what)
    except (schemas.ArtifactSchemaError, CaseError) as exc:
        raise CaseError(f"{what}: {exc}") from None
    assert case is not None  # a schema-valid document has a case's shape
    if document["case_id"] != case.case_id:
        raise CaseError(f"{what}: case_id={document['case_id']!r} is not the case's id {case.case_id!r}; "
                        "write the case file with `python -m rl_engine case`")
    return case, topologies


def load_case_file(path: str | os.PathLike[str]) -> tuple[Case, tuple[tuple[int, int], ...]]:
    """The case and topologies of a case file: strict JSON, schema-valid, every rule kept."""
    try:
        document = jsonio.load(path)
    except (jsonio.StrictJSONError, OSError) as exc:
        raise CaseError(f"case file {path}: {exc}; write it with `python -m rl_engine case`") from None
    return case_from_document(document, f"case file {path}")


def main(argv: list[str] | None = None) -> int:
    """``python -m rl_engine case --json DOCUMENT --output case.json``: the workflow's case rule.

    The Snakefile turns the resolved config (config files and ``--config`` overrides) into the
    case file's JSON when it parses it (:func:`rl_engine.workflow.config_case`); this
    checks that document once more (schema, every rule) and writes it. 0 written, 2 refused.
    """
    parser = argparse.ArgumentParser(
        prog="python -m rl_engine case",
        description="Check a case file's JSON (schemas/case.schema.json and every case rule) and write it.")
    parser.add_argument("--json", required=True, help="the case file's JSON, one object")
    parser.add_argument("--output", required=True, help="the case file to write (case.json)")
    args = parser.parse_args(argv)
    try:
        document = jsonio.loads(args.json)
        case, topologies = case_from_document(document, "--json")
        write_case_file(args.output, case, topologies)
    except (jsonio.StrictJSONError, CaseError, schemas.ArtifactSchemaError) as exc:
        print(f"case: {exc}", file=sys.stderr)
        return 2
    print(f"case {case.case_id}: {len(topologies)} topologies -> {args.output}")
    return 0


__all__ = [
    "CAPTURE_INFO_KEYS",
    "CASE_HASH_CHARS",
    "CONFIG_FIELDS",
    "Case",
    "CaseError",
    "CaseHashError",
    "case_hash",
    "config_case_fields",
    "config_key_of",
    "record_config",
    "record_contract",
    "record_oracle_drift",
    "resolved_case",
    "case_document",
    "case_from_document",
    "capture_problems",
    "captures_sampling",
    "case_problems",
    "check_matrix",
    "check_topology",
    "load_case_file",
    "main",
    "matrix_problem",
    "parse_topologies",
    "parse_topology",
    "write_case_file",
]
