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
                  prompt_tokens=3, **{"topologies": ["2x1", "4x1"], **over})
    path = tmp / "small.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("smoke")
    config = _small_config(tmp)
    out = tmp / "out"
    # one topology runs, sharded (TP 2; 4x1 does not fit two ranks and is skipped): each costs a
    # torchrun and its ranks, each a Python that imports torch, for each backend
    code = gpu_smoke.main(["--cpu-only", "--config", str(config), "--output-dir", str(out), "--max-ranks", "2",
                           "--tokens", "16", "--repeats", "2", "--bitwise-tokens", "4",
                           "--backends", "pytorch-vocab-parallel-logp-ws2,cpu-vocab-parallel-logp-ws2"])
    return code, out, jsonio.load(out / "smoke.json")


def _reuse_the_kernel_stages(monkeypatch: pytest.MonkeyPatch, result: dict[str, Any]) -> None:
    """The negative controls below change one input of the verdict; the bitwise table (Triton's
    interpreter), the timing, the roofline and the guard count are :func:`smoke_run`'s, not computed
    again for each of them."""
    monkeypatch.setattr(gpu_smoke, "bitwise_checks", lambda case, device, tokens: result["bitwise"])
    monkeypatch.setattr(gpu_smoke, "time_paths",
                        lambda case, device, tokens, repeats, sampler=None: result["timing"]["rows"])
    monkeypatch.setattr(gpu_smoke, "roofline_table", lambda case, device, tokens, timing, out_dir: result["roofline"])
    monkeypatch.setattr(gpu_smoke, "guard_table", lambda case: result["guard"])


@pytest.mark.slow
def test_cpu_only_smoke_passes_with_identical_fingerprints(smoke_run) -> None:
    code, out, result = smoke_run
    assert code == 0 and result["passed"] is True and result["failures"] == []
    assert result["device"] == "cpu" and result["topologies_run"] == ["2x1"] and result["topologies_skipped"] == ["4x1"]
    assert result["campaign_backends"] == ["pytorch-vocab-parallel-logp-ws2", "cpu-vocab-parallel-logp-ws2"]
    assert set(result["cpu_fingerprints"]) == {"pytorch-vocab-parallel-logp-ws2",
                                               "cpu-vocab-parallel-logp-ws2"}
    expected = result["cpu_fingerprints"]["pytorch-vocab-parallel-logp-ws2"]
    assert set(expected) == set(FIELDS)
    assert result["cpu_fingerprints"]["cpu-vocab-parallel-logp-ws2"] == expected
    for backend in result["campaign_backends"]:
        runs = result["device_fingerprints"][backend]
        assert sorted(runs) == ["tp2-cp1"] and all(p == expected for p in runs.values())
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
               for label in ("tp2-cp1",)}
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
               for label in ("tp2-cp1",)}
    rows = [dict(row) for row in result["timing"]["rows"]]
    next(row for row in rows if row["path"] == "floor")["median_s"] = median
    monkeypatch.setattr(gpu_smoke, "run_device_campaign", lambda case, topologies, run_dir, timeout_s: reports)
    monkeypatch.setattr(gpu_smoke, "crosscheck_run", lambda run, min_topologies: ({}, []))
    monkeypatch.setattr(gpu_smoke, "cpu_replays", lambda case: result["cpu_fingerprints"])
    _reuse_the_kernel_stages(monkeypatch, result)
    monkeypatch.setattr(gpu_smoke, "time_paths", lambda case, device, tokens, repeats, sampler=None: rows)
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
    assert result["roofline"]["sass"] == [] and result["roofline"]["launched_only"] == []
    # no clocks on the CPU: recorded as absent with the reason, every timed row's telemetry null
    assert result["telemetry"]["source"] is None and "no GPU" in result["telemetry"]["reason"]
    assert all(r["telemetry"] is None for r in result["timing"]["rows"] if "median_s" in r)
    # the guard's IEEE path counted on the timing inputs (randn * 2 logits at T = 0.7: never)
    assert result["guard"]["temperature"] == 0.7 and result["guard"]["forward_tiles"] == 64 * 8
    assert result["guard"]["forward_ieee"] == 0 and result["guard"]["backward_ieee"] == 0


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
    """Negative control: the bitwise table sees a forward whose LSE is 64 ulps off (the merge kernel's
    output, as a wrong ``L`` would make it)."""
    from rl_engine.logprob.backends.triton import triton_backend

    real = triton_backend.triton_forward

    def off_by_64_ulps(*args: Any, **kwargs: Any) -> Any:
        logp, lse, entropy, flags = real(*args, **kwargs)
        return logp, (lse.view(torch.int32) + 64).view(torch.float32), entropy, flags

    monkeypatch.setattr(triton_backend, "triton_forward", off_by_64_ulps)
    case = gpu_smoke._device_case(
        {**yaml.safe_load((REPO / "config.yaml").read_text()), "real_vocab": 1000,
         "padded_vocab": 1024, "num_vocab_tiles": 8}, "cpu")
    found = gpu_smoke.bitwise_checks(case, "cpu", 2)
    assert not any(r["equal"]["lse"] for r in found["rows"])


