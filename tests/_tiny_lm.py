"""Tiny transformers causal LMs built from a config (fixed seed, nothing downloaded): a Llama and the
two captures of one token batch that the capture and parity tests compare, and a Qwen2-MoE (a
router, experts and a load-balancing loss) for the trainer integration's tests."""

from __future__ import annotations

import copy
import os

import torch

VOCAB = 4096
LENGTHS = (7, 12, 9, 5)  # a mixed batch: sequences of different lengths


def tiny_model() -> torch.nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched (the model is built from a config)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def tiny_qwen2(vocab: int = 256) -> torch.nn.Module:
    """A float32 Qwen2 of 2 layers, hidden 32, built from a config with seed 0 (the TRL tests' policy;
    pad 0 and eos/bos 1, the ids their WordLevel tokenizer gives those specials)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return Qwen2ForCausalLM(config)


def tiny_moe(vocab: int = 256, router_aux_loss_coef: float = 0.01) -> torch.nn.Module:
    """A Qwen2-MoE of 2 layers, 4 experts (2 per token) and a shared expert, whose config asks for its
    router logits (``output_router_logits``), so its own forward adds the load-balancing loss."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        output_router_logits=True, router_aux_loss_coef=router_aux_loss_coef, pad_token_id=0, eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(config)


def sequences() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENGTHS]


def padded(seqs: list[torch.Tensor], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    mask = torch.zeros(len(seqs), width, dtype=torch.int64)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols], mask[i, cols] = s, 1
    return ids, mask


def variant(model: torch.nn.Module, dtype: torch.dtype, attn: str) -> torch.nn.Module:
    other = copy.deepcopy(model).to(dtype)
    other.set_attn_implementation(attn)
    return other
