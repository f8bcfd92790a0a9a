"""A campaign on a captured file (case ``capture``): the case's parse-time rules, and (slow) one
end-to-end run shared by most slow tests: docs/capture.md's worked example through ``snakemake``
(a dry run, then the real run) on a tiny capture whose prompts have 2 and 5 tokens, at 1x1 and 2x2,
with ``inputs.archive: true`` and a parity stage. Its run and archive give: identical fingerprints at
1x1 and 2x2 (TP and CP sharding both; more topologies' bytes on a capture:
tests/test_capture_shards.py) from ranks that each read only their tokens and columns, the capture's
SHA-256 and metadata in every report, each report's ``active_mask`` (the ragged mask, not
``prompt_tokens``' rule), a rank that refuses a file whose bytes are not the recorded ones; the
recompute and replay rows from ``--capture``, from the archived copy, from neither and from a wrong
file; an archive holding the capture and a parity report that ``verify --recompute`` passes without
``--capture``, and refuses without the capture member, or with other bytes in it, naming the file and
the hash. The capture's path is not part of the run name; rank 0 hashes the capture once; the
``parity:`` section of config.yaml is checked before any job.

A second, smaller campaign (1x1 and 2x1) runs the real verbs in this process on captures whose
metadata and directory hold HTML and markup (paths the workflow's config check refuses), its ranks
the runner a torchrun rank calls, on forked gloo processes (the torchrun launch of a capture case is
the snakemake run's): its SUMMARY.md shows them as text, and its archive (the capture not in it)
verifies."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rl_engine import cli, schemas
from rl_engine.campaign.captured import capture_record, check_file
from rl_engine.campaign.case import Case, CaseError, case_document, write_case_file
from rl_engine.capture import CaptureError

from _capture_case import CASE_FIELDS, capture_case, write_tiny_capture
from _capture_case import launch_topology as _launch
from _capture_case import verify_archive as _verify

TOPOLOGIES = ("1x1", "2x2")
FIELDS = ("candidate_logp_sha256", "candidate_lse_sha256", "candidate_entropy_sha256",
          "candidate_grad_sha256")


def test_a_capture_case_records_the_file_and_its_id_names_the_hash(tmp_path: Path) -> None:
    path = write_tiny_capture(tmp_path / "cap.safetensors")
    case = capture_case(path)
    record = case.to_dict()["capture"]
    assert record["sha256"] == capture_record(path)["sha256"] and record["size"] == path.stat().st_size
    assert record["metadata"]["engine"] == "test" and record["tokens"] == 16 and record["vocab"] == 64
    assert case.case_id.endswith("-capture" + record["sha256"][:16])
    assert schemas.errors(case_document(case, ((1, 1), (2, 1))), "case") == []
    # negative control: a recipe case has no capture key, so its case file and hash are unchanged
    recipe = Case.create(**CASE_FIELDS)
    assert "capture" not in recipe.to_dict() and "capture" not in recipe.case_id


@pytest.mark.parametrize("change, named", [
    ({"dtype": "fp32"}, "dtype='fp32' must be the logits dtype 'bf16'"),
    ({"batch": 4}, "batch * seq = 4 * 8 = 32 must be the 16 tokens"),
    ({"real_vocab": 60}, "real_vocab=60 must be the vocab 64"),
    ({"padded_vocab": 128, "num_vocab_tiles": 4}, "padded_vocab=128 must be the vocab 64"),
])
def test_a_case_that_disagrees_with_its_capture_is_refused_naming_key_value_and_fix(
        tmp_path: Path, change: dict, named: str) -> None:
    path = write_tiny_capture(tmp_path / "cap.safetensors")
    with pytest.raises(CaseError, match="set ") as info:
        capture_case(path, **change)
    assert named in str(info.value)


def test_a_missing_or_malformed_capture_is_refused_at_parse_time(tmp_path: Path) -> None:
    with pytest.raises(CaptureError, match="no such file"):
        capture_record(tmp_path / "absent.safetensors")
    path = write_tiny_capture(tmp_path / "cap.safetensors")
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-100])
    with pytest.raises(CaptureError, match="truncated"):
        capture_record(tmp_path / "cut.safetensors")


def test_check_file_refuses_other_bytes_naming_the_recorded_hash(tmp_path: Path) -> None:
    path = write_tiny_capture(tmp_path / "cap.safetensors")
    record = capture_record(path)
    assert check_file(record) == path.resolve()
    other = write_tiny_capture(tmp_path / "other.safetensors", seed=6)  # same size, other values
    with pytest.raises(CaptureError, match=f"not that of the case's capture \\(sha256 {record['sha256']}"):
        check_file(record, other)


def _campaign(run_dir: Path, path: Path, topologies: tuple[str, ...], archive: bool) -> dict[str, dict]:
    """The case (``inputs.archive: archive``) of the capture at ``path``, planned and every topology run by
    the ranks' own runner on gloo processes forked from one that imported torch (tests/_multiproc.py):
    the ``launch`` verb's torchrun on a capture case is the module's snakemake run's (``capture_workflow``)."""
    from _evidence_run import run_forked

    (run_dir / "logs").mkdir(parents=True)
    write_case_file(run_dir / "case.json", capture_case(path, archive=archive),
                    tuple(tuple(int(x) for x in t.split("x")) for t in topologies))
    assert cli.main(["plan", "--case", str(run_dir / "case.json"), "--output", str(run_dir / "plan.json")]) == 0
    reports = {}
    for topology in topologies:
        run_forked(run_dir / "plan.json", topology)
        tp, cp = topology.split("x")
        reports[topology] = json.loads((run_dir / f"tp{tp}-cp{cp}.json").read_text())
    return reports


