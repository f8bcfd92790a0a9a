"""The backend's real-column finiteness check, and the GRPO loss refusing non-finite logits.

``real_rows_finite`` is the stand-alone form of what the backend's forward checks with
``validate=True``. The GRPO loss reads the logits once: it runs the op with ``validate=True,
on_invalid="nan"`` (the forward's own check, in the pass that reads the logits, gives an invalid
active row a NaN logp) and refuses a NaN active logp after the global gather, where every rank
holds it. Checked here against an independent oracle on the full logits for every TP shard
(shards with partial and with no real columns), against the backend's own ``validate=True``
verdict and its ``on_invalid="nan"`` rows, and through the loss: non-finite padding changes
nothing, a non-finite real column is refused (negative control), and no aten operation of the
loss reads the logits but the op's one-element-per-row ``gather`` of the target logit (a
negative control puts the stand-alone check back and sees its ``aminmax``).
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rl_engine.grpo import GRPOContract, GRPOContractError, GRPOLoss
from rl_engine.logprob.backends.eager.vocab_parallel import VocabParallelLogprob, real_local_columns, real_rows_finite
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.tables import EAGER_BACKEND, FUSED_CPU_BACKEND
from rl_engine.tensorio import fingerprint, tensor_bytes

PADDED, TILES = 512, 8
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BAD_VALUES = (float("nan"), float("inf"), float("-inf"))


def _contract(real: int, tp: int, rank: int, dtype: str = "fp32", rows: int = 1) -> LogprobContract:
    return LogprobContract(real_vocab_size=real, padded_vocab_size=PADDED, num_vocab_tiles=TILES,
                           num_sequences=rows, seq_len=1, tp_world_size=tp, tp_rank=rank, logits_dtype=dtype)


def _poisoned(real: int, dtype: torch.dtype) -> torch.Tensor:
    """Full logits, one row per (column, bad value) at the edges of every shard and of the real range."""
    columns = sorted({0, real - 1, min(real, PADDED - 1), PADDED - 1}
                     | {edge + d for edge in range(0, PADDED, PADDED // 4) for d in (-1, 0) if 0 <= edge + d < PADDED})
    rows = [(c, v) for c in columns for v in BAD_VALUES]
    full = torch.randn(len(rows) + 1, PADDED, generator=torch.Generator().manual_seed(3)).to(dtype)  # + one clean row
    for i, (column, value) in enumerate(rows):
        full[i, column] = value
    return full


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("real", [500, 100, 512])
def test_real_rows_finite_matches_an_oracle_on_every_shard(real: int, dtype: str) -> None:
    full = _poisoned(real, DTYPES[dtype])
    seen_partial = seen_empty = False
    for tp in (1, 2, 4):
        for rank in range(tp):
            contract = _contract(real, tp, rank, dtype, rows=full.shape[0])
            start, end = contract.vocab_start, contract.vocab_end
            expected = torch.isfinite(full[:, start:min(end, real)].float()).all(dim=1)  # empty slice -> True
            got = real_rows_finite(full[:, start:end], contract)
            assert got.dtype == torch.bool and got.tolist() == expected.tolist(), (real, tp, rank)
            assert real_local_columns(contract) == max(0, min(end, real) - start)
            seen_partial |= 0 < real_local_columns(contract) < end - start
            seen_empty |= real_local_columns(contract) == 0
            assert bool(got[-1])  # the clean row
    assert seen_partial == (real % (PADDED // 4) != 0) and seen_empty == (real <= PADDED // 2)


@pytest.mark.parametrize("real", [500, 512])
def test_real_rows_finite_agrees_with_the_backends_validation(real: int) -> None:
    """TP=1: the op's validate=True refuses exactly the rows the stand-alone check flags."""
    full = _poisoned(real, torch.float32)
    contract = _contract(real, 1, 0, rows=1)
    op = VocabParallelLogprob()
    target, active = torch.tensor([0]), torch.tensor([True])
    flagged = 0
    for row in full:
        local = row.unsqueeze(0)
        finite = bool(real_rows_finite(local, contract)[0])
        flagged += not finite
        if finite:
            op(local, target, active, contract)
        else:
            with pytest.raises(LogprobContractError, match="non-finite value in its real columns"):
                op(local, target, active, contract)
    assert flagged > 0 and (real == PADDED or flagged < full.shape[0] - 1)


def _grpo_case() -> tuple[GRPOContract, dict[str, torch.Tensor]]:
    seqs, seq_len, real = 4, 6, 500
    contract = GRPOContract.build(
        logprob={"real_vocab_size": real, "padded_vocab_size": PADDED, "num_vocab_tiles": TILES,
                 "logits_dtype": "fp32"},
        num_sequences=seqs, seq_len=seq_len, group_size=2,
    )
    gen = torch.Generator().manual_seed(11)
    tokens = seqs * seq_len
    active = (torch.arange(seq_len) >= 2).repeat(seqs)
    actions = torch.where(active, torch.randint(0, real, (tokens,), generator=gen), torch.full((tokens,), -100))
    data = {
        "logits": torch.randn(tokens, PADDED, generator=gen),
        "actions": actions,
        "old": torch.where(active, -6.0 + torch.randn(tokens, generator=gen), torch.zeros(tokens)),
        "rewards": torch.tensor([1.0, 0.0, 2.0, 0.5]),
        "active": active,
    }
    return contract, data


