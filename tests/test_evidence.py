"""Evidence gates on real evidence: environment, regression, validation, crosscheck, summary, archive.

One tiny-vocabulary run (TP=1 x CP=1 and TP=2 x CP=2, real torchrun/gloo ranks) is built once
per module; each corrupted case is applied to a copy and must be caught by the
right gate, naming the file (or topology) and the field. A genuinely failing report (a topology
really run with ``RL_ENGINE_FAULT=perturb``) through both gates' verbs and ``summary``: the
workflow's run of
tests/test_gates_workflow.py::test_really_failing_topology_keeps_its_report_and_blocks_the_archive.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from rl_engine import cli, jsonio, schemas
from rl_engine.evidence import archive, crosscheck, summary, validation
from rl_engine.record import environment, gitstate, regression
from rl_engine.rundir import Finding, Run, load_json

from _evidence_run import (
    PYTEST_ARGS,
    TOPOLOGIES,
    declared_files,
    pack,
    schema_files,
    spec_file,
    workflow_files,
)

BAD = "tp2-cp2"  # the topology the corruptions target (the reference is tp1-cp1)


@pytest.fixture(scope="module")
def good_run(tiny_run: Path) -> Path:
    return tiny_run  # conftest: the session's one tiny run (tests that change evidence copy it: `run`)


@pytest.fixture()
def run(good_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(good_run, copy)
    return copy


def edit_report(run: Path, label: str, change: Callable[[dict[str, Any]], None]) -> None:
    path = run / f"{label}.json"
    report = jsonio.load(path)
    change(report)
    jsonio.write_json(path, report)


def gate(verb: str, run: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, dict[str, Any]]:
    out = run / f"{verb}-out.json"
    code = cli.main([verb, "--run-dir", str(run), "--output", str(out)])
    err = capsys.readouterr().err
    return code, err, jsonio.load(out)


# ---------------------------------------------------------------- environment and regression


def test_environment_records_commands_and_absent_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    git = shutil.which("git")
    assert git is not None
    only_git = tmp_path / "bin"
    only_git.mkdir()
    (only_git / "git").symlink_to(git)
    monkeypatch.setenv("PATH", str(only_git))  # nvidia-smi and nvcc cannot be found
    repo = Path(__file__).resolve().parent.parent
    assert environment.main(["--output-dir", str(tmp_path / "out"), "--repo", str(repo)]) == 0
    env = jsonio.load(tmp_path / "out" / "environment.json")
    assert schemas.errors(env, "environment") == []
    assert env["git"]["available"] is True
    # a commit of this repository (others may commit meanwhile, so not compared with HEAD now)
    subprocess.run([git, "cat-file", "-e", env["git"]["commit"] + "^{commit}"], cwd=repo, check=True)
    assert env["tools"] == {"nvidia_smi": False, "nvcc": False}
    assert env["nvidia"] == {"driver_version": None, "gpus": [], "nvcc_path": None, "nvcc_version": None}
    assert env["torch"]["gloo_available"] is True
    assert env["packages"]["jsonschema"] and env["packages"]["rich"]
    text = (tmp_path / "out" / "environment.txt").read_text()
    for header in ("$ git rev-parse HEAD", "$ git log -1 --oneline", "$ git branch --show-current",
                   "$ python --version", "$ python -c '<torch one-liner>'", "$ nvidia-smi", "$ nvcc --version"):
        assert header in text
    assert "[absent: nvidia-smi not found on PATH]" in text and "[absent: nvcc not found on PATH]" in text
    assert f"$ git rev-parse HEAD\n{env['git']['commit']}\n[exit code: 0]" in text
    # the one-liner ran (tests/test_reuse.py replaces it where its claim is which capture is reused)
    assert (f"$ python -c '<torch one-liner>'\ntorch: {env['torch']['version']}\n"
            f"torch_cuda: {env['torch']['cuda']}\n") in text, text


@pytest.mark.parametrize(("path", "source"), [
    ("new.py", True), ("sub/mod.pyx", True), ("kernel.c", True), ("kernel.h", True), ("k.cu", True),
    ("Snakefile", True), ("workflow/rules/extra.smk", True), ("pyproject.toml", True), ("setup.py", True),
    ("rl_engine/data.bin", True), ("workflow/profiles/x/config.yaml", True), ("schemas/new.schema.json", True),
    ("site.pth", True), ("tests/fixtures/new.json", True),
    ("capture.yaml", False), ("trainer.safetensors", False), ("parity/parity.png", False), (".py", False),
    ("notes/README.md", False), ("results/run/tp1-cp1.json", False), ("my_rl_engine/x.txt", False),
])
def test_is_source_names_what_could_change_what_runs(path: str, source: bool) -> None:
    """The dirty rule: an untracked file makes a checkout dirty only where it could change what runs."""
    assert gitstate.is_source(path) is source


def test_environment_outside_git_is_recorded_not_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the claim is git's record: the torch one-liner (a Python importing torch, about 2 s of CPU) prints a line
    # instead (test_environment_records_commands_and_absent_tools runs the real one)
    monkeypatch.setattr(environment, "TORCH_ONE_LINER", "print('torch: the one-liner replaced by this test')")
    assert environment.main(["--output-dir", str(tmp_path / "out"), "--repo", str(tmp_path)]) == 0
    env = jsonio.load(tmp_path / "out" / "environment.json")
    assert env["git"]["available"] is False and env["git"]["commit"] is None
    assert schemas.errors(env, "environment") == []


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false",
                    *args], cwd=repo, check=True, capture_output=True)


def test_git_state_dirty_counts_untracked_but_not_ignored(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    with pytest.raises(gitstate.GitStateError, match="not a git repository"):
        gitstate.read_git_state(repo)
    _git(repo, "init", "-q", "-b", "trunk")
    (repo / ".gitignore").write_text("ignored.log\n")
    (repo / "a.txt").write_text("a\n")
    (repo / "b.txt").write_text("b\n")
    _git(repo, "add", ".gitignore", "a.txt", "b.txt")
    _git(repo, "commit", "-q", "-m", "first")
    clean = gitstate.read_git_state(repo)
    assert clean.branch == "trunk" and len(clean.commit) == 40 and clean.commit.startswith(clean.short_commit)
    assert not clean.dirty and clean.changed_files == ()
    (repo / "ignored.log").write_text("noise\n")  # ignored: still clean
    assert not gitstate.read_git_state(repo).dirty
    # untracked data (a worked example's YAML, captures, a figure, a name with a newline): listed, clean
    data = ["capture.yaml", "cap\nture.safetensors", "parity/parity.png", "trainer.safetensors"]
    for name in data:
        (repo / name).parent.mkdir(exist_ok=True)
        (repo / name).write_bytes(b"data\n")
    state = gitstate.read_git_state(repo)
    assert not state.dirty and sorted(state.untracked_data_files) == sorted(data)
    record = environment._git(repo, 20.0)
    assert record["dirty"] is False and record["untracked_files"] == 4
    assert sorted(record["untracked_data_files"]) == sorted(
        ["capture.yaml", "cap\\nture.safetensors", "parity/parity.png", "trainer.safetensors"])
    assert environment.main(["--output-dir", str(tmp_path / "env"), "--repo", str(repo)]) == 0  # schema-valid
    assert jsonio.load(tmp_path / "env" / "environment.json")["git"]["untracked_data_files"] == record["untracked_data_files"]
    (repo / "sub").mkdir()
    (repo / "sub" / "new.py").write_text("x = 1\n")  # untracked source, not ignored: dirty, listed by file
    state = gitstate.read_git_state(repo)
    assert state.dirty and "sub/new.py" in state.changed_files and "sub/new.py" in state.untracked_files
    assert "sub/new.py" not in state.untracked_data_files
    record = environment._git(repo, 20.0)  # environment.json's record uses the same definition
    assert record["dirty"] is True and record["untracked_files"] == 5 and record["commit"] == state.commit
    for name in data:
        (repo / name).unlink()
    (repo / "sub" / "new.py").unlink()
    (repo / "a.txt").write_text("changed\n")  # a tracked change
    _git(repo, "mv", "b.txt", "c.txt")  # a staged rename: two -z fields, one change
    state = gitstate.read_git_state(repo)
    assert set(state.changed_files) == {"a.txt", "c.txt"} and state.untracked_files == ()
    assert environment._git(repo, 20.0)["untracked_files"] == 0
    assert gitstate.parse_porcelain("?? a b\0R  new\0old\0 M c\0") == (
        gitstate.Change("??", "a b"), gitstate.Change("R ", "new"), gitstate.Change(" M", "c"))
    with pytest.raises(gitstate.GitStateError, match="full hexadecimal"):
        gitstate.GitState("abc", "abc", None)
    with pytest.raises(gitstate.GitStateError, match="timeout_s"):
        gitstate.read_git_state(repo, 0)


def test_write_validated_refuses_before_writing(tmp_path: Path) -> None:
    out = tmp_path / "crosscheck.json"
    bad = {"schema_version": "1", "passed": True}
    with pytest.raises(schemas.ArtifactSchemaError, match=r"crosscheck\.schema\.json \(4 error\(s\): \$: 'reference' is a required"):
        schemas.write_validated(out, bad, "crosscheck")
    assert list(tmp_path.iterdir()) == []
    good = {"schema_version": "1", "passed": True, "reference": "tp1-cp1", "fields": ["case_id"], "topologies": [],
            "failures": []}
    schemas.write_validated(out, good, "crosscheck")
    assert out.read_bytes() == jsonio.dumps(good).encode()
    good["fields"] = [float("nan")]  # not even a string: the schema refuses before strict JSON would
    with pytest.raises(schemas.ArtifactSchemaError, match=r"\$\.fields\[0\]"):
        schemas.write_validated(out, good, "crosscheck")


@pytest.mark.parametrize("verb", ["env", "regression", "validate", "crosscheck"])
def test_every_evidence_writer_validates_before_writing(verb: str, run: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A writer bug (here: a schema_version the schema does not allow) writes nothing and says why."""
    out = tmp_path / "out"
    if verb == "env":
        env = {**jsonio.load(run / "environment.json"), "schema_version": "2"}
        monkeypatch.setattr(environment, "probe", lambda repo, timeout_s: env)
        monkeypatch.setattr(environment, "raw_text", lambda repo, timeout_s: "raw")
        code, written = environment.main(["--output-dir", str(out)]), out / "environment.json"
    elif verb == "regression":
        monkeypatch.setattr(regression, "SCHEMA_VERSION", "2")
        tiny = tmp_path / "test_one.py"
        tiny.write_text("def test_ok():\n    pass\n")
        code, written = regression.main(["--output-dir", str(out), "--tests", str(tiny), *PYTEST_ARGS]), out / "regression.json"
    else:
        module = validation if verb == "validate" else crosscheck
        monkeypatch.setattr(module, "SCHEMA_VERSION", "2")
        written = out / f"{verb}.json"
        code = cli.main([verb, "--run-dir", str(run), "--output", str(written)])
    err = capsys.readouterr().err
    assert code == 1 and not written.exists(), err
    assert "does not match" in err and "schema_version" in err and "it was not written" in err
    if verb == "env":
        assert not (out / "environment.txt").exists()