@dataclass(frozen=True)
class WorkflowRun:
    """The module's one end-to-end run: docs/capture.md's worked example through ``snakemake`` (a dry run,
    then the real run) on a tiny capture whose prompts have 2 and 5 tokens (``prompt_tokens: 3`` shapes
    nothing on a capture), over :data:`TOPOLOGIES`, with ``inputs.archive: true`` and a parity stage
    against a trainer side of the same tokens. Its run directory and archive are what the matrix, the
    replay, the archive and the ragged-prompt tests read (each restores what it changes)."""

    repo: Path
    planned: str  # the dry run's console
    done: str  # the real run's console
    name: str  # the run name
    rollout: Path
    trainer: Path
    capture: Any  # the rollout's Capture (its mask is the ragged one)

    @property
    def run(self) -> Path:
        return self.repo / "results" / self.name

    @property
    def archive(self) -> Path:
        return self.repo / "results" / f"{self.name}.tar.gz"


@pytest.fixture(scope="module")
def capture_workflow(tmp_path_factory: pytest.TempPathFactory) -> WorkflowRun:
    from rl_engine.capture import write_capture

    from _capture_case import ragged_capture, write_trainer_side
    from _workflow_util import SHORT_REGRESSION, copy_repo, run_name_of, snakemake, write_config

    repo = copy_repo(tmp_path_factory.mktemp("capture-workflow"))
    capture = ragged_capture((2, 5))
    rollout = repo / "rollout.safetensors"
    write_capture(rollout, capture)
    trainer = write_trainer_side(repo / "trainer.safetensors", rollout=capture)
    write_config(repo, {**{k: v for k, v in CASE_FIELDS.items() if k not in ("device", "backend", "seed")},
                        "regression": SHORT_REGRESSION, "topologies": list(TOPOLOGIES),
                        "inputs": {"capture": "rollout.safetensors", "archive": True},
                        "parity": {"rollout": "rollout.safetensors", "trainer": "trainer.safetensors",
                                   "ratio_bounds": [0.5, 2.0]}})
    planned = snakemake(repo, "-n", "-p")
    assert planned.returncode == 0, (planned.stdout + planned.stderr)[-6000:]
    assert list((repo / "results").iterdir()) == []  # a dry run writes nothing
    done = snakemake(repo)
    assert done.returncode == 0, (done.stdout + done.stderr)[-8000:]
    with pytest.MonkeyPatch.context() as env:
        env.chdir(repo)  # the config's capture paths are relative to the workflow's directory
        name = run_name_of(repo)
    return WorkflowRun(repo, planned.stdout + planned.stderr, done.stdout + done.stderr, name, rollout, trainer,
                       capture)


def _other_bytes(path: Path) -> Path:
    """A capture of the workflow's shape, mask and size with other logits (another seed): another hash."""
    from rl_engine.capture import write_capture

    from _capture_case import ragged_capture

    write_capture(path, ragged_capture((2, 5), seed=6))
    return path


@pytest.fixture(scope="module")
def reviewed(capture_workflow: WorkflowRun, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, dict]]:
    """The reviewer's ``verify --recompute`` of the workflow's archive (the verb in this process), no
    ``--capture`` given: the replay reads the archived capture."""
    return _verify(capture_workflow.archive, tmp_path_factory.mktemp("reviewer"), "--recompute")


@pytest.fixture(scope="module")
def capture_run(capture_workflow: WorkflowRun) -> tuple[Path, Path, dict[str, dict]]:
    """The workflow's run directory, its capture, and each topology's report."""
    run = capture_workflow.run
    reports = {t: json.loads((run / "tp{}-cp{}.json".format(*t.split("x"))).read_text()) for t in TOPOLOGIES}
    return run, capture_workflow.rollout, reports


@pytest.mark.slow
def test_a_capture_and_parity_config_runs_through_snakemake_to_a_verified_archive(
        capture_workflow: WorkflowRun, reviewed: tuple[int, dict[str, dict]], tmp_path: Path) -> None:
    """End to end, the workflow of docs/capture.md's worked example on a tiny capture: the dry
    run plans the ``capture`` and ``parity`` stages and writes nothing; the real run copies the
    capture, writes the parity report (the sides differ: a finding, the stage passes), packs both
    into an archive its own ``verify_archive`` job passes, and the reviewer's ``verify --recompute``
    replays it (the verb in this process) from the archived capture, no ``--capture`` given;
    ``snakemake --lint`` of this config (every rule, the capture and parity stages included) is
    clean: tests/test_gates_config.py::test_snakemake_lint_is_clean.
    The negative control (the good config plans neither stage) is
    tests/test_gates_config.py::test_snakemake_dry_run_of_a_good_config_plans_every_job."""
    import tarfile

    from rl_engine import jsonio
    from rl_engine.rundir import CAPTURE, PARITY_JSON, PARITY_PNG, SUMMARY

    from _workflow_util import html_report, jobs_run

    wf = capture_workflow
    text = wf.planned
    counts = jobs_run(text)
    assert counts.get("capture") == 1 and counts.get("parity") == 1 and counts.get("topology") == 2, counts
    parity_line = next(line for line in text.splitlines() if "rl_engine parity" in line)
    assert "--ratio-bounds 0.5 2.0" in parity_line and "--difference-exit-code 0 > " in parity_line
    archive_line = next(line for line in text.splitlines() if "rl_engine archive" in line)
    assert "/capture.safetensors" in archive_line and "/parity.json" in archive_line
    assert "/logs/parity.log" in archive_line and "copy-capture --case" in text

    assert jobs_run(wf.done).get("capture") == 1 and jobs_run(wf.done).get("parity") == 1, jobs_run(wf.done)
    name, run, archive = wf.name, wf.run, wf.archive
    assert jsonio.load(wf.repo / "results" / f"{name}.verify.json")["passed"] is True  # the workflow's own verify
    assert (run / CAPTURE).read_bytes() == wf.rollout.read_bytes()
    parity = jsonio.load(run / PARITY_JSON)
    assert parity["verdict"] == "different" and parity["logits"]["tokens_differing"] > 0
    assert "## Parity: rollout versus trainer" in (run / SUMMARY).read_text()
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {f"{name}/{CAPTURE}", f"{name}/{PARITY_JSON}", f"{name}/{PARITY_PNG}", f"{name}/logs/parity.log"} <= names
    code, checks = reviewed  # the archived capture: no --capture
    assert code == 0, {n: c["problems"] for n, c in checks.items() if c["status"] == "FAIL"}
    assert checks["inputs regenerated"]["status"] == checks["candidate replayed"]["status"] == "PASS", checks

    # the HTML report embeds parity.png, labelled with the counts of parity.json
    results, _ = html_report(wf.repo, tmp_path / "report.html")
    figure = results[f"results/{name}/{PARITY_PNG}"]
    assert figure["data"] == (run / PARITY_PNG).read_bytes() and figure["mime_type"] == "image/png"
    active = parity["targets_and_mask"]["active_tokens"]
    assert figure["labels"]["Parity"] == "different" and figure["labels"]["Active tokens"] == str(active)
    assert figure["labels"]["Ratio outside bounds"] == f"{parity['importance_ratio']['ours']['outside_bounds']} of {active}"


