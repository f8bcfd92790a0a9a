"""The campaign's constant tables: the one place each of these facts is written.

No imports, no torch, at the bottom of the layers: the case rules (:mod:`rl_engine.campaign.case`), the
kernel's contract, registry and mesh, the gates and the workflow's config check all read their sets and defaults
from here. The schemas in ``schemas/`` repeat some of them as enums for standard validators;
``tests/test_case.py`` fails when a schema and this table disagree.
"""

from __future__ import annotations

# Logits dtypes a campaign and every backend serve, and torch's name for each.
DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
TORCH_DTYPE_NAMES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# Acceptance tolerance against the FP32 oracle when a case names none: (atol, rtol).
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "bf16": (0.05, 0.0),
    "fp16": (0.005, 0.0),
    "fp32": (1e-5, 0.0),
}
GATING_ORACLE = "fp32_oracle"  # the oracle acceptance gates on; the FP64 one is recorded only
ORACLES: tuple[str, ...] = ("fp32_oracle", "fp64_oracle")

# Device -> its process-group backend. Nothing falls back from one to the other.
DEVICE_DIST_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl"}

# Token layouts of context parallelism (distributed/bounds.py computes them).
CP_LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")

# Characters no evidence string may hold where a reviewer reads it (a regular-expression class body):
# C0 (newline and tab included), DEL, C1 and the bidirectional overrides and isolates; the
# "printable" rule of schemas/defs.schema.json. A capture's metadata refuses them; SUMMARY.md's
# md_cell shows them as visible escapes.
UNPRINTABLE_CLASS = "\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069"

# The built-in backends' ids (each backend's devices, engine and the rest are in its one description,
# rl_engine/logprob/backends/<name>/description.py). "auto" picks one; a campaign refuses it.
AUTO = "auto"
# num_vocab_tiles="auto": the count resolved by rl_engine.distributed.bounds.auto_vocab_tiles
AUTO_TILES = "auto"
EAGER_BACKEND = "pytorch-vocab-parallel-logp-ws2"
FUSED_CPU_BACKEND = "cpu-vocab-parallel-logp-ws2"
TRITON_BACKEND = "triton-vocab-parallel-logp-ws2"
TRITON_MODE_ENV = "RL_ENGINE_TRITON_MODE"

# Campaign bounds and defaults.
MAX_TP = 8
MAX_CP = 4
MAX_THREADS_PER_RANK = 64
MIN_MATRIX_TOPOLOGIES = 2  # the cross-topology check compares at least two
# Bounds of a case's sizes and input recipe (rl_engine/campaign/inputs.py), checked at parse time.
MAX_SEED = 2**64 - 1  # the recipe hashes the seed as an unsigned 64-bit integer
MAX_TOKENS = 2**20  # batch * seq of a campaign (each rank holds every token's logits in FP32)
MAX_LOGIT_ELEMENTS = 2**32  # batch * seq * padded_vocab: 16 GiB of FP32 logits
# Every recipe logit is |bell| * logit_scale with |bell| <= 3.47; a quarter of the dtype's
# largest finite value keeps every logit (and its rounding to the dtype) finite.
LOGIT_SCALE_BOUNDS: dict[str, float] = {
    "bf16": float.fromhex("0x1.fep127") / 4,
    "fp16": 65504.0 / 4,
    "fp32": float.fromhex("0x1.fffffep127") / 4,
}
DEFAULT_TOPOLOGIES: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2))
DEFAULT_PG_TIMEOUT_S = 120.0  # process-group timeout: a lost rank fails the collective
# The longest process-group timeout (about 31.7 years): torch holds it in int64 nanoseconds (a
# store timeout of 8.64e13 s wraps to a negative one) and datetime.timedelta ends at 999999999 days
# (1e15 s fails every rank's init_mesh with an OverflowError).
MAX_PG_TIMEOUT_S = 1e9

# The benchmark's paths and phases (python -m rl_engine bench; rl_engine.benchmark.config says what each is).
BENCH_PATHS: tuple[str, ...] = ("candidate", "fused", "triton", "naive", "floor", "lm_head", "fused_lm_head",
                                 "fused_lm_head_kept", "naive_lm_head", "processed")
BENCH_PHASES: tuple[str, ...] = ("forward", "forward_backward")
PARITY_RATIO_BOUNDS: tuple[float, float] = (0.8, 1.2)  # parity's default: PPO-style clip; TIS users pass their own

SCHEMA_VERSION = "1"  # of every artifact rl_engine writes (case, plan, reports, gates, environment, regression, verify, bench, smoke)
