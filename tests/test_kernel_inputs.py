"""Hostile tensors at the kernel API.

Every tensor the op hands to compiled code or to a collective is checked before the
agreement step, so a bad tensor on one TP rank makes every rank raise the same
``LogprobContractError``, and nothing can fail after the agreement on one rank alone:

1. a tensor whose storage was shrunk after it was made (what FSDP does to free a buffer,
   ``x.untyped_storage().resize_(64)``): the fused kernel read past the storage (garbage at
   16 rows, SIGSEGV at 1024, forward and backward); now refused naming the bytes;
2. a negative view (``torch._neg_view``) gave the fused kernel's bytes of the un-negated
   data; now resolved first (the eager backend's bytes). Zero tensors, fake and meta tensors
   have no storage to read: refused saying so;
3. sparse (COO, CSR, CSC, BSR) and MKL-DNN logits passed the checks and failed inside the
   forward, after the agreement: a rank that caught the error and called again paired its
   agreement with its peer's exchange (gloo abort). Now refused in the checks;
4. ``FusedCpuLogprob(threads=...)`` and an instruction set the CPU lacks are validated when
   the op is built, not after the agreement.

Bytes are compared as SHA-256 fingerprints. Crashing cases run in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from rl_engine.distributed.mesh import init_mesh
from rl_engine.logprob.backends.eager.vocab_parallel import VocabParallelLogprob
from rl_engine.logprob.backends.fused_cpu import fused_cpu
from rl_engine.logprob.backends.fused_cpu.fused_cpu import MAX_THREADS, FusedCpuLogprob
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.tensorio import fingerprint

from _multiproc import run_workers

ROOT = Path(__file__).resolve().parents[1]
VOCAB, TILES, ROWS = 1024, 16, 16
OPS: dict[str, Callable[[], VocabParallelLogprob]] = {
    "fused": lambda: FusedCpuLogprob(threads=1),
    "eager": VocabParallelLogprob,
}


def _inputs(rows: int = ROWS, seed: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, VOCAB, generator=g) * 2
    targets = torch.randint(0, VOCAB, (rows,), generator=g)
    active = torch.ones(rows, dtype=torch.bool)
    active[::5] = False
    return x, targets, active


def _contract(rows: int = ROWS, dtype: str = "fp32", **kw: Any) -> LogprobContract:
    return LogprobContract(VOCAB, VOCAB, TILES, 1, rows, logits_dtype=dtype, **kw)


def _prints(op: VocabParallelLogprob, x: torch.Tensor, leaf: torch.Tensor, targets: torch.Tensor,
            active: torch.Tensor, contract: LogprobContract) -> tuple[str, ...]:
    """Fingerprints of logp, LSE, entropy and the gradient of ``leaf`` (``x`` is built from it)."""
    out = op(x, targets, active, contract, compute_entropy=True)
    w = torch.linspace(-1.0, 1.0, x.shape[0])
    (grad,) = torch.autograd.grad((out.selected_logp, out.lse), leaf, (w, w.flip(0)))
    assert out.entropy is not None
    return tuple(fingerprint(t) for t in (out.selected_logp, out.lse, out.entropy, grad))


# ----- 1. storage shrunk after the tensor was made --------------------------------------------


@pytest.mark.parametrize("backend", list(OPS))
def test_logits_whose_storage_was_shrunk_are_refused_naming_the_bytes(backend: str) -> None:
    """Unchecked, the fused backend reads past the shrunk storage (an LSE of 4.5e27 and NaN rows) and
    eager raises a bare RuntimeError; both must refuse, naming the bytes."""
    x, targets, active = _inputs()
    x.untyped_storage().resize_(64)
    with pytest.raises(LogprobContractError) as info:
        OPS[backend]()(x, targets, active, _contract())
    message = str(info.value)
    assert "logits" in message and "65536 bytes" in message and "holds 64" in message, message
    assert "resize_" in message, message  # the likely cause and the fix


@pytest.mark.parametrize("name", ["targets", "active"])
def test_targets_or_mask_whose_storage_was_shrunk_are_refused(name: str) -> None:
    x, targets, active = _inputs()
    (targets if name == "targets" else active).untyped_storage().resize_(2)
    with pytest.raises(LogprobContractError, match=f"{name}: its last element"):
        FusedCpuLogprob(threads=1)(x, targets, active, _contract())


@pytest.mark.parametrize("backend", list(OPS))
def test_saved_logits_shrunk_before_backward_are_refused(backend: str) -> None:
    """Unchecked, the fused backward reads freed memory and returns a garbage gradient."""
    x, targets, active = _inputs()
    leaf = x.clone().requires_grad_(True)
    out = OPS[backend]()(leaf, targets, active, _contract())
    leaf.detach().untyped_storage().resize_(64)
    with pytest.raises(LogprobContractError, match="saved logits: its last element"):
        out.selected_logp.sum().backward()


CRASH = textwrap.dedent(
    """
    import sys, torch
    from rl_engine.logprob.contract import LogprobContract, LogprobContractError
    from rl_engine.logprob.backends.fused_cpu.fused_cpu import FusedCpuLogprob
    rows, vocab = 1024, 1024
    c = LogprobContract(vocab, vocab, 16, 1, rows, logits_dtype="fp32")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, vocab, generator=g).requires_grad_(True)
    t = torch.randint(0, vocab, (rows,), generator=g)
    a = torch.ones(rows, dtype=torch.bool)
    op = FusedCpuLogprob(threads=1)
    try:
        if sys.argv[1] == "forward":
            x.detach().untyped_storage().resize_(64)
            op(x, t, a, c)
        else:
            out = op(x, t, a, c)
            x.detach().untyped_storage().resize_(64)
            out.selected_logp.sum().backward()
    except LogprobContractError as exc:
        print("REFUSED:", exc)
        sys.exit(3)
    print("NO ERROR")
    """
)


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_shrunk_storage_of_a_4_mib_tensor_is_refused_instead_of_a_segfault(stage: str) -> None:
    """Unchecked, both stages die of SIGSEGV (exit -11) at 1024 x 1024 fp32 (4 MiB freed to 64 bytes)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CRASH, stage], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "REFUSED:" in proc.stdout and "4194304 bytes" in proc.stdout, proc.stdout


