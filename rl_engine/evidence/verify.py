"""The reviewer's verifier: one offline command that says whether an evidence archive holds.

``python -m rl_engine verify ARCHIVE [--recompute [--max-replay-logits N]] [--no-outer-checksum]
[--accept-looser-tolerance] [--json OUT] [--max-member-mib N] [--max-total-mib N] [--max-members N]``

Runs without a GPU or network and checks, each as a row of the printed table:

1. **outer checksum**: ``ARCHIVE.sha256`` (``<hex>  NAME.tar.gz``, as ``archive`` writes it)
   matches the archive's SHA-256 and names it. A missing sidecar is a failure unless
   ``--no-outer-checksum`` is given (then the row says the check was skipped on request);
2. **safe extraction**: the archive is read member by member into a fresh temporary directory
   (:mod:`rl_engine.evidence.safe_tar`): absolute or ``..`` paths, links, devices, FIFOs,
   duplicate names, oversized members (default caps 256 MiB a member, 2 GiB in all), a
   member the file system cannot create (a file named like a directory, an over-long name) and
   a truncated or corrupt gzip are refused with the reason; nothing is written anywhere else
   and the temporary directory is removed on exit;
3. **top folder**: every member lies under ``NAME/``, the archive's own name;
4. **SHA256SUMS**: every line verifies and no file is missing from it or extra; **archive members**:
   every member is one a rule of the workflow or ``archive`` produces (:mod:`rl_engine.evidence.members`),
   and **REVIEWING.md** is byte-identical to what ``archive`` writes for this name and git record;
5. **JSON schemas**: every JSON artifact against the schemas shipped inside the archive
   (``NAME/schemas/``), strict JSON (no NaN/Infinity literals), ``parity.json`` too when the run
   has a parity stage;
6. **focused regression**: tests ran and none failed (the row gives the passed and skipped counts,
   and says when the pass was not run for this archive but reused from an earlier run: which run,
   when and at which commit, from ``regression.json``'s ``reused``);
7. **report acceptance**: :func:`rl_engine.evidence.acceptance.check_report` on every planned
   report (the same function the workflow's gate used), including each raw tensor's SHA-256
   against its recorded hash and fingerprint and its values against what the arithmetic
   guarantees (logp ``+0`` on inactive tokens, ``<= 0`` on active ones; LSE finite on active ones);
   on a case whose archive holds its capture (``inputs.archive: true``), ``capture.safetensors``
   with the case's recorded size and SHA-256;
8. **cross-topology fingerprints**: :func:`rl_engine.evidence.crosscheck.crosscheck_run` (the
   same function as the workflow's ``crosscheck``);
9. **recorded gates**: the archived ``validation.json`` and ``crosscheck.json`` passed;
10. **SUMMARY.md**: the shipped summary (what a reviewer reads) is byte-identical to the one
    :func:`rl_engine.evidence.summary.summary_text` (what the ``summary`` verb writes) renders
    again from the extracted evidence; the first differing line is named otherwise;
11. **tolerances**: the ``atol``/``rtol`` of the plan's case and of every report's case are no
    looser than the project's defaults for the dtype
    (:func:`rl_engine.logprob.comparison.default_tolerance`, what the runner uses when the
    config sets none). Looser tolerances fail unless ``--accept-looser-tolerance`` is given;
    then the row is a note that names them, not a pass. Tighter tolerances pass;
12. **arithmetic spec**: every report names one and the same version of the arithmetic, one
    this installation replays (:data:`rl_engine.arith.spec_numpy.SPECS`: the current
    ``docs/arithmetic.md``, :data:`rl_engine.arith.portable.SPEC_VERSION`, and every earlier
    one), and the archive packs that version's specification as ``arithmetic.md`` (its first
    line names the version; REVIEWING.md records its version and SHA-256,
    :mod:`rl_engine.evidence.spec_doc`);
13. **provenance statement**: ``provenance.intoto.json`` is strict JSON valid against the shipped
    ``schemas/provenance.schema.json`` (the in-toto Statement v1 with the SLSA provenance v1
    predicate), its ``_type`` and ``predicateType`` are those two, its subjects are exactly the
    archive's files but itself and ``SHA256SUMS``, each with the file's SHA-256, and its predicate
    names this archive (``invocationId``), the commit ``environment.json`` records and the times of
    its ``sourceDateEpoch`` (:func:`rl_engine.evidence.provenance.statement_problems`);
14. **RO-Crate**: ``ro-crate-metadata.json`` is strict JSON valid against the shipped
    ``schemas/ro-crate-metadata.schema.json`` and an RO-Crate 1.3 by the structural rules that hold
    offline (context, flat graph of unique ids whose local references resolve, metadata
    descriptor, root data entity, the Workflow Run Crate profiles, the main workflow), and its data
    entities are exactly the archive's files but itself (:func:`rl_engine.evidence.crate.crate_problems`).
    An archive that holds neither file, as archives made before them did, gets a note on both rows
    (and its REVIEWING.md is the text it was written with); one that holds only one fails the other;
15. with ``--recompute``: **inputs regenerated** (``make_inputs(case)``, or on a capture the
    archive's ``capture.safetensors`` or ``--capture PATH`` after its SHA-256, hashes to the report's
    ``inputs_sha256``), **oracle drift recomputed** from the raw tensors against the FP32
    and FP64 oracles, equal to the reported statistics within :data:`RECOMPUTE_TOL` and within
    the case's tolerance element by element, and **candidate replayed**: the candidate
    recomputed at TP=1 in this process (:func:`rl_engine.campaign.replay.replay_candidate`)
    must equal, byte for byte, every topology's logp, LSE and entropy files and all four
    fingerprints, the gradient's included; the first differing token is named. The recompute opens
    only raw tensor files that passed report acceptance, and refuses, before any input is
    generated, a replay of more than ``--max-replay-logits`` logits (tokens x padded vocabulary
    summed over the distinct cases; default :data:`MAX_REPLAY_LOGITS`), naming the size.

Each check runs on its own: one that stops on damaged content is a failed row naming the reason,
and every other check still runs. Every string printed comes from
:func:`rl_engine.evidence.terminal.terminal_text` (control characters escaped, length capped)
and is printed as plain text, never as markup; ``--json`` is written before the table is printed.

Two more rows say what was tested: **tested** (a note: the commit, its branch, whether the
working tree was dirty, i.e. had changes no commit holds, and the case: its id, device, dist
backend and topologies) and **run name** (the archive's name ``<campaign>-<commit>[-dirty]-case-<hash>``
must name the evidence: the commit and dirty flag of ``environment.json`` and the case hash of
``plan.json`` and ``regression.json`` (and ``parity.json`` when the run has one),
:mod:`rl_engine.campaign.casename`; a name without a
case hash, from before per-case names, is a note).

A note row, **reuse**, says whether the environment capture and the focused suite ran for this
archive or were reused from an earlier run (:mod:`rl_engine.record.reuse`: the run, when, its
commit); ``--json`` records the same as ``reused`` (``{"environment": ..., "regression": ...}``,
each null when the stage ran for this archive).

A note row says whether the shipped schemas are byte-identical to this installation's (a
difference is reported, not failed: an older archive may carry older schemas; the semantic
checks above do not depend on the schemas). Exit 0 only when every check holds; 1 otherwise;
2 on a bad argument. ``--json OUT`` also writes the table as ``schemas/verify.schema.json``
(validated before it is written).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:  # annotations only: torch is imported on --recompute alone
    import torch

from rl_engine import jsonio, schemas
from rl_engine.campaign.casename import NOGIT, RunName, RunNameError, evidence_case_hash
from rl_engine.evidence.acceptance import check_tensor_files
from rl_engine.evidence.archive import SCHEMA_DIR, SUFFIX, SUMS, reviewing_text
from rl_engine.evidence.crate import crate_problems
from rl_engine.evidence.crosscheck import crosscheck_run
from rl_engine.evidence.members import unexpected_members
from rl_engine.evidence.provenance import statement_problems
from rl_engine.evidence.safe_tar import MIB, Extracted, Limits, UnsafeArchiveError, safe_extract
from rl_engine.evidence.spec_doc import SPEC_DOC, spec_problems
from rl_engine.evidence.summary import UNPRINTABLE, SummaryError, regression_text, summary_text
from rl_engine.evidence.terminal import terminal_text
from rl_engine.evidence.validation import validate_run
from rl_engine.record import reuse
from rl_engine.rundir import (
    CRATE,
    ENVIRONMENT,
    PARITY_JSON,
    PLAN,
    REGRESSION,
    REVIEWING,
    STATEMENT,
    SUMMARY,
    VALIDATION,
    Finding,
    PlannedReport,
    Run,
    inside,
    is_number,
)
from rl_engine.tables import DEFAULT_TOLERANCES, MAX_THREADS_PER_RANK, SCHEMA_VERSION

RECOMPUTE_TOL = 1e-5
RECOMPUTED_STATS = ("max_abs", "mean_abs", "p95_abs", "p99_abs")
SIDECAR_LINE = re.compile(r"^([0-9a-f]{64}) [ *](\S.*)$")
SUMS_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")
MAX_DETAIL_LINES = 12
MAX_QUOTED = 160
LOOSER_FLAG = "--accept-looser-tolerance"
REPLAY_FLAG = "--max-replay-logits"
MAX_REPLAY_LOGITS = 1 << 26  # tokens x padded vocabulary, summed over the distinct cases replayed


@dataclass(frozen=True)
class Check:
    """One row of the verifier's table."""

    name: str
    passed: bool | None  # None: a note that does not decide the outcome
    detail: str
    problems: tuple[str, ...] = ()
    facts: dict[str, Any] | None = field(default=None, compare=False)  # a note's data for --json (the reuse row's)

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.detail, str):
            raise ValueError("Check needs a name and a detail string")
        object.__setattr__(self, "problems", tuple(self.problems))

    def status(self) -> str:
        return {True: "PASS", False: "FAIL", None: "note"}[self.passed]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status(), "detail": self.detail, "problems": list(self.problems)}


