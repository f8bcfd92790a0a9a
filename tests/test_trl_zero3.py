"""rl_engine's TRL head under DeepSpeed ZeRO-3 (rl_engine/integrations/trl.py).

ZeRO-3 partitions every parameter: outside its module's forward the LM head's weight has ``numel`` 0.
A fused head reads the weight without calling the module, so TRL's own head gathers it with
``trl.trainer.utils.maybe_gather_lm_head_ctx``, in the forward and again in the backward that makes
the chunks' logits again. Ours enters the same context at the same two places:

- without DeepSpeed, a stand-in for the context (the weight holds NaNs outside it and its values
  inside it) shows that the forward and the backward read the weight only inside it: the outputs and
  gradients are the bytes of the unpartitioned model, and without the backward's gather they are not;
- with DeepSpeed (its environment: scripts/deepspeed-env.sh; .ci/run builds it), one process, ZeRO-3
  partitioning every parameter: the patched ``model.forward`` called bare (the root module's hooks
  do not gather the head there) gives the plain model's bytes, and fails naming the empty weight when
  the gather is replaced by a null context; a training step through the engine gives the plain
  model's log-probs, entropies and LM-head gradient as bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

from rl_engine.tensorio import tensor_bytes

from _tiny_lm import tiny_qwen2

trl = pytest.importorskip("trl", reason="the trl extra is not installed (pip install -e '.[test]' installs it)")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256
LOCK_WAIT_S = 600.0  # a lock older than this is a killed build's (the op builds in about 60 s of CPU)


def _model() -> Any:
    return tiny_qwen2(VOCAB)


class _Partitioned:
    """A stand-in for ZeRO-3's partitioning of one parameter: outside :meth:`gather` the parameter holds
    NaNs (whatever reads it then gives NaNs), inside it its values; ``calls`` records what was gathered."""

    def __init__(self, param: torch.nn.Parameter) -> None:
        self.param, self.full = param, param.data
        self.calls: list[tuple[torch.Tensor, ...]] = []
        param.data = torch.full_like(self.full, float("nan"))

    @contextlib.contextmanager
    def gather(self, *params: torch.Tensor) -> Iterator[None]:
        self.calls.append(params)
        poisoned, self.param.data = self.param.data, self.full
        try:
            yield
        finally:
            self.param.data = poisoned


def _run(model: Any, cast: bool = False) -> dict[str, bytes]:
    from rl_engine.integrations.trl import add_rl_engine_lm_head

    add_rl_engine_lm_head(model, temperature=0.7, cast_lm_head_to_fp32=cast, outputs=("log_probs", "entropy"),
                          chunk_tokens=5)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    labels = ids.masked_fill(torch.arange(9) < 3, -100)
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    (out.loss - 0.01 * out.entropy.sum()).backward()
    return {"log_probs": tensor_bytes(out.log_probs.detach()), "entropy": tensor_bytes(out.entropy.detach()),
            "grad_lm_head": tensor_bytes(model.lm_head.weight.grad),
            "grad_embed": tensor_bytes(model.model.embed_tokens.weight.grad)}


@pytest.mark.parametrize("cast", [False, True], ids=["weight-dtype", "cast_lm_head_to_fp32"])
def test_the_head_reads_the_weight_inside_trl_s_gather_in_the_forward_and_the_backward(cast: bool) -> None:
    expected = _run(_model(), cast)
    model = _model()
    part = _Partitioned(model.lm_head.weight)
    with mock.patch.object(trl.trainer.utils, "maybe_gather_lm_head_ctx", part.gather):
        got = _run(model, cast)
    assert got == expected  # every output and gradient, as bytes: no NaN read outside the gather
    assert len(part.calls) == 2  # the forward, then the backward (which makes the chunks' logits again)
    assert all(len(call) == 1 and call[0] is model.lm_head.weight for call in part.calls)


def test_without_the_backward_s_gather_the_gradient_reads_the_partitioned_weight() -> None:
    """The negative control: the backward makes the chunks' logits again from the weight; without the
    gather there, it reads what ZeRO-3 leaves outside the gather (NaNs in the stand-in)."""
    import rl_engine.integrations.trl as head

    model = _model()
    part = _Partitioned(model.lm_head.weight)
    with mock.patch.object(trl.trainer.utils, "maybe_gather_lm_head_ctx", part.gather), \
            mock.patch.object(head, "_gather_in_backward", lambda out, weight: None):
        got = _run(model)
    assert len(part.calls) == 1
    assert np.isnan(np.frombuffer(got["grad_lm_head"], dtype=np.float32)).all()
    assert not np.isnan(np.frombuffer(got["log_probs"], dtype=np.float32)).any()


def test_without_deepspeed_the_gather_is_trl_s_null_context() -> None:
    """No ZeRO-3: TRL's context is a null one, and the head gives what it gave before (the bytes of
    the materialised logprob are tests/test_trl_grpo.py's)."""
    from rl_engine.integrations.trl import _gather_lm_head

    assert isinstance(_gather_lm_head(_model().lm_head.weight), contextlib.nullcontext)


