"""The archive's provenance statement, its Workflow Run RO-Crate and its one time, SOURCE_DATE_EPOCH.

On the session's real archive (conftest's ``tiny_archive``): the statement lists exactly the archive's
files but itself and SHA256SUMS, with their digests, and validates with the in-toto bindings and, with
a standard validator (check-jsonschema) offline, against the shipped schemas; the crate lists exactly
the archive's files but itself and one action per stage. Each tampered variant (a changed digest, a
missing or an extra subject, another predicateType; a crate missing a file or listing an extra one)
keeps SHA256SUMS, and for the crate the statement's digest of it, consistent, so the row under test has
to catch it. The archive rebuilds byte for byte under one SOURCE_DATE_EPOCH and, under another,
differs in its times alone.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Callable

import pytest

from rl_engine import jsonio
from rl_engine.evidence import crate, epoch, provenance
from rl_engine.rundir import CRATE, STATEMENT, SUMS, Run, run_stages
from rl_engine.workflow.config import archive_problems

from _archive_util import Entry, Good, Sandbox, file_entry, make_sandbox, resummed, run_verify, write_archive
from _evidence_run import archive_argv, pack

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "workflow" / "rules"
NO_NETWORK = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
              "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": ""}


@pytest.fixture()
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Sandbox:
    return make_sandbox(tmp_path, monkeypatch)


def files_of(good: Good) -> dict[str, bytes]:
    return {info.name[len(good.name) + 1:]: data for info, data in good.entries if data is not None}


def doc(good: Good, rel: str) -> Any:
    return jsonio.loads(good.data(rel).decode())


def row(result: dict[str, Any], name: str) -> tuple[str, str]:
    check = [c for c in result["checks"] if c["name"] == name][0]
    return check["status"], "\n".join([check["detail"], *check["problems"]])


def with_member(good: Good, rel: str, change: Callable[[Any], None], restate: bool = False) -> list[Entry]:
    """The good entries with ``rel``'s JSON changed; with ``restate`` the statement's digest of it follows;
    SHA256SUMS recomputed, so only the row that reads ``rel`` can notice."""
    name = f"{good.name}/{rel}"
    changed = doc(good, rel)
    change(changed)
    data = jsonio.dumps(changed).encode()
    entries = [file_entry(name, data) if info.name == name else (info, d) for info, d in good.entries]
    if restate:
        statement = doc(good, STATEMENT)
        for subject in statement["subject"]:
            if subject["name"] == rel:
                subject["digest"]["sha256"] = jsonio.sha256_bytes(data)
        stated = f"{good.name}/{STATEMENT}"
        entries = [file_entry(stated, jsonio.dumps(statement).encode()) if i.name == stated else (i, d)
                   for i, d in entries]
    return resummed(good, entries)


# ---------------------------------------------------------------- the project's own archive
def test_the_statement_lists_every_file_but_itself_and_sha256sums_with_its_digest(tiny_archive: Good) -> None:
    files = files_of(tiny_archive)
    statement = doc(tiny_archive, STATEMENT)
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["predicateType"] == "https://slsa.dev/provenance/v1"
    subjects = {s["name"]: s["digest"]["sha256"] for s in statement["subject"]}
    assert set(subjects) == set(files) - {STATEMENT, SUMS}  # excluded by construction, and nothing else
    assert subjects == {rel: jsonio.sha256_bytes(files[rel]) for rel in subjects}
    assert CRATE in subjects and "workflow/Snakefile" in subjects  # the crate and the workflow are covered
    predicate = statement["predicate"]
    env = doc(tiny_archive, "environment.json")
    assert predicate["buildDefinition"]["resolvedDependencies"] == [
        {"name": "rl_engine", "digest": {"gitCommit": env["git"]["commit"]},
         "annotations": {"branch": env["git"]["branch"], "dirty": env["git"]["dirty"],
                         "untrackedFiles": env["git"]["untracked_files"]}}]
    external = predicate["buildDefinition"]["externalParameters"]
    plan = doc(tiny_archive, "plan.json")
    # the config as the evidence holds it: integers stay integers (protobuf's Struct would make 7 into 7.0)
    assert external["config"]["seed"] == plan["case"]["seed"] and isinstance(external["config"]["seed"], int)
    assert external["workflow"] == "workflow/Snakefile" and external["sourceDateEpoch"] == 0
    internal = predicate["buildDefinition"]["internalParameters"]
    assert internal["case"] == plan["case"] and internal["caseId"] == plan["case_id"]
    assert internal["commands"]["topologies"] == {f"tp{e['tp']}-cp{e['cp']}": e["command"] for e in plan["topologies"]}
    metadata = predicate["runDetails"]["metadata"]
    assert metadata == {"invocationId": tiny_archive.name, "startedOn": "1970-01-01T00:00:00Z",
                        "finishedOn": "1970-01-01T00:00:00Z"}
    assert predicate["runDetails"]["byproducts"][0]["digest"] == {"sha256": subjects["environment.json"]}


def test_the_statement_parses_back_into_the_in_toto_bindings_and_validates(tiny_archive: Good) -> None:
    from google.protobuf import json_format
    from in_toto_attestation.predicates.provenance.v1 import provenance_pb2
    from in_toto_attestation.v1 import statement_pb2
    from in_toto_attestation.v1.statement import Statement

    statement = doc(tiny_archive, STATEMENT)
    parsed = Statement.copy_from_pb(json_format.ParseDict(statement, statement_pb2.Statement()))
    parsed.validate()
    json_format.ParseDict(statement["predicate"], provenance_pb2.Provenance())  # every field is the SLSA message's
    statement["predicate"]["runDetails"]["metadata"]["startedOn"] = "1970-01-01 00:00"  # negative control
    with pytest.raises(json_format.ParseError):
        json_format.ParseDict(statement["predicate"], provenance_pb2.Provenance())


def test_the_crate_lists_every_file_but_itself_and_a_run_of_each_stage(tiny_archive: Good, tmp_path: Path) -> None:
    files = files_of(tiny_archive)
    graph = {e["@id"]: e for e in doc(tiny_archive, CRATE)["@graph"]}
    root = graph["./"]
    assert {ref["@id"] for ref in root["hasPart"]} == set(files) - {CRATE}
    assert {i for i, e in graph.items() if "File" in (e["@type"] if isinstance(e["@type"], list) else [e["@type"]])} \
        == set(files) - {CRATE}
    assert [ref["@id"] for ref in root["conformsTo"]] == list(crate.PROFILES)
    assert root["datePublished"] == "1970-01-01T00:00:00Z" and root["mainEntity"] == {"@id": "workflow/Snakefile"}
    workflow = graph["workflow/Snakefile"]
    assert set(workflow["@type"]) == {"File", "SoftwareSourceCode", "ComputationalWorkflow", "HowTo"}
    run_dir = tmp_path / tiny_archive.name
    for rel, data in files.items():
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_bytes(data)
    stages = run_stages(Run.load(run_dir).stages())
    actions = [i for i, e in graph.items() if e["@type"] == "CreateAction"]
    assert actions == [f"#stage-{s.label.replace(' ', '-')}" for s in stages] + ["#stage-archive", "#run"]
    topology = graph["#stage-topology-tp2-cp2"]
    assert topology["instrument"] == {"@id": "#rule-topology"} and topology["object"] == [{"@id": "plan.json"}]
    assert [r["@id"] for r in topology["result"]] == ["tp2-cp2.json", "tp2-cp2.logp.f32", "tp2-cp2.lse.f32",
                                                        "tp2-cp2.entropy.f32", "logs/tp2-cp2.log"]
    assert [r["@id"] for r in graph["#stage-archive"]["result"]] == ["REVIEWING.md", STATEMENT, SUMS]
    assert graph["#run"]["instrument"] == {"@id": "workflow/Snakefile"} and graph["#run"]["object"][0] == {"@id": "#config"}
    assert graph["#config"]["value"] == provenance.reproduce_text(Run.load(run_dir))
    assert [graph[c["@id"]]["object"] for c in graph["#engine"]["object"]] == [{"@id": a} for a in actions[:-1]]


def test_the_projects_archive_verifies_with_both_rows(tiny_archive: Good, sandbox: Sandbox,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, text, result = run_verify(tiny_archive.archive, sandbox, capsys)
    assert code == 0, text
    files = files_of(tiny_archive)
    assert row(result, "provenance statement") == (
        "PASS", f"in-toto Statement v1 with SLSA provenance v1: {len(files) - 2} subjects, every file but "
                f"{STATEMENT} and {SUMS}, each with its SHA-256")
    assert row(result, "RO-Crate") == ("PASS", f"a Workflow Run RO-Crate listing all {len(files) - 1} other files "
                                               "of the archive")


def test_verify_needs_neither_torch_nor_the_provenance_extra(tiny_run: Path, tiny_archive: Good, tmp_path: Path) -> None:
    """A reviewer's install may lack torch, in-toto-attestation, protobuf and rocrate: verify (without
    ``--recompute``) checks both files with the shipped schemas and its own code, in a fresh interpreter
    where importing any of them fails. The archive verb needs no torch either (it names the arithmetic's
    version from the NumPy spec): packing the tiny run again without it gives the same bytes."""
    blocked = "import sys\nfor m in ('torch', 'rocrate', 'in_toto_attestation', 'google', 'google.protobuf'): sys.modules[m] = None\n"
    done = subprocess.run([sys.executable, "-c", blocked + "from rl_engine.evidence import verify\n"
                           f"sys.exit(verify.main([{str(tiny_archive.archive)!r}]))"],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0 and "VERIFIED" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert "provenance statement │ PASS" in re.sub(r" +│", " │", done.stdout)
    again = tmp_path / tiny_archive.archive.name
    argv = archive_argv(tiny_run, again)  # what _evidence_run.pack gives the verb
    packed = subprocess.run([sys.executable, "-c", "import sys\nsys.modules['torch'] = None\n"
                             f"from rl_engine import cli\nsys.exit(cli.main({argv!r}))"],
                            env={**{k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}, "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, timeout=300, check=False)
    assert packed.returncode == 0, packed.stdout[-3000:] + packed.stderr[-3000:]
    assert again.read_bytes() == tiny_archive.archive.read_bytes()


# ---------------------------------------------------------------- tampered statements and crates
def _set_digest(statement: dict[str, Any]) -> None:
    statement["subject"][0]["digest"]["sha256"] = "0" * 64


def _drop_summary(statement: dict[str, Any]) -> None:
    statement["subject"] = [s for s in statement["subject"] if s["name"] != "SUMMARY.md"]


def _add_note(statement: dict[str, Any]) -> None:
    statement["subject"].append({"name": "notes.txt", "digest": {"sha256": "1" * 64}})


def _add_sums(statement: dict[str, Any]) -> None:
    statement["subject"].append({"name": SUMS, "digest": {"sha256": "2" * 64}})


def _other_predicate(statement: dict[str, Any]) -> None:
    statement["predicateType"] = "https://slsa.dev/provenance/v0.2"


def _other_commit(statement: dict[str, Any]) -> None:
    statement["predicate"]["buildDefinition"]["resolvedDependencies"][0]["digest"]["gitCommit"] = "f" * 40


@pytest.mark.parametrize(("change", "expected"), [
    (_set_digest, "{first}: digest.sha256 is '" + "0" * 64 + "' but the file's SHA-256 is"),
    (_drop_summary, "does not list SUMMARY.md, a file of the archive (missing subject)"),
    (_add_note, "lists notes.txt, which is not a file of the archive (extra subject)"),
    (_add_sums, f"lists {SUMS}, which cannot be a subject"),
    (_other_predicate, "predicateType is 'https://slsa.dev/provenance/v0.2', not the SLSA provenance v1 predicate"),
    (_other_commit, "rl_engine's gitCommit is '" + "f" * 40 + "' but environment.json records commit"),
], ids=["changed-digest", "missing-subject", "extra-subject", "sha256sums-as-subject", "wrong-predicate-type",
        "other-commit"])
def test_a_tampered_statement_fails_verify_naming_the_problem(tiny_archive: Good, sandbox: Sandbox, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str],
                                                               change: Callable[[dict[str, Any]], None],
                                                               expected: str) -> None:
    path = write_archive(tmp_path / tiny_archive.archive.name, with_member(tiny_archive, STATEMENT, change))
    code, text, result = run_verify(path, sandbox, capsys)
    status, detail = row(result, "provenance statement")
    first = doc(tiny_archive, STATEMENT)["subject"][0]["name"]
    assert code == 1 and status == "FAIL" and expected.format(first=first) in detail, detail
    assert row(result, "SHA256SUMS")[0] == "PASS" and row(result, "RO-Crate")[0] == "PASS"  # only this row notices


def _drop_file(graph_doc: dict[str, Any]) -> None:
    graph_doc["@graph"] = [e for e in graph_doc["@graph"] if e["@id"] != "tp1-cp1.lse.f32"]
    for entity in graph_doc["@graph"]:
        for key, value in list(entity.items()):
            if isinstance(value, list):
                entity[key] = [v for v in value if v != {"@id": "tp1-cp1.lse.f32"}]


def _add_file(graph_doc: dict[str, Any]) -> None:
    graph_doc["@graph"].append({"@id": "notes.txt", "@type": "File", "name": "notes.txt"})
    graph_doc["@graph"][0]["hasPart"].append({"@id": "notes.txt"})


def _unlisted_file(graph_doc: dict[str, Any]) -> None:
    graph_doc["@graph"][0]["hasPart"] = [p for p in graph_doc["@graph"][0]["hasPart"] if p["@id"] != "plan.json"]


def _no_workflow_run_profile(graph_doc: dict[str, Any]) -> None:
    graph_doc["@graph"][0]["conformsTo"] = graph_doc["@graph"][0]["conformsTo"][:1]


def _dangling(graph_doc: dict[str, Any]) -> None:
    graph_doc["@graph"] = [e for e in graph_doc["@graph"] if e["@id"] != "#rule-plan"]


@pytest.mark.parametrize(("change", "expected"), [
    (_drop_file, "does not list tp1-cp1.lse.f32, a file of the archive (missing from the root's hasPart)"),
    (_add_file, "lists notes.txt, which is not a file of the archive (extra data entity)"),
    (_unlisted_file, "does not list plan.json, a file of the archive"),
    (_no_workflow_run_profile, "does not conform to https://w3id.org/ro/wfrun/workflow/0.6 (Workflow Run Crate)"),
    (_dangling, "'#stage-plan'.instrument references '#rule-plan', which is no entity of the crate"),
], ids=["misses-a-file", "lists-an-extra-file", "file-not-in-hasPart", "profile-left-out", "dangling-reference"])
def test_a_crate_that_misses_or_adds_a_file_fails_verify(tiny_archive: Good, sandbox: Sandbox, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         change: Callable[[dict[str, Any]], None], expected: str) -> None:
    assert doc(tiny_archive, CRATE)["@graph"][0]["@id"] == "./"  # the root is where the changes assume it
    path = write_archive(tmp_path / tiny_archive.archive.name, with_member(tiny_archive, CRATE, change, restate=True))
    code, text, result = run_verify(path, sandbox, capsys)
    status, detail = row(result, "RO-Crate")
    assert code == 1 and status == "FAIL" and expected in detail, detail
    assert row(result, "provenance statement")[0] == "PASS" and row(result, "SHA256SUMS")[0] == "PASS"


@pytest.mark.parametrize("gone", [STATEMENT, CRATE])
def test_an_archive_without_the_statement_or_the_crate_fails(tiny_archive: Good, sandbox: Sandbox, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str], gone: str) -> None:
    entries = resummed(tiny_archive, [(i, d) for i, d in tiny_archive.entries if i.name != f"{tiny_archive.name}/{gone}"])
    code, text, result = run_verify(write_archive(tmp_path / tiny_archive.archive.name, entries), sandbox, capsys)
    row_name = "provenance statement" if gone == STATEMENT else "RO-Crate"
    assert code == 1 and row(result, row_name) == ("FAIL", f"{gone} is missing: the archive's builder writes it\n"
                                                           f"{gone} is missing: the archive's builder writes it")
    other = "RO-Crate" if gone == STATEMENT else "provenance statement"  # the other one names the missing file
    assert row(result, other)[0] == "FAIL" and f"lists {gone}, which is not a file of the archive" in row(result, other)[1]


def test_an_archive_from_before_the_statement_and_the_crate_verifies_with_notes(
        tiny_archive: Good, sandbox: Sandbox, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An archive made before the provenance statement and the RO-Crate holds neither and no workflow files,
    and its REVIEWING.md says nothing of them (``tests/test_arith_versions.py`` verifies such an archive as it
    was made): both rows are notes. Stripped of both with the new REVIEWING.md left, REVIEWING.md fails."""
    from rl_engine.evidence import archive

    name = tiny_archive.name
    gone = {f"{name}/{STATEMENT}", f"{name}/{CRATE}"}
    kept = [(i, d) for i, d in tiny_archive.entries if i.name not in gone and not i.name.startswith(f"{name}/workflow")]
    git = doc(tiny_archive, "environment.json")["git"]
    older = archive.reviewing_text(name, git, tiny_archive.data("arithmetic.md"), described=False)
    assert "provenance" not in older and "provenance" in tiny_archive.data("REVIEWING.md").decode()
    entries = resummed(tiny_archive, [file_entry(i.name, older.encode()) if i.name == f"{name}/REVIEWING.md" else (i, d)
                                      for i, d in kept])
    code, text, result = run_verify(write_archive(tmp_path / "old" / tiny_archive.archive.name, entries), sandbox, capsys)
    assert code == 0, text
    for name_of_row in ("provenance statement", "RO-Crate"):
        assert row(result, name_of_row) == ("note", f"the archive holds neither {STATEMENT} nor {CRATE}, as archives "
                                                    "made before them did (its REVIEWING.md says nothing of them): not "
                                                    "checked; every other row checks the archive")
    stripped = resummed(tiny_archive, kept)  # negative control: the REVIEWING.md of an archive that holds them
    code, text, result = run_verify(write_archive(tmp_path / "stripped" / tiny_archive.archive.name, stripped), sandbox,
                                    capsys)
    assert code == 1 and row(result, "REVIEWING.md")[0] == "FAIL"


