"""Adapters that make a trainer's logprob and entropy rl_engine's.

- :mod:`rl_engine.integrations.trl`: TRL's ``GRPOTrainer`` (its fused LM head replaced by
  :func:`rl_engine.logprob.hidden.selected_logprob_from_hidden`): ``RLEngineGRPOTrainer`` or
  ``add_rl_engine_lm_head``; needs the ``trl`` extra.
- :mod:`rl_engine.integrations.verl`: drop-ins for verl's ``logprobs_from_logits`` and
  ``entropy_from_logits`` with their signatures (torch only).

Recipes: docs/trainer.md, "TRL and verl".
"""
