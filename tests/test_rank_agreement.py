"""TP ranks that disagree on a call raise the same LogprobContractError on every rank.

Real processes and real gloo collectives (:func:`_multiproc.run_workers`).
Each scenario reproduces a case that crashed (SIGABRT), hung until the process-group timeout
or silently returned different values before the per-call agreement step; each must now
raise on both ranks, with the same message naming the field and the ranks, after exactly
one collective (the agreement record), in well under the process-group timeout. A good call
after all of them proves the group is still in step.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from rl_engine.distributed.mesh import init_mesh
from rl_engine.logprob import LogprobContract, LogprobContractError, gather_tokens
from rl_engine.logprob.agreement import (
    MESSAGE_BYTES,
    RECORD_BYTES,
    CallRecord,
    agree,
    decode_record,
    decode_slot,
    encode_slot,
)
from rl_engine.logprob.backends.eager.vocab_parallel import BACKEND_ID, VocabParallelLogprob
from rl_engine.logprob.registry import dispatch
from rl_engine.tensorio import fingerprint

from _multiproc import run_workers

REAL, PADDED, TILES, SEQ = 1000, 1024, 16, 8
PG_TIMEOUT_S = 30


def _batch(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(SEQ, PADDED, generator=g) * 2).to(torch.bfloat16)
    targets = torch.randint(0, REAL, (SEQ,), generator=g)
    active = torch.ones(SEQ, dtype=torch.bool)
    active[:2] = False
    targets[0] = -100  # garbage on an inactive row
    return logits, targets, active


class Collectives:
    """Record (name, dtype, numel) of every collective this process enters."""

    NAMES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "barrier",
             "all_gather_object", "reduce_scatter", "all_to_all")

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []
        for name in self.NAMES:
            original = getattr(dist, name)

            def wrapper(*args: Any, _name: str = name, _orig: Any = original, **kw: Any) -> Any:
                tensor = args[1] if _name == "all_gather" and len(args) > 1 else (args[0] if args else None)
                if isinstance(tensor, torch.Tensor):
                    self.calls.append((_name, str(tensor.dtype), tensor.numel()))
                else:
                    self.calls.append((_name, "", 0))
                return _orig(*args, **kw)

            setattr(dist, name, wrapper)


def _scenarios(rank: int, mesh: Any) -> list[tuple[str, Callable[[], Any]]]:
    logits, targets, active = _batch()
    contract = LogprobContract(REAL, PADDED, TILES, 1, SEQ, tp_world_size=2, tp_rank=rank)
    local = logits[:, contract.vocab_start:contract.vocab_end].contiguous()
    op = VocabParallelLogprob()
    tp = mesh.tp_group

    def call(**kw: Any) -> Callable[[], Any]:
        args = dict(logits=local, targets=targets, active=active, contract=contract)
        options = dict(group=tp)
        for key, value in kw.items():
            (args if key in args else options)[key] = value
        return lambda: op(args["logits"], args["targets"], args["active"], args["contract"],
                          **options)

    other_targets = targets.clone()
    other_targets[5] = (int(targets[5]) + 1) % REAL  # an active row
    other_active = active.clone()
    other_active[6] = False
    inactive_garbage = targets.clone()
    inactive_garbage[1] = 10**9  # inactive row: never read
    bad_target = targets.clone()
    bad_target[4] = REAL
    one = rank == 1

    def flushing() -> Any:
        if one:
            torch.set_flush_denormal(True)
        try:
            return op(local, targets, active, contract, group=tp)
        finally:
            torch.set_flush_denormal(False)

    return [
        # (a) compute_entropy on one TP rank only: was SIGABRT (exchange buffers of two widths)
        ("entropy_on_one_rank", call(compute_entropy=not one)),
        ("validate_on_one_rank", call(validate=not one)),
        # (c) other targets / another active mask on one TP peer: was silent, each its own logp
        ("targets_differ", call(targets=other_targets if one else targets)),
        ("active_differs", call(active=other_active if one else active)),
        # (d) a bad dtype or shape caught on one rank only: the peer waited for the pg timeout
        ("targets_dtype_on_one_rank", call(targets=targets.int() if one else targets)),
        ("logits_shape_on_one_rank", call(logits=local[:, :256] if one else local)),
        ("logits_dtype_on_one_rank", call(logits=local.float() if one else local)),
        ("bad_target_on_one_rank", call(targets=bad_target if one else targets)),
        ("targets_not_a_tensor_on_one_rank", call(targets=targets.tolist() if one else targets)),
        ("chunk_rows_on_one_rank", call(chunk_rows=2.5 if one else None)),
        ("contract_tp_rank_on_one_rank", call(contract=LogprobContract(
            REAL, PADDED, TILES, 1, SEQ, tp_world_size=2, tp_rank=0) if one else contract)),
        ("cp_rank_differs", call(contract=LogprobContract(
            REAL, PADDED, TILES, 1, SEQ, tp_world_size=2, tp_rank=rank, cp_world_size=2,
            cp_rank=rank), logits=local[:4], targets=targets[:4],
            active=active[:4])),
        ("flush_denormal_on_one_rank", flushing),
        # rank 0 gathers over the group while rank 1 computes: two calls meet in one collective
        ("different_calls", (lambda: gather_tokens(
            torch.zeros(4), LogprobContract(PADDED, PADDED, TILES, 1, SEQ, cp_world_size=2,
                                            cp_rank=0), tp)) if rank == 0 else call()),
        # different garbage on inactive rows is not a disagreement: same bytes, no error
        ("inactive_garbage_differs", call(targets=inactive_garbage if one else targets)),
        ("good", call()),
    ]


EXPECTED: dict[str, tuple[str, ...]] = {  # every fragment must be in the message on both ranks
    "entropy_on_one_rank": ("TP ranks disagree on compute_entropy",
                            "rank 0: compute_entropy=true", "rank 1: compute_entropy=false"),
    "validate_on_one_rank": ("TP ranks disagree on validate", "rank 1: validate=false"),
    "targets_differ": ("TP ranks disagree on targets", "rank 0: targets=sha256:",
                       "rank 1: targets=sha256:", "same targets on its active rows"),
    "active_differs": ("TP ranks disagree on targets, active", "same active mask"),
    "targets_dtype_on_one_rank": ("TP rank 1 rejected its inputs", "targets must be int64",
                                  "torch.int32"),
    "logits_shape_on_one_rank": ("TP rank 1 rejected its inputs", "logits.shape=(8, 256)"),
    "logits_dtype_on_one_rank": ("TP rank 1 rejected its inputs", "logits.dtype=torch.float32"),
    "bad_target_on_one_rank": ("TP rank 1 rejected", "targets[4]=1000",
                               "outside [0, real_vocab_size=1000)"),
    "targets_not_a_tensor_on_one_rank": ("TP rank 1 rejected",
                                         "targets must be a torch.Tensor, got list"),
    "chunk_rows_on_one_rank": ("TP rank 1 rejected", "chunk_rows=2.5 must be a positive integer"),
    "contract_tp_rank_on_one_rank": ("TP rank 1 rejected",
                                     "rank 1 in the TP group disagrees with tp_rank=0"),
    "cp_rank_differs": ("TP ranks disagree on cp_rank", "rank 0: cp_rank=0", "rank 1: cp_rank=1",
                        "share cp_rank"),
    "flush_denormal_on_one_rank": ("TP rank 1 rejected", "set_flush_denormal"),
}


def _worker(rank: int) -> dict[str, Any]:
    mesh = init_mesh(tp=2, timeout_s=PG_TIMEOUT_S)
    log = Collectives()
    out: dict[str, Any] = {}
    for name, call in _scenarios(rank, mesh):
        before = len(log.calls)
        start = time.monotonic()
        try:
            res = call()
            outcome = ("ok", fingerprint(res.selected_logp) + fingerprint(res.lse))
        except LogprobContractError as exc:
            outcome = ("raised", str(exc))
        out[name] = (*outcome, log.calls[before:], time.monotonic() - start)
    return out


@pytest.fixture(scope="module")
def disagreements() -> list[dict[str, Any]]:
    return run_workers(_worker, 2, timeout_s=120)


AGREEMENT = ("all_gather", "torch.uint8", RECORD_BYTES)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_disagreeing_tp_ranks_raise_the_same_error_on_every_rank(
    disagreements: list[dict[str, Any]], name: str
) -> None:
    messages = set()
    for rank, res in enumerate(disagreements):
        outcome, message, calls, seconds = res[name]
        assert outcome == "raised", (rank, name, message)
        for fragment in EXPECTED[name]:
            assert fragment in message, (rank, name, fragment, message)
        assert "(global 1)" in message  # the ranks are named with their global rank too
        assert calls == [AGREEMENT], (rank, name, calls)  # the agreement record, nothing else
        assert seconds < PG_TIMEOUT_S / 3, (rank, name, seconds)  # nobody waited for a timeout
        messages.add(message)
    assert len(messages) == 1, messages  # the same error, word for word, on every rank


def test_ranks_in_different_calls_are_told_apart(disagreements: list[dict[str, Any]]) -> None:
    """The record names its call: an op meeting a gather in the same collective raises on both."""
    for res in disagreements:
        outcome, message, calls, _ = res["different_calls"]
        assert outcome == "raised" and "are not in the same call" in message, message
        assert "gather_tokens" in message and "selected_logprob" in message, message
        assert calls == [AGREEMENT]


def test_different_garbage_on_inactive_rows_is_not_a_disagreement(
    disagreements: list[dict[str, Any]],
) -> None:
    for res in disagreements:
        assert res["inactive_garbage_differs"][0] == "ok"
        assert res["inactive_garbage_differs"][1] == res["good"][1]


def test_the_group_is_still_in_step_after_every_refusal(disagreements: list[dict[str, Any]]) -> None:
    first, second = disagreements
    assert first["good"][0] == second["good"][0] == "ok"
    assert first["good"][1] == second["good"][1]
    # agreement record first, then the one numerical exchange (float32)
    assert [c[:2] for c in first["good"][2]] == [AGREEMENT[:2], ("all_gather", "torch.float32")]
    assert first["good"][2][0] == AGREEMENT


# ----- (b) a fresh op instance (or a fresh dispatch) on one rank only -----------------------


def _fresh_op_worker(rank: int) -> dict[str, Any]:
    """Rank 0 keeps one dispatched op for every call; rank 1 dispatches a new one each call."""
    mesh = init_mesh(tp=2, timeout_s=PG_TIMEOUT_S)
    log = Collectives()
    logits, targets, active = _batch()
    contract = LogprobContract.from_mesh(mesh, real_vocab_size=REAL, padded_vocab_size=PADDED,
                                         num_vocab_tiles=TILES, num_sequences=1, seq_len=SEQ)
    local = logits[:, contract.vocab_start:contract.vocab_end].contiguous()
    kept = dispatch(BACKEND_ID, contract, "cpu").op
    prints, per_call = [], []
    for i in range(3):
        op = kept if rank == 0 else dispatch(BACKEND_ID, contract, "cpu").op
        before = len(log.calls)
        out = op(local, targets, active, contract, group=mesh.tp_group, compute_entropy=i == 1)
        per_call.append(log.calls[before:])
        prints.append(fingerprint(out.selected_logp) + fingerprint(out.lse))
    return {"prints": prints, "calls": per_call}


def test_a_fresh_op_on_one_rank_makes_the_same_collectives() -> None:
    """A fresh op on one rank and a used one on the other make the same collectives: a cached
    preflight that skipped its all-gather on one side would pair it with the peer's exchange (abort)."""
    kept, fresh = run_workers(_fresh_op_worker, 2, timeout_s=120)
    assert kept["prints"] == fresh["prints"]
    assert kept["calls"] == fresh["calls"]
    for calls in kept["calls"]:
        assert calls[0] == AGREEMENT and len(calls) == 2  # agreement first, every call
    logits, targets, active = _batch()
    single = VocabParallelLogprob()(logits, targets, active,
                                    LogprobContract(REAL, PADDED, TILES, 1, SEQ))
    assert kept["prints"][0] == fingerprint(single.selected_logp) + fingerprint(single.lse)


