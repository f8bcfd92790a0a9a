"""What the GPU will execute: the Triton backend's kernels compiled ahead of time, no GPU needed.

``triton.compile(..., target=GPUTarget(...))`` for sm_80, sm_90, sm_100 (PTX) and gfx942 (AMD
ISA), with the argument types and constants the backend launches them with
(:func:`rl_engine.logprob.triton_aot.launch_variants`). Every floating-point instruction of the
PTX must be an IEEE round-to-nearest basic operation; the AMD ISA must hold no FMA-class
instruction outside a division sequence (the kernels divide nowhere, so none at all). Negative
controls: the same kernel with fusion on has ``fma`` (NVIDIA) and FMA-class instructions outside
division sequences (AMD); a plain ``/`` gives a non-IEEE division on NVIDIA; the AMD rule
classifies ``div_rn``'s FMA steps as division steps.

A target that does not compile on this machine fails the test with the reason (never a skip).
The quick set compiles one forward and one backward variant per target; the slow set every
variant the backend launches for the default case's shape (fresh Triton cache, 2 loaded cores:
about 3 s a compile).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("triton")  # the test extra installs it
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from rl_engine.logprob import triton_aot  # noqa: E402
from rl_engine.logprob.triton_backend import load_kernels  # noqa: E402

TARGETS: list[tuple[str, Any]] = [("cuda", arch) for arch in triton_aot.NVIDIA_TARGETS] + [
    ("hip", triton_aot.AMD_TARGET)
]


def _compile(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], backend: str,
             arch: Any, fusion: bool) -> dict[str, Any]:
    try:
        return triton_aot.compile_variant(fn, signature, constexprs, backend, arch, fusion)
    except Exception as exc:  # noqa: BLE001 - say precisely which target failed, and why
        pytest.fail(f"triton {triton.__version__} cannot compile {getattr(fn, '__name__', fn)} "
                    f"for {backend} {arch} on this machine: {type(exc).__name__}: {exc}")


def _variants(quick: bool) -> list[triton_aot.Variant]:
    """Quick: a padded 143-wide bf16 forward and a binary16 backward; slow: every variant of
    the default case's shape (tile 2374, vocabulary 151936). The two shapes differ only in
    constants (unrolled lengths), not in which instructions a variant uses."""
    variants = triton_aot.launch_variants()
    if quick:
        wanted = ("forward-bf16-w143-entropy1-validate1", "backward-fp16-v1001")
        return [v for v in variants if v.name in wanted]
    return [v for v in variants if "w2374" in v.name or "v151936" in v.name]


def _check(variant: triton_aot.Variant, backend: str, arch: Any) -> None:
    fn = getattr(load_kernels("compiled"), variant.kernel)
    asm = _compile(fn, variant.signature, variant.constexprs, backend, arch, fusion=False)
    if backend == "cuda":
        assert len(asm["cubin"]) > 0  # ptxas (shipped with Triton) assembled it too
        found = triton_aot.ptx_findings(asm["ptx"])
        assert found["forbidden"] == [] and found["unknown"] == [], (variant.name, arch, found)
        assert {"add.rn.f32", "mul.rn.f32"} & set(found["float_ops"]) or \
            {"add.rn.f32x2", "mul.rn.f32x2"} & set(found["float_ops"]), found  # it did compute
    else:
        found = triton_aot.amdgcn_findings(asm["amdgcn"])
        assert found == {"fma_in_division": 0, "fma_outside_division": 0, "forbidden": []}, \
            (variant.name, found)
        assert len(asm["hsaco"]) > 0
        assert any("mul_f32" in op for op in triton_aot.opcodes(asm["amdgcn"]))  # it did compute


@pytest.mark.parametrize("backend,arch", TARGETS, ids=lambda t: str(t))
def test_representative_kernels_compile_to_ieee_basic_operations(backend: str, arch: Any) -> None:
    variants = _variants(quick=True)
    assert len(variants) == 2
    for variant in variants:
        _check(variant, backend, arch)


@pytest.mark.slow
@pytest.mark.parametrize("backend,arch", TARGETS, ids=lambda t: str(t))
def test_every_launched_variant_compiles_to_ieee_basic_operations(backend: str, arch: Any) -> None:
    variants = _variants(quick=False)
    assert len(variants) == 9  # 3 dtypes x (2 forward flag sets + backward)
    for variant in variants:
        _check(variant, backend, arch)


def test_launch_variants_carry_the_backends_own_constants() -> None:
    by_name = {v.name: v for v in triton_aot.launch_variants()}
    fwd = by_name["forward-bf16-w2374-entropy1-validate1"]
    assert fwd.constexprs == {"TILES": 64, "WIDTH": 2374, "LEVELS": 12, "DTYPE": 1,
                              "WITH_ENTROPY": True, "VALIDATE": True}
    assert fwd.signature["x_ptr"] == "*i16" and fwd.signature["m_ptr"] == "*fp32"
    assert by_name["backward-fp32-v151936"].constexprs == {"BLOCKS": 38, "BLOCK": 4096, "DTYPE": 0}


# ----- negative controls and the AMD rule -----------------------------------------------------------


@pytest.mark.parametrize("backend,arch", TARGETS, ids=lambda t: str(t))
def test_negative_control_fusion_on_gives_fma(backend: str, arch: Any) -> None:
    variant = _variants(quick=True)[0]
    fn = getattr(load_kernels("compiled"), variant.kernel)
    asm = _compile(fn, variant.signature, variant.constexprs, backend, arch, fusion=True)
    if backend == "cuda":
        forbidden = triton_aot.ptx_findings(asm["ptx"])["forbidden"]
        assert any(op.startswith("fma.rn.f32") for op in forbidden), forbidden
    else:
        assert triton_aot.amdgcn_findings(asm["amdgcn"])["fma_outside_division"] > 0


@triton.jit
def _divide_probe(x_ptr, y_ptr, z_ptr, out_ptr, MULADD: tl.constexpr, PLAIN: tl.constexpr):
    offs = tl.arange(0, 64)
    x = tl.load(x_ptr + offs)
    y = tl.load(y_ptr + offs)
    q = x / y if PLAIN else tl.div_rn(x, y)
    if MULADD:
        q = q * y + tl.load(z_ptr + offs)
    tl.store(out_ptr + offs, q)


PROBE_SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "z_ptr": "*fp32", "out_ptr": "*fp32",
                   "MULADD": "constexpr", "PLAIN": "constexpr"}


def test_div_rn_is_ieee_on_nvidia_and_a_plain_division_is_not() -> None:
    rn = _compile(_divide_probe, PROBE_SIGNATURE, {"MULADD": False, "PLAIN": False}, "cuda", 90, False)
    found = triton_aot.ptx_findings(rn["ptx"])
    assert "div.rn.f32" in found["float_ops"] and found["forbidden"] == found["unknown"] == []
    plain = _compile(_divide_probe, PROBE_SIGNATURE, {"MULADD": False, "PLAIN": True}, "cuda", 90, False)
    found = triton_aot.ptx_findings(plain["ptx"])
    assert found["forbidden"] + found["unknown"], found  # div.full.f32: not correctly rounded


def test_amd_rule_tells_division_steps_from_contracted_multiply_adds() -> None:
    division = _compile(_divide_probe, PROBE_SIGNATURE, {"MULADD": False, "PLAIN": False},
                        "hip", triton_aot.AMD_TARGET, False)
    found = triton_aot.amdgcn_findings(division["amdgcn"])
    assert found["fma_in_division"] > 0 and found["fma_outside_division"] == 0, found
    fused = _compile(_divide_probe, PROBE_SIGNATURE, {"MULADD": True, "PLAIN": False},
                     "hip", triton_aot.AMD_TARGET, True)
    found_fused = triton_aot.amdgcn_findings(fused["amdgcn"])
    assert found_fused["fma_outside_division"] > 0, found_fused  # the contracted q * y + z
    assert found_fused["fma_in_division"] == found["fma_in_division"]
    unfused = _compile(_divide_probe, PROBE_SIGNATURE, {"MULADD": True, "PLAIN": False},
                       "hip", triton_aot.AMD_TARGET, False)
    assert triton_aot.amdgcn_findings(unfused["amdgcn"])["fma_outside_division"] == 0
