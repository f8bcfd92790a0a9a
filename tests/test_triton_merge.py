"""The Triton merge kernel (section 6 steps 5-10 in one launch) gives the shared merge's bytes.

``merge_kernel`` replaces the merge's ~40 aten operations (``tests/test_host_syncs.py``): at TP = 1
the whole forward is the partials kernel and this one, which reads the target logit and the
validity flags itself; at TP > 1 it merges the gathered partials with the owners' target logits.
Under Triton's interpreter, compared as bytes with :meth:`LocalEngine.merge` (the definition):

* random partials of 1 to 65 tiles (powers of two and not: ``F``'s grouping for any count), with
  NaN, ``+inf`` and all ``-inf`` rows, with and without the entropy, with and without NaN rows;
* at TP = 1 with ``on_invalid="nan"``: a non-finite active row and an out-of-range target give
  the eager bytes (NaN logp on exactly those rows), with and without a temperature, and an
  out-of-range target is refused with the eager message;
* the backward's per-row terms (``backward_terms_kernel``, one launch) equal
  :func:`backward_terms`'s: with and without each upstream gradient, an expanded (stride 0) one,
  NaN on inactive rows, targets outside the shard (TP = 4, rank 1), the entropy gradient;
* negative control: the same partials merged as 7 tiles (an empty tile added: weight and terms
  ``+0``, the same terms) instead of 6 change the bytes, because ``F`` groups by the tile count
  (6 + 1 regroups; 7 + 1 would not: ``F`` on 8 with a last ``+0`` adds as ``F`` on 7).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # the test extra installs it: CI never skips

from rl_engine.logprob.backends.eager.vocab_parallel import EAGER_ENGINE, VocabParallelLogprob, backward_terms  # noqa: E402
from rl_engine.logprob.backends.triton.triton_backend import TritonEngine, TritonLogprob  # noqa: E402
from rl_engine.logprob.contract import LogprobContract, LogprobContractError  # noqa: E402
from rl_engine.tensorio import tensor_bytes  # noqa: E402

from _byte_cases import _contract, _inputs, _run  # noqa: E402

INTERP = "interpreter"
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")


def _partials(rows: int, tiles: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``(m, s, t, target_logit, active)`` shaped like a forward's: ``s`` in ``[1, 128]``, ``t`` any
    sign, the target near the maxima; row 0 all ``-inf`` tiles, row 1 a NaN tile, row 2 a ``+inf``
    maximum, row 3 a ``-inf`` tile among finite ones."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, tiles, generator=g) * 4
    s = 1 + torch.rand(rows, tiles, generator=g) * 127
    t = torch.randn(rows, tiles, generator=g) * 30
    target = m.amax(dim=1) - torch.rand(rows, generator=g) * 3
    m[0], s[0], t[0] = float("-inf"), 0.0, 0.0
    m[1, tiles // 2] = float("nan")
    m[2, 0] = float("inf")
    if tiles > 1:
        m[3, -1], s[3, -1], t[3, -1] = float("-inf"), 0.0, 0.0
    active = torch.ones(rows, dtype=torch.bool)
    active[::5] = False
    return m, s, t, target, active


@pytest.mark.parametrize("tiles", [1, 2, 3, 7, 8, 48, 64, 65])
def test_the_merge_kernel_is_the_shared_merge(tiles: int) -> None:
    triton = TritonEngine(INTERP)
    m, s, t, target, active = _partials(21, tiles, seed=tiles)
    poisoned = torch.zeros(21, dtype=torch.bool)
    poisoned[[4, 7]] = True
    for entropy in (True, False):
        for poison in (None, poisoned):
            want = EAGER_ENGINE.merge(m, s, t if entropy else None, target, active, poison)
            got = triton.merge(m, s, t if entropy else None, target, active, poison)
            for name, a, b in zip(("logp", "lse", "entropy"), want, got):
                assert (a is None) == (b is None), name
                if a is not None:
                    assert tensor_bytes(b) == tensor_bytes(a), (name, entropy, poison is not None)


def test_negative_control_the_fold_groups_by_the_tile_count() -> None:
    triton = TritonEngine(INTERP)
    rows = 400
    m, s, t, target, active = _partials(rows, 6, seed=5)
    pad = torch.full((rows, 1), float("-inf"))  # a tile with no column: weight +0, terms +0
    zero = torch.zeros(rows, 1)
    m7, s7, t7 = torch.cat([m, pad], 1), torch.cat([s, zero], 1), torch.cat([t, zero], 1)
    six = [tensor_bytes(v) for v in triton.merge(m, s, t, target, active, None)[1:]]
    seven = [tensor_bytes(v) for v in triton.merge(m7, s7, t7, target, active, None)[1:]]
    assert six != seven
    assert [tensor_bytes(v) for v in EAGER_ENGINE.merge(m7, s7, t7, target, active, None)[1:]] == seven


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_on_invalid_nan_at_tp1_gives_the_eager_bytes(dtype: str, temperature: float) -> None:
    x, targets, active = _inputs(dtype, 997, 1001, 9, seed=4)
    active[:] = True
    active[[0, 1]] = False  # the rows of -inf and NaN specials stay inactive
    x[4, 30] = float("nan")  # an active row with a non-finite real logit
    x[5, 998] = float("nan")  # non-finite padding: never counts
    targets[6] = 997  # an active target in the padding
    targets[7] = -3
    contract = _contract(dtype, 997, 1001, 7, 9, temperature=temperature)
    found = []
    for op in (VocabParallelLogprob(), TritonLogprob(mode=INTERP)):
        out = op(x, targets, active, contract, compute_entropy=True, on_invalid="nan")
        found.append([tensor_bytes(v) for v in (out.selected_logp, out.lse, out.entropy)])
        assert torch.isnan(out.selected_logp).nonzero().squeeze(1).tolist() == [4, 6, 7]
    assert found[0] == found[1]


def test_an_out_of_range_target_is_refused_with_the_eager_message() -> None:
    x, targets, active = _inputs("bf16", 1000, 1024, 6, seed=2, specials=False)
    targets[4] = 1010
    active[4] = True
    contract = _contract("bf16", 1000, 1024, 8, 6)
    messages = []
    for op in (VocabParallelLogprob(), TritonLogprob(mode=INTERP)):
        with pytest.raises(LogprobContractError) as info:
            op(x, targets, active, contract)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "targets[4]=1010" in messages[0]


def test_without_validation_the_fused_forward_gives_the_eager_bytes() -> None:
    """``validate=False`` at TP = 1: no flags, no poison; the eager and Triton bytes agree."""
    x, targets, active = _inputs("bf16", 997, 1001, 6, seed=8)
    contract = _contract("bf16", 997, 1001, 7, 6)
    outs = [op(x, targets, active, contract, compute_entropy=True, validate=False)
            for op in (VocabParallelLogprob(), TritonLogprob(mode=INTERP))]
    found = [[tensor_bytes(v) for v in (o.selected_logp, o.lse, o.entropy)] for o in outs]
    assert found[0] == found[1]
    assert _run(TritonLogprob(mode=INTERP), x, targets, active, contract, True) == \
        _run(VocabParallelLogprob(), x, targets, active, contract, True)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_the_backward_terms_kernel_is_backward_terms(entropy_grad: bool) -> None:
    rows = 37
    contract = LogprobContract(real_vocab_size=1000, padded_vocab_size=1024, num_vocab_tiles=8, num_sequences=1,
                               seq_len=rows, tp_world_size=4, tp_rank=1)
    g = torch.Generator().manual_seed(3)
    targets = torch.randint(-5, 1030, (rows,), generator=g)
    targets[:4] = torch.tensor([256, 511, 255, 512])  # the shard's first and last column, and just outside
    active = torch.rand(rows, generator=g) > 0.3
    lse = torch.randn(rows, generator=g) * 5
    entropy = torch.rand(rows, generator=g) * 3 if entropy_grad else None
    grad = torch.randn(rows, generator=g)
    grad[~active] = float("nan")  # never read on inactive rows
    grad[5] = -0.0
    g_ent = torch.randn(rows, generator=g) if entropy_grad else None
    logits = torch.empty(rows, 256, dtype=torch.bfloat16)
    triton = TritonEngine(INTERP)
    for grad_logp, grad_lse in ((grad, None), (None, grad.abs()), (grad, torch.ones(1).expand(rows)), (None, None)):
        want = backward_terms(logits, targets, active, lse, grad_logp, grad_lse, contract, g_ent, entropy)
        got = triton.backward_terms(logits, targets, active, lse, grad_logp, grad_lse, contract, g_ent, entropy)
        for name in ("coef", "target_col", "target_add", "g_ent", "mb"):
            a, b = getattr(want, name), getattr(got, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert b.dtype == a.dtype and tensor_bytes(b) == tensor_bytes(a), name
        assert (got.real_local, got.t32) == (want.real_local, want.t32)
