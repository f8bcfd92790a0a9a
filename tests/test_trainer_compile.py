"""``torch.compile(fullgraph=True)`` of a trainer step that calls ``selected_logprob``.

The call is one registered op under compilation (``rl_engine::selected_logprob`` with a fake
implementation and a registered backward), so the graph has no break; its real implementation
is the eager call, so the loss and the gradient are the eager bytes and a bad input raises the
eager error. The backend is ``aot_eager`` (AOTAutograd traces the fake and the backward; inductor
would spend a minute compiling C++ on this machine and adds nothing the op's registration needs).
"""

from __future__ import annotations

import re

import pytest
import torch

from rl_engine.logprob import selected_logprob
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.registry import dispatch
from rl_engine.tensorio import tensor_bytes


def _step(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = selected_logprob(logits, ids, mask, real_vocab_size=1000, compute_entropy=True)
    assert out.entropy is not None
    return -(out.selected_logp * 0.5).sum() + (out.lse * 0.25).sum() + 0.0 * out.entropy.sum()


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(2, 6, 1024, generator=gen) * 3).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (2, 6), generator=gen, dtype=torch.int32)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    return logits, ids, mask


def test_a_compiled_trainer_step_has_no_graph_break_and_gives_the_eager_bytes() -> None:
    torch._dynamo.reset()
    logits, ids, mask = _inputs()
    eager_x = logits.clone().requires_grad_(True)
    eager = _step(eager_x, ids, mask)
    eager.backward()
    compiled_x = logits.clone().requires_grad_(True)
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager")(compiled_x, ids, mask)
    compiled.backward()
    assert eager_x.grad is not None and compiled_x.grad is not None
    assert tensor_bytes(compiled) == tensor_bytes(eager)
    assert tensor_bytes(compiled_x.grad) == tensor_bytes(eager_x.grad)
    assert bool((compiled_x.grad != 0).any())


def test_a_bad_input_raises_the_eager_error_from_the_compiled_step() -> None:
    torch._dynamo.reset()
    logits, ids, mask = _inputs()
    step = torch.compile(_step, fullgraph=True, backend="aot_eager")
    bad = ids.clone()
    bad[1, 3] = 5000
    with pytest.raises(LogprobContractError, match=re.escape("targets[9]=5000 (global token 9) is an active target")):
        step(logits, bad, mask)
    two = mask.clone()
    two[0, 4] = 2
    with pytest.raises(LogprobContractError, match=re.escape("active[0, 4]=2 is not 0 or 1")):
        step(logits, ids, two)


def test_negative_control_the_unregistered_op_breaks_the_full_graph() -> None:
    """The TP op called directly holds host reads (the checks): fullgraph refuses it, which is
    what the registered op avoids."""
    torch._dynamo.reset()
    logits, ids, mask = _inputs()
    contract = LogprobContract(1000, 1024, 8, 1, 12)
    op = dispatch("pytorch-vocab-parallel-logp-ws2", contract, "cpu").op

    def direct(x: torch.Tensor) -> torch.Tensor:
        return op(x, ids.reshape(-1).long(), mask.reshape(-1) == 1, contract).selected_logp.sum()

    with pytest.raises(Exception, match="(?i)graph break|unsupported"):
        torch.compile(direct, fullgraph=True, backend="aot_eager")(logits.reshape(12, 1024))


def test_chunk_rows_reaches_the_compiled_call() -> None:
    """The compiled call passes ``chunk_rows`` to the eager one: a bad value is refused there, and a
    good one gives the default's bytes (the chunk size never changes the bytes)."""
    torch._dynamo.reset()
    logits, ids, mask = _inputs()

    def step(x: torch.Tensor, rows: int) -> torch.Tensor:
        return selected_logprob(x, ids, mask, real_vocab_size=1000, chunk_rows=rows).selected_logp

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=False)
    assert tensor_bytes(compiled(logits, 3)) == tensor_bytes(step(logits, 5))
    with pytest.raises(LogprobContractError, match="chunk_rows"):
        compiled(logits, 0)


def test_a_temperature_reaches_the_compiled_call_and_its_gradient() -> None:
    """``temperature`` goes through the registered op and its backward: the compiled step's loss and
    gradient at ``T = 0.7`` are the eager step's bytes at ``T = 0.7``, not those at 1."""
    torch._dynamo.reset()
    logits, ids, mask = _inputs()

    def step(x: torch.Tensor, temperature: float) -> torch.Tensor:
        out = selected_logprob(x, ids, mask, real_vocab_size=1000, temperature=temperature)
        return -(out.selected_logp * 0.5).sum() + (out.lse * 0.25).sum()

    eager_x = logits.clone().requires_grad_(True)
    eager = step(eager_x, 0.7)
    eager.backward()
    compiled_x = logits.clone().requires_grad_(True)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=False)(compiled_x, 0.7)
    compiled.backward()
    assert tensor_bytes(compiled) == tensor_bytes(eager)
    assert tensor_bytes(compiled_x.grad) == tensor_bytes(eager_x.grad)
    assert tensor_bytes(step(logits, 1.0)) != tensor_bytes(eager)
