"""verl's logprob-and-entropy call site in one pass (rl_engine/integrations/verl.py).

verl's actor calls ``logprobs_from_logits`` then ``entropy_from_logits`` on the same logits.
``logprobs_and_entropy_from_logits`` gives both from one call of the op: the same bytes as the two
drop-ins, the gradient of a loss that uses both in one backward, and, on request, verl's output dtype
(the logits'). The time it saves is measured in docs/performance.md, not here (no timing is a test).
"""

from __future__ import annotations

import pytest
import torch
from _doc_blocks import run_trainer_block

from rl_engine.integrations.verl import entropy_from_logits, logprobs_and_entropy_from_logits, logprobs_from_logits
from rl_engine.logprob.contract import LogprobContractError
from rl_engine.tensorio import tensor_bytes

VOCAB, REAL = 1024, 1000
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _inputs(dtype: torch.dtype, seed: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 7, VOCAB, generator=g) * 3).to(dtype)
    labels = torch.randint(0, REAL, (3, 7), generator=g)
    advantages = torch.randn(3, 7, generator=g)
    return logits, labels, advantages


@pytest.mark.parametrize("cast", [False, True], ids=["float32", "logits-dtype"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_one_call_gives_the_bytes_of_the_two_calls(dtype: str, temperature: float, cast: bool) -> None:
    logits, labels, _ = _inputs(DTYPES[dtype])
    options = {"temperature": temperature, "real_vocab_size": REAL, "cast_to_logits_dtype": cast}
    logp, entropy = logprobs_and_entropy_from_logits(logits, labels, **options)
    assert tensor_bytes(logp) == tensor_bytes(logprobs_from_logits(logits, labels, **options))
    assert tensor_bytes(entropy) == tensor_bytes(entropy_from_logits(logits, **options))
    assert logp.dtype == entropy.dtype == (DTYPES[dtype] if cast else torch.float32)
    assert logp.shape == entropy.shape == labels.shape


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_outputs_in_the_logits_dtype_are_the_float32_ones_rounded_once(dtype: str) -> None:
    logits, labels, _ = _inputs(DTYPES[dtype])
    wide = logprobs_and_entropy_from_logits(logits, labels, real_vocab_size=REAL)
    narrow = logprobs_and_entropy_from_logits(logits, labels, real_vocab_size=REAL, cast_to_logits_dtype=True)
    for w, n in zip(wide, narrow):
        assert tensor_bytes(n) == tensor_bytes(w.to(DTYPES[dtype]))


def _grad(loss_of, logits: torch.Tensor) -> torch.Tensor:
    leaf = logits.detach().clone().requires_grad_(True)
    loss_of(leaf).backward()
    assert leaf.grad is not None
    return leaf.grad


@pytest.mark.parametrize("cast", [False, True], ids=["float32", "logits-dtype"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_gradient_flows_through_both_outputs_in_one_backward(dtype: str, cast: bool) -> None:
    """Each output alone gives its separate call's gradient bytes (an unused output adds nothing);
    both together give one backward whose gradient is float64 autograd's within one rounding to the
    logits' dtype plus the arithmetic's binary32 error (4e-6 of the largest term, docs/trainer.md).
    The two calls' gradients are rounded each, then added: a second rounding the one call has not."""
    logits, labels, adv = _inputs(DTYPES[dtype])
    opts = {"temperature": 0.7, "real_vocab_size": REAL, "cast_to_logits_dtype": cast}
    both = lambda x: logprobs_and_entropy_from_logits(x, labels, **opts)
    policy = lambda logp: -(adv * logp.float()).sum()
    bonus = lambda entropy: -0.01 * entropy.float().sum()
    assert tensor_bytes(_grad(lambda x: policy(both(x)[0]), logits)) == \
        tensor_bytes(_grad(lambda x: policy(logprobs_from_logits(x, labels, **opts)), logits))
    assert tensor_bytes(_grad(lambda x: bonus(both(x)[1]), logits)) == \
        tensor_bytes(_grad(lambda x: bonus(entropy_from_logits(x, **opts)), logits))
    together = _grad(lambda x: policy(both(x)[0]) + bonus(both(x)[1]), logits)
    assert tensor_bytes(together) != tensor_bytes(_grad(lambda x: policy(both(x)[0]), logits))  # the entropy counts

    # float64 reference at the same temperature (the arithmetic multiplies by RN32(1 / RN32(0.7)))
    r = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(0.7, dtype=torch.float32))
    x64 = logits.double().requires_grad_(True)
    logp64 = torch.log_softmax(x64[..., :REAL] * r, -1)
    entropy64 = -(logp64.exp() * logp64).sum(-1)
    loss64 = -(adv.double() * logp64.gather(-1, labels[..., None])[..., 0]).sum() - 0.01 * entropy64.sum()
    loss64.backward()
    assert x64.grad is not None
    ulp = torch.finfo(DTYPES[dtype]).eps * x64.grad.abs()
    err = (together.double() - x64.grad).abs()
    assert bool((err <= ulp + 4e-6 * x64.grad.abs().max()).all())


def test_a_bad_cast_flag_is_refused_by_name() -> None:
    logits, labels, _ = _inputs(torch.float32)
    for call in (lambda: logprobs_and_entropy_from_logits(logits, labels, cast_to_logits_dtype="bf16"),
                 lambda: logprobs_from_logits(logits, labels, cast_to_logits_dtype=1),
                 lambda: entropy_from_logits(logits, cast_to_logits_dtype=None)):
        with pytest.raises(LogprobContractError, match="cast_to_logits_dtype=.* must be True or False"):
            call()


def test_the_documented_call_site_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    run_trainer_block("<!-- run by tests/test_verl.py -->")
    assert capsys.readouterr().out.strip() == "torch.float32 torch.bfloat16 torch.Size([6]) torch.Size([6])"
