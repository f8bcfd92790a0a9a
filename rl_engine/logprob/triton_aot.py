"""What the GPU will execute: the Triton backend's kernels compiled ahead of time, and read.

``triton.compile(..., target=GPUTarget(...))`` needs no GPU: it gives the PTX (and a cubin,
through the ptxas Triton ships) for NVIDIA targets and the AMDGCN ISA (and an hsaco) for AMD
ones. This module compiles every kernel variant of ``triton-vocab-parallel-logp-ws2`` with the
argument types and constants :mod:`rl_engine.logprob.triton_backend` launches it with
(:func:`launch_variants` builds them through the backend's own ``forward_launch`` and
``backward_launch``) and classifies every floating-point instruction:

* NVIDIA (:func:`ptx_findings`): allowed are IEEE round-to-nearest basic operations
  (``add.rn``, ``sub.rn``, ``mul.rn``, ``div.rn``, also their ``.f32x2`` packed form on sm_100),
  comparisons (``setp``), selects (``selp``), ``max``/``min``, ``abs``/``neg`` (sign bit),
  exact conversions (``cvt.rzi.s32.f32`` of an integral value, ``cvt.rn.f32.[su]32`` of an
  integer below ``2**24``) and moves; forbidden: ``fma``, ``mad`` on floats, ``.approx``,
  ``ex2``, ``lg2``, ``rcp``, ``sqrt``, ``.ftz``, and a ``mul``/``add``/``sub`` without ``.rn``
  (ptxas may contract such a pair into an FMA). Any other floating-point opcode is reported
  as unknown: the check fails closed.
* AMD (:func:`amdgcn_findings`): the ISA has no rounding suffixes (its default mode is round to
  nearest with denormals on, which Triton's AMD backend keeps for fp32); a fused multiply-add is
  ``v_fma*``, ``v_fmac*``, ``v_fmaak*``, ``v_fmamk*``, ``v_mad*``, ``v_pk_fma*``. A correctly
  rounded division (``div_rn``) is also built from FMAs, always inside the sequence
  ``v_div_scale_f32 ... v_div_fmas_f32 ... v_div_fixup_f32``; the rule: an FMA-class
  instruction is a division step when it lies inside such a sequence, and a contracted
  multiply-add otherwise. The backend's kernels divide nowhere, so with fusion off they must
  hold no FMA-class instruction at all; ``tests/test_triton_ptx.py`` tests the rule on a probe
  kernel that divides (its FMAs are all division steps, with fusion off) and the same probe
  with a multiply-add and fusion on (an FMA outside the sequences).

``python -m rl_engine.logprob.triton_aot`` prints the instruction counts per target.
"""

from __future__ import annotations

import collections
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch

from rl_engine.logprob.contract import LogprobContract
from rl_engine.logprob.triton_backend import (
    backward_launch,
    forward_launch,
    load_kernels,
)
from rl_engine.logprob.vocab_parallel import backward_terms

NVIDIA_TARGETS: tuple[int, ...] = (80, 90, 100)
AMD_TARGET = "gfx942"
# the default case's tile (151936 / 64 = 2374 columns, 4096 slots) and a padded 143-wide tile
WIDTHS: tuple[tuple[int, int, int], ...] = ((151936, 151936, 64), (997, 1001, 7))

_TORCH_TYPES = {torch.float32: "*fp32", torch.int16: "*i16", torch.int32: "*i32",
                torch.int8: "*i8", torch.int64: "*i64"}
_OPCODE = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)", re.M)
_FLOAT_TYPE = re.compile(r"\.(f16|bf16|f32|f64)(x2)?\b")
_PTX_ALLOWED = [
    re.compile(p) for p in (
        r"^(add|sub|mul|div)\.rn\.f32(x2)?$",
        r"^setp\.[a-z]+\.f32$",
        r"^selp\.f32$",
        r"^(max|min)(\.NaN)?\.f32$",
        r"^(abs|neg)\.f32$",
        r"^cvt\.rzi\.s32\.f32$",
        r"^cvt\.rn\.f32\.[su](8|16|32)$",
        r"^mov\.f32$",
        r"^(ld|st)\.[a-z.0-9]*f32$",
    )
]
_PTX_FORBIDDEN = re.compile(r"(^fma|^mad\..*f(16|32|64)|\.approx|^ex2|^lg2|^rcp|^sqrt|^rsqrt|\.ftz|^sin|^cos|^tanh)")
AMD_FMA = re.compile(r"^v_(pk_)?(fma|fmac|fmaak|fmamk|mad|mac)[a-z0-9_]*f(16|32|64)")
AMD_FORBIDDEN = re.compile(r"^v_(exp|log|rsq|sqrt|sin|cos)_")


@dataclass(frozen=True)
class Variant:
    """One kernel with the argument types and constants of one of the backend's launches."""

    name: str
    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, Any]


def _signature(kernel: Any, args: tuple[Any, ...], meta: dict[str, Any]) -> dict[str, str]:
    names = list(kernel.arg_names)
    sig: dict[str, str] = {}
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            sig[name] = _TORCH_TYPES[value.dtype]
        else:
            sig[name] = "i32" if -(2**31) <= int(value) < 2**31 else "i64"
    for name in meta:
        sig[name] = "constexpr"
    return sig


