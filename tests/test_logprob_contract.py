"""LogprobContract validation and fingerprint, fail-closed backend dispatch, and the mesh.

Everything here runs in one process; the multi-process claims live in
tests/test_vocab_parallel_logp.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rl_engine.distributed import bounds, mesh
from rl_engine.distributed.mesh import LaunchEnv, MeshError, ParallelDims, init_mesh
from rl_engine.logprob import contract as contract_module
from rl_engine.logprob import registry
from rl_engine.logprob.backends.description import backend_devices
from rl_engine.logprob.backends.eager.vocab_parallel import BACKEND_ID, VocabParallelLogprob
from rl_engine.logprob.backends.fused_cpu import fused_cpu
from rl_engine.logprob.contract import RANK_LOCAL_FIELDS, LogprobContract, LogprobContractError
from rl_engine.logprob.registry import (
    AUTO,
    BackendCapabilities,
    BackendSpec,
    BackendUnavailableError,
    backend_ids,
    dispatch,
)
from rl_engine.tables import FUSED_CPU_BACKEND, TRITON_BACKEND

NO_CUDA = not torch.cuda.is_available()

BASE: dict[str, Any] = dict(
    real_vocab_size=1000, padded_vocab_size=1024, num_vocab_tiles=16, num_sequences=2, seq_len=8
)


def make(**overrides: Any) -> LogprobContract:
    return LogprobContract(**{**BASE, **overrides})


# ----- validation: every rule, each message naming the field and the value -----------------

INVALID: list[tuple[dict[str, Any], str]] = [
    (dict(real_vocab_size=0), "real_vocab_size=0"),
    (dict(real_vocab_size="1000"), "real_vocab_size='1000'"),
    (dict(real_vocab_size=True), "real_vocab_size=True"),
    (dict(real_vocab_size=1000.0), "real_vocab_size=1000.0"),
    (dict(padded_vocab_size=0), "padded_vocab_size=0"),
    (dict(num_vocab_tiles=0), "num_vocab_tiles=0"),
    (dict(num_sequences=0), "num_sequences=0"),
    (dict(seq_len=0), "seq_len=0"),
    (dict(tp_world_size=0), "tp_world_size=0"),
    (dict(tp_rank=-1), "tp_rank=-1"),
    (dict(cp_world_size=0), "cp_world_size=0"),
    (dict(cp_rank=-1), "cp_rank=-1"),
    (dict(ignore_index=-100.0), "ignore_index=-100.0"),
    (dict(ignore_index=5), "ignore_index=5"),
    (dict(ignore_index=0), "ignore_index=0"),
    (dict(real_vocab_size=1025), "real_vocab_size=1025"),
    (dict(num_vocab_tiles=33), "num_vocab_tiles=33 leaves its last tile with no column"),
    (dict(tp_world_size=2, tp_rank=2), "tp_rank=2"),
    (dict(cp_world_size=2, cp_rank=2), "cp_rank=2"),
    (dict(tp_world_size=32), "tp_world_size=32"),
    (dict(tp_world_size=3), "tp_world_size=3"),
    (dict(cp_layout="ring"), "cp_layout='ring'"),
    (dict(logits_dtype="fp8"), "logits_dtype='fp8'"),
    (dict(logits_dtype=torch.bfloat16), "logits_dtype=torch.bfloat16"),
    (dict(mask_mode="implicit"), "mask_mode='implicit'"),
    (dict(determinism_scope="bitwise"), "determinism_scope='bitwise'"),
    (dict(accumulation_dtype="bf16"), "accumulation_dtype='bf16'"),
    (dict(output_dtype="fp64"), "output_dtype='fp64'"),
    (dict(tp_world_size=2, vocab_shard_bounds=((0, 1024),)), "vocab_shard_bounds has 1 shards"),
    (dict(tp_world_size=2, vocab_shard_bounds=((0, 500), (500, 1024))), "vocab_shard_bounds[0]=(0, 500)"),
    (dict(tp_world_size=2, vocab_shard_bounds=((0, 512), (576, 1024))), "vocab_shard_bounds[1] starts at 576"),
    (dict(tp_world_size=2, vocab_shard_bounds=((0, 512), (512, 960))), "vocab_shard_bounds end at 960"),
    (dict(tp_world_size=2, vocab_shard_bounds=((0, 0), (0, 1024))), "vocab_shard_bounds[0]=(0, 0)"),
    (dict(tp_world_size=2, vocab_shard_bounds=((0, 512.0), (512, 1024))), "vocab_shard_bounds[0]=(0, 512.0)"),
    (dict(tp_world_size=2, vocab_shard_bounds=((0,), (0, 1024))), "vocab_shard_bounds[0]=(0,)"),
    (dict(tp_world_size=2, vocab_shard_bounds=5), "vocab_shard_bounds=5"),
    (dict(seq_len=6, cp_world_size=4), "seq_len=6"),
    (dict(seq_len=8, cp_world_size=8, cp_layout="zigzag"), "seq_len=8"),
]


@pytest.mark.parametrize("overrides, needle", INVALID, ids=[n for _, n in INVALID])
def test_every_invalid_field_raises_naming_field_and_value(
    overrides: dict[str, Any], needle: str
) -> None:
    with pytest.raises(LogprobContractError, match=re.escape(needle)):
        make(**overrides)


def test_zigzag_needs_twice_the_chunks_of_contiguous() -> None:
    make(seq_len=8, cp_world_size=8, cp_layout="contiguous")  # 8 chunks of 1: fine
    with pytest.raises(LogprobContractError, match="16 equal chunks"):
        make(seq_len=8, cp_world_size=8, cp_layout="zigzag")


def test_contract_is_frozen_and_bounds_are_normalised() -> None:
    c = make(tp_world_size=2, tp_rank=1, vocab_shard_bounds=[[0, 128], [128, 1024]])
    assert c.vocab_shard_bounds == ((0, 128), (128, 1024))
    assert (c.vocab_start, c.vocab_end, c.local_vocab_size) == (128, 1024, 896)
    assert c.local_tiles == (2, 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.tp_rank = 0  # type: ignore[misc]


def test_geometry_even_split_and_token_layouts() -> None:
    c = make(tp_world_size=4, tp_rank=3)
    assert c.tile_width == 64
    assert c.vocab_shard_bounds == ((0, 256), (256, 512), (512, 768), (768, 1024))
    assert (c.vocab_start, c.vocab_end, c.local_tiles) == (768, 1024, (12, 16))
    assert c.torch_dtype == torch.bfloat16
    assert c.global_num_tokens == 16 and c.num_tokens == 16
    assert c.token_indices == tuple(range(16))
    contiguous = [make(cp_world_size=2, cp_rank=r).token_indices for r in range(2)]
    assert contiguous == [(0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)]
    # zigzag: each sequence in 2*CP=4 chunks of 2; rank r holds chunks r and 3-r
    zigzag = [make(cp_world_size=2, cp_rank=r, cp_layout="zigzag").token_indices for r in range(2)]
    assert zigzag == [(0, 1, 6, 7, 8, 9, 14, 15), (2, 3, 4, 5, 10, 11, 12, 13)]
    assert make(cp_world_size=2, cp_rank=1, cp_layout="zigzag").num_tokens == 8


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_token_indices_partition_the_batch(layout: str, cp: int) -> None:
    held = [i for r in range(cp) for i in make(cp_world_size=cp, cp_rank=r, cp_layout=layout).token_indices]
    assert sorted(held) == list(range(16)) and len(held) == len(set(held))


def test_bounds_helpers() -> None:
    assert bounds.even_vocab_shards(151936, 64, 4) == (
        (0, 37984), (37984, 75968), (75968, 113952), (113952, 151936)
    )
    with pytest.raises(bounds.BoundsError, match="tp=3"):
        bounds.even_vocab_shards(1024, 16, 3)
    with pytest.raises(bounds.BoundsError, match="num_vocab_tiles=0"):
        bounds.tile_width(1024, 0)
    assert bounds.sequence_positions(8, 2, 0, "zigzag") == (0, 1, 6, 7)
    with pytest.raises(bounds.BoundsError, match="cp_rank=2"):
        bounds.sequence_positions(8, 2, 2, "contiguous")


def test_to_dict_is_strict_json_with_every_field() -> None:
    c = make(tp_world_size=2, tp_rank=1)
    d = c.to_dict()
    json.dumps(d, allow_nan=False)
    init_fields = {f.name for f in dataclasses.fields(LogprobContract) if f.init}
    # temperature only when it is not 1: a call without one keeps the dict and fingerprints it had
    assert init_fields - {"temperature"} <= set(d) and "temperature" not in d
    assert make(temperature=0.7).to_dict()["temperature"] == 0.7
    assert d["vocab_shard_bounds"] == [[0, 512], [512, 1024]]
    assert d["tp_rank"] == 1 and d["tile_width"] == 64


# ----- fingerprints ---------------------------------------------------------------------------


def test_fingerprint_equal_across_ranks_and_independent_recomputation() -> None:
    contracts = [
        make(tp_world_size=4, tp_rank=t, cp_world_size=2, cp_rank=c, cp_layout="zigzag")
        for c in range(2) for t in range(4)
    ]
    prints = {c.cross_rank_fingerprint() for c in contracts}
    assert len(prints) == 1
    assert len({json.dumps(c.to_dict(), sort_keys=True) for c in contracts}) == 8
    shared = {k: v for k, v in contracts[5].to_dict().items() if k not in ("tp_rank", "cp_rank")}
    canonical = json.dumps(shared, sort_keys=True, separators=(",", ":"))
    assert prints == {hashlib.sha256(canonical.encode()).hexdigest()}
    # the TP-group fingerprint is shared within a TP group and differs across CP ranks
    by_cp = {c.cp_rank: set() for c in contracts}
    for c in contracts:
        by_cp[c.cp_rank].add(c.tp_group_fingerprint())
    assert all(len(v) == 1 for v in by_cp.values()) and by_cp[0] != by_cp[1]


# one variant per field that changes the call's numbers; the base has tp=2
FINGERPRINT_VARIANTS: dict[str, dict[str, Any]] = {
    "temperature": {"temperature": 0.7},
    "real_vocab_size": dict(real_vocab_size=999),
    "padded_vocab_size": dict(padded_vocab_size=2048),
    "num_vocab_tiles": dict(num_vocab_tiles=32),
    "num_sequences": dict(num_sequences=3),
    "seq_len": dict(seq_len=16),
    "tp_world_size": dict(tp_world_size=4),
    "vocab_shard_bounds": dict(vocab_shard_bounds=((0, 256), (256, 1024))),
    "cp_world_size": dict(cp_world_size=2),
    "cp_layout": dict(cp_layout="zigzag"),
    "logits_dtype": dict(logits_dtype="fp16"),
    "logits_dtype_fp32": dict(logits_dtype="fp32"),
    "ignore_index": dict(ignore_index=-1),
    "determinism_scope": dict(determinism_scope="fixed_topology"),
}
SINGLE_CHOICE_FIELDS = {"mask_mode", "accumulation_dtype", "output_dtype"}


def test_fingerprint_sensitive_to_each_numerical_field() -> None:
    base = make(tp_world_size=2)
    prints = {"base": base.cross_rank_fingerprint()}
    for name, overrides in FINGERPRINT_VARIANTS.items():
        prints[name] = make(**{"tp_world_size": 2, **overrides}).cross_rank_fingerprint()
    assert len(set(prints.values())) == len(prints), prints
    # every shared init field is covered, so a new field cannot slip past this test
    shared_fields = {
        f.name for f in dataclasses.fields(LogprobContract) if f.init
    } - RANK_LOCAL_FIELDS
    covered = {k.removesuffix("_fp32") for k in FINGERPRINT_VARIANTS} | SINGLE_CHOICE_FIELDS
    assert shared_fields == covered


def test_fingerprint_sensitive_to_single_choice_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """mask_mode and the accumulation/output dtypes have one legal value today; widen the
    choices and show that a different value changes the fingerprint."""
    base = make().cross_rank_fingerprint()
    monkeypatch.setattr(contract_module, "MASK_MODES", ("explicit", "other"))
    assert make(mask_mode="other").cross_rank_fingerprint() != base
    monkeypatch.setattr(contract_module, "ACCUMULATION_DTYPE", "fp64")
    wide = make(accumulation_dtype="fp64").cross_rank_fingerprint()
    assert wide != base
    monkeypatch.setattr(contract_module, "OUTPUT_DTYPE", "fp64")
    assert make(accumulation_dtype="fp64", output_dtype="fp64").cross_rank_fingerprint() not in (
        base, wide
    )


# ----- dispatch ---------------------------------------------------------------------------------


def test_backend_ids_lists_every_backend() -> None:
    # highest priority first: auto's order (Triton, fused C, eager)
    assert backend_ids() == [TRITON_BACKEND, FUSED_CPU_BACKEND, BACKEND_ID]
    assert sorted(backend_ids()) == sorted(backend_devices())
    for backend in backend_ids():  # the devices its description gives, and no others
        assert registry.backend_devices(backend) == frozenset(backend_devices()[backend])


def test_dispatch_by_explicit_id_with_provenance() -> None:
    c = make(logits_dtype="fp32")
    chosen = dispatch(BACKEND_ID, c, "cpu")
    assert isinstance(chosen.op, VocabParallelLogprob)
    assert chosen.provenance() == {
        "requested_backend": BACKEND_ID,
        "actual_backend": BACKEND_ID,
        "fallback": False,
        "rejections": [],
        "reason": "requested explicitly",
        "mode": None,
    }
    json.dumps(chosen.provenance(), allow_nan=False)
    logits = torch.randn(c.num_tokens, c.local_vocab_size)
    out = chosen.op(logits, torch.zeros(c.num_tokens, dtype=torch.int64),
                    torch.ones(c.num_tokens, dtype=torch.bool), c)
    assert out.selected_logp.dtype == torch.float32 and out.lse.shape == (c.num_tokens,)


def test_unregistered_backend_raises_naming_it() -> None:
    with pytest.raises(BackendUnavailableError, match="backend='triton'.*not registered"):
        dispatch("triton", make(), "cpu")


def test_explicit_incapable_backend_fails_closed_with_every_reason() -> None:
    narrow = dataclasses.replace(CAPABLE, dtypes=frozenset({"bf16"}), devices=frozenset({"cuda"}),
                                 determinism_scopes=frozenset({"fixed_topology"}))
    specs = _registry(BackendSpec("narrow", narrow, lambda: None, _never_build, priority=5))
    with pytest.raises(BackendUnavailableError) as info:
        dispatch("narrow", make(logits_dtype="fp32"), "cpu", registry=specs)
    message = str(info.value)
    assert "narrow" in message and "incapable" in message
    for reason in ("dtype fp32 not in ['bf16']", "device cpu not in ['cuda']",
                   "determinism_scope cross_tp_bitwise not in ['fixed_topology']"):
        assert reason in message
    assert "nothing falls back" in message


def test_explicit_backend_on_unknown_device_is_incapable() -> None:
    with pytest.raises(BackendUnavailableError, match="device tpu not in"):
        dispatch(BACKEND_ID, make(), "tpu")


@pytest.mark.skipif(not NO_CUDA, reason="checks the CUDA-less machine's fail-closed path")
def test_cuda_request_on_a_machine_without_cuda_never_falls_back_to_cpu() -> None:
    c = make(determinism_scope="fixed_topology")
    with pytest.raises(BackendUnavailableError, match="device cuda is not available"):
        dispatch(BACKEND_ID, c, "cuda")
    with pytest.raises(BackendUnavailableError) as info:
        dispatch(AUTO, c, "cuda")
    assert BACKEND_ID in str(info.value) and FUSED_CPU_BACKEND in str(info.value)
    assert TRITON_BACKEND in str(info.value)
    assert "device cuda not in ['cpu']" in str(info.value)


def test_auto_on_cpu_takes_the_fused_backend_without_fallback() -> None:
    chosen = dispatch(AUTO, make(), "cpu")
    assert chosen.requested_backend == AUTO and chosen.actual_backend == FUSED_CPU_BACKEND
    assert chosen.fallback is False
    assert chosen.rejections == ((TRITON_BACKEND, "incapable: device cpu not in ['cuda']"),)
    provenance = chosen.provenance()
    assert provenance["reason"].startswith("auto: the highest-priority backend capable and "
                                           "available on device cpu")
    assert provenance["mode"] is None


def test_auto_takes_the_eager_backend_where_the_fused_kernel_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fused_cpu, "kernel_unavailable", lambda: "not built (test)")
    chosen = dispatch(AUTO, make(), "cpu")
    assert chosen.actual_backend == BACKEND_ID and chosen.fallback is True
    assert (FUSED_CPU_BACKEND, "unavailable: not built (test)") in chosen.rejections


CAPABLE = BackendCapabilities(
    dtypes=frozenset({"bf16", "fp16", "fp32"}),
    max_tp_world_size=64,
    supports_padding=True,
    mask_modes=frozenset({"explicit"}),
    exports_lse=True,
    determinism_scopes=frozenset({"cross_tp_bitwise", "fixed_topology"}),
    devices=frozenset({"cpu"}),
)


def _never_build() -> Any:
    raise AssertionError("a rejected backend must not be built")


def _registry(first: BackendSpec) -> dict[str, BackendSpec]:
    second = BackendSpec("plain", CAPABLE, lambda: None, VocabParallelLogprob, priority=0)
    return {first.backend_id: first, second.backend_id: second}


def test_auto_reports_fallback_when_a_capable_candidate_is_unavailable() -> None:
    fast = BackendSpec("fast", CAPABLE, lambda: "kernel not compiled", _never_build, priority=5)
    chosen = dispatch(AUTO, make(), "cpu", registry=_registry(fast))
    assert chosen.actual_backend == "plain" and chosen.fallback is True
    assert chosen.rejections == (("fast", "unavailable: kernel not compiled"),)
    assert chosen.provenance()["rejections"] == [
        {"backend": "fast", "reason": "unavailable: kernel not compiled"}
    ]
    with pytest.raises(BackendUnavailableError, match="kernel not compiled"):
        dispatch("fast", make(), "cpu", registry=_registry(fast))


def test_auto_reports_no_fallback_when_the_skipped_candidate_is_incapable() -> None:
    narrow = dataclasses.replace(CAPABLE, dtypes=frozenset({"fp32"}), max_tp_world_size=1)
    fast = BackendSpec("fast", narrow, lambda: None, _never_build, priority=5)
    chosen = dispatch(AUTO, make(tp_world_size=2), "cpu", registry=_registry(fast))
    assert chosen.actual_backend == "plain" and chosen.fallback is False
    (name, reason), = chosen.rejections
    assert name == "fast" and "dtype bf16 not in ['fp32']" in reason
    assert "tp_world_size 2 > max 1" in reason


def test_auto_with_nothing_available_raises_with_all_reasons() -> None:
    a = BackendSpec("a", CAPABLE, lambda: "no driver", _never_build, priority=1)
    b = BackendSpec("b", dataclasses.replace(CAPABLE, supports_padding=False), lambda: None,
                    _never_build)
    with pytest.raises(BackendUnavailableError) as info:
        dispatch(AUTO, make(), "cpu", registry={"a": a, "b": b})
    assert "a: unavailable: no driver" in str(info.value)
    assert "b: incapable: padded vocabulary not supported" in str(info.value)


@pytest.mark.parametrize("device", ["cpu", "cuda", "tpu"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("scope", ["cross_tp_bitwise", "fixed_topology"])
def test_no_silent_fallback_an_explicit_request_is_served_by_itself_or_raises(
    device: str, dtype: str, scope: str
) -> None:
    c = make(logits_dtype=dtype, determinism_scope=scope)
    for backend in backend_ids():
        try:
            chosen = dispatch(backend, c, device)
        except BackendUnavailableError:
            continue
        assert chosen.actual_backend == backend and chosen.fallback is False
        assert chosen.rejections == ()


def test_registry_module_has_one_error_type_for_the_domain() -> None:
    assert issubclass(BackendUnavailableError, LogprobContractError)
    assert registry.AUTO == "auto"


# ----- mesh -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(dp=0, cp=1, tp=1, world_size=1), "dp=0"),
        (dict(dp=1, cp=-1, tp=1, world_size=1), "cp=-1"),
        (dict(dp=1, cp=1, tp=1.5, world_size=1), "tp=1.5"),
        (dict(dp=1, cp=1, tp=True, world_size=1), "tp=True"),
        (dict(dp=1, cp=2, tp=2, world_size=3), "WORLD_SIZE=3 disagrees with dp*cp*tp=1*2*2=4"),
    ],
)
def test_parallel_dims_validation(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(MeshError, match=re.escape(needle)):
        ParallelDims(**kwargs)


def test_rank_mapping_is_tp_fastest_and_invertible() -> None:
    dims = ParallelDims(dp=2, cp=2, tp=2, world_size=8)
    assert [dims.coords(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)
    ]
    assert all(dims.rank_of(*dims.coords(r)) == r for r in range(8))
    cp_tp = ParallelDims(dp=1, cp=2, tp=4, world_size=8)
    assert all(cp_tp.coords(r)[1:] == divmod(r, 4) for r in range(8))  # cp_rank, tp_rank = divmod(rank, tp)
    assert (cp_tp.tp_enabled, cp_tp.cp_enabled, cp_tp.dp_enabled) == (True, True, False)
    with pytest.raises(MeshError, match="rank=8"):
        dims.coords(8)
    with pytest.raises(MeshError, match="tp_rank=2"):
        dims.rank_of(0, 0, 2)


@pytest.mark.parametrize(
    "environ, needle",
    [
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK is not set"),
        ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK='x'"),
        ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK=2"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "LOCAL_RANK=-1"),
    ],
)
def test_launch_env_validation(environ: dict[str, str], needle: str) -> None:
    with pytest.raises(MeshError, match=re.escape(needle)):
        LaunchEnv.from_environ(environ)


@pytest.fixture
def no_collectives(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record any attempt to initialise a process group (none may happen)."""
    calls: list[str] = []

    def forbidden(*args: Any, **kwargs: Any) -> None:
        calls.append("init_process_group")
        raise AssertionError("init_process_group must not be reached")

    monkeypatch.setattr(dist, "init_process_group", forbidden)
    return calls


