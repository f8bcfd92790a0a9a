"""What the GPU will execute: the Triton backend's kernels compiled ahead of time, as launched, and read.

``triton.compile(..., target=GPUTarget(...))`` needs no GPU: it gives the PTX (and a cubin,
through the ptxas Triton ships) for NVIDIA targets and the AMDGCN ISA (and an hsaco) for AMD
ones. This module compiles the kernels of ``triton-vocab-parallel-logp-ws2`` **with the
specialization Triton applies at launch**: the backend's own launches
(:func:`rl_engine.logprob.backends.triton.triton_backend.forward_launch` and ``backward_launches``) go through
Triton's own binder, which marks every pointer aligned to 16 bytes and every integer divisible
by 16 with ``tt.divisibility=16`` (and makes an integer equal to 1 a constant), exactly as
``kernel[grid](...)`` does before it compiles. A bare signature is another program (at the
default case of ``rl-engine-arith/1`` the two differed by a factor of two in instructions, and
only the launched one spilled). The launches are built on ``meta`` tensors, so the default
case's 8192 x 151936 logits need no memory.

Checks (:func:`ptx_findings`, :func:`amdgcn_findings`) classify every floating-point instruction:

* NVIDIA: allowed are IEEE round-to-nearest basic operations (``add.rn``, ``sub.rn``,
  ``mul.rn``, ``div.rn``, also their ``.f32x2`` packed form on sm_100), ``fma.rn.f32`` and
  ``fma.rn.f32x2`` (counted, a packed one as two: exactly the fused multiply-adds
  ``docs/arithmetic.md`` writes), comparisons (``setp``), selects (``selp``), ``max``/``min``
  and the warp's ``redux.sync.max``/``min`` (a maximum does not depend on grouping),
  ``abs``/``neg`` (sign bit), exact conversions
  (``cvt.rzi.s32.f32`` of an integral value, ``cvt.rn.f32.[su]32`` of an integer below ``2**24``)
  and moves; forbidden: ``mad`` on floats, ``.approx``, ``ex2``, ``lg2``, ``rcp``, ``sqrt``,
  ``.ftz``, and a ``mul``/``add``/``sub`` without ``.rn`` (ptxas may contract such a pair into an
  FMA). Any other floating-point opcode is reported as unknown: the check fails closed.
* AMD: the ISA has no rounding suffixes (its default mode is round to nearest with denormals
  on, which Triton's AMD backend keeps for fp32); a fused multiply-add is ``v_fma*``,
  ``v_fmac*``, ``v_fmaak*``, ``v_fmamk*``, ``v_mad*``, ``v_pk_fma*`` (two per instruction). A
  correctly rounded division (``div_rn``) is built from FMAs inside ``v_div_scale_f32 ...
  v_div_fixup_f32``; an FMA-class instruction inside such a sequence is a division step,
  outside it a multiply-add, and those must be exactly the specification's.

The roofline (:func:`roofline`, ``python -m rl_engine.logprob.backends.triton.triton_aot --roofline
--output-dir DIR``) compiles the default case's launches for sm_90 and reads each cubin's SASS
with the ``nvdisasm`` and ``cuobjdump`` the Triton wheel ships: instructions per thread,
registers, local memory (spills), whether the code loops; and predicts the time of the forward
and the backward at 8192 x 151936 bf16 on an H100 SXM and an H200 against the memory floor
(:data:`MODEL`, written into ``roofline.json``, ``schemas/roofline.schema.json``). It is a
paper model from the compiled SASS, not a measurement.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import functools
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_engine.logprob.backends.eager.vocab_parallel import real_local_columns
from rl_engine.logprob.backends.triton.triton_backend import (
    Launch,
    backward_launches,
    empty_terms,
    forward_launch,
    load_kernels,
    merge_launch,
    terms_launch,
)
from rl_engine.logprob.contract import LogprobContract

NVIDIA_TARGETS: tuple[int, ...] = (80, 90, 100)
AMD_TARGET = "gfx942"
ROOFLINE_ARCH = 90
# (name, real vocabulary, padded vocabulary, tiles): the default case (151936: every size
# divisible by 16), one that is not (GPT-2's 50257, padded to 50304, 48 tiles), and a small
# padded one (tiles of 143 columns) the quick tests compile
CASES: tuple[tuple[str, int, int, int], ...] = (
    ("default", 151936, 151936, 64),
    ("gpt2", 50257, 50304, 48),
    ("small", 997, 1001, 7),
)
ROOFLINE_ROWS = 8192
# docs/arithmetic.md: fused multiply-adds per column: E has 9 (step 2, two of step 4, six of
# step 5), the entropy's G* one more; the backward's E 9
FMA_PER_COLUMN = {"forward": 9, "forward_entropy": 10, "backward": 9}
# With a temperature, Markstein's division adds two per step (rl_engine.arith.division.STEPS: one step for a
# bf16 or binary16 logit, two for a binary32 logit and for the gradient), and the guard's IEEE path
# repeats the forward's second pass and the backward's E (the IEEE division itself is one div.rn)
MARKSTEIN_FMA_PER_STEP = 2
# The forward's split quotient (a bf16 or binary16 logit at a temperature its check accepts, one for the
# call: rl_engine.arith.division.split_reciprocal) is fma(x, r_lo, x * r_hi): one FMA where Markstein's step has two
SPLIT_FMA_PER_COLUMN = 1
# The rounding of a gradient to binary16 (triton_kernels.round_f16_bits) adds one FMA a column, whose product
# is exact: s = fma(b, 1.5 * 2**13, |f|)
F16_ROUND_FMA_PER_COLUMN = 1
TEMPERED_PROBE = 0.7  # the temperature of the tempered variants (its bf16 and binary16 forwards take the split quotient)

_TORCH_TYPES = {torch.float32: "*fp32", torch.int16: "*i16", torch.int32: "*i32",
                torch.int8: "*i8", torch.int64: "*i64"}
_OPCODE = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)", re.M)
_FLOAT_TYPE = re.compile(r"\.(f16|bf16|f32|f64)(x2)?\b")
_PTX_ALLOWED = [
    re.compile(p) for p in (
        r"^(add|sub|mul|div)\.rn\.f32(x2)?$",
        r"^fma\.rn\.f32(x2)?$",
        r"^setp\.[a-z]+\.f32$",
        r"^selp\.f32$",
        r"^(max|min)(\.NaN)?\.f32$",
        r"^(abs|neg)\.f32$",
        r"^cvt\.rzi\.s32\.f32$",
        r"^cvt\.rn\.f32\.[su](8|16|32)$",
        r"^cvt\.f32\.f16$",  # the exact widening of a binary16 logit (ptxas: HADD2.F32 on sm_90)
        r"^mov\.f32$",
        r"^(ld|st)\.[a-z.0-9]*f32$",
        r"^shfl\.sync\.[a-z]+\.[bf]32$",
        r"^redux\.sync\.(max|min)(\.NaN)?\.f32$",
    )
]
_PTX_FORBIDDEN = re.compile(
    r"(^fma(?!\.rn\.f32(x2)?$)|^mad\..*f(16|32|64)|\.approx|^ex2|^lg2|^rcp|^sqrt|^rsqrt|\.ftz|^sin|^cos|^tanh)")
AMD_FMA = re.compile(r"^v_(pk_)?(fma|fmac|fmaak|fmamk|mad|mac)[a-z0-9_]*f(16|32|64)")
AMD_FORBIDDEN = re.compile(r"^v_(exp|log|rsq|sqrt|sin|cos)_")


class AotError(RuntimeError):
    """A kernel does not compile for a target, or a tool of the Triton wheel is missing or fails."""


@dataclass(frozen=True)
class Variant:
    """One launch of the backend, specialized as Triton specializes it at launch."""

    name: str
    kernel: str
    signature: dict[str, str]
    constexprs: dict[Any, Any]
    attrs: dict[Any, Any]
    warps: int
    grid: tuple[int, ...]
    columns: int  # the logit columns the launch covers (rows x local vocabulary, for a whole launch set)


def launch_specialization(fn: Any, launch: Launch, target: Any) -> tuple[dict[str, str], dict[Any, Any], dict[Any, Any]]:
    """``(signature, constexprs, attrs)`` of ``launch`` exactly as ``fn[grid](*args, **meta)``
    derives them: Triton's own binder (``create_function_from_signature``) over the launch's
    arguments, then ``JITFunction._pack_args``."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.meta)
    _, signature, constexprs, attrs = fn._pack_args(backend, dict(launch.meta), bound, specialization, options)
    return signature, constexprs, attrs


