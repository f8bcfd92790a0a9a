"""The Triton path's host work per call: aten operations and host synchronisations, pinned.

A forward and a backward of ``TritonLogprob`` run on CPU tensors with every kernel launch
stubbed (``Launch.run`` does nothing: the outputs keep ``torch.empty``'s contents, and no branch
reads them but the validity flag, which the stub leaves as the zeros it was made of), under a
``TorchDispatchMode`` that records every aten operation the op dispatches. On CUDA each of these
operations is a launch or a host-side tensor operation; the host synchronisations are the
operations that read device memory on the host: ``_local_scalar_dense`` (``.item()``,
``bool()``, ``int()``), ``is_nonzero``, the data-dependent shapes (``nonzero``,
``masked_select``, ``unique``) and ``.tolist()`` (which dispatches nothing on a CPU tensor, so
it is counted by a wrapper).

Pinned (docs/performance.md, "Host work per call"): no host synchronisation in a forward or a
backward without validation, exactly one in a validated forward at TP = 1 (the merge kernel's
per-row flags, the targets' range and the non-finite check together, read once), none in the
backward; the exact operation counts per configuration, none of them device work but the Triton
launches (two per forward, four per backward), so a change that adds an operation or a sync
fails here and must update the table. Negative controls: an added ``.item()`` and an added
``.tolist()`` are counted.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")  # the test extra installs it: CI never skips

from rl_engine.logprob.backends.triton import triton_backend  # noqa: E402
from rl_engine.logprob.backends.triton.triton_backend import TritonLogprob  # noqa: E402
from rl_engine.logprob.contract import LogprobContract, LogprobContractError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # 0 / 0 on zeros
SYNC_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "item", "nonzero", "masked_select", "unique",
                      "_unique", "_unique2", "unique_consecutive", "tolist"})
ROWS = 7


class OpCounter(TorchDispatchMode):
    """Every aten operation dispatched inside the mode, by name, and the host syncs among them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def syncs(self) -> int:
        return sum(n for name, n in self.ops.items() if name in SYNC_OPS)


def _count_tolist(monkeypatch: pytest.MonkeyPatch) -> list[OpCounter]:
    """``.tolist()`` counted into the active counter (the list's last)."""
    active: list[OpCounter] = []
    real_tolist = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:
        if active:
            active[-1].ops["tolist"] += 1
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return active


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch) -> list[OpCounter]:
    """Kernel launches stubbed; ``.tolist()`` counted into the active counter (the list)."""
    monkeypatch.setattr(triton_backend.Launch, "run", lambda self, kernels: None)
    return _count_tolist(monkeypatch)


@pytest.fixture
def live(monkeypatch: pytest.MonkeyPatch) -> list[OpCounter]:
    """The kernels run (interpreter): a branch on what they computed is taken; ``.tolist()`` counted."""
    return _count_tolist(monkeypatch)


def _contract(temperature: float = 1.0) -> LogprobContract:
    return LogprobContract(real_vocab_size=1000, padded_vocab_size=1024, num_vocab_tiles=8, num_sequences=1,
                           seq_len=ROWS, logits_dtype="bf16", temperature=temperature)