# ---------------------------------------------------------------- a standard validator, offline
def _check_jsonschema(schema: Path, instance: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--schemafile", str(schema), str(instance)],
                          env={**os.environ, **NO_NETWORK}, capture_output=True, text=True, timeout=120, check=False)


def test_check_jsonschema_validates_the_statement_and_the_crate_offline_with_the_shipped_schemas(
        tiny_archive: Good, tmp_path: Path) -> None:
    top = tmp_path / tiny_archive.name
    for rel, data in files_of(tiny_archive).items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_bytes(data)
    for schema, member in (("provenance", STATEMENT), ("intoto-statement", STATEMENT), ("ro-crate-metadata", CRATE)):
        done = _check_jsonschema(top / "schemas" / f"{schema}.schema.json", top / member)
        assert done.returncode == 0, f"{schema}: {done.stdout}{done.stderr}"
    predicate = tmp_path / "predicate.json"  # the SLSA predicate's own schema, on the predicate alone
    jsonio.write_json(predicate, doc(tiny_archive, STATEMENT)["predicate"])
    assert _check_jsonschema(top / "schemas" / "slsa-provenance.schema.json", predicate).returncode == 0
    statement = doc(tiny_archive, STATEMENT)  # negative controls: the same validator refuses, naming the field
    statement["predicateType"] = "https://slsa.dev/provenance/v0.2"
    bad = tmp_path / "bad.intoto.json"
    jsonio.write_json(bad, statement)
    done = _check_jsonschema(top / "schemas" / "provenance.schema.json", bad)
    assert done.returncode == 1 and "predicateType" in done.stdout, done.stdout + done.stderr
    described = doc(tiny_archive, CRATE)
    described["@graph"] = [e for e in described["@graph"] if e["@id"] != CRATE]
    jsonio.write_json(bad, described)
    done = _check_jsonschema(top / "schemas" / "ro-crate-metadata.schema.json", bad)
    assert done.returncode == 1 and "@graph" in done.stdout, done.stdout + done.stderr


