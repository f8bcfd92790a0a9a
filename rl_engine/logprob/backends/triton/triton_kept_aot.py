"""The paper cost of processed logprobs in Triton (``docs/arithmetic.md`` section 13): the roofline
of :mod:`rl_engine.logprob.backends.triton.triton_aot` applied to the processed kernels' SASS.

Every launch of a processed call at one case (default: the default case, bf16, 8192 x 151936,
64 tiles) is compiled for ``sm_<arch>`` as Triton specializes it at launch, no GPU needed; each
kernel's executed instructions per column come from its SASS (its fast path), and a call's cost
is the sum over its launches: the raw forward's partials (for the row max ``B``), min-p's scan,
the search's scans (each step of the bisection on the key reads the logits once: at most 16 on
the value of a 16-bit logit, 32 of a binary32 one, and ``ceil(log2(V + 1))`` on the token id per
stage, top-k and top-p, plus top-p's ``Z(K2)``), the masked forward, and in the backward the raw backward's launches and the pass that
writes ``+0`` on the dropped columns. ``python -m rl_engine.logprob.backends.triton.triton_kept_aot --output-dir D``
writes ``processed_roofline.json`` and prints the table of docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from rl_engine.logprob.backends.triton.triton_aot import (
    CASES,
    MODEL,
    ROOFLINE_ARCH,
    ROOFLINE_ROWS,
    Variant,
    _kernel_seconds,
    case_launches,
    compile_variant,
    launch_specialization,
    output_directory,
    read_sass,
)
from rl_engine.logprob.backends.triton.triton_backend import Launch, TritonEngine, load_kernels
from rl_engine.logprob.backends.triton.triton_kept import kept_launch, min_p_launch, zero_launch
from rl_engine.logprob.contract import LogprobContract


def search_steps(real_vocab: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """The most scans one stage of the search on the key makes: the value (16 steps on a 16-bit
    logit's own order, 32 on binary32), then the token id."""
    value = 32 if dtype == torch.float32 else 16
    return value + math.ceil(math.log2(real_vocab + 1))


def processed_launches(rows: int, real: int, padded: int, tiles: int, dtype: torch.dtype,
                       temperature: float = 1.0) -> dict[str, Launch]:
    """One launch of each processed kernel at the case (meta tensors: no memory), by name."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    contract = LogprobContract(real_vocab_size=real, padded_vocab_size=padded, num_vocab_tiles=tiles,
                               num_sequences=1, seq_len=rows, logits_dtype=name, temperature=temperature)
    meta = "meta"
    x = torch.empty(rows, padded, dtype=torch.float32 if dtype == torch.float32 else torch.int16, device=meta)
    m = torch.empty(rows, tiles, dtype=torch.float32, device=meta)
    bad = torch.empty(rows, tiles, dtype=torch.int8, device=meta)
    count = torch.empty(rows, tiles, dtype=torch.int32, device=meta)
    kv = torch.empty(rows, dtype=torch.float32, device=meta)
    kid = torch.empty(rows, dtype=torch.int64, device=meta)
    call = TritonEngine("compiled").kept_call()
    specs = {
        "kept_forward": kept_launch(call, x, contract, kv, kid, None, m, m, m, bad, count, True, True, dtype),
        "search_step": kept_launch(call, x, contract, kv, kid, kv, m, m, None, None, count, False, False, dtype),
        "min_p": min_p_launch(call, x, contract, kv, kv, m, count, dtype),
        "backward_zero": zero_launch(call, x, kv, kid, x, real, contract.temperature32, dtype),
    }
    return {name: Launch(*spec) for name, spec in specs.items()}


def _compile(kernels: Any, name: str, launch: Launch, arch: int, columns: int, out: Path) -> dict[str, Any]:
    from triton.backends.compiler import GPUTarget

    fn = getattr(kernels, launch.kernel)
    sig, cx, attrs = launch_specialization(fn, launch, GPUTarget("cuda", arch, 32))
    variant = Variant(name, launch.kernel, sig, cx, attrs, launch.warps, launch.grid, columns)
    asm = compile_variant(fn, variant, "cuda", arch, False, specialized=True)
    (out / f"{name}.sm_{arch}.cubin").write_bytes(asm["cubin"])
    sass = read_sass(asm["cubin"])
    threads = 32 * launch.warps
    programs = math.prod(launch.grid)
    return {"name": name, "kernel": launch.kernel, "path_per_thread": sass.path_instructions,
            "loops": sass.loops, "registers": sass.registers, "local_bytes": sass.local_bytes,
            "instructions_per_column": round(sass.path_instructions * threads * programs / columns, 3),
            "seconds": _kernel_seconds(sass, threads, programs, MODEL),
            "fma_per_thread": sass.opcodes.get("FFMA", 0), "ptx_ok": "ex2.approx" not in asm["ptx"]}


def processed_roofline(output_dir: Path, arch: int = ROOFLINE_ARCH, rows: int = ROOFLINE_ROWS,
                       case: tuple[int, int, int] = CASES[0][1:], dtype: torch.dtype = torch.bfloat16,
                       temperature: float = 1.0) -> dict[str, Any]:
    """Compile the raw and the processed launches of one case and return the paper model: per
    kernel its instructions per column, and per call (raw; each stage alone; all three) the
    passes over the logits, the predicted time on each GPU model and its ratio to the raw call."""
    output_directory(output_dir)
    kernels = load_kernels("compiled")
    real, padded, tiles = case
    columns = rows * padded
    raw = case_launches(rows, real, padded, tiles, dtype, True, True, temperature)
    kernels_out: dict[str, dict[str, Any]] = {}
    for phase, group in raw.items():
        for i, launch in enumerate(group):
            name = f"raw_{phase}_{i}"
            kernels_out[name] = _compile(kernels, name, launch, arch, columns, output_dir)
    raw_b = _compile(kernels, "raw_forward_no_entropy", case_launches(rows, real, padded, tiles, dtype, False, False,
                                                                     temperature)["forward"][0], arch, columns,
                     output_dir)
    kernels_out["raw_forward_no_entropy"] = raw_b
    for name, launch in processed_launches(rows, real, padded, tiles, dtype, temperature).items():
        kernels_out[name] = _compile(kernels, name, launch, arch, columns, output_dir)
    steps = search_steps(real, dtype)
    raw_fwd = ["raw_forward_0"]
    raw_bwd = [n for n in kernels_out if n.startswith("raw_backward_")]
    # each call as a list of (kernel, launches)
    calls: dict[str, list[tuple[str, int]]] = {
        "raw": [(n, 1) for n in raw_fwd + raw_bwd],
        "min_p": [("raw_forward_no_entropy", 1), ("min_p", 1), ("kept_forward", 1)]
        + [(n, 1) for n in raw_bwd] + [("backward_zero", 1)],
        "top_k": [("raw_forward_no_entropy", 1), ("search_step", steps), ("kept_forward", 1)]
        + [(n, 1) for n in raw_bwd] + [("backward_zero", 1)],
        "top_p": [("raw_forward_no_entropy", 1), ("search_step", steps + 1), ("kept_forward", 1)]
        + [(n, 1) for n in raw_bwd] + [("backward_zero", 1)],
        "all_three": [("raw_forward_no_entropy", 1), ("min_p", 1), ("search_step", 2 * steps + 1),
                      ("kept_forward", 1)] + [(n, 1) for n in raw_bwd] + [("backward_zero", 1)],
    }
    logit_bytes = torch.empty((), dtype=dtype).element_size()
    # reads (and writes) of a logits-sized array per launch: the backward's blocks read the logits and
    # write the gradient; the target kernel touches one column a row; the zero pass reads the logits
    # and writes at most every column
    traffic = {"backward_kernel": 2, "backward_target_kernel": 0, "kept_zero_kernel": 2}
    predicted: dict[str, Any] = {}
    seconds: dict[tuple[str, str], float] = {}
    for call, parts in calls.items():
        per_column = sum(kernels_out[n]["instructions_per_column"] * k for n, k in parts)
        row: dict[str, Any] = {"instructions_per_column": round(per_column, 2), "launches": sum(k for _, k in parts)}
        for gpu, bandwidth in MODEL["bandwidth_bytes_per_s"].items():
            total = 0.0
            for n, k in parts:  # each launch: the larger of its issue time and its memory floor
                floor = columns * logit_bytes / bandwidth * traffic.get(kernels_out[n]["kernel"], 1)
                total += k * max(kernels_out[n]["seconds"], floor)
            seconds[(call, gpu)] = total
            row[f"{gpu}_ms"] = round(total * 1e3, 4)
        predicted[call] = row
    for call, row in predicted.items():
        for gpu in MODEL["bandwidth_bytes_per_s"]:
            row[f"{gpu}_over_raw"] = round(seconds[(call, gpu)] / seconds[("raw", gpu)], 2)
    import triton

    return {
        "kind": "paper model from the compiled SASS (not a measurement)",
        "triton": triton.__version__, "arch": f"sm_{arch}",
        "case": {"rows": rows, "real_vocab": real, "padded_vocab": padded, "num_vocab_tiles": tiles,
                 "dtype": str(dtype).removeprefix("torch."), "temperature": temperature},
        "search_steps_per_stage": steps,
        "kernels": {n: {k: v for k, v in d.items() if k != "seconds"} | {"us": round(d["seconds"] * 1e6, 1)}
                    for n, d in kernels_out.items()},
        "predicted": predicted,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_engine.logprob.backends.triton.triton_kept_aot",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--arch", type=int, default=ROOFLINE_ARCH)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args(argv)
    doc = processed_roofline(args.output_dir, arch=args.arch, temperature=args.temperature)
    (args.output_dir / "processed_roofline.json").write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    print(json.dumps(doc["kernels"], indent=1))
    print(json.dumps(doc["predicted"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