def test_regression_counts_come_from_junit(good_run: Path) -> None:
    reg = jsonio.load(good_run / "regression.json")
    assert schemas.errors(reg, "regression") == []
    assert (reg["passed"], reg["failed"], reg["skipped"], reg["errors"], reg["total"]) == (1, 0, 1, 0, 2)
    assert reg["exit_code"] == 0 and reg["command"].startswith("python -m pytest -q -rs ")
    junit = (good_run / "pytest-junit.xml").read_text()
    assert 'tests="2"' in junit and 'skipped="1"' in junit
    assert "1 passed, 1 skipped" in (good_run / "pytest-focused.log").read_text()


def test_regression_failure_and_empty_run_exit_1(tmp_path: Path) -> None:
    failing = tmp_path / "test_fails.py"
    failing.write_text("def test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2\n")
    empty = tmp_path / "test_empty.py"
    empty.write_text("X = 1\n")
    assert regression.main(["--output-dir", str(tmp_path / "a"), "--tests", str(failing), *PYTEST_ARGS]) == 1
    reg = jsonio.load(tmp_path / "a" / "regression.json")
    assert (reg["passed"], reg["failed"], reg["total"]) == (1, 1, 2) and reg["exit_code"] == 1
    assert [str(f) for f in validation.regression_findings(reg)][0].startswith("regression.json: failed: is 1")
    assert regression.main(["--output-dir", str(tmp_path / "b"), "--tests", str(empty), *PYTEST_ARGS]) == 1
    reg = jsonio.load(tmp_path / "b" / "regression.json")
    assert reg["total"] == 0
    assert any(f.field == "total" and "no test ran" in f.message for f in validation.regression_findings(reg))
    assert regression.main(["--output-dir", str(tmp_path / "c"), "--tests", str(tmp_path / "nope.py")]) == 2


