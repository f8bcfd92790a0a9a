"""What the GPU will execute: the Triton backend's kernels compiled ahead of time, as launched.

``triton.compile(..., target=GPUTarget(...))`` for sm_80, sm_90, sm_100 (PTX) and gfx942 (AMD
ISA), with the argument types, constants and the **specialization Triton applies at launch**
(``tt.divisibility=16`` on aligned pointers and integers divisible by 16), derived by Triton's
own binder from the backend's own launches (:func:`rl_engine.logprob.backends.triton.triton_aot.launch_variants`).
Every floating-point instruction of the PTX must be an IEEE round-to-nearest operation, and the
fused multiply-adds exactly the ones ``docs/arithmetic.md`` writes: 10 per column in the forward
with entropy (9 in ``E``, one in ``G*``), 9 in the backward (a binary16 gradient's rounding one more, its
product exact; a binary16 logit is widened by ``cvt.f32.f16``, exact); the AMD ISA the same, outside
any division sequence.
Negative controls: the forward with fusion on holds more FMAs; a plain ``/``
gives a non-IEEE division on NVIDIA; the AMD rule classifies ``div_rn``'s FMA steps as division
steps. The roofline of the launched binaries (``python -m rl_engine.logprob.backends.triton.triton_aot
--roofline``) meets the roofline targets: no local memory, no loop, at most 25 SASS instructions
per column forward and 35 backward, forward within 1.25x of the H100 floor, forward+backward
within 1.25x of theirs.

A target that does not compile on this machine fails the test with the reason (never a skip).
The quick set compiles a few variants per target; the slow set every variant of the default
case for sm_90 and gfx942, the GPT-2 case (50257 real, 50304 padded: integers not divisible by
16) and the roofline.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")  # the test extra installs it
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from rl_engine import schemas  # noqa: E402
from rl_engine.arith import division  # noqa: E402
from rl_engine.logprob.backends.triton import triton_aot  # noqa: E402
from rl_engine.logprob.backends.triton.triton_backend import load_kernels  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")

TARGETS: list[tuple[str, Any]] = [("cuda", arch) for arch in triton_aot.NVIDIA_TARGETS] + [
    ("hip", triton_aot.AMD_TARGET)
]
QUICK = ("forward-small-bf16-entropy1-validate1", "forward-small-bf16-entropy1-validate1-merge",
         "backward-small-fp16-terms", "backward-small-fp16-tail", "backward-small-fp16-target")


@pytest.fixture(scope="module")
def variants() -> dict[str, triton_aot.Variant]:
    return {v.name: v for v in triton_aot.launch_variants()}


@pytest.fixture(scope="module")
def roofline_of(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``triton_aot.roofline`` once per case in this module: ``(directory, document)``. The roofline
    tests and the variants' table ask for the same cases (the default, fp16); each is compiled and
    disassembled once."""
    import inspect

    real = triton_aot.roofline
    made: dict[str, tuple[Path, dict[str, Any]]] = {}

    def of(**kwargs: Any) -> tuple[Path, dict[str, Any]]:
        bound = inspect.signature(real).bind(None, **kwargs)
        bound.apply_defaults()
        key = repr(sorted((k, v) for k, v in bound.arguments.items() if k != "output_dir"))
        if key not in made:
            out = tmp_path_factory.mktemp("roofline")
            made[key] = (out, real(out, **kwargs))
        return made[key]

    return of


def _compile(variant: triton_aot.Variant, backend: str, arch: Any, fusion: bool) -> dict[str, Any]:
    fn = getattr(load_kernels("compiled"), variant.kernel)
    try:
        return triton_aot.compile_variant(fn, variant, backend, arch, fusion)
    except Exception as exc:  # noqa: BLE001 - say precisely which target failed, and why
        pytest.fail(f"triton {triton.__version__} cannot compile {variant.name} for {backend} {arch} "
                    f"on this machine: {type(exc).__name__}: {exc}")


