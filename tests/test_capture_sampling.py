"""A campaign at the capture's own sampling (case ``sampling: capture``): every topology, the replay,
the oracle and ``verify --recompute`` use each row's captured ``temperature``, ``top_k``, ``top_p``
and ``min_p``, so the campaign proves the TP/CP invariance of the processed logprobs the rollout
sampled from.

The capture (tests/_capture_case.py ``sampled_capture``) mixes per-row parameters: rows at temperature
!= 1 with and without truncation, every parameter alone and combined, and two active rows whose
target falls outside its kept set (logp ``-inf``). The real runner (``run_topology``, each rank a
gloo process of tests/_multiproc.py) at 1x1 and 2x2 (TP and CP both) gives identical fingerprints;
``verify``'s recompute and replay pass on the run. Negative controls: the same capture without the
option gives other bytes; a tampered sampling tensor is refused by the capture's hash; the option
without sampling tensors, with a scalar parameter, without a capture or on a backend whose kernels
take one temperature per call is refused by name before anything runs. The default case is
untouched. Slow: the real verbs to an archive ``verify --recompute`` passes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_engine import cli, schemas
from rl_engine.campaign.captured import capture_record, case_row_sampling, require_sampling_tensors
from rl_engine.campaign.case import Case, CaseError, case_document, case_problems, write_case_file
from rl_engine.capture import CaptureError, write_capture
from rl_engine.tables import EAGER_BACKEND, FUSED_CPU_BACKEND, TRITON_BACKEND
from rl_engine.tensorio import fingerprint

from _capture_case import (
    CASE_FIELDS,
    OUTSIDE_ROWS,
    ROW_TEMPERATURE,
    ROW_TOP_P,
    capture_case,
    sampled_capture,
    write_tiny_capture,
)

FIELDS = ("candidate_logp_sha256", "candidate_lse_sha256", "candidate_entropy_sha256", "candidate_grad_sha256")
TOPOLOGIES = ("1x1", "2x2")
CPU = torch.device("cpu")


def _write(path: Path, **changes: tuple[float, ...]) -> Path:
    write_capture(path, sampled_capture(**changes))
    return path


def _report(case: Case) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The 1x1 report of ``case`` computed in this process (the runner's own functions)."""
    from rl_engine.campaign import plan as planmod
    from rl_engine.campaign.run import build_report, compute_rank

    output = Path("/nonexistent") / "tp1-cp1.json"
    timings = {"setup_s": 0.0, "forward_s": 0.0, "backward_s": 0.0, "total_s": 0.0}
    return build_report(case, 1, 1, output, planmod.launch_command(output.with_name("plan.json"), 1, 1),
                        [compute_rank(case, 1, 1, 0, 0, 0, None, CPU)], None, timings)


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("sampled") / "rollout.safetensors")


# ----- the case ------------------------------------------------------------------------------
def test_the_option_is_its_own_case_and_its_default_changes_nothing(sampled: Path) -> None:
    plain, explicit = capture_case(sampled), capture_case(sampled, sampling="case")
    assert explicit.to_dict() == plain.to_dict() and "sampling" not in plain.to_dict()
    assert explicit.case_id == plain.case_id and not plain.case_id.endswith("-capturesampling")
    hashes = {c.run_hash(((1, 1), (2, 2)), [], []) for c in (plain, explicit)}
    assert len(hashes) == 1
    case = capture_case(sampled, sampling="capture")
    assert case.to_dict()["sampling"] == "capture" and case.case_id == plain.case_id + "-capturesampling"
    assert case.run_hash(((1, 1), (2, 2)), [], []) not in hashes  # the hash covers the option
    assert schemas.errors(case_document(case, ((1, 1), (2, 2))), "case") == []
    # the recipe's default case: no key, the id and hash it had
    recipe = Case.create(**CASE_FIELDS)
    assert Case.create(**CASE_FIELDS, sampling="case") == recipe and "sampling" not in recipe.to_dict()


def test_the_schemas_refuse_the_option_beside_a_scalar_or_without_a_capture(sampled: Path) -> None:
    document = case_document(capture_case(sampled, sampling="capture"), ((1, 1), (2, 2)))
    with_scalar = json.loads(json.dumps(document))
    with_scalar["case"]["top_p"] = 0.9
    assert schemas.errors(with_scalar, "case") != []
    without = json.loads(json.dumps(document))
    del without["case"]["capture"]
    assert schemas.errors(without, "case") != []
    other = json.loads(json.dumps(document))
    other["case"]["sampling"] = "case"  # the default is absent, never written
    assert schemas.errors(other, "case") != []


