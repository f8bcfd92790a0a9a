"""Every binary32 bit pattern (2**32) through the Triton kernels' binary16 rounding, against NumPy.

``round_f16_bits`` in ``rl_engine/logprob/backends/triton/triton_kernels.py`` rounds binary32 to
binary16 (section 8 of docs/arithmetic.md) with binary32 and integer operations: ``b = max(binade(f),
2**-14)``; ``s = fma(b, 1.5 * 2**13, |f|)`` (an exact product: here ``|f| + b * 12288``, the same
rounding, an overflow to infinity included); the magnitude ``min(bits(s) - bits(b) + (bits(b) >> 13) -
0x06C1C400, 0x7C00)`` as unsigned 32-bit integers; the sign, and ``0x7E00`` for any NaN. This script
replays those operations in NumPy (binary32, what the Triton interpreter runs one IEEE operation at a
time; wrapping 32-bit integers) on all 2**32 bit patterns, in chunks, and compares with NumPy's own
float32 -> float16 conversion (IEEE round to nearest even, subnormals, overflow to infinity; NaN made
0x7E00). The test suite checks the kernel itself under the interpreter on a dense subset
(tests/test_triton_backend.py). Run: ``python scripts/f16_rounding_sweep.py`` (every pattern; the
binades where rounding decides something come first), or ``--every K`` for those binades and every
K-th chunk of 2**24 patterns of the rest.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

CHUNK = 1 << 24


def rounded(u: np.ndarray) -> np.ndarray:
    f = u.view(np.float32)
    b = np.maximum((u & np.uint32(0x7F800000)).view(np.float32), np.float32(2.0**-14))  # never NaN
    s = np.abs(f) + b * np.float32(12288.0)  # b * 12288 is exact (or infinity, as the FMA's sum is then)
    bb = b.view(np.uint32).astype(np.int64)
    mag = (s.view(np.uint32).astype(np.int64) - bb + (bb >> 13) - 0x06C1C400) & 0xFFFFFFFF  # unsigned 32-bit
    out = np.minimum(mag, 0x7C00).astype(np.uint32) | ((u >> np.uint32(16)) & np.uint32(0x8000))
    return np.where(np.isnan(f), np.uint32(0x7E00), out).astype(np.uint32)


def _every(argv: list[str]) -> int:
    """``--every N`` (a positive integer, default 1): sweep every N-th chunk outside the first binades."""
    parser = argparse.ArgumentParser(description="the Triton binary16 rounding against NumPy on binary32 patterns")
    parser.add_argument("--every", type=int, default=1,
                        help="every N-th 2**24-pattern chunk outside the binades where rounding decides (N >= 1)")
    every = parser.parse_args(argv).every
    if every < 1:
        parser.error(f"--every {every}: must be a positive integer (1 sweeps every pattern)")
    return every


def main() -> int:
    start = time.time()
    bad = 0
    # the binades where rounding decides something first (|f| in [2**-27, 2**17), either sign), then the rest
    every = _every(sys.argv[1:])
    first = [c for c in range(1 << 32 >> 24) if 0x32 <= c & 0x7F <= 0x47]
    order = first + [c for c in range(1 << 32 >> 24) if c not in first][::every]
    for done, index in enumerate(order, 1):
        lo = index * CHUNK
        u = np.arange(lo, lo + CHUNK, dtype=np.uint64).astype(np.uint32)
        f = u.view(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            want = np.where(np.isnan(f), np.uint16(0x7E00), f.astype(np.float16).view(np.uint16)).astype(np.uint32)
            got = rounded(u)
        wrong = np.flatnonzero(got != want)
        bad += wrong.size
        if wrong.size:
            print(f"mismatch at 0x{int(u[wrong[0]]):08x}: {int(got[wrong[0]]):#06x} != {int(want[wrong[0]]):#06x}")
        print(f"{done}/{len(order)} chunks of 2**24 (bits 0x{lo:08x}..): {bad} mismatches so far", flush=True)
    print(f"{len(order) * CHUNK} binary32 bit patterns ({len(order)} chunks of 2**24; every one when 256): {bad} "
          f"mismatches ({time.time() - start:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
