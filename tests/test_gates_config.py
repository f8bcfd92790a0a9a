"""Bad configuration is refused when the workflow is parsed, before any job.

``check_config`` (what ``workflow/Snakefile`` calls before any rule exists) is exercised case
by case; every family of messages is checked on the config as Snakemake loads and merges a
``--configfile bad.yaml``; real ``snakemake -n`` runs (one bad family, ``--config device=cuda``
without CUDA) show that the workflow itself refuses before building its DAG, with a message that
names the key, the value and the fix, and that a good config dry-runs (negative control).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rl_engine import workflow as wfconfig
from rl_engine.campaign import case as campaign
from rl_engine.campaign.casename import RunName, RunNameError, evidence_case_hash, pytest_args_of
from rl_engine.campaign.plan import build_plan
from rl_engine.campaign.plan import main as plan_main
from rl_engine.record import environment
from rl_engine.tables import MIN_MATRIX_TOPOLOGIES
from rl_engine.workflow import WorkflowConfigError, check_config, load_config

from _schema_fixtures import InvalidCase, invalid_cases
from _workflow_util import REPO, SMALL_VOCAB, copy_repo, env_for, jobs_run, snakemake_cmd, write_config

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "schemas" / "config"
SCHEMA_FIX = "fix the value in config.yaml (see schemas/config.schema.json)"


def base() -> dict[str, Any]:
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config.update(SMALL_VOCAB, topologies=["1x1", "1x2", "2x1"])
    return config


def tolerance(dtype: str, atol: float, rtol: float) -> dict[str, Any]:
    tolerances = dict(base()["tolerances"])
    tolerances[dtype] = {"atol": atol, "rtol": rtol}
    return {"tolerances": tolerances}


# (case id, overrides of the small config, substrings the one error message must contain:
#  the key, the value, and the fix)
BAD: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("unknown key", {"topology": ["1x1"]},
     ("unknown config key(s) ['topology']", "did you mean 'topologies' for 'topology'? remove or rename them",
      "allowed keys: ['backend',")),
    ("unknown nested key", {"regression": {"tests": ["tests/test_logprob_contract.py"], "timeout": 5}},
     ("unknown config key(s) ['timeout'] under 'regression'", "did you mean 'timeout_s' for 'timeout'?",
      "allowed keys: ['pytest_args', 'tests', 'timeout_s']")),
    ("misspelt key", {"sead": 7}, ("unknown config key(s) ['sead']", "did you mean 'seed' for 'sead'? remove or rename")),
    ("unknown key with no close one", {"zzzzzz": 7}, ("unknown config key(s) ['zzzzzz']; remove or rename them",)),
    ("wrong type", {"batch": "2"}, ("config key 'batch' has value '2'", "is not of type 'integer'", SCHEMA_FIX)),
    ("bool is not an integer", {"seq": True}, ("config key 'seq' has value True", "is not of type 'integer'")),
    ("unknown dtype", {"dtype": "bf8"},
     ("config key 'dtype' has value 'bf8'", "is not one of ['bf16', 'fp16', 'fp32']", SCHEMA_FIX)),
    ("unknown backend", {"backend": "triton"},
     ("config key 'backend' has value 'triton'", "is not registered; use one of [",
      "'pytorch-vocab-parallel-logp-ws2'")),
    ("auto backend", {"backend": "auto"}, ("config key 'backend' has value 'auto'", "'auto' is refused")),
    ("cpu-only backend on cuda", {"backend": "cpu-vocab-parallel-logp-ws2", "device": "cuda"},
     ("config key 'backend' has value 'cpu-vocab-parallel-logp-ws2'",
      "does not run on device='cuda' (its devices: ['cpu'])", "choose a backend for 'cuda'")),
    ("unknown device", {"device": "tpu"}, ("config key 'device' has value 'tpu'", "is not one of ['cpu', 'cuda']")),
    ("real vocab above padded", {"real_vocab": 1025},
     ("config key 'real_vocab' has value 1025", "exceeds padded_vocab=1024",
      "the padded vocabulary must be >= the real one")),
    ("tiles not dividing padded", {"num_vocab_tiles": 7},
     ("config key 'num_vocab_tiles' has value 7", "does not divide padded_vocab=1024",
      "choose a tile count that divides 1024")),
    ("shards not tile aligned", {"topologies": ["1x1", "3x1"]},
     ("config key 'topologies[1]' has value '3x1'", "would not be tile aligned", "use a TP degree that divides 8")),
    ("TP*CP above the tile count", {"num_vocab_tiles": 4, "topologies": ["1x1", "4x2"]},
     ("config key 'topologies[1]' has value '4x2'", "tp*cp=8 ranks exceed num_vocab_tiles=4",
      "use at most 4 ranks or more tiles")),
    ("TP above the supported range", {"num_vocab_tiles": 32, "topologies": ["1x1", "16x1"]},
     ("config key 'topologies[1]' has value '16x1'", "tp=16 exceeds the supported maximum 8", "use tp <= 8")),
    ("CP above the supported range", {"topologies": ["1x1", "1x8"]},
     ("config key 'topologies[1]' has value '1x8'", "cp=8 exceeds the supported maximum 4", "use cp <= 4")),
    ("CP not splitting seq", {"seq": 15, "prompt_tokens": 3, "topologies": ["1x1", "1x2"]},
     ("config key 'topologies[1]' has value '1x2'", "seq_len=15 cannot be split into 2 equal chunks",
      "use a sequence length that is a multiple of 2")),
    ("prompt tokens equal seq", {"prompt_tokens": 16},
     ("config key 'prompt_tokens' has value 16", "must be < seq=16", "lower prompt_tokens or raise seq")),
    ("prompt tokens above seq", {"prompt_tokens": 40},
     ("config key 'prompt_tokens' has value 40", "must be < seq=16")),
    ("duplicate topologies", {"topologies": ["1x1", "2x1", "1x1"]},
     ("config key 'topologies' has value ['1x1', '2x1', '1x1']", "has non-unique elements", SCHEMA_FIX)),
    ("malformed topology", {"topologies": ["1x1", "2*1"]},
     ("config key 'topologies[1]' has value '2*1'", "'2*1' is not <tp>x<cp>", "topologies: [1x1, 2x1]")),
    ("a number for a topology", {"topologies": [3]},  # the item's error, not "at least 2"
     ("config key 'topologies[0]' has value 3", "3 is not <tp>x<cp>", "topologies: [1x1, 2x1] in config.yaml")),
    ("topologies as one string", {"topologies": "1x1,2x1"},
     ("config key 'topologies' has value '1x1,2x1'", "not a list",
      """--config topologies='["1x1","2x1"]' on the command line""")),
    ("empty topology list", {"topologies": []},
     ("config key 'topologies' has value []", "0 topologies listed", "list 2 or more")),
    ("single topology", {"topologies": ["2x1"]},
     ("config key 'topologies' has value ['2x1']",
      "1 topology listed, but the cross-topology check compares at least 2", "list 2 or more (e.g. 1x1 and 2x1)")),
    ("zero process-group timeout", {"pg_timeout_s": 0},
     ("config key 'pg_timeout_s' has value 0", "less than or equal to the minimum of 0")),
    ("batch of zero", {"batch": 0}, ("config key 'batch' has value 0", "less than the minimum of 1")),
    ("seq of zero", {"seq": 0}, ("config key 'seq' has value 0", "less than the minimum of 1")),
    ("negative atol", tolerance("bf16", -0.1, 0.0),
     ("config key 'tolerances.bf16.atol' has value -0.1", "less than the minimum of 0", SCHEMA_FIX)),
    ("negative rtol", tolerance("bf16", 0.05, -0.001),
     ("config key 'tolerances.bf16.rtol' has value -0.001", "less than the minimum of 0")),
    ("NaN tolerance", tolerance("bf16", float("nan"), 0.0),
     ("config key 'tolerances.bf16.atol' has value nan: not a finite number", "use a finite value")),
    ("infinite time limit", {"topology_timeout_s": float("inf")},
     ("config key 'topology_timeout_s' has value inf: not a finite number",)),
    ("zero time limit", {"topology_timeout_s": 0},
     ("config key 'topology_timeout_s' has value 0", "less than or equal to the minimum of 0")),
    ("no tolerance for the dtype", {"dtype": "fp16", "tolerances": {"bf16": {"atol": 0.05, "rtol": 0.0}}},
     ("config key 'tolerances' has no entry for dtype 'fp16'", "add tolerances.fp16: {atol: ..., rtol: ...}")),
]


def test_good_configs_pass_unchanged() -> None:
    """Negative control: the default config and the small one used below are accepted as they are."""
    default = yaml.safe_load((REPO / "config.yaml").read_text())
    assert check_config(default) is default
    small = base()
    assert check_config(small) == base()
    fused = {**base(), "backend": "cpu-vocab-parallel-logp-ws2"}  # the workflow selects it by name
    assert check_config(fused)["backend"] == "cpu-vocab-parallel-logp-ws2"
    triton = {**base(), "backend": "triton-vocab-parallel-logp-ws2", "device": "cuda"}
    assert check_config(triton)["backend"] == "triton-vocab-parallel-logp-ws2"


def test_check_config_refuses_the_triton_backend_on_cpu_unless_its_interpreter_is_chosen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    triton = {**base(), "backend": "triton-vocab-parallel-logp-ws2", "device": "cpu"}
    monkeypatch.delenv("RL_ENGINE_TRITON_MODE", raising=False)
    with pytest.raises(WorkflowConfigError, match="does not run on device='cpu'"):
        check_config(dict(triton))
    monkeypatch.setenv("RL_ENGINE_TRITON_MODE", "interpreter")  # the explicit, recorded choice
    assert check_config(dict(triton))["backend"] == "triton-vocab-parallel-logp-ws2"


@pytest.mark.parametrize(("overrides", "expected"), [pytest.param(o, e, id=i) for i, o, e in BAD])
def test_check_config_refuses_naming_key_value_and_fix(overrides: dict[str, Any], expected: tuple[str, ...]) -> None:
    config = base()
    config.update(overrides)
    with pytest.raises(WorkflowConfigError) as raised:
        check_config(config)
    message = str(raised.value)
    for part in expected:
        assert part in message, (part, message)


def test_campaign_problems_are_reported_together() -> None:
    config = base()
    config.update(real_vocab=2000, prompt_tokens=16, backend="triton")
    with pytest.raises(WorkflowConfigError) as raised:
        check_config(config)
    message = str(raised.value)
    for key in ("'backend'", "'real_vocab'", "'prompt_tokens'"):
        assert f"config key {key}" in message, message
    assert message.count("; ") >= 2


def test_check_config_runs_the_runners_topology_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """One mechanism: tightening the runner's rule tightens check_config (no copy of the rule)."""
    config = base()
    assert check_config(config) is config
    monkeypatch.setattr(campaign, "MAX_CP", 1)
    with pytest.raises(WorkflowConfigError) as raised:
        check_config(config)
    assert str(raised.value) == (
        "config key 'topologies[1]' has value '1x2': cp=2 exceeds the supported maximum 1; use cp <= 1"
    )