@pytest.mark.parametrize("change, named", [
    ({"temperature": 0.7}, "the case also sets temperature=0.7: one source per parameter; remove temperature"),
    ({"top_p": 0.9, "top_k": 3}, "the case also sets top_k=3, top_p=0.9: one source per parameter; remove top_k and top_p"),
    ({"min_p": 0.1}, "also sets min_p=0.1"),
])
def test_the_option_beside_a_scalar_parameter_is_refused_naming_both(sampled: Path, change: dict, named: str) -> None:
    with pytest.raises(CaseError, match="sampling='capture' takes each row's") as info:
        capture_case(sampled, sampling="capture", **change)
    assert named in str(info.value)
    capture_case(sampled, **change)  # negative control: the scalar alone is a case


def test_the_option_without_a_capture_or_of_another_value_is_refused() -> None:
    with pytest.raises(CaseError, match=r"the case has none \(the input recipe\); set inputs: \{capture: PATH\}"):
        Case.create(**CASE_FIELDS, sampling="capture")
    with pytest.raises(CaseError, match=r"sampling='rollout' is unknown; use one of \['case', 'capture'\]"):
        Case.create(**CASE_FIELDS, sampling="rollout")


def test_a_backend_without_per_row_temperature_in_processed_logprobs_is_refused_by_name(sampled: Path) -> None:
    """The Triton kernels take one temperature per call with processed logprobs (the engine refuses a
    per-row one by name): the case names the backend and the ones that compute it, before anything runs."""
    values = {**capture_case(sampled).to_dict(), "device": "cuda", "dist_backend": "nccl", "backend": TRITON_BACKEND,
              "sampling": "capture"}
    problems = dict(case_problems(values))
    assert "sampling" in problems and f"backend={TRITON_BACKEND!r} does not compute" in problems["sampling"]
    assert EAGER_BACKEND in problems["sampling"] and FUSED_CPU_BACKEND in problems["sampling"]
    assert "sampling" not in dict(case_problems({**values, "sampling": "case"}))  # negative control


def test_a_capture_without_sampling_tensors_is_refused_before_any_rank_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """File-free, the case cannot see the tensors; where the file is read (the workflow's config check,
    every rank before any collective, the replay) it is refused naming the four tensors."""
    from rl_engine.campaign import run
    from rl_engine.campaign.replay import replay_candidate
    from rl_engine.workflow import WorkflowConfigError, check_config

    bare = write_tiny_capture(tmp_path / "bare.safetensors")
    case = capture_case(bare, sampling="capture").to_dict()
    write_case_file(tmp_path / "case.json", capture_case(bare, sampling="capture"), ((1, 1), (2, 2)))
    assert cli.main(["plan", "--case", str(tmp_path / "case.json"), "--output", str(tmp_path / "plan.json")]) == 0
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)  # a rank of 1x1 in this process: it refuses before the process group
    capsys.readouterr()
    assert run.main([str(tmp_path / "plan.json"), "--tp", "1", "--cp", "1"]) == 2
    assert "carries no sampling tensors" in capsys.readouterr().err and not (tmp_path / "tp1-cp1.json").exists()
    with pytest.raises(CaptureError, match=r"carries no sampling tensors \(temperature, top_k, top_p, min_p\)"):
        require_sampling_tensors(case)
    with pytest.raises(CaptureError, match="carries no sampling tensors"):
        replay_candidate(case)
    with pytest.raises(WorkflowConfigError, match="config key 'sampling' has value 'capture'.*carries no sampling"):
        check_config(_config(bare, sampling="capture"))
    require_sampling_tensors(capture_case(bare).to_dict())  # negative control: without the option, nothing read


def _config(path: Path, **changes: object) -> dict:
    import yaml

    config = yaml.safe_load((Path(__file__).parents[1] / "config.yaml").read_text())
    config.update({"dtype": "bf16", "real_vocab": 64, "padded_vocab": 64, "num_vocab_tiles": 4, "batch": 2,
                   "seq": 8, "prompt_tokens": 3, "topologies": ["1x1", "2x2"], "inputs": {"capture": str(path)}})
    config.update(changes)
    return config