@pytest.mark.slow
def test_the_matrix_on_a_capture_gives_identical_fingerprints_and_records_the_capture(capture_run) -> None:
    _, path, reports = capture_run
    record = capture_record(path, archive=True)
    for topology, report in reports.items():
        assert report["passed"], (topology, report["failures"])
        assert report["case"]["capture"] == record
        assert report["case_id"].endswith(record["sha256"][:16])
    for field in FIELDS:
        assert len({r["bitwise_fingerprints"][field] for r in reports.values()}) == 1, field
    for topology in ("2x2",):
        for rank in reports[topology]["topology"]["ranks"]:
            lo, hi = rank["vocab_bounds"]
            assert hi - lo == 32  # each TP rank held its 32 of the 64 columns only


def _capture_config(path: Path, **changes: object) -> dict:
    import yaml

    config = yaml.safe_load((Path(__file__).parents[1] / "config.yaml").read_text())
    config.update({"dtype": "bf16", "real_vocab": 64, "padded_vocab": 64, "num_vocab_tiles": 4,
                   "batch": 2, "seq": 8, "prompt_tokens": 3, "topologies": ["1x1", "2x1"],
                   "inputs": {"capture": str(path)}})
    config.update(changes)
    return config


def test_the_workflow_config_names_a_capture_and_the_case_file_carries_it(tmp_path: Path) -> None:
    from rl_engine.workflow import check_config, config_case

    path = write_tiny_capture(tmp_path / "cap.safetensors")
    config = check_config(_capture_config(path))
    document = config_case(config)
    assert document["case"]["capture"] == capture_record(path)
    # negative control: the default config (no inputs key) keeps the recipe
    import yaml
    default = check_config(yaml.safe_load((Path(__file__).parents[1] / "config.yaml").read_text()))
    assert "capture" not in config_case(default)["case"]


@pytest.mark.parametrize("change, named", [
    ({"dtype": "fp16"}, "config key 'inputs.capture' has value"),
    ({"seq": 4}, "batch * seq = 2 * 4 = 8 must be the 16 tokens"),
    ({"inputs": {"capture": "absent.safetensors"}}, "no such file"),
    ({"inputs": {"capture": "x", "archive": "yes"}}, "inputs.archive"),
])
def test_the_workflow_config_refuses_a_capture_that_disagrees_or_is_absent(
        tmp_path: Path, change: dict, named: str) -> None:
    from rl_engine.workflow import WorkflowConfigError, check_config

    path = write_tiny_capture(tmp_path / "cap.safetensors")
    with pytest.raises(WorkflowConfigError) as info:
        check_config(_capture_config(path, **change))
    assert named in str(info.value)


def test_summary_inputs_line_records_the_capture_hash_and_metadata(tmp_path: Path) -> None:
    from rl_engine.evidence.summary import inputs_text

    path = write_tiny_capture(tmp_path / "cap.safetensors")
    case = capture_case(path).to_dict()
    text = inputs_text(case)
    assert case["capture"]["sha256"] in text and "engine `test`" in text and "model `seeded-randn`" in text
    assert "input recipe" in inputs_text(Case.create(**CASE_FIELDS).to_dict())


@pytest.mark.slow
def test_verify_recompute_replays_a_capture_campaign_from_capture_or_the_archived_copy(
        capture_run, tmp_path: Path) -> None:
    import shutil

    from rl_engine.evidence.verify import recompute, replay
    from rl_engine.rundir import CAPTURE, Run

    run_dir, path, _ = capture_run
    run = Run.load(run_dir)
    sha = capture_record(path)["sha256"]
    aside = tmp_path / CAPTURE
    shutil.move(run_dir / CAPTURE, aside)  # the workflow's copy, back in place below
    try:
        # --capture PATH: every topology's bytes and fingerprints replayed, drift recomputed
        given = [*recompute(run, capture=path), replay(run, capture=path)]
        assert all(c.passed for c in given), [(c.name, c.problems) for c in given]
        # neither --capture nor an archived copy: refused, naming the file and its hash
        neither = [*recompute(run), replay(run)]
        assert all(c.passed is False for c in neither), [(c.name, c.passed, c.problems) for c in neither]
        named = [neither[0], neither[2]]  # inputs regenerated, candidate replayed (drift: "no inputs")
        assert all(sha in " ".join(c.problems) and str(path) in " ".join(c.problems) for c in named)
        assert "drift not recomputed: no inputs" in " ".join(neither[1].problems)
        assert "pass --capture PATH" in " ".join(neither[0].problems)
        # a file with another hash: refused, naming the recorded hash
        other = _other_bytes(tmp_path / "other.safetensors")
        wrong = [*recompute(run, capture=other), replay(run, capture=other)]
        assert all(c.passed is False for c in wrong)
        assert all(f"not that of the case's capture (sha256 {sha}" in " ".join(c.problems) for c in (wrong[0], wrong[2]))
        # the archive's own copy (inputs.archive: true) is what a replay without --capture reads
        shutil.copyfile(aside, run_dir / CAPTURE)
        archived = [*recompute(run), replay(run)]
        assert all(c.passed for c in archived), [(c.name, c.problems) for c in archived]
    finally:
        if not (run_dir / CAPTURE).exists():
            shutil.copyfile(aside, run_dir / CAPTURE)