def test_check_config_runs_the_runners_case_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(campaign, "backend_devices", lambda: {"another-backend": ("cpu",)})
    with pytest.raises(WorkflowConfigError) as raised:
        check_config(base())
    assert str(raised.value) == (
        "config key 'backend' has value 'pytorch-vocab-parallel-logp-ws2': backend="
        "'pytorch-vocab-parallel-logp-ws2' is not registered; use one of ['another-backend']"
    )


def test_schema_minimum_is_the_runners_matrix_minimum() -> None:
    schema = json.loads((REPO / "schemas" / "config.schema.json").read_text())
    assert schema["properties"]["topologies"]["minItems"] == MIN_MATRIX_TOPOLOGIES == 2


def _case_rule(config: dict[str, Any], output: Path) -> list[str]:
    """The case verb's argv for the config's values, unchecked (the Snakefile only passes checked
    ones: here the verb must refuse the same things by itself)."""
    document = {
        "schema_version": "1",
        "case_id": "unchecked",
        "case": wfconfig.case_values(config),
        "topologies": [{"tp": int(t.split("x")[0]), "cp": int(t.split("x")[1])} for t in config["topologies"]],
    }
    return ["--json", json.dumps(document), "--output", str(output)]


# the BAD cases the schema lets through: the runner's plan-time rules alone decide them
CAMPAIGN_IDS = ("unknown backend", "auto backend", "real vocab above padded", "tiles not dividing padded",
                "shards not tile aligned", "TP*CP above the tile count", "TP above the supported range",
                "CP above the supported range", "CP not splitting seq", "prompt tokens equal seq",
                "prompt tokens above seq", "single topology")
