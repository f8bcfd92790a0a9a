"""Every binary32 bit pattern (2**32) through the Triton kernels' binary16 rounding, against NumPy.

``round_f16_bits`` in ``rl_engine/logprob/triton_kernels.py`` rounds binary32 to binary16 (section 8
of docs/arithmetic.md) with binary32 operations: ``a = min(|f|, 2**16)``; ``c = 1.5 * 2**13 *
max(binade(a), 2**-14)``; ``r = (a + c) - c``; the bits of ``r * 2**-112`` shifted right by 13, the
sign, and ``0x7E00`` for any NaN. This script replays those operations in NumPy binary32 (what the
Triton interpreter runs, one IEEE operation at a time) on all 2**32 bit patterns, in chunks, and
compares with NumPy's own float32 -> float16 conversion (IEEE round to nearest even, subnormals,
overflow to infinity; NaN made 0x7E00). The test suite checks the kernel itself under the
interpreter on a dense subset (tests/test_triton_backend.py). Run: ``python scripts/f16_rounding_sweep.py``.
"""

from __future__ import annotations

import sys
import time

import numpy as np

CHUNK = 1 << 24


def rounded(u: np.ndarray) -> np.ndarray:
    f = u.view(np.float32)
    a = np.fmin(np.abs(f), np.float32(65536.0))  # the compiled min.f32: a NaN operand gives the other
    binade = (a.view(np.uint32) & np.uint32(0x7F800000)).view(np.float32)
    c = np.maximum(binade, np.float32(2.0**-14)) * np.float32(12288.0)
    r = (a + c) - c
    out = ((r * np.float32(2.0**-112)).view(np.uint32) >> np.uint32(13)) | ((u >> np.uint32(16)) & np.uint32(0x8000))
    return np.where(np.isnan(f), np.uint32(0x7E00), out).astype(np.uint32)


def main() -> int:
    start = time.time()
    bad = 0
    # the binades where rounding decides something first (|f| in [2**-26, 2**17), either sign), then the rest
    first = [c for c in range(1 << 32 >> 24) if 0x32 <= c & 0x7F <= 0x47]
    order = first + [c for c in range(1 << 32 >> 24) if c not in first]
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
    print(f"every binary32 bit pattern (4294967296): {bad} mismatches ({time.time() - start:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
