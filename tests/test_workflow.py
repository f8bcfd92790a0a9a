"""The evidence workflow end to end: real snakemake, real torchrun, real archives.

One run is shared by the module: ``snakemake --cores 8`` with the repository's own campaign (the
guide's: vocabulary 151936, TP=1/2/4 x CP=1/2, 4x2 included) and a short focused regression, in
a temporary copy of the repository (with PYTHONPATH pointing at the copy, so the copy's code is
what runs). The tests then rerun, tamper with and change that run, in file order; the archive is
checked with the reviewer's verifier. Faults and corrupted evidence through the workflow are in
tests/test_gates_workflow.py (a topology whose outputs are missing reruns alone there:
``test_rerun_redoes_the_killed_topology_alone_while_a_second_run_is_locked_out``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from rl_engine import jsonio

from _workflow_util import (
    REPO,
    SHORT_REGRESSION,
    archive_of,
    copy_repo,
    html_report,
    jobs_run,
    run_name_of,
    snakemake,
    verify,
    verify_here,
    write_config,
)

pytestmark = pytest.mark.slow  # end to end: snakemake runs (in the full suite, not the quick loop)

TOPOLOGIES = yaml.safe_load((REPO / "config.yaml").read_text())["topologies"]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str], float]:
    """The guide's campaign (config.yaml) with a short regression: every test of the module uses it.

    The checkout's path holds a space, as a user's ``~/My Projects/`` does: every rule's command line
    quotes its paths (tests/test_rules.py reads them; this run proves it, from the environment rule's
    ``--repo`` to the archive)."""
    repo = copy_repo(tmp_path_factory.mktemp("wf-default"), "my checkout")
    write_config(repo, {"regression": SHORT_REGRESSION})
    start = time.monotonic()
    done = snakemake(repo, default_console=True)  # the console a person sees (stderr merged, in order)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stdout[-12000:]
    return repo, done, elapsed


def test_default_campaign_builds_an_archive_that_verifies(default_run) -> None:
    repo, done, elapsed = default_run
    print(f"default campaign wall time: {elapsed:.1f} s")
    counts = jobs_run(done.stdout + done.stderr)
    assert counts.get("topology") == len(TOPOLOGIES) == 6, counts
    # Each topology job is named by its topology in the console, start and end. The job's ``echo`` is
    # one write ending in a newline, but Snakemake writes a multi-line message and its final newline
    # separately, so a job's line may follow another writer's unfinished line on the same pipe (as a
    # person's terminal shows it): the patterns are anchored at the line's end, not its start.
    for topo in TOPOLOGIES:
        stem = f"tp{topo[0]}-cp{topo[2]}"
        assert len(re.findall(rf"topology {stem}: started$", done.stdout, re.M)) == 1, (stem, done.stdout[-6000:])
        assert len(re.findall(rf"topology {stem}: report written$", done.stdout, re.M)) == 1, stem
    assert len(re.findall(r"Finished jobid: \d+ \(Rule: topology\)", done.stdout)) == len(TOPOLOGIES)
    name = run_name_of(repo)
    archive = archive_of(repo)
    assert archive.name == f"{name}.tar.gz"
    assert verify_here(archive, "--recompute") == 0  # its report: the captured stdout
    run = repo / "results" / name
    crosscheck = jsonio.load(run / "crosscheck.json")
    assert crosscheck["passed"] is True
    reports = [jsonio.load(run / f"tp{t[0]}-cp{t[2]}.json") for t in TOPOLOGIES]
    assert len({r["bitwise_fingerprints"]["candidate_logp_sha256"] for r in reports}) == 1
    assert all(r["case"]["real_vocab"] == 151936 for r in reports)
    summary = (run / "SUMMARY.md").read_text()
    for topo in TOPOLOGIES:
        tp, cp = topo.split("x")
        assert re.search(rf"^\|\s*{tp}\s*\|\s*{cp}\s*\|", summary, re.M), (topo, summary)
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        packed = {m.name[len(name) + 1:] for m in tar.getmembers() if m.isfile()}
    assert f"{name}/SHA256SUMS" in names
    assert any(n.endswith("/schemas/report.schema.json") for n in names)
    # the archive packs the rule's declared inputs, and they are every file the workflow
    # wrote in the run (evidence, SUMMARY.md, every rule's log): nothing left out, nothing else
    run_files = {p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()}
    added = {"SHA256SUMS", "REVIEWING.md", "arithmetic.md", "provenance.intoto.json", "ro-crate-metadata.json"}
    assert {p for p in packed if not p.startswith(("schemas/", "workflow/"))} - added == run_files
    assert {p for p in packed if p.startswith("workflow/")} == {  # the workflow that ran: its Snakefile and rules
        p.relative_to(repo).as_posix() for p in [repo / "workflow" / "Snakefile", *(repo / "workflow" / "rules").glob("*.smk")]}
    with tarfile.open(archive) as tar:  # the specification the reports claim, packed as it is in the repo
        spec = tar.extractfile(f"{name}/arithmetic.md").read()  # type: ignore[union-attr]
    assert spec == (repo / "docs" / "arithmetic.md").read_bytes()
    assert {p[len("schemas/"):] for p in packed if p.startswith("schemas/")} == {
        p.name for p in (repo / "schemas").glob("*.schema.json")}
    assert jsonio.load(repo / "results" / f"{name}.verify.json")["passed"] is True


def test_the_console_ends_with_the_verdict_and_the_archive(default_run) -> None:
    """The run ended with Snakemake's step counter; now its last table gives the verdict,
    the archive and its SHA-256, SUMMARY.md and the reviewer's verify command."""
    repo, done, _ = default_run
    name = run_name_of(repo)
    digest = (repo / "results" / f"{name}.tar.gz.sha256").read_text().split()[0]
    tail = done.stdout[done.stdout.rindex("rl_engine evidence workflow: result"):]
    for text in ("Verdict", "VERIFIED", f"results/{name}.tar.gz", digest, f"results/{name}/SUMMARY.md",
                 f"python -m rl_engine verify results/{name}.tar.gz"):
        assert text in tail, (text, tail)
    assert "Finished job" not in tail and "steps (100%) done" not in tail  # nothing of the run after it


