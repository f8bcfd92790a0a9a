"""The fused head's fixed-order logits (``rl_engine/logprob/_head_gemm.c``, docs/arithmetic.md section 12).

Per element ``s = +0``, then ``s = fma(h[k], w[k], s)`` for ``k = 0 .. H-1``, NaN canonical, one
rounding to the dtype. Checked here: the bytes of the independent NumPy implementation
(``rl_engine.arith.spec_numpy.head_logits``) in every instruction-set variant and at several thread
counts; a logit's bytes do not depend on the other rows in the call (chunks, subsets), nor on the
columns in the call (TP shards of 1, 2, 4, 8, simulated as column slices of the weight); special
values; the refusal of a thread that flushes subnormals; the choice of the product. Negative
control: another order of the same sum (k reversed) gives other bytes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rl_engine.arith import spec_numpy
from rl_engine.logprob.contract import LogprobContractError
from rl_engine.logprob.head_matmul import choose_matmul, fixed_logits, selected_isa
from rl_engine.tensorio import tensor_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _isas() -> list[str]:
    return [name for name in ("baseline", "avx2", "avx512") if selected_isa(name) >= 0]


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _operands(dtype: torch.dtype, rows: int = 29, cols: int = 77, depth: int = 53,
              seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, depth, generator=gen).to(dtype)
    weight = (torch.randn(cols, depth, generator=gen) * 0.3).to(dtype)
    return hidden, weight


@pytest.mark.parametrize("name", list(DTYPES))
def test_every_variant_and_thread_count_gives_the_numpy_implementation_s_bytes(name: str) -> None:
    """Odd shapes (29 rows, 77 columns, depth 53) reach every remainder of the register blocks."""
    hidden, weight = _operands(DTYPES[name])
    want = np.asarray(spec_numpy.head_logits(_numpy(hidden), _numpy(weight), name)).tobytes()
    for isa in _isas() + ["auto"]:
        for threads in (1, 2, 3):
            got = fixed_logits(hidden, weight, threads=threads, isa=isa)
            assert got.dtype == hidden.dtype and tuple(got.shape) == (29, 77)
            assert _numpy(got).tobytes() == want, (name, isa, threads)


@pytest.mark.parametrize("name", list(DTYPES))
def test_a_logit_does_not_depend_on_the_rows_or_columns_multiplied_with_it(name: str) -> None:
    """Rows in chunks of 1, 5 and 16 and in any subset, columns in TP shards of 1, 2, 4 and 8 (column
    slices of the weight): every logit keeps the bytes it has in the whole product."""
    hidden, weight = _operands(DTYPES[name], rows=40, cols=512, depth=96)
    whole = fixed_logits(hidden, weight)
    for chunk in (1, 5, 16):
        parts = torch.cat([fixed_logits(hidden[i:i + chunk], weight) for i in range(0, 40, chunk)])
        assert tensor_bytes(parts) == tensor_bytes(whole), chunk
    subset = torch.tensor([39, 0, 17, 18, 3])
    assert tensor_bytes(fixed_logits(hidden[subset], weight)) == tensor_bytes(whole[subset])
    for tp in (1, 2, 4, 8):
        width = 512 // tp
        shards = [fixed_logits(hidden, weight[r * width:(r + 1) * width]) for r in range(tp)]
        assert tensor_bytes(torch.cat(shards, dim=1)) == tensor_bytes(whole), tp
    strided = fixed_logits(hidden[::2], weight[::3])  # views with other strides: the same products
    assert tensor_bytes(strided) == tensor_bytes(whole[::2, ::3].contiguous())


def test_negative_control_another_order_of_the_same_sum_gives_other_bytes() -> None:
    hidden, weight = _operands(torch.float32, rows=40, cols=512, depth=96)
    forward = fixed_logits(hidden, weight)
    backward = fixed_logits(hidden.flip(1), weight.flip(1))  # k = H-1 .. 0: the same terms
    assert tensor_bytes(forward) != tensor_bytes(backward)
    assert float((forward - backward).abs().max()) < 1e-4


def test_special_values_follow_the_specification() -> None:
    """NaN becomes the canonical NaN; an infinite product stays infinite; subnormal products are
    gradual (no flush); an all-zero row gives +0 (the chain starts at +0); bf16 rounds to nearest
    even with overflow to infinity."""
    h = torch.tensor([[1.0, float("nan")], [1.0, 1.0], [-0.0, 0.0], [3.0e38, 3.0e38], [float("inf"), 1.0]])
    w = torch.tensor([[1.0, 1.0], [-1.0, 0.5]])
    out = fixed_logits(h, w)
    bits = out.view(torch.int32)
    assert int(bits[0, 0]) == 0x7FC00000 and int(bits[0, 1]) == 0x7FC00000
    assert float(out[1, 0]) == 2.0 and float(out[1, 1]) == -0.5
    tiny = fixed_logits(torch.tensor([[2.0 ** -75, 2.0 ** -76]]), torch.tensor([[2.0 ** -70, 2.0 ** -70]]))
    assert float(tiny[0, 0]) == 3 * 2.0 ** -146  # two subnormal products, added exactly (no flush)
    assert tensor_bytes(out[2]) == tensor_bytes(torch.zeros(2))  # +0, not -0
    assert float(out[3, 0]) == float("inf")
    assert float(out[4, 0]) == float("inf") and float(out[4, 1]) == float("-inf")
    big = fixed_logits(torch.tensor([[2.0 ** 127, 2.0 ** 127]], dtype=torch.bfloat16),
                       torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16))
    assert float(big[0, 0]) == float("inf")  # 2**128 overflows binary32 before the rounding


def test_a_thread_that_flushes_subnormals_is_refused() -> None:
    hidden, weight = _operands(torch.float32)
    previous = torch.set_flush_denormal(True)
    if not previous and not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        with pytest.raises(LogprobContractError, match=re.escape("flushes subnormal numbers to zero")):
            fixed_logits(hidden, weight)
    finally:
        torch.set_flush_denormal(False)


def test_the_product_is_chosen_by_name_and_nothing_falls_back() -> None:
    assert choose_matmul("auto", torch.device("cpu")).record() == {
        "requested": "auto", "used": "fixed", "reason": "the CPU's fixed-order kernel"}
    assert choose_matmul("library", torch.device("cpu")).used == "library"
    assert choose_matmul("auto", torch.device("cuda")).record() == {
        "requested": "auto", "used": "library", "reason": "no fixed-order kernel on cuda"}
    with pytest.raises(LogprobContractError, match=re.escape("matmul='fixed' runs on the CPU only")):
        choose_matmul("fixed", torch.device("cuda"))
    with pytest.raises(LogprobContractError, match=re.escape("matmul='gemm' must be one of ('auto', 'fixed', 'library')")):
        choose_matmul("gemm", torch.device("cpu"))
    with pytest.raises(LogprobContractError, match="one dtype among bf16, fp16, fp32"):
        fixed_logits(torch.ones(2, 3), torch.ones(4, 3, dtype=torch.bfloat16))
    with pytest.raises(LogprobContractError, match=re.escape("threads=0 must be an integer in [1, 256]")):
        fixed_logits(torch.ones(2, 3), torch.ones(4, 3), threads=0)


def test_a_checkout_without_the_built_product_is_named_by_the_regression_verb(tmp_path: Path) -> None:
    """``regression`` runs nothing in a checkout whose ``_head_gemm`` is not built, naming it and the fix
    (the fused kernel's case is ``tests/test_evidence.py``'s); this checkout has both built."""
    source = Path(spec_numpy.__file__).resolve().parents[2]  # rl_engine/arith/spec_numpy.py -> the checkout
    checkout = tmp_path / "other-checkout"
    shutil.copytree(source / "rl_engine", checkout / "rl_engine",
                    ignore=shutil.ignore_patterns("_head_gemm*.so", "_head_gemm*.pyd", "__pycache__"))
    probe = "from rl_engine.record.regression import unbuilt_kernel; print(unbuilt_kernel())"
    for root, want in ((checkout, "the fused head's fixed-order product is not built in this checkout"),
                       (source, "None")):
        run = subprocess.run([sys.executable, "-c", probe], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.startswith(want), run.stdout + run.stderr
