"""The processed-logprob Triton kernels (docs/arithmetic.md section 13) compile, with no GPU, to
IEEE operations and exactly the specification's fused multiply-adds, and their paper roofline
(rl_engine/logprob/triton_kept_aot.py) reports every call.

* per kernel (the masked forward with entropy and validation, one search step, min-p's scan, the
  backward's zero pass), with and without a temperature, in bf16 and fp32: the PTX has no
  forbidden instruction (no approximate ``ex2``/``lg2``/``rcp``, no contracted ``mul``/``add`` to
  FMA beyond the written ones) and its FMA count per thread is the specification's: 9 per column
  of ``E`` and one more for the entropy's ``G*``, on every 128-column slot of the tile (none in
  min-p's scan or the zero pass);
* negative control: compiled with fusion on, the masked forward has more FMAs than written;
* the roofline of a small case lists the four processed kernels and the five calls, no kernel
  spills, and a processed call predicts more time than the raw one.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from rl_engine.logprob.backends.triton import triton_aot  # noqa: E402
from rl_engine.logprob.backends.triton.triton_backend import load_kernels  # noqa: E402
from rl_engine.logprob.backends.triton.triton_kept_aot import processed_launches, processed_roofline  # noqa: E402

CASE = (1000, 1024, 8)  # tile width 128
ROWS = 64
E_FMA = 9  # section 3's forward form: 9 of its 13 operations


def _ptx(name: str, dtype: torch.dtype, temperature: float, fusion: bool = False) -> tuple[str, int]:
    from triton.backends.compiler import GPUTarget

    launch = processed_launches(ROWS, *CASE, dtype, temperature)[name]
    kernels = load_kernels("compiled")
    fn = getattr(kernels, launch.kernel)
    sig, cx, attrs = triton_aot.launch_specialization(fn, launch, GPUTarget("cuda", 90, 32))
    variant = triton_aot.Variant(name, launch.kernel, sig, cx, attrs, launch.warps, launch.grid, ROWS * CASE[1])
    return triton_aot.compile_variant(fn, variant, "cuda", 90, fusion, specialized=True)["ptx"], 32 * launch.warps


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_processed_kernels_compile_to_ieee_operations_and_the_specs_fmas(dtype: torch.dtype,
                                                                         temperature: float) -> None:
    slots = math.ceil(CASE[1] // CASE[2] / 128) * 128
    want = {"kept_forward": (E_FMA + 1) * slots, "search_step": E_FMA * slots, "min_p": 0, "backward_zero": 0}
    for name, fma_columns in want.items():
        ptx, threads = _ptx(name, dtype, temperature)
        found = triton_aot.ptx_findings(ptx)
        assert found["forbidden"] == [] and found["unknown"] == [], (name, found)
        assert found["fma"] == fma_columns // threads, (name, found["fma"])
        if temperature != 1.0:
            assert "div.rn.f32" in ptx, name  # step 0 by the IEEE division


@pytest.mark.slow
def test_negative_control_fusion_on_contracts_more_fmas() -> None:
    off, _ = _ptx("kept_forward", torch.bfloat16, 1.0)
    on, _ = _ptx("kept_forward", torch.bfloat16, 1.0, fusion=True)
    assert triton_aot.ptx_findings(on)["fma"] > triton_aot.ptx_findings(off)["fma"]


@pytest.mark.slow
def test_the_processed_roofline_reports_every_call(tmp_path: Path) -> None:
    doc = processed_roofline(tmp_path, rows=ROWS, case=CASE)
    assert {"kept_forward", "search_step", "min_p", "backward_zero"} <= set(doc["kernels"])
    assert set(doc["predicted"]) == {"raw", "min_p", "top_k", "top_p", "all_three"}
    assert all(k["local_bytes"] == 0 for k in doc["kernels"].values())
    assert doc["search_steps_per_stage"] == 16 + math.ceil(math.log2(CASE[0] + 1))  # bf16: its own order
    raw = doc["predicted"]["raw"]["h100_ms"]
    assert all(doc["predicted"][c]["h100_ms"] > raw for c in ("min_p", "top_k", "top_p", "all_three"))
    # the row max's pass, Z(K2) and the steps, the masked forward, the raw backward's launches, the zero pass
    raw_launches = doc["predicted"]["raw"]["launches"]
    assert doc["predicted"]["top_p"]["launches"] == raw_launches + doc["search_steps_per_stage"] + 3