def test_the_workflow_config_carries_the_option_into_the_case_and_its_hash(sampled: Path) -> None:
    import yaml

    from rl_engine.workflow import WorkflowConfigError, check_config, config_case, config_case_hash

    on = check_config(_config(sampled, sampling="capture"))
    off = check_config(_config(sampled))
    assert config_case(on)["case"]["sampling"] == "capture" and "sampling" not in config_case(off)["case"]
    assert config_case_hash(on) != config_case_hash(off)
    assert config_case_hash(check_config(_config(sampled, sampling="case"))) == config_case_hash(off)
    default = yaml.safe_load((Path(__file__).parents[1] / "config.yaml").read_text())
    assert config_case_hash(check_config({**default, "sampling": "case"})) == config_case_hash(check_config(default))
    with pytest.raises(WorkflowConfigError, match="config key 'sampling' has value 'capture'.*also sets top_p=0.9"):
        check_config(_config(sampled, sampling="capture", top_p=0.9))
    recipe = {k: v for k, v in _config(sampled, sampling="capture").items() if k != "inputs"}
    with pytest.raises(WorkflowConfigError, match="config key 'sampling' has value 'capture'.*has none"):
        check_config(recipe)


# ----- the numbers ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", [EAGER_BACKEND, FUSED_CPU_BACKEND])
def test_every_row_is_computed_at_its_captured_parameters(sampled: Path, backend: str) -> None:
    """1x1 in this process: the report passes against the oracle's own kept set at each row's
    parameters (within 1e-6 of the FP64 oracle), the rows whose target is outside their kept set are
    ``-inf`` and only those, the replays (eager and NumPy) give the bytes; without the option the same
    capture gives other bytes (the case's scalars: raw at temperature 1)."""
    from rl_engine.arith.portable import SPEC_VERSION
    from rl_engine.arith.spec_numpy import SPEC_V1
    from rl_engine.campaign.replay import ReplayError, replay_candidate, replay_numpy

    case = capture_case(sampled, sampling="capture", backend=backend)
    report, tensors = _report(case)
    assert schemas.errors(report, "report") == [] and report["passed"] is True, report["failures"]
    assert report["drift"]["fp64_oracle"]["dlogp"]["max_abs"] <= 1e-6
    active = sampled_capture().active
    outside = torch.isneginf(tensors["logp"]) & active
    assert set(OUTSIDE_ROWS) <= set(outside.nonzero().flatten().tolist())
    assert report["drift"]["fp32_oracle"]["dlogp"]["count"] == int(active.sum()) - int(outside.sum())
    assert not bool(torch.isnan(tensors["logp"]).any())
    for replayed in (replay_candidate(case.to_dict()), replay_numpy(case.to_dict(), SPEC_VERSION)):
        assert replayed.fingerprints() == {f: report["bitwise_fingerprints"][f] for f in FIELDS}
    with pytest.raises(ReplayError, match=re.escape("the case holds its capture's per-row sampling (sampling: capture)")):
        replay_numpy(case.to_dict(), SPEC_V1)  # the first arithmetic has neither: refused, not replayed raw
    plain, _ = _report(capture_case(sampled, backend=backend))  # negative control: the case's own sampling
    assert all(plain["bitwise_fingerprints"][f] != report["bitwise_fingerprints"][f] for f in FIELDS)
    assert "sampling" not in plain["case"] and report["case"]["sampling"] == "capture"


def test_each_row_is_the_scalar_case_at_that_rows_parameters(sampled: Path) -> None:
    """Rows never mix: row r of the campaign at the captured sampling is row r of the op called with
    row r's parameters for every row (the per-row temperature and truncation reach each row)."""
    from rl_engine.campaign.captured import case_inputs
    from rl_engine.logprob import selected_logprob

    case = capture_case(sampled, sampling="capture")
    _, tensors = _report(case)
    logits, targets, active = case_inputs(case.to_dict())
    x = logits.to(torch.bfloat16)
    rows = sampled_capture().sampling
    assert rows is not None
    for row in (3, 6, 7, 11, 14, 15):  # min-p at T 0.5; all three at T 2; top-p at T 0.7; ...; every one off
        alone = selected_logprob(x[row:row + 1], targets[row:row + 1], active[row:row + 1], num_vocab_tiles=4,
                                 backend=EAGER_BACKEND, temperature=ROW_TEMPERATURE[row], top_k=int(rows.top_k[row]),
                                 top_p=float(rows.top_p[row]), min_p=float(rows.min_p[row]))
        assert fingerprint(alone.selected_logp.float()) == fingerprint(tensors["logp"][row:row + 1]), row


def _rank(rank: int, plan: str, tp: int, cp: int) -> int:
    from rl_engine.campaign.run import run_topology

    return run_topology(plan, tp, cp)