CONSOLE_LIMIT_BYTES = 20_000  # a default run printed 58 KB, 292 lines


def test_the_default_console_fits_a_few_screens_and_the_closing_table_is_last(default_run) -> None:
    """One default run's whole console (Snakemake's and the jobs' output, in order) is at
    most 20 KB, no job prints its input list, the focused suite shows progress, and nothing follows
    the closing table (its bottom border is the last line)."""
    repo, done, _ = default_run
    console = done.stdout
    size = len(console.encode())
    print(f"default console: {size} bytes, {console.count(chr(10))} lines")
    assert size <= CONSOLE_LIMIT_BYTES, console
    assert "rl_engine/logprob/" not in console  # the sources are one input, not ~70 names per job
    assert re.search(r"^regression: \d+% of the focused suite, \d+ s$", console, re.M), console
    assert re.search(r"^regression: \d+ passed, 0 failed", console, re.M), console
    table = console[console.rindex("rl_engine evidence workflow: result"):]
    lines = table.rstrip("\n").splitlines()
    assert lines[-1].startswith("└") and lines[-1].endswith("┘"), lines[-3:]
    assert "VERIFIED" in table and "Finished job" not in table and "steps (100%) done" not in table


def test_an_edited_engine_source_reruns_what_depends_on_it(default_run) -> None:
    """The sources are one input (results/logs/<name>-sources.sha256, from the sources
    rule, whose digest param changes with any source), and an edit still reruns the regression, the
    plan, every topology and what follows; the environment and the case do not depend on it.
    Undoing the edit leaves nothing to do (the dry run changed nothing)."""
    repo, _, _ = default_run
    source = repo / "rl_engine" / "campaign" / "plan.py"
    original = source.read_bytes()
    try:
        source.write_bytes(original + b"\n# an edit\n")
        edited = snakemake(repo, "-n")
    finally:
        source.write_bytes(original)
    counts = jobs_run(edited.stdout + edited.stderr)
    assert counts.get("sources") == 1 and counts.get("regression") == 1 and counts.get("plan") == 1, counts
    assert counts.get("topology") == len(TOPOLOGIES) and counts.get("archive") == 1, counts
    assert "environment" not in counts and "case" not in counts, counts
    back = snakemake(repo, "-n")
    assert jobs_run(back.stdout + back.stderr) == {}, back.stdout[-3000:]
    assert "rl_engine evidence workflow: result" not in back.stdout + back.stderr  # a dry run: no table