# ----- clocks and power beside the timings ---------------------------------------------------------


def _fake_nvidia_smi(tmp: Path, line: str) -> Path:
    """A directory holding an ``nvidia-smi`` that prints ``line`` (and records its arguments)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp / 'args'}\necho '{line}'\n")
    tool.chmod(0o755)
    return bin_dir


def test_clocks_and_power_are_sampled_from_nvidia_smi_beside_each_timing_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``nvidia-smi`` on ``PATH`` (and no NVML), the sampler reads SM and memory clocks, power and
    temperature in the background; each timed row gets the summary of the samples taken while it ran
    (or the next one), and ``[N/A]`` is recorded as null."""
    import builtins
    import time

    from rl_engine.benchmark import telemetry as gpu_telemetry

    real_import = builtins.__import__

    def no_pynvml(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "pynvml":
            raise ImportError("no NVML in this test")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    monkeypatch.setenv("PATH", f"{_fake_nvidia_smi(tmp_path, '1980, 2619, [N/A], 43')}:{__import__('os').environ['PATH']}")
    sampler = gpu_telemetry.Sampler.detect("GPU-0000", interval_s=0.01)
    assert sampler.source == "nvidia-smi" and sampler.reason is None
    with sampler:
        start = time.perf_counter()
        time.sleep(0.2)
        end = time.perf_counter()
    summary = sampler.summary(start, end)
    assert summary is not None and summary["samples"] >= 1 and summary["after"] is False
    assert summary["sm_mhz"] == {"min": 1980.0, "median": 1980.0, "max": 1980.0} and summary["power_w"] is None
    assert "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu" in (tmp_path / "args").read_text()
    assert "-i GPU-0000" in (tmp_path / "args").read_text()
    record = sampler.record()
    assert record["samples"][0]["t"] == 0.0 and record["errors"] == []
    assert sampler.summary(end + 10, end + 11) is None  # nothing sampled then


def test_without_nvml_or_nvidia_smi_telemetry_is_absent_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from rl_engine.benchmark import telemetry as gpu_telemetry

    monkeypatch.setattr(gpu_telemetry.shutil, "which", lambda name: None)
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # import pynvml raises
    sampler = gpu_telemetry.Sampler.detect()
    assert sampler.source is None and "neither pynvml (NVML) nor nvidia-smi" in sampler.reason
    with sampler:
        pass
    assert sampler.samples == [] and sampler.summary(0.0, 1e9) is None
    assert gpu_telemetry.parse_nvidia_smi(" 1410, 1593, 250.12, 37") == {
        "sm_mhz": 1410.0, "mem_mhz": 1593.0, "power_w": 250.12, "temperature_c": 37.0}
    with pytest.raises(gpu_telemetry.TelemetryError, match="expected 4 fields"):
        gpu_telemetry.parse_nvidia_smi("1410, 1593")
    with pytest.raises(gpu_telemetry.TelemetryError, match="interval_s=0"):
        gpu_telemetry.Sampler(None, "x", interval_s=0)


# ----- the SASS of the launched kernels beside the roofline's -----------------------------------------


@pytest.fixture(scope="module")
def small_roofline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The roofline of a small case (64 rows of 1,001 columns, 7 tiles; entropy and its gradient, no
    LSE gradient: the smoke's timed ``entropy`` call), compiled for sm_90."""
    pytest.importorskip("triton")
    from rl_engine.logprob.backends.triton import triton_aot

    return triton_aot.roofline(tmp_path_factory.mktemp("roofline"), rows=64, case=(997, 1001, 7), entropy_grad=True,
                               lse_grad=False)


def _compiled_launches(fusion: bool = False, temperature: float = 1.0, only: str | None = None) -> list[Any]:
    """What a process running the small case would hold in Triton's JIT caches: each launch compiled by
    ``triton.compile`` for sm_90 with the launch's own specialization (a ``CompiledKernel`` each); with
    ``only``, that kernel's launches alone (each other binary costs its SASS read: two NVIDIA tools)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rl_engine.logprob.backends.triton import triton_aot
    from rl_engine.logprob.backends.triton.triton_backend import load_kernels

    kernels = load_kernels("compiled")
    target = GPUTarget("cuda", 90, 32)
    launches = triton_aot.case_launches(64, 997, 1001, 7, torch.bfloat16, True, True, temperature, entropy_grad=True,
                                        lse_grad=False)
    out = []
    for launch in launches["forward"] + launches["backward"]:
        if only is not None and launch.kernel != only:
            continue
        fn = getattr(kernels, launch.kernel)
        sig, cx, attrs = triton_aot.launch_specialization(fn, launch, target)
        out.append(triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs), target=target,
                                  options={"enable_fp_fusion": fusion, "num_warps": launch.warps}))
    return out


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_the_sass_of_launched_binaries_is_compared_with_the_roofline_s(small_roofline: dict[str, Any]) -> None:
    """The comparison gpu-smoke makes on a GPU, on the binaries the offline compile produces: every
    roofline kernel finds the launched binary of its kernel and constants, and instructions,
    registers and local memory are equal. Negative controls: the same launches compiled with FMA
    contraction on (another binary) are flagged unequal and have more FFMA; binaries of another call (a temperature:
    other constants) match no roofline kernel and are listed apart with their SASS."""
    from rl_engine.logprob.backends.triton import triton_aot

    compiled = _compiled_launches()
    launched = [triton_aot.launched_binary(c) for c in compiled]
    table = gpu_smoke.sass_table(small_roofline, launched)
    names = [row["name"] for row in table["sass"]]
    assert names == [k["name"] for k in small_roofline["kernels"]] and table["launched_only"] == []
    assert {"forward", "forward-merge", "backward-terms", "backward-target"} <= set(names)
    for row in table["sass"]:
        assert row["launched"] is not None and all(row["equal"].values()), row
    # what launched_binaries reads on a GPU: each jit function's per-device caches
    module = type("Kernels", (), {name: type("Jit", (), {"device_caches": {0: (
        {str(i): c for i, c in enumerate(compiled) if c.src.fn.__name__ == name}, {}, None, None, None)}})
        for name in ("forward_partials_kernel", "merge_kernel", "backward_terms_kernel", "backward_kernel",
                     "backward_target_kernel")})
    assert sorted(b.kernel for b in triton_aot.launched_binaries(module)) == sorted(b.kernel for b in launched)
    fused = [triton_aot.launched_binary(c) for c in _compiled_launches(fusion=True, only="forward_partials_kernel")]
    rows = {row["name"]: row for row in triton_aot.sass_comparison(small_roofline, fused)}
    # the contraction trades FADD for FFMA (8 a thread in this forward, at the same count): another
    # binary, which the comparison flags (its registers) and whose opcodes differ
    assert not all(rows["forward"]["equal"].values()), rows["forward"]
    fused_forward = next(b for b in fused if b.kernel == "forward_partials_kernel")
    unfused_forward = next(b for b in launched if b.kernel == "forward_partials_kernel")
    assert triton_aot.read_sass(fused_forward.cubin).opcodes["FFMA"] > triton_aot.read_sass(
        unfused_forward.cubin).opcodes["FFMA"]
    other = gpu_smoke.sass_table(small_roofline, [triton_aot.launched_binary(c) for c in _compiled_launches(
        temperature=0.7)])
    assert all(row["launched"] is None and row["equal"] is None for row in other["sass"]
               if row["kernel"] != "backward_terms_kernel")
    assert {r["kernel"] for r in other["launched_only"]} >= {"forward_partials_kernel", "merge_kernel"}
    assert all(r["sass_per_thread"] > 0 and r["local_bytes"] == 0 for r in other["launched_only"])


def test_the_guard_table_counts_the_ieee_path_at_the_case_s_temperature(monkeypatch: pytest.MonkeyPatch) -> None:
    """``guard``: the forward tiles and backward blocks that take the IEEE division's path on the timing
    inputs (64 rows), at 0.7 without a temperature and at the case's own otherwise; logits scaled so
    that ``x / T - LSE`` reaches the subnormal range of ``E`` make backward blocks take it."""
    config = {**yaml.safe_load((REPO / "config.yaml").read_text()), "real_vocab": 1000, "padded_vocab": 1024,
              "num_vocab_tiles": 8}
    found = gpu_smoke.guard_table(gpu_smoke._device_case(config, "cpu"))
    assert (found["temperature"], found["rows"], found["forward_tiles"], found["backward_blocks"]) == (0.7, 64, 512, 64)
    assert found["forward_ieee"] == found["backward_ieee"] == 0
    from rl_engine.benchmark import inputs

    monkeypatch.setattr(inputs, "LOGIT_SCALE", 20.0)  # spread logits: E(x / T - LSE) underflows to subnormals
    hot = gpu_smoke.guard_table(gpu_smoke._device_case({**config, "temperature": 0.25}, "cpu"))
    assert hot["temperature"] == 0.25 and hot["backward_ieee"] > 0 and 0 < hot["backward_share"] <= 1, hot