# ---------------------------------------------------------------- SOURCE_DATE_EPOCH
def _members(path: Path) -> dict[str, tuple[tarfile.TarInfo, bytes | None]]:
    with tarfile.open(path) as tar:
        return {m.name: (m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()}  # type: ignore[union-attr]


def test_the_archive_rebuilds_byte_for_byte_under_one_epoch_and_differs_only_in_its_times_under_another(
        tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = tiny_run.name

    def build(when: int, where: str) -> Path:
        monkeypatch.setenv("SOURCE_DATE_EPOCH", str(when))
        out = tmp_path / where / f"{name}.tar.gz"
        assert pack(tiny_run, out) == 0
        return out

    first, again, later = build(1700000000, "a"), build(1700000000, "b"), build(1800000001, "c")
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes() != later.read_bytes()
    for path, when in ((first, 1700000000), (later, 1800000001)):
        raw = path.read_bytes()
        assert struct.unpack("<I", raw[4:8])[0] == when  # the gzip header's mtime
        assert {m.mtime for m, _ in _members(path).values()} == {when}  # every member's
    a, c = _members(first), _members(later)
    assert list(a) == list(c)
    differ = {n[len(name) + 1:] for n in a if a[n][1] != c[n][1]}
    assert differ == {CRATE, STATEMENT, SUMS}
    assert all((a[n][0].mode, a[n][0].size, a[n][0].type) == (c[n][0].mode, c[n][0].size, c[n][0].type)
               for n in a if n[len(name) + 1:] not in differ)
    times = {epoch.rfc3339(1700000000): epoch.rfc3339(1800000001)}
    crate_a, crate_c = (jsonio.loads(m[f"{name}/{CRATE}"][1].decode()) for m in (a, c))  # type: ignore[union-attr]
    assert crate_a["@graph"][0]["datePublished"] == "2023-11-14T22:13:20Z"
    crate_a["@graph"][0]["datePublished"] = times[crate_a["@graph"][0]["datePublished"]]
    assert crate_a == crate_c  # the crate differs in its date alone
    st_a, st_c = (jsonio.loads(m[f"{name}/{STATEMENT}"][1].decode()) for m in (a, c))  # type: ignore[union-attr]
    metadata = st_a["predicate"]["runDetails"]["metadata"]
    assert metadata["startedOn"] == metadata["finishedOn"] == "2023-11-14T22:13:20Z"
    metadata["startedOn"] = metadata["finishedOn"] = times[metadata["startedOn"]]
    st_a["predicate"]["buildDefinition"]["externalParameters"]["sourceDateEpoch"] = 1800000001
    for subject in st_a["subject"]:  # the crate's digest follows its date
        if subject["name"] == CRATE:
            subject["digest"]["sha256"] = jsonio.sha256_bytes(c[f"{name}/{CRATE}"][1])  # type: ignore[arg-type]
    assert st_a == st_c  # the statement differs in its times and the crate's digest alone
    sums_a, sums_c = (set(m[f"{name}/{SUMS}"][1].decode().splitlines()) for m in (a, c))  # type: ignore[union-attr]
    assert {line.split("  ", 1)[1] for line in sums_a ^ sums_c} == {CRATE, STATEMENT}


def test_two_processes_with_other_hash_seeds_write_the_same_archive(tiny_run: Path, tmp_path: Path) -> None:
    """Nothing of one interpreter (set order under its hash seed, a random id of the crate library) reaches
    the bytes: the archive verb in two fresh processes, under two hash seeds, writes the same archive."""

    outs = []
    for seed in ("1", "2"):
        out = tmp_path / seed / f"{tiny_run.name}.tar.gz"
        argv = [sys.executable, "-m", "rl_engine", *archive_argv(tiny_run, out)]
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO), "SOURCE_DATE_EPOCH": "1700000000"}
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