def _meta_inputs(rows: int, real: int, padded: int, tiles: int, dtype: torch.dtype,
                 temperature: float = 1.0) -> dict[str, Any]:
    """The backend's launches for one case, on meta tensors (no memory; pointers count as aligned)."""
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    contract = LogprobContract(real_vocab_size=real, padded_vocab_size=padded, num_vocab_tiles=tiles,
                               num_sequences=1, seq_len=rows, logits_dtype=dtype_name, temperature=temperature)
    raw_dtype = torch.float32 if dtype == torch.float32 else torch.int16
    raw = torch.empty(rows, padded, dtype=raw_dtype, device="meta")
    m = torch.empty(rows, tiles, dtype=torch.float32, device="meta")
    bad = torch.empty(rows, tiles, dtype=torch.int8, device="meta")
    lse = torch.empty(rows, dtype=torch.float32, device="meta")
    targets = torch.empty(rows, dtype=torch.int64, device="meta")
    active = torch.empty(rows, dtype=torch.bool, device="meta")
    flags = torch.empty(rows, dtype=torch.int8, device="meta")
    return {"contract": contract, "raw": raw, "m": m, "bad": bad, "lse": lse, "targets": targets,
            "active": active, "flags": flags, "dtype_name": dtype_name}


def case_launches(rows: int, real: int, padded: int, tiles: int, dtype: torch.dtype,
                  entropy: bool = True, validate: bool = True, temperature: float = 1.0,
                  entropy_grad: bool = False, lse_grad: bool = True) -> dict[str, list[Launch]]:
    """``{"forward": [...], "backward": [...]}``: every launch the backend makes for one call on
    ``rows`` x ``padded`` logits held by one rank (TP = 1), built by the backend's own launch
    functions: the forward's partials and merge, the backward's terms, blocks and target column
    (``entropy_grad``: a backward with the entropy's gradient, which needs ``entropy``; ``lse_grad``:
    the loss uses the LSE, so the backward gets its gradient)."""
    inp = _meta_inputs(rows, real, padded, tiles, dtype, temperature)
    raw, m, lse, contract = inp["raw"], inp["m"], inp["lse"], inp["contract"]
    targets, active = inp["targets"], inp["active"]
    bad = inp["bad"] if validate else None
    forward = [forward_launch(raw, contract, m, m, m if entropy else None, bad, entropy, validate, dtype),
               merge_launch(m, m, m if entropy else None, active, lse, lse, lse if entropy else None,
                            t32=contract.temperature32, x=raw, targets=targets, bad=bad,
                            flags=inp["flags"] if validate else None, real_vocab=real, logits_dtype=dtype)]
    terms = empty_terms(rows, raw.device, real_local_columns(contract), contract.temperature32, entropy_grad)
    backward = [terms_launch(targets, active, lse, lse, lse if lse_grad else None, 0, padded, terms,
                             lse if entropy_grad else None, lse if entropy_grad else None)]
    return {"forward": forward, "backward": backward + backward_launches(raw, lse, terms, raw, dtype)}


LAUNCH_PARTS = {"merge_kernel": "-merge", "backward_terms_kernel": "-terms", "backward_target_kernel": "-target"}


def launch_part(launch: Launch) -> str:
    """The suffix naming one of a phase's launches: ``-merge`` for the forward's merge,
    ``-terms``/``-blocks``/``-tail``/``-target`` for the backward's."""
    if launch.kernel == "backward_kernel":
        return "-tail" if launch.meta.get("MASKED") else "-blocks"
    return LAUNCH_PARTS.get(launch.kernel, "")


def launch_variants(arch: int = ROOFLINE_ARCH, rows: int = ROOFLINE_ROWS,
                    cases: tuple[tuple[str, int, int, int], ...] = CASES, tempered: bool = False) -> list[Variant]:
    """Every (case, dtype, flags) launch the backend makes, specialized for ``arch`` as at launch
    (``tempered``: the kernels of a temperature, :data:`TEMPERED_PROBE`, named with a ``-tempered``
    suffix; a temperature's value is not specialized, only whether there is one)."""
    temperature = TEMPERED_PROBE if tempered else 1.0
    from triton.backends.compiler import GPUTarget

    kernels = load_kernels("compiled")
    target = GPUTarget("cuda", arch, 32)
    out: list[Variant] = []
    for case, real, padded, tiles in cases:
        for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
            for entropy, validate in ((True, True), (False, False)):
                launches = case_launches(rows, real, padded, tiles, dtype, entropy, validate, temperature)
                groups = [("forward", launches["forward"])]
                if entropy:  # the backward does not depend on the forward's flags
                    groups.append(("backward", launches["backward"]))
                for phase, group in groups:
                    for launch in group:
                        fn = getattr(kernels, launch.kernel)
                        sig, cx, attrs = launch_specialization(fn, launch, target)
                        flags = f"-entropy{int(entropy)}-validate{int(validate)}" if phase == "forward" else ""
                        suffix = "-tempered" if tempered else ""
                        out.append(Variant(f"{phase}-{case}-{dtype_name}{flags}{launch_part(launch)}{suffix}",
                                           launch.kernel, sig, cx, attrs, launch.warps, launch.grid, rows * padded))
    return out