def _compile_probe(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], backend: str,
                   arch: Any, fusion: bool) -> dict[str, Any]:
    """A probe kernel of this file, compiled without specialization (it is not the backend's)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget(backend, arch, 32 if backend == "cuda" else 64)
    return dict(triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                               options={"enable_fp_fusion": fusion}).asm)


def _const(variant: triton_aot.Variant, name: str) -> Any:
    fn = getattr(load_kernels("compiled"), variant.kernel)
    return variant.constexprs[(fn.arg_names.index(name),)]


def _flag(variant: triton_aot.Variant, name: str) -> bool:
    return bool(_const(variant, name))


def _width(variant: triton_aot.Variant) -> int:
    return int(_const(variant, "WIDTH"))


def _check(variant: triton_aot.Variant, backend: str, arch: Any, exact: bool) -> int:
    """IEEE operations only, and no more FMAs than the specification's (exactly as many when
    ``exact``: no lane of the launch is known at compile time to lie past the tile). Returns the
    FMA count."""
    asm = _compile(variant, backend, arch, fusion=False)
    threads = variant.warps * (32 if backend == "cuda" else 64)
    if backend != "cuda" and variant.kernel == "merge_kernel":
        # its two divisions a lane (L's f / (f + 2) and the entropy's / S) interleave in gfx942's schedule
        # with E's FMAs, so the region rule (v_div_scale ... v_div_fixup) cannot tell them apart: at
        # least the specification's FMAs in all, division steps among them, nothing forbidden
        found = triton_aot.amdgcn_findings(asm["amdgcn"])
        total = found["fma_in_division"] + found["fma_outside_division"]
        assert found["forbidden"] == [] and found["fma_in_division"] > 0, (variant.name, found)
        assert total >= spec_fma(variant, threads), (variant.name, found, spec_fma(variant, threads))
        return found["fma_outside_division"]
    if backend == "cuda":
        assert len(asm["cubin"]) > 0  # ptxas (shipped with Triton) assembled it too
        found = triton_aot.ptx_findings(asm["ptx"])
        assert found["forbidden"] == [] and found["unknown"] == [], (variant.name, arch, found)
        fma = found["fma"]
    else:
        found = triton_aot.amdgcn_findings(asm["amdgcn"])
        # the merge divides (L's f / (f + 2), the entropy's / S): division steps there, none elsewhere
        divides = variant.kernel == "merge_kernel"
        assert (found["fma_in_division"] > 0) == divides and found["forbidden"] == [], (variant.name, found)
        assert len(asm["hsaco"]) > 0
        fma = found["fma_outside_division"]
    want = spec_fma(variant, threads)
    assert (0 < fma <= want if want else fma == 0) if not exact else fma == want, (variant.name, backend, arch, fma,
                                                                                    want)
    return fma


# The kernels that compute per row, not per column: the merge's E of its weights (every lane of its
# [ROWS, COLS] block, the unused ones included: 9 FMAs each, at least one lane a thread, as a block
# smaller than the program's threads is replicated; L has none) and the backward's terms (none)
NO_COLUMN_FMA = {
    "merge_kernel": lambda v, threads: triton_aot.FMA_PER_COLUMN["backward"]
    * max(1, -(-int(_const(v, "ROWS")) * int(_const(v, "COLS")) // threads)),
    "backward_terms_kernel": lambda v, threads: 0,
}


def spec_fma(variant: triton_aot.Variant, threads: int) -> int:
    """FMAs per thread the specification writes for the columns (slots) a thread computes."""
    if variant.kernel in NO_COLUMN_FMA:
        return NO_COLUMN_FMA[variant.kernel](variant, threads)
    if variant.kernel == "forward_partials_kernel":
        slots = -(-_width(variant) // 128) * 128
        per = triton_aot.FMA_PER_COLUMN["forward_entropy" if _flag(variant, "WITH_ENTROPY") else "forward"]
    else:
        slots = int(_const(variant, "BLOCK" if variant.kernel == "backward_kernel" else "ROWS"))
        per = triton_aot.FMA_PER_COLUMN["backward"] + _f16_round(variant)
    return per * slots // threads


def _f16_round(variant: triton_aot.Variant) -> int:
    """The FMAs a column of the binary16 rounding adds to a backward launch (none for other dtypes)."""
    return triton_aot.F16_ROUND_FMA_PER_COLUMN if int(_const(variant, "DTYPE")) == 2 else 0


@pytest.mark.parametrize("backend,arch", TARGETS, ids=lambda t: str(t))
def test_representative_kernels_compile_to_ieee_operations_and_the_specs_fmas(
        variants: dict[str, triton_aot.Variant], backend: str, arch: Any) -> None:
    for name in QUICK:
        _check(variants[name], backend, arch, exact=False)


def tempered_fma(variant: triton_aot.Variant, threads: int) -> int:
    """PTX FMAs per thread of a tempered launch: the specification's, Markstein's two per step
    (one step for a bf16 or binary16 logit, two for a binary32 one and for the gradient) on the fast
    path (the forward's split quotient: one), and the specification's again on the guard's IEEE path
    (its divisions are div.rn)."""
    if variant.kernel in NO_COLUMN_FMA:
        return NO_COLUMN_FMA[variant.kernel](variant, threads)
    dtype = {0: "float32", 1: "bfloat16", 2: "float16"}[int(_const(variant, "DTYPE"))]
    steps = division.STEPS[dtype] * triton_aot.MARKSTEIN_FMA_PER_STEP
    if variant.kernel == "forward_partials_kernel":
        slots = -(-_width(variant) // 128) * 128
        per = triton_aot.FMA_PER_COLUMN["forward_entropy" if _flag(variant, "WITH_ENTROPY") else "forward"]
        top = 0
        if _flag(variant, "SPLIT"):  # one temperature its check accepts: the split quotient, not Markstein's step
            steps = triton_aot.SPLIT_FMA_PER_COLUMN
            top = triton_aot.SPLIT_FMA_PER_COLUMN  # the tile maximum's too
        return (2 * per + steps) * slots // threads + top
    if variant.kernel == "backward_kernel":
        if _flag(variant, "SPLIT"):  # the logit's division: the split quotient
            steps = triton_aot.SPLIT_FMA_PER_COLUMN
        grad_steps = division.STEPS["float32"] * triton_aot.MARKSTEIN_FMA_PER_STEP
        per = 2 * triton_aot.FMA_PER_COLUMN["backward"] + steps + grad_steps + _f16_round(variant)
        return per * int(_const(variant, "BLOCK")) // threads
    per = triton_aot.FMA_PER_COLUMN["backward"] + _f16_round(variant)
    return per * int(_const(variant, "ROWS")) // threads


# FMA-class instructions of one IEEE division on gfx942 (v_fma_f32 five times and v_div_fmas_f32: the
# _divide_probe's div_rn, tests/test_triton_ptx.py::test_amd_rule_tells_division_steps_from_contracted_multiply_adds)
AMD_DIVISION_FMA = 6


@pytest.mark.parametrize("backend,arch", [("cuda", 90), ("hip", triton_aot.AMD_TARGET)], ids=lambda t: str(t))
def test_tempered_kernels_compile_to_ieee_operations_markstein_and_div_rn(backend: str, arch: Any) -> None:
    """With a temperature (section 6 step 0): IEEE operations only, the division's ``div.rn.f32``
    (the guard's path, and the tile maximum's) among them, and on sm_90 exactly the FMAs of
    :func:`tempered_fma` in the default case's whole tiles and blocks (bf16 and binary32 logits); on
    gfx942 division steps, and at least those plus the divisions' own in all."""
    wanted = ("forward-default-bf16-entropy1-validate1-tempered", "backward-default-bf16-blocks-tempered",
              "backward-default-fp32-blocks-tempered", "backward-default-bf16-target-tempered")
    tempered = {v.name: v for v in triton_aot.launch_variants(cases=(triton_aot.CASES[0],), tempered=True)
                if v.name in wanted}
    assert set(tempered) == set(wanted)
    for name, variant in tempered.items():
        asm = _compile(variant, backend, arch, fusion=False)
        threads = variant.warps * (32 if backend == "cuda" else 64)
        want = tempered_fma(variant, threads)
        if backend == "cuda":
            found = triton_aot.ptx_findings(asm["ptx"])
            assert found["forbidden"] == [] and found["unknown"] == [], (name, found)
            assert "div.rn.f32" in found["float_ops"] and found["fma"] == want, (name, found["fma"], want)
            assert triton_aot.zero_subtractions(asm["ttir"]) == [], name  # Markstein's negations: fneg
        else:
            # the scheduler interleaves the specification's FMAs with the division sequences (the text
            # between a v_div_scale_f32 and its v_div_fixup_f32), so they are counted in all: at least
            # the specification's and the split's, plus the IEEE division's own (AMD_DIVISION_FMA each)
            # but for two (the forward's scalar divisions of the tile's maximum and minimum, on the guard's
            # path, by one divisor: bf16 at T = 0.7 shows 6 FMAs fewer for each, Triton 3.9.0)
            found = triton_aot.amdgcn_findings(asm["amdgcn"])
            assert found["forbidden"] == [] and found["fma_in_division"] > 0, (name, found)
            divisions = asm["amdgcn"].count("v_div_fixup_f32")
            total = found["fma_outside_division"] + found["fma_in_division"]
            assert total >= want + AMD_DIVISION_FMA * (divisions - 2), (name, found, want, divisions)


@pytest.mark.slow
@pytest.mark.parametrize("backend,arch", [("cuda", 90), ("hip", triton_aot.AMD_TARGET)], ids=lambda t: str(t))
def test_every_default_case_launch_compiles_to_the_specs_operations(
        variants: dict[str, triton_aot.Variant], backend: str, arch: Any) -> None:
    chosen = [v for name, v in variants.items() if "-default-" in name]
    assert len(chosen) == 24  # 3 dtypes x (2 forward flag sets x (partials, merge) + 4 backward launches)
    for variant in chosen:
        # the forward's, the merge's and the whole blocks' lanes are all computed: exactly the spec's FMAs
        exact = variant.kernel in ("forward_partials_kernel", "merge_kernel") or "-blocks" in variant.name
        _check(variant, backend, arch, exact=exact)


@pytest.mark.slow
def test_the_gpt2_case_compiles_to_the_specs_operations(variants: dict[str, triton_aot.Variant]) -> None:
    for name in ("forward-gpt2-bf16-entropy1-validate1", "backward-gpt2-bf16-blocks", "backward-gpt2-bf16-tail"):
        for backend, arch in (("cuda", 90), ("hip", triton_aot.AMD_TARGET)):
            _check(variants[name], backend, arch, exact=not name.endswith("tail"))


def test_launches_are_specialized_as_triton_specializes_them_at_launch(
        variants: dict[str, triton_aot.Variant]) -> None:
    """Triton's binder marks the default case's pointers and integers (151936, all divisible by
    16) with tt.divisibility=16, and not GPT-2's 50257 real columns; the binary differs from the
    one a bare signature gives."""
    def divisible(v: triton_aot.Variant) -> set[str]:
        fn = getattr(load_kernels("compiled"), v.kernel)
        return {fn.arg_names[k[0]] for k, attrs in v.attrs.items() if ["tt.divisibility", 16] in attrs}

    fwd = variants["forward-default-bf16-entropy1-validate1"]
    assert {"x_ptr", "row_stride", "real_local", "m_ptr"} <= divisible(fwd)
    assert fwd.signature["x_ptr"] == "*i16" and fwd.warps == 1 and fwd.grid == (8192 * 64,)
    gpt2 = variants["forward-gpt2-bf16-entropy1-validate1"]
    assert "row_stride" in divisible(gpt2) and "real_local" not in divisible(gpt2)
    assert _const(gpt2, "PADDED") is True and _const(fwd, "PADDED") is False
    blocks = variants["backward-default-bf16-blocks"]
    assert _const(blocks, "MASKED") is False and blocks.grid == (8192 * (151936 // 2048),)
    launched = _compile(fwd, "cuda", 90, fusion=False)["ptx"]
    bare = triton_aot.Variant(fwd.name, fwd.kernel, fwd.signature, fwd.constexprs, {}, fwd.warps, fwd.grid, fwd.columns)
    assert _compile(bare, "cuda", 90, fusion=False)["ptx"] != launched  # another program


# ----- negative controls and the AMD rule -----------------------------------------------------------


def test_negative_control_fusion_on_contracts_more_fmas_in_the_forward(
        variants: dict[str, triton_aot.Variant]) -> None:
    """With fusion on, sm_90's compiler contracts a multiply and an add of the forward (the lane
    sum's s + p * sc among them) into FMAs the specification does not write: the count shows it."""
    variant = variants["forward-default-bf16-entropy1-validate1"]
    unfused = _check(variant, "cuda", 90, exact=True)
    fused = triton_aot.ptx_findings(_compile(variant, "cuda", 90, fusion=True)["ptx"])["fma"]
    assert fused > unfused == 10 * 19 * 4


@pytest.mark.parametrize("backend,arch", TARGETS, ids=lambda t: str(t))
def test_negative_control_a_contracted_multiply_add_is_counted(backend: str, arch: Any) -> None:
    """On every target, the probe's q * y + z is two operations with fusion off and a counted
    FMA with fusion on (where sm_100 and gfx942 contract nothing in the forward, this shows the
    count would see it)."""
    counts = []
    for fusion in (False, True):
        asm = _compile_probe(_divide_probe, PROBE_SIGNATURE, {"MULADD": True, "PLAIN": False}, backend, arch, fusion)
        counts.append(triton_aot.ptx_findings(asm["ptx"])["fma"] if backend == "cuda"
                      else triton_aot.amdgcn_findings(asm["amdgcn"])["fma_outside_division"])
    assert counts[0] == 0 < counts[1], counts


# ----- the roofline of the launched binaries ---------------------------------------------------------


def test_sass_parser_counts_loops_and_ignores_the_trap() -> None:
    text = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   FFMA R2, R3, R4, R5 ;
        /*0020*/               @P0 BRA `(.L_x_0) ;
        /*0030*/                   EXIT ;
.L_x_1:
        /*0040*/                   BRA `(.L_x_1);
        /*0050*/                   NOP;
"""
    usage = "Function k:REG:12 STACK:0 SHARED:0 LOCAL:8 CONSTANT[0]:0"
    sass = triton_aot.parse_sass(text, usage)
    assert sass.loops and sass.instructions == 5 and sass.opcodes["BRA"] == 2 and "NOP" not in sass.opcodes
    assert sass.registers == 12 and sass.local_bytes == 8
    assert sass.path_instructions == sass.longest_instructions == 5  # a loop: the static count
    straight = triton_aot.parse_sass(text.replace("@P0 BRA `(.L_x_0) ;", "FADD R2, R2, R2 ;"), usage)
    assert not straight.loops  # the trailing self-branch trap is not a loop
    assert straight.path_instructions == straight.longest_instructions == 4  # ... and it is not executed


def test_sass_parser_follows_the_fast_and_the_slow_path() -> None:
    """A guarded branch over a block that calls a subroutine (the shape of the tempered kernels'
    guard and of a division's slow path): the shortest path skips both, the longest runs both."""
    text = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA `(.L_x_1) ;
        /*0020*/                   FFMA R2, R3, R4, R5 ;
        /*0030*/                   FFMA R2, R3, R4, R5 ;
        /*0040*/                   CALL.REL.NOINC `($__internal_0_slowpath) ;
.L_x_1:
        /*0050*/                   FADD R2, R2, R2 ;
        /*0060*/                   EXIT ;
.L_x_2:
        /*0070*/                   BRA `(.L_x_2);
$__internal_0_slowpath:
        /*0080*/                   FMUL R2, R2, R2 ;
        /*0090*/                   RET.REL.NODEC R20 `(k) ;
"""
    usage = "Function k:REG:12 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:0"
    sass = triton_aot.parse_sass(text, usage)
    assert not sass.loops and sass.instructions == 10
    assert sass.path_instructions == 4 and sass.path_opcodes == {"BRA": 1, "EXIT": 1, "FADD": 1, "MOV": 1}
    assert sass.longest_instructions == 9  # MOV BRA FFMA FFMA CALL (FMUL RET) FADD EXIT
    unguarded = triton_aot.parse_sass(text.replace("@P0 BRA `(.L_x_1) ;", "BRA `(.L_x_1) ;"), usage)
    assert unguarded.path_instructions == unguarded.longest_instructions == 4


def test_the_roofline_command_refuses_a_temperature_the_arithmetic_refuses(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--temperature`` is checked as every temperature is (binary32 value in ``[2**-64, 2**64]``):
    exit 2 naming it, before anything compiles or is written."""
    for bad in ("0", "-0.7", "nan", "1e30"):
        with pytest.raises(SystemExit) as info:
            triton_aot.main(["--roofline", "--output-dir", str(tmp_path / "out"), "--temperature", bad])
        assert info.value.code == 2 and "--temperature" in capsys.readouterr().err, bad
    assert not (tmp_path / "out").exists()


# the roofline targets (instructions per column forward and backward, forward and forward+backward over
# the H100 floor): without a temperature, and with one (section 6 step 0's division: the split quotient,
# 2 instructions per column in bf16, the backward's gradient Markstein's 5, and the guard; measured 24.7,
# 39.8, 1.239x and 1.08x with Triton 3.9.0, the installed one these run under (3.6.0: 24.8, 40.5, 1.241x,
# 1.09x; before the folded negations and the block's one exchange 41.0 and 44.6 backward); Markstein's step
# on the logits gave 26.3, 42.4, 1.32x, 1.15x): the bound of docs/performance.md, 1.25x, both ways
ROOFLINE_TARGETS = {1.0: (25, 35, 1.25, 1.25), 0.7: (25, 42, 1.25, 1.25)}


def test_roofline_output_dir_that_is_a_file_is_refused_naming_it(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``--roofline --output-dir FILE`` (or a directory under a file) ended in a FileExistsError traceback:
    now a usage error (exit 2) naming the option, the path and the fix, before anything is compiled;
    ``roofline()`` itself raises :class:`AotError` with the same message."""
    existing = tmp_path / "roofline.json"
    existing.write_text("{}")
    for given in (existing, existing / "sub"):
        with pytest.raises(SystemExit) as stopped:
            triton_aot.main(["--roofline", "--output-dir", str(given)])
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert f"--output-dir {given}: a file, not a directory, is at that path or above it" in err, err
        assert "(it is made when missing)" in err and "Traceback" not in err
        with pytest.raises(triton_aot.AotError, match=f"--output-dir {given}: a file, not a directory"):
            triton_aot.roofline(given)
    assert existing.read_text() == "{}"  # untouched
    made = triton_aot.output_directory(tmp_path / "new" / "dir")  # control: a missing directory is made
    assert made.is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_roofline_of_the_launched_kernels_meets_the_targets(tmp_path: Path, roofline_of: Any,
                                                               temperature: float) -> None:
    """The SASS budget of the launched kernels' fast path, without and with a temperature (whose
    guard's IEEE path is code the fast path skips: its longest path is longer, its static count too)."""
    out, doc = roofline_of(temperature=temperature)
    assert doc["case"]["temperature"] == temperature
    schemas.write_validated(tmp_path / "roofline.json", doc, "roofline")
    assert json.loads((tmp_path / "roofline.json").read_text())["kernels"] == doc["kernels"]
    for kernel in doc["kernels"]:
        assert (out / kernel["cubin"]).stat().st_size > 0
        assert kernel["local_bytes"] == 0 and kernel["loops"] is False, kernel["name"]
        found = (kernel["name"], kernel["path_per_thread"], kernel["sass_per_thread"], kernel["longest_path_per_thread"])
        if kernel["kernel"] == "merge_kernel":  # L's and the entropy's div.rn: a slow-path call the fast path skips
            assert kernel["path_per_thread"] < kernel["longest_path_per_thread"], found
        elif temperature == 1.0 or kernel["kernel"] == "backward_terms_kernel":
            # straight code: every instruction but the trailing trap runs
            assert kernel["path_per_thread"] == kernel["longest_path_per_thread"] == kernel["sass_per_thread"] - 1, found
        else:
            assert kernel["path_per_thread"] < kernel["sass_per_thread"] < kernel["longest_path_per_thread"], found
    forward, backward, fwd_floor, both_floor = ROOFLINE_TARGETS[temperature]
    per = doc["instructions_per_column"]
    assert per["forward"] <= forward and per["backward"] <= backward, per
    h100 = doc["predicted"]["h100"]
    assert h100["forward_over_floor"] <= fwd_floor and h100["forward_backward_over_floor"] <= both_floor, h100
    fwd = next(k for k in doc["kernels"] if k["name"] == "forward")
    assert fwd["fma_per_thread"] >= 10 * 19 * 4  # the spec's FMAs reach the SASS (the PTX count is exact)


@pytest.mark.slow
@pytest.mark.parametrize("entropy,validate,entropy_grad", [(True, False, False), (False, False, False),
                                                           (True, True, True)])
def test_the_bf16_kernels_at_a_temperature_are_within_1_25x_of_the_h100_floor(
        tmp_path: Path, entropy: bool, validate: bool, entropy_grad: bool) -> None:
    """bf16 at ``T = 0.7`` (the bf16 bound: 1.25x), the variants beside the default's (which
    :func:`test_the_roofline_of_the_launched_kernels_meets_the_targets` holds to it): without
    validation, with neither, with the entropy's gradient; forward and forward+backward over the
    H100 floor, the forward and the backward's blocks dividing the logits by the split quotient."""
    doc = triton_aot.roofline(tmp_path, temperature=0.7, entropy=entropy, validate=validate,
                              entropy_grad=entropy_grad)
    for kernel in doc["kernels"]:
        assert kernel["local_bytes"] == 0 and kernel["loops"] is False, kernel["name"]
        if kernel["kernel"] in ("forward_partials_kernel", "backward_kernel"):
            assert kernel["constants"]["SPLIT"] is True, kernel["name"]
    h100 = doc["predicted"]["h100"]
    assert h100["forward_over_floor"] <= 1.25 and h100["forward_backward_over_floor"] <= 1.25, h100


@pytest.mark.slow
@pytest.mark.parametrize("entropy,validate,temperature,entropy_grad", [
    (True, True, 1.0, False), (False, False, 1.0, False), (True, True, 0.7, False), (False, False, 0.7, False),
    (True, True, 0.7, True)])
def test_the_fp16_kernels_are_within_1_3x_of_the_h100_floor(roofline_of: Any, entropy: bool, validate: bool,
                                                            temperature: float, entropy_grad: bool) -> None:
    """binary16 logits ("fp16 at the floor"), without and with a temperature (and the entropy's
    gradient): forward and forward+backward within 1.3x of the H100 floor on the launched kernels'
    fast path (no spill, no loop). Each logit is widened by one ``HADD2.F32`` (ptxas's ``cvt.f32.f16``, exact) that reads
    its half of a 32-bit register: 76 a thread in the forward (19 chunks of 4 columns, one reading
    for both passes; at ``T = 0.7`` 76 more on the guard's IEEE path, which reads the tile again) and
    16 in a backward block's thread; at ``T = 0.7`` the forward and the blocks divide by the split
    quotient. (The counts are static: without a temperature the code is straight.)"""
    _, doc = roofline_of(dtype=torch.float16, entropy=entropy, validate=validate, temperature=temperature,
                         entropy_grad=entropy_grad)
    assert doc["case"]["dtype"] == "fp16"
    for kernel in doc["kernels"]:
        assert kernel["local_bytes"] == 0 and kernel["loops"] is False, kernel["name"]
        if temperature != 1.0 and kernel["kernel"] in ("forward_partials_kernel", "backward_kernel"):
            assert kernel["constants"]["SPLIT"] is True, kernel["name"]
    h100 = doc["predicted"]["h100"]
    assert h100["forward_over_floor"] <= 1.3 and h100["forward_backward_over_floor"] <= 1.3, h100
    by_name = {k["name"]: k for k in doc["kernels"]}
    assert by_name["forward"]["opcodes"].get("HADD2") == 19 * 4 * (1 if temperature == 1.0 else 2), by_name["forward"]
    assert by_name["backward-blocks"]["opcodes"].get("HADD2") == 16, by_name["backward-blocks"]["opcodes"]


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


NEGATE = load_kernels("compiled").negate


@triton.jit
def _negate_probe(x_ptr, y_ptr, out_ptr, FROM_ZERO: tl.constexpr):
    offs = tl.arange(0, 64)
    x = tl.load(x_ptr + offs)
    minus = 0.0 - x if FROM_ZERO else NEGATE(x)
    tl.store(out_ptr + offs, tl.fma(minus, tl.load(y_ptr + offs), x))


NEGATE_SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "FROM_ZERO": "constexpr"}


def test_negate_is_ieee_negation_folded_into_the_fma_and_a_subtraction_from_zero_is_not() -> None:
    """``triton_kernels.negate`` compiles to ``neg.f32`` (LLVM's ``fneg``: ``-(+0) = -0``), which
    ptxas folds into the FMA reading it (no ``FADD``), on every supported Triton; ``0.0 - x`` (what
    Triton 3.6 makes of a float's unary minus: ``+0 - (+0) = +0``) is flagged by
    :func:`triton_aot.zero_subtractions` (negative control) and stays a ``sub.f32``."""
    neg = _compile_probe(_negate_probe, NEGATE_SIGNATURE, {"FROM_ZERO": False}, "cuda", 90, False)
    assert triton_aot.zero_subtractions(neg["ttir"]) == [] and "neg.f32" in neg["ptx"], neg["ttir"]
    assert not re.search(r"\bsub(\.rn)?\.f32", neg["ptx"]), neg["ptx"]
    sass = triton_aot.read_sass(neg["cubin"]).opcodes
    assert "FADD" not in sass and sass.get("FFMA") == 1, sass  # one column a thread (64 of 128 threads), one FFMA
    sub = _compile_probe(_negate_probe, NEGATE_SIGNATURE, {"FROM_ZERO": True}, "cuda", 90, False)
    assert len(triton_aot.zero_subtractions(sub["ttir"])) == 1, sub["ttir"]
    assert re.search(r"\bsub(\.rn)?\.f32", sub["ptx"]), sub["ptx"]


def test_div_rn_is_ieee_on_nvidia_and_a_plain_division_is_not() -> None:
    rn = _compile_probe(_divide_probe, PROBE_SIGNATURE, {"MULADD": False, "PLAIN": False}, "cuda", 90, False)
    found = triton_aot.ptx_findings(rn["ptx"])
    assert "div.rn.f32" in found["float_ops"] and found["forbidden"] == found["unknown"] == []
    plain = _compile_probe(_divide_probe, PROBE_SIGNATURE, {"MULADD": False, "PLAIN": True}, "cuda", 90, False)
    found = triton_aot.ptx_findings(plain["ptx"])
    assert found["forbidden"] + found["unknown"], found  # div.full.f32: not correctly rounded


def test_the_merge_s_log_kernel_compiles_to_ieee_operations_only() -> None:
    """``log_kernel`` (the merge's ``L``): basic operations and one ``div.rn.f32``, no ``lg2`` or
    ``.approx``, nothing contracted (the launch's ``enable_fp_fusion=False``)."""
    fn = load_kernels("compiled").log_kernel
    signature = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "L4": "fp32", "L3": "fp32", "L2": "fp32",
                 "L1": "fp32", "BLOCK": "constexpr"}
    found = triton_aot.ptx_findings(_compile_probe(fn, signature, {"BLOCK": 1024}, "cuda", 90, False)["ptx"])
    assert "div.rn.f32" in found["float_ops"] and found["forbidden"] == found["unknown"] == [], found
    assert found["fma"] == 0, found


def test_amd_rule_tells_division_steps_from_contracted_multiply_adds() -> None:
    division = _compile_probe(_divide_probe, PROBE_SIGNATURE, {"MULADD": False, "PLAIN": False},
                        "hip", triton_aot.AMD_TARGET, False)
    found = triton_aot.amdgcn_findings(division["amdgcn"])
    assert found["fma_in_division"] > 0 and found["fma_outside_division"] == 0, found
    assert found["fma_in_division"] == AMD_DIVISION_FMA * division["amdgcn"].count("v_div_fixup_f32"), found
    fused = _compile_probe(_divide_probe, PROBE_SIGNATURE, {"MULADD": True, "PLAIN": False},
                     "hip", triton_aot.AMD_TARGET, True)
    found_fused = triton_aot.amdgcn_findings(fused["amdgcn"])
    assert found_fused["fma_outside_division"] > 0, found_fused  # the contracted q * y + z
    assert found_fused["fma_in_division"] == found["fma_in_division"]
    unfused = _compile_probe(_divide_probe, PROBE_SIGNATURE, {"MULADD": True, "PLAIN": False},
                       "hip", triton_aot.AMD_TARGET, False)
    assert triton_aot.amdgcn_findings(unfused["amdgcn"])["fma_outside_division"] == 0


def test_the_roofline_variants_cover_what_trainers_launch() -> None:
    """``--variants`` lists every axis a trainer varies: each logits dtype (each at TP 8
    too), TP 1 and 8, entropy and validation on and off in all four pairs, the entropy gradient, a
    temperature (bf16 and binary16), sm_90, sm_100 and gfx942; the names are unique."""
    variants = triton_aot.ROOFLINE_VARIANTS
    names = [name for name, _ in variants]
    assert len(set(names)) == len(names) and names[0] == "default" and variants[0][1] == {}

    def values(key: str, default: Any) -> set[Any]:
        return {kwargs.get(key, default) for _, kwargs in variants}

    import torch

    assert values("dtype", torch.bfloat16) == {torch.bfloat16, torch.float16, torch.float32}
    assert values("tp", 1) == {1, 8}
    assert {(kw.get("entropy", True), kw.get("validate", True)) for _, kw in variants} == {
        (True, True), (True, False), (False, True), (False, False)}
    assert values("entropy_grad", False) == {False, True}
    assert values("temperature", 1.0) == {1.0, triton_aot.TEMPERED_PROBE}
    assert values("arch", triton_aot.ROOFLINE_ARCH) == {90, 100, triton_aot.AMD_TARGET}
    for dtype in (torch.float16, torch.float32):
        assert any(kw.get("dtype") == dtype and kw.get("tp") == 8 for _, kw in variants), dtype
    assert any(kw.get("dtype") == torch.float16 and kw.get("temperature") for _, kw in variants)


def test_the_roofline_compiles_every_launch_the_backend_makes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel of a pass is in the roofline's sum: the launches :func:`triton_aot.case_launches`
    builds are those a call of the op makes (kernel, grid and constants, in order: the forward's
    partials and merge; the backward's terms, whole blocks, last block and target column), here with
    entropy, validation, its gradient and a temperature at 4 rows x 4,224 columns (two whole blocks)."""
    import torch

    from rl_engine.logprob.backends.triton import triton_backend
    from rl_engine.logprob.contract import LogprobContract

    launched: list[tuple[str, tuple[int, ...], dict[str, Any]]] = []
    monkeypatch.setattr(triton_backend.Launch, "run", lambda self, k: launched.append((self.kernel, self.grid, self.meta)))
    rows, real, padded, tiles = 4, 4200, 4224, 33
    contract = LogprobContract(real_vocab_size=real, padded_vocab_size=padded, num_vocab_tiles=tiles, num_sequences=1,
                               seq_len=rows, logits_dtype="bf16", temperature=0.7)
    x = torch.zeros(rows, padded, dtype=torch.bfloat16)
    targets, active, ones = torch.arange(rows), torch.ones(rows, dtype=torch.bool), torch.ones(rows)
    # the compiled mode's launch functions, stubbed (no interpreter: this file also runs under Triton 3.6,
    # whose interpreter the backend refuses); the op's own calls of them: tests/test_host_syncs.py
    _, lse, entropy, _ = triton_backend.triton_forward(x, targets, active, contract, True, True, "raise", "compiled")
    forward = list(launched)
    launched.clear()
    terms = triton_backend.triton_backward_terms(targets, active, ones, ones, ones, contract, padded, ones, ones,
                                                 "compiled")
    triton_backend.triton_backward(x, ones, terms, "compiled")
    built = triton_aot.case_launches(rows, real, padded, tiles, torch.bfloat16, True, True, 0.7, entropy_grad=True)
    assert forward == [(v.kernel, v.grid, v.meta) for v in built["forward"]]
    assert launched == [(v.kernel, v.grid, v.meta) for v in built["backward"]]
    assert [k for k, _, _ in launched] == ["backward_terms_kernel", "backward_kernel", "backward_kernel",
                                           "backward_target_kernel"]


@pytest.mark.slow
def test_the_roofline_variants_are_listed_with_their_own_case(tmp_path: Path, roofline_of: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``--variants``: fp16, entropy and validation off, the entropy gradient, TP 8, sm_100 and gfx942
    beside the default, each its own compiled kernels (no spill), its case recorded; TP 8 is rank 0's
    shard (an eighth of the columns: the same per-column work, an eighth of the floor); no entropy and
    no validation is less work per column than the default, the entropy gradient more backward; gfx942
    has its own model (amd_model) and the MI300X's prediction. Each NVIDIA variant's roofline is
    :func:`roofline_of`'s (the default and fp16 ones the tests above made)."""
    monkeypatch.setattr(triton_aot, "roofline", lambda output_dir, **kwargs: roofline_of(**kwargs)[1])
    names = ("default", "fp16", "no-entropy-no-validation", "entropy-gradient", "tp8", "sm_100", "gfx942")
    rows = {row["name"]: row for row in triton_aot.roofline_variants(tmp_path, names)}
    assert list(rows) == list(names)
    doc = dict(triton_aot.roofline(tmp_path / "doc"), variants=list(rows.values()), amd_model=triton_aot.AMD_MODEL)
    schemas.write_validated(tmp_path / "roofline.json", doc, "roofline")
    printed = triton_aot.variant_table(doc["variants"])
    assert len(printed) == len(names) and all(f"variant {name} " in line for name, line in zip(names, printed))
    amd = rows["gfx942"]
    assert amd["arch"] == "gfx942" and set(amd["predicted"]) == {"mi300x"} and amd["local_bytes"] == 0
    assert {k["kernel"] for k in amd["kernels"]} == {"forward_partials_kernel", "merge_kernel", "backward_terms_kernel",
                                                      "backward_kernel", "backward_target_kernel"}
    assert (tmp_path / "gfx942" / "forward-merge.gfx942.hsaco").stat().st_size > 0
    grad, base_row = rows["entropy-gradient"], rows["default"]
    assert grad["entropy_grad"] is True and grad["instructions_per_column"]["backward"] > \
        base_row["instructions_per_column"]["backward"]
    assert rows["fp16"]["dtype"] == "fp16" and rows["sm_100"]["arch"] == "sm_100" and rows["tp8"]["tp"] == 8
    assert all(row["local_bytes"] == 0 for row in rows.values()), rows
    base, lean = rows["default"]["instructions_per_column"], rows["no-entropy-no-validation"]["instructions_per_column"]
    assert lean["forward"] < base["forward"] and lean["backward"] == base["backward"], (base, lean)
    assert rows["tp8"]["padded_vocab"] == 151936 and rows["tp8"]["predicted"]["h100"]["forward_ms"] < \
        rows["default"]["predicted"]["h100"]["forward_ms"]
    assert (roofline_of(tp=8)[0] / "forward.sm_90.cubin").stat().st_size > 0
    with pytest.raises(triton_aot.AotError, match="tp=3 must divide padded_vocab=151936"):
        triton_aot.roofline(tmp_path / "bad", tp=3)