def test_a_view_inside_its_storage_is_accepted_and_its_bytes_are_the_copy_s() -> None:
    """Control: a row-strided view of a bigger storage is legal and gives the copy's bytes."""
    x, targets, active = _inputs()
    wide = torch.zeros(ROWS, VOCAB + 64)
    wide[:, 32:32 + VOCAB] = x
    view = wide[:, 32:32 + VOCAB]
    assert view.storage_offset() == 32
    op = FusedCpuLogprob(threads=1)
    leaf_v, leaf_c = view.clone().requires_grad_(True), x.clone().requires_grad_(True)
    got = _prints(op, leaf_v, leaf_v, targets, active, _contract())
    assert got == _prints(op, leaf_c, leaf_c, targets, active, _contract())


# ----- 2. negative views, conj, tensors without storage ---------------------------------------


@pytest.mark.parametrize("backend", list(OPS))
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_a_negative_view_gives_the_bytes_of_its_negated_copy(dtype: str, backend: str) -> None:
    """A negative view's memory holds the un-negated values: a kernel reading it directly, or the
    eager backend in fp16 (torch 2.13's fp16 -> fp32 ``copy_`` drops the neg bit), gets other bytes."""
    x, targets, active = _inputs()
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    leaf = (-x).to(torch_dtype).requires_grad_(True)
    contract = _contract(dtype=dtype)
    expected = _prints(VocabParallelLogprob(), -leaf, leaf, targets, active, contract)
    view = torch._neg_view(leaf)
    assert view.is_neg()
    assert _prints(OPS[backend](), view, leaf, targets, active, contract) == expected


def test_negative_control_the_un_negated_memory_gives_other_bytes() -> None:
    x, targets, active = _inputs()
    leaf = x.clone().requires_grad_(True)
    plain = _prints(FusedCpuLogprob(threads=1), leaf, leaf, targets, active, _contract())
    negated = _prints(FusedCpuLogprob(threads=1), -leaf, leaf, targets, active, _contract())
    assert all(a != b for a, b in zip(plain, negated))


def test_a_conjugate_view_cannot_reach_the_kernel() -> None:
    """Conj bits exist on complex tensors only, and complex logits are refused by dtype."""
    x, targets, active = _inputs()
    z = torch.complex(x, x).conj()
    assert z.is_conj()
    with pytest.raises(LogprobContractError, match="logits.dtype=torch.complex64 does not match"):
        FusedCpuLogprob(threads=1)(z, targets, active, _contract())


def _zero() -> torch.Tensor:
    return torch._efficientzerotensor((ROWS, VOCAB), dtype=torch.float32)


def _meta() -> torch.Tensor:
    return torch.empty(ROWS, VOCAB, device="meta")