CAMPAIGN_CASES = [case for case in BAD if case[0] in CAMPAIGN_IDS]


def test_campaign_ids_name_bad_cases() -> None:
    assert sorted(case[0] for case in CAMPAIGN_CASES) == sorted(CAMPAIGN_IDS)


@pytest.mark.parametrize(("overrides", "expected"),
                         [pytest.param({}, (), id="good config")]
                         + [pytest.param(o, e, id=i) for i, o, e in CAMPAIGN_CASES])
def test_check_config_and_the_plan_rule_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              overrides: dict[str, Any], expected: tuple[str, ...]) -> None:
    """check_config refuses exactly what the case rule would refuse, for the same reason; a good
    config's case file (as the Snakefile makes it) is written and plans."""
    config = {**base(), **overrides}
    output = tmp_path / "case.json"
    if not expected:
        assert check_config(config) is config
        rc = campaign.main(["--json", json.dumps(wfconfig.config_case(config)), "--output", str(output)])
        assert rc == 0 and output.is_file(), capsys.readouterr().err
        assert plan_main(["--case", str(output), "--output", str(tmp_path / "plan.json")]) == 0
        return
    rc = campaign.main(_case_rule(config, output))
    err = capsys.readouterr().err
    with pytest.raises(WorkflowConfigError) as raised:
        check_config(config)
    assert rc == 2 and not output.exists(), err
    # the runner's own sentence is inside the config message, after "has value ...: "
    runner_reason = err.removeprefix("case: --json: ").strip().split("; ")[0]
    if runner_reason.startswith("--topologies: "):
        runner_reason = runner_reason.removeprefix("--topologies: ")
    assert runner_reason in str(raised.value), (runner_reason, str(raised.value))


