"""Build step of the package: the fused CPU kernel of backend ``cpu-vocab-parallel-logp-ws2`` and
the fused head's fixed-order logits (``rl_engine.logprob._head_gemm``).

Everything else about the package is in ``pyproject.toml``. The kernels are plain C (no torch
headers, so pip's isolated build environment needs setuptools alone), compiled without
fused multiply-add contraction and without fast-math: ``docs/arithmetic.md`` section 2.
"""

from setuptools import Extension, setup

IEEE_FLAGS = [
    "-O3",
    "-std=gnu11",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fno-unsafe-math-optimizations",
    "-fexcess-precision=standard",
    "-Wno-psabi",
    "-pthread",
]

FUSED_CPU = Extension(
    "rl_engine.logprob.backends.fused_cpu._fused_cpu",
    sources=["rl_engine/logprob/backends/fused_cpu/_fused_cpu.c"],
    depends=["rl_engine/logprob/backends/fused_cpu/_fused_cpu_lanes.h"],
    extra_compile_args=IEEE_FLAGS,
    extra_link_args=["-pthread"],
)

HEAD_GEMM = Extension(
    "rl_engine.logprob._head_gemm",
    sources=["rl_engine/logprob/_head_gemm.c"],
    depends=["rl_engine/logprob/_head_gemm_lanes.h"],
    extra_compile_args=IEEE_FLAGS,
    extra_link_args=["-pthread"],
)

setup(ext_modules=[FUSED_CPU, HEAD_GEMM])
