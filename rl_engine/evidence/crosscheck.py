"""Cross-topology bitwise check: the guide's step 4, over every topology (CP=2 included).

:func:`compare_topologies` is the one definition of "the topologies agree": every field of
``bitwise_fingerprints`` (logp, LSE, entropy and gradient hashes with their dtypes and
shapes), the input hashes and the case id are equal to the first planned topology's, compared
as strings (hashes of bytes). :func:`crosscheck_run` adds that each raw tensor file hashes to
its fingerprint (the same :func:`~rl_engine.evidence.acceptance.check_tensor_files` the
acceptance uses). The ``crosscheck`` verb and ``verify`` both call these.

``python -m rl_engine crosscheck --run-dir RUN --output RUN/crosscheck.json [--min-topologies N]``
writes ``crosscheck.json`` (validated against ``schemas/crosscheck.schema.json`` first: a
non-matching result is not written and the verb exits 1) and exits 1, naming the topology
and the field on stderr, when anything differs. Fewer than ``--min-topologies`` (default 2)
planned topologies is a failure: a comparison of one report with itself proves nothing.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_engine crosscheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory holding plan.json and the reports")
    parser.add_argument("--output", required=True, type=Path, help="where to write crosscheck.json")
    parser.add_argument("--min-topologies", type=int, default=2, help="fewest planned topologies accepted (default 2)")
    args = parser.parse_args(argv)
    if args.min_topologies < 1:
        parser.error(f"--min-topologies must be >= 1, got {args.min_topologies}")
    if not args.run_dir.is_dir():
        print(f"crosscheck: --run-dir {args.run_dir} is not a directory", file=sys.stderr)
        return 2
    result, found = crosscheck_run(args.run_dir, args.min_topologies)
    first = result["topologies"][0] if result["topologies"] else {}
    fps = first.get("bitwise_fingerprints") or {}
    return finish_gate(
        "crosscheck", args.output, result, "crosscheck", found,
        f"crosscheck passed: {len(result['topologies'])} topologies bitwise identical "
        f"(logp {fps.get('candidate_logp_sha256')}, lse {fps.get('candidate_lse_sha256')})",
    )