def _fixture(text: str) -> dict[str, Any]:
    # json, not yaml: PyYAML reads 1e-05 (no dot) as a string; json reads the NaN literal as nan
    return json.loads(text)


@pytest.mark.parametrize("case", invalid_cases("config"), ids=lambda c: c.name)
def test_invalid_schema_fixtures_are_refused_by_the_workflow_check(case: InvalidCase) -> None:
    """The invalid config cases of tests/test_schemas.py are refused by check_config too."""
    with pytest.raises(WorkflowConfigError, match="config key"):
        check_config(_fixture(case.text()))


@pytest.mark.parametrize("path", sorted((FIXTURES / "valid").glob("*.json")), ids=lambda p: p.stem)
def test_valid_schema_fixtures_pass_the_workflow_check(path: Path, tmp_path: Path) -> None:
    from _capture_case import write_tiny_capture, write_trainer_side

    config = _fixture(path.read_text())
    for section, key, write in (("inputs", "capture", write_tiny_capture), ("parity", "rollout", write_tiny_capture),
                                ("parity", "trainer", write_trainer_side)):
        if section in config:  # the captures it names, written here (16 tokens x 64 bf16 columns)
            target = tmp_path / config[section][key]
            target.parent.mkdir(parents=True, exist_ok=True)
            config[section][key] = str(write(target))
    assert check_config(config) is config


def test_yaml_file_is_loaded_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("atol_typo: 1\n" + (REPO / "config.yaml").read_text())
    with pytest.raises(WorkflowConfigError, match=r"unknown config key\(s\) \['atol_typo'\]"):
        load_config(path)
    (tmp_path / "list.yaml").write_text("- 1x1\n")
    with pytest.raises(WorkflowConfigError, match="the top level must be a mapping"):
        load_config(tmp_path / "list.yaml")
    assert load_config(REPO / "config.yaml")["dtype"] == "bf16"


def test_check_config_verb(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(dict(base(), seq=0)))
    assert wfconfig.main([str(bad)]) == 2
    assert "config key 'seq' has value 0" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(base()))
    assert wfconfig.main([str(good)]) == 0


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false",
                    *args], cwd=repo, check=True, capture_output=True,
                   env={**os.environ, "GIT_CONFIG_GLOBAL": os.devnull})


def test_run_name_and_environment_agree_on_dirty(tmp_path: Path) -> None:
    """The run name's -dirty and environment.json's git.dirty come from one definition.

    ``status.showUntrackedFiles=no`` in the checkout hid an untracked file from the run
    name's plain ``git status`` while environment.json counted it: the same tree was named
    clean and recorded dirty.
    """
    repo = tmp_path / "repo"
    repo.mkdir()
    config = dict(base(), campaign="c")
    digest = wfconfig.config_case_hash(config)
    assert wfconfig.run_name(config, repo) == f"c-nogit-case-{digest}"
    assert environment._git(repo, 20.0)["available"] is False
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("ignored.log\n")
    (repo / "a.txt").write_text("a\n")
    _git(repo, "add", ".gitignore", "a.txt")
    _git(repo, "commit", "-q", "-m", "first")
    _git(repo, "config", "status.showUntrackedFiles", "no")
    short = environment._git(repo, 20.0)["short_commit"]
    states = []
    for step in ("clean", "ignored", "untracked data", "untracked", "tracked change"):
        if step == "ignored":
            (repo / "ignored.log").write_text("noise\n")
        if step == "untracked data":  # a worked example's files: listed, not dirty, same run name
            (repo / "capture.yaml").write_text("inputs: {}\n")
            (repo / "trainer.safetensors").write_bytes(b"\0" * 16)
        if step == "untracked":
            (repo / "new.py").write_text("x = 1\n")
        if step == "tracked change":
            (repo / "new.py").unlink()
            (repo / "a.txt").write_text("changed\n")
        dirty = environment._git(repo, 20.0)["dirty"]
        name = wfconfig.run_name(config, repo)
        assert name == f"c-{short}{'-dirty' if dirty else ''}-case-{digest}", step
        assert RunName.parse(name) == RunName("c", short, dirty, digest)
        states.append(dirty)
    assert states == [False, False, False, True, True]  # both outcomes seen (negative control)