def count(active: list[OpCounter], entropy: bool, validate: bool, temperature: float = 1.0,
          targets: torch.Tensor | None = None,
          row_temperature: torch.Tensor | None = None) -> tuple[OpCounter, OpCounter]:
    """``(forward, backward)`` counters of one call of the Triton op (interpreter mode, stubbed)."""
    op = TritonLogprob(mode="interpreter")
    x = torch.zeros(ROWS, 1024, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.arange(ROWS, dtype=torch.int64) * 100 if targets is None else targets
    active_rows = torch.ones(ROWS, dtype=torch.bool)
    grads = (torch.ones(ROWS), torch.ones(ROWS))
    contract = _contract(temperature)
    fwd, bwd = OpCounter(), OpCounter()
    active.append(fwd)
    with fwd:
        out = op(x, targets, active_rows, contract, compute_entropy=entropy, validate=validate,
                 **({} if row_temperature is None else {"temperature": row_temperature}))
    active[-1] = bwd
    with bwd:
        torch.autograd.grad((out.selected_logp, out.lse), x, grads)
    active.pop()
    return fwd, bwd


# (entropy, validate, temperature): (forward ops, forward syncs, backward ops, backward syncs). At
# TP = 1 the forward is two launches (the partials, the merge), the backward four (its terms, the
# whole blocks, the last block, the target column); every other operation allocates, views or
# detaches (no device work), but for the validated forward's one read of the flags (any, then the
# host read).
PINNED: dict[tuple[bool, bool, float], tuple[int, int, int, int]] = {
    (False, False, 1.0): (13, 0, 17, 0),
    (False, True, 1.0): (17, 1, 17, 0),
    (True, False, 1.0): (14, 0, 17, 0),
    (True, True, 1.0): (18, 1, 17, 0),
    (False, False, 0.7): (13, 0, 17, 0),
    (True, True, 0.7): (18, 1, 17, 0),
}
# aten operations that compute on the device (a launch each on CUDA): none on the Triton path
DEVICE_FREE = frozenset({"detach", "view", "empty", "empty_like", "zeros", "any", "_local_scalar_dense"})
# the Triton launches of one call at TP = 1 (one row block, one tile width), by kernel
LAUNCHES = {"forward": ["forward_partials_kernel", "merge_kernel"],
            "backward": ["backward_terms_kernel", "backward_kernel", "backward_target_kernel"]}


@pytest.mark.parametrize("case", sorted(PINNED), ids=lambda c: f"entropy{int(c[0])}-validate{int(c[1])}-T{c[2]}")
def test_host_work_per_call_is_pinned(stubbed: list[OpCounter], case: tuple[bool, bool, float]) -> None:
    entropy, validate, temperature = case
    fwd, bwd = count(stubbed, entropy, validate, temperature)
    found = (fwd.total, fwd.syncs, bwd.total, bwd.syncs)
    assert found == PINNED[case], (found, dict(fwd.ops), dict(bwd.ops))
    # no tensor from host data (on CUDA a pageable copy that waits for the stream)
    assert not {"lift_fresh", "lift_fresh_copy"} & (set(fwd.ops) | set(bwd.ops)), (dict(fwd.ops), dict(bwd.ops))
    # and nothing that computes on the device outside the kernels (zeros: the flags' fill)
    assert set(fwd.ops) | set(bwd.ops) <= DEVICE_FREE, (dict(fwd.ops), dict(bwd.ops))


def test_the_launches_per_call(stubbed: list[OpCounter], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Triton launches per forward and three per backward at TP = 1 (docs/performance.md): its
    terms, the masked block (1,024 columns: no whole block of 2,048, which a wide shard adds as a
    fourth launch) and the target column."""
    launched: list[str] = []
    monkeypatch.setattr(triton_backend.Launch, "run", lambda self, kernels: launched.append(self.kernel))
    op = TritonLogprob(mode="interpreter")
    x = torch.zeros(ROWS, 1024 + 100, dtype=torch.bfloat16, requires_grad=True)[:, :1024]
    out = op(x, torch.arange(ROWS) * 100, torch.ones(ROWS, dtype=torch.bool), _contract(), compute_entropy=True)
    assert launched == LAUNCHES["forward"]
    launched.clear()
    torch.autograd.grad((out.selected_logp, out.lse), x, (torch.ones(ROWS), torch.ones(ROWS)))
    assert sorted(set(launched)) == sorted(LAUNCHES["backward"]) and len(launched) == 3, launched


def test_no_host_sync_without_validation_and_one_with_it(stubbed: list[OpCounter]) -> None:
    for entropy in (False, True):
        fwd, bwd = count(stubbed, entropy, validate=False)
        assert fwd.syncs == 0 and bwd.syncs == 0, (dict(fwd.ops), dict(bwd.ops))
        fwd, bwd = count(stubbed, entropy, validate=True)
        assert fwd.syncs == 1 and fwd.ops["_local_scalar_dense"] == 1 and bwd.syncs == 0, dict(fwd.ops)


def test_the_counter_sees_an_added_item(stubbed: list[OpCounter], monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a ``bool()`` on a tensor inside the forward is one more sync."""
    real = triton_backend.triton_forward

    def with_sync(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        bool(found[0].isnan().any())
        return found

    monkeypatch.setattr(triton_backend, "triton_forward", with_sync)
    fwd, _ = count(stubbed, entropy=False, validate=False)
    assert fwd.syncs == 1


def test_the_counter_sees_an_added_tolist(stubbed: list[OpCounter], monkeypatch: pytest.MonkeyPatch) -> None:
    real = triton_backend.triton_forward

    def with_tolist(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        found[0].tolist()
        return found

    monkeypatch.setattr(triton_backend, "triton_forward", with_tolist)
    fwd, _ = count(stubbed, entropy=False, validate=False)
    assert fwd.syncs == 1 and fwd.ops["tolist"] == 1


@pytest.mark.parametrize("bad", [-1, 1000, 1023])
def test_the_joined_check_still_names_an_out_of_range_target(live: list[OpCounter], bad: int) -> None:
    """At TP = 1 the targets' range is checked in the forward's one sync (the merge kernel's flags,
    the kernels run): same refusal, same text; without validation nothing is read."""
    targets = torch.arange(ROWS, dtype=torch.int64) * 100
    targets[3] = bad
    with pytest.raises(LogprobContractError, match=rf"targets\[3\]={bad} .*outside \[0, real_vocab_size=1000\)"):
        count(live, entropy=False, validate=True, targets=targets)
    fwd, _ = count(live, entropy=False, validate=False, targets=targets)  # unvalidated: not read
    assert fwd.syncs == 0
    live.clear()
    fwd, bwd = count(live, entropy=True, validate=True)  # valid inputs, the kernels run: one sync
    assert (fwd.syncs, bwd.syncs) == (1, 0)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_owner_rank_builds_no_tensor_from_host_data(tp: int) -> None:
    """At TP > 1 the target's owner is counted against the shard ends as Python integers: the
    ranks ``searchsorted`` over a tensor of the ends gives (out-of-range targets clamped), with no
    ``lift_fresh`` (a tensor from host data: on CUDA a pageable copy that waits for the stream)."""
    from rl_engine.logprob.backends.eager.vocab_parallel import _owner_rank

    contract = LogprobContract(real_vocab_size=1000, padded_vocab_size=1024, num_vocab_tiles=16, num_sequences=1,
                               seq_len=1, tp_world_size=tp, tp_rank=0)
    targets = torch.arange(-5, 1024 + 5)
    with OpCounter() as ops:
        got = _owner_rank(targets, contract)
    assert not {"lift_fresh", "lift_fresh_copy", "_to_copy", "searchsorted"} & set(ops.ops), dict(ops.ops)
    assert ops.syncs == 0
    ends = torch.tensor([end for _, end in contract.vocab_shard_bounds])
    want = torch.searchsorted(ends, targets.clamp(0, 1023), right=True).clamp(0, tp - 1)
    assert got.numpy().tobytes() == want.numpy().tobytes()


def test_a_temperature_per_row_adds_no_host_sync_without_validation(stubbed: list[OpCounter]) -> None:
    """The per-row temperatures' values are checked on the host only when validating (as the
    targets' range is): without validation the call stays free of host round trips."""
    temps = torch.full((ROWS,), 0.7)
    for entropy in (False, True):
        fwd, bwd = count(stubbed, entropy, validate=False, row_temperature=temps)
        assert fwd.syncs == 0 and bwd.syncs == 0, (dict(fwd.ops), dict(bwd.ops))
        fwd, _ = count(stubbed, entropy, validate=True, row_temperature=temps)
        assert fwd.syncs >= 2, dict(fwd.ops)  # the temperatures' check reads too (negative control)