def _loss(contract: GRPOContract, data: dict[str, torch.Tensor], logits: torch.Tensor) -> tuple[str, bytes]:
    x = logits.clone().requires_grad_()
    out = GRPOLoss()(x, data["actions"], data["old"], data["rewards"], data["active"], contract)
    out.loss.backward()
    assert x.grad is not None
    return fingerprint(out.loss), tensor_bytes(x.grad)


def test_grpo_ignores_non_finite_padding_and_refuses_a_non_finite_real_column() -> None:
    contract, data = _grpo_case()
    row = int(data["active"].nonzero()[0, 0])
    clean = _loss(contract, data, data["logits"])
    padded_nan = data["logits"].clone()
    padded_nan[:, 500:] = float("nan")  # every padding column of every row, active ones included
    assert _loss(contract, data, padded_nan) == clean
    for column in (0, 499):  # the first and the last real column: refused, naming the row
        bad = data["logits"].clone()
        bad[row, column] = float("inf")
        with pytest.raises(GRPOContractError, match=f"logits row {row} .* non-finite value in its real columns"):
            _loss(contract, data, bad)
    inactive = int((~data["active"]).nonzero()[0, 0])
    quiet = data["logits"].clone()
    quiet[inactive, 3] = float("nan")  # an inactive row's values are never read into the loss
    assert _loss(contract, data, quiet) == clean


@pytest.mark.parametrize("real", [500, 512])
def test_on_invalid_nan_gives_exactly_the_flagged_active_rows_nan(real: int) -> None:
    """``on_invalid="nan"``: NaN logp on the active rows the stand-alone check flags (and on an
    out-of-range target), the bytes of ``validate=False`` elsewhere, inactive rows untouched."""
    full = _poisoned(real, torch.float32)
    contract = LogprobContract(real_vocab_size=real, padded_vocab_size=PADDED, num_vocab_tiles=TILES,
                               num_sequences=1, seq_len=full.shape[0], logits_dtype="fp32")
    targets = torch.arange(full.shape[0]) % real
    active = torch.ones(full.shape[0], dtype=torch.bool)
    active[1] = False  # an inactive poisoned row
    targets[-1] = real  # the clean row with a target outside the real vocabulary
    op = VocabParallelLogprob()
    got = op(full, targets, active, contract, on_invalid="nan").selected_logp
    plain = op(full, targets, active, contract, validate=False).selected_logp
    expect = (active & ~real_rows_finite(full, contract))
    expect[-1] = True
    assert torch.equal(torch.isnan(got), expect) and bool(expect[:-1].any())
    keep = ~expect
    assert tensor_bytes(got[keep]) == tensor_bytes(plain[keep])
    with pytest.raises(LogprobContractError, match="on_invalid='skip' must be one of"):
        op(full, targets, active, contract, on_invalid="skip")


class _LogitsReads(TorchDispatchMode):
    """The aten operations given a tensor that shares the logits' storage."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.ptr = logits.untyped_storage().data_ptr()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat = list(args) + list((kwargs or {}).values())
        if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.ptr for a in flat):
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


# views and the op's target-logit gather (one element a row); every other read is the engine's own pass
ONE_READ_OPS = {"detach", "alias", "view", "slice", "gather", "_to_copy"}


def _logits_reads(backend: str) -> collections.Counter[str]:
    contract, data = _grpo_case()
    x = data["logits"].clone().requires_grad_()
    with _LogitsReads(x) as reads:
        GRPOLoss(backend)(x, data["actions"], data["old"], data["rewards"], data["active"], contract)
    return reads.ops


@pytest.mark.parametrize("backend", [FUSED_CPU_BACKEND, EAGER_BACKEND])
def test_grpo_reads_the_logits_once(backend: str) -> None:
    ops = _logits_reads(backend)
    if backend == FUSED_CPU_BACKEND:  # the C pass reads the logits outside aten
        assert set(ops) <= ONE_READ_OPS and ops["gather"] == 1, dict(ops)
    assert not {"aminmax", "amin", "amax", "isfinite", "min", "max"} & set(ops), dict(ops)


def test_the_logits_read_counter_sees_a_second_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the stand-alone check put back into the loss's local checks is seen."""
    import rl_engine.grpo.loss as loss

    real_check = loss._check_local_inputs

    def with_second_pass(contract: Any, logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        real_rows_finite(logits, contract.logprob)
        return real_check(contract, logits, *args, **kwargs)

    monkeypatch.setattr(loss, "_check_local_inputs", with_second_pass)
    assert _logits_reads(FUSED_CPU_BACKEND)["aminmax"] == 1