# (change, whether it changes the evidence and so the run name)
CASE_CHANGES: list[tuple[str, dict[str, Any], bool]] = [
    ("seed", {"seed": 7}, True),
    ("topologies", {"topologies": ["1x1", "2x1", "8x1"]}, True),
    ("topology order", {"topologies": ["2x1", "1x2", "1x1"]}, True),
    ("device", {"device": "cuda"}, True),
    ("dtype", {"dtype": "fp32"}, True),
    ("tolerance of the dtype", tolerance("bf16", 0.01, 0.0), True),
    ("shape", {"seq": 32}, True),
    ("backend threads", {"threads_per_rank": 2}, True),
    ("process-group timeout", {"pg_timeout_s": 60}, True),
    ("regression tests", {"regression": {"tests": ["tests/test_logprob_chunks.py"]}}, True),
    ("regression pytest args", {"regression": {"tests": base()["regression"]["tests"], "pytest_args": ["-x"]}}, True),
    ("campaign", {"campaign": "other"}, True),
    ("topology time limit", {"topology_timeout_s": 20}, False),
    ("regression time limit", {"regression": {**base()["regression"], "timeout_s": 5}}, False),
    ("tolerance of another dtype", tolerance("fp16", 0.001, 0.0), False),
    ("integer logit scale", {"logit_scale": 1}, False),
]


@pytest.mark.parametrize(("overrides", "changes"), [pytest.param(o, c, id=i) for i, o, c in CASE_CHANGES])
def test_run_name_changes_exactly_with_the_evidence(tmp_path: Path, overrides: dict[str, Any], changes: bool) -> None:
    """--config topologies=... or seed=7 started in the directory of the default campaign
    (reports "left from an earlier plan", an overwritten archive). Each case now has its own name;
    what does not change the evidence (wall-clock limits) keeps the name, so a rerun completes it."""
    config = base()
    changed = dict(config, **overrides)
    assert (wfconfig.run_name(changed, tmp_path) != wfconfig.run_name(config, tmp_path)) is changes


def test_case_hash_of_the_evidence_is_the_hash_of_the_config(tmp_path: Path) -> None:
    """The hash in the name can be computed again from plan.json and regression.json (verify does)."""
    config = dict(base(), logit_scale=1, regression={"tests": ["tests/a.py", "tests/b.py"], "pytest_args": ["-x", "-k", "a b"]})
    values = wfconfig.case_values(config)
    plan = build_plan(campaign.Case(**values), ((1, 1), (1, 2), (2, 1)), "plan.json")
    plan = json.loads(json.dumps(plan))  # as read back from disk
    command = "python -m pytest -q -rs tests/a.py tests/b.py -x -k 'a b' --junitxml=results/r/pytest-junit.xml"
    regression = {"tests": ["tests/a.py", "tests/b.py"], "command": command}
    assert evidence_case_hash(plan, regression) == wfconfig.config_case_hash(config)
    regression["command"] = command.replace(" -x", "")
    assert evidence_case_hash(plan, regression) != wfconfig.config_case_hash(config)
    # the verb's own plugin (rl_engine.record.suite_imports) is not an argument of the case
    regression["command"] = command.replace("-rs ", "-rs -p rl_engine.record.suite_imports ")
    assert evidence_case_hash(plan, regression) == wfconfig.config_case_hash(config)
    regression["command"] = command.replace("-rs ", "-rs -p other.plugin ")  # any other plugin is the case's
    with pytest.raises(RunNameError):
        evidence_case_hash(plan, regression)
    with pytest.raises(RunNameError, match="is not 'python -m pytest -q -rs \\[-p rl_engine.record.suite_imports\\] "
                                           "<tests> \\[args\\]"):
        pytest_args_of({"tests": ["tests/a.py"], "command": "pytest tests/a.py"})