@pytest.mark.slow
def test_a_rank_refuses_a_capture_whose_bytes_changed_after_the_plan(
        capture_run, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir, path, _ = capture_run
    monkeypatch.chdir(run_dir.parents[1])  # the workflow wrote the plan from its directory, naming it relatively
    original = path.read_bytes()
    kept = {p: p.read_bytes() for p in [*run_dir.glob("tp1-cp1.*"), run_dir / "logs" / "tp1-cp1.log"]}  # the refused
    # run removes the report and tensors and writes the log: all archived, restored below
    try:
        _other_bytes(path)  # the same shape and size, other logits: another hash
        report = run_dir / "tp1-cp1.json"
        assert _launch(run_dir.relative_to(run_dir.parents[1]) / "plan.json", "1x1") == 2
        assert not report.exists()  # refused before any collective: no report left
        assert "has sha256" in (run_dir / "logs" / "tp1-cp1.log").read_text(errors="replace")
    finally:
        path.write_bytes(original)
        for kept_path, data in kept.items():
            kept_path.write_bytes(data)


# ----- the capture's path is not the case's identity ---------------------------------
def test_the_capture_path_is_recorded_but_the_same_bytes_elsewhere_are_the_same_run(tmp_path: Path) -> None:
    import shutil

    from rl_engine.workflow import check_config, config_case, config_case_hash

    first = write_tiny_capture(tmp_path / "cap.safetensors")
    (tmp_path / "moved").mkdir()
    moved = Path(shutil.copy(first, tmp_path / "moved" / "renamed.safetensors"))
    one, two = check_config(_capture_config(first)), check_config(_capture_config(moved))
    assert config_case(one)["case"]["capture"]["path"] == str(first.resolve())  # recorded, for information
    assert config_case(two)["case"]["capture"]["path"] == str(moved.resolve())
    assert config_case_hash(one) == config_case_hash(two)
    # negative controls: other bytes, or the archive holding the file, are another run
    other = write_tiny_capture(tmp_path / "other.safetensors", seed=6)
    assert config_case_hash(check_config(_capture_config(other))) != config_case_hash(one)
    archived = check_config(_capture_config(first, inputs={"capture": str(first), "archive": True}))
    assert config_case_hash(archived) != config_case_hash(one)


def _parity_config(tmp_path: Path, **section: object) -> dict:
    from _capture_case import write_trainer_side

    rollout = write_tiny_capture(tmp_path / "rollout.safetensors")
    trainer = write_trainer_side(tmp_path / "trainer.safetensors")
    return _capture_config(rollout, parity={"rollout": str(rollout), "trainer": str(trainer), **section})


def test_a_parity_section_is_a_stage_named_by_its_captures_hashes_and_absent_changes_nothing(tmp_path: Path) -> None:
    import shutil

    import yaml

    from rl_engine.campaign.case import case_hash
    from rl_engine.workflow import case_values, check_config, config_case_hash, stage_flags

    config = check_config(_parity_config(tmp_path))
    assert stage_flags(config) == {"capture": False, "parity": True}
    without = dict(config)
    del without["parity"]
    assert config_case_hash(config) != config_case_hash(without)
    # the same captures at other paths: the same run
    (tmp_path / "elsewhere").mkdir()
    moved = {side: str(shutil.copy(config["parity"][side], tmp_path / "elsewhere" / f"{side}.st"))
             for side in ("rollout", "trainer")}
    assert config_case_hash(check_config({**config, "parity": moved})) == config_case_hash(config)
    assert config_case_hash(check_config({**config, "parity": {**moved, "ratio_bounds": [0.5, 2]}})) \
        != config_case_hash(config)
    # no parity section: no stage, and the case hash is the one of the resolved case without a parity key
    default = check_config(yaml.safe_load((Path(__file__).parents[1] / "config.yaml").read_text()))
    assert stage_flags(default) == {"capture": False, "parity": False}
    regression = default["regression"]
    assert config_case_hash(default) == case_hash(case_values(default), default["topologies"],
                                                  regression["tests"], regression["pytest_args"])


@pytest.mark.parametrize("change, named", [
    ({"rollout": "absent.safetensors"}, "config key 'parity.rollout' has value 'absent.safetensors': no such file"),
    ({"rolout": "x"}, "unknown config key(s) ['rolout'] under 'parity'; did you mean 'rollout' for 'rolout'?"),
    ({"ratio_bounds": [1.2, 0.8]}, "--ratio-bounds=1.2 0.8 must be finite with 0 < LOW < 1 < HIGH"),
    ({"num_vocab_tiles": 3}, "num_vocab_tiles: num_vocab_tiles=3 does not divide padded_vocab=64"),
    ({"backend": "triton-vocab-parallel-logp-ws2"}, "must be a backend registered for the cpu"),
    ({"trainer": "OTHER"}, "tensor targets differs at token"),
])
def test_a_bad_parity_section_is_refused_before_any_job_naming_key_value_and_fix(
        tmp_path: Path, change: dict, named: str) -> None:
    from rl_engine.workflow import WorkflowConfigError, check_config

    config = _parity_config(tmp_path)
    if change.get("trainer") == "OTHER":  # same shape, other targets
        change = {"trainer": str(write_tiny_capture(tmp_path / "other.safetensors", seed=6))}
    config["parity"].update(change)
    with pytest.raises(WorkflowConfigError) as info:
        check_config(config)
    assert named in str(info.value), str(info.value)
    assert "fix" in str(info.value) or "remove or rename" in str(info.value)


@pytest.mark.parametrize("key", ["parity.rollout", "parity.trainer", "inputs.capture", "regression.tests"])
@pytest.mark.parametrize("name", ["</script><img src=x onerror=alert(1)>.safetensors", "cap\x1b]0;x\x07.safetensors",
                                  "cap\u202eorsnetefas.safetensors"], ids=["html", "escape-sequence", "bidi"])
def test_a_path_holding_html_or_control_characters_is_refused_by_check_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, name: str) -> None:
    """A path the config names with '<', '>' or a control character (before: ``caps/</script><img src=x
    onerror=...>.safetensors`` passed check-config and ``snakemake --report``'s HTML held a live
    ``<img onerror>``) is refused by ``python -m rl_engine check-config`` (exit 2), which is the check
    the Snakefile runs at parse time, before any job: the message names the key, the value, the
    character and the fix, though the file exists and is a good capture. Control: the same capture under
    a plain name passes."""
    import yaml

    from rl_engine.workflow.config import main

    folder = tmp_path / "caps"
    folder.mkdir()
    hostile = write_tiny_capture(folder / name)
    config = _parity_config(tmp_path)
    top, _, sub = key.partition(".")
    if top == "regression":
        config["regression"]["tests"] = [*config["regression"]["tests"], f"tests/{name}"]
    else:
        config[top][sub] = str(hostile)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    shown_key = f"{key}[{len(config['regression']['tests']) - 1}]" if top == "regression" else key
    bad = next(ch for ch in name if ch in "<>" or ord(ch) < 0x20 or 0x202a <= ord(ch) <= 0x202e)
    assert f"config key {shown_key!r} has value " in err and f"the path holds {bad!r} (U+{ord(bad):04X})" in err, err
    assert "rename the file, or link it, to a name without them; fix the value in config.yaml" in err
    clean = _parity_config(tmp_path / "clean")
    path.write_text(yaml.safe_dump(clean), encoding="utf-8")
    assert main([str(path)]) == 0, capsys.readouterr().err


