"""TRL's ``GRPOTrainer`` on rl_engine's logprob and entropy (the ``trl`` extra; TRL >= 1.16).

TRL 1.16 scores completions through a fused LM head: ``trl.trainer.utils.add_fused_lm_head``
patches the policy (and the reference model) so that ``model(..., labels=labels,
fused_lm_head=True)`` returns per-token ``log_probs`` and ``entropy`` without building the
``[batch, seq, vocab]`` logits, with the temperature applied inside. :func:`add_rl_engine_lm_head`
is the same patch with the same signature and output, whose numbers are
:func:`rl_engine.logprob.hidden.selected_logprob_from_hidden`'s: ``hidden @ weight.T`` chunk by
chunk, our arithmetic on each chunk (the temperature as section 6 step 0, the entropy
differentiable, section 7 step 1). :class:`RLEngineGRPOTrainer` is ``GRPOTrainer`` with that head
on the policy and the reference model (nothing else of TRL changes):

    from rl_engine.integrations.trl import RLEngineGRPOTrainer
    trainer = RLEngineGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                                  train_dataset=dataset, processing_class=tokenizer)

Under DeepSpeed ZeRO-3 the LM head's weight is read inside TRL's own ``maybe_gather_lm_head_ctx``, in
the forward and again in the backward that makes the chunks' logits again, as TRL's head reads it.

The head computes in its weight's dtype, autocast or not (``cast_lm_head_to_fp32``: float32):
the arithmetic needs the logits' dtype fixed. What is refused, naming the setting: an LM head with a
bias, a model whose config scales or caps
its logits (``final_logit_softcapping``, ``logit_scale`` and its relatives: the arithmetic would
need that step specified first), and per-token outputs other than ``log_probs`` and ``entropy``.
"""

from __future__ import annotations

import functools
import types
from typing import Any
from unittest import mock

import torch

from rl_engine.logprob.contract import LogprobContractError
from rl_engine.logprob.hidden import DEFAULT_CHUNK_TOKENS, selected_logprob_from_hidden

SUPPORTED_OUTPUTS = ("log_probs", "entropy")
SCALING_FIELDS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                  "logits_scaling")


def _scaling_problem(config: Any) -> str | None:
    for name in SCALING_FIELDS:
        value = getattr(config, name, None)
        if value is not None and value != 1 and not (name == "final_logit_softcapping" and value == 0):
            return (f"the model's config sets {name}={value!r}: its logits are scaled or capped before the "
                    "softmax, a step the arithmetic does not specify; use TRL's own head for this model")
    return None


def _gather_lm_head(weight: torch.Tensor) -> Any:
    """TRL's ``maybe_gather_lm_head_ctx``: under DeepSpeed ZeRO-3 the LM head's weight is partitioned
    (``numel`` 0 outside its module's forward) and a fused head reads it without calling the module, so
    it is gathered for the read; a null context without ZeRO-3 or when the weight is gathered already."""
    from trl.trainer import utils

    return utils.maybe_gather_lm_head_ctx(weight)


def _gather_in_backward(out: Any, weight: torch.Tensor) -> None:
    """Enter :func:`_gather_lm_head` again around the backward of the autograd node that computed
    ``out`` (the first custom ``Function`` node behind its outputs): it makes each chunk's logits again
    from the weight, as TRL's own head does inside its backward. Nothing to do when no output needs a
    gradient."""
    roots = [t.grad_fn for t in (out.selected_logp, out.entropy) if t is not None and t.grad_fn is not None]
    if not roots:
        return
    node, seen, queue = None, set(), list(roots)
    while queue and node is None:
        current = queue.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, torch.autograd.function.BackwardCFunction):
            node = current
        else:
            queue.extend(edge[0] for edge in current.next_functions)
    if node is None:
        raise LogprobContractError("rl_engine's head found no autograd node of selected_logprob_from_hidden behind "
                                   "its outputs, so it cannot gather a ZeRO-3 weight for the backward")
    held: list[Any] = []

    def enter(_grad_outputs: Any) -> None:
        held.append(_gather_lm_head(weight))
        held[-1].__enter__()

    def leave(_grad_inputs: Any, _grad_outputs: Any) -> None:
        held.pop().__exit__(None, None, None)

    node.register_prehook(enter)
    node.register_hook(leave)