def deepspeed_python() -> Path | None:
    """The python of DeepSpeed's environment: $RL_ENGINE_DEEPSPEED_PYTHON, else .ci/deepspeed-env."""
    named = os.environ.get("RL_ENGINE_DEEPSPEED_PYTHON")
    path = Path(named) if named else ROOT / ".ci" / "deepspeed-env" / "bin" / "python"
    return path if path.is_file() else None


def wait_for_build_lock(lock: Path) -> None:
    """Wait while torch's build lock ``lock`` is younger than LOCK_WAIT_S; refuse an older one, naming it.

    The lock is held while a build runs (a second copy of the suite sharing this environment rebuilds
    the op for its own include paths) and left behind by a build killed midway, after which every
    load would wait on it forever. A live build ends well within LOCK_WAIT_S of starting it."""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > LOCK_WAIT_S:
            pytest.fail(f"{lock} is {age:.0f} s old: a build of DeepSpeed's shared-memory op killed midway left it "
                        "(every load would wait on it forever); remove it when no scripts/deepspeed-env.sh runs")
        time.sleep(1.0)


def test_a_young_build_lock_is_waited_for_and_an_old_one_refused_naming_it(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - LOCK_WAIT_S - 5
    os.utime(lock, (old, old))
    with pytest.raises(pytest.fail.Exception, match=f"{lock} is \\d+ s old"):
        wait_for_build_lock(lock)
    lock.touch()  # a live build's lock, gone after a second
    threading.Timer(1.0, lock.unlink).start()
    start = time.monotonic()
    wait_for_build_lock(lock)
    assert not lock.exists() and time.monotonic() - start >= 0.9


@pytest.mark.slow
def test_under_deepspeed_zero3_the_head_gathers_its_partitioned_weight(tmp_path: Path) -> None:
    python = deepspeed_python()
    if python is None:
        message = "DeepSpeed's environment is missing: run scripts/deepspeed-env.sh (or set RL_ENGINE_DEEPSPEED_PYTHON)"
        if os.environ.get("CI") == "true":
            pytest.fail(message + "; .ci/run builds it, so under CI this is a failure")
        pytest.skip(message)
    extensions = python.parent.parent / "torch_extensions"  # where scripts/deepspeed-env.sh built the op
    wait_for_build_lock(extensions / "deepspeed_shm_comm" / "lock")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCH_EXTENSIONS_DIR=str(extensions))
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)  # one rank of its own (the driver sets them, on a free port)
    done = subprocess.run([str(python), str(ROOT / "tests" / "_deepspeed_driver.py"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text(encoding="utf-8"))
    read = lambda name: (tmp_path / f"{name}.f32").read_bytes()
    assert result["zero3"] and result["partitioned_numel"] == 0 and result["ds_shape"] == [VOCAB, 32], result
    # bare forward: only the head's own gather makes the weight whole; the same bytes as without DeepSpeed
    assert result["bare_gathers"] == {"real": 1, "null": 0} and result["numel_after_bare"] == 0, result
    for name in ("logp", "entropy"):
        assert read(f"bare-{name}") == read(f"plain-{name}"), name
    assert "weight=(0,)" in result["bare_without_gather"], result  # the negative control: the partitioned weight
    # through the engine DeepSpeed has gathered the weight already (TRL's context is then a null one),
    # forward and backward; the head's outputs and gradient are the plain model's bytes
    assert result["engine_gathers"] == {"real": 0, "null": 2}, result
    for name in ("logp", "entropy", "grad-lm_head"):
        assert read(f"engine-{name}") == read(f"plain-{name}"), name
    # the backbone's gradient is DeepSpeed's arithmetic (its ZeRO-3 linear layers): close, not our claim
    embed = [np.frombuffer(read(f"{run}-grad-embed"), dtype=np.float32) for run in ("engine", "plain")]
    assert float(np.abs(embed[0] - embed[1]).max()) <= 1e-6