# ----- rank 0 hashes the capture once ------------------------------------------------------------
def _hashes_of_one_rank(rank: int, plan: str, tp: int, cp: int) -> tuple[int, list[str]]:
    """One rank of ``tp x cp`` in this worker process, counting every time the capture is hashed."""
    from rl_engine.campaign import captured, run

    hashed: list[str] = []
    real = captured._hash_stream

    def counting(handle: object) -> str:
        hashed.append(str(getattr(handle, "name", "?")))
        return real(handle)

    captured._hash_stream = counting
    return run.run_topology(plan, tp, cp), hashed


def test_each_rank_hashes_the_capture_once_and_a_rewritten_file_again(tmp_path: Path) -> None:
    from _multiproc import run_workers

    path = write_tiny_capture(tmp_path / "cap.safetensors")
    write_case_file(tmp_path / "case.json", capture_case(path), ((1, 1), (2, 1)))
    assert cli.main(["plan", "--case", str(tmp_path / "case.json"), "--output", str(tmp_path / "plan.json")]) == 0
    results = run_workers(_hashes_of_one_rank, 2, str(tmp_path / "plan.json"), 2, 1, timeout_s=120)
    assert [code for code, _ in results] == [0, 0]
    assert [len(hashed) for _, hashed in results] == [1, 1], results  # rank 0: its check, its oracle's read: one hash
    assert (tmp_path / "tp2-cp1.json").is_file()
    # negative control: the memory is of the file's identity; a rewritten file is hashed again
    from rl_engine.campaign import captured

    calls: list[str] = []
    real = captured._hash_stream
    record = capture_record(path)
    captured._HASHED.clear()
    try:
        captured._hash_stream = lambda handle: calls.append(handle.name) or real(handle)  # type: ignore[assignment]
        check_file(record)
        check_file(record)
        assert len(calls) == 1
        write_tiny_capture(path)  # the same bytes, a new file
        check_file(record)
        assert len(calls) == 2
    finally:
        captured._hash_stream = real  # type: ignore[assignment]


# ----- an archive that holds the capture (inputs.archive: true) and a parity report -------------
def _pack(run_dir: Path, output: Path, files: list[Path] | None = None) -> int:
    """The archive verb on ``files`` of the run directory (default: every file, all of them made by the
    verbs here)."""
    from _evidence_run import archive_argv

    files = sorted(p for p in run_dir.rglob("*") if p.is_file()) if files is None else files
    return cli.main(archive_argv(run_dir, output, files))


@pytest.fixture(scope="module")
def capture_archive(capture_workflow: WorkflowRun) -> dict[str, Path]:
    """The workflow's archive (with the capture and a parity report), its run, and both captures."""
    return {"archive": capture_workflow.archive, "run": capture_workflow.run, "capture": capture_workflow.rollout,
            "trainer": capture_workflow.trainer}


def _complete(run_dir: Path, base: Path, path: Path, trainer: Path, recorded_from: Path) -> dict[str, Path]:
    """A launched capture campaign in ``run_dir`` (:func:`_campaign` of ``path``) completed by the real
    verbs (``copy-capture`` where the case archives its capture), with a parity stage against
    ``trainer``, archived under its run name in ``base / "out"``. The environment and focused-suite
    files are the session's run ``recorded_from``'s (conftest's tiny run:
    :func:`_evidence_run.copy_recorded`): what they record is not the capture's."""
    from rl_engine import jsonio
    from rl_engine.campaign.casename import RunName, evidence_case_hash
    from rl_engine.rundir import CAPTURE

    from _evidence_run import copy_recorded

    if jsonio.load(run_dir / "case.json")["case"]["capture"].get("archive") is True:
        assert cli.main(["copy-capture", "--case", str(run_dir / "case.json"), "--output", str(run_dir / CAPTURE)]) == 0
    copy_recorded(recorded_from, run_dir)
    assert cli.main(["parity", str(path), str(trainer), "--output-dir", str(run_dir),
                     "--difference-exit-code", "0"]) == 0  # a difference: exit 0 as the workflow asks
    for verb, out in (("validate", "validation.json"), ("crosscheck", "crosscheck.json"), ("summary", "SUMMARY.md")):
        assert cli.main([verb, "--run-dir", str(run_dir), "--output", str(run_dir / out)]) == 0, verb
    git = jsonio.load(run_dir / "environment.json")["git"]
    digest = evidence_case_hash(jsonio.load(run_dir / "plan.json"), jsonio.load(run_dir / "regression.json"),
                                jsonio.load(run_dir / "parity.json"))
    name = RunName("capture", git.get("short_commit") or "nogit", git.get("dirty") is True, digest)
    archive = base / "out" / f"{name}.tar.gz"
    assert _pack(run_dir, archive) == 0
    return {"archive": archive, "run": run_dir, "capture": path, "trainer": trainer}


