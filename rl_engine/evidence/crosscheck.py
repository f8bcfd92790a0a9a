"""Cross-topology bitwise check: the guide's step 4, over every topology (CP=2 included).

:func:`compare_topologies` is the one definition of "the topologies agree": every field of
``bitwise_fingerprints`` (logp, LSE, entropy and gradient hashes with their dtypes and
shapes), the input hashes and the case id are equal to the first planned topology's, compared
as strings (hashes of bytes). :func:`crosscheck_run` adds that each raw tensor file hashes to
its fingerprint (the same :func:`~rl_engine.evidence.acceptance.check_tensor_files` the
acceptance uses). The ``crosscheck`` verb and ``verify`` both call these.

``python -m rl_engine crosscheck --run-dir RUN --output RUN/crosscheck.json [--min-topologies N]
[--against OTHER_RUN ...]``
writes ``crosscheck.json`` (validated against ``schemas/crosscheck.schema.json`` first: a
non-matching result is not written and the verb exits 1) and exits 1, naming the topology
and the field on stderr, when anything differs. Fewer than ``--min-topologies`` (default 2)
planned topologies is a failure: a comparison of one report with itself proves nothing.

``--against OTHER_RUN`` (repeatable) compares runs, not only topologies: each other run is
crosschecked on its own, then every one of its planned reports is compared with this run's
reference topology on the same fields (:func:`crosscheck_runs`). The fields include the
``case_id`` (the numerical case: dtype, vocabulary, tiles, shapes, seed, layout, scale) but
not the backend or the device, so a campaign run with ``pytorch-vocab-parallel-logp-ws2``
and one with ``cpu-vocab-parallel-logp-ws2`` (or on ``cuda``) must give identical
fingerprints. ``crosscheck.json`` then lists each other run under ``against``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl_engine.evidence.acceptance import check_tensor_files
from rl_engine.evidence.rundir import (
    PLAN,
    Finding,
    field_path,
    finish_gate,
    get,
    load_json,
    planned_reports,
)

SCHEMA_VERSION = "1"
FINGERPRINT_FIELDS: tuple[tuple[str, ...], ...] = tuple(
    ("bitwise_fingerprints", key)
    for key in (
        "dtype",
        "shape",
        "candidate_logp_sha256",
        "candidate_lse_sha256",
        "candidate_entropy_sha256",
        "candidate_grad_sha256",
        "grad_dtype",
        "grad_shape",
    )
) + (("inputs_sha256", "logits"), ("inputs_sha256", "targets"), ("inputs_sha256", "mask"), ("case_id",))
MISSING = "<missing>"


def compare_topologies(reports: Sequence[tuple[str, Any]]) -> list[Finding]:
    """Findings for every compared field that differs from the first report's (or is missing)."""
    if not reports:
        return []
    ref_label, ref = reports[0]
    found: list[Finding] = []
    for parts in FINGERPRINT_FIELDS:
        field = field_path(parts)
        ok, want = get(ref, parts)
        if not ok:
            found.append(Finding(ref_label, field, "missing in the reference topology"))
            continue
        for label, report in reports[1:]:
            ok, value = get(report, parts)
            if not ok:
                found.append(Finding(label, field, f"missing; {ref_label} has {want!r}"))
            elif value != want:
                found.append(Finding(label, field, f"{value!r} differs from {ref_label}'s {want!r}"))
    return found


