"""The TP x CP comparison runner: plan, refusals, layouts, reports, real torchrun runs, launch.

Real processes: one 8-rank gloo world computes every topology of the default matrix in both
CP layouts with the runner's own per-rank function; real ``torchrun`` runs (through the
``launch`` verb) write a passing TP=2 x CP=2 report, a perturbed report that fails, refuse a
WORLD_SIZE that disagrees with TP*CP, and get killed at the time limit.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rl_engine import cli, jsonio, schemas
from rl_engine.campaign import case as campaign
from rl_engine.campaign import plan as planmod
from rl_engine.campaign.captured import case_rank_inputs
from rl_engine.campaign.case import Case, CaseError
from rl_engine.campaign.faults import Fault, FaultError, fault_from_env, parse_fault
from rl_engine.campaign.inputs import PADDING_LOGIT, inputs_sha256, make_inputs
from rl_engine.campaign.plan import load_plan
from rl_engine.campaign.plan import main as plan_main
from rl_engine.campaign.run import (
    assemble,
    build_report,
    compute_rank,
    main,
    rank_contract,
    tp_replication_failures,
    write_report,
)
from rl_engine.distributed.bounds import token_indices
from rl_engine.distributed.mesh import ParallelDims
from rl_engine.logprob.backends.eager.vocab_parallel import BACKEND_ID
from rl_engine.logprob.comparison import ComparisonError, compare_single_rank
from rl_engine.tables import DEFAULT_TOPOLOGIES
from rl_engine.tensorio import fingerprint

from _case_argv import case_argv
from _multiproc import run_workers
from _procs import mentioning

# the case flags of the guide's plan command, and the case they name (with the defaults they leave out)
FLAG_VALUES: dict[str, Any] = dict(device="cpu", dtype="bf16", backend=BACKEND_ID, real_vocab=1000, padded_vocab=1024,
                                   num_vocab_tiles=8, batch=2, seq=16, prompt_tokens=8, seed=123)
FLAGS = case_argv(**FLAG_VALUES)
CASE = dict(**FLAG_VALUES, cp_layout="contiguous", logit_scale=1.0, threads_per_rank=1)
FP_KEYS = ("candidate_logp_sha256", "candidate_lse_sha256", "candidate_entropy_sha256", "candidate_grad_sha256")
CPU = torch.device("cpu")
GUIDE_SCRIPT = Path(__file__).resolve().parents[1] / "rl_engine" / "testing" / "distributed_logprob_comparison.py"


def _case(**overrides: Any) -> Case:
    return Case.create(**{**CASE, "dist_backend": None, "atol": None, "rtol": None, **overrides})


def _plan(tmp_path: Path, *extra: str, flags: list[str] = FLAGS) -> tuple[int, Path]:
    output = tmp_path / "plan.json"
    return plan_main(["--plan", *flags, *extra, "--output", str(output)]), output


def _single_rank_reference(case: Case) -> dict[str, Any]:
    logits, targets, active = make_inputs(case)
    return compare_single_rank(logits, targets, active, real_vocab=case.real_vocab,
                               num_vocab_tiles=case.num_vocab_tiles, dtype=case.dtype,
                               backend=case.backend, num_sequences=case.batch)


# ----- inputs -----------------------------------------------------------------------------
def test_inputs_follow_the_documented_recipe() -> None:
    logits, targets, active = make_inputs(CASE)
    mask = (1 << 64) - 1

    def splitmix(index: int) -> int:  # docs/arithmetic.md section 10, in Python integers
        z = (123 * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    unit = torch.tensor(float.fromhex("0x1.bb67aep-16"), dtype=torch.float32)
    for row, col in ((0, 0), (0, 999), (5, 17), (31, 998)):
        z = splitmix(row * 1024 + col)
        n = sum((z >> shift) & 0xFFFF for shift in (0, 16, 32, 48))
        want = torch.tensor(float(n - 131070), dtype=torch.float32) * unit
        assert logits[row, col].view(torch.int32).item() == want.view(torch.int32).item()
    assert bool((logits[:, 1000:] == PADDING_LOGIT).all())
    assert targets.tolist() == [splitmix(2**62 + row) % 1000 for row in range(32)]
    assert active.tolist() == [p >= 8 for _ in range(2) for p in range(16)]
    again = make_inputs(dict(CASE))
    assert inputs_sha256(*again) == inputs_sha256(logits, targets, active)
    assert inputs_sha256(*make_inputs({**CASE, "seed": 124}))["logits"] != inputs_sha256(logits, targets, active)["logits"]
    scaled = make_inputs({**CASE, "logit_scale": 2.0})[0]
    assert fingerprint(scaled[:, :1000]) == fingerprint(logits[:, :1000] * 2.0)



@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_a_rank_makes_only_its_part_of_the_inputs_with_the_bytes_of_the_whole(
        layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank of every default topology makes its tokens and columns alone (the runner's
    ``case_rank_inputs``: the whole recipe is never made for a rank's part), and gets the bytes of
    the same slice of the whole case's inputs; padding columns included (real 1000 of 1024, so the
    last TP shard straddles the boundary)."""
    from rl_engine.campaign import inputs
    from rl_engine.campaign.inputs import InputSpecError, make_input_part

    case = Case.create(**{**CASE, "cp_layout": layout})
    whole = make_inputs(case.to_dict())
    monkeypatch.setattr(inputs, "make_inputs", lambda *a, **k: pytest.fail("a rank made the whole recipe"))
    for tp, cp in DEFAULT_TOPOLOGIES:
        for tp_rank in range(tp):
            for cp_rank in range(cp):
                contract = case.contract(tp, cp, tp_rank, cp_rank)
                part = case_rank_inputs(case.to_dict(), contract)
                rows = torch.tensor(contract.token_indices, dtype=torch.int64)
                want = (whole[0][rows, contract.vocab_start:contract.vocab_end], whole[1][rows], whole[2][rows])
                assert [t.numpy().tobytes() for t in part] == [t.contiguous().numpy().tobytes() for t in want], \
                    (tp, cp, tp_rank, cp_rank)
                assert [t.dtype for t in part] == [torch.float32, torch.int64, torch.bool]
    for rows, start, stop in (([32], 0, 8), ([0], 8, 4), ([0], 0, 1025), ([-1], 0, 8)):
        with pytest.raises(InputSpecError, match="to take a part of these inputs"):
            make_input_part(case.to_dict(), rows, start, stop)


