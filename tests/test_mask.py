"""Which tokens are active: the case's inputs' mask, as report acceptance reads it.

The recipe's mask is its rule of ``prompt_tokens`` (:func:`rl_engine.campaign.mask.recipe_active`, what
``make_inputs`` makes); a capture's is its own, which its reports record (``active_mask``) and which must
hash to ``inputs_sha256.mask``. The end-to-end case (a capture with prompts of 2 and 5 tokens through
every verb to a verified archive) is ``tests/test_capture_campaign.py::test_a_capture_with_ragged_prompts_runs_to_a_verified_archive``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl_engine.campaign.inputs import inputs_sha256, make_inputs
from rl_engine.campaign.mask import MaskError, mask_sha256, pack_mask, recipe_active, report_active, unpack_mask

RECIPE = {"batch": 2, "seq": 8, "prompt_tokens": 3, "real_vocab": 60, "padded_vocab": 64, "seed": 7}


def test_the_recipe_mask_is_make_inputs_mask_and_its_hash_is_inputs_sha256() -> None:
    logits, targets, active = make_inputs(RECIPE)
    rule = recipe_active(np.arange(16), 8, 3)
    assert rule.tobytes() == active.numpy().tobytes()
    assert mask_sha256(rule) == inputs_sha256(logits, targets, active)["mask"]
    mask, why = report_active({"case": RECIPE})
    assert why is None and mask is not None and mask.tobytes() == rule.tobytes()


@pytest.mark.parametrize("tokens", [1, 7, 8, 9, 16, 17])
def test_a_recorded_mask_round_trips_with_its_hash(tokens: int) -> None:
    active = torch.Generator().manual_seed(tokens)
    mask = torch.rand(tokens, generator=active) < 0.5
    mask[0] = True
    text = pack_mask(mask.numpy())
    assert len(text) == 2 * ((tokens + 7) // 8) and text == text.lower()
    back = unpack_mask(text, tokens, mask_sha256(mask.numpy()))
    assert back.tobytes() == mask.numpy().tobytes()
    assert mask_sha256(back) == inputs_sha256(torch.zeros(tokens, 1), torch.zeros(tokens, dtype=torch.int64),
                                              mask)["mask"]


def _capture_report(mask: np.ndarray, **changes: object) -> dict[str, object]:
    report: dict[str, object] = {"case": {"batch": 2, "seq": 8, "prompt_tokens": 3, "capture": {"sha256": "x"}},
                                 "inputs_sha256": {"mask": mask_sha256(mask)}, "active_mask": pack_mask(mask)}
    report.update(changes)
    return {k: v for k, v in report.items() if v is not None}


def test_a_capture_report_gives_its_recorded_mask_and_never_the_prompt_tokens_rule() -> None:
    ragged = (np.arange(16) % 8) >= np.repeat([2, 5], 8)  # prompts of 2 and 5 tokens
    mask, why = report_active(_capture_report(ragged))
    assert why is None and mask is not None and mask.tobytes() == ragged.tobytes()
    assert mask.tobytes() != recipe_active(np.arange(16), 8, 3).tobytes()


@pytest.mark.parametrize(("changes", "needle"), [
    ({"active_mask": None}, "missing: a case on a capture records the capture's active mask"),
    ({"active_mask": pack_mask(recipe_active(np.arange(16), 8, 3))}, "not to inputs_sha256.mask"),
    ({"active_mask": "FC1F"}, "it must be the lowercase hex of 2 bytes"),
    ({"active_mask": "fc"}, "is a string of 2 characters; it must be the lowercase hex of 2 bytes"),
    ({"active_mask": 7}, "is 7; it must be the lowercase hex"),
    ({"active_mask": "0000"}, "holds no active token"),
    ({"inputs_sha256": None}, "not to inputs_sha256.mask None"),
])
def test_a_recorded_mask_that_is_not_the_runs_is_named(changes: dict[str, object], needle: str) -> None:
    ragged = (np.arange(16) % 8) >= np.repeat([2, 5], 8)
    mask, why = report_active(_capture_report(ragged, **changes))
    assert mask is None and why is not None and needle in why, why


def test_bits_past_the_last_token_and_a_mask_on_a_recipe_case_are_refused() -> None:
    with pytest.raises(MaskError, match="sets a bit past the case's 9 tokens"):
        unpack_mask("ff03", 9, mask_sha256(np.ones(9, bool)))
    assert unpack_mask("ff01", 9, mask_sha256(np.ones(9, bool))).all()  # control: the same mask, canonical
    mask, why = report_active({"case": RECIPE, "active_mask": "ff03"})
    assert mask is None and why is not None and "present on a case of the input recipe" in why