def test_the_html_report_holds_what_a_reviewer_reads(default_run, tmp_path: Path) -> None:
    """``snakemake --report report.html`` made a 3 MB report with no result in it. Read from the HTML:
    SUMMARY.md and the two verdict files are embedded byte for byte, the verification's labels are the
    closing table's rows (VERIFIED, the archive, its SHA-256, the verify command), the cross-topology
    labels say it passed over every topology, and the workflow's description names the topologies."""
    repo, _, _ = default_run
    name = run_name_of(repo)
    results, description = html_report(repo, tmp_path / "report.html")
    summary, verdict = f"results/{name}/SUMMARY.md", f"results/{name}.verify.json"
    crosscheck = f"results/{name}/crosscheck.json"
    assert set(results) == {summary, verdict, crosscheck}, sorted(results)
    for path in results:
        assert results[path]["data"] == (repo / path).read_bytes(), path
    labels = results[verdict]["labels"]
    digest = (repo / "results" / f"{name}.tar.gz.sha256").read_text().split()[0]
    assert labels["Verdict"] == "VERIFIED" and labels["SHA-256"] == digest, labels
    assert labels["Archive"] == f"results/{name}.tar.gz"
    assert labels["Verify (reviewer)"] == f"python -m rl_engine verify results/{name}.tar.gz"
    checked = results[crosscheck]["labels"]
    assert checked["Cross-topology check"] == "PASSED: bitwise equal" and checked["Topologies"] == str(len(TOPOLOGIES))
    assert ", ".join(TOPOLOGIES) in description


def test_verify_rejects_a_tampered_archive(default_run, tmp_path: Path) -> None:
    repo, _, _ = default_run
    original = archive_of(repo)
    bad = tmp_path / original.name
    shutil.copy(original, bad)
    shutil.copy(original.with_name(original.name + ".sha256"), tmp_path)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    done = verify(repo, bad)
    assert done.returncode != 0
    assert "sha256" in (done.stdout + done.stderr).lower()


def test_a_changed_campaign_gets_its_own_run_and_going_back_has_nothing_to_do(default_run) -> None:
    """--config topologies=... ran in the default campaign's directory and failed validation on
    reports "left from an earlier plan"; going back failed the same way; seed=7 overwrote the archive.
    Going back is the default campaign's second run: it has nothing to do and still ends with the
    run's verdict table, read from disk."""
    repo, _, _ = default_run
    first = run_name_of(repo)
    first_archive = repo / "results" / f"{first}.tar.gz"
    kept = {p: p.read_bytes() for p in (first_archive, first_archive.with_name(first_archive.name + ".sha256"))}
    other = ["1x1", "2x1"]
    done = snakemake(repo, "--config", f"topologies={json.dumps(other)}")
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-6000:]
    assert "left from an earlier plan" not in text
    second = run_name_of(repo, topologies=other)
    assert second != first and second.startswith("rl-engine-logprob-nogit-case-")
    assert sorted(p.name for p in (repo / "results" / second).glob("tp*-cp*.json")) == ["tp1-cp1.json", "tp2-cp1.json"]
    assert jobs_run(text).get("verify_archive") == 1  # the new archive verified in the run (rc 0)
    # a new case of the same code: the environment capture and the focused suite are copied, not run
    for stage in ("environment.json", "regression.json"):
        reused = jsonio.load(repo / "results" / second / stage)["reused"]
        assert reused["from_run"] == first, (stage, reused)
    assert re.search(r"^regression: reused the focused suite's pass of run " + re.escape(first), text, re.M), text[-6000:]
    assert "regression: running the focused suite" not in text
    assert f"reused from run {first}" in (repo / "results" / second / "SUMMARY.md").read_text()
    assert jsonio.load(repo / "results" / f"{second}.verify.json")["passed"] is True
    assert {p: p.read_bytes() for p in kept} == kept  # the first campaign's archive is untouched
    back = snakemake(repo)
    assert back.returncode == 0, (back.stdout + back.stderr)[-4000:]
    assert "Nothing to be done" in back.stdout + back.stderr
    assert jobs_run(back.stdout + back.stderr) == {}
    table = back.stdout[back.stdout.index("rl_engine evidence workflow: result"):]  # the first run's verdict
    for part in ("VERIFIED", f"results/{first}.tar.gz", f"python -m rl_engine verify results/{first}.tar.gz"):
        assert part in table, (part, table)
    assert table.rstrip("\n").splitlines()[-1].startswith("└")
    seed = snakemake(repo, "-n", "--config", "seed=7")  # a new seed plans a new run and a new archive
    planned = set(re.findall(r"results/([^/\s]+?)(?:\.tar\.gz|/)", seed.stdout + seed.stderr)) - {"logs"}
    assert planned == {run_name_of(repo, seed=7)} and run_name_of(repo, seed=7) not in (first, second), planned
    assert {p: p.read_bytes() for p in kept} == kept  # still the archive the first test verified