@pytest.mark.parametrize("value", ["", "1.5", "-1", "0x10", "017", " 1", "4294967296", "1e9", "١٢"])
def test_a_malformed_source_date_epoch_is_refused_before_anything_is_written(
        tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        value: str) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", value)
    out = tmp_path / f"{tiny_run.name}.tar.gz"
    out.write_bytes(b"stale")
    assert pack(tiny_run, out) == 1
    err = capsys.readouterr().err
    assert f"SOURCE_DATE_EPOCH={value!r} is not a time an archive can record" in err, err
    assert "from 0 to 4294967295" in err and "unset it for the default 0 (1970-01-01T00:00:00Z)" in err
    assert not out.exists() and not out.with_name(out.name + ".sha256").exists()
    problems = archive_problems({"SOURCE_DATE_EPOCH": value})  # the workflow says so when it is parsed
    assert problems and f"SOURCE_DATE_EPOCH={value!r}" in problems[0]


def test_the_workflow_refuses_a_bad_epoch_when_it_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``workflow/Snakefile`` calls before any job: a bad time would otherwise fail the archive at the end."""
    from rl_engine.workflow.config import WorkflowConfigError, check_workflow_config, load_config

    config = load_config(REPO / "config.yaml")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "soon")
    with pytest.raises(WorkflowConfigError, match=r"SOURCE_DATE_EPOCH='soon' is not a time an archive can record"):
        check_workflow_config(config)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert check_workflow_config(config) is config  # control


def test_source_date_epoch_unit() -> None:
    assert epoch.source_date_epoch({}) == epoch.DEFAULT_EPOCH == 0
    assert epoch.source_date_epoch({"SOURCE_DATE_EPOCH": "0"}) == 0
    assert epoch.source_date_epoch({"SOURCE_DATE_EPOCH": "4294967295"}) == epoch.MAX_EPOCH
    assert epoch.rfc3339(0) == "1970-01-01T00:00:00Z" and epoch.rfc3339(1700000000) == "2023-11-14T22:13:20Z"
    assert archive_problems({"SOURCE_DATE_EPOCH": "1700000000"}) == []


@pytest.mark.parametrize(("module", "extra_message"), [
    ("in_toto_attestation", "is written with the in-toto-attestation package"),
    ("rocrate", "is written with ro-crate-py (rocrate)"),
])
def test_the_archive_refuses_without_the_provenance_extra_naming_it(
        tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        module: str, extra_message: str) -> None:
    for loaded in [m for m in sys.modules if m == module or m.startswith(f"{module}.")] or [module]:
        monkeypatch.setitem(sys.modules, loaded, None)  # as if not installed
    out = tmp_path / f"{tiny_run.name}.tar.gz"
    assert pack(tiny_run, out) == 1
    err = capsys.readouterr().err
    assert extra_message in err and "pip install -e '.[provenance]'" in err, err
    assert not out.exists()


# ---------------------------------------------------------------- the crate's stages are the rules'
SELECTORS: dict[str, tuple[str, int | None]] = {
    "CAPTURE_COPY": ("capture", None), "PARITY_OUTPUTS": ("parity", None), "STAGE_LOGS": ("logs", None),
    "SCHEMAS": ("schemas", None), '"docs/arithmetic.md"': ("spec", None), "WORKFLOW_FILES": ("workflow", None),
}
EXTERNAL = re.compile(r'^(SOURCES|config\[.*|PARITY\[.*|list\(dict\.fromkeys\(.*)$')  # not files of the run


def rule_blocks() -> dict[str, str]:
    found: dict[str, str] = {}
    for smk in sorted(RULES.glob("*.smk")):
        parts = re.split(r"^rule (\w+):\n", smk.read_text(encoding="utf-8"), flags=re.M)
        found.update(dict(zip(parts[1::2], parts[2::2])))
    return found


def declared_inputs(block: str) -> set[tuple[str, int | None]]:
    """A rule's ``input:`` entries as :data:`rl_engine.evidence.crate.STAGE_INPUTS` selectors."""
    match = re.search(r"^    input:\n((?:        .*\n)+)", block, flags=re.M)
    if match is None:
        return set()
    found: set[tuple[str, int | None]] = set()
    names = set()
    for line in match.group(1).splitlines():
        if line.strip().startswith("#"):
            continue
        expr = line.strip().rstrip(",").split("=", 1)[-1]
        if m := re.fullmatch(r'stage_output\("(\w+)"(?:, (\d+))?\)', expr):
            found.add((m.group(1), int(m.group(2) or 0)))
        elif m := re.fullmatch(r'\[str\(p\) for p in STAGE_OF\["(\w+)"\]\.outputs\]', expr):
            found.add((m.group(1), None))
        elif expr in ("REPORTS", "TENSORS"):
            names.add(expr)
        elif expr in SELECTORS:
            found.add(SELECTORS[expr])
        else:
            assert EXTERNAL.match(expr), f"unknown input expression {expr!r}: map it here and in crate.STAGE_INPUTS"
    assert names in (set(), {"REPORTS", "TENSORS"}), names  # the reports travel with their tensors
    return found | ({("topology", None)} if names else set())


