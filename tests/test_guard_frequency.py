"""The host count of the guard's IEEE path (``rl_engine.logprob.backends.triton.guard``) is the kernels' own.

Under Triton's interpreter the kernels' device functions are module attributes looked up at each
call, so a wrapper counts the programs that really run the IEEE path: the forward's
``pass_two(..., DIV_IEEE)`` (a tile computed again) and the backward's ``column_grad(..., DIV_IEEE)``
(a block computed again). :func:`guard_counts` must give the same numbers on rows built to take each
branch (real ``-inf`` logits, logits below the division's domain, quotients that overflow,
gradients below the domain or overflowing, with the entropy's gradient and without) and on
ordinary rows, in bf16 and binary32. Ordinary rows take no forward tile there, but the backward's
last block fires on rows whose padding columns hold large logits (100 here: ``E(100 / 0.7 - LSE)``
overflows, so ``|g|`` reaches the guard's bound, though the kernel writes ``+0`` there): the
"padding lanes", counted, not yet excluded from the guard. ``gpu-smoke`` reports these counts on the timing
inputs (``smoke.json``'s ``guard``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # the test extra installs it: CI never skips

from rl_engine.logprob.backends.eager.vocab_parallel import backward_terms  # noqa: E402
from rl_engine.logprob.backends.triton.guard import GuardCountError, guard_counts  # noqa: E402
from rl_engine.logprob.backends.triton.triton_backend import TritonLogprob, load_kernels  # noqa: E402
from rl_engine.logprob.contract import LogprobContract  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
REAL, PADDED, ROWS, TILES = 2300, 2304, 8, 4  # one whole backward block of 2,048 and a masked one


def _inputs(dtype: str, edges: bool) -> tuple[torch.Tensor, ...]:
    """Logits, targets, mask and upstream gradients; with ``edges`` rows that take each branch:
    0 real ``-inf`` logits; 1 logits below the domain with a tiny maximum; 3 a quotient overflowing
    at T = 0.25; 5 a gradient below the domain; 7 one that overflows (rows 0, 1, 3 inactive)."""
    g = torch.Generator().manual_seed(23)
    x = torch.randn(ROWS, PADDED, generator=g) * 3
    x[:, REAL:] = 100.0
    active = torch.ones(ROWS, dtype=torch.bool)
    w_logp, w_lse = torch.randn(ROWS, generator=g), torch.randn(ROWS, generator=g)
    if edges:
        x[0, 10:40] = float("-inf")
        tiny = torch.from_numpy(((np.arange(REAL, dtype=np.uint32) * 9973 % 0x01000000) | 0x00400000).view(np.float32))
        x[1, :REAL] = torch.where(torch.arange(REAL) % 2 == 0, tiny, -tiny)
        x[3, 2100:2110] = -3.0e38
        active[[0, 1, 3]] = False
        w_lse[5], w_logp[5] = 3e-37, 1e-38
        w_lse[7], w_logp[7] = 3e38, -3e38
    targets = torch.randint(0, REAL, (ROWS,), generator=g)
    return x.to(DTYPES[dtype]), targets, active, w_logp, w_lse


def _kernel_counts(monkeypatch: pytest.MonkeyPatch, x: torch.Tensor, targets: torch.Tensor, active: torch.Tensor,
                   w_logp: torch.Tensor, w_lse: torch.Tensor, contract: LogprobContract,
                   entropy_grad: bool) -> tuple[dict[str, int], Any]:
    """The programs that run the IEEE path under the interpreter, and the call's forward outputs."""
    kernels = load_kernels("interpreter")
    counts = {"forward": 0, "backward": 0}
    for name, phase in (("pass_two", "forward"), ("column_grad", "backward")):
        real = getattr(kernels, name)

        def counting(*args: Any, _real: Any = real, _phase: str = phase) -> Any:
            if int(args[-1]) == int(kernels.DIV_IEEE):
                counts[_phase] += 1
            return _real(*args)

        monkeypatch.setattr(kernels, name, counting)
    leaf = x.clone().requires_grad_(True)
    out = TritonLogprob(mode="interpreter")(leaf, targets, active, contract, compute_entropy=True)
    outputs = (out.selected_logp, out.lse) + ((out.entropy,) if entropy_grad else ())
    grads = (w_logp, w_lse) + ((torch.linspace(-1, 1, ROWS),) if entropy_grad else ())
    torch.autograd.grad(outputs, leaf, grads)
    return counts, out


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("edges", [True, False], ids=["edge-rows", "ordinary-rows"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_host_count_is_the_kernels_count(dtype: str, edges: bool, entropy_grad: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    temperature = 0.25 if edges else 0.7
    x, targets, active, w_logp, w_lse = _inputs(dtype, edges)
    contract = LogprobContract(real_vocab_size=REAL, padded_vocab_size=PADDED, num_vocab_tiles=TILES,
                               num_sequences=1, seq_len=ROWS, logits_dtype=dtype, temperature=temperature)
    kernel, out = _kernel_counts(monkeypatch, x, targets, active, w_logp, w_lse, contract, entropy_grad)
    g_ent = torch.linspace(-1, 1, ROWS) if entropy_grad else None
    terms = backward_terms(x, targets, active, out.lse.detach(), w_logp, w_lse, contract, g_ent,
                           out.entropy.detach())
    found = guard_counts(x, contract, out.lse.detach(), terms.coef, terms.g_ent, terms.mb)
    assert (found.forward_ieee, found.backward_ieee) == (kernel["forward"], kernel["backward"]), (found, kernel)
    assert found.forward_tiles == ROWS * TILES and found.backward_blocks == ROWS * 2
    if edges:  # the built branches fire: rows 0, 1, 3 forward; rows 0, 3, 5, 7 backward at least
        assert found.forward_ieee >= 3 and found.backward_ieee >= 4, found
    else:  # ordinary logits: no tile; the blocks of the padding columns (100 / 0.7: E overflows), some
        assert found.forward_ieee == 0 and 0 < found.backward_ieee <= ROWS, found
    shares = found.to_dict()
    assert shares["forward_share"] == found.forward_ieee / (ROWS * TILES)


def test_no_temperature_has_nothing_to_count() -> None:
    x, targets, active, _, _ = _inputs("bf16", False)
    contract = LogprobContract(real_vocab_size=REAL, padded_vocab_size=PADDED, num_vocab_tiles=TILES,
                               num_sequences=1, seq_len=ROWS, logits_dtype="bf16")
    with pytest.raises(GuardCountError, match="temperature=1: no division"):
        guard_counts(x, contract, torch.zeros(ROWS), torch.zeros(ROWS))