def _text(check: dict) -> str:
    return "\n".join([check["detail"], *check["problems"]])


def _rebuilt(capture_archive: dict[str, Path], tmp_path: Path, capture_bytes: bytes | None,
             edit: Any = None) -> Path:
    """The archive with its capture member replaced by ``capture_bytes`` (removed when None), each member
    passed through ``edit(name, data)`` when given, SHA256SUMS recomputed and a matching .sha256: only
    the checks of the capture itself can catch it."""
    import gzip
    import io
    import tarfile

    from rl_engine import jsonio
    from rl_engine.evidence import archive as archive_verb
    from rl_engine.rundir import CAPTURE, SUMS

    source = capture_archive["archive"]
    top = source.name[: -len(".tar.gz")]
    with tarfile.open(source) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]  # type: ignore[union-attr]
    files: dict[str, bytes | None] = {m.name: data for m, data in members}
    if capture_bytes is None:
        del files[f"{top}/{CAPTURE}"]
    else:
        files[f"{top}/{CAPTURE}"] = capture_bytes
    if edit is not None:
        files = {name: data if data is None else edit(name, data) for name, data in files.items()}
    sums = [(name[len(top) + 1:], data) for name, data in files.items() if data is not None and not name.endswith(SUMS)]
    files[f"{top}/{SUMS}"] = archive_verb.sums_text(sums).encode()
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0) as gz, tarfile.open(fileobj=gz, mode="w|") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.REGTYPE if data is not None else tarfile.DIRTYPE
            info.size, info.mode = (len(data), 0o644) if data is not None else (0, 0o755)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    out = tmp_path / "in" / source.name
    out.parent.mkdir()
    out.write_bytes(buffer.getvalue())
    out.with_name(out.name + ".sha256").write_text(f"{jsonio.sha256_bytes(buffer.getvalue())}  {out.name}\n")
    return out


@pytest.mark.slow
def test_an_archive_holding_the_capture_verifies_with_recompute_and_no_capture_flag(
        capture_archive: dict[str, Path], reviewed: tuple[int, dict[str, dict]], tmp_path: Path) -> None:
    import tarfile

    from rl_engine import jsonio
    from rl_engine.rundir import CAPTURE, PARITY_JSON, PARITY_PNG, SUMS

    archive, path = capture_archive["archive"], capture_archive["capture"]
    code, checks = reviewed  # verify --recompute, no --capture
    assert code == 0, {n: c["problems"] for n, c in checks.items() if c["status"] == "FAIL"}
    for name in ("run name", "SHA256SUMS", "archive members", "JSON schemas (shipped)", "report acceptance",
                 "SUMMARY.md", "inputs regenerated", "oracle drift recomputed", "candidate replayed"):
        assert checks[name]["status"] == "PASS", (name, checks[name])
    assert PARITY_JSON in checks["run name"]["detail"]  # the parity report is part of the run name
    top = archive.name[: -len(".tar.gz")]
    with tarfile.open(archive) as tar:
        held = tar.extractfile(f"{top}/{CAPTURE}").read()  # type: ignore[union-attr]
        sums = tar.extractfile(f"{top}/{SUMS}").read().decode()  # type: ignore[union-attr]
        names = tar.getnames()
    assert held == path.read_bytes()
    assert f"{capture_record(path)['sha256']}  {CAPTURE}\n" in sums
    assert {f"{top}/{PARITY_JSON}", f"{top}/{PARITY_PNG}"} <= set(names)
    # byte-reproducible: the run's files the workflow packed, packed again by the verb here, are the same archive
    again = tmp_path / "again" / archive.name
    packed = sorted(capture_archive["run"] / n[len(top) + 1:] for n in names
                    if (capture_archive["run"] / n[len(top) + 1:]).is_file())
    assert _pack(capture_archive["run"], again, packed) == 0
    assert again.read_bytes() == archive.read_bytes()
    # SUMMARY.md's parity section: its numbers are parity.json's
    summary = (capture_archive["run"] / "SUMMARY.md").read_text()
    parity = jsonio.load(capture_archive["run"] / PARITY_JSON)
    assert parity["verdict"] == "different" and "## Parity: rollout versus trainer" in summary
    logits = parity["logits"]
    assert (f"{logits['tokens_differing']} active tokens and {logits['columns_differing']} columns differ; "
            f"max abs {logits['max_abs_diff']!r}") in summary
    assert f"mean {parity['importance_ratio']['ours']['mean']!r}" in summary
    assert "the archive holds it (`inputs.archive: true`)" in summary


@pytest.mark.slow
def test_the_summary_reproduce_config_gives_the_run_name_of_the_archive(
        capture_archive: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml
    from snakemake.utils import update_config

    from rl_engine.workflow import config_case_hash

    text = (capture_archive["run"] / "SUMMARY.md").read_text()
    block = text.split("`reproduce.yaml` (over the repository's `config.yaml`", 1)[1].split("\n\n", 2)[1]
    reproduce = yaml.safe_load("\n".join(line[4:] for line in block.splitlines()))
    assert reproduce["inputs"] == {"capture": str(capture_archive["capture"].resolve()), "archive": True}
    assert reproduce["parity"]["trainer"] == capture_archive["trainer"].name  # as the workflow's config gave it
    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "config.yaml").read_text())
    update_config(config, reproduce)
    monkeypatch.chdir(capture_archive["run"].parents[1])  # the workflow's directory, where its config's paths are
    assert capture_archive["archive"].name.endswith(f"-case-{config_case_hash(config)}.tar.gz")