# ----- plan -------------------------------------------------------------------------------
def test_plan_default_matrix_order_and_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, output = _plan(tmp_path)
    assert rc == 0
    plan = jsonio.load(output)
    assert schemas.errors(plan, "plan") == []
    assert [(t["tp"], t["cp"]) for t in plan["topologies"]] == [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2)]
    assert plan["case_id"] == "bf16-v1000-p1024-t8-b2-s16-pt8-seed123-contiguous-scale1"
    assert plan["case"] == _case().to_dict() and "tp" not in plan["case"]
    assert load_plan(output)[0] == _case()  # the plan holds the case; nothing else does
    printed = capsys.readouterr().out.splitlines()
    for entry in plan["topologies"]:
        tp, cp, n = entry["tp"], entry["cp"], entry["tp"] * entry["cp"]
        assert entry["world_size"] == n
        assert entry["output"] == f"tp{tp}-cp{cp}.json"  # beside the plan: no machine's path in it
        assert entry["command"] == (f"torchrun --standalone --nproc-per-node={n} -m rl_engine.campaign.run "
                                    f"{output} --tp {tp} --cp {cp}")
        assert entry["command"] in printed
        # the plan records the argv launch runs, and prints shlex.join of it
        assert entry["command"] == shlex.join(entry["argv"]) and shlex.split(entry["command"]) == entry["argv"]
        argv = planmod.interpreter_argv(entry["argv"])
        assert argv[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
        assert argv[3:] == entry["argv"][1:]  # only torchrun itself is replaced, by this interpreter's module


def test_plan_topologies_and_single_topology(tmp_path: Path) -> None:
    rc, output = _plan(tmp_path, "--topologies", "8x1,1x4,2x2", "--cp-layout", "zigzag")
    assert rc == 0
    plan = jsonio.load(output)
    assert [(t["tp"], t["cp"]) for t in plan["topologies"]] == [(8, 1), (1, 4), (2, 2)]
    assert plan["case"]["cp_layout"] == "zigzag" and plan["case_id"].endswith("-zigzag-scale1")
    rc, output = _plan(tmp_path, "--tp", "2", "--cp", "1", "--atol", "0.01", "--threads-per-rank", "2")
    plan = jsonio.load(output)
    assert rc == 0 and [(t["tp"], t["cp"]) for t in plan["topologies"]] == [(2, 1)]
    assert plan["case"]["atol"] == 0.01 and plan["case"]["threads_per_rank"] == 2
    assert "--atol" not in plan["topologies"][0]["command"]  # the case lives in the plan only


def test_guide_case_id_and_tolerances() -> None:
    case = Case.create(device="cpu", dist_backend=None, dtype="bf16", backend=BACKEND_ID, real_vocab=151936,
                       padded_vocab=151936, num_vocab_tiles=64, batch=2, seq=16, prompt_tokens=8, seed=123,
                       cp_layout="contiguous", logit_scale=1.0, atol=None, rtol=None, threads_per_rank=1)
    assert case.case_id == "bf16-v151936-p151936-t64-b2-s16-pt8-seed123-contiguous-scale1"
    assert (case.dist_backend, case.atol, case.rtol) == ("gloo", 0.05, 0.0)
    assert (_case(dtype="fp16").atol, _case(dtype="fp32").atol) == (0.005, 1e-5)


REFUSALS = [
    ({"backend": "auto"}, (), "backend='auto' is refused"),
    ({"backend": "nope"}, (), "backend='nope' is not registered"),
    ({"num_vocab_tiles": "7"}, (), "num_vocab_tiles=7 does not divide padded_vocab=1024"),
    ({}, ("--topologies", "1x1,3x1"), "tp=3 does not split num_vocab_tiles=8 evenly"),
    ({}, ("--tp", "3", "--cp", "1"), "topology 3x1: tp=3 does not split num_vocab_tiles=8 evenly"),
    ({"prompt_tokens": "16"}, (), "prompt_tokens=16 must be < seq=16"),
    ({"num_vocab_tiles": "4"}, ("--topologies", "1x1,4x2"), "tp*cp=8 ranks exceed num_vocab_tiles=4"),
    ({"seq": "12", "prompt_tokens": "2"}, ("--cp-layout", "zigzag", "--tp", "1", "--cp", "4"),
     "cannot be split into 8 equal chunks for cp=4"),
    ({"num_vocab_tiles": "64"}, ("--tp", "16", "--cp", "1"), "tp=16 exceeds the supported maximum 8"),
    ({}, ("--topologies", "1x1,1x8"), "cp=8 exceeds the supported maximum 4"),
    ({}, ("--dist-backend", "nccl"), "dist_backend='nccl' does not serve device='cpu'"),
    ({"real_vocab": "2000"}, (), "real_vocab=2000 exceeds padded_vocab=1024"),
    ({}, ("--topologies", "2x"), "is not <TP>x<CP>"),
    ({}, ("--topologies", "1x1,1x1"), "lists 1x1 twice"),
    ({}, ("--topologies", "2x1"), "--topologies: 1 topology listed, but the cross-topology check compares at "
     "least 2; list 2 or more (e.g. 1x1 and 2x1); to plan one topology alone use --tp T --cp C"),
    ({}, ("--tp", "2"), "give both or neither"),
    ({}, ("--logit-scale", "0"), "logit_scale=0.0 must be > 0"),
    ({}, ("--atol", "nan"), "atol=nan must be a finite number"),
]


@pytest.mark.parametrize(("changed", "extra", "message"), REFUSALS, ids=[r[2][:40] for r in REFUSALS])
def test_plan_time_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str], changed: dict[str, str],
                            extra: tuple[str, ...], message: str) -> None:
    rc, output = _plan(tmp_path, *extra, flags=case_argv(**{**FLAG_VALUES, **changed}))
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not output.exists()


