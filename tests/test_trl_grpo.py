"""TRL's GRPOTrainer running on rl_engine's logprob (rl_engine/integrations/trl.py), and verl's drop-ins.

A tiny Qwen2 built from a config and a word-level tokenizer built in memory (nothing downloaded),
on the CPU: three GRPO steps with TRL's own fused head, then three with ours, from the same seed.
The rewards are equal step by step (the same completions were sampled), the losses agree to the
rounding of two arithmetics, and our per-token logprobs do not depend on how the batch is split.
A tiny Qwen2-MoE (tests/_tiny_lm.py) trains the same way, its router loss kept as TRL's head keeps it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from rl_engine.logprob import selected_logprob
from rl_engine.logprob.contract import LogprobContractError
from rl_engine.tensorio import tensor_bytes

from _head_products import count_products
from _tiny_lm import tiny_moe, tiny_qwen2

trl = pytest.importorskip("trl", reason="the trl extra is not installed (pip install -e '.[test]' installs it)")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # about a minute: two short GRPO runs

VOCAB = 256  # rows of the LM head (the tokenizer's words and specials fit under it)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="<eos>")


def _model() -> Any:
    return tiny_qwen2(VOCAB)


def _reward(completions: list[str], **_: Any) -> list[float]:
    return [float(sum(word.endswith(("1", "3", "5", "7", "9")) for word in text.split())) for text in completions]


def _saved_model(root: Path, build: Callable[[], Any] = _model, name: str = "tiny-qwen2") -> str:
    """The tiny model saved to a local directory: TRL builds the reference model (beta > 0) from
    the policy's path, so the policy is given as that path (read offline, nothing downloaded)."""
    path = root / name
    if not path.exists():
        build().save_pretrained(path)
    return str(path)


def _train(trainer_class: type, tmp_path: Path, model: str | None = None,
           steps: int = 3) -> tuple[list[dict[str, float]], Any]:
    prompts = [f"w{3 * i} w{3 * i + 1} w{5 * i + 2}" for i in range(8)]
    config = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                            max_completion_length=6, max_steps=steps, learning_rate=1e-2, logging_steps=1,
                            report_to="none", use_cpu=True, bf16=False, temperature=0.7, seed=0, beta=0.04,
                            save_strategy="no", disable_tqdm=True, shuffle_dataset=False)
    trainer = trainer_class(model=model or _saved_model(tmp_path.parent), reward_funcs=_reward, args=config,
                            train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                            processing_class=_tokenizer())
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return logs, trainer


def test_grpo_on_our_logprob_gives_trl_s_rewards_and_losses(tmp_path: Path) -> None:
    from rl_engine.integrations.trl import RLEngineGRPOTrainer

    theirs, _ = _train(trl.GRPOTrainer, tmp_path / "trl")
    ours, trainer = _train(RLEngineGRPOTrainer, tmp_path / "ours")
    assert len(theirs) == len(ours) == 3, (theirs, ours)
    # the policy's scoring forward is rl_engine's head (and the reference model's too)
    for patched in (trainer.model, trainer.ref_model):
        assert "add_rl_engine_lm_head" in patched.forward.__func__.__code__.co_qualname
    for step, (a, b) in enumerate(zip(theirs, ours)):
        assert a["reward"] == b["reward"], (step, a, b)  # the same completions, the same rewards
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(a["loss"])), (step, a["loss"], b["loss"])

    print("rewards and losses (TRL, ours):", [(a["reward"], a["loss"], b["loss"]) for a, b in zip(theirs, ours)])

    # the trained policy's logits for one batch; our logprob of them, whatever the rows are split into:
    # the same bytes. (The model's own forward gives its hidden states other bits when the batch
    # changes, on this CPU: measured, and no logprob can undo that; the split is of the logits.)
    model = trainer.model
    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        whole = selected_logprob(logits, labels, temperature=0.7, compute_entropy=True)
        rows = [selected_logprob(logits[i:i + 1], labels[i:i + 1], temperature=0.7, compute_entropy=True)
                for i in range(4)]
    for name in ("selected_logp", "entropy"):
        split = torch.cat([getattr(r, name) for r in rows])
        assert tensor_bytes(getattr(whole, name)) == tensor_bytes(split), name
    assert bool((whole.selected_logp[1:] != 0).all())