@pytest.mark.slow
def test_an_archive_without_its_capture_member_is_refused_naming_the_file_and_hash(
        capture_archive: dict[str, Path], tmp_path: Path) -> None:
    from rl_engine.rundir import CAPTURE

    sha = capture_record(capture_archive["capture"])["sha256"]
    path = _rebuilt(capture_archive, tmp_path, None)
    code, checks = _verify(path, tmp_path, "--recompute")
    assert code == 1 and checks["SHA256SUMS"]["status"] == "PASS"  # consistent sums: the capture checks catch it
    for name in ("report acceptance", "inputs regenerated", "candidate replayed"):
        assert checks[name]["status"] == "FAIL" and sha in _text(checks[name]), (name, checks[name])
    assert f"has no {CAPTURE}: the archive is incomplete" in _text(checks["inputs regenerated"])
    assert "pass --capture PATH" in _text(checks["inputs regenerated"])
    assert f"{CAPTURE}: (file): the case says the archive holds its capture" in _text(checks["report acceptance"])
    # negative control: given the file with --capture, the replay passes again
    code, checks = _verify(path, tmp_path, "--recompute", "--capture", str(capture_archive["capture"]))
    assert checks["inputs regenerated"]["status"] == "PASS" and checks["candidate replayed"]["status"] == "PASS"