def compile_variant(fn: Any, variant: Variant, backend: str, arch: int | str, fusion: bool,
                    specialized: bool = False) -> dict[str, Any]:
    """``triton.compile`` of a launch for a target, no GPU needed; returns every stage (text, or
    the binary's bytes: ``cubin``, ``hsaco``). ``specialized``: the variant is already specialized
    for this target (the roofline's own launches)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    warp = 32 if backend == "cuda" else 64
    target = GPUTarget(backend, arch, warp)
    if specialized or (backend == "cuda" and arch == ROOFLINE_ARCH):
        signature, constexprs, attrs = variant.signature, variant.constexprs, variant.attrs
    else:  # the same launch, specialized for this target
        signature, constexprs, attrs = _respecialized(fn, variant, target)
    try:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
            target=target, options={"enable_fp_fusion": fusion, "num_warps": variant.warps},
        )
    except Exception as exc:  # noqa: BLE001 - say which kernel and target, and why
        raise AotError(f"triton {triton.__version__} cannot compile {variant.name} for {backend} {arch}: "
                       f"{type(exc).__name__}: {exc}") from exc
    return dict(compiled.asm)


def _respecialized(fn: Any, variant: Variant, target: Any) -> tuple[dict[str, str], dict[Any, Any], dict[Any, Any]]:
    """The variant's launch specialized for another target (the specialization rules are the
    backend's: AMD's differ from NVIDIA's)."""
    for launch_variant, launch in _launch_index().items():
        if launch_variant == variant.name:
            return launch_specialization(fn, launch, target)
    raise AotError(f"no launch named {variant.name}")


_LAUNCHES: dict[str, Launch] = {}


def _launch_index() -> dict[str, Launch]:
    """Every launch of :func:`launch_variants`' cases by variant name (built once)."""
    if not _LAUNCHES:
        for case, real, padded, tiles in CASES:
            for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
                for entropy, validate in ((True, True), (False, False)):
                    for temperature, suffix in ((1.0, ""), (TEMPERED_PROBE, "-tempered")):
                        launches = case_launches(ROOFLINE_ROWS, real, padded, tiles, dtype, entropy, validate,
                                                 temperature)
                        flags = f"-entropy{int(entropy)}-validate{int(validate)}"
                        for launch in launches["forward"]:
                            _LAUNCHES[f"forward-{case}-{dtype_name}{flags}{launch_part(launch)}{suffix}"] = launch
                        for launch in launches["backward"]:
                            _LAUNCHES[f"backward-{case}-{dtype_name}{launch_part(launch)}{suffix}"] = launch
    return _LAUNCHES


def opcodes(asm: str) -> collections.Counter[str]:
    """Opcode counts of PTX or AMDGCN text (directives, labels and comments left out)."""
    found: collections.Counter[str] = collections.Counter()
    for line in asm.splitlines():
        line = line.split("//")[0].split(";;")[0]
        match = _OPCODE.match(line)
        if match and not line.strip().startswith("."):
            found[match.group(1)] += 1
    return found


_TTIR_ZERO = re.compile(r"^\s*(%[\w.]+) = arith\.constant (?:dense<0\.000000e\+00>|0\.000000e\+00) :")
_TTIR_SUBF = re.compile(r"=\s*arith\.subf\s+(%[\w.]+),")


def zero_subtractions(ttir: str) -> list[str]:
    """The ``arith.subf +0, v`` on tensors of a Triton IR text: Triton 3.6 lowers a float's unary
    minus to it, which is not IEEE negation (``+0 - (+0)`` is ``+0``) and which ptxas cannot fold into
    an FMA's operand (a ``FADD`` a column); the kernels negate a column's value by
    ``triton_kernels.negate`` (``fneg``). A scalar's (the forward's ``-hi_x`` of a positive bound:
    exact, once a program) is left out."""
    zeros = {m.group(1) for m in map(_TTIR_ZERO.match, ttir.splitlines()) if m}
    return [line.strip() for line in ttir.splitlines()
            if (m := _TTIR_SUBF.search(line)) and m.group(1) in zeros and ": tensor<" in line]


def ptx_findings(ptx: str) -> dict[str, Any]:
    """``{"forbidden": [...], "unknown": [...], "float_ops": [...], "fma": n}`` of a PTX text."""
    forbidden, unknown, floats = [], [], []
    ops = opcodes(ptx)
    for op in sorted(ops):
        if _PTX_FORBIDDEN.search(op) or re.match(r"^(mul|add|sub)\.f32", op):
            forbidden.append(op)
        elif _FLOAT_TYPE.search(op):
            floats.append(op)
            if not any(p.match(op) for p in _PTX_ALLOWED):
                unknown.append(op)
    fma = ops.get("fma.rn.f32", 0) + 2 * ops.get("fma.rn.f32x2", 0)  # a packed one is two
    return {"forbidden": forbidden, "unknown": unknown, "float_ops": floats, "fma": fma}


def amdgcn_findings(asm: str) -> dict[str, Any]:
    """FMA-class instructions inside and outside division sequences (a ``v_pk_`` one counts two
    fused multiply-adds), and forbidden ones."""
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
            n = 2 if op.startswith("v_pk_") else 1
            if in_division:
                inside += n
            else:
                outside += n
        if AMD_FORBIDDEN.match(op):
            forbidden.append(op)
    return {"fma_in_division": inside, "fma_outside_division": outside,
            "forbidden": sorted(set(forbidden))}


# ------------------------------------------------------------------------------------ SASS


