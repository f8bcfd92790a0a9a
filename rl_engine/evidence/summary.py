"""``SUMMARY.md``: the reference guide's write-up, generated from the evidence files only.

``python -m rl_engine summary --run-dir RUN --output RUN/SUMMARY.md`` reads
``environment.json``, ``regression.json`` (and the JUnit XML it names), ``plan.json``, every
planned report, ``validation.json`` and ``crosscheck.json`` and writes, in the guide's shape:
status, tested commit, validation matrix, per-topology table (TP, CP, ranks, the nodes they
ran on, LSE max abs, active dlogp max abs, result), acceptance results at full precision, the
focused regression with the reason of every skipped test, fingerprints, hardware and runtime,
reproduction (the commit, a config file that reproduces the case and the run's exact
commands), boundary, and artifacts with their SHA-256; with a parity stage, its five sections from
``parity.json``. Every number comes from those files; nothing is typed in. The same tables are printed on the console with rich.

The text is a function of the evidence files alone (:func:`summary_text`): ``verify`` renders it
again from an extracted archive and compares bytes with the shipped ``SUMMARY.md``. The
artifact table lists the evidence files the evidence names
(:meth:`rl_engine.rundir.Run.evidence_files`: not ``SUMMARY.md`` itself, the logs, or any
other file lying in the run directory), so it says the same of a run directory and of an archive
that packs the workflow's declared files.

Exit 0 when written, whatever the evidence says: evidence whose recorded gates failed gets a
FAILED status. That happens only when the verb is run by hand on such evidence; in the
workflow the summary rule needs ``validation.json`` and ``crosscheck.json``, and Snakemake
deletes those when their gate fails, so a workflow never reaches the summary of a failed run.
Exit 1 when an evidence file cannot be read.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table
from rich.text import Text

from rl_engine import jsonio
from rl_engine.campaign.case import captures_sampling, record_config
from rl_engine.campaign.casename import RunNameError, pytest_args_of
from rl_engine.campaign.plan import RUNNER_MODULE
from rl_engine.evidence.spec_doc import SPEC_DOC
from rl_engine.evidence.terminal import terminal_text
from rl_engine.rundir import (
    CASE,
    CROSSCHECK,
    ENVIRONMENT,
    PARITY_JSON,
    PARITY_PNG,
    PLAN,
    REGRESSION,
    VALIDATION,
    Finding,
    PlannedReport,
    Run,
)
from rl_engine.tables import UNPRINTABLE_CLASS


class SummaryError(ValueError):
    """Evidence that cannot be summarised (a file missing or unreadable)."""


@dataclass(frozen=True)
class Evidence:
    environment: dict[str, Any]
    regression: dict[str, Any]
    plan: dict[str, Any]
    planned: tuple[PlannedReport, ...]
    reports: tuple[dict[str, Any], ...]
    validation: dict[str, Any]
    crosscheck: dict[str, Any]
    parity: dict[str, Any] | None = None  # parity.json, when the run has a parity stage


# C0 (newline and tab included), DEL, C1 and the bidirectional overrides: what defs.schema.json's
# "printable" refuses. In a Markdown table cell each is shown as a visible escape instead.
UNPRINTABLE = re.compile(f"[{UNPRINTABLE_CLASS}]")
# What a string from the evidence could turn into markup: a backslash (it would escape what follows,
# e.g. the pipe's escape), the HTML specials (a tag such as <img src=...> or <script>, an autolink)
# and "](" (the middle of an inline link or image, ![..](url)). Headings, lists and link reference
# definitions need a line of their own, which the control escapes already rule out.
_MARKUP = {"\\": "\\\\", "&": "&amp;", "<": "&lt;", ">": "&gt;", "](": "]\\(", "|": "\\|"}
_MARKUP_RE = re.compile("|".join(re.escape(k) for k in _MARKUP))


def md_cell(text: str) -> str:
    """A string from the evidence as SUMMARY.md holds it (a table cell, or a value in a sentence or
    a code span), whatever it held: no markup can come of it. A backslash is doubled, ``&``, ``<``,
    ``>`` become HTML entities (no tag, no autolink), ``](`` becomes ``]\\(`` (no inline link or
    image), ``|`` is escaped (the cell is not split), and every control character (a raw ESC
    sequence, a newline that would end the row or start a heading) and bidirectional override
    becomes a visible ``\\xNN`` or ``\\uNNNN`` escape, so a string from the evidence cannot leave its
    cell or line, load anything, or reach a reviewer's terminal as a command. Backticks are kept
    (cells hold code spans); one in a value can end its span, and then meets only escaped text.
    Anything else is unchanged, so ordinary evidence renders as it did. The one function every
    evidence string of SUMMARY.md goes through."""
    text = _MARKUP_RE.sub(lambda m: _MARKUP[m.group()], text)
    return UNPRINTABLE.sub(lambda m: (f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                                      else f"\\u{ord(m.group()):04x}"), text)


@dataclass(frozen=True)
class Section:
    """One table: a title, column names and rows of strings (rendered as Markdown and rich)."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |"
        rule = "|" + "|".join("---" for _ in self.columns) + "|"
        body = ["| " + " | ".join(md_cell(cell) for cell in row) + " |" for row in self.rows]
        return "\n".join([head, rule, *body]) + "\n"

    def rich(self) -> Table:
        """The table for the console: every cell a ``rich.text.Text`` (shown as written, never parsed
        as markup, so an evidence string such as a model named ``qwen [/]`` cannot raise MarkupError
        or style the table), its control characters shown as visible escapes."""
        table = Table(title=Text(self.title), title_justify="left")
        for column in self.columns:
            table.add_column(Text(column), overflow="fold")
        for row in self.rows:
            table.add_row(*(Text(terminal_text(cell)) for cell in row))
        return table


def _need(obj: Any, found: list[Finding], what: str) -> dict[str, Any]:
    if found:
        raise SummaryError(f"cannot summarise: {found[0]}")
    if not isinstance(obj, dict):
        raise SummaryError(f"cannot summarise: {what} is not a JSON object")
    return obj


def load_evidence(run: Run) -> Evidence:
    """The documents a summary reads, each a JSON object (:class:`SummaryError` naming the first that is not)."""
    loaded = {name: _need(run.doc(name), run.found(name), name)
              for name in (ENVIRONMENT, REGRESSION, PLAN, VALIDATION, CROSSCHECK)}
    if run.plan_findings:
        raise SummaryError(f"cannot summarise: {run.plan_findings[0]}")
    reports = [_need(report, run.found(item.file), item.file) for item, report in run.reports()]
    parity = _need(run.parity, run.found(PARITY_JSON), PARITY_JSON) if run.has_parity else None
    return Evidence(loaded[ENVIRONMENT], loaded[REGRESSION], loaded[PLAN], run.planned, tuple(reports),
                    loaded[VALIDATION], loaded[CROSSCHECK], parity)


def _get(obj: Any, *keys: str) -> Any:
    for key in keys:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _sci(value: Any) -> str:
    return f"{value:.4e}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "n/a"


def _exact(value: Any) -> str:
    return repr(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else "n/a"


def _result(report: dict[str, Any]) -> str:
    return "Passed" if report.get("passed") is True else "Failed"


def _list_degrees(values: list[int]) -> str:
    return "/".join(str(v) for v in sorted(set(values)))


def nodes_text(report: dict[str, Any]) -> str:
    """``<nnodes>: <node>, ...``: how many nodes a topology ran on and which (sorted names)."""
    ranks = _get(report, "topology", "ranks")
    names = sorted({str(r.get("node")) for r in ranks if isinstance(r, dict)}) if isinstance(ranks, list) else []
    return f"{_get(report, 'topology', 'nnodes')}: {', '.join(names)}"


def status_passed(ev: Evidence) -> bool:
    reports_ok = all(r.get("passed") is True for r in ev.reports)
    return bool(ev.validation.get("passed") is True and ev.crosscheck.get("passed") is True and reports_ok)


def hardware_text(env: dict[str, Any]) -> str:
    gpus = _get(env, "torch", "gpus") or []
    if gpus:
        names = sorted(set(gpus))
        return ", ".join(f"{gpus.count(n)} x {n}" for n in names)
    return f"CPU only: {_get(env, 'cpu', 'model')} ({_get(env, 'cpu', 'count')} cores), no GPU"


def reused_text(ev: Evidence) -> list[str]:
    """Where the environment capture and the focused suite were reused from (rl_engine.record.reuse)."""
    lines = []
    for what, record in (("The environment capture", ev.environment.get("reused")),
                         ("The focused suite's pass", ev.regression.get("reused"))):
        if isinstance(record, dict):
            lines += [f"{what} is reused from run {md_cell(str(record.get('from_run')))} "
                      f"({md_cell(str(record.get('captured_utc')))}, key `{md_cell(str(record.get('key')))[:16]}`): "
                      "same code, tests and environment; not run again for this case.", ""]
    return lines


def regression_text(reg: dict[str, Any]) -> str:
    text = f"{reg.get('passed')} passed, {reg.get('skipped')} skipped"
    if reg.get("failed") or reg.get("errors"):
        text += f", {reg.get('failed')} failed, {reg.get('errors')} errors"
    return text


def skipped_tests(run_dir: Path, reg: dict[str, Any]) -> tuple[tuple[str, str], ...] | str:
    """``(test id, reason)`` of every skipped test in the regression's JUnit XML, in file order;
    a sentence instead when the XML was not recorded or cannot be read."""
    junit = reg.get("junit")
    if not isinstance(junit, str) or "/" in junit or junit.startswith("."):
        return "the JUnit XML was not recorded (regression.json junit is null), so the skip reasons are unknown"
    try:
        root = ET.parse(run_dir / junit).getroot()
    except (OSError, ET.ParseError) as exc:
        return f"{junit} cannot be read ({type(exc).__name__}), so the skip reasons are unknown"
    found = []
    for case in root.iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None:
            test = f"{case.get('classname', '')}::{case.get('name', '')}"
            found.append((test, (skipped.get("message") or skipped.text or "(no reason given)").strip()))
    return tuple(found)


REPRODUCE_CONFIG = "reproduce.yaml"


def reproduce_config(ev: Evidence) -> str:
    """A config file (YAML) that, over the repository's config.yaml, is this run's case."""
    regression: dict[str, Any] = {"tests": list(ev.regression.get("tests") or [])}
    try:
        regression["pytest_args"] = pytest_args_of(ev.regression)
    except RunNameError as exc:
        regression["pytest_args"] = f"unknown: {exc}"
    config = record_config(ev.plan.get("case", {}), [(p.tp, p.cp) for p in ev.planned], regression)
    if ev.parity is not None:
        config["parity"] = parity_config(ev.parity)
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=1000)


def parity_config(parity: dict[str, Any]) -> dict[str, Any]:
    """The config's ``parity:`` section of a parity.json (the recorded paths, bounds, tiles and backend)."""
    return {"rollout": _get(parity, "captures", "rollout", "path"), "trainer": _get(parity, "captures", "trainer", "path"),
            "ratio_bounds": _get(parity, "importance_ratio", "bounds"), "num_vocab_tiles": parity.get("num_vocab_tiles"),
            "backend": parity.get("backend")}


def _beside_plan(ev: Evidence, name: str) -> str:
    """``name`` in the run directory as the plan's recorded commands name it (they hold the plan's
    path as the plan verb was given it), or ``RUN/name`` when no command says."""
    for planned in ev.planned:
        words = shlex.split(planned.command or "")
        if RUNNER_MODULE in words[:-1]:
            return str(Path(words[words.index(RUNNER_MODULE) + 1]).with_name(name))
    return f"RUN/{name}"


# The README's install commands (tests/test_evidence.py checks they are the README's, byte for byte).
INSTALL_COMMANDS = {
    "cpu": "pip install -q -c constraints/cpu.txt -e '.[test]'",
    "cuda": "pip install -e '.[test]'  # after installing your CUDA build of torch",
}


def install_command(device: Any) -> str:
    """The README's install command for a run on ``device`` (the CPU one when it is not recorded)."""
    return INSTALL_COMMANDS.get(device, INSTALL_COMMANDS["cpu"]) if isinstance(device, str) else INSTALL_COMMANDS["cpu"]


def reproduction(ev: Evidence) -> str:
    """The Reproduction section: the commit, how to rerun the case, and the run's exact commands."""
    git = ev.environment.get("git", {})
    commit = git.get("commit")
    if git.get("available") is True:
        where = (f"Tested commit `{md_cell(str(commit))}` (branch `{md_cell(str(git.get('branch')))}`). "
                 + ("The working tree was DIRTY: it had changes that no commit holds, so the commands below at that "
                    "commit run the committed code, not exactly the tested code." if git.get("dirty") else
                    "The working tree was clean."))
        checkout = [f"git checkout {commit}", f'test "$(git rev-parse HEAD)" = "{commit}"']
    else:
        where = (f"No git state was recorded ({md_cell(str(git.get('reason')))}): the tested code is not named by a commit; run "
                 "the commands below in a copy of the tested source tree.")
        checkout = []
    plan_cmd = ["python", "-m", "rl_engine", "plan", "--case", _beside_plan(ev, CASE), "--output", _beside_plan(ev, PLAN)]
    lines = [
        "## Reproduction",
        "",
        where,
        "",
        f"In a clone of rl_engine (see `REVIEWING.md` in the archive), the whole run with this case, from the "
        f"repository root, with `{REPRODUCE_CONFIG}` below:",
        "",
        *(f"    {line}" for line in checkout),
        f"    {install_command(ev.plan.get('case', {}).get('device'))}",
        f"    snakemake --cores 8 --configfile {REPRODUCE_CONFIG}",
        "",
        f"`{REPRODUCE_CONFIG}` (over the repository's `config.yaml`; it gives this run's case hash):",
        "",
        *(f"    {line}" for line in reproduce_config(ev).splitlines()),
        "",
        "The exact commands of this run, as recorded in the evidence (the focused regression from "
        f"`{REGRESSION}`, the plan from `{CASE}`, and each topology's `torchrun` from `{PLAN}`):",
        "",
        f"    {ev.regression.get('command')}",
        f"    {shlex.join(plan_cmd)}",
        *(f"    {p.command}" for p in ev.planned),
        "",
    ]
    return "\n".join(lines)


def _matrix_section(ev: Evidence) -> Section:
    """The validation matrix: hardware, runtime, candidate, topologies and every gate's verdict."""
    case = ev.plan.get("case", {})
    env = ev.environment
    n = len(ev.reports)
    n_passed = sum(1 for r in ev.reports if r.get("passed") is True)
    tps = [p.tp for p in ev.planned]
    cps = [p.cp for p in ev.planned]
    ranks = [p.tp * p.cp for p in ev.planned]
    fallbacks = [p.label for p, r in zip(ev.planned, ev.reports) if r.get("fallback") is not False]
    runtime = (f"Python {_get(env, 'python', 'version')}; PyTorch {_get(env, 'torch', 'version')}; "
               f"{str(case.get('dist_backend', 'n/a')).upper()}")
    if ev.crosscheck.get("passed") is True:
        determinism = (f"logp, LSE, entropy and gradient hashes identical across all {n} topologies "
                       f"(TP={_list_degrees(tps)} x CP={_list_degrees(cps)})")
    else:
        determinism = f"MISMATCH: {len(ev.crosscheck.get('failures', []))} differences (see crosscheck.json)"
    return Section("Validation matrix", ("Evidence", "Result"), (
        ("Hardware", hardware_text(env)),
        ("Runtime", runtime),
        ("Candidate", f"{str(case.get('dtype')).upper()} {case.get('backend')} with FP32 accumulation"),
        ("Arithmetic", _arithmetic_text(ev.reports)),
        ("Reference", "Independent full-vocabulary FP32 PyTorch oracle"),
        ("Topology", f"TP={_list_degrees(tps)} x CP={_list_degrees(cps)}; {_list_degrees(ranks)} ranks"),
        ("Focused regression", regression_text(ev.regression)),
        ("Required matrix", f"{n_passed} of {n} topology reports passed"),
        ("Cross-topology determinism", determinism),
        ("Fallback", "None" if not fallbacks else "in " + ", ".join(fallbacks)),
        ("Schema validation", "all artifacts valid (draft 2020-12)" if ev.validation.get("passed") is True
         else f"FAILED: {len(ev.validation.get('failures', []))} problems (see validation.json)"),
        ("Invalid JSON values", "None; strict JSON serialization" if ev.validation.get("passed") is True
         else "see validation.json"),
    ))


def _result_sections(ev: Evidence) -> tuple[Section, Section]:
    """Per topology: the FP32-oracle drift in short, and the acceptance table at full precision."""
    per_topology = []
    acceptance = []
    for item, report in zip(ev.planned, ev.reports):
        lse = _get(report, "drift", "fp32_oracle", "lse", "max_abs")
        dlogp = _get(report, "drift", "fp32_oracle", "dlogp", "max_abs")
        world = _get(report, "topology", "world_size")
        per_topology.append((str(item.tp), str(item.cp), str(world), nodes_text(report), _sci(lse), _sci(dlogp),
                             _result(report)))
        acceptance.append((str(item.tp), str(item.cp), str(world), _result(report), _exact(lse), _exact(dlogp),
                           _exact(_get(report, "drift", "fp64_oracle", "lse", "max_abs")),
                           _exact(_get(report, "drift", "fp64_oracle", "dlogp", "max_abs"))))
    topo = Section("Per-topology results (FP32 oracle)",
                   ("TP", "CP", "Ranks", "Nodes", "LSE max abs", "Active dlogp max abs", "Result"),
                   tuple(per_topology))
    accept = Section("Acceptance results (full precision)",
                     ("TP", "CP", "Ranks", "Result", "LSE max abs (FP32)", "Active dlogp max abs (FP32)",
                      "LSE max abs (FP64)", "Active dlogp max abs (FP64)"), tuple(acceptance))
    return topo, accept


def _fingerprint_section(ev: Evidence) -> Section:
    """The reference topology's fingerprints and input hashes."""
    n = len(ev.reports)
    ref = ev.reports[0] if ev.reports else {}
    fps = ref.get("bitwise_fingerprints", {}) if isinstance(ref, dict) else {}
    fp_rows = [(key, str(fps.get(key))) for key in ("candidate_logp_sha256", "candidate_lse_sha256",
                                                     "candidate_entropy_sha256", "candidate_grad_sha256")]
    fp_rows += [("dtype / shape", f"{fps.get('dtype')} {fps.get('shape')}"),
                ("grad dtype / shape", f"{fps.get('grad_dtype')} {fps.get('grad_shape')}")]
    fp_rows += [(f"inputs_sha256.{k}", str(v)) for k, v in sorted((ref.get("inputs_sha256") or {}).items())]
    return Section(f"Cross-topology fingerprints (reference {ev.crosscheck.get('reference')}; "
                           f"{'identical in all ' + str(n) + ' reports' if ev.crosscheck.get('passed') is True else 'NOT identical'})",
                           ("Field", "Value"), tuple(fp_rows))


def _hardware_section(ev: Evidence) -> Section:
    env, case = ev.environment, ev.plan.get("case", {})
    git = env.get("git", {})
    return Section("Hardware and runtime", ("Item", "Value"), (
        ("GPU", ", ".join(_get(env, "torch", "gpus") or []) or "none"),
        ("Compute capability", ", ".join(_get(env, "torch", "compute_capability") or []) or "n/a"),
        ("CPU", f"{_get(env, 'cpu', 'model')} ({_get(env, 'cpu', 'count')} cores)"),
        ("Python", str(_get(env, "python", "version"))),
        ("PyTorch", str(_get(env, "torch", "version"))),
        ("PyTorch CUDA runtime", str(_get(env, "torch", "cuda"))),
        ("CUDA available", str(_get(env, "torch", "cuda_available"))),
        ("NCCL available", str(_get(env, "torch", "nccl_available"))),
        ("gloo available", str(_get(env, "torch", "gloo_available"))),
        ("nvidia-smi / nvcc", f"{'present' if _get(env, 'tools', 'nvidia_smi') else 'absent'} / "
                              f"{'present' if _get(env, 'tools', 'nvcc') else 'absent'}"),
        ("Device / dist backend", f"{case.get('device')} / {case.get('dist_backend')}"),
        ("Threads per rank", str(case.get("threads_per_rank"))),
        ("Host", f"{env.get('hostname')} ({env.get('platform')})"),
        ("Tested commit", f"{git.get('commit')} (branch {git.get('branch')}, "
                          f"{'dirty' if git.get('dirty') else 'clean'})"),
    ))


def _artifact_sections(ev: Evidence, run: Run) -> tuple[Section, Section]:
    """The evidence files with their sizes and SHA-256, and the skipped tests with their reasons."""
    artifacts = []
    for rel in run.evidence_files()[0]:  # unreadable evidence already stopped load_evidence
        path = run.root / rel
        if path.is_file() and not path.is_symlink():
            artifacts.append((rel, str(path.stat().st_size), run.sha256(path)))
    arts = Section("Artifacts", ("File", "Bytes", "SHA-256"), tuple(artifacts))
    skips = skipped_tests(run.root, ev.regression)
    skipped = Section("Skipped tests", ("Test", "Reason"), skips if isinstance(skips, tuple) else ())
    return arts, skipped


def engine_text(meta: dict[str, Any]) -> str:
    """``vllm 0.6.3``; the version alone where it already starts with the engine's name (the
    transformers capture records ``transformers 5.25.0, torch 2.9.1``), so the name is not said twice."""
    engine, version = str(meta.get("engine")), str(meta.get("engine_version"))
    return version if version.startswith(f"{engine} ") else f"{engine} {version}"


def _capture_text(parity: dict[str, Any], side: str) -> str:
    record = _get(parity, "captures", side) or {}
    meta = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
    return (f"`{record.get('path')}` (SHA-256 `{record.get('sha256')}`; engine {engine_text(meta)}, "
            f"model {meta.get('model')}, {meta.get('dtype')}, TP {meta.get('tp')}; "
            f"{'with' if record.get('has_reported_logp') else 'without'} reported_logp)")


def _differ_text(stats: Any) -> str:
    """A difference section's verdict: bitwise equal, or the tokens that differ and by how much."""
    if not isinstance(stats, dict):
        return "no reported_logp in the capture"
    if stats.get("bitwise_equal") is True:
        return "bitwise equal on every active token"
    overflow = (f"; {stats.get('non_finite')} not finite (an overflowed logprob: the statistics are n/a)"
                if stats.get("non_finite") else "")
    return (f"{stats.get('tokens_differing')} active tokens differ; max abs {_exact(stats.get('max_abs_diff'))}, "
            f"mean abs {_exact(stats.get('mean_abs_diff'))}, mean {_exact(stats.get('mean_diff'))}{overflow}")


def _ratio_text(stats: Any, bounds: Any) -> str:
    if not isinstance(stats, dict):
        return "not computed (a side has no reported_logp)"
    return (f"mean {_exact(stats.get('mean'))}, min {_exact(stats.get('min'))}, max {_exact(stats.get('max'))}; "
            f"{stats.get('outside_bounds')} outside {bounds} (share {_exact(stats.get('share_outside_bounds'))}), "
            f"{stats.get('non_finite')} non-finite")


def parity_section(parity: dict[str, Any]) -> Section:
    """The parity stage's five sections (six with sampling parameters) in one table, every figure read from
    parity.json."""
    tokens, logits, ours = (parity.get(k) or {} for k in ("targets_and_mask", "logits", "our_logprob"))
    ratio = parity.get("importance_ratio") or {}
    control = "holds" if _get(ours, "control", "bitwise_equal") is True else "FAILED"
    logits_text = ("bitwise equal on every active token" if logits.get("bitwise_equal") is True else
                   f"{logits.get('tokens_differing')} active tokens and {logits.get('columns_differing')} columns differ; "
                   f"max abs {_exact(logits.get('max_abs_diff'))}, max rel {_exact(logits.get('max_rel_diff'))}"
                   + ("" if logits.get("same_dtype") is True else " (the two sides' logits have different dtypes)"))
    from_logits = ("every difference comes from the logits (no token with equal logits and a different logprob)"
                   if ours.get("from_logits_only") is True else
                   f"NOT from the logits alone: tokens {ours.get('tokens_equal_logits_different_logp')}")
    rows = [("Verdict", str(parity.get("verdict"))),
            ("Rollout capture", _capture_text(parity, "rollout")),
            ("Trainer capture", _capture_text(parity, "trainer")),
            ("1 Targets and mask", f"identical: {tokens.get('tokens')} tokens, {tokens.get('active_tokens')} active"),
            ("2 Logits", logits_text),
            ("3 Our logprob, trainer - rollout", f"{_differ_text(ours)}; {from_logits}; control (same logits, rows "
                                                 f"reordered, bitwise equal): {control}"),
            ("4 Rollout engine's reported - ours", _differ_text((parity.get("engine_vs_ours") or {}).get("rollout"))),
            ("4 Trainer engine's reported - ours", _differ_text((parity.get("engine_vs_ours") or {}).get("trainer"))),
            ("5 Importance ratio (ours)", _ratio_text(ratio.get("ours"), ratio.get("bounds"))),
            ("5 Importance ratio (engines' reported)", _ratio_text(ratio.get("engines"), ratio.get("bounds")))]
    processed = parity.get("processed")
    if isinstance(processed, dict):  # only when the rollout capture carries sampling parameters
        rows.append(("6 Processed logprob (rollout's sampling parameters)", _processed_text(processed)))
    return Section("Parity: rollout versus trainer", ("Section", "Result"), tuple(rows))


def _processed_text(section: dict[str, Any]) -> str:
    """Section 6 of parity.json in one cell: the engine's processed logprob against ours, the share of
    the raw-to-processed gap our processing explains, and the targets outside either kept set."""
    outside = (f"{_get(section, 'target_not_kept', 'count')} target(s) outside our kept set"
               + (f", {_get(section, 'engine_target_not_kept', 'count')} reported -inf by the engine"
                  if section.get("engine_reported") is True else ""))
    if section.get("engine_reported") is not True:
        return (f"no reported_processed_logp in the capture; our processed - our raw: mean abs "
                f"{_exact(_get(section, 'explained', 'mean_abs'))}; {outside}")
    residual = section.get("residual") or {}
    return (f"engine - ours: {residual.get('tokens_differing')} of {section.get('counted_tokens')} counted tokens differ, "
            f"max abs {_exact(residual.get('max_abs'))}; fraction of the gap explained "
            f"{_exact(section.get('fraction_explained'))}; {outside}")


def sections(ev: Evidence, run: Run) -> dict[str, Section]:
    """Every table of SUMMARY.md, by key."""
    topo, accept = _result_sections(ev)
    arts, skipped = _artifact_sections(ev, run)
    out = {"matrix": _matrix_section(ev), "topology": topo, "acceptance": accept,
           "fingerprints": _fingerprint_section(ev), "hardware": _hardware_section(ev), "artifacts": arts,
           "skipped": skipped}
    if ev.parity is not None:
        out["parity"] = parity_section(ev.parity)
    return out


def parity_text(ev: Evidence, secs: dict[str, Section]) -> list[str]:
    """SUMMARY.md's parity part (empty without a parity stage)."""
    if ev.parity is None:
        return []
    return ["## Parity: rollout versus trainer", "",
            f"`python -m rl_engine parity` on two captures of the same tokens ({PARITY_JSON}, backend "
            f"{md_cell(str(ev.parity.get('backend')))}, {md_cell(str(ev.parity.get('num_vocab_tiles')))} vocabulary "
            f"tiles, {md_cell(str(ev.parity.get('arithmetic_spec')))}); the histogram of the per-token differences is `{PARITY_PNG}`. "
            "A difference is a finding of this report, not a failure of the run.", "",
            secs["parity"].markdown()]


def inputs_text(case: dict[str, Any]) -> str:
    """Where the candidate's logits came from: the input recipe, or the capture's hash and metadata."""
    capture = case.get("capture")
    if not isinstance(capture, dict):
        return ("Inputs: the input recipe (docs/arithmetic.md section 10), regenerable from the case's "
                "integers.")
    meta = capture.get("metadata") if isinstance(capture.get("metadata"), dict) else {}
    described = ", ".join(f"{md_cell(str(key))} `{md_cell(str(meta[key]))}`" for key in sorted(meta))
    held = ("the archive holds it (`inputs.archive: true`)" if capture.get("archive") is True
            else "the archive does not hold it (`verify --recompute` needs `--capture PATH`)")
    path, sha, size, tokens, vocab, dtype = (md_cell(str(capture.get(k))) for k in
                                             ("path", "sha256", "size", "tokens", "vocab", "dtype"))
    return (f"Inputs: the capture `{path}`, SHA-256 `{sha}`, {size} bytes, {tokens} tokens x {vocab} "
            f"{dtype} columns; its metadata: {described}; {held}. The capture's mask "
            "is the active tokens (prompt tokens, seed and logit scale do not shape its inputs). "
            + sampling_text(case))


def sampling_text(case: dict[str, Any]) -> str:
    """Which sampling a campaign on a capture computed: each row's captured parameters, or the case's own."""
    if captures_sampling(case):
        return ("Sampling: each row's own temperature, top_k, top_p and min_p, the capture's sampling tensors "
                "(`sampling: capture`; docs/arithmetic.md sections 6 and 13): the processed logprobs the rollout "
                "sampled from, in every topology, the replay and the oracle.")
    return ("Sampling: the case's own (temperature, top_k, top_p and min_p as the case line says, every row "
            "alike), not any per-row sampling the capture carries (`sampling: capture` computes that).")


def _case_line(case: dict[str, Any]) -> str:
    return (f"{str(case.get('dtype')).upper()}, real/padded vocabulary "
            f"{case.get('real_vocab')}/{case.get('padded_vocab')}, {case.get('num_vocab_tiles')} vocabulary tiles, "
            f"batch {case.get('batch')}, sequence {case.get('seq')}, prompt tokens {case.get('prompt_tokens')}, "
            f"seed {case.get('seed')}, logit scale {case.get('logit_scale')}, CP layout {case.get('cp_layout')}, "
            + (f"temperature {md_cell(str(case.get('temperature')))} (section 6 step 0), " if "temperature" in case else "")
            + "".join(f"{name} {md_cell(str(case.get(name)))}, " for name in ("top_k", "top_p", "min_p") if name in case)
            + ("processed logprobs (section 13), " if any(n in case for n in ("top_k", "top_p", "min_p")) else "")
            + f"explicit {case.get('backend')}, {case.get('device')}/{case.get('dist_backend')}.")


def render(ev: Evidence, run: Run) -> tuple[str, dict[str, Section]]:
    secs = sections(ev, run)
    case = ev.plan.get("case", {})
    git = ev.environment.get("git", {})
    passed = status_passed(ev)
    n = len(ev.reports)
    status = ("PASSED: every topology report passed acceptance, all fingerprints are identical across "
              f"the {n} topologies, and every artifact is valid against its schema."
              if passed else
              "FAILED: see validation.json and crosscheck.json for each failing file and field.")
    case_line = _case_line(case)
    out = [
        f"# rl_engine validation summary: {ev.plan.get('case_id')}",
        "",
        "## Status",
        "",
        status,
        "",
        f"Tested commit: `{md_cell(str(git.get('commit')))}` (branch `{md_cell(str(git.get('branch')))}`, "
        f"{'dirty working tree' if git.get('dirty') else 'clean working tree'})",
        "",
        f"Case: {case_line}",
        "",
        inputs_text(case),
        "",
        "## Validation matrix",
        "",
        secs["matrix"].markdown(),
        "## Per-topology results",
        "",
        secs["topology"].markdown(),
        f"Tolerance against the FP32 oracle: atol={case.get('atol')!r}, rtol={case.get('rtol')!r} "
        "(LSE over all rows, dlogp over active rows).",
        "",
        "## Acceptance results",
        "",
        secs["acceptance"].markdown(),
        "## Focused regression",
        "",
        f"{regression_text(ev.regression)} (pytest exit {ev.regression.get('exit_code')}; `{ev.regression.get('log')}`, "
        f"`{ev.regression.get('junit')}`).",
        "",
        *reused_text(ev),
        skipped_text(run.root, ev.regression, secs["skipped"]),
        "## Fingerprints",
        "",
        secs["fingerprints"].title,
        "",
        secs["fingerprints"].markdown(),
        *parity_text(ev, secs),
        "## Hardware and runtime",
        "",
        secs["hardware"].markdown(),
        reproduction(ev),
        "## Boundary",
        "",
        f"This run covers deterministic TP/CP-aware selected-token logprob with {case.get('dtype')} candidate "
        "logits and FP32 accumulation: explicit backend materialisation with fail-closed dispatch, "
        "bitwise equality within each TP group and across every planned TP x CP topology (logprob, LSE, "
        "entropy and the gradient of the active logprob sum), and tolerance compliance against an "
        "independent full-vocabulary FP32 oracle (FP64 statistics recorded for diagnosis). Candidate "
        "versus oracle drift is expected from the rounded logits and the fixed-order reduction: the "
        "requirement is tolerance, not oracle bitwise equality. The candidate's numbers follow "
        f"{_arithmetic_text(ev.reports).split(':')[0]} (`{SPEC_DOC}` in the archive): basic IEEE-754 operations in a "
        "fixed order, with its own exp and log, so `verify --recompute` replays them byte for byte on any "
        "machine with gradual underflow and no contracted multiply-adds. It does not claim end-to-end trainer or "
        "inference-engine replay, pipeline or data-parallel model execution, or a fused kernel.",
        "",
        "The gradient is the one fingerprint without a file: `candidate_grad_sha256` is compared across "
        "topologies, and `verify --recompute` recomputes it by replaying the candidate at TP=1 (logp, LSE "
        "and entropy are also backed by raw `*.f32` files whose SHA-256 equals their fingerprint).",
        "",
        "## Artifacts",
        "",
        "SHA-256 of each evidence file of the run directory (per-stage logs under `logs/` are covered by "
        "the archive's `SHA256SUMS`).",
        "",
        secs["artifacts"].markdown(),
    ]
    return "\n".join(out), secs


def _arithmetic_text(reports: list[dict[str, Any]]) -> str:
    """The reports' arithmetic specification (docs/arithmetic.md), or what disagrees."""
    specs = sorted({str(r.get("arithmetic_spec")) for r in reports})
    if len(specs) == 1:
        return (f"{specs[0]}: IEEE-754 basic operations only (`{SPEC_DOC}` in the archive); the same bytes on "
                "any conforming CPU or GPU")
    return "MIXED: " + ", ".join(specs)


def skipped_text(run_dir: Path, reg: dict[str, Any], section: Section) -> str:
    skips = skipped_tests(run_dir, reg)
    if isinstance(skips, str):
        return f"Skipped tests: {skips}.\n"
    if not skips:
        return "No test was skipped.\n"
    return f"Every skipped test and its reason, from `{reg.get('junit')}`:\n\n" + section.markdown()


def summary_text(run: Run) -> str:
    """SUMMARY.md's text for the evidence of ``run`` (:class:`SummaryError` when unreadable).

    The summary verb writes exactly this; ``verify`` compares it with an archive's SUMMARY.md.
    """
    return render(load_evidence(run), run)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_engine summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory to summarise")
    parser.add_argument("--output", required=True, type=Path, help="where to write SUMMARY.md")
    args = parser.parse_args(argv)
    run = Run.load(args.run_dir)
    try:
        ev = load_evidence(run)
    except SummaryError as exc:
        print(f"summary: {exc}", file=sys.stderr)
        return 1
    text, secs = render(ev, run)
    jsonio.atomic_write_text(args.output, text)
    console = Console(width=160)
    # evidence strings (the case id, the output path) as text: Text objects are never parsed as markup
    console.print(Text.assemble(("PASSED" if status_passed(ev) else "FAILED", "bold"),
                                f": {terminal_text(str(ev.plan.get('case_id')))}"))
    for key in ("matrix", "topology", "fingerprints", "parity", "hardware"):
        if key in secs:
            console.print(secs[key].rich())
    console.print(Text(f"wrote {terminal_text(str(args.output))}"))
    return 0