# ----- gather_tokens on a CP group: the same agreement ----------------------------------------


def _gather_worker(rank: int) -> dict[str, Any]:
    mesh = init_mesh(tp=1, cp=2, timeout_s=PG_TIMEOUT_S)
    contract = LogprobContract.from_mesh(mesh, real_vocab_size=PADDED, num_vocab_tiles=TILES,
                                         num_sequences=2, seq_len=SEQ, cp_layout="zigzag")
    mine = torch.tensor(contract.token_indices, dtype=torch.float32)
    out: dict[str, Any] = {"values": gather_tokens(mine, contract, mesh.cp_group).tolist()}
    flags = gather_tokens(mine > 3, contract, mesh.cp_group)
    out["bool"] = (flags.dtype == torch.bool, flags.tolist())
    for name, local in (("shape_on_one_rank", mine[:3] if rank == 1 else mine),
                        ("dtype_on_one_rank", mine.double() if rank == 1 else mine)):
        try:
            gather_tokens(local, contract, mesh.cp_group)
            out[name] = "ok"
        except LogprobContractError as exc:
            out[name] = str(exc)
    return out


def test_gather_tokens_places_every_cp_rank_in_global_order_and_agrees_first() -> None:
    results = run_workers(_gather_worker, 2, timeout_s=120)
    for res in results:
        assert res["values"] == [float(i) for i in range(2 * SEQ)]
        assert res["bool"] == (True, [i > 3 for i in range(2 * SEQ)])
    for name, fragment in (("shape_on_one_rank", "CP rank 1 rejected its inputs"),
                           ("dtype_on_one_rank", "CP ranks disagree on dtype")):
        assert results[0][name] == results[1][name], name
        assert fragment in results[0][name], results[0][name]


