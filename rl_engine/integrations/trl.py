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

A mixture-of-experts model keeps its load-balancing loss as with TRL's head: router logits when the
call or the config asks for them, ``aux_loss`` and ``loss + router_aux_loss_coef * aux_loss`` (TRL's
GRPO stacks each micro-batch's ``aux_loss``: a head returning None stopped ``train()``).

Under DeepSpeed ZeRO-3 the LM head's weight is read inside TRL's own ``maybe_gather_lm_head_ctx``, in
the forward and again in the backward that makes the chunks' logits again, as TRL's head reads it.

The head computes in its weight's dtype, or under autocast in autocast's dtype as the model's own
head does (``cast_lm_head_to_fp32``: float32, autocast off). What is refused, naming the setting: an LM head with a
bias, a model whose config scales or caps
its logits (``final_logit_softcapping``, ``logit_scale`` and its relatives: the arithmetic would
need that step specified first), and per-token outputs other than ``log_probs`` and ``entropy``.
"""

from __future__ import annotations

import contextlib
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


def router_aux_loss(model: Any, text_config: Any, router_logits: Any, attention_mask: Any) -> torch.Tensor:
    """An MoE's load-balancing loss from the backbone's router logits, as the model's own forward and
    TRL's fused head compute it: transformers' ``load_balancing_loss_func`` (Mixtral's, which every MoE
    family shares through transformers' modular files) with the model's expert count and top-k (the
    attributes its forward reads, else its config's) and the attention mask (None when padding-free)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    counts = {}
    for name in ("num_experts", "num_experts_per_tok"):
        value = getattr(model, name, getattr(text_config, name, None))
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LogprobContractError(f"the model asks for its router logits (output_router_logits) but neither it "
                                       f"nor its config has a positive integer {name} (found {value!r}); the "
                                       "load-balancing loss needs it: use TRL's own head for this model")
        counts[name] = value
    if router_logits is None:
        raise LogprobContractError("the backbone returned no router_logits although output_router_logits was asked "
                                   "for; the load-balancing loss needs them: use TRL's own head for this model")
    return load_balancing_loss_func(router_logits, counts["num_experts"], counts["num_experts_per_tok"],
                                    attention_mask)


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
                          chunk_tokens: int = DEFAULT_CHUNK_TOKENS, backend: str = "auto",
                          grad_weight_fp32: bool = True, matmul: str = "auto", keep_logits: bool = False) -> None:
    """Patch ``model`` as ``trl.trainer.utils.add_fused_lm_head`` does, computing with rl_engine.

    ``model(..., labels=labels, fused_lm_head=True)`` then returns TRL's ``FusedCausalLMOutput``:
    ``log_probs`` (0 where the next-token label is -100), ``entropy`` (when asked for in
    ``outputs``; 0 there too) and ``loss`` (minus the mean log-prob), from the backbone's last
    hidden state and the LM head's weight, at ``temperature``. A mixture-of-experts model's router loss
    is kept as TRL's head keeps it: router logits are asked of the backbone when the call or the
    model's config (``output_router_logits``) asks, and then ``aux_loss`` is :func:`router_aux_loss`
    and ``loss`` adds ``router_aux_loss_coef * aux_loss``. Without ``fused_lm_head`` the model's
    forward is the one it had (generation is unchanged). ``num_vocab_tiles``, ``chunk_tokens``,
    ``backend``, ``grad_weight_fp32`` (default True: the weight's gradient summed in binary32, at TRL's
    accuracy), ``matmul`` and ``keep_logits`` (default False: the backward makes each chunk's logits again;
    True keeps the forward's, the memory of the whole logits of the completion tokens, for one product
    fewer, the same bytes) are :func:`selected_logprob_from_hidden`'s. TRL samples a batch at one
    temperature (``GRPOConfig.temperature``), the patched one; a trainer whose rows were sampled at
    different temperatures passes ``temperature=`` to the fused call, a tensor of the targets' shape
    (``labels[:, 1:]``, or ``shift_labels``): one per token, in place of the patched number."""
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
    patched_temperature = temperature

    @functools.wraps(type(model).forward)
    def _forward(self: Any, *args: Any, fused_lm_head: bool = False, labels: Any = None, shift_labels: Any = None,
                 num_items_in_batch: Any = None, temperature: Any = None, **kwargs: Any) -> Any:
        if temperature is not None and not fused_lm_head:
            raise LogprobContractError("temperature= is a fused_lm_head=True argument (the head's temperature); "
                                       "without the fused head the model returns its logits: divide them yourself")
        if not fused_lm_head:
            for name, value in (("labels", labels), ("shift_labels", shift_labels),
                                ("num_items_in_batch", num_items_in_batch)):
                if value is not None:
                    kwargs[name] = value
            return original_forward(*args, **kwargs)
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):  # an MoE whose config asks for its router loss
            kwargs.setdefault("output_router_logits", True)
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
        autocasting = torch.is_autocast_enabled(hidden.device.type)
        if cast_lm_head_to_fp32:
            hidden = hidden.float()
        elif hidden.dtype != weight.dtype and not autocasting:
            hidden = hidden.to(weight.dtype)  # the logits' dtype is the head weight's
        mask = targets != -100
        # Under autocast (GRPOConfig's default bf16=True) the logits are made in autocast's dtype, as the
        # model's own head and TRL's make them; cast_lm_head_to_fp32 computes in float32 with autocast off.
        # ZeRO-3 partitions the weight: it is read inside TRL's own gather, here and in the backward that
        # makes the chunks' logits again.
        precision = torch.autocast(hidden.device.type, enabled=False) if cast_lm_head_to_fp32 else contextlib.nullcontext()
        with precision, _gather_lm_head(weight):
            out = selected_logprob_from_hidden(hidden, weight.float() if cast_lm_head_to_fp32 else weight, targets,
                                               num_vocab_tiles=num_vocab_tiles,
                                               temperature=patched_temperature if temperature is None else temperature,
                                               compute_entropy=want_entropy, chunk_tokens=chunk_tokens, backend=backend,
                                               grad_weight_fp32=grad_weight_fp32, matmul=matmul,
                                               keep_logits=keep_logits)
        _gather_in_backward(out, weight)
        log_probs = out.selected_logp  # 0 on -100 labels (inactive rows)
        entropy = out.entropy.masked_fill(~mask, 0.0) if want_entropy else None
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        aux_loss = None
        if kwargs.get("output_router_logits"):
            aux_loss = router_aux_loss(self, text_config, backbone.router_logits, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, label_mask=mask, aux_loss=aux_loss)

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


__all__ = ["add_rl_engine_lm_head", "rl_engine_trainer", "router_aux_loss"]  # and RLEngineGRPOTrainer, made on first use