ENV2 = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def test_world_size_mismatch_raises_before_any_collective(no_collectives: list[str]) -> None:
    with pytest.raises(MeshError, match=re.escape("WORLD_SIZE=3 disagrees with dp*cp*tp=1*1*2=2")):
        init_mesh(tp=2, environ=ENV2)
    assert no_collectives == [] and not dist.is_initialized()


@pytest.mark.skipif(not NO_CUDA, reason="checks the CUDA-less machine's fail-closed path")
def test_cuda_mesh_on_a_machine_without_cuda_raises(no_collectives: list[str]) -> None:
    env = {**ENV2, "WORLD_SIZE": "1"}
    with pytest.raises(MeshError, match="device='cuda'.*nothing falls back"):
        init_mesh(tp=1, device="cuda", environ=env)
    assert no_collectives == [] and not dist.is_initialized()


@pytest.mark.parametrize("kwargs, needle", [(dict(device="tpu"), "device='tpu'"),
                                            (dict(timeout_s=0), "timeout_s=0")])
def test_init_mesh_rejects_bad_device_and_timeout(
    no_collectives: list[str], kwargs: dict[str, Any], needle: str
) -> None:
    with pytest.raises(MeshError, match=re.escape(needle)):
        init_mesh(tp=1, environ={**ENV2, "WORLD_SIZE": "1"}, **kwargs)
    assert no_collectives == []


def test_mesh_backends_are_gloo_on_cpu_and_nccl_on_cuda() -> None:
    assert mesh.DEVICE_DIST_BACKENDS == {"cpu": "gloo", "cuda": "nccl"}
    assert mesh.check_device("cpu") == "gloo"
