"""Values that passed the parse-time check and failed later, or never.

``seed=2**70`` failed only inside the input recipe, after two stages had run;
``logit_scale=1e39`` gave infinite logits; ``seq=2**40`` dry-ran fine; ``regression.tests:
../../../../etc/passwd`` was accepted. Each is now refused by ``check_config`` (what the
Snakefile calls when it is parsed; the ``snakemake -n`` run is in ``tests/test_gates_config.py``,
``[bounds]``), naming the key, the value and the fix; the bounds themselves are tested against
the input recipe (the seed's range, the largest logit the recipe can make).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from rl_engine.campaign.inputs import InputSpecError, _bell, make_inputs
from rl_engine.tables import LOGIT_SCALE_BOUNDS, MAX_LOGIT_ELEMENTS, MAX_SEED, MAX_TOKENS
from rl_engine.workflow import Origin, WorkflowConfigError, check_config, regression_problems

from _workflow_util import REPO, SMALL_VOCAB

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def base() -> dict[str, Any]:
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config.update(SMALL_VOCAB, topologies=["1x1", "2x1"])
    return config


BAD: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("seed 2**70", {"seed": 2**70},
     (f"config key 'seed' has value {2**70}", "exceeds 18446744073709551615 (2**64 - 1)",
      "use a seed in [0, 2**64 - 1]")),
    ("seed 2**64", {"seed": 2**64}, ("config key 'seed' has value 18446744073709551616",)),
    ("logit_scale 1e39", {"logit_scale": 1e39},
     ("config key 'logit_scale' has value 1e+39", "exceeds 8.47383e+37 for dtype bf16",
      "use logit_scale <= 8.47383e+37")),
    ("logit_scale infinite in fp16", {"dtype": "fp16", "logit_scale": 20000.0},
     ("config key 'logit_scale' has value 20000.0", "exceeds 16376 for dtype fp16", "use logit_scale <= 16376")),
    ("seq 2**40", {"seq": 2**40},
     (f"config key 'seq' has value {2**40}", "exceeds 1048576 (2**20)", "use a seq of at most 1048576")),
    ("batch 2**21", {"batch": 2**21}, ("config key 'batch' has value 2097152", "exceeds 1048576")),
    ("batch x seq", {"batch": 2**17},
     ("config key 'batch' has value 131072", "x seq=16 = 2097152 tokens exceed the bound 1048576",
      "lower batch or seq")),
    ("logits above 2**32", {"batch": 2**16, "real_vocab": 8192, "padded_vocab": 8192},
     ("config key 'padded_vocab' has value 8192", "x batch*seq=1048576 tokens = 8589934592 logits",
      "exceed the bound 4294967296 (2**32", "lower the vocabulary, batch or seq")),
    ("tests escaping with ..", {"regression": {"tests": ["../../../../etc/passwd"]}},
     ("config key 'regression.tests[0]' has value '../../../../etc/passwd'",
      "must be a relative path inside tests/ without '..'", "fix the value in config.yaml")),
    ("tests .. inside tests/", {"regression": {"tests": ["tests/../../../etc/passwd"]}},
     ("config key 'regression.tests[0]'", "without '..'")),
    ("tests absolute", {"regression": {"tests": ["/etc/passwd"]}}, ("'/etc/passwd'", "relative path inside tests/")),
    ("tests outside tests/", {"regression": {"tests": ["rl_engine/cli.py"]}},
     ("config key 'regression.tests[0]' has value 'rl_engine/cli.py'", "inside tests/")),
    ("tests missing", {"regression": {"tests": ["tests/test_logprob_contract.py", "tests/test_absent.py::x"]}},
     ("config key 'regression.tests[1]' has value 'tests/test_absent.py::x'", "does not exist")),
]


@pytest.mark.parametrize(("overrides", "expected"), [pytest.param(o, e, id=i) for i, o, e in BAD])
def test_parse_time_bounds_refuse_naming_key_value_and_fix(overrides: dict[str, Any], expected: tuple[str, ...],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # Snakemake resolves the regression's test files in its working directory
    config = {**base(), **overrides}
    with pytest.raises(WorkflowConfigError) as raised:
        check_config(config)
    for part in expected:
        assert part in str(raised.value), (part, str(raised.value))


def test_values_at_the_bounds_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: each bound itself is accepted, and a test id after the file too."""
    monkeypatch.chdir(REPO)
    for dtype, bound in LOGIT_SCALE_BOUNDS.items():
        check_config({**base(), "dtype": dtype, "logit_scale": bound})
    check_config({**base(), "seed": MAX_SEED})
    check_config({**base(), "batch": MAX_TOKENS // 16, "seq": 16})  # 2**20 tokens x 1024 = 2**30 logits
    check_config({**base(), "batch": 1, "seq": 2**20, "prompt_tokens": 8})
    tokens = MAX_LOGIT_ELEMENTS // 4096
    check_config({**base(), "batch": tokens // 16, "seq": 16, "real_vocab": 4096, "padded_vocab": 4096})
    check_config({**base(), "regression": {"tests": ["tests/test_logprob_contract.py::test_x"]}})


def test_the_largest_recipe_logit_at_the_bound_is_finite_in_its_dtype() -> None:
    """The recipe's extreme |bell| (every 16-bit piece 0 or 0xFFFF) times the bound, rounded as
    the recipe rounds, is finite in the dtype; 1.25 x the bound overflows (the bound is that tight)."""
    extreme = _bell(np.array([0xFFFF_FFFF_FFFF_FFFF, 0], dtype=np.uint64))
    assert extreme[0] == -extreme[1] and 3.46 < float(extreme[0]) < 3.47
    for dtype, bound in LOGIT_SCALE_BOUNDS.items():
        for scale, finite in ((bound, True), (bound * 1.25, False)):
            logits = torch.from_numpy(extreme * np.float32(scale)).to(TORCH_DTYPES[dtype])
            assert bool(torch.isfinite(logits).all()) is finite, (dtype, scale, logits)


def test_the_seed_bound_is_the_recipe_s_range() -> None:
    """2**64 - 1 makes inputs; 2**64 is refused by the recipe's own check (was an OverflowError)."""
    case = {"batch": 1, "seq": 4, "prompt_tokens": 1, "real_vocab": 8, "padded_vocab": 8, "seed": MAX_SEED}
    logits, _, _ = make_inputs(case)
    assert bool(torch.isfinite(logits).all())
    with pytest.raises(InputSpecError, match="seed=18446744073709551616 exceeds"):
        make_inputs({**case, "seed": MAX_SEED + 1})


def test_a_test_file_linked_out_of_tests_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_ok.py").write_text("def test_ok():\n    pass\n")
    os.symlink("/etc/hostname", tmp_path / "tests" / "test_link.py")
    config = {"regression": {"tests": ["tests/test_ok.py", "tests/test_link.py"]}}
    problems = regression_problems(config, Origin(), root=tmp_path)
    assert len(problems) == 1 and "'regression.tests[1]'" in problems[0], problems
    assert "leads out of tests/ (through a symbolic link)" in problems[0]


# ----- numbers beyond binary64 ----------------------------------------------------------------------
# ``10**400`` is a YAML integer the schema's "type: number" passes; ``float()`` and ``math.isfinite``
# of it raise a bare ``OverflowError``. check-config and ``snakemake -n`` died with it (exit 1), and
# ``selected_logprob(temperature=10**400)`` too. One check refuses it in a config (check_config, before
# any number of the config is converted), one rule in a case (its number rule), one in the temperature.
HUGE = 10**400
HUGE_SHOWN = "100000000000... (an integer of 401 digits)"
HUGE_KEYS: dict[str, dict[str, Any]] = {
    "temperature": {"temperature": HUGE},
    "logit_scale": {"logit_scale": HUGE},
    "pg_timeout_s": {"pg_timeout_s": HUGE},
    "tolerances.bf16.atol": {"tolerances": {"bf16": {"atol": HUGE, "rtol": 0.0}}},
    "tolerances.bf16.rtol": {"tolerances": {"bf16": {"atol": 0.05, "rtol": HUGE}}},
    "topology_timeout_s": {"topology_timeout_s": HUGE},
    "seed": {"seed": HUGE},
    "ratio_bounds": {"parity": {"rollout": "r.safetensors", "trainer": "t.safetensors", "ratio_bounds": [0.8, HUGE]}},
}


@pytest.mark.parametrize("key", sorted(HUGE_KEYS))
def test_an_integer_beyond_binary64_is_refused_naming_the_key_and_check_config_exits_2(
        key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from rl_engine.workflow.config import main as check_config_main

    monkeypatch.chdir(REPO)
    config = {**base(), **HUGE_KEYS[key]}
    named = "parity.ratio_bounds[1]" if key == "ratio_bounds" else key
    expected = (f"config key {named!r} has value {HUGE_SHOWN}: not a finite number: an integer beyond binary64's "
                "range (about 1.8e308) has no float value; use a finite value")
    with pytest.raises(WorkflowConfigError) as raised:
        check_config(config)
    assert expected in str(raised.value), str(raised.value)
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    assert check_config_main([str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and "OverflowError" not in err


def test_a_case_refuses_numbers_beyond_binary64_by_its_own_rules() -> None:
    """Without the config's check (a case built by the API, ``plan`` or a case file), each float field's
    rule names it; ``timeout_s`` is bounded by what torch holds (1e15 s was finite, and failed every
    rank's ``init_mesh`` with an OverflowError), and the bound itself passes."""
    from rl_engine.campaign.case import Case, CaseError, case_problems
    from rl_engine.tables import MAX_PG_TIMEOUT_S

    for field in ("logit_scale", "atol", "rtol", "timeout_s", "temperature"):
        problems = case_problems({field: HUGE})
        assert [f for f, _ in problems] == [field] and HUGE_SHOWN in problems[0][1], problems
    fields = dict(device="cpu", dtype="bf16", backend="pytorch-vocab-parallel-logp-ws2", real_vocab=60,
                  padded_vocab=64, num_vocab_tiles=4, batch=2, seq=8, prompt_tokens=4, seed=7)
    with pytest.raises(CaseError, match=r"timeout_s=1000000000000000.0 exceeds 1e\+09 s, the longest process-group timeout"):
        Case.create(**fields, timeout_s=1e15)
    assert Case.create(**fields, timeout_s=MAX_PG_TIMEOUT_S).timeout_s == MAX_PG_TIMEOUT_S  # control


def test_the_api_refuses_numbers_beyond_binary64_with_its_own_errors() -> None:
    """The API path's conversions of a caller's number: the temperature of ``selected_logprob`` (was an
    OverflowError), the comparison harness's tolerance, a GRPO coefficient and ``init_mesh``'s timeout."""
    from rl_engine.arith.temperature import TemperatureError, inverse_temperature
    from rl_engine.distributed.mesh import MeshError, init_mesh
    from rl_engine.grpo.contract import GRPOContract, GRPOContractError
    from rl_engine.logprob.api import selected_logprob
    from rl_engine.logprob.comparison import ComparisonError, compare_single_rank
    from rl_engine.logprob.contract import LogprobContractError

    logits, targets = torch.zeros(4, 16), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(LogprobContractError, match=re.escape(f"temperature={HUGE_SHOWN} is outside [2**-64, 2**64]")):
        selected_logprob(logits, targets, num_vocab_tiles=1, temperature=HUGE)
    with pytest.raises(TemperatureError, match=re.escape("is outside [2**-64, 2**64]")):
        inverse_temperature(-HUGE)
    with pytest.raises(ComparisonError, match=re.escape(f"atol={HUGE_SHOWN} must be a finite number")):
        compare_single_rank(logits, targets, torch.ones(4, dtype=torch.bool), real_vocab=16, num_vocab_tiles=1,
                            dtype="fp32", backend="pytorch-vocab-parallel-logp-ws2", atol=HUGE)
    with pytest.raises(GRPOContractError, match=re.escape(f"beta={HUGE_SHOWN} must be finite (an integer beyond")):
        GRPOContract.build(logprob={"real_vocab_size": 16, "padded_vocab_size": 16, "num_vocab_tiles": 1},
                           num_sequences=2, seq_len=4, group_size=2, beta=HUGE)
    with pytest.raises(MeshError, match=re.escape(f"timeout_s={HUGE_SHOWN} must be a number > 0 and <= 1e+09 s")):
        init_mesh(tp=1, timeout_s=HUGE, environ={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
