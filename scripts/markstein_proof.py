#!/usr/bin/env python
"""The exhaustive checks behind the Triton kernels' division by T32 (docs/arithmetic.md, "Dividing by
T32 on a GPU"; rl_engine/arith/division.py). NumPy only, exact (spec_numpy.fma32 rounds once), no GPU.

    python scripts/markstein_proof.py [--parts bf16,fp16,fp32,values] [--temperatures 0.7,1.3]

bf16, fp16 (the proof for every temperature): one Markstein step on every significand A of the
precision (128, 1024) against every binary32 significand B in [1, 2) (2**23): the sequence equals
the IEEE quotient A / B for all of them. Every x = A * 2**a and T32 = B * 2**b of the domain scale
from these (rl_engine.arith.division.domain), so one step is exact for every bf16 and binary16 logit in
the domain and every temperature. (bf16: 2**30 pairs, about 80 s; fp16: 2**33, about 11 min, on
one core of this project's 2-core machine.)

fp32 (per temperature): two steps on all 2**23 binary32 significands A against the temperature's
B, and how many one step alone gets wrong. Two steps are exact for every T32 by Markstein's theorem
(docs/arithmetic.md); this checks the listed ones exhaustively.

values (per temperature): every finite bf16 and binary16 value, and every positive binary32 value of
the subnormals and of the binades where the domain ends (the quotient, a residual or an estimate
leaves the normal range; negative values mirror them, the sequence being odd in x):
the sequence equals the quotient on the domain, and how often it does not outside it, which is
why the kernels divide with the IEEE division there.

Prints one line per check and exits 1 if any check inside the domain fails.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_engine.arith import division  # noqa: E402

F32 = np.float32
TEMPERATURES = (0.1, 0.3, 0.6, 0.7, 0.9, 1.1, 1.5, 2.7, 3.0, 0.25, 1.3, 2.0 ** -64, 2.0 ** 64, 1e-10, 1e10)
SEED = 20260412
RANDOM_TEMPERATURES = 6


def _temperatures(given: str | None) -> list[float]:
    if given:
        return [float(v) for v in given.split(",")]
    rng = np.random.default_rng(SEED)
    return list(TEMPERATURES) + [float(F32(v)) for v in np.exp(rng.uniform(math.log(0.05), math.log(5.0),
                                                                             RANDOM_TEMPERATURES))]


def all_temperatures(dtype: str) -> int:
    """One step, every significand of ``dtype`` against every B: the number of mismatches."""
    b = division.significands(23)
    bad = 0
    start = time.time()
    for a in division.significands(division.FRACTION_BITS[dtype]):
        found = division.significand_mismatches(np.full_like(b, a), b, 1)
        if len(found):
            bad += len(found)
            print(f"  mismatch: A={float(a).hex()} B={float(b[found[0]]).hex()} (+{len(found) - 1} more B)")
    pairs = (1 << division.FRACTION_BITS[dtype]) * len(b)
    print(f"{dtype}: one step, every A ({1 << division.FRACTION_BITS[dtype]}) x every B ({len(b)}): "
          f"{pairs} pairs, {bad} mismatches ({time.time() - start:.0f} s)", flush=True)
    return bad


def _significand(t32: float) -> float:
    m, e = math.frexp(t32)
    return m * 2.0


def fp32_binade(t32: float) -> int:
    """Two steps (and one) on every binary32 significand against the temperature's B."""
    a = division.significands(23)
    b = np.full_like(a, _significand(t32))
    two = division.significand_mismatches(a, b, 2)
    one = division.significand_mismatches(a, b, 1)
    print(f"fp32 T={t32!r}: B={_significand(t32).hex()}, every A ({len(a)}): two steps {len(two)} mismatches, "
          f"one step {len(one)}", flush=True)
    return len(two)


def _edge_binades(t32: float) -> np.ndarray:
    """Every positive binary32 of the binades next to the domain's ends and of the subnormals."""
    lo, hi = division.domain(t32)
    exps = {int(math.floor(math.log2(lo))) + k for k in (-2, -1, 0, 1)}
    if math.isfinite(hi):
        exps |= {int(math.log2(hi)) + k for k in (-2, -1)}
    exps |= {127}
    blocks = [np.arange(1, 1 << 23, dtype=np.uint32)]  # the subnormals
    for e in sorted(x for x in exps if -126 <= x <= 127):
        start = (e + 127) << 23
        blocks.append(np.arange(start, start + (1 << 23), dtype=np.uint32))
    return np.concatenate(blocks).view(F32)


def values(t32: float) -> int:
    """The sequence against the IEEE quotient on concrete values: 0 mismatches inside the domain."""
    bad_inside = 0
    bf16 = (np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)).view(F32)
    fp16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(F32)
    cases = (("bf16", bf16, 1), ("fp16", fp16, 1), ("fp32 edge binades", _edge_binades(t32), 2))
    for name, x, steps in cases:
        x = x[np.isfinite(x)]  # the binary32 binades positive only: the sequence is odd in x (RN is symmetric)
        with np.errstate(over="ignore", invalid="ignore"):
            want = np.divide(x, F32(t32)).view(np.uint32)
            got = division.markstein(x, t32, steps).view(np.uint32)
        inside = division.in_domain(x, t32)
        wrong = got != want
        n_in, n_out = int(np.count_nonzero(wrong & inside)), int(np.count_nonzero(wrong & ~inside))
        bad_inside += n_in
        print(f"  {name} T={t32!r}: {x.size} values, {int(inside.sum())} in the domain: {n_in} mismatches there, "
              f"{n_out} outside it", flush=True)
    return bad_inside


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="bf16,fp16,fp32,values")
    parser.add_argument("--temperatures", default=None, help="comma-separated (default: the documented list)")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    temps = [float(F32(t)) for t in _temperatures(args.temperatures)]
    bad = 0
    for dtype in ("bf16", "fp16"):
        if dtype in parts:
            bad += all_temperatures({"bf16": "bfloat16", "fp16": "float16"}[dtype])
    if "fp32" in parts:
        for t32 in temps:
            bad += fp32_binade(t32)
    if "values" in parts:
        for t32 in temps:
            bad += values(t32)
    print("all checks passed" if bad == 0 else f"FAILED: {bad} mismatches inside the domain")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