REUSE_ROW = "reuse"
REUSED_STAGES = (("environment", "the environment capture"), ("regression", "the focused suite"))


def regression_detail(run: Run) -> str:
    """The regression row's detail when it passes: the counts, as SUMMARY.md gives them, and whether
    the suite ran for this archive or its pass was reused from an earlier run."""
    reg = run.regression
    counts = regression_text(reg) if isinstance(reg, dict) else "no readable counts"
    if isinstance(reg, dict) and reuse.REUSED in reg:
        return (f"REUSED, not run for this archive: the pass of {reuse.reused_text(reg[reuse.REUSED])}, "
                f"none failed: {counts}")
    return f"tests ran for this archive, none failed: {counts}"


def _reused_fact(record: Any) -> dict[str, Any]:
    """A ``reused`` record as verify.json holds it (strings escaped: it comes from the archive)."""
    if not isinstance(record, dict):
        return {"from_run": terminal_text(repr(record)), "captured_utc": "", "from_commit": None, "key": ""}
    commit = record.get("from_commit")
    return {"from_run": terminal_text(str(record.get("from_run"))),
            "captured_utc": terminal_text(str(record.get("captured_utc"))),
            "from_commit": None if commit is None else terminal_text(str(commit)),
            "key": terminal_text(str(record.get("key")))}


def reuse_note(run: Run) -> Check:
    """The reuse row: which stages ran for this archive and which were copied from which earlier run."""
    documents = {"environment": run.environment, "regression": run.regression}
    facts: dict[str, Any] = {}
    parts = []
    for stage, what in REUSED_STAGES:
        doc = documents[stage]
        if isinstance(doc, dict) and reuse.REUSED in doc:
            facts[stage] = _reused_fact(doc[reuse.REUSED])
            parts.append(f"{what} REUSED from {reuse.reused_text(doc[reuse.REUSED])}")
        else:
            facts[stage] = None
            parts.append(f"{what} ran for this archive" if isinstance(doc, dict) else f"{what}: no readable record")
    return Check(REUSE_ROW, None, "; ".join(parts), facts=facts)


def _from_findings(name: str, found: list[Finding], ok_detail: str) -> Check:
    if not found:
        return Check(name, True, ok_detail)
    return Check(name, False, f"{len(found)} problem(s)", [str(f) for f in found])