@pytest.fixture(scope="module")
def sampled_run(sampled: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    """The case at the captured sampling planned, every topology run by the real runner on gloo ranks."""
    from _multiproc import run_workers

    run_dir = tmp_path_factory.mktemp("sampled-run")
    write_case_file(run_dir / "case.json", capture_case(sampled, sampling="capture"),
                    tuple(tuple(int(x) for x in t.split("x")) for t in TOPOLOGIES))
    assert cli.main(["plan", "--case", str(run_dir / "case.json"), "--output", str(run_dir / "plan.json")]) == 0
    reports = {}
    for topology in TOPOLOGIES:
        tp, cp = (int(x) for x in topology.split("x"))
        assert run_workers(_rank, tp * cp, str(run_dir / "plan.json"), tp, cp, timeout_s=120) == [0] * (tp * cp)
        reports[topology] = json.loads((run_dir / f"tp{tp}-cp{cp}.json").read_text())
    return run_dir, reports


def test_tp_and_cp_give_the_single_rank_bytes_at_the_captured_sampling(sampled_run) -> None:
    run_dir, reports = sampled_run
    for topology, report in reports.items():
        assert report["passed"], (topology, report["failures"])
        assert report["case"]["sampling"] == "capture"
    for field in FIELDS:
        assert len({r["bitwise_fingerprints"][field] for r in reports.values()}) == 1, field
    assert {r["tp_rank"] for r in reports["2x2"]["topology"]["ranks"]} == {0, 1}
    assert {r["cp_rank"] for r in reports["2x2"]["topology"]["ranks"]} == {0, 1}


def test_report_acceptance_counts_the_kept_targets_at_the_captured_sampling(sampled_run) -> None:
    """The validation gate's acceptance of a report at the captured sampling: dlogp counted over the
    active rows whose target each row's kept set holds; the same report read as a case without the
    option (every active row counted) is refused naming the count."""
    from rl_engine.evidence.acceptance import check_report

    run_dir, reports = sampled_run
    report = reports["2x2"]
    assert check_report(report, "tp2-cp2.json", run_dir) == []
    count = report["drift"]["fp32_oracle"]["dlogp"]["count"]
    assert 0 < count < int(sampled_capture().active.sum())
    plain = json.loads(json.dumps(report))
    del plain["case"]["sampling"]
    found = [f"{f.field}: {f.message}" for f in check_report(plain, "tp2-cp2.json", run_dir)]
    assert any(f.startswith("drift.fp32_oracle.dlogp.count") for f in found), found


def test_verify_recomputes_and_replays_the_run_and_refuses_a_tampered_sampling_tensor(
        sampled_run, sampled: Path, tmp_path: Path) -> None:
    """``verify``'s recompute (inputs, oracle drift at each row's parameters) and replay pass with the
    capture; a capture whose one ``top_p`` value was changed (same size, other bytes) is refused by the
    recorded SHA-256 before any tensor of it is used, though its sampling does differ."""
    from rl_engine.evidence.verify import recompute, replay
    from rl_engine.rundir import Run

    run_dir, _ = sampled_run
    run = Run.load(run_dir)
    checks = [*recompute(run, capture=sampled), replay(run, capture=sampled)]
    assert all(c.passed for c in checks), [(c.name, c.problems) for c in checks]
    tampered = _write(tmp_path / "tampered.safetensors", top_p=(*ROW_TOP_P[:7], 0.6, *ROW_TOP_P[8:]))
    assert tampered.stat().st_size == sampled.stat().st_size
    case = capture_case(sampled, sampling="capture").to_dict()
    assert case_row_sampling(case, tampered).top_p[7] != case_row_sampling(case, sampled).top_p[7]
    sha = capture_record(sampled)["sha256"]
    refused = [*recompute(run, capture=tampered), replay(run, capture=tampered)]
    assert all(c.passed is False for c in refused)
    assert all(f"not that of the case's capture (sha256 {sha}" in " ".join(c.problems) for c in (refused[0], refused[2]))


@pytest.mark.slow  # two topologies and the real verbs end to end
def test_a_campaign_at_the_captured_sampling_runs_to_an_archive_verify_recompute_passes(
        sampled: Path, tmp_path: Path, tiny_run: Path) -> None:
    """The real verbs (plan, the ranks' runner at 1x1 and 2x2 on forked gloo processes, validate,
    crosscheck, summary, archive: tests/_capture_case.py ``campaign_to_archive``) to an archive
    ``verify --recompute --capture`` passes: the inputs, the oracle drift at each row's
    parameters and the candidate replayed; SUMMARY.md says the campaign ran at the captured sampling."""
    from _capture_case import campaign_to_archive, verify_archive

    case = capture_case(sampled, sampling="capture")
    run_dir, archive = campaign_to_archive(tmp_path, case, TOPOLOGIES, tiny_run)
    one, two = (json.loads((run_dir / f"tp{t}-cp{t}.json").read_text()) for t in (1, 2))
    assert one["bitwise_fingerprints"] == two["bitwise_fingerprints"] and two["case"]["sampling"] == "capture"
    assert "Sampling: each row's own temperature, top_k, top_p and min_p" in (run_dir / "SUMMARY.md").read_text()
    code, checks = verify_archive(archive, tmp_path, "--recompute", "--capture", str(sampled))
    assert code == 0, {n: c for n, c in checks.items() if c["status"] != "PASS"}
    for row in ("report acceptance", "inputs regenerated", "oracle drift recomputed", "candidate replayed"):
        assert checks[row]["status"] == "PASS", (row, checks[row])


def test_the_described_capability_is_what_each_engine_does(sampled: Path) -> None:
    """``processed_row_temperature`` in each backend's description (what the case rule reads) is what
    its engine does: the eager and fused C ops take a temperature per row with processed parameters in
    one call and give the same bytes; the Triton engine refuses that call by name (its kernels take one
    temperature per call), so its description says False."""
    from rl_engine.logprob.backends.description import descriptions, processed_row_temperature_backends
    from rl_engine.logprob.backends.triton.triton_backend import _refuse_row_temperature
    from rl_engine.logprob.contract import LogprobContractError
    from rl_engine.logprob.registry import default_registry, dispatch

    assert set(processed_row_temperature_backends()) == {EAGER_BACKEND, FUSED_CPU_BACKEND}
    assert {d.backend_id for d in descriptions() if d.processed_logprobs} >= {EAGER_BACKEND, FUSED_CPU_BACKEND,
                                                                            TRITON_BACKEND}
    capture = sampled_capture()
    case = capture_case(sampled, sampling="capture")
    contract = case.contract()
    kwargs = case.op_sampling(contract.num_tokens, "cpu", capture.sampling)
    assert set(kwargs) == {"temperature", "sampling"}
    outs = {}
    for backend in (EAGER_BACKEND, FUSED_CPU_BACKEND):
        op = dispatch(backend, contract, "cpu", processed=True).op
        out = op(capture.logits, capture.targets, capture.active, contract, **kwargs)
        outs[backend] = fingerprint(out.selected_logp)
    assert len(set(outs.values())) == 1
    with pytest.raises(LogprobContractError, match="does not compute processed logprobs .* with a temperature per row"):
        _refuse_row_temperature(kwargs["temperature"])
    # the registry reads the same flag: dispatch finds Triton incapable of the call (auto passes it over on a
    # GPU; asked for by name it is refused before any launch), and the others capable
    registry = default_registry()
    per_row = "processed logprobs (top_k / top_p / min_p) with a temperature per row not supported"
    for backend, spec in registry.items():
        reasons = spec.capabilities.reasons_incapable(contract, "cuda", processed=True, row_temperature=True)
        assert (per_row in reasons) == (backend == TRITON_BACKEND), (backend, reasons)
        assert per_row not in spec.capabilities.reasons_incapable(contract, "cuda", processed=True)
    with pytest.raises(LogprobContractError, match=re.escape(per_row)):
        dispatch(TRITON_BACKEND, contract, "cpu", processed=True, row_temperature=True)



def test_summary_and_reproduce_yaml_say_which_sampling_the_campaign_used(sampled: Path) -> None:
    """SUMMARY.md's Inputs line names the sampling (the capture's per-row, or the case's own); its
    reproduce.yaml carries ``sampling: capture`` back into a config whose case is this one."""
    from rl_engine.campaign.case import config_case_fields, record_config
    from rl_engine.evidence.summary import inputs_text

    on, off = capture_case(sampled, sampling="capture"), capture_case(sampled)
    assert "Sampling: each row's own temperature, top_k, top_p and min_p" in inputs_text(on.to_dict())
    assert "Sampling: the case's own" in inputs_text(off.to_dict())
    for case in (on, off):
        config = {**record_config(case.to_dict(), ((1, 1), (2, 2))), "campaign": "x"}
        assert ("sampling" in config) is (case is on)
        assert Case(**config_case_fields(config, case.capture)) == case
