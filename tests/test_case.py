"""One case, one plan: the constant tables, the torch-free case and its file, and the one-way flow.

The tables (rl_engine/tables.py) are the only place each constant is written; the
schemas repeat some as enums for standard validators, and these tests fail when the two
disagree. The case file is what the workflow's resolved config becomes, and the plan is built
from it alone.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rl_engine import jsonio, schemas, tables
from rl_engine import workflow as wfconfig
from rl_engine.campaign import case as casemod
from rl_engine.campaign.case import Case, CaseError, case_document, load_case_file
from rl_engine.campaign.inputs import InputSpec, InputSpecError
from rl_engine.campaign.plan import build_plan, load_plan
from rl_engine.campaign.plan import main as plan_main
from rl_engine.logprob.backends.description import schema_enum

REPO = Path(__file__).resolve().parents[1]
DEFS = json.loads((REPO / "schemas" / "defs.schema.json").read_text())["$defs"]
CONFIG_SCHEMA = json.loads((REPO / "schemas" / "config.schema.json").read_text())["properties"]
SMALL = dict(device="cpu", dtype="bf16", backend=tables.EAGER_BACKEND, real_vocab=1000, padded_vocab=1024,
             num_vocab_tiles=8, batch=2, seq=16, prompt_tokens=8, seed=123)


def test_schema_enums_are_the_tables() -> None:
    assert DEFS["dtype"]["enum"] == list(tables.DTYPES) == CONFIG_SCHEMA["dtype"]["enum"]
    assert DEFS["device"]["enum"] == list(tables.DEVICE_DIST_BACKENDS) == CONFIG_SCHEMA["device"]["enum"]
    assert DEFS["dist_backend"]["enum"] == list(tables.DEVICE_DIST_BACKENDS.values())
    assert DEFS["cp_layout"]["enum"] == list(tables.CP_LAYOUTS)
    assert DEFS["backend_id"]["enum"] == schema_enum()
    assert DEFS["tp_degree"]["maximum"] == tables.MAX_TP and DEFS["cp_degree"]["maximum"] == tables.MAX_CP
    assert CONFIG_SCHEMA["threads_per_rank"]["maximum"] == tables.MAX_THREADS_PER_RANK
    assert CONFIG_SCHEMA["topologies"]["minItems"] == tables.MIN_MATRIX_TOPOLOGIES
    assert set(tables.TORCH_DTYPE_NAMES.values()) <= set(DEFS["torch_dtype_name"]["enum"])
    # every field is required but the optional capture record (a case on the input recipe has none)
    # and the temperature (absent at 1), the processed-logprob parameters (absent when off) and the
    # sampling source (absent at its default "case")
    optional = {"capture", "temperature", "top_k", "top_p", "min_p", "sampling"}
    assert CONFIG_SCHEMA["sampling"]["enum"] == list(casemod.SAMPLING_SOURCES)
    assert DEFS["case_common"]["properties"]["sampling"]["const"] == casemod.CAPTURED_SAMPLING
    assert set(casemod.SCALAR_SAMPLING) == {"temperature", *casemod.SAMPLING_DEFAULTS}
    assert set(DEFS["case_common"]["required"]) == {f.name for f in dataclasses.fields(Case)} - optional
    assert set(DEFS["case_common"]["properties"]) == {f.name for f in dataclasses.fields(Case)}


def test_default_config_tolerances_and_timeout_are_the_tables() -> None:
    config = wfconfig.load_config(REPO / "config.yaml")
    assert {d: (t["atol"], t["rtol"]) for d, t in config["tolerances"].items()} == tables.DEFAULT_TOLERANCES
    assert config["pg_timeout_s"] == tables.DEFAULT_PG_TIMEOUT_S
    assert [tuple(map(int, t.split("x"))) for t in config["topologies"]] == list(tables.DEFAULT_TOPOLOGIES)


def test_the_harness_modules_import_without_torch() -> None:
    """Checking the config, the case and the plan loads no torch (the Snakefile imports them)."""
    code = ("import sys, rl_engine.workflow, rl_engine.campaign.case, rl_engine.campaign.plan, "
            "rl_engine.tables; assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_one_rule_for_prompt_tokens_everywhere() -> None:
    """inputs.py once allowed prompt_tokens == seq while the campaign refused it: now one rule."""
    with pytest.raises(CaseError, match="prompt_tokens=16 must be < seq=16") as from_case:
        Case.create(**{**SMALL, "prompt_tokens": 16})
    with pytest.raises(InputSpecError) as from_inputs:
        InputSpec(batch=2, seq=16, prompt_tokens=16, real_vocab=1000, padded_vocab=1024, seed=123)
    assert str(from_inputs.value) == str(from_case.value)
    assert casemod.case_problems({"seq": 16, "prompt_tokens": 16}) == [
        ("prompt_tokens", str(from_case.value))]
    assert casemod.case_problems({"seq": 16}) == []  # a rule needs every field it reads


def test_case_defaults_come_from_the_tables() -> None:
    case = Case.create(**SMALL)
    assert (case.dist_backend, case.atol, case.rtol) == ("gloo", *tables.DEFAULT_TOLERANCES["bf16"])
    assert case.timeout_s == tables.DEFAULT_PG_TIMEOUT_S and case.cp_layout == "contiguous"
    assert Case.create(**{**SMALL, "logit_scale": 1}).logit_scale.hex() == (1.0).hex()  # 1 is 1.0
    with pytest.raises(CaseError, match=r"case fields \['seed'\] are missing"):
        Case.create(**{k: v for k, v in SMALL.items() if k != "seed"})


def test_case_file_round_trip_and_plan_from_it(tmp_path: Path) -> None:
    case = Case.create(**SMALL)
    path = tmp_path / "case.json"
    document = case_document(case, ((1, 1), (2, 2)))
    assert casemod.main(["--json", json.dumps(document), "--output", str(path)]) == 0
    assert jsonio.load(path) == document and schemas.errors(document, "case") == []
    assert load_case_file(path) == (case, ((1, 1), (2, 2)))
    plan_path = tmp_path / "plan.json"
    assert plan_main(["--case", str(path), "--output", str(plan_path)]) == 0
    loaded, plan = load_plan(plan_path)
    assert loaded == case and plan == build_plan(case, ((1, 1), (2, 2)), plan_path)
    assert [e["output"] for e in plan["topologies"]] == ["tp1-cp1.json", "tp2-cp2.json"]


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["case"].update(seq=10, prompt_tokens=2, cp_layout="zigzag"), "cannot be split into 4 equal chunks"),
    (lambda d: d["case"].update(backend="auto"), "backend='auto' is refused"),
    (lambda d: d.update(topologies=[{"tp": 1, "cp": 1}]), "1 topology listed"),
    (lambda d: d.update(case_id="bf16-v1-p1-t1-b1-s1-pt0-seed0-contiguous-scale1"), "is not the case's id"),
    (lambda d: d["case"].pop("seed"), "'seed' is a required property"),
    (lambda d: d["case"].update(extra=1), "Unevaluated properties are not allowed ('extra'"),
])
def test_case_verb_refuses_a_bad_case_file_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              change, message: str) -> None:
    document = case_document(Case.create(**SMALL), ((1, 1), (1, 2)))
    change(document)
    output = tmp_path / "case.json"
    assert casemod.main(["--json", json.dumps(document), "--output", str(output)]) == 2
    assert message in capsys.readouterr().err
    assert not output.exists()


def test_plan_with_a_case_file_refuses_case_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "case.json"
    casemod.write_case_file(path, Case.create(**SMALL), ((1, 1), (1, 2)))
    assert plan_main(["--case", str(path), "--seed", "5", "--output", str(tmp_path / "plan.json")]) == 2
    assert "holds the whole case; drop --seed" in capsys.readouterr().err
    assert not (tmp_path / "plan.json").exists()


def test_snakefile_case_json_is_the_config_case() -> None:
    """The case rule writes config_case(config): the config's values through the case's rules."""
    config = wfconfig.load_config(REPO / "config.yaml")
    document = wfconfig.config_case(config)
    case, topologies = casemod.case_from_document(document, "config.yaml")
    assert case.to_dict() == {**wfconfig.case_values(config), "logit_scale": 1.0, "timeout_s": 120.0}
    assert [f"{tp}x{cp}" for tp, cp in topologies] == config["topologies"]


# What only the case module may name: the config-key table, the resolved case, the capture
# fields the hash leaves out, the one config key whose case field has another name.
CASE_OWNED_NAMES = ("CONFIG_FIELDS", "OPTIONAL_FIELDS", "resolved_case", "CAPTURE_INFO_KEYS", "FLOAT_FIELDS")
CASE_OWNED_LITERALS = ("pg_timeout_s",)
RECIPE_CALLS = ("inputs.make_inputs", "inputs.make_input_part")
# The oracle's drift reads the case's real vocabulary, dtype, tolerance and temperature: only the
# case calls it with a case's values (record_oracle_drift); comparison.py defines it and its TP=1
# harness (no case) passes its own arguments.
ORACLE_DRIFT_MODULES = ("campaign/case.py", "logprob/comparison.py")


def _derived_outside_the_case(source: str, module: str) -> list[str]:
    """What a module other than ``campaign/case.py`` derives from a case itself: a
    ``LogprobContract(...)`` whose arguments read a case (``case.x``, ``case["x"]``), a name of
    :data:`CASE_OWNED_NAMES`, a literal of :data:`CASE_OWNED_LITERALS`, or the input recipe called
    outside ``campaign/captured.py`` (the recipe-or-capture branch), or the oracle's drift called or
    imported outside :data:`ORACLE_DRIFT_MODULES` (its case arguments spelled out a second time)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            args = [ast.unparse(a) for a in node.args] + [ast.unparse(k.value) for k in node.keywords]
            if name == "LogprobContract" and any(a.startswith(("case.", "case[")) or "case." in a for a in args):
                found.append(f"contract: {ast.unparse(node)[:100]}")
            if ast.unparse(node.func) in RECIPE_CALLS and module != "campaign/captured.py":
                found.append("the input recipe called outside campaign.captured")
            if name == "oracle_drift" and module not in ORACLE_DRIFT_MODULES:
                found.append(f"the oracle's case arguments: {ast.unparse(node)[:100]}")
        elif isinstance(node, ast.ImportFrom) and node.module == "rl_engine.campaign.inputs":
            found += [f"imports {a.name}" for a in node.names if a.name in ("make_inputs", "make_input_part")]
        elif isinstance(node, ast.ImportFrom) and module not in ORACLE_DRIFT_MODULES:
            found += [f"imports {a.name}" for a in node.names if a.name == "oracle_drift"]
        if isinstance(node, (ast.Name, ast.Attribute, ast.alias)):
            name = getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "name", None)
            if name in CASE_OWNED_NAMES:
                found.append(f"names {name}")
        elif isinstance(node, ast.Constant) and node.value in CASE_OWNED_LITERALS:
            found.append(f"the config key {node.value!r}")
    return found


