"""GRPO loss contract and the single-process loss: rules, fingerprints, identities, oracle.

The oracle is a plain PyTorch GRPO written here, sharing nothing with ``rl_engine.grpo``:
full-vocabulary ``log_softmax``, ``torch.mean``/``torch.std``, masked sums and autograd.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from typing import Any

import pytest
import torch

from rl_engine.grpo import GRPOContract, GRPOContractError, GRPOLoss
from rl_engine.grpo.objective import ordered_sum
from rl_engine.logprob.contract import LogprobContract
from rl_engine.logprob.registry import BackendUnavailableError, dispatch
from rl_engine.tensorio import fingerprint, tensor_bytes

from _grpo_inputs import GROUP, PADDED_VOCAB, REAL_VOCAB, SEQ_LEN, SEQS, TILES, grpo_inputs

SEED = 7
LOGPROB = {"real_vocab_size": REAL_VOCAB, "padded_vocab_size": PADDED_VOCAB,
           "num_vocab_tiles": TILES, "logits_dtype": "fp32"}

# FP32 round-off scale bounds. Measured on the CPU build (FP32 logits, the oracle cases below):
# max |loss diff| 7.5e-8 (loss ~0.04-0.08), max |grad diff| 1.9e-8 (grad up to ~0.019).
SCALAR_ATOL = 2e-6
GRAD_ATOL = 1e-7


def make_contract(**overrides: Any) -> GRPOContract:
    """``GRPOContract.build`` with small defaults; ``logprob`` overrides merge into LOGPROB."""
    kwargs: dict[str, Any] = {"num_sequences": SEQS, "seq_len": SEQ_LEN, "group_size": GROUP}
    logprob = dict(LOGPROB)
    logprob.update(overrides.pop("logprob", {}))
    kwargs.update(overrides)
    return GRPOContract.build(logprob=logprob, **kwargs)


def run_loss(contract: GRPOContract, data: dict[str, torch.Tensor], with_ref: bool = True,
             **kw: Any) -> tuple[Any, torch.Tensor]:
    logits = data["logits"].clone().requires_grad_()
    out = GRPOLoss(**kw)(
        logits, data["actions"], data["old"], data["rewards"], data["active"], contract,
        ref_logits=data["ref"] if with_ref else None,
    )
    out.loss.backward()
    assert logits.grad is not None
    return out, logits.grad


# ----- the independent oracle ----------------------------------------------------------------
def oracle_grpo(data: dict[str, torch.Tensor], *, group_size: int, eps_low: float,
                eps_high: float, advantage_mode: str, adv_eps: float, kl_estimator: str,
                beta: float, reduction: str, normalizer: float | None,
                with_ref: bool) -> dict[str, torch.Tensor]:
    """Plain single-process GRPO on full FP32 logits, with autograd."""
    logits = data["logits"].float().clone().requires_grad_()
    active = data["active"].view(SEQS, SEQ_LEN)
    mask = active.float()
    safe = torch.where(data["active"], data["actions"], torch.zeros_like(data["actions"]))
    logp = torch.log_softmax(logits[:, :REAL_VOCAB], dim=-1).gather(1, safe[:, None])
    logp = logp.view(SEQS, SEQ_LEN)
    grouped = data["rewards"].view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if advantage_mode == "group_mean_std":
        adv = centered / (grouped.std(dim=1, keepdim=True) + adv_eps)
    else:
        adv = centered
    adv = adv.reshape(SEQS, 1)
    old = data["old"].view(SEQS, SEQ_LEN)
    ratio = torch.exp(logp - old) * mask + (1.0 - mask)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
    per_token = -surrogate
    kl = None
    if with_ref:
        ref = torch.log_softmax(data["ref"].float()[:, :REAL_VOCAB], dim=-1)
        ref = ref.gather(1, safe[:, None]).view(SEQS, SEQ_LEN)
        if kl_estimator == "k3":
            kl = torch.exp(ref - logp) - (ref - logp) - 1
        else:
            kl = logp - ref
        if beta > 0:
            per_token = per_token + beta * kl

    def reduce(values: torch.Tensor) -> torch.Tensor:
        masked = values * mask
        if reduction == "token_mean":
            return masked.sum() / mask.sum()
        if reduction == "sequence_mean":
            return (masked.sum(dim=1) / mask.sum(dim=1)).mean()
        assert normalizer is not None
        return masked.sum() / normalizer

    loss = reduce(per_token)
    loss.backward()
    clipped = (((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))) & active
    assert logits.grad is not None
    return {
        "loss": loss.detach(),
        "policy_loss": reduce(-surrogate).detach(),
        "kl": reduce(kl).detach() if kl is not None else None,
        "advantages": adv.detach().reshape(-1),
        "clip_fraction": clipped.sum() / mask.sum(),
        "grad": logits.grad,
    }


# ----- contract rules -------------------------------------------------------------------------
INVALID: list[tuple[dict[str, Any], str]] = [
    ({"num_sequences": 0}, "num_sequences=0"),
    ({"num_sequences": 8.0}, "num_sequences=8.0"),
    ({"group_size": 1}, "group_size=1"),
    ({"group_size": True}, "group_size=True"),
    ({"group_size": 3}, "group_size=3 does not divide num_sequences=8"),
    ({"dp_world_size": 0}, "dp_world_size=0"),
    ({"dp_world_size": 2, "dp_rank": 2}, "dp_rank=2 must be < dp_world_size=2"),
    ({"dp_world_size": 3}, "cannot be split evenly over dp_world_size=3"),
    ({"dp_world_size": 2, "dp_sequence_bounds": ((0, 8),)}, "has 1 shards but dp_world_size=2"),
    ({"dp_world_size": 2, "dp_sequence_bounds": ((0, 3), (4, 8))}, "starts at 4 but must start at 3"),
    ({"dp_world_size": 2, "dp_sequence_bounds": ((0, 0), (0, 8))}, "dp_sequence_bounds[0]=(0, 0) is empty"),
    ({"dp_world_size": 2, "dp_sequence_bounds": ((0, 3), (3, 7))}, "end at 7 but must cover"),
    ({"dp_world_size": 2, "dp_sequence_bounds": ((0, 3, 5), (3, 8))}, "must be a (start, end) pair"),
    ({"dp_world_size": 2, "dp_sequence_bounds": "abc"}, "dp_sequence_bounds='abc'"),
    ({"clip_eps_low": -0.1}, "clip_eps_low=-0.1"),
    ({"clip_eps_low": 1.0}, "clip_eps_low=1.0 must lie in [0, 1)"),
    ({"clip_eps_low": float("nan")}, "clip_eps_low=nan must be finite"),
    ({"clip_eps_low": "0.2"}, "clip_eps_low='0.2' must be a real number"),
    ({"clip_eps_high": -0.01}, "clip_eps_high=-0.01 must be >= 0"),
    ({"clip_eps_high": float("inf")}, "clip_eps_high=inf must be finite"),
    ({"advantage_mode": "group_std"}, "advantage_mode='group_std' is not supported"),
    ({"adv_eps": 0.0}, "adv_eps=0.0 must be > 0"),
    ({"adv_eps": -1e-6}, "adv_eps=-1e-06 must be > 0"),
    ({"advantage_mode": "group_mean", "adv_eps": 1e-6}, "advantage_mode='group_mean' uses no epsilon"),
    ({"kl_estimator": "k2"}, "kl_estimator='k2' is not supported"),
    ({"beta": -0.1}, "beta=-0.1 must be >= 0"),
    ({"beta": float("nan")}, "beta=nan must be finite"),
    ({"beta": None}, "beta=None must be a real number"),
    ({"reduction": "sum"}, "reduction='sum' is not supported"),
    ({"reduction": "constant"}, "constant_normalizer=None but reduction='constant' needs it"),
    ({"reduction": "constant", "constant_normalizer": 0.0}, "constant_normalizer=0.0 must be > 0"),
    ({"reduction": "token_mean", "constant_normalizer": 64.0}, "constant_normalizer=64.0 is set but"),
    ({"accumulation_dtype": "bf16"}, "accumulation_dtype='bf16' is not supported"),
    ({"summation_order": "torch_sum"}, "summation_order='torch_sum' is not supported"),
    ({"logprob": {"num_vocab_tiles": 300}}, "logprob: num_vocab_tiles=300 leaves its last tile with no column"),
    ({"logprob": {"cp_world_size": 2, "cp_layout": "zigzag"}, "seq_len": 6}, "cannot be split into 4 equal chunks"),
    ({"logprob": {"num_sequences": 4}}, "logprob['num_sequences'] is derived"),
]


@pytest.mark.parametrize("overrides,message", INVALID, ids=[m for _, m in INVALID])
def test_invalid_contracts_raise_naming_field_and_value(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(GRPOContractError) as info:
        make_contract(**overrides)
    assert message in str(info.value)


def test_nested_contract_must_match_the_dp_share() -> None:
    nested = LogprobContract(num_sequences=8, seq_len=SEQ_LEN, **LOGPROB)
    with pytest.raises(GRPOContractError, match=r"logprob.num_sequences=8 but dp_rank=1 holds "
                       r"sequences \[3, 8\) \(5\); build the nested logprob contract with "
                       r"num_sequences=5"):
        GRPOContract(logprob=nested, num_sequences=8, group_size=4, dp_world_size=2, dp_rank=1,
                     dp_sequence_bounds=((0, 3), (3, 8)))
    with pytest.raises(GRPOContractError, match="must be a LogprobContract"):
        GRPOContract(logprob=dict(LOGPROB), num_sequences=8, group_size=4)  # type: ignore[arg-type]


def test_valid_contract_resolves_defaults_and_serialises_strictly() -> None:
    contract = make_contract()
    assert contract.adv_eps == 1e-6 and contract.dp_sequence_bounds == ((0, SEQS),)
    assert make_contract(advantage_mode="group_mean").adv_eps is None
    assert make_contract(clip_eps_high=1).clip_eps_high == 1.0  # ints become floats
    data = contract.to_dict()
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    with pytest.raises(dataclasses.FrozenInstanceError):
        contract.beta = 1.0  # type: ignore[misc]


MESH = (2, 2, 2)  # tp, cp, dp
UNEVEN = ((0, 3), (3, 8))


def all_rank_contracts(layout: str = "zigzag", **overrides: Any) -> list[GRPOContract]:
    tp, cp, dp = MESH
    out = []
    for rank in range(tp * cp * dp):
        dp_cp, tp_rank = divmod(rank, tp)
        dp_rank, cp_rank = divmod(dp_cp, cp)
        out.append(make_contract(
            dp_world_size=dp, dp_rank=dp_rank, dp_sequence_bounds=UNEVEN,
            logprob={"tp_world_size": tp, "tp_rank": tp_rank, "cp_world_size": cp,
                     "cp_rank": cp_rank, "cp_layout": layout},
            **overrides,
        ))
    return out


def test_fingerprint_agrees_across_ranks_and_geometry_covers_every_token() -> None:
    contracts = all_rank_contracts()
    assert len({c.cross_rank_fingerprint() for c in contracts}) == 1
    seen: dict[int, int] = {}
    for rank, contract in enumerate(contracts):
        assert contract.rank == rank and contract.coords(rank) == (
            contract.dp_rank, contract.logprob.cp_rank, contract.logprob.tp_rank)
        assert contract.global_token_indices == contract.rank_token_indices(rank)
        assert contract.num_tokens == len(contract.global_token_indices)
        if contract.logprob.tp_rank == 0:
            for index in contract.global_token_indices:
                seen[index] = seen.get(index, 0) + 1
    assert sorted(seen) == list(range(SEQS * SEQ_LEN)) and set(seen.values()) == {1}
    # dp rank 1 holds sequences 3..7: its first token of cp rank 0 is sequence 3, position 0.
    assert contracts[4].global_token_indices[0] == 3 * SEQ_LEN


# One change per field that every rank must share (nested logprob fields included).
SENSITIVITY: dict[str, dict[str, Any]] = {
    "num_sequences": {"num_sequences": 12, "dp_sequence_bounds": ((0, 3), (3, 12))},
    "seq_len": {"seq_len": 24},
    "group_size": {"group_size": 2},
    "dp_world_size": {"dp_world_size": 4, "dp_sequence_bounds": ((0, 2), (2, 4), (4, 6), (6, 8))},
    "dp_sequence_bounds": {"dp_sequence_bounds": ((0, 4), (4, 8))},
    "clip_eps_low": {"clip_eps_low": 0.21},
    "clip_eps_high": {"clip_eps_high": 0.28},
    "advantage_mode": {"advantage_mode": "group_mean"},
    "adv_eps": {"adv_eps": 1e-4},
    "kl_estimator": {"kl_estimator": "k1"},
    "beta": {"beta": 0.04},
    "reduction": {"reduction": "sequence_mean"},
    "constant_normalizer": {"reduction": "constant", "constant_normalizer": 64.0},
    "logprob.real_vocab_size": {"logprob": {"real_vocab_size": 499}},
    "logprob.padded_vocab_size": {"logprob": {"padded_vocab_size": 1024}},
    "logprob.num_vocab_tiles": {"logprob": {"num_vocab_tiles": 4}},
    "logprob.tp_world_size": {"logprob": {"tp_world_size": 4}},
    "logprob.vocab_shard_bounds": {"logprob": {"vocab_shard_bounds": ((0, 128), (128, 512))}},
    "logprob.cp_world_size": {"logprob": {"cp_world_size": 1, "cp_rank": 0}},
    "logprob.cp_layout": {"logprob": {"cp_layout": "contiguous"}},
    "logprob.logits_dtype": {"logprob": {"logits_dtype": "bf16"}},
    "logprob.ignore_index": {"logprob": {"ignore_index": -1}},
    "logprob.determinism_scope": {"logprob": {"determinism_scope": "fixed_topology"}},
}
# Fields with a single allowed value (nothing to vary) or derived from another field.
FIXED_FIELDS = {"accumulation_dtype", "summation_order", "logprob.mask_mode",
                "logprob.accumulation_dtype", "logprob.output_dtype", "logprob.tile_width",
                "logprob.seq_len"}  # the nested seq_len is the top-level seq_len


def _base_rank0(**overrides: Any) -> GRPOContract:
    logprob = {"tp_world_size": 2, "tp_rank": 0, "cp_world_size": 2, "cp_rank": 0,
               "cp_layout": "zigzag"}
    logprob.update(overrides.pop("logprob", {}))
    kwargs: dict[str, Any] = {"dp_world_size": 2, "dp_rank": 0, "dp_sequence_bounds": UNEVEN}
    kwargs.update(overrides)
    return make_contract(logprob=logprob, **kwargs)


def test_fingerprint_is_sensitive_to_every_shared_field() -> None:
    base = _base_rank0()
    prints = {"base": base.cross_rank_fingerprint()}
    for name, change in SENSITIVITY.items():
        prints[name] = _base_rank0(**copy.deepcopy(change)).cross_rank_fingerprint()
        assert prints[name] != prints["base"], name
    assert len(set(prints.values())) == len(prints)
    shared = base.shared_dict()
    fields = {k for k in shared if k != "logprob"} | {f"logprob.{k}" for k in shared["logprob"]}
    assert fields - FIXED_FIELDS == set(SENSITIVITY), "every shared field needs a sensitivity case"


def test_rank_local_fields_do_not_enter_the_fingerprint() -> None:
    contracts = all_rank_contracts()
    assert {c.dp_rank for c in contracts} == {0, 1}
    assert len({c.logprob.num_sequences for c in contracts}) == 2  # uneven DP shares
    assert len({c.cross_rank_fingerprint() for c in contracts}) == 1
    assert "dp_rank" not in contracts[0].shared_dict()


# ----- the loss in one process ----------------------------------------------------------------
@pytest.fixture(scope="module")
def data() -> dict[str, torch.Tensor]:
    return grpo_inputs(SEED)


@pytest.mark.parametrize("estimator", ["k3", "k1"])
def test_reference_equal_to_policy_gives_kl_exactly_zero(
    data: dict[str, torch.Tensor], estimator: str
) -> None:
    same = dict(data, ref=data["logits"].clone())
    out, _ = run_loss(make_contract(beta=0.1, kl_estimator=estimator), same)
    assert out.kl is not None and out.sequence_stats.kl_sum is not None
    assert tensor_bytes(out.kl) == tensor_bytes(torch.tensor(0.0))
    assert tensor_bytes(out.sequence_stats.kl_sum) == tensor_bytes(torch.zeros(SEQS))
    # With the KL term exactly zero, the loss is the policy loss to the byte.
    assert tensor_bytes(out.loss.detach()) == tensor_bytes(out.policy_loss)
    # Control: a different reference gives a positive KL.
    other, _ = run_loss(make_contract(beta=0.1, kl_estimator=estimator), data)
    assert other.kl is not None and tensor_bytes(other.kl) != tensor_bytes(torch.tensor(0.0))


@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.0, 0.0)])
def test_old_equal_to_current_gives_ratio_one_and_no_clipping(
    data: dict[str, torch.Tensor], eps: tuple[float, float]
) -> None:
    contract = make_contract(clip_eps_low=eps[0], clip_eps_high=eps[1])
    op = dispatch("pytorch-vocab-parallel-logp-ws2", contract.logprob, "cpu").op
    current = op(data["logits"], data["actions"], data["active"], contract.logprob).selected_logp
    out, grad = run_loss(contract, dict(data, old=current.detach()), with_ref=False)
    assert tensor_bytes(out.ratio) == tensor_bytes(torch.ones(SEQS, SEQ_LEN))
    assert tensor_bytes(out.clip_fraction) == tensor_bytes(torch.tensor(0.0))
    assert tensor_bytes(out.sequence_stats.clipped_tokens) == tensor_bytes(
        torch.zeros(SEQS, dtype=torch.int64))
    # At ratio 1 the policy loss is -mean(A) over active tokens.
    weights = data["active"].view(SEQS, SEQ_LEN).sum(1).float()
    expected = -(out.advantages * weights).sum() / weights.sum()
    assert abs(float(out.policy_loss) - float(expected)) < SCALAR_ATOL
    assert float(grad.abs().max()) > 0


@pytest.mark.parametrize("value", [1.5, 0.9554973840713501, 0.1, -7.3, 1e-3])
def test_group_of_equal_rewards_gets_advantage_exactly_zero(
    data: dict[str, torch.Tensor], value: float
) -> None:
    # Non-dyadic values: an FP32 sum of them divided by the group size does not give the value
    # back, so a centre computed in FP32 would be a tiny non-zero that the std division inflates.
    rewards = data["rewards"].clone()
    rewards[:GROUP] = value
    for mode in ("group_mean_std", "group_mean"):
        out, _ = run_loss(make_contract(advantage_mode=mode), dict(data, rewards=rewards),
                          with_ref=False)
        assert tensor_bytes(out.advantages[:GROUP]) == tensor_bytes(torch.zeros(GROUP)), mode
        assert float(out.advantages[GROUP:].abs().max()) > 0, mode


def test_equal_rewards_of_every_group_size_centre_exactly() -> None:
    from rl_engine.grpo.objective import group_advantages

    g = torch.Generator().manual_seed(5)
    for size in range(2, 17):
        contract = make_contract(num_sequences=2 * size, group_size=size)
        for value in torch.rand(32, generator=g).tolist():
            rewards = torch.full((2 * size,), value, dtype=torch.float32)
            adv = group_advantages(rewards, contract)
            assert tensor_bytes(adv) == tensor_bytes(torch.zeros(2 * size)), (size, value)



ORACLE_CASES: dict[str, dict[str, Any]] = {
    "token-k3-std": {"reduction": "token_mean", "kl_estimator": "k3", "beta": 0.05,
                     "advantage_mode": "group_mean_std", "clip_eps_low": 0.2, "clip_eps_high": 0.28},
    "seq-k1-mean": {"reduction": "sequence_mean", "kl_estimator": "k1", "beta": 0.1,
                    "advantage_mode": "group_mean", "clip_eps_low": 0.1, "clip_eps_high": 0.1},
    "constant-k3-std-eps": {"reduction": "constant", "constant_normalizer": 96.0,
                            "kl_estimator": "k3", "beta": 0.2, "adv_eps": 1e-2,
                            "advantage_mode": "group_mean_std", "clip_eps_low": 0.3,
                            "clip_eps_high": 0.1},
    "token-noref": {"reduction": "token_mean", "beta": 0.0, "clip_eps_low": 0.2,
                    "clip_eps_high": 0.2},
}


def oracle_agreement(name: str, data: dict[str, torch.Tensor]) -> dict[str, float]:
    """Max abs difference of every output between the candidate and the oracle."""
    objective = ORACLE_CASES[name]
    with_ref = objective.get("beta", 0.0) > 0 or name != "token-noref"
    contract = make_contract(**objective)
    out, grad = run_loss(contract, data, with_ref=with_ref)
    ref = oracle_grpo(
        data, group_size=GROUP, eps_low=contract.clip_eps_low, eps_high=contract.clip_eps_high,
        advantage_mode=contract.advantage_mode, adv_eps=contract.adv_eps or 0.0,
        kl_estimator=contract.kl_estimator, beta=contract.beta, reduction=contract.reduction,
        normalizer=contract.constant_normalizer, with_ref=with_ref,
    )
    diffs = {
        "loss": abs(float(out.loss.detach()) - float(ref["loss"])),
        "policy_loss": abs(float(out.policy_loss) - float(ref["policy_loss"])),
        "advantages": float((out.advantages - ref["advantages"]).abs().max()),
        "clip_fraction": abs(float(out.clip_fraction) - float(ref["clip_fraction"])),
        "grad": float((grad - ref["grad"]).abs().max()),
        "grad_scale": float(ref["grad"].abs().max()),
        "loss_scale": abs(float(ref["loss"])),
        "clip_fraction_value": float(ref["clip_fraction"]),
    }
    if ref["kl"] is not None:
        assert out.kl is not None
        diffs["kl"] = abs(float(out.kl) - float(ref["kl"]))
    else:
        assert out.kl is None
    return diffs


@pytest.mark.parametrize("name", list(ORACLE_CASES))
def test_agrees_with_independent_single_process_grpo(name: str, data: dict[str, torch.Tensor]) -> None:
    diffs = oracle_agreement(name, data)
    print(f"oracle agreement {name}: {diffs}")
    for key in ("loss", "policy_loss", "kl", "advantages"):
        if key in diffs:
            assert diffs[key] <= SCALAR_ATOL, (key, diffs)
    assert diffs["clip_fraction"] == 0.0, diffs  # same tokens clipped
    assert diffs["clip_fraction_value"] > 0.0, "the case must exercise clipping"
    assert diffs["grad"] <= GRAD_ATOL, diffs
    assert diffs["grad_scale"] > 100 * GRAD_ATOL and diffs["loss_scale"] > 100 * SCALAR_ATOL


def test_bf16_logits_gradient_agrees_within_bf16_rounding() -> None:
    data = grpo_inputs(11, torch.bfloat16)
    contract = make_contract(beta=0.05, logprob={"logits_dtype": "bf16"})
    out, grad = run_loss(contract, data)
    ref = oracle_grpo(data, group_size=GROUP, eps_low=0.2, eps_high=0.2,
                      advantage_mode="group_mean_std", adv_eps=1e-6, kl_estimator="k3",
                      beta=0.05, reduction="token_mean", normalizer=None, with_ref=True)
    assert grad.dtype == torch.bfloat16
    assert abs(float(out.loss.detach()) - float(ref["loss"])) <= SCALAR_ATOL
    scale = float(ref["grad"].abs().max())
    assert float((grad.float() - ref["grad"]).abs().max()) <= scale * 2.0 ** -8


def test_outputs_are_deterministic_and_thread_count_invariant(data: dict[str, torch.Tensor]) -> None:
    contract = make_contract(beta=0.05)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, grad_one = run_loss(contract, data)
        torch.set_num_threads(2)
        two, grad_two = run_loss(contract, data)
    finally:
        torch.set_num_threads(threads)
    assert fingerprint(one.loss) == fingerprint(two.loss)
    assert tensor_bytes(grad_one) == tensor_bytes(grad_two)


def test_negative_controls_change_the_bytes(data: dict[str, torch.Tensor]) -> None:
    base, base_grad = run_loss(make_contract(beta=0.05), data)
    tiles, tiles_grad = run_loss(make_contract(beta=0.05, logprob={"num_vocab_tiles": 4}), data)
    assert tensor_bytes(tiles_grad) != tensor_bytes(base_grad)
    # Tokens with ratio in (1.05, 1.2) and A > 0 move from the gradient to the clipped branch.
    clip, clip_grad = run_loss(make_contract(beta=0.05, clip_eps_high=0.05), data)
    assert fingerprint(clip.loss) != fingerprint(base.loss)
    assert fingerprint(clip.clip_fraction) != fingerprint(base.clip_fraction)
    assert tensor_bytes(clip_grad) != tensor_bytes(base_grad)
    group, group_grad = run_loss(make_contract(beta=0.05, group_size=2), data)
    assert fingerprint(group.advantages) != fingerprint(base.advantages)
    assert fingerprint(group.loss) != fingerprint(base.loss)
    assert tensor_bytes(group_grad) != tensor_bytes(base_grad)


def test_ordered_sum_grouping_is_fixed_and_fp32_only() -> None:
    x = torch.tensor([1.0, 2.0 ** -24, 2.0 ** -24, 2.0 ** -24, 2.0 ** -24], dtype=torch.float32)
    # pairs (x0 + x3), (x1 + x4), then x2 is folded in: grouping depends only on the length.
    expected = ((x[0] + x[3]) + x[2]) + (x[1] + x[4])
    assert tensor_bytes(ordered_sum(x)) == tensor_bytes(expected)
    with pytest.raises(GRPOContractError, match="float32"):
        ordered_sum(x.double())


def test_provenance_and_fail_closed_backend(data: dict[str, torch.Tensor]) -> None:
    contract = make_contract(beta=0.05)
    out, _ = run_loss(contract, data)
    prov = out.provenance
    assert prov["requested_backend"] == "auto"  # the default: the fastest on the device
    assert prov["actual_backend"] == "cpu-vocab-parallel-logp-ws2"
    assert prov["reason"].startswith("auto: the highest-priority backend") and prov["fallback"] is False
    eager, _ = run_loss(contract, data, backend="pytorch-vocab-parallel-logp-ws2")
    assert eager.provenance["actual_backend"] == eager.provenance["requested_backend"]
    assert tensor_bytes(eager.loss.detach()) == tensor_bytes(out.loss.detach())  # same bytes
    assert prov["grpo_contract_fingerprint"] == contract.cross_rank_fingerprint()
    assert prov["logprob_contract_fingerprint"] == contract.logprob.cross_rank_fingerprint()
    assert json.dumps(prov, allow_nan=False)
    with pytest.raises(BackendUnavailableError, match="backend='triton' is not registered"):
        run_loss(contract, data, backend="triton")


def _expect_input_error(contract: GRPOContract, data: dict[str, torch.Tensor], message: str,
                        **kw: Any) -> None:
    with pytest.raises(GRPOContractError) as info:
        run_loss(contract, data, **kw)
    assert message in str(info.value), str(info.value)


def test_bad_inputs_raise_with_field_and_fix(data: dict[str, torch.Tensor]) -> None:
    contract = make_contract(beta=0.05)
    first_active = int(data["active"].nonzero()[0, 0])
    old = data["old"].clone()
    old[first_active] = float("inf")
    _expect_input_error(contract, dict(data, old=old), f"old_logp[{first_active}]=inf")
    _expect_input_error(contract, dict(data, old=data["old"][:-1]), "old_logp must be float32 of shape [128]")
    _expect_input_error(contract, dict(data, old=data["old"].double()), "old_logp must be float32")
    rewards = data["rewards"].clone()
    rewards[3] = float("nan")
    _expect_input_error(contract, dict(data, rewards=rewards), "rewards[3]=nan")
    _expect_input_error(contract, dict(data, rewards=data["rewards"][:4]), "rewards must be float32 of shape [8]")
    _expect_input_error(contract, data, "beta=0.05 > 0 needs reference logits", with_ref=False)
    actions = data["actions"].clone()
    actions[first_active] = REAL_VOCAB
    _expect_input_error(contract, dict(data, actions=actions), f"targets[{first_active}]={REAL_VOCAB}")
    logits = data["logits"].clone()
    logits[first_active, 3] = float("nan")
    _expect_input_error(contract, dict(data, logits=logits), f"logits row {first_active}")
    ref = data["ref"].clone()
    ref[first_active, 3] = float("inf")
    _expect_input_error(contract, dict(data, ref=ref), f"ref_logits row {first_active}")
    _expect_input_error(contract, dict(data, logits=data["logits"].bfloat16()), "logits.dtype=torch.bfloat16")
    _expect_input_error(contract, dict(data, active=torch.zeros_like(data["active"])), "no active token")
    active = data["active"].clone()
    active[SEQ_LEN:2 * SEQ_LEN] = False
    _expect_input_error(make_contract(reduction="sequence_mean"), dict(data, active=active),
                        "sequences [1] have no active token")
    dp_contract = make_contract(dp_world_size=2, dp_rank=0)
    half = {k: (v[: SEQS * SEQ_LEN // 2] if v.shape[0] == SEQS * SEQ_LEN else v[: SEQS // 2])
            for k, v in data.items()}
    _expect_input_error(dp_contract, half, "need the loss's world group", with_ref=False)


def test_inactive_rows_ignore_their_old_logprob_and_action(data: dict[str, torch.Tensor]) -> None:
    """NaN old logprobs and ignore_index actions on inactive rows change nothing."""
    contract = make_contract(beta=0.05)
    base, base_grad = run_loss(contract, data)
    old = torch.where(data["active"], data["old"], torch.full_like(data["old"], float("nan")))
    noisy, noisy_grad = run_loss(contract, dict(data, old=old))
    assert fingerprint(noisy.loss) == fingerprint(base.loss)
    assert tensor_bytes(noisy_grad) == tensor_bytes(base_grad)
    inactive_rows = ~data["active"]
    assert tensor_bytes(base_grad[inactive_rows]) == tensor_bytes(
        torch.zeros_like(base_grad[inactive_rows]))


def test_sequence_stats_are_consistent(data: dict[str, torch.Tensor]) -> None:
    contract = make_contract(beta=0.05, reduction="constant", constant_normalizer=1.0)
    out, _ = run_loss(contract, data)
    stats = out.sequence_stats
    assert tensor_bytes(stats.reward) == tensor_bytes(data["rewards"])
    assert tensor_bytes(stats.advantage) == tensor_bytes(out.advantages)
    assert stats.active_tokens.tolist() == data["active"].view(SEQS, SEQ_LEN).sum(1).tolist()
    assert int(stats.active_tokens.sum()) == out.active_tokens
    # constant reduction with normaliser 1: the policy loss is the fold of the per-sequence sums.
    assert tensor_bytes(ordered_sum(stats.policy_loss_sum)) == tensor_bytes(out.policy_loss)
    clipped = int(stats.clipped_tokens.sum())
    assert math.isclose(float(out.clip_fraction), clipped / out.active_tokens, rel_tol=1e-7)


# ----- the trainer's own advantages --------------------------------------------------------------
def test_advantages_given_as_computed_give_the_same_bytes_and_others_change_them() -> None:
    """``advantages=`` is used as given: the group's own advantages, passed in, give the bytes of
    the rewards path (loss, gradient, statistics); other advantages give other bytes."""
    contract, data = make_contract(), grpo_inputs(SEED)
    ref, ref_grad = run_loss(contract, data)
    logits = data["logits"].clone().requires_grad_()
    out = GRPOLoss()(logits, data["actions"], data["old"], data["rewards"], data["active"], contract,
                     ref_logits=data["ref"], advantages=ref.advantages.clone())
    out.loss.backward()
    assert logits.grad is not None and out.provenance["advantages"] == "given"
    assert ref.provenance["advantages"] == "group_mean_std"
    assert tensor_bytes(out.loss) == tensor_bytes(ref.loss) and tensor_bytes(logits.grad) == tensor_bytes(ref_grad)
    assert tensor_bytes(out.advantages) == tensor_bytes(ref.advantages)
    other = GRPOLoss()(data["logits"], data["actions"], data["old"], data["rewards"], data["active"], contract,
                       ref_logits=data["ref"], advantages=ref.advantages * 2)
    assert tensor_bytes(other.loss) != tensor_bytes(ref.loss)


@pytest.mark.parametrize("advantages, needle", [
    (torch.zeros(SEQS, dtype=torch.float64), "advantages must be float32 of shape [8]"),
    (torch.zeros(SEQS - 1), "advantages must be float32 of shape [8]"),
    ([0.0] * SEQS, "got list"),
    (torch.tensor([0.0, 1.0, float("inf"), 0.0, 0.0, 0.0, 0.0, 0.0]),
     "advantages[2]=inf (global sequence 2) is not finite; fix the advantage estimate"),
])
def test_bad_advantages_are_refused_by_name(advantages: Any, needle: str) -> None:
    data = grpo_inputs(SEED)
    with pytest.raises(GRPOContractError, match=re.escape(needle)):
        GRPOLoss()(data["logits"], data["actions"], data["old"], data["rewards"], data["active"],
                   make_contract(), ref_logits=data["ref"], advantages=advantages)