@pytest.mark.slow
def test_an_archived_capture_larger_than_its_case_is_bounded_before_any_tensor_is_read(
        capture_archive: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forged archive whose capture (and its record, rewritten to match the file) holds 128 times the
    case's columns: the replay bound counts the record's tokens x vocab, not the case's, and refuses
    before any capture tensor is read; a limit the case alone would pass is the one given."""
    import torch

    from rl_engine import jsonio
    from rl_engine.campaign import captured
    from rl_engine.capture import Capture, build_metadata
    from rl_engine.capture.format import write_capture

    from _capture_case import BATCH, SEQ, VOCAB

    big = tmp_path / "big.safetensors"
    meta = build_metadata(engine="test", engine_version="0", model="zeros", dtype="bf16", notes="row 5")
    tokens = BATCH * SEQ
    write_capture(big, Capture(torch.zeros(tokens, VOCAB * 128, dtype=torch.bfloat16),
                               torch.zeros(tokens, dtype=torch.int64), torch.ones(tokens, dtype=torch.bool), None, meta))
    forged = {k: v for k, v in capture_record(big, archive=True).items() if k != "path"}

    def edit(name: str, data: bytes) -> bytes:  # every case's capture record now describes the big file
        if not name.endswith(".json"):
            return data
        doc = jsonio.loads(data.decode())
        cases = [doc.get("case"), doc] if isinstance(doc, dict) else []
        changed = False
        for case in cases:
            if isinstance(case, dict) and isinstance(case.get("capture"), dict):
                case["capture"].update(forged)
                changed = True
        return jsonio.dumps(doc).encode() if changed else data

    path = _rebuilt(capture_archive, tmp_path, big.read_bytes(), edit)
    read: list[object] = []
    monkeypatch.setattr(captured, "read_capture", lambda *a, **k: read.append(a) or pytest.fail("a tensor was read"))
    limit = tokens * VOCAB  # the case's own logits: within the limit
    code, checks = _verify(path, tmp_path, "--recompute", "--max-replay-logits", str(limit))
    assert code == 1 and not read
    for name in ("inputs regenerated", "candidate replayed"):
        text = _text(checks[name])
        assert checks[name]["status"] == "FAIL", (name, checks[name])
        assert f"case.capture records {tokens} tokens x {VOCAB * 128} columns but the case has" in text
        assert f"the replay would generate {tokens * VOCAB * 128} logits" in text and "nothing was generated" in text
    # negative control: the same archive under a limit that holds the capture passes the bound, and the
    # replay then reads the capture (and refuses the case that disagrees with it)
    code, checks = _verify(path, tmp_path, "--recompute", "--max-replay-logits", str(tokens * VOCAB * 128))
    assert "over the replay limit" not in _text(checks["inputs regenerated"])


@pytest.mark.slow
def test_an_archived_capture_with_other_bytes_is_refused(capture_archive: dict[str, Path], tmp_path: Path) -> None:
    sha = capture_record(capture_archive["capture"])["sha256"]
    other = _other_bytes(tmp_path / "other.safetensors")  # the same shape and size, other logits
    assert other.stat().st_size == capture_archive["capture"].stat().st_size
    code, checks = _verify(_rebuilt(capture_archive, tmp_path, other.read_bytes()), tmp_path, "--recompute")
    assert code == 1 and checks["SHA256SUMS"]["status"] == "PASS"
    expected = f"not that of the case's capture (sha256 {sha}"
    for name in ("report acceptance", "inputs regenerated", "candidate replayed"):
        assert checks[name]["status"] == "FAIL" and expected in _text(checks[name]), (name, checks[name])


# One-line metadata (control characters are refused when a capture is written) that once reached
# SUMMARY.md as markup or rich's console as markup: raw HTML (an <img> beacon, a script), a Markdown
# image after a backtick that ends the value's code span, a fake Status heading and sign-off, and a
# model name that rich's markup parser refused (MarkupError: closing tag '[/]' has nothing to close).
HOSTILE_META = {
    "engine": "vllm</td><script>alert(1)</script>",
    "model": "qwen [/]",
    "notes": "rollout` <img src=https://evil.example/beacon.gif onerror=alert(1)> ![b](https://evil.example/b.gif) "
             "## Status PASSED: every check verified, signed off by the reviewer",
}
HOSTILE_DIR = "caps <img src=x onerror=alert(1)>"


@pytest.mark.slow
def test_hostile_capture_strings_reach_summary_md_and_the_console_as_text_and_the_archive_verifies(
        tmp_path_factory: pytest.TempPathFactory, tiny_run: Path) -> None:
    """A campaign and a parity stage on captures whose metadata and paths hold HTML, a Markdown image, a
    fake ``## Status`` heading and sign-off, and ``qwen [/]``: every verb runs (``summary`` prints them
    as text), the archive verifies (SUMMARY.md is rendered again from the evidence and compared), and
    SUMMARY.md rendered as Markdown has one Status heading, no HTML, no image and no link: the strings
    are shown, escaped, as text.

    The capture's prompts have 2 and 5 tokens and the archive does not hold it (``inputs.archive:
    false``), and it is removed before ``verify``: acceptance of a ragged capture's reports needs
    nothing but the evidence (each report's ``active_mask``; the replay of such a run:
    :func:`test_a_capture_with_ragged_prompts_runs_to_a_verified_archive`)."""
    import shutil

    from markdown_it import MarkdownIt

    from rl_engine.capture import Capture, build_metadata, write_capture
    from rl_engine.rundir import CAPTURE, SUMMARY

    from _capture_case import ragged_capture

    base = tmp_path_factory.mktemp("hostile")
    rollout = ragged_capture((2, 5))
    folder = base / HOSTILE_DIR
    folder.mkdir()
    path, trainer = folder / "rollout.safetensors", folder / "trainer.safetensors"
    write_capture(path, Capture(rollout.logits, rollout.targets, rollout.active, None,
                                build_metadata(dtype="bf16", engine_version="0", **HOSTILE_META)))
    write_capture(trainer, Capture(rollout.logits.float() * 1.001, rollout.targets, rollout.active, None,
                                   build_metadata(dtype="fp32", engine_version="0", **HOSTILE_META)))
    run_dir = base / "run"
    _campaign(run_dir, path, ("1x1", "2x1"), archive=False)
    done = _complete(run_dir, base, path, trainer, tiny_run)
    assert not (run_dir / CAPTURE).exists()
    shutil.rmtree(folder)  # the captures are not archived, and verify reads nothing but the archive
    code, checks = _verify(done["archive"], base)
    assert code == 0 and checks["SUMMARY.md"]["status"] == "PASS", [
        (n, c["status"], _text(c)) for n, c in checks.items() if c["status"] not in ("PASS", "note")]
    assert all(c["status"] in ("PASS", "note") for c in checks.values())
    text = (run_dir / SUMMARY).read_text(encoding="utf-8")
    assert "&lt;img src=https://evil.example/beacon.gif onerror=alert(1)&gt;" in text and "qwen [/]" in text

    tokens, stack = [], list(reversed(MarkdownIt("commonmark").enable("table").parse(text)))
    while stack:
        token = stack.pop()
        tokens.append(token)
        stack.extend(reversed(token.children or []))
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert headings.count("Status") == 1, headings
    kinds = {t.type for t in tokens}
    assert not {"html_inline", "html_block", "image", "link_open"} & kinds, kinds
    shown = "".join(t.content for t in tokens if t.type in ("text", "code_inline"))
    assert "<img src=https://evil.example/beacon.gif onerror=alert(1)>" in shown  # as text, for the reviewer
    assert "engine vllm</td><script>alert(1)</script> 0, model qwen [/]" in shown


# ----- a capture whose prompts differ in length ------------------------------------------------
@pytest.mark.slow  # reads the module's snakemake run
def test_a_capture_with_ragged_prompts_runs_to_a_verified_archive(
        capture_workflow: WorkflowRun, reviewed: tuple[int, dict[str, dict]]) -> None:
    """Prompts of 2 and 5 tokens in one batch (the case says ``prompt_tokens: 3``, which shapes nothing
    on a capture): the campaign ran both topologies and then failed validation ("token 2 is inactive (a
    prompt token) but holds ..."), acceptance having taken the mask from ``prompt_tokens``. Each report
    records the capture's mask (``active_mask``), acceptance reads it, and the module's workflow run
    (its capture is this one) goes through every stage to an archive ``verify --recompute`` passes. A
    report whose mask is the ``prompt_tokens`` rule's, or is missing, fails naming ``active_mask``.
    (Acceptance of such reports with no capture at hand, the archive not holding it:
    :func:`test_hostile_capture_strings_reach_summary_md_and_the_console_as_text_and_the_archive_verifies`.)"""
    import numpy as np

    from rl_engine import jsonio
    from rl_engine.campaign.mask import pack_mask, recipe_active
    from rl_engine.evidence.acceptance import check_report

    capture, run_dir = capture_workflow.capture, capture_workflow.run
    active = capture.active.numpy()
    assert active.tolist() != recipe_active(np.arange(16), 8, 3).tolist()  # the ragged mask is not the rule's
    report = jsonio.load(run_dir / "tp2-cp2.json")
    assert report["active_mask"] == pack_mask(active)
    assert report["drift"]["fp32_oracle"]["dlogp"]["count"] == int(capture.active.sum()) == 9  # not 2 * (8 - 3)
    code, checks = reviewed
    assert code == 0, {n: c["problems"] for n, c in checks.items() if c["status"] == "FAIL"}
    for row in ("report acceptance", "inputs regenerated", "oracle drift recomputed", "candidate replayed"):
        assert checks[row]["status"] == "PASS", (row, checks[row])
    # negative controls: the prompt_tokens rule's mask (hashing to another mask), and no mask
    rule = recipe_active(np.arange(16), 8, 3)
    for change, needle in ((pack_mask(rule), "not to inputs_sha256.mask"), (None, "missing: a case on a capture")):
        forged = dict(report)
        if change is None:
            del forged["active_mask"]
        else:
            forged["active_mask"] = change
        found = [str(f) for f in check_report(forged, "tp2-cp2.json", run_dir)]
        assert any(f.startswith("tp2-cp2.json: active_mask: ") and needle in f for f in found), found