def test_only_the_case_turns_a_case_into_a_contract_and_maps_config_keys() -> None:
    """``campaign/case.py`` owns what a case determines: ``Case.contract`` is the one place a case
    becomes a ``LogprobContract`` (the runner's ranks, verify's replays, the GPU smoke),
    ``CONFIG_FIELDS`` the one mapping between config keys and case fields (``Case.from_config``,
    ``config_key_of``, ``record_config``: the workflow and SUMMARY.md's reproduce.yaml), the oracle's
    case arguments are read there only (``record_oracle_drift``: the runner and verify), the case
    hash is built there only, and the recipe-or-capture branch of a case's inputs is
    ``campaign/captured.py``'s (``case_inputs``, ``case_rank_inputs``)."""
    root = REPO / "rl_engine"
    offenders = {}
    for path in root.rglob("*.py"):
        module = path.relative_to(root).as_posix()
        if module != "campaign/case.py" and (found := _derived_outside_the_case(path.read_text(), module)):
            offenders[module] = found
    assert offenders == {}
    controls = {  # each way a second owner would come back
        "c = LogprobContract(real_vocab_size=case.real_vocab, seq_len=4)": "contract",
        "keys = {k: f for k, f in CONFIG_FIELDS}": "names CONFIG_FIELDS",
        "from rl_engine.campaign.case import resolved_case": "names resolved_case",
        "timeout = config['pg_timeout_s']": "the config key",
        "x = inputs.make_inputs(case)": "the input recipe",
        "from rl_engine.campaign.inputs import make_inputs": "imports make_inputs",
        "x = inputs.make_input_part(case, rows, 0, 64)": "the input recipe",
        # the two spellings that judged a T = 0.7 campaign by two oracles
        "d = oracle_drift(lp, lse, x, t, a, case.real_vocab, case.dtype, case.atol, case.rtol, case.temperature)":
            "the oracle's case arguments",
        "d = oracle_drift(lp, lse, x, t, a, case['real_vocab'], case['dtype'], case['atol'], case['rtol'])":
            "the oracle's case arguments",
        "from rl_engine.logprob.comparison import oracle_drift": "imports oracle_drift",
    }
    for snippet, what in controls.items():
        assert any(what in f for f in _derived_outside_the_case(snippet, "campaign/run.py")), snippet
    assert _derived_outside_the_case("d = comparison.oracle_drift(lp, lse, x, t, a, 60, 'bf16', 0.05, 0.0)",
                                     "logprob/comparison.py") == []  # its own module and TP=1 harness
    case = Case.create(**SMALL, temperature=0.7)
    contract = case.contract(2, 2, 1, 0)
    assert (contract.tp_world_size, contract.tp_rank, contract.cp_world_size, contract.temperature) == (2, 1, 2, 0.7)
    assert contract.num_sequences == case.batch and contract.seq_len == case.seq