def nvidia_tool(name: str) -> Path:
    """A binary of the Triton wheel's ``backends/nvidia/bin`` (``nvdisasm``, ``cuobjdump``)."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.is_file():
        raise AotError(f"{path} is missing: the Triton wheel ships {name} for reading SASS; reinstall triton")
    return path


@dataclass(frozen=True)
class Sass:
    """What one cubin runs: its instructions (NOPs left out) and resources, and the instructions
    a thread executes on the kernel's shortest path from entry to exit (its fast path: with a
    temperature, the tiles and blocks that need no IEEE division, each division's own fast path)
    and on its longest (every branch taken, every division's slow-path call made)."""

    opcodes: dict[str, int]
    instructions: int  # per thread, static
    registers: int
    local_bytes: int  # local memory per thread: spills (and stack)
    shared_bytes: int
    loops: bool  # a branch back to an earlier instruction (the trailing self-branch trap excluded)
    path_opcodes: dict[str, int]  # executed on the shortest path (the static ones when the code loops)
    path_instructions: int
    longest_instructions: int  # executed on the longest path (static when the code loops)


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)\s*([^;]*);")
_LABEL = re.compile(r"^\s*([.$][\w.$]+):")
_BRANCH_TARGET = re.compile(r"`\(([.$][\w.$]+)\)")
_PREDICATE_OPERAND = re.compile(r"^!?U?P[T0-9]+\s*,")


@functools.lru_cache(maxsize=512)
def read_sass(cubin: bytes) -> Sass:
    """Disassemble a cubin (``nvdisasm -c``) and read its resources (``cuobjdump --dump-resource-usage``).

    Read once a process for each cubin (its bytes are the key): the roofline, its variants and gpu-smoke's
    comparison of the launched binaries meet the same kernels again (the merge and target kernels of
    every variant, a roofline kernel and its launched twin), and each reading is two processes. Callers
    share the returned value and do not change it."""
    with tempfile.TemporaryDirectory(prefix="rl_engine-sass-") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        try:
            text = subprocess.run([str(nvidia_tool("nvdisasm")), "-c", str(path)], capture_output=True,
                                  text=True, check=True, timeout=300).stdout
            usage = subprocess.run([str(nvidia_tool("cuobjdump")), "--dump-resource-usage", str(path)],
                                   capture_output=True, text=True, check=True, timeout=300).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise AotError(f"reading the SASS failed: {exc}") from exc
    return parse_sass(text, usage)


@dataclass(frozen=True)
class _Instruction:
    address: int
    op: str
    guarded: bool  # @P / @!P: it may not execute
    operands: str


def _paths(code: list[_Instruction], labels: dict[str, int]) -> tuple[collections.Counter[str], int]:
    """The opcodes on the shortest path from the first instruction to an unguarded ``EXIT``, and the
    length of the longest, in a code whose branches all go forward. A ``CALL`` costs its callee's
    path to ``RET``; a conditional branch (a guard or a predicate operand) may go either way; the
    trailing self-branch trap ends a path."""
    index = {inst.address: i for i, inst in enumerate(code)}
    end = len(code)

    def target(inst: _Instruction) -> int:
        found = _BRANCH_TARGET.search(inst.operands)
        if found is None or found.group(1) not in labels:
            raise AotError(f"SASS branch without a known target: {inst.op} {inst.operands}")
        return index.get(labels[found.group(1)], end)

    nxt: list[list[int]] = []
    callee: list[int | None] = []
    for i, inst in enumerate(code):
        cal = None
        if inst.op in ("BRA", "BRX", "JMP"):
            t = target(inst)
            conditional = inst.guarded or bool(_PREDICATE_OPERAND.match(inst.operands))
            succ = [] if t == i else ([i + 1, t] if conditional else [t])
        elif inst.op == "EXIT" or inst.op == "RET":  # a guarded one is taken as not exiting:
            succ = [i + 1] if inst.guarded else []  # every program of the launches has work
        elif inst.op == "CALL":
            succ, cal = [i + 1], target(inst)
        else:
            succ = [i + 1]
        nxt.append([s for s in succ if s <= end])
        callee.append(cal)
    short = [0] * (end + 1)
    long = [0] * (end + 1)
    best: list[int | None] = [None] * (end + 1)
    for i in range(end - 1, -1, -1):
        extra_short = extra_long = 0
        if callee[i] is not None:
            c = callee[i]
            assert c is not None and c > i
            extra_short, extra_long = short[c], long[c]
        options = nxt[i]
        if options:
            pick = min(options, key=lambda s: short[s])
            best[i] = pick
            short[i] = 1 + extra_short + short[pick]
            long[i] = 1 + extra_long + max(long[s] for s in options)
        else:
            short[i], long[i] = 1, 1
    ops: collections.Counter[str] = collections.Counter()

    def walk(i: int) -> None:
        while i < end:
            ops[code[i].op] += 1
            c = callee[i]
            if c is not None:
                walk(c)
            nb = best[i]
            if nb is None:
                return
            i = nb

    walk(0)
    return ops, long[0] if code else 0


def parse_sass(text: str, usage: str) -> Sass:
    """:class:`Sass` from ``nvdisasm -c`` text and ``cuobjdump --dump-resource-usage`` text."""
    ops: collections.Counter[str] = collections.Counter()
    labels: dict[str, int] = {}
    pending: list[str] = []
    branches: list[tuple[int, str]] = []
    code: list[_Instruction] = []
    for line in text.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        match = _SASS_LINE.search(line)
        if not match:
            continue
        address, guard, op, operands = int(match.group(1), 16), match.group(2), match.group(3), match.group(5)
        for name in pending:
            labels[name] = address
        pending = []
        if op == "NOP":
            continue
        ops[op] += 1
        code.append(_Instruction(address, op, guard is not None, operands.strip()))
        target = _BRANCH_TARGET.search(operands)
        if op in ("BRA", "BRX", "JMP") and target:
            branches.append((address, target.group(1)))
    # an instruction a label names that is a NOP: the label goes to the next real instruction
    real = [inst.address for inst in code]
    for name, address in list(labels.items()):
        at = bisect.bisect_left(real, address)
        labels[name] = real[at] if at < len(real) else address
    loops = any(labels.get(target, address + 1) < address for address, target in branches)
    resources = dict(re.findall(r"\b(REG|SHARED|LOCAL|STACK):(\d+)", usage))
    if "REG" not in resources:
        raise AotError(f"cuobjdump printed no resource usage: {usage[:200]!r}")
    static = dict(sorted(ops.items()))
    if loops:
        path_ops, longest = static, sum(ops.values())
    else:
        found, longest = _paths(code, labels)
        path_ops = dict(sorted(found.items()))
    return Sass(static, sum(ops.values()), int(resources["REG"]),
                int(resources.get("LOCAL", 0)) + int(resources.get("STACK", 0)), int(resources.get("SHARED", 0)),
                loops, path_ops, sum(path_ops.values()), longest)


# ------------------------------------------------------------------------------------ roofline