def test_the_head_refuses_what_it_does_not_compute() -> None:
    from rl_engine.integrations.trl import add_rl_engine_lm_head

    with pytest.raises(LogprobContractError, match="is_top1"):
        add_rl_engine_lm_head(_model(), outputs=("log_probs", "is_top1"))
    capped = _model()
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(LogprobContractError, match="final_logit_softcapping=30.0"):
        add_rl_engine_lm_head(capped)


def test_the_head_is_the_materialised_logprob_at_the_temperature() -> None:
    """One chunk: ``model(..., fused_lm_head=True)`` gives ``selected_logprob`` of the model's own logits
    at the same temperature, byte for byte, entropy included (0 on -100 labels)."""
    from rl_engine.integrations.trl import add_rl_engine_lm_head
    from rl_engine.logprob import selected_logprob

    model = _model()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[:, :4] = -100
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    add_rl_engine_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"), chunk_tokens=64)
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        ref = selected_logprob(logits, labels[:, 1:], temperature=0.7, compute_entropy=True)
    assert tensor_bytes(out.log_probs) == tensor_bytes(ref.selected_logp)
    assert tensor_bytes(out.entropy) == tensor_bytes(ref.entropy.masked_fill(labels[:, 1:] == -100, 0.0))


def test_keep_logits_reaches_the_head_and_gives_the_recomputing_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``add_rl_engine_lm_head(..., keep_logits=True)``: log-probs, entropies and the gradients of the LM
    head and of the model below it are the bytes of ``keep_logits=False``, and the backward makes no
    product again (counted; without it, one per chunk)."""
    from rl_engine.integrations.trl import add_rl_engine_lm_head

    calls = count_products(monkeypatch)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[:, :4] = -100
    found = {}
    for keep in (False, True):
        torch.manual_seed(0)
        model = _model()
        add_rl_engine_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"), chunk_tokens=3,
                              keep_logits=keep)
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        calls.clear()
        (out.loss - 0.01 * out.entropy.sum()).backward()
        found[keep] = {"products": len(calls), "log_probs": tensor_bytes(out.log_probs),
                       "entropy": tensor_bytes(out.entropy),
                       "lm_head": tensor_bytes(model.get_output_embeddings().weight.grad),
                       "embed": tensor_bytes(model.get_input_embeddings().weight.grad)}
    assert found[False].pop("products") == 4 and found[True].pop("products") == 0  # 10 active tokens, 3 a chunk
    assert found[True] == found[False]


def test_the_head_takes_a_temperature_per_token_per_call() -> None:
    """``model(..., fused_lm_head=True, temperature=tensor)``: each token at its own temperature, the
    bytes of ``selected_logprob`` of the model's logits with that tensor; without the fused head the
    argument is refused (the model returns its logits)."""
    from rl_engine.integrations.trl import add_rl_engine_lm_head
    from rl_engine.logprob import selected_logprob

    model = _model()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[:, :4] = -100
    temps = torch.tensor([0.7, 1.2]).repeat_interleave(8).reshape(2, 8)  # two requests, two temperatures
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    add_rl_engine_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"), chunk_tokens=64)
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels, fused_lm_head=True, temperature=temps)
        ref = selected_logprob(logits, labels[:, 1:], temperature=temps, compute_entropy=True)
        patched = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert tensor_bytes(out.log_probs) == tensor_bytes(ref.selected_logp)
    assert tensor_bytes(out.entropy) == tensor_bytes(ref.entropy.masked_fill(labels[:, 1:] == -100, 0.0))
    assert tensor_bytes(out.log_probs[0]) == tensor_bytes(patched.log_probs[0])  # the first request is at 0.7
    assert tensor_bytes(out.log_probs[1]) != tensor_bytes(patched.log_probs[1])
    with pytest.raises(LogprobContractError, match="temperature= is a fused_lm_head=True argument"):
        model(input_ids=ids, temperature=temps)


def _moe_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding: the router loss counts only attended tokens
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :4] = -100  # the prompt is not scored
    return ids, mask, labels


def test_the_head_keeps_an_moe_s_router_loss_as_trl_s_head_and_the_model_s_forward_do() -> None:
    """A tiny Qwen2-MoE whose config asks for its router logits: our head's ``aux_loss`` is TRL's head's
    and the model's own forward's, byte for byte; our ``loss`` is minus our mean logprob plus
    ``router_aux_loss_coef * aux_loss`` (exactly) and agrees with TRL's to the rounding of the two
    logprob arithmetics; the router's weights get a gradient from it. Control: a model whose config
    does not ask (and a call that does not) gets ``aux_loss=None`` from both heads."""
    import copy

    from trl.trainer.utils import add_fused_lm_head

    from rl_engine.integrations.trl import add_rl_engine_lm_head

    model = tiny_moe(VOCAB)
    ids, mask, labels = _moe_batch()
    own = model(input_ids=ids, attention_mask=mask)
    theirs, ours = copy.deepcopy(model), copy.deepcopy(model)
    add_fused_lm_head(theirs)
    add_rl_engine_lm_head(ours)
    a = theirs(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    b = ours(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert a.aux_loss is not None and b.aux_loss is not None and own.aux_loss is not None
    assert tensor_bytes(b.aux_loss.detach()) == tensor_bytes(a.aux_loss.detach()) == tensor_bytes(own.aux_loss.detach())
    coef = model.config.router_aux_loss_coef
    ce = -b.log_probs.sum() / (labels[:, 1:] != -100).sum()
    assert tensor_bytes((ce + coef * b.aux_loss).detach()) == tensor_bytes(b.loss.detach())
    assert abs(float(a.loss) - float(b.loss)) <= 1e-4 * abs(float(a.loss)), (float(a.loss), float(b.loss))
    assert abs(coef * float(b.aux_loss)) > 1e-3  # the router loss is a visible part of the loss
    print("loss (TRL, ours), aux:", float(a.loss), float(b.loss), float(b.aux_loss))
    b.aux_loss.backward()
    gate = ours.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and bool((gate.grad != 0).any())
    # control: the router loss only where it is asked for
    dense = tiny_moe(VOCAB)
    dense.config.output_router_logits = False
    plain_theirs, plain_ours = copy.deepcopy(dense), copy.deepcopy(dense)
    add_fused_lm_head(plain_theirs)
    add_rl_engine_lm_head(plain_ours)
    for head in (plain_theirs, plain_ours):
        assert head(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).aux_loss is None
    asked = plain_ours(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, output_router_logits=True)
    assert tensor_bytes(asked.aux_loss.detach()) == tensor_bytes(b.aux_loss.detach())


def test_grpo_trains_a_tiny_moe_with_trl_s_router_loss(tmp_path: Path) -> None:
    """``RLEngineGRPOTrainer.train()`` on a tiny Qwen2-MoE (it raised ``TypeError: expected Tensor as
    element 0`` when the head dropped the router loss): two GRPO steps with TRL's head and with ours
    from the same seed give the same rewards, the same logged router loss at the first step (the same
    weights, the same completions: equal floats), and losses that agree to the logprob rounding."""
    from rl_engine.integrations.trl import RLEngineGRPOTrainer

    path = _saved_model(tmp_path, lambda: tiny_moe(VOCAB), "tiny-qwen2-moe")
    theirs, _ = _train(trl.GRPOTrainer, tmp_path / "trl", path, steps=2)
    ours, trainer = _train(RLEngineGRPOTrainer, tmp_path / "ours", path, steps=2)
    assert len(theirs) == len(ours) == 2, (theirs, ours)
    assert "add_rl_engine_lm_head" in trainer.model.forward.__func__.__code__.co_qualname
    assert trainer.aux_loss_enabled
    assert ours[0]["aux_loss"] == theirs[0]["aux_loss"] > 0, (theirs[0], ours[0])
    for step, (a, b) in enumerate(zip(theirs, ours)):
        assert a["reward"] == b["reward"], (step, a, b)
        assert abs(a["aux_loss"] - b["aux_loss"]) <= 1e-4 * a["aux_loss"], (step, a["aux_loss"], b["aux_loss"])
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(a["loss"])), (step, a["loss"], b["loss"])
    print("MoE rewards, aux and losses (TRL, ours):",
          [(a["reward"], a["aux_loss"], b["aux_loss"], a["loss"], b["loss"]) for a, b in zip(theirs, ours)])


def test_verl_drop_ins_have_verl_s_signatures_and_our_bytes() -> None:
    from rl_engine.integrations.verl import entropy_from_logits, logprobs_from_logits
    from rl_engine.logprob import selected_logprob

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5, 512, generator=g).requires_grad_(True)
    labels = torch.randint(0, 512, (2, 5), generator=g)
    logp = logprobs_from_logits(logits, labels, inplace_backward=True, temperature=0.7)
    entropy = entropy_from_logits(logits, temperature=0.7)
    ref = selected_logprob(logits.detach(), labels, temperature=0.7, compute_entropy=True)
    assert tensor_bytes(logp) == tensor_bytes(ref.selected_logp) and tensor_bytes(entropy) == tensor_bytes(ref.entropy)
    (logp.sum() - 0.01 * entropy.sum()).backward()  # both differentiable, one backward
    assert logits.grad is not None and bool((logits.grad != 0).any())
    torch.testing.assert_close(logp.detach(), torch.log_softmax(logits.detach() / 0.7, -1).gather(-1, labels[..., None])[..., 0],
                               rtol=0, atol=1e-5)


def _doc_block(mark: str) -> str:
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "trainer.md").read_text(encoding="utf-8")
    assert text.count(mark) == 1
    block = re.search(re.escape(mark) + r"\n```python\n(.*?)^```", text, re.S | re.M)
    assert block is not None
    return block.group(1)


def test_the_documented_recipes_run_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = [f"w{i} w{i + 1}" for i in range(4)]
    scope = {"__name__": "__main__", "model": _model(), "tokenizer": _tokenizer(), "reward": _reward,
             "dataset": datasets.Dataset.from_dict({"prompt": prompts}), "output_dir": str(tmp_path)}
    exec(compile(_doc_block("<!-- run by tests/test_trl_grpo.py -->"), "docs/trainer.md", "exec"), scope)
    assert scope["trainer"].state.global_step == 1
    exec(compile(_doc_block("<!-- run by tests/test_trl_grpo.py (verl) -->"), "docs/trainer.md", "exec"), {})
    assert "torch.Size([2, 5]) torch.Size([2, 5])" in capsys.readouterr().out


def test_grpo_with_trl_s_default_bf16_gives_trl_s_rewards_and_losses(tmp_path: Path) -> None:
    """GRPOConfig's default ``bf16=True`` (left unset here): on the CPU too, accelerate runs the steps
    under ``torch.autocast("cpu", dtype=torch.bfloat16)``, the parameters staying float32. Five steps of
    TRL's own head and of ours: the same rewards step by step and the losses within 1e-4."""
    from rl_engine.integrations.trl import RLEngineGRPOTrainer

    def train(trainer_class: type, root: Path) -> list[dict[str, float]]:
        prompts = [f"w{3 * i} w{3 * i + 1} w{5 * i + 2}" for i in range(8)]
        config = trl.GRPOConfig(output_dir=str(root), per_device_train_batch_size=4, num_generations=4,
                                max_completion_length=6, max_steps=5, learning_rate=1e-2, logging_steps=1,
                                report_to="none", use_cpu=True, temperature=0.7, seed=0, beta=0.04,
                                save_strategy="no", disable_tqdm=True, shuffle_dataset=False)
        assert config.bf16 and not config.fp16  # TRL's default
        trainer = trainer_class(model=_saved_model(tmp_path), reward_funcs=_reward, args=config,
                                train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                                processing_class=_tokenizer())
        assert trainer.accelerator.mixed_precision == "bf16"
        trainer.train()
        return [entry for entry in trainer.state.log_history if "loss" in entry]

    theirs, ours = train(trl.GRPOTrainer, tmp_path / "trl"), train(RLEngineGRPOTrainer, tmp_path / "ours")
    print("bf16 rewards and losses (TRL, ours):", [(a["reward"], b["reward"], a["loss"], b["loss"])
                                                   for a, b in zip(theirs, ours)])
    assert len(theirs) == len(ours) == 5, (theirs, ours)
    for step, (a, b) in enumerate(zip(theirs, ours)):
        assert a["reward"] == b["reward"], (step, a["reward"], b["reward"])
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(a["loss"])), (step, a["loss"], b["loss"])