def test_the_oracle_of_a_case_is_at_its_temperature_for_the_runner_and_verify_alike() -> None:
    """``Case.drift`` (the runner) and ``record_oracle_drift`` of the report's case (``verify
    --recompute``) are one function of the case: the candidate at T = 0.7 is within tolerance of the
    oracle at 0.7; the oracle without the temperature (what verify's own spelling computed: LSE drift
    0.535, "reported True, recomputed False") is not, and the record's temperature is what moves it."""
    from rl_engine.campaign.captured import case_inputs
    from rl_engine.campaign.replay import replay_candidate

    case = Case.create(**SMALL, temperature=0.7)
    replay = replay_candidate(case.to_dict())
    logits, targets, active = case_inputs(case.to_dict())
    args = (replay.tensors["logp"], replay.tensors["lse"], logits, targets, active)
    drift = case.drift(*args)
    assert drift == casemod.record_oracle_drift(json.loads(json.dumps(case.to_dict())), *args)  # as read back
    assert all(stats["passed"] for stats in drift["fp32_oracle"].values()), drift["fp32_oracle"]
    cold = casemod.record_oracle_drift({k: v for k, v in case.to_dict().items() if k != "temperature"}, *args)
    assert cold["fp32_oracle"]["lse"]["passed"] is False and cold["fp32_oracle"]["lse"]["max_abs"] > 0.1


