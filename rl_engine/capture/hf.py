"""Capture from a Hugging Face ``transformers`` causal LM forward pass.

:func:`capture_causal_lm` runs one forward pass of a padded batch and keeps, for every
sequence in batch order, the logits of each real position but the last with the token that
follows it as the target (the usual shift by one). Padding rows (``attention_mask == 0``) are
not part of the capture, so a sequence's rows do not depend on how it was padded or batched:
two engines that batched the same sequences differently give captures of the same tokens once
their batches are joined in the same sequence order (:func:`concat_captures`). ``active``
comes from the attention mask of the target and, when given, a response mask (RL scores the
response tokens only). Position ids follow the attention mask, so left padding gives the same
positions as right padding.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.capture.format import DTYPE_NAMES, SAMPLING, Capture, CaptureError, RowSampling, build_metadata


def capture_causal_lm(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    response_mask: torch.Tensor | None = None,
    model_name: str | None = None,
    notes: str = "",
) -> Capture:
    """One forward pass of ``model`` on ``[batch, seq]`` ids as a :class:`Capture`.

    ``attention_mask`` (1 for real tokens, 0 for padding, left or right) and the optional
    ``response_mask`` (true where a token counts) have the ids' shape. The engine's own
    logprob is not recorded (``reported_logp`` stays absent): a transformers forward pass
    returns logits only.
    """
    import transformers

    if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
        raise CaptureError(f"input_ids: shape {list(input_ids.shape)}, dtype {input_ids.dtype}; "
                           "give [batch, seq] int64 token ids")
    for name, mask in (("attention_mask", attention_mask), ("response_mask", response_mask)):
        if mask is not None and tuple(mask.shape) != tuple(input_ids.shape):
            raise CaptureError(f"{name}: shape {list(mask.shape)} must equal input_ids' "
                               f"{list(input_ids.shape)}")
    real = attention_mask.to(torch.bool)
    for b in range(real.shape[0]):
        where = real[b].nonzero().flatten()
        if where.numel() < 2 or int(where[-1] - where[0]) + 1 != where.numel():
            raise CaptureError(f"attention_mask: sequence {b} has {where.numel()} real token(s) "
                               "or a hole; each sequence needs at least two contiguous real tokens "
                               "(padding on the left or on the right only)")
    positions = (real.to(torch.int64).cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=real.to(torch.int64),
                       position_ids=positions).logits
    if logits.dtype not in DTYPE_NAMES:
        raise CaptureError(f"the model returned {logits.dtype} logits; a capture holds bf16, fp16 "
                           "or fp32")
    counts = response_mask.to(torch.bool) if response_mask is not None else real
    rows, targets, active = [], [], []
    for b in range(real.shape[0]):
        where = real[b].nonzero().flatten()
        src, nxt = where[:-1], where[1:]
        rows.append(logits[b, src])
        targets.append(input_ids[b, nxt])
        active.append(counts[b, nxt] & real[b, nxt])
    config = model.config
    name = model_name or getattr(config, "name_or_path", "") or type(model).__name__
    attn = getattr(config, "_attn_implementation", None)
    text = f"attn_implementation={attn}" + (f"; {notes}" if notes else "")
    metadata = build_metadata(
        engine="transformers", engine_version=f"transformers {transformers.__version__}, "
        f"torch {torch.__version__}", model=name, dtype=DTYPE_NAMES[logits.dtype], tp=1,
        notes=text,
    )
    return Capture(torch.cat(rows).contiguous(), torch.cat(targets).contiguous(),
                   torch.cat(active).contiguous(), None, metadata)


def concat_captures(captures: list[Capture], notes: str | None = None) -> Capture:
    """Captures of consecutive batches of one engine joined in order (one file per side).

    They must agree on the logits' dtype and vocabulary and on every metadata key but
    ``notes`` (joined, or replaced by ``notes``).
    """
    if not captures:
        raise CaptureError("concat_captures: no captures given; give at least one")
    first = captures[0]
    for i, cap in enumerate(captures[1:], start=1):
        for key in ("engine", "engine_version", "model", "dtype", "tp"):
            if cap.metadata[key] != first.metadata[key]:
                raise CaptureError(f"concat_captures: capture {i} has metadata {key}="
                                   f"{cap.metadata[key]!r}, capture 0 {first.metadata[key]!r}; "
                                   "join captures of one engine only")
        if cap.vocab != first.vocab:
            raise CaptureError(f"concat_captures: capture {i} has vocab {cap.vocab}, capture 0 "
                               f"{first.vocab}; join captures of one model only")
    joined: dict[str, torch.Tensor] = {}
    for name in ("reported_logp", "sampling", "reported_processed_logp"):
        parts = [getattr(c, name) for c in captures]
        if any(r is None for r in parts) and not all(r is None for r in parts):
            raise CaptureError(f"concat_captures: {name} is present in some captures only; "
                               "give it for all or none")
        if parts[0] is not None and name != "sampling":
            joined[name] = torch.cat(parts)
    sampling = None if first.sampling is None else RowSampling(
        *(torch.cat([c.sampling.tensors()[n] for c in captures]) for n in SAMPLING))  # type: ignore[union-attr]
    metadata = dict(first.metadata)
    metadata["notes"] = notes if notes is not None else " | ".join(
        dict.fromkeys(c.metadata["notes"] for c in captures))
    return Capture(
        torch.cat([c.logits for c in captures]), torch.cat([c.targets for c in captures]),
        torch.cat([c.active for c in captures]), joined.get("reported_logp"), metadata,
        sampling=sampling, reported_processed_logp=joined.get("reported_processed_logp"),
    )


__all__ = ["capture_causal_lm", "concat_captures"]
