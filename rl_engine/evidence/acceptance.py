"""Acceptance of one topology report: the guide's step 3, as one function.

:func:`check_report` is the single definition of "this report is acceptable evidence". The
workflow's ``validate`` verb and the reviewer's ``verify`` (replaying it from an archive) both
call it, so the gate and the replay cannot disagree. A report is accepted only when:

* ``passed`` is true and ``failures`` is empty;
* ``requested_backend`` equals ``actual_backend`` and the case's ``backend``, on every rank,
  and ``fallback`` is false everywhere;
* ``tp_outputs_bitwise_replicated`` is true;
* every drift statistic is a finite number, the FP32-oracle statistics passed with the case's
  tolerance (``max_abs <= atol`` checked here when ``rtol`` is 0; with ``rtol > 0`` the
  element-wise bound needs the tensors, which ``verify --recompute`` checks) and count the
  rows the case implies;
* the fingerprints describe the case's shapes, and each raw tensor file's SHA-256 equals both
  the ``tensors`` entry and the matching ``bitwise_fingerprints`` value
  (:func:`check_tensor_files`, also used by the cross-topology check);
* the raw tensors hold what the arithmetic guarantees (:func:`check_tensor_values`, cheap: one
  pass over ``batch * seq`` values): ``logp`` is exactly ``+0`` on every inactive (prompt) token
  and ``<= 0`` (never NaN) on every active one, and ``lse`` is finite on every active token. So
  logp, LSE and entropy files swapped, fingerprints swapped to match, are refused without a replay.
  Which tokens are active is the case's inputs' (:func:`rl_engine.campaign.mask.report_active`): the
  input recipe's rule of ``prompt_tokens``, or a capture's own mask, which its report records
  (``active_mask``, hashing to ``inputs_sha256.mask``); the FP32 ``dlogp`` count is that mask's;
* when the plan is given: the report's case, case id and launch command are the plan's.

Every finding names the report and the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rl_engine.campaign.case import captures_sampling
from rl_engine.campaign.mask import MASK_FIELD, report_active
from rl_engine.jsonio import sha256_bytes, sha256_file
from rl_engine.rundir import TENSOR_NAMES, Finding, PlannedReport, field_path, get, inside, is_number, non_finite_numbers
from rl_engine.tables import GATING_ORACLE, ORACLES, TORCH_DTYPE_NAMES

TENSOR_FINGERPRINTS: dict[str, str] = {name: f"candidate_{name}_sha256" for name in TENSOR_NAMES}
QUANTITIES = ("lse", "dlogp")
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class TensorCheck:
    """A raw tensor file against what its report records."""

    name: str
    path: str
    recorded_sha256: str | None
    fingerprint: str | None
    file_sha256: str | None

    @property
    def ok(self) -> bool:
        return self.file_sha256 is not None and self.file_sha256 == self.recorded_sha256 == self.fingerprint

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "recorded_sha256": self.recorded_sha256,
            "fingerprint": self.fingerprint,
            "file_sha256": self.file_sha256,
            "ok": self.ok,
        }


SAMPLING_FIELDS = ("top_k", "top_p", "min_p")  # a case's processed-logprob parameters (docs/arithmetic.md section 13)


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_tensor_values(name: str, data: bytes, active: np.ndarray | None, where: str) -> list[Finding]:
    """What ``docs/arithmetic.md`` guarantees of a raw tensor's values, whatever the logits.

    ``logp = x_target - LSE`` with ``LSE = B + L(S)``, ``S >= 1`` (the row's maximum contributes
    ``E(0) = 1``), ``L(S) >= 0`` and ``x_target <= B``, so ``logp <= 0`` on an active token (never
    NaN: the candidate refuses an active row with a non-finite real logit; ``-inf`` where a
    processed case's sampler drops the target, section 13), and ``logp = +0`` on an inactive one;
    ``LSE`` of an active row is finite. Nothing is claimed of the entropy: rounding can
    make a near-one-hot row's entropy a little negative, and extreme logits can overflow it.
    ``active`` is the case's mask (:func:`rl_engine.campaign.mask.report_active`: the recipe's rule or
    a capture's own mask); None when the report cannot say, which :func:`check_report` names.
    """
    if name not in ("logp", "lse") or active is None:
        return []
    values = np.frombuffer(data, dtype="<f4")
    if values.size != active.size:
        return []  # the shape checks name a file of another size
    field = f"tensors.{name}"
    found = []
    if name == "logp":
        bits = np.frombuffer(data, dtype="<u4")
        inactive_bad = ~active & (bits != 0)
        if inactive_bad.any():
            i = _first(inactive_bad)
            found.append(Finding(where, field, f"token {i} is inactive (a prompt token) but holds {float(values[i])!r} "
                                 f"(0x{int(bits[i]):08x}); logp is exactly +0 on inactive tokens "
                                 f"({int(inactive_bad.sum())} such tokens): not a logp file"))
        with np.errstate(invalid="ignore"):
            active_bad = active & ~(values <= 0)
        if active_bad.any():
            i = _first(active_bad)
            found.append(Finding(where, field, f"token {i} holds {float(values[i])!r}, which is positive: a logprob "
                                 f"is never above 0 (nor NaN) on an active token ({int(active_bad.sum())} such "
                                 "tokens): not a logp file"))
    else:
        active_bad = active & ~np.isfinite(values)
        if active_bad.any():
            i = _first(active_bad)
            found.append(Finding(where, field, f"token {i} is active but holds {float(values[i])!r}; the LSE of an "
                                 f"active token is finite ({int(active_bad.sum())} such tokens): not an LSE file"))
    return found


def check_tensor_files(report: Any, where: str, report_dir: Path,
                       read: Callable[[Path], bytes] = Path.read_bytes) -> tuple[list[TensorCheck], list[Finding]]:
    """Each raw tensor file's SHA-256 against its ``tensors`` entry and its fingerprint.

    The file must be a regular file inside ``report_dir`` (no absolute path, no ``..``, no
    link), hold exactly ``4 * prod(shape)`` bytes, hash to both recorded values, and hold values
    the arithmetic allows (:func:`check_tensor_values`, when it has the shape the case implies).
    """
    checks: list[TensorCheck] = []
    found: list[Finding] = []
    _, fingerprints = get(report, ("bitwise_fingerprints",))
    _, fp_shape = get(report, ("bitwise_fingerprints", "shape"))
    active, _ = report_active(report)  # None: check_report names why
    for name, fp_key in TENSOR_FINGERPRINTS.items():
        base = ("tensors", name)
        ok, entry = get(report, base)
        fingerprint = fingerprints.get(fp_key) if isinstance(fingerprints, dict) else None
        if not ok or not isinstance(entry, dict):
            found.append(Finding(where, field_path(base), "missing: the report must record this raw tensor file"))
            continue
        rel, recorded, dtype, shape = entry.get("path"), entry.get("sha256"), entry.get("dtype"), entry.get("shape")
        if not isinstance(rel, str) or not inside(rel):
            found.append(Finding(where, field_path(base + ("path",)), f"{rel!r} is not a relative path inside the run directory"))
            checks.append(TensorCheck(name, str(rel), recorded, fingerprint, None))
            continue
        if dtype != "float32":
            found.append(Finding(where, field_path(base + ("dtype",)), f"is {dtype!r}; raw tensor files are float32"))
        if shape != fp_shape:
            found.append(Finding(where, field_path(base + ("shape",)), f"{shape!r} differs from bitwise_fingerprints.shape {fp_shape!r}"))
        file = report_dir / rel
        file_sha: str | None = None
        if file.is_symlink() or (file.exists() and not file.is_file()):
            found.append(Finding(where, field_path(base + ("path",)), f"{rel} is not a regular file"))
        elif not file.exists():
            found.append(Finding(where, field_path(base + ("path",)), f"raw tensor file {rel} is missing"))
        else:
            file_sha = _check_tensor_bytes(found, where, (name, rel, base), file, shape, fp_shape, active, read)
            if file_sha != recorded:
                found.append(Finding(where, field_path(base + ("sha256",)), f"{recorded} but sha256 of {rel} is {file_sha}"))
            if file_sha != fingerprint:
                found.append(Finding(where, f"bitwise_fingerprints.{fp_key}", f"{fingerprint} but sha256 of {rel} is {file_sha}"))
        checks.append(TensorCheck(name, rel, recorded, fingerprint, file_sha))
    return checks, found


def _check_tensor_bytes(found: list[Finding], where: str, named: tuple[str, str, tuple[str, ...]], file: Path,
                        shape: Any, fp_shape: Any, active: np.ndarray | None, read: Callable[[Path], bytes]) -> str:
    """The SHA-256 of one raw tensor file, with a finding when its size is not its shape's. A file of
    the right size is read once (``read``), then hashed and value-checked from those same bytes; any
    other is only hashed, as a stream."""
    name, rel, base = named
    expected = None
    if isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        expected = FLOAT32_BYTES * math.prod(shape)
    if expected is None or file.stat().st_size != expected:
        if expected is not None:
            found.append(Finding(where, field_path(base + ("path",)),
                                 f"{rel} holds {file.stat().st_size} bytes; shape {shape} float32 needs {expected}"))
        return sha256_file(file)
    data = read(file)
    if len(data) != expected:  # it changed since the stat
        found.append(Finding(where, field_path(base + ("path",)), f"{rel} holds {len(data)} bytes; shape {shape} "
                             f"float32 needs {expected}"))
    elif shape == fp_shape:
        found += check_tensor_values(name, data, active, where)
    return sha256_bytes(data)


def _expect(found: list[Finding], where: str, report: Any, parts: tuple[str | int, ...], expected: Any, why: str) -> Any:
    ok, value = get(report, parts)
    if not ok:
        found.append(Finding(where, field_path(parts), f"missing (must be {expected!r})"))
    elif value != expected or type(value) is not type(expected):
        found.append(Finding(where, field_path(parts), f"is {value!r}, must be {expected!r} ({why})"))
    return value


def _check_drift(found: list[Finding], where: str, report: Any, case: dict[str, Any],
                 active: np.ndarray | None) -> None:
    ok, drift = get(report, ("drift",))
    if not ok or not isinstance(drift, dict):
        found.append(Finding(where, "drift", "missing: drift statistics against the oracles are required"))
        return
    for path in non_finite_numbers({"drift": drift}):
        found.append(Finding(where, path, "is not a finite number"))
    counts = {} if active is None else {"lse": int(active.size), "dlogp": int(active.sum())}
    atol, rtol = case.get("atol"), case.get("rtol")
    for oracle in ORACLES:
        for quantity in QUANTITIES:
            base = ("drift", oracle, quantity)
            ok, stats = get(report, base)
            if not ok or not isinstance(stats, dict):
                found.append(Finding(where, field_path(base), "missing drift statistics"))
                continue
            for key in ("max_abs", "mean_abs", "p95_abs", "p99_abs", "max_rel"):
                value = stats.get(key)
                if not is_number(value):
                    found.append(Finding(where, field_path(base + (key,)), f"is {value!r}; must be a finite number"))
            processed = quantity == "dlogp" and (any(name in case for name in SAMPLING_FIELDS)
                                                 or captures_sampling(case))
            count = stats.get("count")
            if processed and quantity in counts:
                # section 13: dlogp is over the active rows whose target the sampler keeps (verify
                # --recompute recomputes the exact count with the kept set)
                if not (isinstance(count, int) and not isinstance(count, bool) and 0 <= count <= counts[quantity]):
                    found.append(Finding(where, field_path(base + ("count",)),
                                         f"is {count!r}; a processed case (top_k/top_p/min_p, or sampling: capture) counts the active rows "
                                         f"whose target is kept: at most {counts[quantity]}"))
            elif quantity in counts and count != counts[quantity]:
                found.append(Finding(where, field_path(base + ("count",)),
                                     f"is {count!r}; the case has {counts[quantity]} "
                                     f"{'rows' if quantity == 'lse' else 'active rows'}"))
            if oracle != GATING_ORACLE:
                continue
            for key, want in (("atol", atol), ("rtol", rtol)):
                if stats.get(key) != want:
                    found.append(Finding(where, field_path(base + (key,)), f"is {stats.get(key)!r} but the case states {key}={want!r}"))
            if stats.get("passed") is not True:
                found.append(Finding(where, field_path(base + ("passed",)),
                                     f"is {stats.get('passed')!r}: drift against the FP32 oracle is outside tolerance"))
            max_abs = stats.get("max_abs")
            if is_number(max_abs) and is_number(atol) and rtol == 0 and math.isfinite(max_abs) and max_abs > atol:
                found.append(Finding(where, field_path(base + ("max_abs",)), f"{max_abs!r} exceeds atol {atol!r} (rtol 0)"))


def _check_topology(found: list[Finding], where: str, report: dict[str, Any], case: dict[str, Any],
                    requested: Any) -> None:
    """The per-rank provenance: degrees, world size, every rank's backend without fallback, the nodes."""
    ok, topo = get(report, ("topology",))
    if not ok or not isinstance(topo, dict):
        found.append(Finding(where, "topology", "missing: per-rank provenance is required"))
    else:
        tp, cp = case.get("tp"), case.get("cp")
        for key, want in (("tp", tp), ("cp", cp)):
            if topo.get(key) != want:
                found.append(Finding(where, f"topology.{key}", f"is {topo.get(key)!r} but case.{key} is {want!r}"))
        ranks = topo.get("ranks")
        if isinstance(tp, int) and isinstance(cp, int):
            if topo.get("world_size") != tp * cp:
                found.append(Finding(where, "topology.world_size", f"is {topo.get('world_size')!r}; TP={tp} x CP={cp} needs {tp * cp}"))
            if not isinstance(ranks, list) or len(ranks) != tp * cp:
                count = len(ranks) if isinstance(ranks, list) else ranks
                found.append(Finding(where, "topology.ranks", f"lists {count!r} ranks; TP={tp} x CP={cp} needs {tp * cp}"))
        for index, rank in enumerate(ranks if isinstance(ranks, list) else []):
            base = ("topology", "ranks", index)
            if not isinstance(rank, dict):
                found.append(Finding(where, field_path(base), "must be an object"))
                continue
            if rank.get("actual_backend") != requested:
                found.append(Finding(where, field_path(base + ("actual_backend",)),
                                     f"rank {rank.get('rank')!r} materialised {rank.get('actual_backend')!r}, "
                                     f"requested {requested!r}"))
            if rank.get("fallback") is not False:
                found.append(Finding(where, field_path(base + ("fallback",)),
                                     f"rank {rank.get('rank')!r} recorded fallback={rank.get('fallback')!r}"))
        nodes = {rank.get("node") for rank in ranks if isinstance(rank, dict)} if isinstance(ranks, list) else set()
        if ranks and topo.get("nnodes") != len(nodes):
            found.append(Finding(where, "topology.nnodes", f"is {topo.get('nnodes')!r} but the ranks ran on {len(nodes)} "
                                                           f"distinct node(s) {sorted(map(str, nodes))}"))


def _check_fingerprints(found: list[Finding], where: str, report: dict[str, Any], case: dict[str, Any]) -> None:
    """The fingerprints describe the case's shapes and dtypes."""
    ok, fps = get(report, ("bitwise_fingerprints",))
    if not ok or not isinstance(fps, dict):
        found.append(Finding(where, "bitwise_fingerprints", "missing: fingerprints of the aggregate tensors are required"))
    elif case:
        tokens = case.get("batch", 0) * case.get("seq", 0) if all(isinstance(case.get(k), int) for k in ("batch", "seq")) else None
        if fps.get("dtype") != "float32":
            found.append(Finding(where, "bitwise_fingerprints.dtype", f"is {fps.get('dtype')!r}; aggregates are float32"))
        if tokens is not None and fps.get("shape") != [tokens]:
            found.append(Finding(where, "bitwise_fingerprints.shape", f"is {fps.get('shape')!r}; batch*seq is {tokens}"))
        if tokens is not None and "padded_vocab" in case and fps.get("grad_shape") != [tokens, case["padded_vocab"]]:
            found.append(Finding(where, "bitwise_fingerprints.grad_shape",
                                 f"is {fps.get('grad_shape')!r}; expected [{tokens}, {case['padded_vocab']}]"))
        want_grad = TORCH_DTYPE_NAMES.get(case.get("dtype", ""))
        if want_grad and fps.get("grad_dtype") != want_grad:
            found.append(Finding(where, "bitwise_fingerprints.grad_dtype",
                                 f"is {fps.get('grad_dtype')!r}; {case.get('dtype')} logits give {want_grad} gradients"))


def _check_against_plan(found: list[Finding], where: str, report: dict[str, Any], case: dict[str, Any],
                        planned: PlannedReport | None, plan: Any) -> None:
    """The report's topology, command, case and case id are the plan's."""
    if planned is not None:
        for key, want in (("tp", planned.tp), ("cp", planned.cp)):
            if case.get(key) != want:
                found.append(Finding(where, f"case.{key}", f"is {case.get(key)!r} but the plan lists this file as {key}={want}"))
        if planned.command is not None and report.get("launch_command") != planned.command:
            found.append(Finding(where, "launch_command", "differs from the plan's command for this topology"))
    if isinstance(plan, dict):
        plan_case = plan.get("case")
        if isinstance(plan_case, dict):
            for key in sorted(set(plan_case) | (set(case) - {"tp", "cp"})):
                if case.get(key) != plan_case.get(key):
                    found.append(Finding(where, f"case.{key}", f"is {case.get(key)!r} but the plan's case has {plan_case.get(key)!r}"))
        if "case_id" in plan and report.get("case_id") != plan.get("case_id"):
            found.append(Finding(where, "case_id", f"is {report.get('case_id')!r} but the plan's is {plan.get('case_id')!r}"))


def check_report(
    report: Any,
    where: str,
    report_dir: Path,
    *,
    planned: PlannedReport | None = None,
    plan: Any = None,
    read: Callable[[Path], bytes] = Path.read_bytes,
) -> list[Finding]:
    """Every reason ``report`` is not acceptable evidence; empty when it is.

    ``where`` names the report in findings (e.g. ``tp2-cp1.json``); ``report_dir`` is where
    its raw tensor files lie. ``planned``/``plan`` add the consistency checks against the plan;
    ``read`` reads a raw tensor file (:meth:`rl_engine.rundir.Run.file_bytes`: once per run).
    """
    if not isinstance(report, dict):
        return [Finding(where, "(file)", f"a report must be a JSON object, got {type(report).__name__}")]
    found: list[Finding] = []
    _expect(found, where, report, ("passed",), True, "the runner judged this topology failed")
    failures = report.get("failures")
    if failures != []:
        detail = "; ".join(str(f) for f in failures) if isinstance(failures, list) else repr(failures)
        found.append(Finding(where, "failures", f"must be empty; recorded: {detail}"))
    ok, case = get(report, ("case",))
    case = case if ok and isinstance(case, dict) else {}
    if not case:
        found.append(Finding(where, "case", "missing: the report must record its case"))
    requested = report.get("requested_backend")
    if not isinstance(requested, str) or not requested:
        found.append(Finding(where, "requested_backend", f"is {requested!r}; the report must name the backend it requested"))
    _expect(found, where, report, ("actual_backend",), requested, "requested and actual backend must be the same")
    if "backend" in case and requested != case["backend"]:
        found.append(Finding(where, "requested_backend", f"is {requested!r} but the case requested {case['backend']!r}"))
    _expect(found, where, report, ("fallback",), False, "a silent fallback is never acceptable")
    _expect(found, where, report, ("tp_outputs_bitwise_replicated",), True, "TP peers must produce identical bytes")

    _check_topology(found, where, report, case, requested)
    _check_fingerprints(found, where, report, case)
    active, why = report_active(report)  # the recipe's rule, or a capture's recorded mask
    if why is not None:
        found.append(Finding(where, MASK_FIELD, why))
    _check_drift(found, where, report, case, active)
    found += check_tensor_files(report, where, report_dir, read)[1]
    _check_against_plan(found, where, report, case, planned, plan)
    return found