def crosscheck_run(run_dir: Path, min_topologies: int = 2) -> tuple[dict[str, Any], list[Finding]]:
    """Compare every planned report of ``run_dir``; return crosscheck.json's content and findings."""
    found: list[Finding] = []
    plan, plan_found = load_json(run_dir / PLAN)
    found += plan_found
    planned, planned_found = planned_reports(plan, run_dir) if plan is not None else ([], [])
    found += planned_found
    if plan is not None and len(planned) < min_topologies:
        found.append(Finding(PLAN, "topologies", f"{len(planned)} planned topologies; the cross-topology check needs at least {min_topologies}"))
    loaded: list[tuple[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for item in planned:
        report, report_found = load_json(item.path)
        found += report_found
        row: dict[str, Any] = {"topology": item.label, "tp": item.tp, "cp": item.cp, "file": item.file,
                               "bitwise_fingerprints": None, "inputs_sha256": None, "tensors": []}
        if report is not None:
            loaded.append((item.label, report))
            for key in ("bitwise_fingerprints", "inputs_sha256"):
                value = report.get(key) if isinstance(report, dict) else None
                row[key] = value if isinstance(value, dict) else None
            checks, tensor_found = check_tensor_files(report, item.file, run_dir)
            found += tensor_found
            row["tensors"] = [c.to_dict() for c in checks]
        rows.append(row)
    found += compare_topologies(loaded)
    result = {
        "schema_version": SCHEMA_VERSION,
        "passed": not found,
        "reference": planned[0].label if planned else None,
        "fields": [field_path(parts) for parts in FINGERPRINT_FIELDS],
        "topologies": rows,
        "failures": [str(f) for f in found],
    }
    return result, found


def _reports(run_dir: Path) -> tuple[list[tuple[str, Any]], str | None]:
    """The loaded planned reports of a run (label, report), and its planned backend."""
    plan, _ = load_json(run_dir / PLAN)
    if plan is None:
        return [], None
    planned, _ = planned_reports(plan, run_dir)
    loaded = []
    for item in planned:
        report, _ = load_json(item.path)
        if report is not None:
            loaded.append((item.label, report))
    case = plan.get("case") if isinstance(plan, dict) else None
    backend = case.get("backend") if isinstance(case, dict) else None
    return loaded, backend if isinstance(backend, str) else None


def crosscheck_runs(
    run_dir: Path, against: Sequence[Path], min_topologies: int = 2
) -> tuple[dict[str, Any], list[Finding]]:
    """:func:`crosscheck_run` of ``run_dir``, then every run in ``against`` checked on its own and
    each of its planned reports compared with ``run_dir``'s reference topology.

    Findings of another run name it (``<run dir>:<topology>``). The result is
    ``crosscheck.json``'s content with ``against``: one entry per other run (its directory,
    its planned backend, how many reports were compared, and whether it passed).
    """
    result, found = crosscheck_run(run_dir, min_topologies)
    mine, my_backend = _reports(run_dir)
    entries = []
    for other in against:
        other_result, other_found = crosscheck_run(other, min_topologies)
        prefixed = [Finding(f"{other}:{f.where}", f.field, f.message) for f in other_found]
        theirs, their_backend = _reports(other)
        compared: list[Finding] = []
        if not mine:
            compared.append(Finding(str(run_dir), "reference", "no report to compare another run with"))
        elif not theirs:
            compared.append(Finding(str(other), "reports", "no planned report to compare"))
        else:
            ref_label, ref = mine[0]
            pairs = [(f"{run_dir}:{ref_label}", ref)] + [(f"{other}:{label}", r) for label, r in theirs]
            compared = compare_topologies(pairs)
        entries.append({
            "run_dir": str(other),
            "backend": their_backend,
            "reports_compared": len(theirs),
            "passed": not prefixed and not compared,
        })
        found = found + prefixed + compared
    result = {**result, "passed": not found, "failures": [str(f) for f in found],
              "backend": my_backend, "against": entries}
    return result, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_engine crosscheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory holding plan.json and the reports")
    parser.add_argument("--output", required=True, type=Path, help="where to write crosscheck.json")
    parser.add_argument("--min-topologies", type=int, default=2, help="fewest planned topologies accepted (default 2)")
    parser.add_argument("--against", type=Path, action="append", default=[], metavar="OTHER_RUN",
                        help="another run directory of the same case (another backend or device) whose "
                             "reports must have this run's fingerprints; repeatable")
    args = parser.parse_args(argv)
    if args.min_topologies < 1:
        parser.error(f"--min-topologies must be >= 1, got {args.min_topologies}")
    if not args.run_dir.is_dir():
        print(f"crosscheck: --run-dir {args.run_dir} is not a directory", file=sys.stderr)
        return 2
    for other in args.against:
        if not other.is_dir():
            print(f"crosscheck: --against {other} is not a directory", file=sys.stderr)
            return 2
    if args.against:
        result, found = crosscheck_runs(args.run_dir, args.against, args.min_topologies)
    else:
        result, found = crosscheck_run(args.run_dir, args.min_topologies)
    first = result["topologies"][0] if result["topologies"] else {}
    fps = first.get("bitwise_fingerprints") or {}
    return finish_gate(
        "crosscheck", args.output, result, "crosscheck", found,
        f"crosscheck passed: {len(result['topologies'])} topologies"
        + (f" and {len(args.against)} other run(s)" if args.against else "")
        + " bitwise identical "
        f"(logp {fps.get('candidate_logp_sha256')}, lse {fps.get('candidate_lse_sha256')})",
    )