def test_regression_in_a_checkout_without_the_built_kernel_says_so_and_runs_nothing(tmp_path: Path) -> None:
    """A checkout whose fused kernel is not built (its package installed from another checkout): the
    verb names the checkout and the fix and runs nothing, rather than letting the suite's ``auto``
    tests fail saying that auto chose eager. Negative control: the same verb from this checkout runs."""
    import shutil
    import subprocess
    import sys

    source = Path(regression.__file__).resolve().parents[2]
    checkout = tmp_path / "other-checkout"
    shutil.copytree(source / "rl_engine", checkout / "rl_engine",
                    ignore=shutil.ignore_patterns("_fused_cpu*.so", "_fused_cpu*.pyd", "__pycache__"))
    passing = tmp_path / "test_ok.py"
    passing.write_text("def test_ok():\n    pass\n")
    argv = [sys.executable, "-m", "rl_engine", "regression", "--tests", str(passing), *PYTEST_ARGS]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    run = subprocess.run([*argv, "--output-dir", str(tmp_path / "a")], cwd=checkout, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert (f"regression: the fused kernel is not built in this checkout ({checkout}: no logprob/backends/fused_cpu/_fused_cpu"
            in run.stderr) and f"run `pip install -e .` here (in {checkout})" in run.stderr
    assert not (tmp_path / "a").exists()  # nothing was run or written
    env = {**os.environ, "PYTHONPATH": str(source)}
    run = subprocess.run([*argv, "--output-dir", str(tmp_path / "b")], cwd=source, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "not built" not in run.stderr, run.stderr


# ---------------------------------------------------------------- validation and crosscheck


def test_good_evidence_passes_both_gates(good_run: Path) -> None:
    val = jsonio.load(good_run / "validation.json")
    cross = jsonio.load(good_run / "crosscheck.json")
    assert val["passed"] is True and val["failures"] == [] and len(val["reports"]) == 2
    assert all(r["schema_valid"] and r["accepted"] for r in val["reports"])
    assert schemas.errors(val, "validation") == [] and schemas.errors(cross, "crosscheck") == []
    assert cross["passed"] is True and cross["reference"] == "tp1-cp1"
    assert [t["topology"] for t in cross["topologies"]] == ["tp1-cp1", "tp2-cp2"]
    assert all(t["ok"] for row in cross["topologies"] for t in row["tensors"])
    assert set(val["schemas"]) >= {"report", "plan", "environment", "regression", "validation", "crosscheck"}


@pytest.mark.parametrize(
    ("field", "change", "expected"),
    [
        ("fallback", lambda r: r.update(fallback=True), f"{BAD}.json: fallback: is True"),
        ("backend", lambda r: r.update(actual_backend="cpu-vocab-parallel-logp-ws2"),
         f"{BAD}.json: actual_backend: is 'cpu-vocab-parallel-logp-ws2'"),
        ("replicated", lambda r: r.update(tp_outputs_bitwise_replicated=False), f"{BAD}.json: tp_outputs_bitwise_replicated"),
        ("rank-fallback", lambda r: r["topology"]["ranks"][3].update(fallback=True), f"{BAD}.json: topology.ranks[3].fallback"),
        ("drift", lambda r: r["drift"]["fp32_oracle"]["dlogp"].update(max_abs=0.5),
         f"{BAD}.json: drift.fp32_oracle.dlogp.max_abs: 0.5 exceeds atol"),
        ("launch", lambda r: r.update(launch_command=r["launch_command"] + " --seed 8"),
         f"{BAD}.json: launch_command: differs from the plan"),
        ("case", lambda r: r["case"].update(seed=8), f"{BAD}.json: case.seed: is 8 but the plan's case has 7"),
    ],
)
def test_corrupted_report_fails_validation_naming_field(run: Path, capsys: pytest.CaptureFixture[str], field: str,
                                                        change: Callable[[dict[str, Any]], None], expected: str) -> None:
    edit_report(run, BAD, change)
    code, err, val = gate("validate", run, capsys)
    assert code == 1 and val["passed"] is False
    assert expected in err, err
    assert any(expected in failure for failure in val["failures"])


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_literal_named_by_field(run: Path, capsys: pytest.CaptureFixture[str], literal: str) -> None:
    path = run / f"{BAD}.json"
    report = jsonio.load(path)
    report["drift"]["fp32_oracle"]["lse"]["max_abs"] = float(literal.replace("Infinity", "inf"))
    path.write_text(json.dumps(report, indent=2))  # raw, as a non-strict writer would
    assert literal in path.read_text()
    code, err, _ = gate("validate", run, capsys)
    assert code == 1
    assert f"{BAD}.json: drift.fp32_oracle.lse.max_abs: non-finite literal {literal}" in err
    code, err, _ = gate("crosscheck", run, capsys)
    assert code == 1 and f"{BAD}.json: drift.fp32_oracle.lse.max_abs: non-finite literal {literal}" in err


def test_in_memory_nan_statistic_is_not_accepted(good_run: Path) -> None:
    from rl_engine.evidence.acceptance import check_report

    report = jsonio.load(good_run / f"{BAD}.json")
    assert check_report(report, "x.json", good_run) == []  # negative control
    report["drift"]["fp64_oracle"]["dlogp"]["p99_abs"] = float("nan")
    assert [str(f) for f in check_report(report, "x.json", good_run)] == [
        "x.json: drift.fp64_oracle.dlogp.p99_abs: is not a finite number"
    ]


def test_schema_failure_named_by_field(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit_report(run, BAD, lambda r: (r.pop("reduction"), r["case"].update(batch="2")))
    code, err, val = gate("validate", run, capsys)
    assert code == 1
    assert f"{BAD}.json: (file): schema report: 'reduction' is a required property" in err
    assert f"{BAD}.json: case.batch: schema report: '2' is not of type 'integer'" in err
    assert [r["schema_valid"] for r in val["reports"]] == [True, False]


def test_fingerprint_differing_in_one_topology_fails_crosscheck(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit_report(run, BAD, lambda r: r["bitwise_fingerprints"].update(candidate_grad_sha256="0" * 64))
    code, err, cross = gate("crosscheck", run, capsys)
    assert code == 1 and cross["passed"] is False
    assert f"{BAD}: bitwise_fingerprints.candidate_grad_sha256: '{'0' * 64}' differs from tp1-cp1's" in err
    edit_report(run, BAD, lambda r: r["bitwise_fingerprints"].update(shape=[17]))
    code, err, _ = gate("crosscheck", run, capsys)
    assert f"{BAD}: bitwise_fingerprints.shape: [17] differs from tp1-cp1's [16]" in err


def test_raw_tensor_changed_by_one_byte(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = run / f"{BAD}.logp.f32"
    data = bytearray(raw.read_bytes())
    data[5] ^= 0x01
    raw.write_bytes(bytes(data))
    code, err, _ = gate("validate", run, capsys)
    assert code == 1
    assert f"{BAD}.json: tensors.logp.sha256:" in err and f"but sha256 of {BAD}.logp.f32 is" in err
    assert f"{BAD}.json: bitwise_fingerprints.candidate_logp_sha256:" in err
    code, err, cross = gate("crosscheck", run, capsys)
    assert code == 1 and f"{BAD}.json: tensors.logp.sha256:" in err
    bad_row = [row for row in cross["topologies"] if row["topology"] == BAD][0]
    assert [t["ok"] for t in bad_row["tensors"]] == [False, True, True]


def test_raw_tensor_missing(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / f"{BAD}.lse.f32").unlink()
    code, err, _ = gate("validate", run, capsys)
    assert code == 1 and f"{BAD}.json: tensors.lse.path: raw tensor file {BAD}.lse.f32 is missing" in err
    code, err, _ = gate("crosscheck", run, capsys)
    assert code == 1 and f"{BAD}.json: tensors.lse.path: raw tensor file {BAD}.lse.f32 is missing" in err


def test_tensor_path_escaping_the_run_is_refused(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit_report(run, BAD, lambda r: r["tensors"]["entropy"].update(path="../outside.f32"))
    code, err, _ = gate("validate", run, capsys)
    assert code == 1 and f"{BAD}.json: tensors.entropy.path: '../outside.f32' is not a relative path inside" in err


def test_missing_report_and_missing_files(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / f"{BAD}.json").unlink()
    (run / "environment.json").unlink()
    code, err, val = gate("validate", run, capsys)
    assert code == 1
    assert f"{BAD}.json: (file): file is missing" in err and "environment.json: (file): file is missing" in err
    assert val["reports"][1]["schema_valid"] is False
    code, err, _ = gate("crosscheck", run, capsys)
    assert code == 1 and f"{BAD}.json: (file): file is missing" in err


def test_crosscheck_needs_two_topologies(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = jsonio.load(run / "plan.json")
    plan["topologies"] = plan["topologies"][:1]
    jsonio.write_json(run / "plan.json", plan)
    code, err, _ = gate("crosscheck", run, capsys)
    assert code == 1 and "plan.json: topologies: 1 planned topologies; the cross-topology check needs at least 2" in err


def test_finding_is_validated() -> None:
    assert str(Finding("a.json", "x.y", "bad")) == "a.json: x.y: bad"
    with pytest.raises(ValueError, match="Finding.field"):
        Finding("a.json", "", "bad")


def test_load_json_names_syntax_errors(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text('{"a": 1,,}')
    obj, found = load_json(tmp_path / "x.json")
    assert obj is None and str(found[0]).startswith("x.json: line 1 column 9: invalid JSON")


# ---------------------------------------------------------------- summary


def test_summary_numbers_come_from_the_evidence(good_run: Path, run: Path) -> None:
    text = (good_run / "SUMMARY.md").read_text()
    reports = [jsonio.load(good_run / f"{label}.json") for label in ("tp1-cp1", "tp2-cp2")]
    env = jsonio.load(good_run / "environment.json")
    for heading in ("## Status", "## Validation matrix", "## Per-topology results", "## Fingerprints",
                    "## Hardware and runtime", "## Boundary", "## Artifacts"):
        assert heading in text
    assert text.count("| Passed |") == 4 and "PASSED:" in text and env["git"]["commit"] in text
    for report in reports:
        stats = report["drift"]["fp32_oracle"]
        assert f"{stats['lse']['max_abs']:.4e}" in text and repr(stats["dlogp"]["max_abs"]) in text
        assert report["bitwise_fingerprints"]["candidate_logp_sha256"] in text
    assert "| Focused regression | 1 passed, 1 skipped |" in text
    assert "| Required matrix | 2 of 2 topology reports passed |" in text
    assert f"| plan.json | {(good_run / 'plan.json').stat().st_size} | {jsonio.sha256_file(good_run / 'plan.json')} |" in text
    # the boundary says the gradient hash has no file behind it, and that is true of the run
    assert "`candidate_grad_sha256` is compared across topologies, and `verify --recompute` recomputes it" in text
    assert not [p.name for p in good_run.rglob("*") if "grad" in p.name]
    assert summary.summary_text(Run.load(good_run)) == text  # the verb writes exactly what verify renders again
    # negative control: change the evidence, the summary follows
    edit_report(run, BAD, lambda r: r["drift"]["fp32_oracle"]["lse"].update(max_abs=0.0123))
    reg = jsonio.load(run / "regression.json")
    reg.update(passed=41, skipped=3, total=44)
    jsonio.write_json(run / "regression.json", reg)
    assert summary.main(["--run-dir", str(run), "--output", str(run / "SUMMARY.md")]) == 0
    changed = (run / "SUMMARY.md").read_text()
    host = socket.gethostname()  # the runs here ran on this machine: one node per topology
    assert f"| 2 | 2 | 4 | 1: {host} | 1.2300e-02 |" in changed and "0.0123" in changed
    assert "| Focused regression | 41 passed, 3 skipped |" in changed


def test_summary_prints_evidence_strings_as_text_never_as_markup(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A parity capture whose model is ``qwen [/]`` and whose notes hold rich markup: the summary verb
    (which died with rich's MarkupError on it, at every rerun) exits 0, twice, and the console shows the
    strings as written; SUMMARY.md holds them in the parity table. Every table it prints is built of
    ``rich.text.Text`` cells, never parsed as markup."""
    from rich.console import Console
    from rich.text import Text

    parity = jsonio.load(Path(__file__).parent / "fixtures" / "schemas" / "parity" / "valid" / "parity.json")
    meta = parity["captures"]["trainer"]["metadata"]
    meta["model"], meta["engine"] = "qwen [/]", "[bold red]ALL CHECKS VERIFIED[/]"
    assert schemas.errors(parity, "parity") == []
    (run / "parity.json").write_text(jsonio.dumps(parity), encoding="utf-8")
    for _ in range(2):
        assert cli.main(["summary", "--run-dir", str(run), "--output", str(run / "SUMMARY.md")]) == 0
        out = capsys.readouterr().out
        assert "model qwen [/]," in out and "engine [bold" in out and "red]ALL CHECKS VERIFIED[/] 1.0" in out  # folded
    text = (run / "SUMMARY.md").read_text(encoding="utf-8")
    assert "model qwen [/]" in text and "engine [bold red]ALL CHECKS VERIFIED[/]" in text
    table = summary.parity_section(parity).rich()
    assert all(isinstance(cell, Text) for column in table.columns for cell in column._cells)
    console = Console(file=io.StringIO(), width=400)
    console.print(table)  # a plain string cell would raise MarkupError here
    assert "qwen [/]" in console.file.getvalue()  # type: ignore[attr-defined]


def test_summary_has_the_reproduction_section_and_every_skip_reason(good_run: Path, run: Path) -> None:
    """SUMMARY.md lacked the guide's Reproduction section and the reason of each skipped test."""
    from snakemake.utils import update_config

    from rl_engine import workflow as wfconfig
    from rl_engine.campaign.casename import evidence_case_hash

    text = (good_run / "SUMMARY.md").read_text()
    env, plan = jsonio.load(good_run / "environment.json"), jsonio.load(good_run / "plan.json")
    reg = jsonio.load(good_run / "regression.json")
    assert "## Focused regression" in text and "## Reproduction" in text
    # from the JUnit XML; its classname is the file's dotted path from pytest's rootdir, which
    # depends on where the checkout and the temporary directory lie
    assert any(line.startswith("| ") and line.endswith("test_tiny_focused::test_skipped | demonstrates a recorded skip |")
               for line in text.splitlines()), text
    commit = env["git"]["commit"]
    assert f"    git checkout {commit}\n    test \"$(git rev-parse HEAD)\" = \"{commit}\"" in text
    assert ("The working tree was DIRTY" in text) is (env["git"]["dirty"] is True)
    assert f"    {reg['command']}\n" in text
    for entry in plan["topologies"]:
        assert f"    {entry['command']}\n" in text
    plan_line = next(line for line in text.splitlines() if line.startswith("    python -m rl_engine plan "))
    assert plan_line == f"    python -m rl_engine plan --case {good_run}/case.json --output {good_run}/plan.json"
    # reproduce.yaml over config.yaml is this run's case: the same case hash as the evidence
    block = text.split("`reproduce.yaml` (over the repository's `config.yaml`", 1)[1].split("\n\n", 2)[1]
    reproduce = yaml.safe_load("\n".join(line[4:] for line in block.splitlines()))
    config = yaml.safe_load((Path(__file__).resolve().parent.parent / "config.yaml").read_text())
    update_config(config, reproduce)
    assert wfconfig.config_case_hash(config) == evidence_case_hash(plan, reg)
    # negative controls: no skip, and an unreadable JUnit XML, say so instead of a table
    (run / "pytest-junit.xml").write_text(
        (run / "pytest-junit.xml").read_text().replace('skipped="1"', 'skipped="0"').split("<testcase", 1)[0]
        + "</testsuite></testsuites>")
    assert "No test was skipped." in summary.summary_text(Run.load(run))
    (run / "pytest-junit.xml").write_text("<not xml")
    assert "pytest-junit.xml cannot be read (ParseError), so the skip reasons are unknown" in summary.summary_text(Run.load(run))


def test_summary_refuses_missing_evidence(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / "crosscheck.json").unlink()
    assert summary.main(["--run-dir", str(run), "--output", str(run / "S.md")]) == 1
    assert "crosscheck.json: (file): file is missing" in capsys.readouterr().err
    assert not (run / "S.md").exists()


# ---------------------------------------------------------------- archive


def _archive(run: Path, out: Path) -> int:
    return pack(run, out)


def _build(run: Path, out: Path) -> archive.Built:
    return archive.build(run, out, declared_files(run), schema_files(), spec_file(), workflow_files())


def test_archive_is_byte_reproducible_and_well_formed(good_run: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)  # unset: the default time, 0
    name = good_run.name
    first, second = tmp_path / "a" / f"{name}.tar.gz", tmp_path / "b" / f"{name}.tar.gz"
    assert _archive(good_run, first) == 0
    copy = tmp_path / "copy" / name  # same content, fresh mtimes and inode order
    shutil.copytree(good_run, copy, copy_function=shutil.copy)
    os.utime(copy / "plan.json", (1, 1))
    assert _archive(copy, second) == 0
    assert first.read_bytes() == second.read_bytes()
    digest = jsonio.sha256_file(first)
    assert (tmp_path / "a" / f"{name}.tar.gz.sha256").read_text() == f"{digest}  {name}.tar.gz\n"
    raw = first.read_bytes()
    assert raw[:2] == b"\x1f\x8b" and raw[4:8] == b"\0\0\0\0" and not raw[3] & 0x08  # gzip mtime 0, no name
    with tarfile.open(first) as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        assert names == sorted(names) and all(n == name or n.startswith(f"{name}/") for n in names)
        assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.uname == "" and m.gname == "" for m in members)
        assert {m.mode for m in members if m.isfile()} == {0o644} and {m.mode for m in members if m.isdir()} == {0o755}
        assert all(m.isfile() or m.isdir() for m in members)
        files = {m.name[len(name) + 1:]: tar.extractfile(m).read() for m in members if m.isfile()}  # type: ignore[union-attr]
    given = {p.relative_to(good_run).as_posix() for p in declared_files(good_run)}
    run_files = {p.relative_to(good_run).as_posix() for p in good_run.rglob("*") if p.is_file()}
    assert given == run_files  # the declared list is every file the run's verbs wrote...
    assert set(files) == given | {"REVIEWING.md", "SHA256SUMS", "arithmetic.md", "provenance.intoto.json",
                                  "ro-crate-metadata.json"} | {f"schemas/{p.name}" for p in schema_files()} | {
        f"workflow/{p.relative_to(workflow_files()[0].parent).as_posix()}" for p in workflow_files()}  # ...and all
    assert {f"schemas/{p.name}" for p in schemas.repo_schema_dir().glob("*.schema.json")} <= set(files)
    assert f"sha256sum -c {name}.tar.gz.sha256" in files["REVIEWING.md"].decode()
    reviewing = files["REVIEWING.md"].decode()
    assert "python -m rl_engine verify" in reviewing and "--accept-looser-tolerance" in reviewing
    assert "`bitwise_fingerprints.candidate_grad_sha256` is compared across topologies" in reviewing
    assert "rl-engine-arith/2" in reviewing and "replays the\ncandidate at TP=1" in reviewing
    assert "not backed by a file" in reviewing and not [rel for rel in files if "grad" in rel]
    lines = files["SHA256SUMS"].decode().splitlines()
    listed = {line.split("  ", 1)[1]: line.split("  ", 1)[0] for line in lines}
    assert set(listed) == set(files) - {"SHA256SUMS"}
    assert all(jsonio.sha256_bytes(files[rel]) == digest for rel, digest in listed.items())


def test_reviewing_says_how_to_get_rl_engine_at_the_tested_commit(good_run: Path, run: Path, tmp_path: Path) -> None:
    """REVIEWING.md did not say how to get the code that made the evidence."""
    def reviewing(run_dir: Path, out: Path) -> str:
        assert _archive(run_dir, out) == 0
        with tarfile.open(out) as tar:
            return tar.extractfile(f"{run_dir.name}/REVIEWING.md").read().decode()  # type: ignore[union-attr]

    git = jsonio.load(good_run / "environment.json")["git"]
    text = reviewing(good_run, tmp_path / "a" / f"{good_run.name}.tar.gz")
    assert "## rl_engine at the tested commit" in text
    assert f"    git checkout {git['commit']}\n    test \"$(git rev-parse HEAD)\" = \"{git['commit']}\"" in text
    assert f"branch `{git['branch']}`" in text and "pip install -e '.[test]'" in text
    assert ("The working tree was DIRTY" in text) is (git["dirty"] is True)
    assert ("The working tree was clean" in text) is (git["dirty"] is False)
    env = jsonio.load(run / "environment.json")  # negative control: a run with no git state says so
    env["git"] = {"available": False, "commit": None, "short_commit": None, "branch": None, "dirty": None,
                  "untracked_files": None, "reason": "not a git repository"}
    jsonio.write_json(run / "environment.json", env)
    for gate_verb, out in (("validate", "validation.json"), ("crosscheck", "crosscheck.json")):
        assert cli.main([gate_verb, "--run-dir", str(run), "--output", str(run / out)]) == 0
    text = reviewing(run, tmp_path / "b" / "run.tar.gz")
    assert "No git state was recorded for this run (not a git repository)" in text and "git checkout" not in text


def test_archive_checks_with_sha256sum_alone(good_run: Path, tmp_path: Path) -> None:
    tool, tar_tool = shutil.which("sha256sum"), shutil.which("tar")
    if tool is None or tar_tool is None:
        pytest.skip("sha256sum or tar not installed")
    out = tmp_path / f"{good_run.name}.tar.gz"
    built = _build(good_run, out)
    subprocess.run([tool, "-c", out.name + ".sha256"], cwd=tmp_path, check=True, capture_output=True)
    subprocess.run([tar_tool, "-xzf", out.name], cwd=tmp_path, check=True)
    done = subprocess.run([tool, "-c", "SHA256SUMS"], cwd=tmp_path / good_run.name, capture_output=True, text=True)
    assert done.returncode == 0
    assert done.stdout.count(": OK") == len(done.stdout.splitlines()) == len(built.members) - 1
    raw = tmp_path / good_run.name / "tp1-cp1.logp.f32"
    raw.write_bytes(raw.read_bytes()[:-1] + b"\x00")  # negative control: sha256sum alone notices
    done = subprocess.run([tool, "-c", "SHA256SUMS"], cwd=tmp_path / good_run.name, capture_output=True, text=True)
    assert done.returncode == 1 and "tp1-cp1.logp.f32: FAILED" in done.stdout


@pytest.mark.parametrize("gate_file", ["validation.json", "crosscheck.json"])
def test_archive_refuses_failing_or_missing_gates(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   gate_file: str) -> None:
    out = tmp_path / "res" / f"{run.name}.tar.gz"
    out.parent.mkdir()
    out.write_bytes(b"stale archive from an earlier run")
    gate_obj = jsonio.load(run / gate_file)
    gate_obj.update(passed=False, failures=["tp2-cp2.json: passed: is False"])
    jsonio.write_json(run / gate_file, gate_obj)
    assert _archive(run, out) == 1
    assert f"{gate_file} did not pass" in capsys.readouterr().err
    assert not out.exists() and not out.with_name(out.name + ".sha256").exists()
    (run / gate_file).unlink()
    assert _archive(run, out) == 1
    assert f"{gate_file}: (file): file is missing" in capsys.readouterr().err
    assert list(out.parent.iterdir()) == []


def test_interrupted_archive_leaves_nothing_at_final_path(good_run: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / f"{good_run.name}.tar.gz"
    real_fsync = os.fsync

    def interrupted(fd: int) -> None:
        real_fsync(fd)
        raise KeyboardInterrupt("simulated interruption while writing the archive")

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _build(good_run, out)
    assert list(tmp_path.iterdir()) == []  # no archive, no sidecar, no temporary file
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert _build(good_run, out).sha256 == jsonio.sha256_file(out)


def test_archive_refuses_unsafe_run_dirs_and_names(run: Path, tmp_path: Path) -> None:
    with pytest.raises(archive.ArchiveError, match="must end in .tar.gz"):
        _build(run, tmp_path / "x.tgz")
    with pytest.raises(archive.ArchiveError, match="archive name 'bad name'"):
        _build(run, tmp_path / "bad name.tar.gz")
    with pytest.raises(archive.ArchiveError, match="inside the run directory"):
        _build(run, run / "self.tar.gz")
    (run / "link.json").symlink_to(run / "plan.json")
    with pytest.raises(archive.ArchiveError, match="link.json is a symbolic link"):
        archive.build(run, tmp_path / "ok.tar.gz", [*declared_files(run), run / "link.json"], schema_files(), spec_file(),
                      workflow_files())
    (run / "link.json").unlink()
    (run / ".plan.json.abc.tmp").write_text("{")  # a crashed writer's leftover: not declared, not packed
    built = _build(run, tmp_path / "ok.tar.gz")
    assert ".plan.json.abc.tmp" not in built.members and "plan.json" in built.members


def test_archive_packs_exactly_the_given_files_and_verify_finds_all_it_needs(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The archive packs its declared inputs, not the run directory. Files no rule declares
    (a report of an unplanned topology left in the run, a note) are not packed, the summary does not
    list them, and the archive built from the declared list verifies: it misses nothing verify needs."""
    from rl_engine.evidence import verify

    (run / "tp8-cp1.json").write_bytes((run / "tp2-cp2.json").read_bytes())
    (run / "notes.txt").write_text("a reviewer's note, not evidence\n")
    assert summary.summary_text(Run.load(run)) == (run / "SUMMARY.md").read_text()  # the artifact table ignores them
    out = tmp_path / "res" / f"{run.name}.tar.gz"
    built = _build(run, out)
    given = {p.relative_to(run).as_posix() for p in declared_files(run)}
    assert set(built.members) == given | {"REVIEWING.md", "SHA256SUMS", "arithmetic.md", "provenance.intoto.json",
                                          "ro-crate-metadata.json"} | {f"schemas/{p.name}" for p in schema_files()} | {
        f"workflow/{p.relative_to(workflow_files()[0].parent).as_posix()}" for p in workflow_files()}
    monkeypatch.chdir(tmp_path)
    checks = verify.verify(out, recompute_drift=True)
    assert [c.name for c in checks if c.passed is False] == [], [c.to_dict() for c in checks if c.passed is False]
    assert {"SUMMARY.md", "report acceptance", "cross-topology fingerprints", "recorded gates",
            "candidate replayed"} <= {c.name for c in checks if c.passed is True}


@pytest.mark.parametrize("case", ["missing", "outside", "directory", "clash", "tensor left out", "summary left out",
                                  "log left out", "other schemas", "no schemas"])
def test_archive_refuses_a_file_list_it_cannot_pack_naming_the_file_and_the_fix(
        run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    files, schema_list = declared_files(run), schema_files()
    expected = {
        "missing": "tp2-cp2.lse.f32 is missing (or not a regular file); it is declared evidence of the run: make it "
                   "again (snakemake --cores 8 rebuilds every declared file) or leave it out of --files",
        "outside": "outside.json lies outside the run directory",
        "directory": "logs is missing (or not a regular file)",
        "clash": "SHA256SUMS clashes with the archive's own SHA256SUMS; rename it or leave it out of --files",
        "tensor left out": "tp1-cp1.entropy.f32 is evidence that verify needs but is not among the files to pack "
                           "(1 missing: tp1-cp1.entropy.f32); add it to --files",
        "summary left out": "SUMMARY.md is evidence that verify needs but is not among the files to pack",
        "other schemas": "the schemas given (report differ) are not the ones validation.json records it was "
                         "checked with",
        "no schemas": "the following arguments are required: --schemas",
    }.get(case)
    if case == "missing":
        (run / "tp2-cp2.lse.f32").unlink()
    elif case == "outside":
        (tmp_path / "outside.json").write_text("{}")
        files.append(tmp_path / "outside.json")
    elif case == "directory":
        files.append(run / "logs")
    elif case == "clash":
        (run / "SHA256SUMS").write_text("")
        files.append(run / "SHA256SUMS")
    elif case == "tensor left out":
        files.remove(run / "tp1-cp1.entropy.f32")
    elif case == "summary left out":
        files.remove(run / "SUMMARY.md")
    elif case == "log left out":  # packed when given, never required: verify needs no log
        files = [f for f in files if f.parent.name != "logs"]
    elif case == "other schemas":
        other = tmp_path / "other" / "report.schema.json"
        other.parent.mkdir()
        other.write_text(schema_list[[p.name for p in schema_list].index("report.schema.json")].read_text() + "\n")
        schema_list = [other if p.name == other.name else p for p in schema_list]
    out = tmp_path / "res" / f"{run.name}.tar.gz"
    argv = ["archive", "--run-dir", str(run), "--output", str(out), "--spec", str(spec_file()),
            "--workflow", *map(str, workflow_files()), "--files", *map(str, files)]
    if case != "no schemas":
        argv += ["--schemas", *map(str, schema_list)]
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    err = capsys.readouterr().err
    if expected is None:
        assert code == 0, err
        with tarfile.open(out) as tar:
            assert not [m for m in tar.getnames() if "/logs/" in m]
        return
    assert code in (1, 2) and expected in err, err
    assert not out.exists() and not out.with_name(out.name + ".sha256").exists()


def test_gzip_and_tar_helpers_are_deterministic() -> None:
    files = [("b.txt", b"2"), ("a/x.bin", b"\0\1")]
    one, two = archive.tar_gz_bytes("N", files), archive.tar_gz_bytes("N", list(reversed(files)))
    assert one == two
    with tarfile.open(fileobj=io.BytesIO(one)) as tar:
        assert tar.getnames() == ["N", "N/a", "N/a/x.bin", "N/b.txt"]
    assert gzip.decompress(one)[:1] == b"N"
    first, second = jsonio.sha256_bytes(b"\0\1"), jsonio.sha256_bytes(b"2")
    assert archive.sums_text(files) == f"{first}  a/x.bin\n{second}  b.txt\n"


def test_a_file_member_is_streamed_from_disk_and_packs_the_same_bytes(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture can be gigabytes: the archive reads a file member in chunks (never whole:
    ``Path.read_bytes`` is refused here) and its bytes and SHA256SUMS line are those of the same data held
    in memory, so streaming keeps the archive byte-reproducible."""
    big = tmp_path / "capture.safetensors"
    data = bytes(range(256)) * (3 * 4096 + 17)  # about 3 MiB: several chunks
    big.write_bytes(data)
    in_memory = [("b.txt", b"2"), ("capture.safetensors", data)]
    expected_tar, expected_sums = archive.tar_gz_bytes("N", in_memory), archive.sums_text(in_memory)

    def refuse(self: Path) -> bytes:
        raise AssertionError(f"{self} was read whole into memory")

    monkeypatch.setattr(Path, "read_bytes", refuse)
    streamed = [("b.txt", b"2"), ("capture.safetensors", big)]
    assert archive.tar_gz_bytes("N", streamed) == expected_tar
    assert archive.sums_text(streamed) == expected_sums
    given = archive.given_files(tmp_path, [big])
    assert given == [("capture.safetensors", big)]  # a path, not the bytes


def test_cli_maps_every_evidence_verb() -> None:
    for verb in ("env", "regression", "validate", "crosscheck", "summary", "archive", "verify"):
        assert verb in cli.VERBS
    done = subprocess.run([sys.executable, "-m", "rl_engine", "validate", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--run-dir" in done.stdout


# ---------------------------------------------------------------- any standard validator, offline
ARTIFACT_SCHEMAS = {"case.json": "case", "plan.json": "plan", "validation.json": "validation", "crosscheck.json": "crosscheck",
                    "environment.json": "environment", "regression.json": "regression"}
NO_NETWORK = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
              "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": ""}


def _check_jsonschema(schema: Path, instance: Path) -> subprocess.CompletedProcess[str]:
    """The standard ``check-jsonschema`` CLI (not our code), with every network route refused."""
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--schemafile", str(schema), str(instance)],
        env={**os.environ, **NO_NETWORK}, capture_output=True, text=True, timeout=120, check=False,
    )


def test_check_jsonschema_validates_every_artifact_offline_with_the_shipped_schemas(
    good_run: Path, tmp_path: Path,
) -> None:
    shipped = tmp_path / "schemas"  # as the archive ships them, away from the repository
    shutil.copytree(schemas.repo_schema_dir(), shipped)
    files = {name: good_run / name for name in ARTIFACT_SCHEMAS}
    files.update({p.name: p for p in good_run.glob("tp*-cp*.json")})
    assert len(files) == len(ARTIFACT_SCHEMAS) + len(TOPOLOGIES)
    for name, path in sorted(files.items()):
        schema = ARTIFACT_SCHEMAS.get(name, "report")
        done = _check_jsonschema(shipped / f"{schema}.schema.json", path)
        assert done.returncode == 0, f"{name}: {done.stdout}{done.stderr}"
    # negative control: the same validator, a broken report, fails naming the field
    report = jsonio.load(good_run / "tp1-cp1.json")
    report["bitwise_fingerprints"]["candidate_lse_sha256"] = "not-a-hash"
    bad = tmp_path / "tp1-cp1.json"
    jsonio.write_json(bad, report)
    done = _check_jsonschema(shipped / "report.schema.json", bad)
    assert done.returncode == 1 and "candidate_lse_sha256" in done.stdout, done.stdout + done.stderr

def _help(verb: str, capsys: pytest.CaptureFixture[str]) -> str:
    try:
        code = cli.main([verb, "--help"])
    except SystemExit as exc:  # argparse's --help
        code = exc.code
    assert code in (0, None), verb
    return capsys.readouterr().out


def test_every_verb_help_says_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    """Plan --help and compare --help printed the same text under the runner's file name, and
    launch --help printed its own usage line as its description."""
    helps = {verb: _help(verb, capsys) for verb in cli.VERBS}
    for verb, text in helps.items():
        assert text.startswith(f"usage: python -m rl_engine {verb} "), (verb, text[:200])
        description = text.split("\n\n", 2)[1]  # argparse: usage, blank line, description
        assert not description.lstrip().startswith(("usage", "``python -m")), (verb, description)
        assert len(description.split()) >= 8, (verb, description)
    assert len(set(helps.values())) == len(helps)  # no two verbs print the same help
    assert "Write plan.json for a case" in helps["plan"]
    assert "Run one topology of a plan under torchrun" in helps["run"]  # (the verb was `compare`)
    assert "case.schema.json and every case rule" in helps["case"]
    assert "Run one planned topology" in helps["launch"]


def test_no_verb_imports_torch_for_its_help() -> None:
    """Every verb's --help in a fresh interpreter, with torch absent from sys.modules afterwards
    (copy-capture --help took 10 s: its module imports torch; rl_engine.verb_parsers builds the
    parsers of such verbs without it). The verbs' accepted arguments come from the same parsers
    (test_every_verb_help_says_what_it_does checks each help through cli.main)."""
    script = ("import contextlib, io, sys\n"
              "from rl_engine import cli\n"
              "heavy = {}\n"
              "for verb in cli.VERBS:\n"
              "    with contextlib.redirect_stdout(io.StringIO()):\n"
              "        try:\n"
              "            code = cli.main([verb, '--help'])\n"
              "        except SystemExit as exc:\n"
              "            code = exc.code\n"
              "    assert code in (0, None), (verb, code)\n"
              "    heavy[verb] = sorted(m for m in ('torch', 'triton') if m in sys.modules)\n"
              "print(heavy)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    heavy = eval(done.stdout)  # noqa: S307 (our own subprocess's repr of a dict of lists of names)
    assert set(heavy) == set(cli.VERBS) and all(found == [] for found in heavy.values()), heavy
    # negative control: the check sees torch when a verb's module is imported
    control = subprocess.run([sys.executable, "-c", "import sys, rl_engine.capture.parity; print('torch' in sys.modules)"],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert control.stdout.strip() == "True", control.stderr[-2000:]


@pytest.mark.parametrize("argv", [["check-config", "/nonexistent/config.yaml"], ["env", "--output-dir", "/proc/no/such"]])
def test_file_errors_end_in_a_message_without_a_traceback(argv: list[str], tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "rl_engine", *argv], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.returncode in (1, 2), done.stderr
    assert "No such file or directory" in done.stderr and "Traceback" not in done.stderr and 'File "' not in done.stderr


def test_env_refuses_an_output_dir_it_cannot_make_before_any_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The ``env`` verb makes its output directory before it runs the probes (git, a Python that imports
    torch, nvidia-smi, nvcc: seconds), so a directory it cannot make is refused at once, naming it."""
    probed: list[str] = []
    monkeypatch.setattr(environment, "probe", lambda *a: probed.append("probe") or pytest.fail("probed"))
    monkeypatch.setattr(environment, "raw_text", lambda *a: probed.append("raw_text") or pytest.fail("ran commands"))
    blocker = tmp_path / "a-file"
    blocker.write_text("x", encoding="utf-8")
    assert cli.main(["env", "--output-dir", str(blocker / "run"), "--repo", str(tmp_path)]) == 2
    assert f"env: [Errno 20] Not a directory: '{blocker / 'run'}'" in capsys.readouterr().err
    assert probed == []
    # negative control: a directory it can make is made, and then the probes run
    with pytest.raises(pytest.fail.Exception, match="probed"):
        cli.main(["env", "--output-dir", str(tmp_path / "made" / "run"), "--repo", str(tmp_path)])
    assert probed == ["probe"] and (tmp_path / "made" / "run").is_dir()


def test_plan_not_built_from_the_case_file_fails_validation(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """validation requires plan.json's case and topologies to be case.json's (the one-way flow)."""
    code, _, _ = gate("validate", run, capsys)
    assert code == 0  # negative control: the run as built
    case = jsonio.load(run / "case.json")
    case["case"]["seed"] += 1
    case["topologies"] = case["topologies"][::-1]
    jsonio.write_json(run / "case.json", case)
    code, err, _ = gate("validate", run, capsys)
    assert code == 1
    assert "plan.json: case: differs from case.json's case in ['seed']: the plan was not built from this case file" in err
    assert "plan.json: topologies: plans [(1, 1), (2, 2)], but case.json lists [(2, 2), (1, 1)]" in err


# ---------------------------------------------------------------- cheap value checks, hostile JSON


def _f32(*values: float) -> bytes:
    import struct

    return struct.pack(f"<{len(values)}f", *values)


def test_tensor_value_checks_unit() -> None:
    """What the arithmetic guarantees of the raw files (seq 4, 1 prompt token: tokens 0 and 4 inactive)."""
    import numpy as np

    from rl_engine.campaign.mask import recipe_active
    from rl_engine.evidence.acceptance import check_tensor_values

    case = recipe_active(np.arange(8), 4, 1)  # the mask the case's inputs have
    good_logp = _f32(0.0, -1.5, 0.0, -float("inf"), 0.0, -0.25, -7.0, -1e-30)  # +0 allowed on active tokens too
    assert check_tensor_values("logp", good_logp, case, "r.json") == []
    assert check_tensor_values("lse", _f32(float("nan"), 7.0, -3.0, 1e30, float("inf"), 6.9, 7.1, 7.2), case,
                               "r.json") == []  # inactive rows may hold anything
    assert check_tensor_values("entropy", _f32(*[-1.0] * 8), case, "r.json") == []  # nothing claimed
    minus_zero = _f32(-0.0, -1.5, -1.0, -1.0, 0.0, -1.0, -1.0, -1.0)
    [found] = check_tensor_values("logp", minus_zero, case, "r.json")
    assert str(found).startswith("r.json: tensors.logp: token 0 is inactive (a prompt token) but holds -0.0 (0x80000000)")
    positive = _f32(0.0, 7.25, float("nan"), -1.0, 0.0, -1.0, -1.0, -1.0)
    [found] = check_tensor_values("logp", positive, case, "r.json")
    assert "token 1 holds 7.25, which is positive" in str(found) and "(2 such tokens)" in str(found)
    [found] = check_tensor_values("lse", _f32(1.0, float("inf"), 2.0, 3.0, 1.0, 2.0, 2.0, float("nan")), case, "r.json")
    assert "token 1 is active but holds inf; the LSE of an active token is finite (2 such tokens)" in str(found)


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        ("[" * 100_000 + "NaN" + "]" * 100_000, "(file)", "JSON nested too deeply to be an rl_engine artifact"),
        ("[NaN, " + "[" * 100_000 + "]" * 100_000 + "]", "(file)", "JSON nested too deeply to be an rl_engine artifact"),
        ("[NaN, " + "[" * 200 + "]" * 200 + "]", "[0]", "non-finite literal NaN"),
        ('{"a": ' + "9" * 100_000 + "}", "(file)", "an integer of 100000 digits is not an rl_engine value"),
        ('{"a": -' + "1" * 101 + "}", "(file)", "an integer of 101 digits"),
        ('{"a": 1e999999}', "(file)", "the number 1e999999 is not finite as a binary64 value"),
        ('{"a": [1, -1e400]}', "(file)", "the number -1e400 is not finite"),
        ('{"a": [1, NaN]}', "a[1]", "non-finite literal NaN"),
    ],
    ids=["deep NaN", "NaN then deep", "NaN then 200 deep", "100k digits", "101 digits", "overflowing exponent",
         "negative overflow", "located NaN"],
)
def test_load_json_hostile_numbers_and_depth(tmp_path: Path, text: str, field: str, message: str) -> None:
    path = tmp_path / "x.json"
    path.write_text(text)
    value, found = load_json(path)
    assert value is None and len(found) == 1, found
    assert found[0].where == "x.json" and found[0].field == field and message in found[0].message, found
    path.write_text('{"a": ' + "9" * 100 + ', "b": 1e308}')  # the largest accepted: control
    assert load_json(path) == ({"a": int("9" * 100), "b": 1e308}, [])


def test_summary_reproduction_installs_with_the_readmes_command(good_run: Path) -> None:
    """SUMMARY.md's Reproduction said `pip install -e '.[test]'`, the README another command."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    for command in summary.INSTALL_COMMANDS.values():
        assert command.split("  #")[0] in readme, command
    text = (good_run / "SUMMARY.md").read_text(encoding="utf-8")
    reproduction = text[text.index("## Reproduction"):]
    assert f"    {summary.INSTALL_COMMANDS['cpu']}\n" in reproduction
    assert summary.install_command("cuda") == summary.INSTALL_COMMANDS["cuda"] != summary.install_command("cpu")


def test_archive_refuses_a_specification_of_another_version(run: Path, tmp_path: Path) -> None:
    """The packed spec must be the version the engine computes (its first line names it)."""
    other = tmp_path / "arithmetic.md"
    other.write_bytes(spec_file().read_bytes().replace(b"`rl-engine-arith/2`", b"`rl-engine-arith/1`", 1))
    out = tmp_path / "res" / f"{run.name}.tar.gz"
    with pytest.raises(archive.ArchiveError, match=r"names version 'rl-engine-arith/1', but this rl_engine computes "
                                                   r"'rl-engine-arith/2'"):
        archive.build(run, out, declared_files(run), schema_files(), other, workflow_files())
    assert not out.exists()


def test_the_regression_shows_progress_on_its_progress_fd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The focused suite was 34 s of silence; with --progress-fd the verb writes a start
    line, one line per pytest progress line and the counts there (the log keeps all of pytest's output).
    The suite: a scratch file of three tests, in a pytest without the installed plugins (a quick start)."""
    assert regression.progress_line("....... [ 48%]\n", 12.4) == "regression: 48% of the focused suite, 12 s\n"
    assert regression.progress_line("1 passed in 0.1s\n", 1.0) is None  # negative control
    suite = tmp_path / "suite" / "test_three.py"
    suite.parent.mkdir()
    suite.write_text("def test_one():\n    pass\n\n\ndef test_two():\n    pass\n\n\ndef test_three():\n    pass\n")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    read, write = os.pipe()
    try:
        code = regression.main(["--output-dir", str(tmp_path / "run"), "--tests", str(suite),
                                "--pytest-arg=-x", "--progress-fd", str(write)])
    finally:
        os.close(write)
    with os.fdopen(read) as stream:
        shown = stream.read().splitlines()
    assert code == 0
    assert shown[0].startswith("regression: running the focused suite (1 files)")
    assert shown[-2].endswith("% of the focused suite, " + shown[-2].split(", ")[-1]) and "100%" in shown[-2]
    assert re.match(r"regression: 3 passed, 0 failed", shown[-1]), shown