# The throughput model of the roofline, written into roofline.json. An H100 SXM and an H200
# have the same 132 SMs of 4 schedulers, each issuing one warp instruction (32 threads) per
# clock at up to 1.98 GHz; the FP32 pipe (FADD, FMUL, FFMA) takes one warp instruction per
# clock, the integer/logic/compare/select/min-max pipe one every two clocks, conversions one
# every four. A kernel's time is the largest of: issue (every instruction), each pipe's
# occupancy, and its memory traffic at the HBM bandwidth.
MODEL: dict[str, Any] = {
    "sms": 132,
    "schedulers_per_sm": 4,
    "threads_per_warp": 32,
    "clock_hz": 1.98e9,
    "bandwidth_bytes_per_s": {"h100": 3.35e12, "h200": 4.8e12},
    "rows": ROOFLINE_ROWS,
    "vocab": 151936,
    "logit_bytes": 2,
    "half_rate": ["FMNMX", "FSETP", "FSEL", "SEL", "ISETP", "IADD3", "IMAD", "IMNMX", "SHF", "LOP3", "PRMT",
                  "LEA", "SGXT", "IABS", "BMSK", "FCHK", "VIADD", "VIMNMX", "VIADDMNMX", "IADD", "ISCADD"],
    "quarter_rate": ["F2I", "I2F", "F2F", "I2I", "F2FP", "MUFU", "POPC", "FLO", "BREV"],
}


def _kernel_seconds(sass: Sass, threads: int, programs: int, model: dict[str, Any]) -> float:
    """Issue-bound and pipe-bound time of one launch (the larger), on its fast path."""
    rate = model["sms"] * model["schedulers_per_sm"] * model["threads_per_warp"] * model["clock_hz"]
    half = sum(n for op, n in sass.path_opcodes.items() if op in model["half_rate"])
    quarter = sum(n for op, n in sass.path_opcodes.items() if op in model["quarter_rate"])
    slots = max(sass.path_instructions, 2 * half, 4 * quarter)
    return slots * threads * programs / rate