def test_run_name_parse_refuses_names_without_a_case() -> None:
    with pytest.raises(RunNameError, match="is not a run name"):
        RunName.parse("rl-engine-logprob-abc1234-dirty")
    assert RunName.parse("my-camp-1-abc1234-dirty-case-0123abcd") == RunName("my-camp-1", "abc1234", True, "0123abcd")
    assert str(RunName.parse("c-nogit-case-0123abcd")) == "c-nogit-case-0123abcd"


def test_config_errors_say_when_the_value_came_from_the_command_line() -> None:
    """A bad --config value was reported as if config.yaml held it."""
    config = dict(base(), seed=-1)
    with pytest.raises(WorkflowConfigError) as from_file:
        check_config(config)
    assert "--config" not in str(from_file.value) and SCHEMA_FIX in str(from_file.value)
    origin = wfconfig.Origin(cli={"seed": -1}, files={"seed": 123})
    with pytest.raises(WorkflowConfigError) as from_cli:
        check_config(config, origin)
    message = str(from_cli.value)
    assert "config key 'seed' has value -1 (given with --config seed=...; the config file has seed: 123)" in message
    assert "fix the value given with --config seed=..." in message and "config.yaml" not in message
    with pytest.raises(WorkflowConfigError, match=r"fix the value in my\.yaml \(see"):  # the file that set it
        check_config(config, wfconfig.Origin(files={"seed": -1}, file_of={"seed": "my.yaml"}))
    campaign_cli = wfconfig.Origin(cli={"topologies": ["1x1", "3x1"]}, files={"topologies": ["1x1", "2x1"]})
    with pytest.raises(WorkflowConfigError, match=r"config key 'topologies\[1\]' has value '3x1' \(given with "
                                                   r"--config topologies=\.\.\.; the config file has topologies: "):
        check_config(dict(base(), topologies=["1x1", "3x1"]), campaign_cli)
    with pytest.raises(WorkflowConfigError, match=r"unknown config key\(s\) \['sead'\] \(given with --config\); "
                                                   r"did you mean 'seed' for 'sead'\? remove or rename"):
        check_config(dict(base(), sead=7), wfconfig.Origin(cli={"sead": 7}))  # --config sead=7


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_campaign_is_refused_on_a_machine_without_cuda() -> None:
    """Device=cuda passed the dry run here and failed 35 s later in six tracebacks."""
    config = dict(base(), device="cuda")
    assert check_config(config) is config  # the campaign itself is valid...
    with pytest.raises(WorkflowConfigError, match="config key 'device' has value 'cuda': device='cuda' was requested "
                                                  "but CUDA is not available; nothing falls back to the CPU"):
        wfconfig.check_workflow_config(config)  # ...this machine cannot run it
    assert wfconfig.check_workflow_config(base()) == base()  # negative control


# ---------------------------------------------------------------- real snakemake -n

# One dry run per family of messages; the campaign families batch several problems at once.
DRY_RUNS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "unknown-key": ({"topology": ["1x1"]}, ("unknown config key(s) ['topology']",
                                           "did you mean 'topologies' for 'topology'? remove or rename them")),
    "schema-value": ({"dtype": "bf8"}, ("config key 'dtype' has value 'bf8'", "is not one of ['bf16', 'fp16', 'fp32']",
                                        "fix the value in schema-value.yaml (see schemas/config.schema.json)")),
    "schema-nested": (tolerance("bf16", -0.1, 0.0), ("config key 'tolerances.bf16.atol' has value -0.1",)),
    "non-finite": (tolerance("bf16", float("nan"), 0.0), ("config key 'tolerances.bf16.atol' has value nan",)),
    "campaign-case": ({"real_vocab": 2000, "num_vocab_tiles": 7, "prompt_tokens": 16, "backend": "triton"},
                      ("config key 'real_vocab' has value 2000: real_vocab=2000 exceeds padded_vocab=1024",
                       "config key 'num_vocab_tiles' has value 7", "config key 'prompt_tokens' has value 16",
                       "config key 'backend' has value 'triton'")),
    "campaign-topology": ({"num_vocab_tiles": 4, "topologies": ["1x1", "3x1", "4x2"]},
                          ("config key 'topologies[1]' has value '3x1'", "would not be tile aligned",
                           "config key 'topologies[2]' has value '4x2': tp*cp=8 ranks exceed num_vocab_tiles=4")),
    # each passed the parse-time check and failed later, or never
    "bounds": ({"seed": 2**70, "logit_scale": 1e39, "seq": 2**40,
                "regression": {"tests": ["../../../../etc/passwd"]}},
               ("config key 'seed' has value 1180591620717411303424", "config key 'logit_scale' has value 1e+39",
                "config key 'seq' has value 1099511627776", "config key 'regression.tests[0]' has value "
                "'../../../../etc/passwd'")),
    # 400-digit integers pass the schema; float() of them was an OverflowError traceback
    "beyond-binary64": ({"temperature": 10**400, "logit_scale": 10**400, "pg_timeout_s": 10**400,
                         **tolerance("bf16", 10**400, 0.0)},
                        tuple(f"config key {key!r} has value 100000000000... (an integer of 401 digits): not a finite "
                              "number: an integer beyond binary64's range" for key in
                              ("temperature", "logit_scale", "pg_timeout_s", "tolerances.bf16.atol"))),
    "single-topology": ({"topologies": ["1x1"]},
                        ("config key 'topologies' has value ['1x1']", "the cross-topology check compares at least 2")),
}


