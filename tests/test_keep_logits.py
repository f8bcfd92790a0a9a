"""``keep_logits=True``: the fused head keeps its forward's logits and its backward makes none again.

The claim: outputs and every gradient are the bytes of the recomputing backward (``keep_logits=False``),
compared as SHA-256 of the bytes, in fp32 and bf16, with and without the entropy's gradient, at a
temperature, a temperature per row, with the processed logprob (top-k, top-p, min-p), with masked
(inactive) rows, under autocast, with the library's product, with the weight's gradient summed in
the compute dtype, and when only one input wants a gradient; and the backward makes no product (the
product is counted). Negative controls: a kept logit raised by 1 changes the gradients' bytes
(the backward reads what was kept), and the recomputing backward makes one product per chunk. The
registered op under ``torch.compile`` is in ``tests/test_trainer_compile.py``; TP and DTensor
weights are in ``tests/test_from_hidden.py``'s gloo ranks.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import pytest
import torch

import rl_engine.logprob.hidden_chunks as hidden_chunks
from rl_engine.logprob import selected_logprob_from_hidden
from rl_engine.logprob.contract import LogprobContractError
from rl_engine.logprob.op_settings import HeadOpSettings
from rl_engine.tensorio import tensor_bytes

from _head_products import count_products

VOCAB, REAL, HIDDEN, CHUNK = 512, 500, 32, 7


def _sha(t: torch.Tensor | None) -> str | None:
    return None if t is None else hashlib.sha256(tensor_bytes(t.detach())).hexdigest()


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(45)
    hidden = torch.randn(2, 19, HIDDEN, generator=gen).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.4).to(dtype)
    ids = torch.randint(0, REAL, (2, 19), generator=gen)
    ids[0, :4] = -100  # a prompt: inactive rows
    ids[1, 9:12] = -100
    return hidden, weight, ids


def _run(dtype: torch.dtype, keep: bool, *, entropy_grad: bool = True, want: tuple[bool, bool] = (True, True),
         autocast: bool = False, **options: Any) -> dict[str, str | None]:
    """The SHA-256 of every output and gradient of one forward+backward."""
    hidden, weight, ids = _inputs(dtype)
    hidden.requires_grad_(want[0])
    weight.requires_grad_(want[1])
    compute_entropy = options.pop("compute_entropy", True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = selected_logprob_from_hidden(hidden, weight, ids, real_vocab_size=REAL, compute_entropy=compute_entropy,
                                           chunk_tokens=CHUNK, keep_logits=keep, **options)
    loss = (out.selected_logp * 0.75).sum() + 0.125 * out.lse.sum()
    if entropy_grad:
        loss = loss - 0.01 * out.entropy.sum()
    loss.backward()
    assert out.provenance["keep_logits"] == {"requested": keep, "kept": keep}
    return {"logp": _sha(out.selected_logp), "lse": _sha(out.lse), "entropy": _sha(out.entropy),
            "target_kept": _sha(out.target_kept), "grad_hidden": _sha(hidden.grad), "grad_weight": _sha(weight.grad)}


def _row_temperature() -> torch.Tensor:
    return 0.5 + torch.rand(2, 19, generator=torch.Generator().manual_seed(3))


CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "no entropy gradient": {"entropy_grad": False},
    "no entropy": {"entropy_grad": False, "compute_entropy": False},
    "temperature 0.7": {"temperature": 0.7},
    "a temperature per row": {"temperature": "rows"},
    "processed (top-k, top-p, min-p) at 0.7": {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.01},
    "weight gradient in the compute dtype": {"grad_weight_fp32": False},
    "the library's product": {"matmul": "library"},
    "hidden's gradient only": {"want": (True, False)},
    "the weight's gradient only": {"want": (False, True)},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_kept_logits_give_the_recomputing_backward_s_bytes(case: str, dtype: torch.dtype) -> None:
    options = dict(CASES[case])
    if options.get("temperature") == "rows":
        options["temperature"] = _row_temperature()
    recomputed = _run(dtype, False, **options)
    kept = _run(dtype, True, **options)
    assert kept == recomputed
    want = options.get("want", (True, True))
    assert (recomputed["grad_hidden"] is not None, recomputed["grad_weight"] is not None) == want


def test_under_autocast_the_kept_bf16_logits_give_the_recomputing_bytes() -> None:
    """fp32 inputs under bf16 autocast: the logits (kept or made again) are bf16; the gradients come
    back in fp32, the same bytes."""
    assert _run(torch.float32, True, autocast=True) == _run(torch.float32, False, autocast=True)
    assert _run(torch.float32, True, autocast=True)["logp"] != _run(torch.float32, True)["logp"]  # bf16 logits


def test_the_backward_makes_no_product_with_kept_logits_and_one_per_chunk_without(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_products(monkeypatch)
    hidden, weight, ids = _inputs(torch.float32)
    active = int((ids != -100).sum())
    chunks = -(-active // CHUNK)
    for keep, backward_products in ((True, 0), (False, chunks)):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = selected_logprob_from_hidden(h, w, ids, real_vocab_size=REAL, chunk_tokens=CHUNK, keep_logits=keep)
        assert len(calls) == chunks and sum(calls) == active
        calls.clear()
        out.selected_logp.sum().backward()
        assert len(calls) == backward_products, keep
        calls.clear()


def test_nothing_is_kept_without_a_gradient_wanted() -> None:
    hidden, weight, ids = _inputs(torch.float32)
    with torch.no_grad():
        out = selected_logprob_from_hidden(hidden, weight.requires_grad_(True), ids, real_vocab_size=REAL,
                                           keep_logits=True)
    assert out.provenance["keep_logits"] == {"requested": True, "kept": False}
    plain = selected_logprob_from_hidden(hidden, weight.detach(), ids, real_vocab_size=REAL, keep_logits=True)
    assert plain.provenance["keep_logits"] == {"requested": True, "kept": False}


def test_negative_control_a_changed_kept_logit_changes_the_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward reads the kept logits: one of them raised by 1 after the forward used it gives
    other gradient bytes (and the same forward bytes)."""
    recomputed = _run(torch.float32, False)
    real = hidden_chunks.forward_chunks

    def nudged(*args: Any) -> Any:
        logp, lse, entropy, kept, logits = real(*args)
        logits[0, 5] += 1.0
        return logp, lse, entropy, kept, logits

    monkeypatch.setattr("rl_engine.logprob.hidden.forward_chunks", nudged)
    changed = _run(torch.float32, True)
    assert changed["logp"] == recomputed["logp"] and changed["lse"] == recomputed["lse"]
    assert changed["grad_hidden"] != recomputed["grad_hidden"] and changed["grad_weight"] != recomputed["grad_weight"]


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_bad_keep_logits_is_refused_by_name(value: Any) -> None:
    hidden, weight, ids = _inputs(torch.float32)
    with pytest.raises(LogprobContractError, match=re.escape(f"keep_logits={value!r} must be True")):
        selected_logprob_from_hidden(hidden, weight, ids, real_vocab_size=REAL, keep_logits=value)
    fields = dict(real_vocab_size=REAL, num_vocab_tiles=4, ignore_index=-100, compute_entropy=False, validate=True,
                  backend="auto", chunk_tokens=CHUNK, grad_weight_fp32=True, temperature=1.0, matmul="auto",
                  autocast=None)
    with pytest.raises(LogprobContractError, match=re.escape(f"keep_logits={value!r} must be True or False")):
        HeadOpSettings(**fields, keep_logits=value)


def test_the_backward_refuses_kept_logits_that_are_not_the_forward_s() -> None:
    hidden, weight, ids = _inputs(torch.float32)
    from rl_engine.logprob.hidden import BACKWARD_OP  # noqa: F401 - registers the ops
    from rl_engine.logprob.op_settings import HeadGradSettings

    fields = dict(real_vocab_size=REAL, num_vocab_tiles=4, ignore_index=-100, compute_entropy=False, validate=True,
                  backend="auto", chunk_tokens=CHUNK, grad_weight_fp32=True, temperature=1.0, matmul="auto",
                  autocast=None, keep_logits=True)
    settings = HeadGradSettings(HeadOpSettings(**fields), True, True).encode()
    lse = torch.zeros(2, 19)
    wrong = torch.zeros(3, VOCAB)
    with pytest.raises(LogprobContractError, match=re.escape("the kept logits (3, 512) torch.float32 are not the "
                                                             "forward's: [31 active rows, 512 columns]")):
        torch.ops.rl_engine.selected_logprob_from_hidden_backward(
            hidden, weight, ids, None, lse, lse.new_empty(0), torch.ones(2, 19), None, None, None, wrong, settings)