def test_usage_errors_return_2_and_help_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--plan", "--device", "cpu"]) == 2
    assert "required" in capsys.readouterr().err
    assert plan_main(["--plan", "--device", "cpu", "--output", "p.json"]) == 2
    assert "the case needs --dtype, --backend" in capsys.readouterr().err
    assert plan_main(["--help"]) == 0
    assert main(["--help"]) == 0


def test_cli_plan_verb_is_the_guides_plan_command(tmp_path: Path) -> None:
    assert cli.main(["plan", *FLAGS, "--output", str(tmp_path / "p.json")]) == 0
    assert jsonio.load(tmp_path / "p.json")["case_id"].startswith("bf16-v1000")


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
def test_guide_plan_command_runs_as_a_script(tmp_path: Path) -> None:
    """The guide's command, script path and all, from another working directory."""
    proc = subprocess.run(
        [sys.executable, str(GUIDE_SCRIPT), "--plan", *FLAGS, "--output", str(tmp_path / "plan.json")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("torchrun --standalone") == 6
    assert schemas.errors(jsonio.load(tmp_path / "plan.json"), "plan") == []
    # then the guide's next step: a printed torchrun line, run as printed, from the repository root
    line = next(text for text in proc.stdout.splitlines() if text.startswith("torchrun ") and text.endswith("--tp 1 --cp 1"))
    ran = subprocess.run(line, shell=True, cwd=GUIDE_SCRIPT.parents[2], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    report = jsonio.load(tmp_path / "tp1-cp1.json")
    assert report["passed"] is True and report["launch_command"] == line


# ----- layouts ----------------------------------------------------------------------------
def test_rank_mapping_is_tp_fastest() -> None:
    dims = ParallelDims(dp=1, cp=2, tp=4, world_size=8)
    assert [dims.coords(r) for r in range(8)] == [(0, r // 4, r % 4) for r in range(8)]
    case = _case()
    for rank in range(8):
        cp_rank, tp_rank = divmod(rank, 4)
        contract = rank_contract(case, 4, 2, tp_rank, cp_rank)
        assert (contract.vocab_start, contract.vocab_end) == (tp_rank * 256, (tp_rank + 1) * 256)


@pytest.mark.parametrize(("layout", "expected"), [
    ("contiguous", [list(range(0, 8)) + list(range(16, 24)), list(range(8, 16)) + list(range(24, 32))]),
    ("zigzag", [[0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19, 28, 29, 30, 31],
                [4, 5, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23, 24, 25, 26, 27]]),
])
def test_token_bounds_for_both_layouts(layout: str, expected: list[list[int]]) -> None:
    case = _case(cp_layout=layout)
    held = [list(rank_contract(case, 2, 2, 0, cp_rank).token_indices) for cp_rank in range(2)]
    assert held == expected
    assert held == [list(token_indices(range(2), 16, 2, r, layout)) for r in range(2)]
    assert sorted(held[0] + held[1]) == list(range(32))
    # TP peers hold the same tokens
    assert rank_contract(case, 2, 2, 1, 1).token_indices == rank_contract(case, 2, 2, 0, 1).token_indices


# ----- report logic in one process ---------------------------------------------------------
def _one_rank_report(case: Case, fault: Fault | None = None,
                     tmp: Path | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[dict[str, Any]]]:
    results = [compute_rank(case, 1, 1, 0, 0, 0, None, CPU)]
    output = (tmp or Path("/nonexistent")) / "tp1-cp1.json"
    timings = {"setup_s": 0.0, "forward_s": 0.0, "backward_s": 0.0, "total_s": 0.0}
    command = planmod.launch_command(output.with_name("plan.json"), 1, 1)
    report, tensors = build_report(case, 1, 1, output, command, results, fault, timings)
    return report, tensors, results


def test_single_process_report_is_valid_and_matches_the_harness() -> None:
    case = _case()
    report, tensors, _ = _one_rank_report(case)
    assert schemas.errors(report, "report") == []
    assert report["passed"] is True and report["failures"] == [] and report["fault_injection"] is None
    reference = _single_rank_reference(case)
    assert report["bitwise_fingerprints"] == reference["bitwise_fingerprints"]
    assert report["drift"] == reference["drift"]
    assert report["inputs_sha256"] == inputs_sha256(*make_inputs(case))
    assert report["launch_command"] == planmod.launch_command("/nonexistent/plan.json", 1, 1)
    for name in ("logp", "lse", "entropy"):
        assert report["tensors"][name]["path"] == f"tp1-cp1.{name}.f32"
        assert report["tensors"][name]["sha256"] == fingerprint(tensors[name])


def test_a_case_with_a_temperature_is_its_own_case_and_replays_from_the_evidence() -> None:
    """``temperature: 0.7`` in the case: a schema-valid passing report whose case, case id and
    fingerprints carry it, whose bytes the reviewer's replay (verify --recompute's) and the NumPy
    implementation give again, and which differ from the case at 1; 1 is the case without it."""
    from rl_engine.arith.portable import SPEC_VERSION
    from rl_engine.campaign.replay import replay_candidate, replay_numpy

    warm = _case(temperature=0.7)
    assert warm.case_id.endswith("-temp0.7") and _case(temperature=1.0).case_id == _case().case_id
    assert _case(temperature=1.0).to_dict() == _case().to_dict()  # absent at 1: hashes as before
    report, tensors, _ = _one_rank_report(warm)
    assert schemas.errors(report, "report") == [] and report["passed"] is True, report["failures"]
    assert report["case"]["temperature"] == 0.7
    replayed = replay_candidate(warm.to_dict(), spec=SPEC_VERSION)
    by_numpy = replay_numpy(warm.to_dict(), SPEC_VERSION)
    for name in ("logp", "lse", "entropy"):
        assert fingerprint(replayed.tensors[name]) == fingerprint(tensors[name]) == fingerprint(by_numpy.tensors[name])
    assert fingerprint(replayed.grad) == report["bitwise_fingerprints"]["candidate_grad_sha256"]
    cold, _, _ = _one_rank_report(_case())
    assert cold["bitwise_fingerprints"]["candidate_logp_sha256"] != report["bitwise_fingerprints"]["candidate_logp_sha256"]
    with pytest.raises(CaseError, match="temperature"):
        _case(temperature=0.0)


def test_fallback_on_a_rank_fails_acceptance() -> None:
    case = _case()
    results = [compute_rank(case, 1, 1, 0, 0, 0, None, CPU)]
    results[0]["fallback"] = True
    report, _ = build_report(case, 1, 1, Path("/x/tp1-cp1.json"), "torchrun", results, None,
                             {"setup_s": 0.0, "forward_s": 0.0, "backward_s": 0.0, "total_s": 0.0})
    assert report["passed"] is False and report["fallback"] is True
    assert report["failures"][0].startswith("backend: rank 0")
    assert schemas.errors(report, "report") == []


def test_tp_replication_compares_bytes_per_group() -> None:
    a = {"rank": 0, "tp_rank": 0, "cp_rank": 0, "fingerprints": {"logp": "a" * 64, "lse": "b" * 64, "entropy": "c" * 64}}
    b = {**a, "rank": 1, "tp_rank": 1}
    c = {**a, "rank": 2, "tp_rank": 0, "cp_rank": 1, "fingerprints": {"logp": "d" * 64, "lse": "e" * 64, "entropy": "f" * 64}}
    assert tp_replication_failures([a, b, c]) == []  # different CP groups may differ
    b["fingerprints"] = {**a["fingerprints"], "lse": "0" * 64}
    failures = tp_replication_failures([a, b, c])
    assert len(failures) == 1 and "lse differs within the TP group of cp_rank=0" in failures[0]


def test_assembly_refuses_inconsistent_coverage() -> None:
    case = _case()
    result = compute_rank(case, 1, 1, 0, 0, 0, None, CPU)
    assembled = assemble([result], case)
    assert fingerprint(assembled["logp"]) == result["fingerprints"]["logp"]
    twice = {**result, "rank": 1, "tp_rank": 0}
    with pytest.raises(ComparisonError, match="exactly once"):
        assemble([result, twice], case)


def test_perturb_fault_fails_acceptance_only_in_its_topology() -> None:
    case = _case()
    clean, _, _ = _one_rank_report(case)
    perturbed, _, _ = _one_rank_report(case, parse_fault("perturb:1x1"))
    assert perturbed["passed"] is False and perturbed["fault_injection"] == "perturb:1x1"
    assert len(perturbed["failures"]) == 1 and perturbed["failures"][0].startswith("drift: dlogp")
    assert perturbed["drift"]["fp32_oracle"]["dlogp"]["worst_token"] == 8  # first active token
    fps, clean_fps = perturbed["bitwise_fingerprints"], clean["bitwise_fingerprints"]
    assert fps["candidate_logp_sha256"] != clean_fps["candidate_logp_sha256"]
    assert fps["candidate_lse_sha256"] == clean_fps["candidate_lse_sha256"]
    assert schemas.errors(perturbed, "report") == []
    elsewhere, _, _ = _one_rank_report(case, parse_fault("perturb:2x2"))
    assert elsewhere["passed"] is True and elsewhere["fault_injection"] == "perturb:2x2"
    # even a loose tolerance cannot hide the perturbation
    loose, _, _ = _one_rank_report(_case(atol=0.5, rtol=0.1), parse_fault("perturb:1x1"))
    assert loose["passed"] is False


@pytest.mark.parametrize("text", ["perturb:2x", "kill:2x1", "hang:2x1:4", "explode:1x1", "perturb:0x1", "perturb:1x1:0"])
def test_bad_fault_strings_are_errors(text: str) -> None:
    with pytest.raises(FaultError):
        fault_from_env({"RL_ENGINE_FAULT": text})


def test_fault_strings_parse() -> None:
    assert fault_from_env({}) is None and fault_from_env({"RL_ENGINE_FAULT": ""}) is None
    assert parse_fault("kill:4x2:7") == Fault("kill", 4, 2, 7)
    assert parse_fault("hang:1x2:1").text == "hang:1x2:1"
    assert parse_fault(" perturb:2x2 ").applies(2, 2) and not parse_fault("perturb:2x2").applies(2, 1)


def test_invalid_report_is_never_written(tmp_path: Path) -> None:
    case = _case()
    report, tensors, _ = _one_rank_report(case, tmp=tmp_path)
    report["case"]["tp"] = 99
    with pytest.raises(ComparisonError, match="report.schema.json"):
        write_report(str(tmp_path / "tp1-cp1.json"), report, tensors)
    assert list(tmp_path.iterdir()) == []
    report["case"]["tp"] = 1
    write_report(str(tmp_path / "tp1-cp1.json"), report, tensors)
    for name in ("logp", "lse", "entropy"):
        data = (tmp_path / f"tp1-cp1.{name}.f32").read_bytes()
        assert hashlib.sha256(data).hexdigest() == report["bitwise_fingerprints"][f"candidate_{name}_sha256"]


def test_run_refusals_before_any_collective(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc, plan = _plan(tmp_path, "--tp", "2", "--cp", "1")
    assert rc == 0
    out = [str(plan), "--tp", "2", "--cp", "1"]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert main(out) == 2
    assert "WORLD_SIZE=3 disagrees" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RL_ENGINE_FAULT", "kill:2x1")
    assert main(out) == 2
    assert "RL_ENGINE_FAULT='kill:2x1' does not parse" in capsys.readouterr().err
    monkeypatch.delenv("RL_ENGINE_FAULT")
    assert main([str(plan), "--tp", "2"]) == 2
    assert "the following arguments are required: --cp" in capsys.readouterr().err
    assert main([str(plan), "--tp", "1", "--cp", "1"]) == 2
    assert "topology 1x1 is not in the plan" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.json"), "--tp", "2", "--cp", "1"]) == 2
    assert "write it with `python -m rl_engine plan`" in capsys.readouterr().err
    assert not dist.is_initialized()
    assert list(tmp_path.iterdir()) == [plan]


# ----- real processes ---------------------------------------------------------------------
def matrix_worker(rank: int, case_fields: dict[str, Any]) -> dict[tuple[str, int, int], dict[str, Any]]:
    """One rank of an 8-rank gloo world running every default topology in both layouts."""
    dist.init_process_group("gloo", rank=rank, world_size=8, timeout=timedelta(seconds=120))
    out: dict[tuple[str, int, int], dict[str, Any]] = {}
    for layout in ("contiguous", "zigzag"):
        case = Case.create(**{**case_fields, "cp_layout": layout})
        for tp, cp in DEFAULT_TOPOLOGIES:
            groups = [dist.new_group(list(range(c * tp, (c + 1) * tp))) for c in range(cp)]
            if rank < tp * cp:
                cp_rank, tp_rank = divmod(rank, tp)
                out[(layout, tp, cp)] = compute_rank(case, tp, cp, rank, tp_rank, cp_rank, groups[cp_rank], CPU)
            dist.barrier()
    return out


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
def test_fingerprints_equal_across_tp_cp_and_layouts() -> None:
    fields = {**CASE, "dist_backend": None, "atol": None, "rtol": None}
    per_rank = run_workers(matrix_worker, 8, fields, timeout_s=240)
    reference = _single_rank_reference(_case())["bitwise_fingerprints"]
    seen_layouts: dict[str, list[list[int]]] = {}
    for layout in ("contiguous", "zigzag"):
        case = _case(cp_layout=layout)
        for tp, cp in DEFAULT_TOPOLOGIES:
            results = [per_rank[r][(layout, tp, cp)] for r in range(tp * cp)]
            report, _ = build_report(case, tp, cp, Path(f"/x/tp{tp}-cp{cp}.json"), "torchrun", results, None,
                                     {"setup_s": 0.0, "forward_s": 0.0, "backward_s": 0.0, "total_s": 0.0})
            assert report["passed"] is True, (layout, tp, cp, report["failures"])
            assert report["tp_outputs_bitwise_replicated"] is True
            for key in FP_KEYS:
                assert report["bitwise_fingerprints"][key] == reference[key], (layout, tp, cp, key)
            if (tp, cp) == (2, 2):
                seen_layouts[layout] = [r["token_indices"] for r in report["topology"]["ranks"]]
    assert seen_layouts["contiguous"] != seen_layouts["zigzag"]  # the layouts really differ


def _launch(plan: Path, tp: int, cp: int, timeout_s: float, log: Path) -> int:
    return cli.main(["launch", "--plan", str(plan), "--tp", str(tp), "--cp", str(cp),
                     "--timeout-s", str(timeout_s), "--log", str(log)])


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
def test_torchrun_tp2_cp2_writes_a_passing_schema_valid_report(tmp_path: Path) -> None:
    rc, plan_path = _plan(tmp_path, "--tp", "2", "--cp", "2")
    assert rc == 0
    plan = jsonio.load(plan_path)
    entry = plan["topologies"][0]
    stale = tmp_path / "tp2-cp2.logp.f32"
    stale.write_bytes(b"stale")
    (tmp_path / "tp2-cp2.json").write_text("{}")
    assert _launch(plan_path, 2, 2, 240, tmp_path / "tp2-cp2.log") == 0, (tmp_path / "tp2-cp2.log").read_text()
    report = jsonio.load(tmp_path / entry["output"])  # the report lies beside the plan
    assert schemas.errors(report, "report") == []
    assert report["passed"] is True and report["failures"] == []
    assert report["requested_backend"] == report["actual_backend"] == BACKEND_ID
    assert report["fallback"] is False and report["tp_outputs_bitwise_replicated"] is True
    assert report["launch_command"] == entry["command"]
    assert report["case"] == {**plan["case"], "tp": 2, "cp": 2} and report["case_id"] == plan["case_id"]
    assert report["environment"]["world_size"] == 4 and report["environment"]["dist_backend"] == "gloo"
    assert report["inputs_sha256"] == inputs_sha256(*make_inputs(plan["case"]))
    for item in report["topology"]["ranks"]:
        cp_rank, tp_rank = divmod(item["rank"], 2)
        assert (item["cp_rank"], item["tp_rank"]) == (cp_rank, tp_rank)
        assert item["token_indices"] == list(token_indices(range(2), 16, 2, cp_rank, "contiguous"))
        assert item["vocab_bounds"] == [tp_rank * 512, (tp_rank + 1) * 512]
        assert item["actual_backend"] == BACKEND_ID and item["fallback"] is False
    for name in ("logp", "lse", "entropy"):
        data = (tmp_path / report["tensors"][name]["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == report["tensors"][name]["sha256"] \
            == report["bitwise_fingerprints"][f"candidate_{name}_sha256"]
    reference = _single_rank_reference(_case())["bitwise_fingerprints"]
    assert {k: report["bitwise_fingerprints"][k] for k in FP_KEYS} == {k: reference[k] for k in FP_KEYS}


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
def test_torchrun_perturbed_candidate_is_reported_as_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rc, plan_path = _plan(tmp_path, "--tp", "1", "--cp", "2")
    assert rc == 0
    monkeypatch.setenv("RL_ENGINE_FAULT", "perturb:1x2")
    assert _launch(plan_path, 1, 2, 240, tmp_path / "log") == 1, (tmp_path / "log").read_text()
    report = jsonio.load(tmp_path / "tp1-cp2.json")
    assert schemas.errors(report, "report") == []
    assert report["passed"] is False and report["fault_injection"] == "perturb:1x2"
    assert report["failures"] and report["failures"][0].startswith("drift: dlogp")
    reference = _single_rank_reference(_case())["bitwise_fingerprints"]
    assert report["bitwise_fingerprints"]["candidate_logp_sha256"] != reference["candidate_logp_sha256"]
    assert report["bitwise_fingerprints"]["candidate_lse_sha256"] == reference["candidate_lse_sha256"]
    assert (tmp_path / "tp1-cp2.logp.f32").is_file()  # the failing evidence is kept


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
def test_torchrun_world_size_disagreeing_with_tp_cp_is_rejected(tmp_path: Path) -> None:
    output = tmp_path / "tp2-cp1.json"
    rc, plan = _plan(tmp_path, "--tp", "2", "--cp", "1")
    assert rc == 0
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",  # one rank: the cheapest mismatch
         "-m", "rl_engine.campaign.run", str(plan), "--tp", "2", "--cp", "1"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode != 0
    assert "WORLD_SIZE=1 disagrees with dp*cp*tp=1*1*2=2" in proc.stderr
    assert "--nproc-per-node=2" in proc.stderr
    assert not output.exists()


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
def test_launch_time_limit_kills_the_group_and_leaves_no_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    rc, plan_path = _plan(tmp_path, "--tp", "1", "--cp", "2")
    assert rc == 0
    (tmp_path / "tp1-cp2.json").write_text("{}")
    (tmp_path / "tp1-cp2.lse.f32").write_bytes(b"stale")
    monkeypatch.setenv("RL_ENGINE_FAULT", "hang:1x2:1")
    assert _launch(plan_path, 1, 2, 12, tmp_path / "log") == 124
    assert "exceeded --timeout-s=12" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log", "plan.json"]
    assert mentioning(str(tmp_path / "tp1-cp2.json")) == {}


def test_launch_refuses_unplanned_topology_and_bad_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, plan_path = _plan(tmp_path, "--tp", "1", "--cp", "1")
    assert rc == 0
    assert _launch(plan_path, 2, 2, 10, tmp_path / "log") == 2
    assert "topology 2x2 is not in" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": "1", "topologies": NaN}')
    assert _launch(bad, 1, 1, 10, tmp_path / "log") == 2
    assert "non-finite literal NaN" in capsys.readouterr().err
    assert cli.main(["launch", "--plan", str(plan_path), "--tp", "1", "--cp", "1", "--timeout-s", "0"]) == 2


def test_plan_errors_name_the_field() -> None:
    with pytest.raises(CaseError, match="threads_per_rank=0 must be >= 1"):
        _case(threads_per_rank=0)
    with pytest.raises(CaseError, match="device='tpu' is unknown"):
        _case(device="tpu")
    assert campaign.parse_topologies("1x1, 2X2") == ((1, 1), (2, 2))


def test_launch_runs_the_argv_the_plan_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Launch ran an argv built beside the plan's command; now it runs the plan's argv
    (torchrun as this interpreter's module). A plan whose argv is edited launches the edited argv."""
    from rl_engine.campaign import launch

    rc, output = _plan(tmp_path, "--topologies", "1x1,1x2")
    assert rc == 0
    plan = jsonio.load(output)
    plan["topologies"][0]["argv"][-1] = "1 "  # a visible edit that stays schema-valid
    jsonio.write_json(output, plan)
    started: list[list[str]] = []

    class Started(Exception):
        pass

    def fake_popen(argv: list[str], **kwargs: Any) -> None:
        started.append(argv)
        raise Started

    monkeypatch.setattr(launch.subprocess, "Popen", fake_popen)
    with pytest.raises(Started):
        launch.main(["--plan", str(output), "--tp", "1", "--cp", "1", "--timeout-s", "30"])
    assert started == [[sys.executable, "-m", "torch.distributed.run", *plan["topologies"][0]["argv"][1:]]]
    with pytest.raises(planmod.PlanError, match="does not start with 'torchrun'"):
        planmod.interpreter_argv(["python", "-m", "rl_engine.campaign.run"])
    copied = tmp_path / "elsewhere" / "plan.json"  # its argv runs the original plan: refused, nothing started
    copied.parent.mkdir()
    copied.write_bytes(output.read_bytes())
    started.clear()
    assert launch.main(["--plan", str(copied), "--tp", "1", "--cp", "2", "--timeout-s", "30"]) == 2
    assert started == []


def test_validation_fails_a_plan_whose_command_is_not_its_argv() -> None:
    from rl_engine.evidence.validation import plan_command_findings

    entry = {"argv": ["torchrun", "--standalone", "--nproc-per-node=1", "-m", "rl_engine.campaign.run", "p.json",
                      "--tp", "1", "--cp", "1"]}
    good = {"topologies": [{**entry, "command": shlex.join(entry["argv"])}]}
    assert plan_command_findings(good) == []  # negative control
    bad = {"topologies": [{**entry, "command": shlex.join(entry["argv"]) + " --seed 8"}]}
    assert [str(f).split(":")[:2] for f in plan_command_findings(bad)] == [["plan.json", " topologies[0].command"]]
    assert plan_command_findings({"topologies": [{"command": "torchrun x"}]}) == []  # a plan from before argv
