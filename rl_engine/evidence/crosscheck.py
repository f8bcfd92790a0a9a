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
from rl_engine.evidence.gate import finish_gate
from rl_engine.rundir import PLAN, Finding, Run, field_path, get
from rl_engine.tables import SCHEMA_VERSION

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


def crosscheck_run(run: Run, min_topologies: int = 2) -> tuple[dict[str, Any], list[Finding]]:
    """Compare every planned report of ``run``; return crosscheck.json's content and findings."""
    found: list[Finding] = run.found(PLAN) + list(run.plan_findings)
    if run.plan is not None and len(run.planned) < min_topologies:
        found.append(Finding(PLAN, "topologies", f"{len(run.planned)} planned topologies; the cross-topology check "
                                                f"needs at least {min_topologies}"))
    rows: list[dict[str, Any]] = []
    for item, report in run.reports():
        found += run.found(item.file)
        row: dict[str, Any] = {"topology": item.label, "tp": item.tp, "cp": item.cp, "file": item.file,
                               "bitwise_fingerprints": None, "inputs_sha256": None, "tensors": []}
        if report is not None:
            for key in ("bitwise_fingerprints", "inputs_sha256"):
                value = report.get(key) if isinstance(report, dict) else None
                row[key] = value if isinstance(value, dict) else None
            checks, tensor_found = check_tensor_files(report, item.file, run.root, run.file_bytes)
            found += tensor_found
            row["tensors"] = [c.to_dict() for c in checks]
        rows.append(row)
    found += compare_topologies(_loaded(run))
    result = {
        "schema_version": SCHEMA_VERSION,
        "passed": not found,
        "reference": run.planned[0].label if run.planned else None,
        "fields": [field_path(parts) for parts in FINGERPRINT_FIELDS],
        "topologies": rows,
        "failures": [str(f) for f in found],
    }
    return result, found


def _loaded(run: Run) -> list[tuple[str, Any]]:
    """The readable planned reports of a run, (label, report) in plan order."""
    return [(item.label, report) for item, report in run.reports() if report is not None]


def _backend(run: Run) -> str | None:
    """The backend a run's plan names (None when it names none)."""
    backend = run.plan_case().get("backend")
    return backend if isinstance(backend, str) else None


def crosscheck_runs(
    run: Run, against: Sequence[Run], min_topologies: int = 2
) -> tuple[dict[str, Any], list[Finding]]:
    """:func:`crosscheck_run` of ``run``, then every run in ``against`` checked on its own and
    each of its planned reports compared with ``run``'s reference topology.

    Findings of another run name it (``<run dir>:<topology>``). The result is
    ``crosscheck.json``'s content with ``against``: one entry per other run (its directory,
    its planned backend, how many reports were compared, and whether it passed).
    """
    result, found = crosscheck_run(run, min_topologies)
    mine = _loaded(run)
    entries = []
    for other in against:
        _, other_found = crosscheck_run(other, min_topologies)
        prefixed = [Finding(f"{other.root}:{f.where}", f.field, f.message) for f in other_found]
        theirs = _loaded(other)
        compared: list[Finding] = []
        if not mine:
            compared.append(Finding(str(run.root), "reference", "no report to compare another run with"))
        elif not theirs:
            compared.append(Finding(str(other.root), "reports", "no planned report to compare"))
        else:
            ref_label, ref = mine[0]
            pairs = [(f"{run.root}:{ref_label}", ref)] + [(f"{other.root}:{label}", r) for label, r in theirs]
            compared = compare_topologies(pairs)
        entries.append({
            "run_dir": str(other.root),
            "backend": _backend(other),
            "reports_compared": len(theirs),
            "passed": not prefixed and not compared,
        })
        found = found + prefixed + compared
    result = {**result, "passed": not found, "failures": [str(f) for f in found],
              "backend": _backend(run), "against": entries}
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
        result, found = crosscheck_runs(Run.load(args.run_dir), [Run.load(o) for o in args.against],
                                        args.min_topologies)
    else:
        result, found = crosscheck_run(Run.load(args.run_dir), args.min_topologies)
    first = result["topologies"][0] if result["topologies"] else {}
    fps = first.get("bitwise_fingerprints") or {}
    return finish_gate(
        "crosscheck", args.output, result, "crosscheck", found,
        f"crosscheck passed: {len(result['topologies'])} topologies"
        + (f" and {len(args.against)} other run(s)" if args.against else "")
        + " bitwise identical "
        f"(logp {fps.get('candidate_logp_sha256')}, lse {fps.get('candidate_lse_sha256')})",
    )