def check_outer(archive: Path, skip: bool) -> Check:
    sidecar = archive.with_name(archive.name + ".sha256")
    if not sidecar.is_file():
        if skip:
            return Check("outer checksum", None, f"skipped on request (--no-outer-checksum); {sidecar.name} not checked")
        return Check("outer checksum", False, f"{sidecar.name} is missing; a reviewer cannot tell this archive is "
                     "the published one (pass --no-outer-checksum to skip this check knowingly)")
    lines = [ln for ln in sidecar.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    match = SIDECAR_LINE.match(lines[0]) if len(lines) == 1 else None
    if not match:
        return Check("outer checksum", False, f"{sidecar.name} must hold one line '<sha256>  {archive.name}'")
    actual = jsonio.sha256_file(archive)
    problems = []
    if match.group(2) != archive.name:
        problems.append(f"{sidecar.name} names {match.group(2)!r}, not {archive.name!r}")
    if match.group(1) != actual:
        problems.append(f"{sidecar.name} says {match.group(1)} but the archive's SHA-256 is {actual}: "
                        "the archive was changed or damaged after it was published")
    if problems:
        return Check("outer checksum", False, problems[0], problems)
    return Check("outer checksum", True, f"{actual} matches {sidecar.name}")


def check_sums(run: Run, files: tuple[str, ...], top: str) -> Check:
    root = run.root
    sums = root / SUMS
    if not sums.is_file():
        return Check("SHA256SUMS", False, f"{top}/{SUMS} is missing")
    listed: dict[str, str] = {}
    problems: list[str] = []
    for number, line in enumerate(sums.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        match = SUMS_LINE.match(line)
        if not match:
            problems.append(f"line {number} is not '<sha256>  <path>': {line[:80]!r}")
            continue
        digest, rel = match.groups()
        if not inside(rel):
            problems.append(f"line {number} names an unsafe path {rel!r}")
            continue
        if rel in listed:
            problems.append(f"line {number} lists {rel} a second time")
            continue
        listed[rel] = digest
    present = {f[len(top) + 1:] for f in files} - {SUMS}
    for rel in sorted(set(listed) - present):
        problems.append(f"{rel} is listed in SHA256SUMS but missing from the archive")
    for rel in sorted(present - set(listed)):
        problems.append(f"{rel} is in the archive but not listed in SHA256SUMS (extra member)")
    for rel in sorted(set(listed) & present):
        actual = run.sha256(root / rel)
        if actual != listed[rel]:
            problems.append(f"{rel}: SHA256SUMS says {listed[rel]} but the file's SHA-256 is {actual} (changed member)")
    if problems:
        return Check("SHA256SUMS", False, f"{len(problems)} problem(s)", problems)
    return Check("SHA256SUMS", True, f"{len(listed)} files verified, none missing or extra")


def _quote(line: str | None) -> str:
    if line is None:
        return "(no such line)"
    return repr(line) if len(line) <= MAX_QUOTED else repr(line[:MAX_QUOTED]) + "..."


def check_summary(run: Run) -> Check:
    """The shipped SUMMARY.md against the summary the extracted evidence renders, byte for byte."""
    shipped = run.root / SUMMARY
    if shipped.is_symlink() or not shipped.is_file():
        return Check("SUMMARY.md", False, f"{SUMMARY} is missing: the archive has no summary for a reviewer to read")
    try:
        expected = summary_text(run)
    except SummaryError as exc:
        return Check("SUMMARY.md", False, f"cannot render the summary again from the evidence: {exc}")
    except Exception as exc:  # damaged evidence: a failed row, not a traceback
        return Check("SUMMARY.md", False, f"rendering the summary again stopped: {type(exc).__name__}: {exc}")
    actual = shipped.read_bytes()
    controls = sorted({m.group() for m in UNPRINTABLE.finditer(actual.decode("utf-8", "replace"))} - {"\n"})
    if controls:
        return Check("SUMMARY.md", False, f"{SUMMARY} holds control or bidirectional characters "
                     f"{[f'U+{ord(c):04X}' for c in controls]}: a terminal would act on them; the project's "
                     "summary shows every such character as a visible escape")
    if actual == expected.encode("utf-8"):
        return Check("SUMMARY.md", True, "byte-identical to the summary rendered again from the evidence")
    count, problem = _line_difference(SUMMARY, actual, expected, "the evidence renders")
    return Check("SUMMARY.md", False, f"{SUMMARY} is not what the evidence renders ({count} line(s) differ): "
                 "what a reviewer reads does not match the evidence", [problem])


def _line_difference(name: str, actual: bytes, expected: str, source: str) -> tuple[int, str]:
    """How many lines differ, and the first one quoted from both sides."""
    have = actual.decode("utf-8", errors="replace").split("\n")
    want = expected.split("\n")
    differing = [i for i in range(max(len(have), len(want)))
                 if (have[i] if i < len(have) else None) != (want[i] if i < len(want) else None)]
    first = differing[0]
    return len(differing), (f"line {first + 1}: {name} has {_quote(have[first] if first < len(have) else None)} but "
                            f"{source} {_quote(want[first] if first < len(want) else None)}")


def check_reviewing(run: Run, top: str) -> Check:
    """The shipped REVIEWING.md against the one ``archive`` writes for this name and git record, byte for byte."""
    shipped = run.root / REVIEWING
    if shipped.is_symlink() or not shipped.is_file():
        return Check(REVIEWING, False, f"{REVIEWING} is missing: the archive has no instructions for a reviewer")
    environment = run.environment  # an unreadable one fails other rows; archive does the same
    git = environment.get("git") if isinstance(environment, dict) else None
    spec = run.root / SPEC_DOC  # REVIEWING.md records the packed spec's version and SHA-256
    expected = reviewing_text(top, git if isinstance(git, dict) else None,
                              spec.read_bytes() if spec.is_file() and not spec.is_symlink() else None,
                              described=_described(run))
    actual = shipped.read_bytes()
    if actual == expected.encode("utf-8"):
        return Check(REVIEWING, True, "byte-identical to the one the archive verb writes for this run")
    count, problem = _line_difference(REVIEWING, actual, expected, "the archive verb writes")
    return Check(REVIEWING, False, f"{REVIEWING} is not what the archive verb writes ({count} line(s) differ): the "
                 "instructions a reviewer follows were changed; do not run them", [problem])


def check_members(run: Run, files: tuple[str, ...], top: str) -> Check:
    """Every member is produced by a rule of the workflow or by ``archive`` (:mod:`rl_engine.evidence.members`)."""
    extra = unexpected_members(run, [f[len(top) + 1:] for f in files])
    if extra:
        return Check("archive members", False, f"{len(extra)} member(s) no rule produces", extra)
    return Check("archive members", True, f"all {len(files)} members are evidence, logs, schemas or what archive adds")


def _described(run: Run) -> bool:
    """The archive holds the provenance statement or the RO-Crate: every archive ``archive`` builds holds both;
    one made before them holds neither (its REVIEWING.md says nothing of them, and their rows are notes)."""
    return any(os.path.lexists(run.root / name) for name in (STATEMENT, CRATE))


def _undescribed(name: str) -> Check:
    return Check(name, None, f"the archive holds neither {STATEMENT} nor {CRATE}, as archives made before them did "
                 "(its REVIEWING.md says nothing of them): not checked; every other row checks the archive")


def _member_json(run: Run, name: str) -> tuple[Any, str | None]:
    """An archive-added JSON member, parsed strictly from the bytes the run reads once, or why it cannot be."""
    path = run.root / name
    if path.is_symlink() or not path.is_file():
        return None, f"{name} is missing: the archive's builder writes it"
    try:
        return jsonio.loads(run.file_bytes(path).decode("utf-8")), None
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"{name} is not strict JSON: {exc}"


def _member_digests(run: Run, files: tuple[str, ...], top: str) -> dict[str, str]:
    """Every member's SHA-256 by its path relative to the top folder (hashed once, with SHA256SUMS's check)."""
    return {f[len(top) + 1:]: run.sha256(run.root / f[len(top) + 1:]) for f in files}


def check_provenance(run: Run, files: tuple[str, ...], top: str) -> Check:
    """The in-toto statement: the shipped schemas, the types, exactly the archive's files as subjects with their
    digests, and the predicate naming this run (:func:`rl_engine.evidence.provenance.statement_problems`)."""
    name = "provenance statement"
    if not _described(run):
        return _undescribed(name)
    doc, unreadable = _member_json(run, STATEMENT)
    if unreadable:
        return Check(name, False, unreadable, [unreadable])
    digests = _member_digests(run, files, top)
    problems = statement_problems(doc, run, top, digests, run.root / SCHEMA_DIR)
    if problems:
        return Check(name, False, f"{len(problems)} problem(s)", problems)
    return Check(name, True, f"in-toto Statement v1 with SLSA provenance v1: {len(doc['subject'])} subjects, every "
                 f"file but {STATEMENT} and {SUMS}, each with its SHA-256")


def check_crate(run: Run, files: tuple[str, ...], top: str) -> Check:
    """The Workflow Run RO-Crate: the shipped schema, RO-Crate's structure, exactly the archive's files
    (:func:`rl_engine.evidence.crate.crate_problems`)."""
    name = "RO-Crate"
    if not _described(run):
        return _undescribed(name)
    doc, unreadable = _member_json(run, CRATE)
    if unreadable:
        return Check(name, False, unreadable, [unreadable])
    problems = crate_problems(doc, [f[len(top) + 1:] for f in files], run.root / SCHEMA_DIR)
    if problems:
        return Check(name, False, f"{len(problems)} problem(s)", problems)
    return Check(name, True, f"a Workflow Run RO-Crate listing all {len(files) - 1} other files of the archive")


def _tested(run: Run) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """environment.json's git record, plan.json and regression.json (empty objects when unreadable:
    unreadable files already fail other rows)."""
    env, plan, regression = (doc if isinstance(doc, dict) else {} for doc in (run.environment, run.plan, run.regression))
    git = env.get("git")
    return (git if isinstance(git, dict) else {}), plan, regression


def tested_note(run: Run) -> Check:
    """What was tested: commit, branch, dirty or clean, and the case (a note, never a failure)."""
    git, plan, _ = _tested(run)
    case = plan.get("case") if isinstance(plan.get("case"), dict) else {}
    topologies = ", ".join(f"{e.get('tp')}x{e.get('cp')}" for e in plan.get("topologies") or [] if isinstance(e, dict))
    if git.get("available") is True:
        tree = ("DIRTY working tree: the tested code had changes that no commit holds, so checking out the commit "
                "does not give exactly the tested code" if git.get("dirty") else "clean working tree")
        commit = f"commit {git.get('commit')} (branch {git.get('branch')}), {tree}"
    else:
        commit = f"no git state recorded ({git.get('reason')}): the tested code cannot be named by a commit"
    detail = (f"{commit}; case {plan.get('case_id')} on {case.get('device')}/{case.get('dist_backend')}, "
              f"backend {case.get('backend')}, topologies {topologies}")
    return Check("tested", None, detail)


def check_run_name(run: Run, top: str) -> Check:
    """The archive's name ``<campaign>-<commit>[-dirty]-case-<hash>`` names its evidence."""
    if "-case-" not in top:
        return Check("run name", None, f"{top!r} carries no case hash (an archive from before per-case run names); "
                     "commit and case are in the 'tested' row")
    try:
        name = RunName.parse(top)
    except RunNameError as exc:
        return Check("run name", False, str(exc), [str(exc)])
    git, plan, regression = _tested(run)
    problems = []
    if git.get("available") is True:
        short, dirty = git.get("short_commit"), git.get("dirty") is True
        if name.commit != short:
            problems.append(f"the name says commit {name.commit} but {ENVIRONMENT} records git.short_commit {short!r}")
        if name.dirty != dirty:
            problems.append(f"the name says {'dirty' if name.dirty else 'clean'} but {ENVIRONMENT} records "
                            f"git.dirty {git.get('dirty')!r}")
    elif name.commit != NOGIT:
        problems.append(f"the name says commit {name.commit} but {ENVIRONMENT} records no git state")
    try:
        digest = evidence_case_hash(plan, regression, run.parity if run.has_parity else None)
    except RunNameError as exc:
        problems.append(f"the case hash cannot be computed from the evidence: {exc}")
    else:
        if digest != name.case:
            parity = f" and {PARITY_JSON}" if run.has_parity else ""
            problems.append(f"the name says case {name.case} but {PLAN} and {REGRESSION}{parity} hash to case {digest}: "
                            "the archive is named for another campaign")
    if problems:
        return Check("run name", False, problems[0], problems)
    parity = f", {PARITY_JSON}" if run.has_parity else ""
    return Check("run name", True, f"campaign {name.campaign}, commit {name.commit}{' (dirty)' if name.dirty else ''} "
                 f"and case {name.case} match {ENVIRONMENT}, {PLAN}{parity} and {REGRESSION}")


def _planned(run: Run) -> tuple[tuple[PlannedReport, ...], list[str]]:
    """The plan's reports, or the messages of a failed row when there are none to check."""
    found = run.found(PLAN) + list(run.plan_findings)
    if found or not run.planned:
        return (), [str(f) for f in found] or ["no planned reports"]
    return run.planned, []


def _report_case(run: Run, item: PlannedReport) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """A planned report and its case, or ``None`` for what cannot be read."""
    report = run.report(item)
    if run.found(item.file) or not isinstance(report, dict) or not isinstance(report.get("case"), dict):
        return None, None
    return report, report["case"]


def _case_key(case: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a case across its topologies (everything but tp and cp)."""
    return tuple(sorted((k, jsonio.dumps(v) if isinstance(v, (dict, list)) else v)  # a capture record too
                        for k, v in case.items() if k not in ("tp", "cp")))


def check_tolerances(run: Run, accept_looser: bool) -> Check:
    """Every case's atol/rtol against the project's default tolerance for its dtype (the table that
    :func:`rl_engine.logprob.comparison.default_tolerance` reads, without importing torch)."""
    plan = run.plan
    problems = [str(f) for f in run.found(PLAN) + list(run.plan_findings)]
    cases: list[tuple[str, Any]] = [(PLAN, plan.get("case") if isinstance(plan, dict) else None)]
    for item, report in run.reports():  # unreadable reports already fail other rows
        if report is not None:
            cases.append((item.file, report.get("case") if isinstance(report, dict) else None))
    looser: list[str] = []
    for where, case in cases:
        if not isinstance(case, dict):
            problems.append(f"{where}: case: missing, so its tolerance cannot be checked")
            continue
        dtype = case.get("dtype")
        defaults = DEFAULT_TOLERANCES.get(dtype) if isinstance(dtype, str) else None
        if defaults is None:
            problems.append(f"{where}: case.dtype: dtype={dtype!r} has no default tolerance; use one of "
                            f"{list(DEFAULT_TOLERANCES)}")
            continue
        for key, default in zip(("atol", "rtol"), defaults):
            value = case.get(key)
            if not is_number(value) or not math.isfinite(value) or value < 0:
                problems.append(f"{where}: case.{key}: {value!r} is not a finite number >= 0")
            elif value > default:
                looser.append(f"{where}: case.{key}={value!r} is looser than the project's default {default!r} "
                              f"for {dtype}")
    if problems:
        return Check("tolerances", False, f"{len(problems)} problem(s)", problems)
    if looser and not accept_looser:
        return Check("tolerances", False, f"{len(looser)} tolerance(s) looser than the project's defaults: a "
                     f"lowered bar can make a report pass ({LOOSER_FLAG} accepts them knowingly)",
                     looser)
    if looser:
        return Check("tolerances", None, f"looser than the project's defaults, accepted on request ({LOOSER_FLAG}): "
                     + "; ".join(looser), looser)
    return Check("tolerances", True, f"atol/rtol of the plan and {len(cases) - 1} reports no looser than the "
                 "project's defaults for their dtype")


def _compare_stats(where: str, reported: Any, recomputed: dict[str, Any], path: str,
                   deviation: list[float]) -> list[str]:
    """Reported vs recomputed statistics; appends the largest |difference| to ``deviation``."""
    problems = []
    if not isinstance(reported, dict):
        return [f"{where}: {path}: missing"]
    for key in ("count", "passed"):
        if reported.get(key) != recomputed[key]:
            problems.append(f"{where}: {path}.{key}: reported {reported.get(key)!r}, recomputed {recomputed[key]!r}")
    for key in RECOMPUTED_STATS:
        got, want = reported.get(key), recomputed[key]
        finite = isinstance(got, (int, float)) and not isinstance(got, bool) and math.isfinite(got)
        if finite:
            deviation.append(abs(got - want))
        if not finite or abs(got - want) > RECOMPUTE_TOL:
            problems.append(f"{where}: {path}.{key}: reported {got!r}, recomputed {want!r} "
                            f"(allowed difference {RECOMPUTE_TOL})")
    return problems


def _raw_f32(run: Run, path: Path | None) -> torch.Tensor:
    """The float32 values of an accepted raw tensor file, from the bytes its check read."""
    from rl_engine.tensorio import f32_from_bytes  # imports torch: only on --recompute

    if path is None:
        raise TypeError("no accepted tensor file")
    return f32_from_bytes(run.file_bytes(path), path)


def _accepted_tensor(run: Run, item: PlannedReport, report: dict[str, Any], tensor: str) -> tuple[Path | None, str | None]:
    """The raw tensor file of ``report``, only when it passed the plain checks (``report acceptance``).

    :func:`rl_engine.evidence.acceptance.check_tensor_files` decides: a plain relative path inside
    the run, a regular file (not a link, device or FIFO), hashing to the recorded SHA-256 and
    fingerprint. Nothing else is ever opened, so ``--recompute`` reads no file the plain checks refused;
    the file's bytes are the ones those checks read (:meth:`rl_engine.rundir.Run.file_bytes`).
    """
    checks, _ = check_tensor_files(report, item.file, item.path.parent, run.file_bytes)
    for entry in checks:
        if entry.name == tensor and entry.ok:
            return item.path.parent / entry.path, None
    return None, (f"{item.file}: tensors.{tensor}: not read: it failed the report acceptance checks (a regular file "
                  "inside the run whose SHA-256 is the recorded one and the fingerprint)")


def replay_bound(run: Run, planned: tuple[PlannedReport, ...], max_logits: int) -> list[str]:
    """Why the replay is refused before any input is generated or any capture read: its logits (tokens x
    padded vocabulary, or the capture record's tokens x vocab where larger, summed over the distinct cases)
    over ``max_logits``, a case whose sizes are not positive integers or disagree with its capture record, or
    one whose ``threads_per_rank`` (the replay's CPU thread count) is not an integer from 1 to
    :data:`rl_engine.tables.MAX_THREADS_PER_RANK`, the bound the case itself has."""
    sizes: dict[tuple[Any, ...], tuple[int, int]] = {}
    problems = []
    for item in planned:
        _, case = _report_case(run, item)
        if case is None:
            continue  # the rows name an unreadable case themselves
        dims = [case.get(k) for k in ("batch", "seq", "padded_vocab")]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
            problems.append(f"{item.file}: case: batch, seq and padded_vocab must be positive integers to bound the "
                            f"replay, got {terminal_text(repr(dims), 200)}")
            continue
        threads = case.get("threads_per_rank", 1)
        if not (isinstance(threads, int) and not isinstance(threads, bool) and 1 <= threads <= MAX_THREADS_PER_RANK):
            problems.append(f"{item.file}: case: threads_per_rank must be an integer from 1 to {MAX_THREADS_PER_RANK} "
                            f"(the case's own bound) to set the replay's threads, got {terminal_text(repr(threads), 200)}")
            continue
        tokens, vocab = dims[0] * dims[1], dims[2]
        record = case.get("capture")
        if record is not None:  # the replay reads the capture's logits: bound what its record says
            held = [record.get(k) if isinstance(record, dict) else None for k in ("tokens", "vocab")]
            if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in held):
                problems.append(f"{item.file}: case.capture: tokens and vocab must be positive integers to bound "
                                f"the replay, got {terminal_text(repr(held), 200)}")
                continue
            if held != [tokens, vocab]:
                problems.append(f"{item.file}: case.capture records {held[0]} tokens x {held[1]} columns but the "
                                f"case has batch * seq = {tokens} tokens x padded_vocab {vocab}: the replay would "
                                "read the capture's logits, not the case's; nothing was read (a case is made "
                                "with its capture's sizes: rerun the workflow)")
            tokens, vocab = max(tokens, held[0]), max(vocab, held[1])
        sizes[_case_key(case)] = (tokens, vocab)
    total = sum(tokens * vocab for tokens, vocab in sizes.values())
    if total > max_logits:
        parts = " + ".join(f"{tokens} tokens x {vocab} padded vocabulary" for tokens, vocab in sizes.values())
        problems.append(f"the replay would generate {total} logits ({parts}), over the replay limit of {max_logits} "
                        f"logits ({REPLAY_FLAG}, default {MAX_REPLAY_LOGITS}: about {4 * max_logits >> 20} MiB of "
                        f"float32 logits); nothing was generated: raise the limit with {REPLAY_FLAG} N to replay "
                        "a case this large knowingly")
    return problems


def _recompute_rows(input_problems: list[str], drift_problems: list[str], reports: int,
                    deviation: float) -> tuple[Check, Check]:
    """The ``inputs regenerated`` and ``oracle drift recomputed`` rows of :func:`recompute`."""
    inputs = (Check("inputs regenerated", False, f"{len(input_problems)} problem(s)", input_problems) if input_problems
              else Check("inputs regenerated", True, "the inputs (make_inputs(case), or the capture after its SHA-256) "
                         f"match inputs_sha256 in {reports} reports"))
    drift_check = (Check("oracle drift recomputed", False, f"{len(drift_problems)} problem(s)", drift_problems)
                   if drift_problems else
                   Check("oracle drift recomputed", True, f"FP32/FP64 oracle drift of {reports} reports equals "
                         f"the reported statistics (largest difference {deviation:.3g}, allowed "
                         f"{RECOMPUTE_TOL}) and is within tolerance"))
    return inputs, drift_check


def recompute(run: Run, max_logits: int = MAX_REPLAY_LOGITS, capture: Path | None = None) -> tuple[Check, Check]:
    """Regenerate inputs from each report's case (or read its capture: ``--capture`` or the
    archive's copy: :func:`rl_engine.campaign.replay.regenerate_inputs`) and recompute drift from
    the raw tensors."""
    import torch

    from rl_engine.campaign.captured import case_row_sampling
    from rl_engine.campaign.case import captures_sampling, record_oracle_drift
    from rl_engine.campaign.replay import case_source, regenerate_inputs

    planned, msg = _planned(run)
    msg = msg or replay_bound(run, planned, max_logits)
    if msg:
        return Check("inputs regenerated", False, msg[0], msg), Check("oracle drift recomputed", False, msg[0], msg)
    input_problems: list[str] = []
    drift_problems: list[str] = []
    cache: dict[tuple[Any, ...], tuple[Any, Any, Any, dict[str, str], Any]] = {}
    deviation: list[float] = [0.0]
    threads = torch.get_num_threads()
    try:
        for item in planned:
            report, case = _report_case(run, item)
            if report is None or case is None:
                input_problems.append(f"{item.file}: case: unreadable report or case")
                continue
            key = _case_key(case)
            try:
                if key not in cache:  # the inputs and, at sampling: capture, every row's captured sampling
                    # the capture's file is hashed again only where its sampling tensors are read
                    sampled = case_row_sampling(case, case_source(case, run.root, capture)) \
                        if captures_sampling(case) else None
                    cache[key] = (*regenerate_inputs(case, run.root, capture), sampled)
                logits, targets, active, hashes, captured = cache[key]
            except (ValueError, TypeError) as exc:
                input_problems.append(f"{item.file}: case: cannot regenerate inputs ({exc})")
                drift_problems.append(f"{item.file}: drift not recomputed: no inputs (see inputs regenerated)")
                continue
            recorded = report.get("inputs_sha256") if isinstance(report.get("inputs_sha256"), dict) else {}
            for name, digest in hashes.items():
                if recorded.get(name) != digest:
                    input_problems.append(f"{item.file}: inputs_sha256.{name}: recorded {recorded.get(name)!r}, "
                                          f"regenerated {digest}")
            paths = {name: _accepted_tensor(run, item, report, name) for name in ("logp", "lse")}
            refused = [why for _, why in paths.values() if why]
            if refused:
                drift_problems += refused
                continue
            try:
                logp = _raw_f32(run, paths["logp"][0])
                lse = _raw_f32(run, paths["lse"][0])
            except (KeyError, TypeError, OSError, ValueError) as exc:
                drift_problems.append(f"{item.file}: tensors: cannot read the raw logp/lse files ({exc})")
                continue
            n = targets.numel()
            if logp.numel() != n or lse.numel() != n:
                drift_problems.append(f"{item.file}: tensors: logp/lse hold {logp.numel()}/{lse.numel()} values, "
                                      f"the case has {n} tokens")
                continue
            torch.set_num_threads(case.get("threads_per_rank", 1))  # bounded by replay_bound
            drift = record_oracle_drift(case, logp, lse, logits, targets, active, captured)  # the runner's oracle
            for oracle, quantities in drift.items():
                for quantity, stats in quantities.items():
                    reported = (report.get("drift") or {}).get(oracle, {}).get(quantity)
                    drift_problems += _compare_stats(item.file, reported, stats, f"drift.{oracle}.{quantity}",
                                                     deviation)
                    if oracle == "fp32_oracle" and not stats["passed"]:
                        drift_problems.append(f"{item.file}: drift.{oracle}.{quantity}: recomputed max_abs "
                                              f"{stats['max_abs']!r} is outside atol={case['atol']} rtol={case['rtol']}")
    except Exception as exc:  # a hostile or damaged case must end as a failed row, not a traceback
        drift_problems.append(f"recompute stopped: {type(exc).__name__}: {exc}")
    finally:
        torch.set_num_threads(threads)
    return _recompute_rows(input_problems, drift_problems, len(planned), max(deviation))


def check_arithmetic_spec(run: Run) -> Check:
    """Every planned report names one version of the arithmetic, one this installation replays,
    and the archive packs that version's specification."""
    from rl_engine.arith.spec_numpy import SPEC_VERSION, SPECS

    planned, msg = _planned(run)
    if msg:
        return Check("arithmetic spec", False, msg[0], msg)
    problems = []
    versions: set[str] = set()
    for item in planned:
        report = run.report(item)
        got = report.get("arithmetic_spec") if isinstance(report, dict) else None
        if got not in SPECS:
            problems.append(f"{item.file}: arithmetic_spec: {terminal_text(repr(got), 80)} is not a version this "
                            f"verifier replays ({', '.join(SPECS)}); verify with an rl_engine release that "
                            "implements it")
        else:
            versions.add(got)
    if len(versions) > 1:
        problems.append(f"the reports name different arithmetic versions ({', '.join(sorted(versions))}): one campaign "
                        "is computed under one")
    claimed = versions.pop() if len(versions) == 1 else SPEC_VERSION
    spec = run.root / SPEC_DOC
    reviewing = run.root / REVIEWING
    problems += spec_problems(spec.read_bytes() if spec.is_file() else None, claimed,
                              reviewing.read_text(encoding="utf-8", errors="replace") if reviewing.is_file() else None)
    if problems:
        return Check("arithmetic spec", False, f"{len(problems)} problem(s)", problems)
    earlier = "" if claimed == SPEC_VERSION else f" (an earlier version than this rl_engine's {SPEC_VERSION}: replayed under its own)"
    return Check("arithmetic spec", True, f"{len(planned)} reports computed under {claimed}{earlier}; its text packed as "
                 f"{SPEC_DOC}, the version and SHA-256 REVIEWING.md records")


def _first_difference(name: str, archived: Any, replayed: Any) -> str:
    """The first token whose bytes differ, with both values and their bits."""
    import torch

    a = archived.view(torch.int32)
    b = replayed.view(torch.int32)
    index = int((a != b).nonzero()[0, 0]) if a.numel() == b.numel() else 0
    if a.numel() != b.numel():
        return f"{name}: {a.numel()} values archived, {b.numel()} replayed"
    return (f"{name}: first differing token {index}: archived {float(archived[index])!r} "
            f"(0x{int(a[index]) & 0xFFFFFFFF:08x}), replayed {float(replayed[index])!r} "
            f"(0x{int(b[index]) & 0xFFFFFFFF:08x})")


def replay(run: Run, max_logits: int = MAX_REPLAY_LOGITS, capture: Path | None = None) -> Check:
    """Recompute the candidate at TP=1 and require byte equality with every topology."""
    import torch

    from rl_engine.campaign.replay import REFERENCE_BACKEND, arith_backends, case_source, replay_candidate
    from rl_engine.rundir import TENSOR_NAMES
    from rl_engine.tensorio import tensor_bytes

    name = "candidate replayed"
    planned, msg = _planned(run)
    msg = msg or replay_bound(run, planned, max_logits)
    if msg:
        return Check(name, False, msg[0], msg)
    problems: list[str] = []
    cache: dict[tuple[Any, ...], Any] = {}
    compared = 0
    try:
        for item in planned:
            report, case = _report_case(run, item)
            if report is None or case is None:
                problems.append(f"{item.file}: case: unreadable report or case")
                continue
            spec = report.get("arithmetic_spec")
            key = (_case_key(case), spec)
            if key not in cache:
                # a case of any backend of the arithmetic spec is replayed by the eager
                # reference: no compiled kernel needed here, and the strictest comparison;
                # a report of an earlier arithmetic version, by that version's NumPy implementation
                by = REFERENCE_BACKEND if case.get("backend") in arith_backends() else None
                cache[key] = replay_candidate(case, backend=by, capture=case_source(case, run.root, capture),
                                              spec=spec if isinstance(spec, str) else "")
            again = cache[key]
            for tensor in TENSOR_NAMES:
                path, refused = _accepted_tensor(run, item, report, tensor)
                if path is None:
                    problems.append(str(refused))
                    continue
                try:
                    archived = _raw_f32(run, path)
                except (KeyError, TypeError, OSError, ValueError) as exc:
                    problems.append(f"{item.file}: tensors.{tensor}: cannot read the raw file ({exc})")
                    continue
                if tensor_bytes(archived) != tensor_bytes(again.tensors[tensor]):
                    problems.append(f"{item.file}: " + _first_difference(tensor, archived, again.tensors[tensor]))
            recorded = report.get("bitwise_fingerprints") if isinstance(report.get("bitwise_fingerprints"), dict) else {}
            for field, digest in again.fingerprints().items():
                if recorded.get(field) != digest:
                    problems.append(f"{item.file}: bitwise_fingerprints.{field}: recorded {recorded.get(field)!r}, "
                                    f"replayed {digest}")
            compared += 1
    except Exception as exc:  # a hostile or damaged case must end as a failed row, not a traceback
        problems.append(f"replay stopped: {type(exc).__name__}: {exc}")
    if problems:
        return Check(name, False, f"{len(problems)} problem(s)", problems)
    return Check(name, True, f"the candidate recomputed at TP=1 on this machine ({torch.__version__}, "
                 f"{len(cache)} case(s)) equals the logp, LSE and entropy bytes and the four fingerprints "
                 f"of all {compared} topologies")


def schema_note(shipped: Path) -> Check:
    mine = schemas.repo_schema_dir()
    differ = []
    names = sorted({p.name for p in shipped.glob("*.schema.json")} | {p.name for p in mine.glob("*.schema.json")})
    for name in names:
        a, b = shipped / name, mine / name
        if not a.is_file() or not b.is_file() or a.read_bytes() != b.read_bytes():
            differ.append(name)
    if not differ:
        return Check("schemas vs this rl_engine", None, "shipped schemas are byte-identical to this installation's")
    return Check("schemas vs this rl_engine", None, f"shipped schemas differ from this installation's: {', '.join(differ)} "
                 "(checks above used the shipped ones)")


DEFAULT_LIMITS = Limits()  # the archive bounds verify applies unless told otherwise


def verify(archive: Path, *, recompute_drift: bool = False, skip_outer: bool = False,
           limits: Limits = DEFAULT_LIMITS, accept_looser_tolerance: bool = False,
           max_replay_logits: int = MAX_REPLAY_LOGITS, capture: Path | None = None) -> list[Check]:
    """Every check of the module docstring, in order; later checks are skipped after a refusal."""
    checks = [check_outer(archive, skip_outer)]
    with tempfile.TemporaryDirectory(prefix="rl_engine-verify-") as tmp:
        try:
            extracted = safe_extract(archive, Path(tmp), limits)
        except UnsafeArchiveError as exc:
            checks.append(Check("safe extraction", False, str(exc), [str(exc)]))
            return checks
        checks.append(Check("safe extraction", True, f"{len(extracted.files)} files, {extracted.total_bytes} bytes, "
                            "no links, devices, unsafe paths or duplicates"))
        expected = archive.name[: -len(SUFFIX)] if archive.name.endswith(SUFFIX) else None
        if extracted.top != expected:
            checks.append(Check("top folder", False, f"members lie under {extracted.top!r}, expected {expected!r} "
                                f"(the archive's name without {SUFFIX})"))
        else:
            checks.append(Check("top folder", True, f"every member under {extracted.top}/"))
        checks.extend(_checks_of_extracted(extracted, recompute_drift, accept_looser_tolerance, max_replay_logits,
                                           capture))
    return checks


def _guarded(names: tuple[str, ...], run: Any) -> list[Check]:
    """``run()``'s rows; an exception fails the rows ``names`` alone, so every other check still runs."""
    try:
        out = run()
    except Exception as exc:  # damaged content must end as a failed row a reviewer can read, not a traceback
        detail = f"checking stopped: {type(exc).__name__}: {exc}"
        return [Check(name, False, detail, [detail]) for name in names]
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _checks_of_extracted(extracted: Extracted, recompute_drift: bool, accept_looser: bool,
                         max_replay_logits: int = MAX_REPLAY_LOGITS, capture: Path | None = None) -> list[Check]:
    """The tested commit and case, the run name, then checks 4-14 on an extracted archive (module docstring).

    Each check runs on its own: one that stops on damaged content is a failed row, the others still run.
    """
    root, top = extracted.root, extracted.top
    run = Run.load(root)  # load_json turns every unreadable document into findings, never an exception
    shipped = root / SCHEMA_DIR
    gated = ("JSON schemas (shipped)", "focused regression", "report acceptance", "recorded gates")
    checks = [*_guarded(("tested",), lambda: tested_note(run)),
              *_guarded((REUSE_ROW,), lambda: reuse_note(run)),
              *_guarded(("run name",), lambda: check_run_name(run, top)),
              *_guarded(("SHA256SUMS",), lambda: check_sums(run, extracted.files, top)),
              *_guarded(("archive members",), lambda: check_members(run, extracted.files, top)),
              *_guarded(("REVIEWING.md",), lambda: check_reviewing(run, top))]
    validated = _guarded(gated, lambda: _validation_rows(run, shipped, top))
    checks += [c for c in validated if c.name != "recorded gates"]
    checks += _guarded(("cross-topology fingerprints",), lambda: _cross_row(run))
    checks += [c for c in validated if c.name == "recorded gates"]
    checks += _guarded(("SUMMARY.md",), lambda: check_summary(run))
    checks += _guarded(("tolerances",), lambda: check_tolerances(run, accept_looser))
    checks += _guarded(("arithmetic spec",), lambda: check_arithmetic_spec(run))
    checks += _guarded(("provenance statement",), lambda: check_provenance(run, extracted.files, top))
    checks += _guarded(("RO-Crate",), lambda: check_crate(run, extracted.files, top))
    if recompute_drift:
        checks += _guarded(("inputs regenerated", "oracle drift recomputed"),
                           lambda: recompute(run, max_replay_logits, capture))
        checks += _guarded(("candidate replayed",), lambda: replay(run, max_replay_logits, capture))
    if shipped.is_dir():
        checks += _guarded(("schemas vs this rl_engine",), lambda: schema_note(shipped))
    return checks


def _validation_rows(run: Run, shipped: Path, top: str) -> list[Check]:
    """The rows :func:`rl_engine.evidence.validation.validate_run` decides: schemas, regression, acceptance, gates."""
    validation = validate_run(run, shipped, gates=True)
    n_reports = len(validation.result.get("reports", []))
    gates = list(validation.gates)
    recorded = run.doc(VALIDATION)
    if isinstance(recorded, dict) and recorded.get("schemas") != validation.result.get("schemas"):
        gates.append(Finding("validation.json", "schemas", "the recorded validation used schemas other than "
                             f"the ones shipped in {top}/{SCHEMA_DIR}/"))
    return [_from_findings("JSON schemas (shipped)", [*validation.load, *validation.schema],
                           f"every artifact valid against {top}/{SCHEMA_DIR}/ and strict JSON"),
            _from_findings("focused regression", list(validation.regression), regression_detail(run)),
            _from_findings("report acceptance", list(validation.acceptance),
                           f"{n_reports} reports accepted; raw tensors match their fingerprints"),
            _from_findings("recorded gates", gates, "validation.json and crosscheck.json passed, "
                           "with the shipped schemas")]


def _cross_row(run: Run) -> Check:
    cross, cross_found = crosscheck_run(run)
    return _from_findings("cross-topology fingerprints", cross_found,
                          f"{len(cross['topologies'])} topologies bitwise identical ({len(cross['fields'])} fields)")


def _cell(text: str) -> Text:
    """Archive-derived text as a table cell: control characters escaped, never parsed as markup."""
    return Text(terminal_text(text))


def _table(archive: Path, checks: list[Check]) -> Table:
    table = Table(title=_cell(f"verify {archive.name}"), title_justify="left")
    table.add_column("Check")
    table.add_column("Result")
    table.add_column("Detail", overflow="fold")
    colours = {"PASS": "green", "FAIL": "bold red", "note": "yellow"}
    for check in checks:
        detail = check.detail
        if check.problems and check.passed is False:
            shown = [terminal_text(p) for p in check.problems[:MAX_DETAIL_LINES]]
            more = len(check.problems) - len(shown)
            detail = "\n".join(shown + ([f"... and {more} more"] if more else []))
        status = check.status()
        table.add_row(_cell(check.name), Text(status, style=colours[status]), _cell(detail))
    return table


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return number


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_engine verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("archive", type=Path, help="results/NAME.tar.gz (NAME.tar.gz.sha256 expected next to it)")
    parser.add_argument("--recompute", action="store_true", help="regenerate inputs and recompute oracle drift")
    parser.add_argument("--capture", type=Path, default=None,
                        help="with --recompute, for a campaign on a capture the archive does not hold: the "
                             "captured file (it must have the case's recorded SHA-256)")
    parser.add_argument("--no-outer-checksum", action="store_true", help="accept a missing NAME.tar.gz.sha256 (row says so)")
    parser.add_argument(LOOSER_FLAG, dest="accept_looser_tolerance", action="store_true",
                        help="accept atol/rtol looser than the project's defaults for the dtype (bf16/fp16/fp32 "
                             "defaults of rl_engine.logprob.comparison); without it they fail, with it the "
                             "tolerances row is a note naming them")
    parser.add_argument(REPLAY_FLAG, dest="max_replay_logits", type=_positive, default=MAX_REPLAY_LOGITS,
                        metavar="N", help="with --recompute: the most logits (tokens x padded vocabulary, summed "
                                          f"over the distinct cases) the replay generates (default {MAX_REPLAY_LOGITS}"
                                          ", about 256 MiB of float32); a larger case is refused before any input "
                                          "is generated")
    parser.add_argument("--json", type=Path, default=None, help="also write the result as JSON (verify.schema.json)")
    parser.add_argument("--max-member-mib", type=int, default=Limits().max_member_bytes // MIB, metavar="MIB",
                        help="refuse the archive if one member would extract to more than this many MiB "
                             f"(default {Limits().max_member_bytes // MIB}); nothing is extracted")
    parser.add_argument("--max-total-mib", type=int, default=Limits().max_total_bytes // MIB, metavar="MIB",
                        help="refuse the archive if its members would extract to more than this many MiB in all "
                             f"(default {Limits().max_total_bytes // MIB})")
    parser.add_argument("--max-members", type=int, default=Limits().max_members, metavar="N",
                        help=f"refuse an archive of more than N members (default {Limits().max_members})")
    args = parser.parse_args(argv)
    if args.capture is not None and not args.recompute:
        parser.error(f"--capture {args.capture} is read only by --recompute; add --recompute or drop --capture")
    if args.capture is not None and not args.capture.is_file():
        parser.error(f"--capture {terminal_text(str(args.capture))}: no such regular file (looked for "
                     f"{terminal_text(str(args.capture.absolute()))}); give the path of the captured file")
    if not args.archive.is_file():
        shown_path = terminal_text(str(args.archive))
        why = ("does not exist" if not args.archive.exists() else
               "is a directory, not an archive" if args.archive.is_dir() else "is not a regular file")
        print(f"verify: {shown_path} {why} (looked for {terminal_text(str(args.archive.absolute()))}); give the path "
              "of an evidence archive (results/<name>.tar.gz)", file=sys.stderr)
        return 2
    try:
        limits = Limits(args.max_member_mib * MIB, args.max_total_mib * MIB, args.max_members)
    except ValueError as exc:
        parser.error(str(exc))
    checks = verify(args.archive, recompute_drift=args.recompute, skip_outer=args.no_outer_checksum, limits=limits,
                    accept_looser_tolerance=args.accept_looser_tolerance, max_replay_logits=args.max_replay_logits,
                    capture=args.capture)
    passed = all(c.passed is not False for c in checks) and any(c.name == "recorded gates" for c in checks)
    reused = next((c.facts for c in checks if c.name == REUSE_ROW and c.facts is not None), None)
    failures = [f"{c.name}: {p}" for c in checks if c.passed is False for p in (c.problems or [c.detail])]
    if args.json is not None:  # written before anything is printed: the record never depends on the terminal
        try:
            schemas.write_validated(args.json, {
                "schema_version": SCHEMA_VERSION,
                "archive": args.archive.name,
                "recompute": args.recompute,
                "passed": passed,
                "reused": reused,
                "checks": [c.to_dict() for c in checks],
                "failures": failures,
            }, "verify")
        except schemas.ArtifactSchemaError as exc:
            print(f"verify: --json {terminal_text(str(args.json))} not written: {terminal_text(str(exc))}",
                  file=sys.stderr)
            return 1
    console = Console(width=160)
    console.print(_table(args.archive, checks))
    if passed:
        console.print(Text.assemble(("VERIFIED", "bold green"),
                                    f": every check holds for {terminal_text(args.archive.name)}"))
        return 0
    print(f"verify: {terminal_text(args.archive.name)} FAILED {sum(c.passed is False for c in checks)} check(s):",
          file=sys.stderr)
    for failure in failures[:50]:
        print(f"  {terminal_text(failure)}", file=sys.stderr)
    return 1