def test_the_crates_stage_inputs_are_the_rules_declared_inputs() -> None:
    blocks = rule_blocks()
    assert set(crate.STAGE_INPUTS) == set(blocks) - {"all", "sources", "verify_archive"}  # those lie outside the run
    for rule, block in blocks.items():
        if rule in crate.STAGE_INPUTS:
            assert set(crate.STAGE_INPUTS[rule]) == declared_inputs(block), rule
            assert f"python -m rl_engine {crate.RULE_VERBS[rule]} " in block, rule
    changed = blocks["crosscheck"].replace('stage_output("validation")', 'stage_output("summary")')
    assert declared_inputs(changed) != set(crate.STAGE_INPUTS["crosscheck"])  # negative control: the reader reads


def test_the_workflow_files_the_archive_packs_are_the_ones_it_runs(tiny_archive: Good) -> None:
    packed = {rel: data for rel, data in files_of(tiny_archive).items() if rel.startswith("workflow/")}
    expected = {f"workflow/{p.relative_to(REPO / 'workflow').as_posix()}": p.read_bytes()
                for p in [REPO / "workflow" / "Snakefile", *sorted(RULES.glob("*.smk"))]}
    assert packed == expected


def test_the_archive_refuses_workflow_files_that_are_not_the_snakefile_and_its_rules(tiny_run: Path,
                                                                                      tmp_path: Path) -> None:
    from rl_engine.evidence.archive import ArchiveError, given_workflow

    snakefile = REPO / "workflow" / "Snakefile"
    with pytest.raises(ArchiveError, match="names 0 files called Snakefile"):
        given_workflow([RULES / "plan.smk"])
    with pytest.raises(ArchiveError, match="is neither the Snakefile nor a rules/<name>.smk file beside it"):
        given_workflow([snakefile, REPO / "config.yaml"])
    elsewhere = tmp_path / "rules" / "plan.smk"
    elsewhere.parent.mkdir()
    shutil.copy(RULES / "plan.smk", elsewhere)
    with pytest.raises(ArchiveError, match="is neither the Snakefile nor"):
        given_workflow([snakefile, elsewhere])
    assert [rel for rel, _ in given_workflow([snakefile, RULES / "plan.smk"])] == ["workflow/Snakefile",
                                                                                  "workflow/rules/plan.smk"]


def test_gzip_header_carries_the_epoch_and_members_their_mtime() -> None:
    from rl_engine.evidence.archive import tar_gz_bytes

    data = tar_gz_bytes("N", [("a.txt", b"1")], mtime=1234567890)
    assert struct.unpack("<I", data[4:8])[0] == 1234567890
    assert gzip.decompress(data)[136:147] == b"%011o" % 1234567890  # ustar's mtime field of the first member
