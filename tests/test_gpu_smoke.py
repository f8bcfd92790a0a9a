"""``python -m rl_engine gpu-smoke --cpu-only``: everything the GPU smoke does but CUDA (the dry run).

A real run on a small config (torchrun campaigns with gloo ranks for two backends, CPU replays
with both CPU backends, forward and forward+backward timing of every path with its ratios)
must pass with identical fingerprints everywhere; a CPU replay
that differs by one fingerprint makes it exit 1 naming the topology and field; without CUDA
the GPU mode refuses to start (exit 2) instead of falling back to the CPU; smoke.json matches
``schemas/smoke.schema.json``, and a document that does not is never written. The bitwise table
(the Triton kernels against the fused CPU bytes at bf16/fp16/fp32 and T = 1 and 0.7) runs the
kernels under the interpreter; a kernel a few ulps off fails it (negative control).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rl_engine import gpu_smoke, jsonio, schemas

REPO = Path(__file__).resolve().parents[1]
FIELDS = gpu_smoke.FIELDS


def _small_config(tmp: Path, **over: Any) -> Path:
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config.update(real_vocab=1000, padded_vocab=1024, num_vocab_tiles=8, batch=2, seq=8,
                  prompt_tokens=3, topologies=["1x1", "2x1"], **over)
    path = tmp / "small.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("smoke")
    config = _small_config(tmp)
    out = tmp / "out"
    code = gpu_smoke.main(["--cpu-only", "--config", str(config), "--output-dir", str(out),
                           "--tokens", "64", "--repeats", "2",
                           "--backends", "pytorch-vocab-parallel-logp-ws2,cpu-vocab-parallel-logp-ws2"])
    return code, out, jsonio.load(out / "smoke.json")


def _reuse_the_kernel_stages(monkeypatch: pytest.MonkeyPatch, result: dict[str, Any]) -> None:
    """The negative controls below change one input of the verdict; the bitwise table (Triton's
    interpreter) and the timing are :func:`smoke_run`'s, not computed again for each of them."""
    monkeypatch.setattr(gpu_smoke, "bitwise_checks", lambda case, device, tokens: result["bitwise"])
    monkeypatch.setattr(gpu_smoke, "time_paths", lambda case, device, tokens, repeats: result["timing"]["rows"])


@pytest.mark.slow
def test_cpu_only_smoke_passes_with_identical_fingerprints(smoke_run) -> None:
    code, out, result = smoke_run
    assert code == 0 and result["passed"] is True and result["failures"] == []
    assert result["device"] == "cpu" and result["topologies_run"] == ["1x1", "2x1"]
    assert result["campaign_backends"] == ["pytorch-vocab-parallel-logp-ws2", "cpu-vocab-parallel-logp-ws2"]
    assert set(result["cpu_fingerprints"]) == {"pytorch-vocab-parallel-logp-ws2",
                                               "cpu-vocab-parallel-logp-ws2"}
    expected = result["cpu_fingerprints"]["pytorch-vocab-parallel-logp-ws2"]
    assert set(expected) == set(FIELDS)
    assert result["cpu_fingerprints"]["cpu-vocab-parallel-logp-ws2"] == expected
    for backend in result["campaign_backends"]:
        runs = result["device_fingerprints"][backend]
        assert sorted(runs) == ["tp1-cp1", "tp2-cp1"] and all(p == expected for p in runs.values())
        assert (out / f"campaign-cpu-{backend}" / "plan.json").exists()
    rows = result["timing"]["rows"]
    timed = {(row["path"], row["phase"]): row for row in rows if "median_s" in row}
    for phase in ("forward", "forward_backward"):
        for path in ("pytorch-vocab-parallel-logp-ws2", "cpu-vocab-parallel-logp-ws2", "naive", "floor"):
            row = timed[(path, phase)]
            assert row["median_s"] > 0 and len(row["times_s"]) == 2 and row["peak_bytes"] is None
            assert row["time_vs_floor"] == row["median_s"] / timed[("floor", phase)]["median_s"]
            assert row["time_vs_naive"] == row["median_s"] / timed[("naive", phase)]["median_s"]
    skipped = {row["path"]: row["skipped"] for row in rows if "skipped" in row}
    assert "device cpu not in ['cuda']" in skipped["triton-vocab-parallel-logp-ws2"]
    bitwise = result["bitwise"]  # the dry run of the GPU's byte table: the interpreter's kernels
    assert bitwise["mode"] == "interpreter" and bitwise["reason"] is None and len(bitwise["rows"]) == 6
    assert all(all(row["equal"].values()) for row in bitwise["rows"])