def _fake() -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode().from_tensor(torch.empty(ROWS, VOCAB))


NO_STORAGE = {
    "zero": (_zero, "logits is a zero tensor (torch._efficientzerotensor) with no storage"),
    "meta": (_meta, "logits has no real storage (its storage is on device meta"),
    "fake": (_fake, "logits has no real storage (its storage is on device meta"),
}


@pytest.mark.parametrize("backend", list(OPS))
@pytest.mark.parametrize("kind", list(NO_STORAGE))
def test_tensors_without_real_storage_are_refused_saying_so(kind: str, backend: str) -> None:
    """A zero-storage, fake or meta tensor is refused by name: the fused kernel would report "bad
    arguments, or an instruction set this CPU lacks", eager would compute on the zero tensor, and
    meta logits would be refused for their device only."""
    make, needle = NO_STORAGE[kind]
    x = make()
    _, targets, active = _inputs()
    if kind == "meta":
        targets, active = targets.to("meta"), active.to("meta")
    with pytest.raises(LogprobContractError) as info:
        OPS[backend]()(x, targets, active, _contract())
    assert needle in str(info.value), str(info.value)


# ----- 3. layouts other than strided ----------------------------------------------------------


LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sparse_coo": lambda x: x.to_sparse(),
    "sparse_csr": lambda x: x.to_sparse_csr(),
    "sparse_csc": lambda x: x.to_sparse_csc(),
    "sparse_bsr": lambda x: x.to_sparse_bsr((4, 4)),
    "mkldnn": lambda x: x.to_mkldnn(),
}