def test_the_run_name_and_verify_hash_the_case_through_one_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workflow's run name (from the config) and verify's check of it (from the evidence) call
    the case module's one hash builder; the default config's case hash is the one every run of it
    has carried (a change of the builder that moved it would rename every run and fail every
    archive's run-name check). It moved once, from ``c7d2b29e``, when the default focused suite
    became the six files less their ``ranks`` tests: the regression's arguments are part of the case."""
    from rl_engine.campaign import casename

    config = wfconfig.load_config(REPO / "config.yaml")
    assert wfconfig.config_case_hash(config) == "20acd3ab"
    calls: list[str] = []
    real = casemod.case_hash
    monkeypatch.setattr(casemod, "case_hash", lambda *a, **k: calls.append("hash") or real(*a, **k))
    named = wfconfig.config_case_hash(config)
    assert calls == ["hash"]
    document = wfconfig.config_case(config)
    plan = {"case": document["case"], "topologies": document["topologies"]}
    tests = config["regression"]["tests"]
    args = config["regression"]["pytest_args"]
    assert args == ["-m", "not slow and not ranks"]
    regression = {"tests": tests, "command": " ".join(["python -m pytest -q -rs", *tests, shlex.join(args), "--junitxml=j.xml"])}
    assert casename.evidence_case_hash(plan, regression) == named
    assert calls == ["hash", "hash"]


def test_a_case_goes_to_its_config_keys_and_back() -> None:
    """``Case.from_config`` and ``Case.to_config`` are inverses over the config keys they share
    (the default config, and a case with a temperature, which is absent from a case at 1)."""
    config = wfconfig.load_config(REPO / "config.yaml")
    for temperature in (1, 0.7):
        given = {**config, "temperature": temperature}
        case = Case.from_config(given)
        back = case.to_config([(1, 1), (2, 1)])
        assert {k: given[k] for k, _ in casemod.CONFIG_FIELDS if k in back} == {k: back[k] for k, _ in casemod.CONFIG_FIELDS if k in back}
        assert ("temperature" in back) == (temperature != 1)
        assert back["tolerances"] == {config["dtype"]: config["tolerances"][config["dtype"]]}
        assert Case.from_config({**config, **back}) == case
        assert casemod.config_key_of("timeout_s", given) == ("pg_timeout_s", config["pg_timeout_s"])
        assert casemod.config_key_of("dist_backend", given) == ("device", config["device"])


def test_reproduce_config_keys_come_in_the_order_summaries_have_always_rendered() -> None:
    """``record_config`` lists the case's keys, topologies, tolerances, the regression, then a
    capture's inputs: SUMMARY.md's reproduce.yaml, which verify re-renders byte for byte from an
    archive, depends on this order."""
    capture = {"path": "/data/c.safetensors", "sha256": "0" * 64, "size": 10, "tokens": 32, "vocab": 1024,
               "dtype": "bf16", "metadata": {}, "archive": False}
    record = {**Case.create(**SMALL).to_dict(), "capture": capture}
    config = casemod.record_config(record, [(1, 1), (2, 1)], {"tests": ["tests/test_case.py"], "pytest_args": []})
    assert list(config)[-4:] == ["topologies", "tolerances", "regression", "inputs"]
    assert config["inputs"] == {"capture": "/data/c.safetensors", "archive": False}
    assert config["pg_timeout_s"] == record["timeout_s"] and "timeout_s" not in config
    assert list(casemod.record_config(Case.create(**SMALL).to_dict(), [(1, 1)]))[-2:] == ["topologies", "tolerances"]
