"""Build step of the package: the fused CPU kernel of backend ``cpu-vocab-parallel-logp-ws2``.

Everything else about the package is in ``pyproject.toml``. The kernel is plain C (no torch
headers, so pip's isolated build environment needs setuptools alone), compiled without
fused multiply-add contraction and without fast-math: ``docs/arithmetic.md`` section 2.
"""

from setuptools import Extension, setup

FUSED_CPU = Extension(
    "rl_engine.logprob._fused_cpu",
    sources=["rl_engine/logprob/_fused_cpu.c"],
    depends=["rl_engine/logprob/_fused_cpu_lanes.h"],
    extra_compile_args=[
        "-O3",
        "-std=gnu11",
        "-ffp-contract=off",
        "-fno-fast-math",
        "-fno-unsafe-math-optimizations",
        "-fexcess-precision=standard",
        "-Wno-psabi",
        "-pthread",
    ],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[FUSED_CPU])