@pytest.mark.parametrize("backend", list(OPS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_non_strided_logits_are_refused_in_the_checks(layout: str, backend: str) -> None:
    """Refused before the agreement: inside the forward they raise NotImplementedError/RuntimeError
    on one rank while the others wait in a collective."""
    x, targets, active = _inputs()
    with pytest.raises(LogprobContractError) as info:
        OPS[backend]()(LAYOUTS[layout](x), targets, active, _contract())
    message = str(info.value)
    assert "logits.layout=" in message and layout.replace("sparse_", "sparse_") in message
    assert ".to_dense()" in message, message


@pytest.mark.parametrize("name", ["targets", "active"])
def test_sparse_targets_or_mask_are_refused(name: str) -> None:
    x, targets, active = _inputs()
    args = {"targets": targets, "active": active}
    args[name] = args[name].to_sparse()
    with pytest.raises(LogprobContractError, match=f"{name}.layout=torch.sparse_coo"):
        FusedCpuLogprob(threads=1)(x, args["targets"], args["active"], _contract())


# ----- under TP=2: one rank's hostile tensor, every rank refuses, the group stays in step -----


TP_TILES = 16
PG_TIMEOUT_S = 30


def _tp_worker(rank: int, backend: str) -> dict[str, Any]:
    mesh = init_mesh(tp=2, timeout_s=PG_TIMEOUT_S)
    x, targets, active = _inputs(rows=8)
    contract = LogprobContract.from_mesh(mesh, real_vocab_size=VOCAB, num_vocab_tiles=TP_TILES,
                                         num_sequences=1, seq_len=8, logits_dtype="fp32")
    local = x[:, contract.vocab_start:contract.vocab_end].contiguous()
    op = OPS[backend]()
    one = rank == 1

    def call(logits: torch.Tensor, t: torch.Tensor = targets, a: torch.Tensor = active) -> Any:
        try:
            out = op(logits, t, a, contract, group=mesh.tp_group)
        except Exception as exc:  # noqa: BLE001 - a trainer that catches and goes on
            return ("raised", f"{type(exc).__name__}: {exc}")
        return ("ok", fingerprint(out.selected_logp) + fingerprint(out.lse))

    def shrunk() -> torch.Tensor:
        y = local.clone()
        y.untyped_storage().resize_(64)
        return y

    results: dict[str, Any] = {"good": call(local)}
    # each hostile call on rank 1 is caught there and followed by a good call on both ranks
    hostile: dict[str, Callable[[], Any]] = {
        "sparse_coo": lambda: call(local.to_sparse() if one else local),
        "sparse_csr": lambda: call(local.to_sparse_csr() if one else local),
        "shrunk": lambda: call(shrunk() if one else local),
        "zero": lambda: call(torch._efficientzerotensor(local.shape) if one else local),
        "meta": lambda: call(torch.empty(local.shape, device="meta"), targets.to("meta"),
                             active.to("meta")) if one else call(local),
        "neg_view": lambda: call(torch._neg_view(-local) if one else local),
    }
    for name, hostile_call in hostile.items():
        results[name] = hostile_call()
        results[f"{name}_then"] = call(local)
    return results


@pytest.fixture(scope="module", params=["fused", "eager"])
def tp_runs(request: Any) -> tuple[str, list[dict[str, Any]]]:
    return request.param, run_workers(_tp_worker, 2, request.param, timeout_s=120)


@pytest.mark.parametrize("name,needle", [
    ("sparse_coo", "logits.layout=torch.sparse_coo"),
    ("sparse_csr", "logits.layout=torch.sparse_csr"),
    ("shrunk", "logits: its last element"),
    ("zero", "zero tensor"),
    ("meta", "no real storage"),
])
def test_a_hostile_tensor_on_one_tp_rank_is_refused_by_every_rank_and_the_retry_works(
    tp_runs: tuple[str, list[dict[str, Any]]], name: str, needle: str
) -> None:
    """Before (sparse): the retrying rank's agreement met its peer's exchange, gloo abort."""
    _, ranks = tp_runs
    messages = set()
    for res in ranks:
        outcome, message = res[name]
        assert outcome == "raised" and message.startswith("LogprobContractError: "), message
        assert needle in message and "TP rank 1" in message, message
        messages.add(message)
        assert res[f"{name}_then"] == res["good"]  # the group is still in step
    assert len(messages) == 1
    assert ranks[0]["good"][0] == "ok" and ranks[0]["good"] == ranks[1]["good"]


def test_a_negative_view_on_one_tp_rank_gives_both_ranks_the_right_bytes(
    tp_runs: tuple[str, list[dict[str, Any]]],
) -> None:
    """Before (fused): both ranks got other bytes than the good call's."""
    _, ranks = tp_runs
    for res in ranks:
        assert res["neg_view"] == res["good"], res["neg_view"]


# ----- 4. the fused op's options, validated when it is built ----------------------------------


@pytest.mark.parametrize("threads,needle", [
    (10**10, f"threads=10000000000 exceeds the kernel's maximum of {MAX_THREADS}"),
    (MAX_THREADS + 1, f"threads={MAX_THREADS + 1} exceeds the kernel's maximum"),
    (2.5, "threads=2.5 must be an integer"),
    (True, "threads=True must be an integer"),
    ("2", "threads='2' must be an integer"),
    (0, "threads=0 must be >= 1"),
    (-3, "threads=-3 must be >= 1"),
])
def test_threads_is_validated_when_the_op_is_built(threads: Any, needle: str) -> None:
    """ctypes would truncate 10**10 and raise its own error on 2.5 at the call: check at construction."""
    with pytest.raises(LogprobContractError) as info:
        FusedCpuLogprob(threads=threads)
    message = str(info.value)
    assert needle in message and "None" in message, message  # the fix: an int or None


def test_the_thread_bound_is_accepted_and_gives_the_same_bytes() -> None:
    x, targets, active = _inputs()
    leaf = x.clone().requires_grad_(True)
    one = _prints(FusedCpuLogprob(threads=1), leaf, leaf, targets, active, _contract())
    assert _prints(FusedCpuLogprob(threads=MAX_THREADS), leaf, leaf, targets, active,
                   _contract()) == one


def test_an_instruction_set_the_cpu_lacks_is_refused_when_the_op_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An instruction set the CPU lacks is refused at construction, not by the kernel (status 1) after
    the agreement."""
    monkeypatch.setattr(fused_cpu.FusedKernel, "selected_isa", lambda self, isa=0: -1)
    with pytest.raises(LogprobContractError, match="isa='avx2' is not supported by this CPU"):
        FusedCpuLogprob(isa="avx2")


@pytest.mark.parametrize("kind", ["sparse", "shrunk"])
def test_gather_tokens_checks_the_memory_of_what_it_sends(kind: str) -> None:
    """The CP gather hands ``local`` to a collective: the same memory checks, before it."""
    from rl_engine.logprob.api import gather_tokens

    local = torch.arange(8, dtype=torch.float32)
    if kind == "sparse":
        local, needle = local.to_sparse(), "local.layout=torch.sparse_coo"
    else:
        local.untyped_storage().resize_(4)
        needle = "local: its last element needs 32 bytes of storage, which holds 4"
    with pytest.raises(LogprobContractError, match=needle):
        gather_tokens(local, LogprobContract(VOCAB, VOCAB, TILES, 1, 8))