def add_rl_engine_lm_head(model: Any, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                          outputs: tuple[str, ...] = ("log_probs",), *, num_vocab_tiles: int | str = "auto",
                          chunk_tokens: int = DEFAULT_CHUNK_TOKENS, backend: str = "auto") -> None:
    """Patch ``model`` as ``trl.trainer.utils.add_fused_lm_head`` does, computing with rl_engine.

    ``model(..., labels=labels, fused_lm_head=True)`` then returns TRL's ``FusedCausalLMOutput``:
    ``log_probs`` (0 where the next-token label is -100), ``entropy`` (when asked for in
    ``outputs``; 0 there too) and ``loss`` (minus the mean log-prob), from the backbone's last
    hidden state and the LM head's weight, at ``temperature``. Without ``fused_lm_head`` the model's
    forward is the one it had (generation is unchanged). ``num_vocab_tiles``, ``chunk_tokens`` and
    ``backend`` are :func:`selected_logprob_from_hidden`'s."""
    from trl.trainer.utils import FusedCausalLMOutput

    unknown = [name for name in outputs if name not in SUPPORTED_OUTPUTS]
    if unknown:
        raise LogprobContractError(f"outputs={tuple(outputs)!r}: {unknown} are not computed by rl_engine's head; "
                                   f"ask for {SUPPORTED_OUTPUTS} only")
    text_config = model.config.get_text_config()
    problem = _scaling_problem(text_config)
    if problem is not None:
        raise LogprobContractError(problem)
    want_entropy = "entropy" in outputs
    original_forward = model.forward

    @functools.wraps(type(model).forward)
    def _forward(self: Any, *args: Any, fused_lm_head: bool = False, labels: Any = None, shift_labels: Any = None,
                 num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        if not fused_lm_head:
            for name, value in (("labels", labels), ("shift_labels", shift_labels),
                                ("num_items_in_batch", num_items_in_batch)):
                if value is not None:
                    kwargs[name] = value
            return original_forward(*args, **kwargs)
        kwargs["use_cache"] = False
        backbone = self.base_model(*args, **kwargs)
        if shift_labels is None:
            hidden, targets = backbone.last_hidden_state[:, :-1], labels[:, 1:]
        else:
            hidden, targets = backbone.last_hidden_state, shift_labels
        lm_head = self.get_output_embeddings()
        if getattr(lm_head, "bias", None) is not None:
            raise LogprobContractError("the LM head has a bias; rl_engine's head takes hidden @ weight.T only: use "
                                       "TRL's own head for this model")
        weight = lm_head.weight
        hidden, targets = hidden.to(weight.device), targets.to(weight.device)
        if cast_lm_head_to_fp32:
            hidden = hidden.float()
        elif hidden.dtype != weight.dtype:
            hidden = hidden.to(weight.dtype)  # the logits' dtype is the head weight's
        mask = targets != -100
        # autocast would change the chunks' matmul dtype under the contract's feet: the head computes
        # in its weight's dtype (float32 with cast_lm_head_to_fp32). ZeRO-3 partitions the weight: it is
        # read inside TRL's own gather, here and in the backward that makes the chunks' logits again.
        with torch.autocast(hidden.device.type, enabled=False), _gather_lm_head(weight):
            out = selected_logprob_from_hidden(hidden, weight.float() if cast_lm_head_to_fp32 else weight, targets,
                                               num_vocab_tiles=num_vocab_tiles, temperature=temperature,
                                               compute_entropy=want_entropy, chunk_tokens=chunk_tokens, backend=backend)
        _gather_in_backward(out, weight)
        log_probs = out.selected_logp  # 0 on -100 labels (inactive rows)
        entropy = out.entropy.masked_fill(~mask, 0.0) if want_entropy else None
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask)

    model.forward = types.MethodType(_forward, model)


def rl_engine_trainer(base: type, **head_options: Any) -> type:
    """``base`` (TRL's ``GRPOTrainer`` or a subclass of it) whose fused LM head is rl_engine's:
    TRL's ``add_fused_lm_head`` is replaced by :func:`add_rl_engine_lm_head` (with
    ``head_options``) while the trainer is built, for the policy and the reference model alike."""
    import trl.trainer.grpo_trainer as grpo_module

    class _Trainer(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            head = functools.partial(add_rl_engine_lm_head, **head_options)
            with mock.patch.object(grpo_module, "add_fused_lm_head", head):
                super().__init__(*args, **kwargs)

    _Trainer.__name__ = _Trainer.__qualname__ = f"RLEngine{base.__name__}"
    return _Trainer


def __getattr__(name: str) -> Any:
    """``RLEngineGRPOTrainer``: TRL's ``GRPOTrainer`` with rl_engine's head (built on first use, so
    importing this module does not import TRL)."""
    if name == "RLEngineGRPOTrainer":
        from trl import GRPOTrainer

        trainer = rl_engine_trainer(GRPOTrainer)
        globals()[name] = trainer
        return trainer
    raise AttributeError(name)


__all__ = ["add_rl_engine_lm_head", "rl_engine_trainer"]  # and RLEngineGRPOTrainer, made on first use
