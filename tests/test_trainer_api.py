"""The op as a trainer uses it: the README's example run under torchrun, the one-call
TP=1 function, the contract from the mesh, the gather into global token order, argument
errors, and double backward refused instead of silently dropped.

The multi-process disagreement cases live in ``tests/test_rank_agreement.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from rl_engine.logprob import LogprobContract, LogprobContractError, gather_tokens, selected_logprob
from rl_engine.logprob.backends.eager.vocab_parallel import VocabParallelLogprob
from rl_engine.tensorio import fingerprint, tensor_bytes

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "trainer_step.py"
EXAMPLE_COMMAND = "torchrun --standalone --nproc-per-node=4 examples/trainer_step.py --tp 2 --cp 2"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trainer_step_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----- the README's API and docs/trainer.md's example, run as written -------------------------------

TRAINER_DOC = ROOT / "docs" / "trainer.md"


def test_the_readme_and_the_example_give_the_same_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert EXAMPLE_COMMAND in readme
    assert EXAMPLE_COMMAND in TRAINER_DOC.read_text(encoding="utf-8")
    assert EXAMPLE_COMMAND in EXAMPLE.read_text(encoding="utf-8")


def test_the_documented_excerpt_is_the_examples_code() -> None:
    """Every line of docs/trainer.md's TP x CP excerpt is a line of the script the test runs."""
    doc = TRAINER_DOC.read_text(encoding="utf-8")
    section = doc[doc.index("## TP x CP: a runnable trainer step"):]
    excerpt = section[section.index("```python") + len("```python"):]
    excerpt = excerpt[: excerpt.index("```")]
    script = {line.strip() for line in EXAMPLE.read_text(encoding="utf-8").splitlines()}
    lines = [line.strip() for line in excerpt.splitlines() if line.strip()]
    assert len(lines) > 10
    assert [line for line in lines if line not in script] == []


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
def test_the_trainer_example_runs_under_torchrun_and_equals_one_rank() -> None:
    """TP=2 x CP=2 (zigzag) on 4 gloo processes: logp, LSE and every rank's gradient block
    are the bytes of the single-rank call on the same logits."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
            str(EXAMPLE.relative_to(ROOT)), "--tp", "2", "--cp", "2"]
    assert " ".join(["torchrun", *argv[3:]]) == EXAMPLE_COMMAND
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout  # rank 0 alone prints
    report = json.loads(lines[0])
    assert report["equal_to_single_rank"] is True, report
    assert sorted((r["tp_rank"], r["cp_rank"]) for r in report["ranks"]) == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    example = _example()
    logits, targets, active = example.make_batch()
    assert (logits.dtype, targets.dtype, active.dtype) == (torch.bfloat16, torch.int64, torch.bool)
    ref = selected_logprob(logits, targets, active, num_vocab_tiles=example.TILES,
                           real_vocab_size=example.REAL_VOCAB)
    assert report["logp_sha256"] == fingerprint(ref.selected_logp)
    assert report["lse_sha256"] == fingerprint(ref.lse)


# ----- selected_logprob: the one-call TP=1 function -------------------------------------------


def _inputs(shape: tuple[int, ...], vocab: int = 1024, seed: int = 3) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g) * 2).to(torch.bfloat16)
    targets = torch.randint(0, 1000, shape, generator=g)
    active = torch.rand(shape, generator=g) > 0.3
    return logits, targets, active


def test_selected_logprob_equals_the_op_with_an_explicit_contract() -> None:
    logits, targets, active = _inputs((2, 8))
    x = logits.clone().requires_grad_(True)
    out = selected_logprob(x, targets, active, num_vocab_tiles=16, real_vocab_size=1000,
                           compute_entropy=True)
    assert out.selected_logp.shape == out.lse.shape == (2, 8) and out.entropy is not None
    contract = LogprobContract(1000, 1024, 16, 2, 8, logits_dtype="bf16")
    y = logits.reshape(16, 1024).clone().requires_grad_(True)
    want = VocabParallelLogprob()(y, targets.reshape(-1), active.reshape(-1), contract,
                                  compute_entropy=True)
    for got, ref in ((out.selected_logp, want.selected_logp), (out.lse, want.lse),
                     (out.entropy, want.entropy)):
        assert tensor_bytes(got) == tensor_bytes(ref)
    out.selected_logp.sum().backward()
    want.selected_logp.sum().backward()
    assert x.grad is not None and y.grad is not None
    assert tensor_bytes(x.grad) == tensor_bytes(y.grad)
    # 2-D logits and the default mask (every token active)
    flat = selected_logprob(logits.reshape(16, 1024), targets.reshape(-1), num_vocab_tiles=16,
                            real_vocab_size=1000)
    every = VocabParallelLogprob()(logits.reshape(16, 1024), targets.reshape(-1),
                                   torch.ones(16, dtype=torch.bool), contract)
    assert tensor_bytes(flat.selected_logp) == tensor_bytes(every.selected_logp)


def test_selected_logprob_backend_auto_takes_the_fastest_and_records_why() -> None:
    from rl_engine.logprob.registry import BackendUnavailableError

    logits, targets, active = _inputs((2, 8))
    runs = {}
    for backend in ("auto", "pytorch-vocab-parallel-logp-ws2", "cpu-vocab-parallel-logp-ws2"):
        x = logits.clone().requires_grad_(True)
        out = selected_logprob(x, targets, active, num_vocab_tiles=16, real_vocab_size=1000,
                               backend=backend)
        out.selected_logp.sum().backward()
        assert x.grad is not None and out.provenance is not None
        runs[backend] = (out.provenance, tensor_bytes(out.selected_logp), tensor_bytes(x.grad))
    auto = runs["auto"][0]
    assert auto["requested_backend"] == "auto" and auto["fallback"] is False
    assert auto["actual_backend"] == "cpu-vocab-parallel-logp-ws2"  # the fused C kernel on cpu
    assert "highest-priority backend capable and available on device cpu" in auto["reason"]
    assert runs["pytorch-vocab-parallel-logp-ws2"][0]["reason"] == "requested explicitly"
    assert len({run[1:] for run in runs.values()}) == 1  # the same bytes whichever backend
    with pytest.raises(BackendUnavailableError, match=r"device cpu not in \['cuda'\]"):
        selected_logprob(logits, targets, active, num_vocab_tiles=16, real_vocab_size=1000,
                         backend="triton-vocab-parallel-logp-ws2")


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda l, t, a: (l.double(), t, a), "logits.dtype=torch.float64"),
        (lambda l, t, a: (l[0, 0], t, a), "logits=(1024,) must be a tensor of shape"),
        (lambda l, t, a: (l, t[:, :4], a), "targets.shape=(2, 4) must equal logits.shape[:-1]=(2, 8)"),
        (lambda l, t, a: (l, t, a[0]), "active.shape=(8,) must equal"),
    ],
)
def test_selected_logprob_refuses_bad_input_naming_it(change: Any, needle: str) -> None:
    logits, targets, active = change(*_inputs((2, 8)))
    with pytest.raises(LogprobContractError, match=re.escape(needle)):
        selected_logprob(logits, targets, active, num_vocab_tiles=16, real_vocab_size=1000)
    with pytest.raises(LogprobContractError, match="num_vocab_tiles=33 leaves its last tile with no column"):
        selected_logprob(*_inputs((2, 8)), num_vocab_tiles=33)  # 33 tiles of ceil(1024 / 33) = 32 columns


# ----- the contract from the mesh -----------------------------------------------------------------


def _fake_mesh(tp: int, cp: int, tp_rank: int, cp_rank: int) -> Any:
    return SimpleNamespace(dims=SimpleNamespace(tp=tp, cp=cp), tp_rank=tp_rank, cp_rank=cp_rank)


def test_from_mesh_takes_degrees_and_coordinates_from_the_mesh() -> None:
    got = LogprobContract.from_mesh(_fake_mesh(2, 2, 1, 1), real_vocab_size=1000,
                                    padded_vocab_size=1024, num_vocab_tiles=16, num_sequences=2,
                                    seq_len=8, cp_layout="zigzag")
    assert got == LogprobContract(1000, 1024, 16, 2, 8, tp_world_size=2, tp_rank=1,
                                  cp_world_size=2, cp_rank=1, cp_layout="zigzag")
    assert LogprobContract.from_mesh(_fake_mesh(1, 1, 0, 0), real_vocab_size=1024,
                                     num_vocab_tiles=16, num_sequences=1,
                                     seq_len=8).padded_vocab_size == 1024
    with pytest.raises(LogprobContractError, match=r"from_mesh takes \['tp_rank'\] from the mesh"):
        LogprobContract.from_mesh(_fake_mesh(2, 1, 0, 0), real_vocab_size=1024, num_vocab_tiles=16,
                                  num_sequences=1, seq_len=8, tp_rank=1)
    with pytest.raises(LogprobContractError, match="is not a mesh"):
        LogprobContract.from_mesh("tp=2", real_vocab_size=1024, num_vocab_tiles=16,
                                  num_sequences=1, seq_len=8)


# ----- gather_tokens on one rank (CP=1); CP=2 in test_rank_agreement.py and the example ----------


def test_gather_tokens_on_one_rank_is_the_identity_and_differentiable() -> None:
    contract = LogprobContract(1024, 1024, 16, 2, 8)
    local = torch.randn(16, requires_grad=True)
    out = gather_tokens(local, contract)
    assert tensor_bytes(out) == tensor_bytes(local)
    weights = torch.randn(16)
    (out * weights).sum().backward()
    assert local.grad is not None and tensor_bytes(local.grad) == tensor_bytes(weights)
    with pytest.raises(LogprobContractError, match="must start with num_tokens=16"):
        gather_tokens(local[:4], contract)
    cp2 = LogprobContract(1024, 1024, 16, 2, 8, cp_world_size=2)
    with pytest.raises(LogprobContractError, match="needs the CP process group"):
        gather_tokens(local[:8], cp2)


# ----- argument errors ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LogprobContract]:
    logits, targets, active = _inputs((8,))
    return logits, targets, active, LogprobContract(1000, 1024, 16, 1, 8)


@pytest.mark.parametrize("value, needle", [
    (2.5, "chunk_rows=2.5 must be a positive integer or None (got float)"),
    (True, "chunk_rows=True must be a positive integer or None (got bool)"),
    ("4", "chunk_rows='4' must be a positive integer or None (got str)"),
    (0, "chunk_rows=0 must be >= 1"),
])
def test_chunk_rows_of_the_wrong_type_is_our_error_naming_the_field(
    small: Any, value: Any, needle: str
) -> None:
    """2.5, True and "4" are refused by name, not by a bare TypeError from deep inside the chunk loop."""
    logits, targets, active, contract = small
    with pytest.raises(LogprobContractError, match=re.escape(needle)):
        VocabParallelLogprob()(logits, targets, active, contract, chunk_rows=value)


@pytest.mark.parametrize("name, value", [("compute_entropy", "yes"), ("validate", 1)])
def test_flags_must_be_booleans(small: Any, name: str, value: Any) -> None:
    logits, targets, active, contract = small
    with pytest.raises(LogprobContractError, match=re.escape(f"{name}={value!r} must be True or False")):
        VocabParallelLogprob()(logits, targets, active, contract, **{name: value})


# ----- double backward ------------------------------------------------------------------------------


def test_create_graph_gradient_raises_when_differentiated_instead_of_dropping_the_penalty(
    small: Any,
) -> None:
    """A create_graph gradient without a graph would make a gradient penalty added to the loss
    contribute nothing, silently: differentiating it raises, naming create_graph."""
    logits, targets, active, contract = small
    x = logits.float().clone().requires_grad_(True)
    c32 = LogprobContract(1000, 1024, 16, 1, 8, logits_dtype="fp32")
    out = VocabParallelLogprob()(x, targets, active, c32)
    (grad,) = torch.autograd.grad(out.selected_logp.sum(), x, create_graph=True)
    assert grad.requires_grad  # attached to the node that refuses a second derivative
    total = out.lse.sum() + (grad ** 2).sum()  # a gradient penalty next to another term
    with pytest.raises(LogprobContractError, match=r"create_graph=True: the selected-logprob op is differentiable once"):
        total.backward()
    # the first-order gradient itself is the usual one, byte for byte
    y = logits.float().clone().requires_grad_(True)
    plain = VocabParallelLogprob()(y, targets, active, c32)
    (want,) = torch.autograd.grad(plain.selected_logp.sum(), y)
    assert tensor_bytes(grad) == tensor_bytes(want) and not want.requires_grad