def launch_variants() -> list[Variant]:
    """Every (kernel, dtype, flags, tile width) the backend launches, as the backend builds it."""
    kernels = load_kernels("compiled")
    out: list[Variant] = []
    for real, padded, tiles in WIDTHS:
        for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                                  ("fp32", torch.float32)):
            contract = LogprobContract(real_vocab_size=real, padded_vocab_size=padded,
                                       num_vocab_tiles=tiles, num_sequences=1, seq_len=2,
                                       logits_dtype=dtype_name)
            raw = torch.zeros(2, padded, dtype=torch.float32 if dtype == torch.float32 else torch.int16)
            m = torch.zeros(2, tiles)
            bad = torch.zeros(2, tiles, dtype=torch.int8)
            for entropy, validate in ((True, True), (False, False)):
                _, args, meta = forward_launch(raw, contract, m, m, m if entropy else None,
                                               bad if validate else None, entropy, validate, dtype)
                out.append(Variant(
                    f"forward-{dtype_name}-w{contract.tile_width}-entropy{int(entropy)}-validate{int(validate)}",
                    "forward_partials_kernel",
                    _signature(kernels.forward_partials_kernel, args, meta), meta))
            lse = torch.zeros(2)
            targets = torch.zeros(2, dtype=torch.int64)
            active = torch.ones(2, dtype=torch.bool)
            terms = backward_terms(raw, targets, active, lse, lse, lse, contract)
            _, args, meta = backward_launch(raw, lse, terms, raw, dtype)
            out.append(Variant(f"backward-{dtype_name}-v{padded}", "backward_kernel",
                               _signature(kernels.backward_kernel, args, meta), meta))
    return out


def compile_variant(fn: Any, signature: dict[str, str], constexprs: dict[str, Any],
                    backend: str, arch: int | str, fusion: bool) -> dict[str, Any]:
    """``triton.compile`` for a target, no GPU needed; returns every stage (text, or the
    binary's bytes: ``cubin``, ``hsaco``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    warp = 32 if backend == "cuda" else 64
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget(backend, arch, warp), options={"enable_fp_fusion": fusion},
    )
    return dict(compiled.asm)


def opcodes(asm: str) -> collections.Counter[str]:
    """Opcode counts of PTX or AMDGCN text (directives, labels and comments left out)."""
    found: collections.Counter[str] = collections.Counter()
    for line in asm.splitlines():
        line = line.split("//")[0].split(";;")[0]
        match = _OPCODE.match(line)
        if match and not line.strip().startswith("."):
            found[match.group(1)] += 1
    return found


def ptx_findings(ptx: str) -> dict[str, list[str]]:
    """``{"forbidden": [...], "unknown": [...], "float_ops": [...]}`` of a PTX text."""
    forbidden, unknown, floats = [], [], []
    for op in sorted(opcodes(ptx)):
        if _PTX_FORBIDDEN.search(op) or re.match(r"^(mul|add|sub)\.f32", op):
            forbidden.append(op)
        elif _FLOAT_TYPE.search(op):
            floats.append(op)
            if not any(p.match(op) for p in _PTX_ALLOWED):
                unknown.append(op)
    return {"forbidden": forbidden, "unknown": unknown, "float_ops": floats}


def amdgcn_findings(asm: str) -> dict[str, Any]:
    """FMA-class instructions inside and outside division sequences, and forbidden ones."""
    inside = outside = 0
    in_division = False
    forbidden: list[str] = []
    for line in asm.splitlines():
        line = line.split(";")[0]
        match = _OPCODE.match(line)
        if not match:
            continue
        op = match.group(1)
        if op.startswith("v_div_scale_f32"):
            in_division = True
        elif op.startswith("v_div_fixup_f32"):
            in_division = False
        elif AMD_FMA.match(op) or op.startswith("v_div_fmas_f32"):
            if in_division:
                inside += 1
            else:
                outside += 1
        if AMD_FORBIDDEN.match(op):
            forbidden.append(op)
    return {"fma_in_division": inside, "fma_outside_division": outside,
            "forbidden": sorted(set(forbidden))}


def main(argv: list[str]) -> int:
    kernels = load_kernels("compiled")
    variants = launch_variants() if "--all" in argv else launch_variants()[:1] + launch_variants()[4:5]
    for variant in variants:
        fn = getattr(kernels, variant.kernel)
        for arch in NVIDIA_TARGETS:
            asm = compile_variant(fn, variant.signature, variant.constexprs, "cuda", arch, False)
            ops = opcodes(asm["ptx"])
            floats = {op: n for op, n in sorted(ops.items()) if _FLOAT_TYPE.search(op)}
            print(f"{variant.name} sm_{arch}: {floats} findings={ptx_findings(asm['ptx'])['forbidden']}")
        asm = compile_variant(fn, variant.signature, variant.constexprs, "hip", AMD_TARGET, False)
        ops = opcodes(asm["amdgcn"])
        floats = {op: n for op, n in sorted(ops.items()) if "f32" in op}
        print(f"{variant.name} {AMD_TARGET}: {floats} {amdgcn_findings(asm['amdgcn'])}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
