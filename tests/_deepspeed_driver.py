"""Runs in DeepSpeed's environment (scripts/deepspeed-env.sh), called by tests/test_trl_zero3.py.

``python tests/_deepspeed_driver.py OUT`` runs one process (world size 1, gloo, DeepSpeed's CPU
accelerator) with ZeRO-3 partitioning every parameter (``stage3_param_persistence_threshold: 0``: no
parameter is kept whole, the tiny LM head included), a tiny Qwen2 patched with rl_engine's TRL head,
and writes ``OUT/result.json`` and the tensors it compares, as raw bytes, for the test to check:

- ``bare``: the patched ``model.forward`` called directly under ``no_grad`` (the root module's
  ZeRO-3 hooks do not run, so nothing gathers the head's weight but the head itself: the weight has
  ``numel`` 0 there): our log-probs and entropies, and the same call with the head's gather replaced
  by a null context (the negative control: it must fail, naming the empty weight);
- ``engine``: one training forward and backward through the DeepSpeed engine: the log-probs and
  entropies, and the full gradients of the LM head and the embedding (``safe_get_full_grad``);
- ``plain``: the same model and head without DeepSpeed, the same calls (the reference).

It records how many times the head's gather was a real ``GatheredParameters`` (the weight was
partitioned when the head read it) and how many times a null context (DeepSpeed had gathered it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


# one rank of torch.distributed's environment (else DeepSpeed looks for MPI)
for name, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(name, value)
os.environ.setdefault("MASTER_PORT", _free_port())

import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401  (imported before DeepSpeed patches torch.Tensor.__new__)

VOCAB = 256
CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def build() -> torch.nn.Module:
    from _tiny_lm import tiny_qwen2  # tests/ is sys.path[0]: this file runs as a script

    return tiny_qwen2(VOCAB)


def score(call, ids, labels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = call(input_ids=ids, labels=labels, fused_lm_head=True)
    return out.log_probs, out.entropy, out.loss - 0.01 * out.entropy.sum()


def main(out: Path) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from transformers.integrations import HfDeepSpeedConfig

    import rl_engine.integrations.trl as head
    from rl_engine.logprob.contract import LogprobContractError

    out.mkdir(parents=True, exist_ok=True)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    labels = ids.masked_fill(torch.arange(9) < 3, -100)
    files: dict[str, torch.Tensor] = {}

    plain = build()
    head.add_rl_engine_lm_head(plain, temperature=0.7, outputs=("log_probs", "entropy"))
    with torch.no_grad():
        files["plain-logp"], files["plain-entropy"], _ = score(plain, ids, labels)
    _, _, loss = score(plain, ids, labels)
    loss.backward()
    files["plain-grad-lm_head"] = plain.lm_head.weight.grad
    files["plain-grad-embed"] = plain.model.embed_tokens.weight.grad

    kept = HfDeepSpeedConfig(CONFIG)  # noqa: F841  (transformers' is_deepspeed_zero3_enabled() reads it while it lives)
    deepspeed.init_distributed(dist_backend="gloo")
    model = build()
    head.add_rl_engine_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG)
    weight = model.lm_head.weight
    result: dict = {"deepspeed": deepspeed.__version__, "partitioned_numel": weight.numel(),
                    "ds_shape": list(weight.ds_shape), "zero3": __import__(
                        "transformers.integrations.deepspeed", fromlist=["x"]).is_deepspeed_zero3_enabled()}

    gathers = {"real": 0, "null": 0}
    original = head._gather_lm_head

    def counted(w: torch.Tensor):
        ctx = original(w)
        gathers["null" if isinstance(ctx, contextlib.nullcontext) else "real"] += 1
        return ctx

    head._gather_lm_head = counted
    with torch.no_grad():
        files["bare-logp"], files["bare-entropy"], _ = score(model.forward, ids, labels)
    result["bare_gathers"] = dict(gathers)
    result["numel_after_bare"] = weight.numel()

    head._gather_lm_head = lambda w: contextlib.nullcontext()  # the negative control: no gather
    try:
        with torch.no_grad():
            score(model.forward, ids, labels)
        result["bare_without_gather"] = "ran"
    except LogprobContractError as error:
        result["bare_without_gather"] = str(error)
    head._gather_lm_head = counted

    gathers.update(real=0, null=0)
    files["engine-logp"], files["engine-entropy"], loss = score(engine, ids, labels)
    engine.backward(loss)
    files["engine-grad-lm_head"] = safe_get_full_grad(model.lm_head.weight)
    files["engine-grad-embed"] = safe_get_full_grad(model.model.embed_tokens.weight)
    engine.step()
    result["engine_gathers"] = dict(gathers)

    for name, tensor in files.items():
        (out / f"{name}.f32").write_bytes(tensor.detach().float().contiguous().numpy().tobytes())
    (out / "result.json").write_text(json.dumps(result, allow_nan=False, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