# The family whose real dry run shows the Snakefile's refusal end to end (its values once ended in an
# OverflowError traceback); every family, this one included, is also parsed in process below, as
# Snakemake builds its config, then checked by the Snakefile's check.
REAL_DRY_RUN = "beyond-binary64"


def snakemake_config(repo: Path, configfile: str) -> tuple[dict[str, Any], wfconfig.Origin]:
    """The config ``snakemake --configfile <configfile>`` hands the Snakefile's check, and its origin:
    Snakemake's own loader (JSON, else YAML through yte) and merge (``--configfile`` values over the
    Snakefile's ``configfile: "config.yaml"``, mappings key by key), as in its ``Workflow.configfile``."""
    from snakemake.common.configfile import load_configfile
    from snakemake.utils import update_config

    overwrite: dict[str, Any] = {}
    update_config(overwrite, load_configfile(str(repo / configfile)))
    config = load_configfile(str(repo / "config.yaml"))
    update_config(config, overwrite)
    return config, wfconfig.workflow_origin({}, [str(repo / "config.yaml"), str(repo / configfile)])


@pytest.fixture(scope="module")
def bad_configs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the repository with every bad config written (``<family>.yaml``) and ``good.yaml``."""
    repo = copy_repo(tmp_path_factory.mktemp("gates-config"))
    for name, (overrides, _) in DRY_RUNS.items():
        write_config(repo, {**base(), **overrides}, name=f"{name}.yaml")
    write_config(repo, base(), name="good.yaml")
    return repo


@pytest.fixture(scope="module")
def dry_runs(bad_configs: Path) -> tuple[Path, dict[str, subprocess.CompletedProcess[str]]]:
    """:data:`REAL_DRY_RUN`'s dry run in :func:`bad_configs`'s copy (it fails while parsing; no lock): a
    snakemake start, for the slow tests only (the quick loop's in-process family checks need none)."""
    done = {REAL_DRY_RUN: subprocess.run(snakemake_cmd("-n", configfile=f"{REAL_DRY_RUN}.yaml"), cwd=bad_configs,
                                         env=env_for(bad_configs), capture_output=True, text=True, timeout=300)}
    return bad_configs, done


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
def test_snakemake_dry_run_refuses_bad_config_before_any_job(dry_runs: tuple[Path, dict[str, Any]]) -> None:
    repo, done = dry_runs
    result = done[REAL_DRY_RUN]
    text = result.stdout + result.stderr
    assert result.returncode != 0, text
    assert "WorkflowConfigError (workflow/Snakefile, before any job): " in text, text
    for part in DRY_RUNS[REAL_DRY_RUN][1]:
        assert part in text, (part, text)
    assert "Building DAG of jobs" not in text and jobs_run(text) == {}, text  # refused before the DAG
    assert 'File "' not in text and "Traceback" not in text, text  # the message alone, no traceback after it
    assert list((repo / "results").iterdir()) == []


@pytest.mark.parametrize("name", sorted(DRY_RUNS))
def test_every_family_of_bad_config_is_refused_as_snakemake_parses_it(
        bad_configs: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each family's message, from the config as Snakemake loads and merges its file (in process:
    the Snakefile's check is :func:`check_workflow_config` on it, the real dry run above shows the
    Snakefile's refusal), run from the workflow's directory as the Snakefile runs."""
    repo = bad_configs
    monkeypatch.chdir(repo)
    config, origin = snakemake_config(repo, f"{name}.yaml")
    with pytest.raises(WorkflowConfigError) as info:
        wfconfig.check_workflow_config(config, origin)
    for part in DRY_RUNS[name][1]:
        assert part in str(info.value), (part, str(info.value))
    good, origin = snakemake_config(repo, "good.yaml")  # negative control: the same path passes a good config
    assert wfconfig.check_workflow_config(good, origin) is good


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_snakemake_dry_run_refuses_cuda_on_a_machine_without_cuda(bad_configs: Path) -> None:
    """``snakemake -n --config device=cuda`` passed here; the jobs failed 35 s later."""
    repo = bad_configs
    write_config(repo, base(), name="good.yaml")
    done = subprocess.run(snakemake_cmd("-n", "--config", "device=cuda", configfile="good.yaml"), cwd=repo,
                          env=env_for(repo), capture_output=True, text=True, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode != 0, text
    assert ("WorkflowConfigError (workflow/Snakefile, before any job): config key 'device' has value 'cuda' (given "
            "with --config device=...; the config file has device: 'cpu'): device='cuda' was requested but CUDA is "
            "not available; nothing falls back to the CPU: run on a GPU machine or set device: cpu") in text, text
    assert "Building DAG of jobs" not in text and jobs_run(text) == {}, text
    assert 'File "' not in text and "Traceback" not in text, text
    assert list((repo / "results").iterdir()) == []


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
def test_snakemake_dry_run_of_a_good_config_plans_every_job(bad_configs: Path) -> None:
    """Negative control in the same copy: the small config dry-runs and lists one job per topology."""
    repo = bad_configs
    write_config(repo, base(), name="good.yaml")
    done = subprocess.run(snakemake_cmd("-n", configfile="good.yaml"), cwd=repo, env=env_for(repo),
                          capture_output=True, text=True, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    counts = jobs_run(text)
    assert counts.get("topology") == 3 and counts.get("archive") == 1, counts
    assert "capture" not in counts and "parity" not in counts  # no optional stage unless the config asks
    assert list((repo / "results").iterdir()) == []  # a dry run writes nothing


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
def test_snakemake_lint_is_clean(bad_configs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``snakemake --lint`` finds nothing in the workflow (rules, the case rule's params, the Snakefile's
    parse-time code), under a config that includes every rule: a capture campaign with an archived
    capture and a parity stage (docs/capture.md's worked example; the default config leaves the two
    optional stages' rules out)."""
    from _capture_case import CASE_FIELDS, write_tiny_capture, write_trainer_side

    repo = bad_configs
    write_tiny_capture(repo / "rollout.safetensors")
    write_trainer_side(repo / "trainer.safetensors")
    path = write_config(repo, {**{k: v for k, v in CASE_FIELDS.items() if k not in ("device", "backend", "seed")},
                               "topologies": ["1x1", "2x1"], "inputs": {"capture": "rollout.safetensors", "archive": True},
                               "parity": {"rollout": "rollout.safetensors", "trainer": "trainer.safetensors"}},
                        name="every-rule.yaml")
    monkeypatch.chdir(repo)  # the config's paths are relative to the workflow's directory
    assert wfconfig.stage_flags(check_config(yaml.safe_load(path.read_text()))) == {"capture": True, "parity": True}
    done = subprocess.run([sys.executable, "-m", "snakemake", "--lint", "--configfile", "every-rule.yaml"], cwd=repo,
                          env=env_for(repo), capture_output=True, text=True, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    assert "Congratulations, your workflow is in a good condition!" in text


def test_auto_tiles_resolve_when_the_workflow_is_parsed_to_the_api_s_count() -> None:
    """``num_vocab_tiles: auto`` becomes the count of the API's rule for ``padded_vocab`` and the
    largest TP of ``topologies``: the same case hash (and run) as that count written out; a
    vocabulary with no such count is refused naming the key and the padding that has one."""
    from rl_engine.distributed.bounds import auto_vocab_tiles

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    explicit = wfconfig.check_config(dict(config))
    auto = wfconfig.check_config({**config, "num_vocab_tiles": "auto"})
    assert auto["num_vocab_tiles"] == auto_vocab_tiles(config["padded_vocab"], 4) == 64
    assert wfconfig.config_case_hash(auto) == wfconfig.config_case_hash(explicit)
    narrow = wfconfig.check_config({**config, "num_vocab_tiles": "auto", "topologies": ["1x1", "2x1"]})
    assert narrow["num_vocab_tiles"] == auto_vocab_tiles(config["padded_vocab"], 2)
    with pytest.raises(wfconfig.WorkflowConfigError, match="config key 'num_vocab_tiles' has value 'auto'.*padded_vocab_size="):
        wfconfig.check_config({**config, "num_vocab_tiles": "auto", "padded_vocab": 50257, "real_vocab": 50257})
    with pytest.raises(wfconfig.WorkflowConfigError, match="num_vocab_tiles"):
        wfconfig.check_config({**config, "num_vocab_tiles": "many"})
