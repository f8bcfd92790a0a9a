"""A rollout with a real vLLM engine, the trainer's side with transformers, and the parity report.

Runs in two environments, because vLLM pins its own packages (docs/capture.md, "From vLLM"):

    # 1. the tiny model (any environment with transformers), then the rollout (vLLM's environment):
    python examples/vllm_rollout.py model  work/model
    .ci/vllm-env/bin/python examples/vllm_rollout.py rollout work/model work/rollout.safetensors
    # 2. the trainer's side (rl_engine's environment), then parity and a campaign on the capture:
    python examples/vllm_rollout.py trainer work/model work/rollout.safetensors work/trainer.safetensors
    python -m rl_engine parity work/rollout.safetensors work/trainer.safetensors --output-dir work/parity
    # the campaign: config.yaml with inputs: {capture: work/rollout.safetensors}, batch: 2, seq: 24,
    # real_vocab: 4096, padded_vocab: 4096, dtype: bf16 (docs/capture.md, "A campaign on a capture"),
    # then snakemake --cores 8 (tests/test_vllm.py runs this campaign through the same verbs)

The model is a tiny random Qwen2 (vocabulary 4096 by default; ``--vocab 151936`` for Qwen's) made
from a config, offline; the prompts are token ids of different lengths (ragged, as in every RL
batch), so vLLM runs without a tokenizer (``skip_tokenizer_init``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

PROMPT_LENGTHS = (5, 11, 8)
MAX_TOKENS = 9  # 12 + 19 + 16 = 48 rows with the prompts above: 2 sequences of 24 for CP = 2 (zigzag)
TEMPERATURE = 0.7


def make_model(path: str | os.PathLike[str], vocab: int = 4096) -> None:
    """A tiny random bf16 Qwen2 (2 layers, hidden 64, head_dim 32) saved at ``path``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                         initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def prompts(vocab: int, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    """Token-id prompts of the given lengths (a fixed pseudo-random choice)."""
    return [[(7919 * (i + 1) + 104729 * j) % vocab for j in range(n)] for i, n in enumerate(lengths)]


def engine(model: str, **kwargs):
    """An offline vLLM engine on ``model`` for rl_engine's worker extension (CPU-friendly settings)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default asks for most of the RAM
    from vllm import LLM

    from rl_engine.integrations.vllm import WORKER_EXTENSION

    args = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256,
                seed=0, enable_prefix_caching=False, worker_extension_cls=WORKER_EXTENSION)
    args.update(kwargs)
    return LLM(**args)


def rollout(model: str, out: str, vocab: int | None = None) -> None:
    """Generate from ragged prompts with vLLM and write the capture (prompt rows included)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rl_engine.capture import write_capture
    from rl_engine.integrations import vllm as rv

    llm = engine(model)
    vocab = vocab or llm.llm_engine.model_config.get_vocab_size()
    rv.install(llm, capture=True, prompt_rows=True)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, logprobs=0, prompt_logprobs=0,
                            seed=1, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(vocab)], params)
    digest = write_capture(out, rv.collect(llm, outputs, model_name="tiny-qwen2"))
    print(json.dumps({"capture": out, "sha256": digest}))


def trainer(model: str, rollout_path: str, out: str) -> None:
    """The trainer's capture of the rollout's tokens (prompt + generated) with transformers."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    from rl_engine.capture import read_capture, write_capture
    from rl_engine.capture.hf import capture_causal_lm, concat_captures

    rolled = read_capture(rollout_path)
    info = json.loads(rolled.metadata["notes"].splitlines()[-1])["vllm"]["requests"]
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    parts, start = [], 0
    for req in info:
        if not req["prompt_rows"]:
            raise SystemExit(f"request {req['request_id']} was captured without its prompt rows; roll out with "
                             "prompt_rows=True so the trainer's capture has the same rows")
        rows = req["prompt_tokens"] - 1 + req["generated_tokens"]
        ids = torch.cat([torch.tensor([req["first_token"]]), rolled.targets[start:start + rows]])
        response = torch.zeros(ids.numel(), dtype=torch.int64)
        response[req["prompt_tokens"]:] = 1
        parts.append(capture_causal_lm(lm, ids.view(1, -1), torch.ones_like(ids).view(1, -1),
                                       response_mask=response.view(1, -1), model_name="tiny-qwen2"))
        start += rows
    print(json.dumps({"capture": out, "sha256": write_capture(out, concat_captures(parts))}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("model", help="make the tiny Qwen2")
    p.add_argument("path")
    p.add_argument("--vocab", type=int, default=4096)
    p = sub.add_parser("rollout", help="roll out with vLLM (run with vLLM's python)")
    p.add_argument("model")
    p.add_argument("out")
    p = sub.add_parser("trainer", help="the trainer's capture with transformers")
    p.add_argument("model")
    p.add_argument("rollout")
    p.add_argument("out")
    args = parser.parse_args(argv)
    if args.verb == "model":
        make_model(args.path, args.vocab)
    elif args.verb == "rollout":
        rollout(args.model, args.out)
    else:
        trainer(args.model, args.rollout, args.out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