def output_directory(output_dir: Path) -> Path:
    """``output_dir`` made (with its parents) if missing; :class:`AotError` naming ``--output-dir`` when a
    file stands where it or a parent must be, or it cannot be made."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise AotError(f"--output-dir {output_dir}: a file, not a directory, is at that path or above it; give "
                       "a directory for roofline.json and the cubins (it is made when missing)") from None
    except OSError as exc:
        raise AotError(f"--output-dir {output_dir}: cannot be made ({exc.strerror}); give a directory you can "
                       "write") from None
    return output_dir


def roofline(output_dir: Path, arch: int = ROOFLINE_ARCH, rows: int = ROOFLINE_ROWS,
             case: tuple[int, int, int] = CASES[0][1:], dtype: torch.dtype = torch.bfloat16,
             temperature: float = 1.0, entropy: bool = True, validate: bool = True, tp: int = 1,
             entropy_grad: bool = False, lse_grad: bool = True) -> dict[str, Any]:
    """Compile the launches of one case (default: the default case, bf16, 8192 x 151936, 64
    tiles, entropy and validation on, no temperature) for ``arch``, write each cubin into
    ``output_dir`` and return the roofline document (``temperature`` other than 1 compiles the
    kernels with section 6 step 0's division). Instructions per column and times are those of each
    kernel's fast path (:class:`Sass`): the executed count of every tile and block that needs no
    IEEE division, which without a temperature is every instruction but the trailing trap.
    ``entropy``/``validate``: the forward's flags; ``tp``: one rank's shard of the case (rank 0's
    ``padded / tp`` columns and ``tiles / tp`` tiles; both must divide), the floor that rank's bytes;
    ``entropy_grad``: the backward with the entropy's gradient (the forward then computes the entropy);
    ``lse_grad``: whether the loss uses the LSE (the backward's terms read its gradient).
    Every kernel of a pass is compiled and summed: the forward's partials and merge, the backward's
    terms, blocks, last block and target column."""
    output_directory(output_dir)  # before triton is imported or anything compiled
    import triton

    kernels = load_kernels("compiled")
    whole, (real, padded, tiles) = _shard(case, tp)
    launches = case_launches(rows, real, padded, tiles, dtype, entropy or entropy_grad, validate, temperature,
                             entropy_grad, lse_grad)
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", arch, 32)
    columns = rows * padded
    entries: list[dict[str, Any]] = []
    seconds = {"forward": 0.0, "backward": 0.0}
    per_column = {"forward": 0.0, "backward": 0.0}
    for phase, group in launches.items():
        for launch in group:
            fn = getattr(kernels, launch.kernel)
            sig, cx, attrs = launch_specialization(fn, launch, target)
            name = f"{phase}{launch_part(launch)}"
            variant = Variant(name, launch.kernel, sig, cx, attrs, launch.warps, launch.grid, columns)
            asm = compile_variant(fn, variant, "cuda", arch, False, specialized=True)
            cubin = f"{name}.sm_{arch}.cubin"
            (output_dir / cubin).write_bytes(asm["cubin"])
            sass = read_sass(asm["cubin"])
            threads = 32 * launch.warps
            programs = 1
            for g in launch.grid:
                programs *= g
            share = sass.path_instructions * threads * programs / columns
            per_column[phase] += share
            seconds[phase] += _kernel_seconds(sass, threads, programs, MODEL)
            entries.append({
                "name": name, "kernel": launch.kernel, "cubin": cubin, "arch": f"sm_{arch}",
                "sass_per_thread": sass.instructions, "path_per_thread": sass.path_instructions,
                "longest_path_per_thread": sass.longest_instructions, "threads_per_program": threads, "programs": programs,
                "registers": sass.registers, "local_bytes": sass.local_bytes, "shared_bytes": sass.shared_bytes,
                "loops": sass.loops, "instructions_per_column": round(share, 3),
                "fma_per_thread": sass.opcodes.get("FFMA", 0), "opcodes": sass.opcodes,
                "specialization": {k: v for k, v in sig.items() if v != "constexpr"},
                "divisible_by_16": sorted(fn.arg_names[k[0]] for k, v in attrs.items()
                                          if any(a == ["tt.divisibility", 16] for a in v)),
                "constants": constant_names(fn, cx),
            })
    logits = columns * torch.empty((), dtype=dtype).element_size()
    predicted = {}
    for gpu, bandwidth in MODEL["bandwidth_bytes_per_s"].items():
        floor_fwd = logits / bandwidth  # read the logits once
        floor_bwd = 2 * logits / bandwidth  # read them again, write the gradient
        fwd = max(seconds["forward"], floor_fwd)
        bwd = max(seconds["backward"], floor_bwd)
        predicted[gpu] = {
            "forward_floor_ms": round(floor_fwd * 1e3, 4), "forward_ms": round(fwd * 1e3, 4),
            "backward_floor_ms": round(floor_bwd * 1e3, 4), "backward_ms": round(bwd * 1e3, 4),
            "forward_over_floor": round(fwd / floor_fwd, 4),
            "forward_backward_over_floor": round((fwd + bwd) / (floor_fwd + floor_bwd), 4),
            "forward_issue_ms": round(seconds["forward"] * 1e3, 4),
            "backward_issue_ms": round(seconds["backward"] * 1e3, 4),
        }
    from rl_engine.tables import SCHEMA_VERSION

    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "paper model from the compiled SASS (not a measurement)",
        "triton": triton.__version__,
        "case": _case_record(rows, whole, dtype, entropy or entropy_grad, validate, temperature, tp, entropy_grad),
        "model": {**MODEL, "rows": rows, "vocab": padded, "logit_bytes": torch.empty((), dtype=dtype).element_size()},
        "kernels": entries,
        "instructions_per_column": {k: round(v, 3) for k, v in per_column.items()},
        "predicted": predicted,
    }


def _shard(case: tuple[int, int, int], tp: int) -> tuple[dict[str, int], tuple[int, int, int]]:
    """The whole case's sizes, and rank 0's ``(real, padded, tiles)`` at ``tp`` (which must divide)."""
    real, padded, tiles = case
    if tp < 1 or padded % tp or tiles % tp:
        raise AotError(f"tp={tp} must divide padded_vocab={padded} and num_vocab_tiles={tiles}")
    whole = {"real_vocab": real, "padded_vocab": padded, "num_vocab_tiles": tiles}
    return whole, (min(real, padded // tp), padded // tp, tiles // tp)


def _case_record(rows: int, whole: dict[str, int], dtype: torch.dtype, entropy: bool, validate: bool,
                 temperature: float, tp: int, entropy_grad: bool) -> dict[str, Any]:
    return {"rows": rows, **whole,
            "dtype": {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype],
            "entropy": entropy, "validate": validate, "temperature": temperature, "tp": tp,
            "entropy_grad": entropy_grad}


# ------------------------------------------------------------------------------------ launched binaries


def constant_names(fn: Any, constexprs: dict[Any, Any]) -> dict[str, Any]:
    """A launch's compile-time constants by argument name (``constexprs`` as Triton keys them: by the
    argument's index path), what tells two binaries of one kernel apart."""
    return {fn.arg_names[key[0]] if isinstance(key, tuple) else str(key): value
            for key, value in sorted(constexprs.items(), key=lambda kv: str(kv[0]))}


@dataclass(frozen=True)
class Launched:
    """One binary a process compiled and launched: its kernel, constants and cubin."""

    kernel: str
    constants: dict[str, Any]
    cubin: bytes


def launched_binary(compiled: Any) -> Launched:
    """:class:`Launched` of a Triton ``CompiledKernel`` (a JIT cache entry, or what ``triton.compile``
    returns: the same object)."""
    src = compiled.src
    fn = src.fn
    return Launched(fn.__name__, constant_names(fn, dict(src.constants)), bytes(compiled.asm["cubin"]))


def launched_binaries(kernels: Any) -> list[Launched]:
    """Every binary of the backend's kernels this process compiled and launched (the JIT caches of
    ``kernels``' jit functions, every device), as :class:`Launched`."""
    found = []
    for name in ("forward_partials_kernel", "merge_kernel", "backward_terms_kernel", "backward_kernel",
                 "backward_target_kernel"):
        fn = getattr(kernels, name)
        for cache in getattr(fn, "device_caches", {}).values():
            for compiled in list(cache[0].values()):
                if "cubin" in compiled.asm:
                    found.append(launched_binary(compiled))
    return found


def sass_comparison(doc: dict[str, Any], launched: list[Launched]) -> list[dict[str, Any]]:
    """Each roofline kernel beside the launched binary of the same kernel and constants: SASS
    instructions (static and on the fast path), registers and local memory of both, and whether
    each is equal (``launched`` null when the process launched no such binary)."""
    rows = []
    for entry in doc["kernels"]:
        same = [b for b in launched if b.kernel == entry["kernel"] and b.constants == entry["constants"]]
        row: dict[str, Any] = {"name": entry["name"], "kernel": entry["kernel"], "roofline": {
            key: entry[key] for key in ("sass_per_thread", "path_per_thread", "registers", "local_bytes")}}
        if not same:
            row.update(launched=None, equal=None)
        else:
            sass = read_sass(same[0].cubin)
            row["launched"] = {"sass_per_thread": sass.instructions, "path_per_thread": sass.path_instructions,
                               "registers": sass.registers, "local_bytes": sass.local_bytes}
            row["equal"] = {key: row["launched"][key] == row["roofline"][key] for key in row["roofline"]}
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------ gfx942

# The time model of gfx942 (an AMD Instinct MI300X), written into roofline.json's amd_model. No
# SASS-like path analysis exists for the AMD ISA here: the counts are static (with a temperature the
# guard's IEEE path is included: an upper bound).
AMD_MODEL: dict[str, Any] = {
    "gpu": "mi300x",
    "arch": AMD_TARGET,
    "compute_units": 304,
    "simds_per_cu": 4,
    "lanes_per_simd_per_clock": 16,
    "wave_size": 64,
    "clock_hz": 2.1e9,
    "bandwidth_bytes_per_s": 5.3e12,
    "assumptions": [
        "every vector instruction (v_*, and the memory instructions global_*, buffer_*, flat_*, ds_*) of a wave64 "
        "occupies its SIMD 4 clocks (16 lanes a clock): 304 CUs x 4 SIMDs x 16 lanes x 2.1 GHz = 40.9e12 thread "
        "instructions a second; a packed v_pk_* instruction counts once (it does two lanes' work in those clocks)",
        "scalar instructions (s_*) run on the scalar unit beside the vector ones and are not timed; s_nop hazard "
        "waits are not timed",
        "static instruction counts (every branch's code counted once, the guard's IEEE path with a temperature)",
        "a pass takes the larger of its kernels' summed issue time and its memory traffic at 5.3 TB/s (the logits "
        "read once forward; read again and the gradient written backward); launch latency, caches and occupancy "
        "left out",
    ],
}
AMD_VECTOR_PREFIXES = ("v_", "global_", "buffer_", "flat_", "ds_")
_AMD_OPCODE = re.compile(r"^\s+([a-z][a-z0-9_]*)")


@dataclass(frozen=True)
class AmdCode:
    """What one gfx942 kernel runs, read from its AMDGCN text: static opcode counts per wave lane (a
    thread), vector and scalar instructions, and resources."""

    opcodes: dict[str, int]
    vector: int
    scalar: int  # s_* but s_nop
    nops: int
    vgprs: int
    scratch_bytes: int  # private memory per lane: spills
    lds_bytes: int


def read_amdgcn(asm: str) -> AmdCode:
    """:class:`AmdCode` of the AMDGCN text ``triton.compile`` gives for gfx942 (one kernel)."""
    body = asm.split(".Lfunc_end0:")[0]
    ops: collections.Counter[str] = collections.Counter()
    for line in body.splitlines():
        match = _AMD_OPCODE.match(line.split(";")[0])
        if match:
            ops[match.group(1)] += 1

    def resource(name: str) -> int:
        found = re.search(rf"; {name}: (\d+)", asm)
        if found is None:
            raise AotError(f"the AMDGCN text has no '; {name}:' line: not a kernel triton compiled for {AMD_TARGET}")
        return int(found.group(1))

    nops = ops.get("s_nop", 0)
    return AmdCode(dict(sorted(ops.items())), sum(n for op, n in ops.items() if op.startswith(AMD_VECTOR_PREFIXES)),
                   sum(n for op, n in ops.items() if op.startswith("s_")) - nops, nops, resource("NumVgprs"),
                   resource("ScratchSize"), resource("LDSByteSize"))


def amd_roofline(output_dir: Path, rows: int = ROOFLINE_ROWS, case: tuple[int, int, int] = CASES[0][1:],
                 dtype: torch.dtype = torch.bfloat16, temperature: float = 1.0, entropy: bool = True,
                 validate: bool = True, tp: int = 1, entropy_grad: bool = False) -> dict[str, Any]:
    """The gfx942 counterpart of :func:`roofline` under :data:`AMD_MODEL`: every launch of the case
    specialized as Triton's AMD backend specializes it, compiled (each ``.hsaco`` written into
    ``output_dir``), read, and the passes' times predicted for an MI300X. Returns a variant row."""
    output_directory(output_dir)
    from triton.backends.compiler import GPUTarget

    kernels = load_kernels("compiled")
    whole, (real, padded, tiles) = _shard(case, tp)
    launches = case_launches(rows, real, padded, tiles, dtype, entropy or entropy_grad, validate, temperature,
                             entropy_grad)
    target = GPUTarget("hip", AMD_TARGET, 64)
    rate = AMD_MODEL["compute_units"] * AMD_MODEL["simds_per_cu"] * AMD_MODEL["lanes_per_simd_per_clock"] * \
        AMD_MODEL["clock_hz"]
    columns = rows * padded
    seconds = {"forward": 0.0, "backward": 0.0}
    per_column = {"forward": 0.0, "backward": 0.0}
    entries = []
    for phase, group in launches.items():
        for launch in group:
            fn = getattr(kernels, launch.kernel)
            sig, cx, attrs = launch_specialization(fn, launch, target)
            name = f"{phase}{launch_part(launch)}"
            variant = Variant(name, launch.kernel, sig, cx, attrs, launch.warps, launch.grid, columns)
            asm = compile_variant(fn, variant, "hip", AMD_TARGET, False, specialized=True)
            (output_dir / f"{name}.{AMD_TARGET}.hsaco").write_bytes(asm["hsaco"])
            code = read_amdgcn(asm["amdgcn"])
            threads = AMD_MODEL["wave_size"] * launch.warps
            programs = 1
            for g in launch.grid:
                programs *= g
            per_column[phase] += code.vector * threads * programs / columns
            seconds[phase] += code.vector * threads * programs / rate
            entries.append({"name": name, "kernel": launch.kernel, "hsaco": f"{name}.{AMD_TARGET}.hsaco",
                            "vector_per_thread": code.vector, "scalar_per_thread": code.scalar, "nops": code.nops,
                            "vgprs": code.vgprs, "scratch_bytes": code.scratch_bytes, "lds_bytes": code.lds_bytes,
                            "threads_per_program": threads, "programs": programs,
                            "instructions_per_column": round(code.vector * threads * programs / columns, 3)})
    logits = columns * torch.empty((), dtype=dtype).element_size()
    floor_fwd = logits / AMD_MODEL["bandwidth_bytes_per_s"]
    floor_bwd = 2 * floor_fwd
    fwd, bwd = max(seconds["forward"], floor_fwd), max(seconds["backward"], floor_bwd)
    return {
        "name": "gfx942", "arch": AMD_TARGET,
        **_case_record(rows, whole, dtype, entropy or entropy_grad, validate, temperature, tp, entropy_grad),
        "instructions_per_column": {k: round(v, 3) for k, v in per_column.items()},
        "registers": max(e["vgprs"] for e in entries), "local_bytes": max(e["scratch_bytes"] for e in entries),
        "predicted": {"mi300x": {"forward_ms": round(fwd * 1e3, 4), "backward_ms": round(bwd * 1e3, 4),
                                 "forward_over_floor": round(fwd / floor_fwd, 4),
                                 "forward_backward_over_floor": round((fwd + bwd) / (floor_fwd + floor_bwd), 4)}},
        "kernels": entries,
    }


# The variants beside the default case (python -m rl_engine.logprob.backends.triton.triton_aot --roofline --variants):
# name -> roofline() arguments other than the default's (``arch`` gfx942: :func:`amd_roofline`). Together
# they cover what trainers launch (tests/test_triton_ptx.py pins it): each logits dtype, TP 1 and 8,
# entropy and validation on and off, the entropy gradient, a temperature, sm_90, sm_100 and gfx942.
ROOFLINE_VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("default", {}),
    ("fp16", {"dtype": torch.float16}),
    ("fp32", {"dtype": torch.float32}),
    ("no-entropy", {"entropy": False}),
    ("no-validation", {"validate": False}),
    ("no-entropy-no-validation", {"entropy": False, "validate": False}),
    ("entropy-gradient", {"entropy_grad": True}),
    ("temperature-0.7", {"temperature": 0.7}),
    ("temperature-0.7-no-validation", {"temperature": 0.7, "validate": False}),
    ("temperature-0.7-entropy-gradient", {"temperature": 0.7, "entropy_grad": True}),
    ("fp16-temperature-0.7", {"dtype": torch.float16, "temperature": 0.7}),
    ("fp16-temperature-0.7-entropy-gradient", {"dtype": torch.float16, "temperature": 0.7, "entropy_grad": True}),
    ("tp8", {"tp": 8}),
    ("fp16-tp8", {"dtype": torch.float16, "tp": 8}),
    ("fp32-tp8", {"dtype": torch.float32, "tp": 8}),
    ("sm_100", {"arch": 100}),
    ("gfx942", {"arch": AMD_TARGET}),
)


def roofline_variants(output_dir: Path, names: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """One summary row per variant of :data:`ROOFLINE_VARIANTS` (``names``: a subset), each compiled
    into ``output_dir/<name>/`` by :func:`roofline`: its case, instructions per column, the largest
    registers and local memory of its kernels, and the predicted times per GPU model."""
    rows = []
    for name, kwargs in ROOFLINE_VARIANTS:
        if names is not None and name not in names:
            continue
        if kwargs.get("arch") == AMD_TARGET:
            amd = {k: v for k, v in kwargs.items() if k != "arch"}
            rows.append({**amd_roofline(output_dir / name, **amd), "name": name})
            continue
        doc = roofline(output_dir / name, **kwargs)
        rows.append({
            "name": name, "arch": f"sm_{kwargs.get('arch', ROOFLINE_ARCH)}", **doc["case"],
            "instructions_per_column": doc["instructions_per_column"],
            "registers": max(k["registers"] for k in doc["kernels"]),
            "local_bytes": max(k["local_bytes"] for k in doc["kernels"]),
            "predicted": {gpu: {key: p[key] for key in ("forward_ms", "backward_ms", "forward_over_floor",
                                                         "forward_backward_over_floor")}
                          for gpu, p in doc["predicted"].items()},
        })
    return rows


def variant_table(variants: list[dict[str, Any]]) -> list[str]:
    """The printed table of the variants: one line each, its case, instructions per column forward /
    backward, registers, local memory, and each GPU model's forward and forward+backward over its floor."""
    lines = []
    for v in variants:
        over = ", ".join(f"{gpu.upper()} {p['forward_over_floor']}x / {p['forward_backward_over_floor']}x"
                         for gpu, p in v["predicted"].items())
        lines.append(f"variant {v['name']:<26} {v['arch']:<6} {v['dtype']} tp{v['tp']} entropy={int(v['entropy'])} "
                     f"validate={int(v['validate'])} entropy_grad={int(v['entropy_grad'])} T={v['temperature']}: "
                     f"per column {v['instructions_per_column']['forward']} / {v['instructions_per_column']['backward']}, "
                     f"{v['registers']} registers, local {v['local_bytes']} B; {over} the floor")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_engine.logprob.backends.triton.triton_aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--roofline", action="store_true", help="write roofline.json and the cubins into --output-dir")
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--all", action="store_true", help="check every launch variant's PTX (default: the default case's bf16)")
    parser.add_argument("--variants", action="store_true",
                        help="with --roofline: also the variants (fp16, fp32, entropy and validation off, the entropy "
                             "gradient, T = 0.7, TP 8, sm_100, gfx942), each under --output-dir/<name>/, listed in "
                             "roofline.json's variants")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="the roofline's temperature (default 1: none; docs/arithmetic.md section 6 step 0)")
    args = parser.parse_args(argv)
    if args.roofline:
        if args.output_dir is None:
            parser.error("--roofline needs --output-dir DIR")
        from rl_engine import schemas
        from rl_engine.arith.temperature import TemperatureError, temperature32

        try:
            temperature32(args.temperature, "--temperature")
            output_directory(args.output_dir)
        except (TemperatureError, AotError) as exc:
            parser.error(str(exc))
        doc = roofline(args.output_dir, temperature=args.temperature)
        if args.variants:
            doc["variants"] = roofline_variants(args.output_dir)
            if any(v["arch"] == AMD_TARGET for v in doc["variants"]):
                doc["amd_model"] = AMD_MODEL
        schemas.write_validated(args.output_dir / "roofline.json", doc, "roofline")
        for k in doc["kernels"]:
            print(f"{k['name']}: {k['path_per_thread']} SASS/thread on the fast path ({k['sass_per_thread']} static, "
                  f"{k['longest_path_per_thread']} on the longest) x {k['threads_per_program']} threads x "
                  f"{k['programs']} programs, {k['instructions_per_column']} per column, {k['registers']} registers, "
                  f"local {k['local_bytes']} B, loops {k['loops']}")
        print(f"per column: {doc['instructions_per_column']}")
        for gpu, p in doc["predicted"].items():
            print(f"{gpu}: forward {p['forward_ms']} ms ({p['forward_over_floor']}x the floor), forward+backward "
                  f"{p['forward_backward_over_floor']}x the floor")
        for line in variant_table(doc.get("variants", [])):
            print(line)
        print(f"wrote {args.output_dir / 'roofline.json'}")
        return 0
    kernels = load_kernels("compiled")
    variants = launch_variants()
    if not args.all:
        variants = [v for v in variants if v.name.startswith(("forward-default-bf16", "backward-default-bf16"))]
    for variant in variants:
        fn = getattr(kernels, variant.kernel)
        for arch in NVIDIA_TARGETS:
            asm = compile_variant(fn, variant, "cuda", arch, False)
            found = ptx_findings(asm["ptx"])
            print(f"{variant.name} sm_{arch}: fma={found['fma']} float ops={found['float_ops']} "
                  f"forbidden={found['forbidden']} unknown={found['unknown']}")
        asm = compile_variant(fn, variant, "hip", AMD_TARGET, False)
        print(f"{variant.name} {AMD_TARGET}: {amdgcn_findings(asm['amdgcn'])}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))


def predicted_vs_measured(doc: dict[str, Any], timing_rows: list[dict[str, Any]], gpu: str,
                          path: str) -> list[dict[str, Any]]:
    """The roofline's predicted forward and forward+backward times of ``gpu`` (``h100``/``h200``)
    beside the measured medians of ``path`` and of the floor (rows of ``gpu-smoke``'s timing)."""
    p = doc["predicted"][gpu]
    predicted = {"forward": (p["forward_ms"], p["forward_floor_ms"]),
                 "forward_backward": (p["forward_ms"] + p["backward_ms"], p["forward_floor_ms"] + p["backward_floor_ms"])}
    out = []
    for phase, (ms, floor_ms) in predicted.items():
        # the roofline's case computes the entropy and validates: the Triton backend's "entropy"
        # variant where the rows have one (a row without a variant: the only call of its path)
        measured = {r["path"]: r["median_s"] * 1e3 for r in timing_rows
                    if r.get("phase") == phase and "median_s" in r and r.get("variant") in (None, "entropy")}
        if path not in measured or "floor" not in measured:
            continue
        out.append({"phase": phase, "path": path, "predicted_ms": ms, "measured_ms": round(measured[path], 4),
                    "measured_over_predicted": round(measured[path] / ms, 4),
                    "floor_predicted_ms": floor_ms, "floor_measured_ms": round(measured["floor"], 4),
                    "floor_measured_over_predicted": round(measured["floor"] / floor_ms, 4)})
    return out