# ----- the record itself (one process) ----------------------------------------------------------


def test_the_record_has_a_fixed_size_and_round_trips() -> None:
    fields = (("compute_entropy", "true"), ("contract.num_vocab_tiles", "16"),
              ("targets", "sha256:" + "ab" * 32))
    ok = CallRecord("selected_logprob", None, fields)
    bad = CallRecord("selected_logprob", "é" * MESSAGE_BYTES, fields)  # 2 bytes a character
    for record in (ok, bad):
        raw = record.encode()
        assert len(raw) == RECORD_BYTES
        got = decode_record(raw)
        assert got.magic_ok and got.call == "selected_logprob"
        assert got.values[:2] == ("true", "16") and got.values[2].startswith("sha256:")
    assert decode_record(ok.encode()).failed is False
    message = decode_record(bad.encode()).message
    assert message == "é" * (MESSAGE_BYTES // 2)  # truncated to whole characters
    assert decode_record(bytes(RECORD_BYTES)).magic_ok is False  # zeros: not a record
    # short values travel as text, long ones as a digest that still tells them apart
    assert decode_slot(encode_slot("zigzag")) == "zigzag"
    assert decode_slot(encode_slot("x" * 40)) != decode_slot(encode_slot("x" * 39 + "y"))


def test_a_single_rank_group_exchanges_nothing_and_raises_its_own_verdict() -> None:
    agree(CallRecord("selected_logprob", None, ()), None, torch.device("cpu"))
    with pytest.raises(LogprobContractError, match="^my own problem$"):
        agree(CallRecord("selected_logprob", "my own problem", ()), None, torch.device("cpu"))


def _rank_of_world(rank: int) -> int:
    import torch.distributed as dist

    from rl_engine.distributed.mesh import init_mesh

    init_mesh(tp=2, cp=1, timeout_s=30)
    return dist.get_rank()


def test_run_workers_runs_again_when_its_port_was_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The port ``free_port`` picks can be taken before rank 0 binds it (another process on a busy
    machine: it happened beside a second copy of the suite). Here the first port is held by a
    listening socket: the group cannot form, and ``run_workers`` runs again on a fresh port."""
    import socket

    import _multiproc

    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen()
    ports = iter([held.getsockname()[1]])
    real = _multiproc.free_port
    monkeypatch.setattr(_multiproc, "free_port", lambda: next(ports, None) or real())
    try:
        assert _multiproc.run_workers(_rank_of_world, 2, timeout_s=60, failure_grace_s=2.0) == [0, 1]
    finally:
        held.close()