@pytest.mark.slow
def test_a_differing_cpu_fingerprint_fails_naming_topology_and_field(
    smoke_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, result = smoke_run
    reports = {label: jsonio.load(out / "campaign-cpu-pytorch-vocab-parallel-logp-ws2" / f"{label}.json")
               for label in ("tp1-cp1", "tp2-cp1")}
    forged = {b: dict(p) for b, p in result["cpu_fingerprints"].items()}
    forged["cpu-vocab-parallel-logp-ws2"]["candidate_grad_sha256"] = "0" * 64
    monkeypatch.setattr(gpu_smoke, "run_device_campaign", lambda case, topologies, run_dir, timeout_s: reports)
    monkeypatch.setattr(gpu_smoke, "crosscheck_run", lambda run, min_topologies: ({}, []))
    monkeypatch.setattr(gpu_smoke, "cpu_replays", lambda case: forged)
    _reuse_the_kernel_stages(monkeypatch, result)
    code = gpu_smoke.main(["--cpu-only", "--config", str(_small_config(tmp_path)), "--output-dir",
                           str(tmp_path / "out"), "--tokens", "8", "--repeats", "1"])
    assert code == 1
    err = capsys.readouterr().err
    assert "cpu pytorch-vocab-parallel-logp-ws2 tp2-cp1 candidate_grad_sha256" in err
    assert "cpu-vocab-parallel-logp-ws2" in err


@pytest.mark.slow
def test_cpu_only_smoke_json_matches_its_schema(smoke_run) -> None:
    _, out, result = smoke_run
    assert schemas.errors(result, "smoke") == []
    assert result["schema_version"] == "1" and result["cuda_device"] is None
    # the file is what was validated: strict JSON, read back equal
    assert jsonio.loads((out / "smoke.json").read_text(encoding="utf-8")) == result


@pytest.mark.slow
@pytest.mark.parametrize("median", [-1.0, float("nan")])
def test_a_smoke_document_that_does_not_match_its_schema_is_not_written(
    smoke_run, median: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, out, result = smoke_run
    reports = {label: jsonio.load(out / "campaign-cpu-pytorch-vocab-parallel-logp-ws2" / f"{label}.json")
               for label in ("tp1-cp1", "tp2-cp1")}
    rows = [dict(row) for row in result["timing"]["rows"]]
    next(row for row in rows if row["path"] == "floor")["median_s"] = median
    monkeypatch.setattr(gpu_smoke, "run_device_campaign", lambda case, topologies, run_dir, timeout_s: reports)
    monkeypatch.setattr(gpu_smoke, "crosscheck_run", lambda run, min_topologies: ({}, []))
    monkeypatch.setattr(gpu_smoke, "cpu_replays", lambda case: result["cpu_fingerprints"])
    _reuse_the_kernel_stages(monkeypatch, result)
    monkeypatch.setattr(gpu_smoke, "time_paths", lambda case, device, tokens, repeats: rows)
    code = gpu_smoke.main(["--cpu-only", "--config", str(_small_config(tmp_path)), "--output-dir",
                           str(tmp_path / "out"), "--tokens", "8", "--repeats", "1"])
    assert code == 1
    assert "smoke.json not written" in capsys.readouterr().err
    assert not (tmp_path / "out" / "smoke.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_gpu_mode_refuses_to_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = gpu_smoke.main(["--config", str(_small_config(tmp_path)), "--output-dir", str(tmp_path / "o")])
    assert code == 2
    assert "CUDA is not available" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_a_config_backend_that_cannot_run_on_the_device_runs_the_eager_one(tmp_path: Path) -> None:
    config = yaml.safe_load(_small_config(tmp_path, backend="cpu-vocab-parallel-logp-ws2").read_text())
    assert gpu_smoke._device_case(config, "cuda").backend == "pytorch-vocab-parallel-logp-ws2"
    assert gpu_smoke._device_case(config, "cpu").backend == "cpu-vocab-parallel-logp-ws2"
    fit, skipped = gpu_smoke._fitting({"topologies": ["1x1", "2x1", "4x2"]}, 2)
    assert fit == [(1, 1), (2, 1)] and skipped == ["4x2"]


def test_campaign_backends_default_to_triton_and_eager_on_cuda(tmp_path: Path) -> None:
    config = yaml.safe_load(_small_config(tmp_path).read_text())
    assert gpu_smoke.campaign_backends(config, "cuda", None) == [
        "triton-vocab-parallel-logp-ws2", "pytorch-vocab-parallel-logp-ws2"]
    assert gpu_smoke._device_case(config, "cuda", "triton-vocab-parallel-logp-ws2").backend == \
        "triton-vocab-parallel-logp-ws2"
    assert gpu_smoke.campaign_backends(config, "cpu", None) == [config["backend"]]
    for bad in ("nope", "pytorch-vocab-parallel-logp-ws2,pytorch-vocab-parallel-logp-ws2", ","):
        with pytest.raises(gpu_smoke.SmokeError, match="list registered backend ids once each"):
            gpu_smoke.campaign_backends(config, "cpu", bad)


def test_timing_rows_have_both_phases_ratios_and_skips_on_the_cpu() -> None:
    case = gpu_smoke._device_case(
        {**yaml.safe_load((REPO / "config.yaml").read_text()), "real_vocab": 1000,
         "padded_vocab": 1024, "num_vocab_tiles": 8}, "cpu")
    rows = gpu_smoke.time_paths(case, torch.device("cpu"), 16, 1)
    timed = [r for r in rows if "median_s" in r]
    assert {(r["path"], r["phase"]) for r in timed} >= {
        ("naive", "forward"), ("floor", "forward_backward"),
        ("cpu-vocab-parallel-logp-ws2", "forward_backward")}
    floor = next(r for r in timed if r["path"] == "floor" and r["phase"] == "forward")
    assert floor["time_vs_floor"] == 1.0 and floor["memory_vs_naive"] is None
    assert {("copy_floor", "forward"), ("copy_floor", "forward_backward")} <= {(r["path"], r["phase"]) for r in timed}


@pytest.mark.slow
def test_the_cpu_only_smoke_says_why_it_has_no_roofline(smoke_run) -> None:
    _, _, result = smoke_run
    assert result["roofline"]["rows"] == [] and "no GPU" in result["roofline"]["reason"]


def test_predicted_beside_measured_from_a_roofline_and_timing_rows() -> None:
    """The table gpu-smoke prints on a GPU: the paper model's forward and forward+backward times
    (a roofline document's numbers) next to the measured medians of the Triton backend and the floor."""
    from rl_engine.logprob.backends.triton import triton_aot

    doc = jsonio.load(Path(__file__).resolve().parent / "fixtures" / "schemas" / "roofline" / "valid"
                      / "default.json")
    rows = [{"path": gpu_smoke.TRITON_BACKEND, "phase": "forward", "median_s": 0.00101},
            {"path": "floor", "phase": "forward", "median_s": 0.00080},
            {"path": gpu_smoke.TRITON_BACKEND, "phase": "forward_backward", "median_s": 0.0030},
            {"path": "floor", "phase": "forward_backward", "median_s": 0.0025},
            {"path": "naive", "skipped": "n/a"}]
    table = triton_aot.predicted_vs_measured(doc, rows, "h100", gpu_smoke.TRITON_BACKEND)
    p = doc["predicted"]["h100"]
    fwd, both = table
    assert fwd["predicted_ms"] == p["forward_ms"] and fwd["measured_ms"] == 1.01
    assert fwd["measured_over_predicted"] == round(1.01 / p["forward_ms"], 4)
    assert both["predicted_ms"] == p["forward_ms"] + p["backward_ms"]
    assert both["floor_predicted_ms"] == p["forward_floor_ms"] + p["backward_floor_ms"]
    assert gpu_smoke.gpu_model("NVIDIA H100 80GB HBM3") == "h100" and gpu_smoke.gpu_model("NVIDIA H200") == "h200"
    assert gpu_smoke.gpu_model("NVIDIA A100-SXM4-80GB") is None


def test_bitwise_table_compares_the_triton_kernels_with_the_cpu_bytes_on_the_cpu() -> None:
    """The dry run of the GPU's byte comparison: the Triton kernels under the interpreter against
    the fused CPU backend, at bf16/fp16/fp32 and T = 1 and 0.7 (tiny shapes): every output equal."""
    case = gpu_smoke._device_case(
        {**yaml.safe_load((REPO / "config.yaml").read_text()), "real_vocab": 1000,
         "padded_vocab": 1024, "num_vocab_tiles": 8}, "cpu")
    found = gpu_smoke.bitwise_checks(case, "cpu", 4)
    assert found["mode"] == "interpreter" and found["reason"] is None, found
    assert [(r["dtype"], r["temperature"]) for r in found["rows"]] == [
        (d, t) for d in ("bf16", "fp16", "fp32") for t in (1.0, 0.7)]
    assert all(all(r["equal"].values()) for r in found["rows"]), found
    assert len({r["device_sha256"]["grad"] for r in found["rows"]}) == 6  # every case its own bytes


def test_a_differing_triton_byte_fails_the_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the bitwise table sees a kernel whose ``L`` is 64 ulps off (one ulp can be
    absorbed by the rounding of ``B + L(sum)``)."""
    from rl_engine.logprob.backends.triton import triton_backend

    real = triton_backend.triton_log

    def off_by_64_ulps(x: torch.Tensor, mode: str = "compiled") -> torch.Tensor:
        out = real(x, mode)
        return (out.view(torch.int32) + 64).view(torch.float32)

    monkeypatch.setattr(triton_backend, "triton_log", off_by_64_ulps)
    case = gpu_smoke._device_case(
        {**yaml.safe_load((REPO / "config.yaml").read_text()), "real_vocab": 1000,
         "padded_vocab": 1024, "num_vocab_tiles": 8}, "cpu")
    found = gpu_smoke.bitwise_checks(case, "cpu", 2)
    assert not any(r["equal"]["lse"] for r in found["rows"])
