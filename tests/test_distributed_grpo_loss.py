"""GRPO loss on real gloo processes: bitwise equal across TP, CP (both layouts) and DP.

Every topology runs the same loss cases on the same global inputs; each rank gets its rows
(by global token index) and its vocabulary columns. The loss, policy loss, KL, advantages,
clip fraction, ratios and per-sequence statistics are compared as bytes with a single-process
run (TP=CP=DP=1), and so is the logits gradient, reassembled from every rank's local gradient
by token index and vocabulary bounds. Workers also record every collective they issue: only
all-gathers (transport) are allowed, never a numerical all-reduce.

One spawn per world size (2, 4, 8 ranks) runs several topologies through ``init_mesh``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from rl_engine.distributed.mesh import init_mesh
from rl_engine.grpo import GRPOContract, GRPOContractError, GRPOLoss
from rl_engine.tensorio import fingerprint, tensor_bytes

from _grpo_inputs import GROUP, PADDED_VOCAB, REAL_VOCAB, SEQ_LEN, SEQS, TILES, grpo_inputs
from _multiproc import run_workers

SEED = 20240611

TOKEN_K3: dict[str, Any] = {
    "dtype": "bf16",
    "objective": {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "beta": 0.05,
                  "kl_estimator": "k3", "reduction": "token_mean"},
    "uneven_dp": False, "ref": True, "tiles": TILES,
}
# Negative control: the first case with another tile count (run on the 2-rank meshes only).
TILE_CONTROL = "bf16-token-k3-tiles4"
# name -> logits dtype, objective fields, uneven DP split, reference logits, tile count
CASES: dict[str, dict[str, Any]] = {
    "bf16-token-k3": TOKEN_K3,
    "fp32-seqmean-k1-uneven": {
        "dtype": "fp32",
        "objective": {"clip_eps_low": 0.1, "clip_eps_high": 0.15, "beta": 0.1,
                      "kl_estimator": "k1", "reduction": "sequence_mean",
                      "advantage_mode": "group_mean"},
        "uneven_dp": True, "ref": True, "tiles": TILES,
    },
    "bf16-constant-noref": {
        "dtype": "bf16",
        "objective": {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "beta": 0.0,
                      "reduction": "constant", "constant_normalizer": float(SEQS * SEQ_LEN),
                      "adv_eps": 1e-4},
        "uneven_dp": False, "ref": False, "tiles": TILES,
    },
    TILE_CONTROL: {**TOKEN_K3, "tiles": 4},
    # the trainer's own advantages (one per sequence, not the group's): they travel beside the
    # rewards in the one gather, over an uneven DP split
    "fp32-given-advantages-uneven": {
        "dtype": "fp32",
        "objective": {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "beta": 0.05,
                      "kl_estimator": "k3", "reduction": "token_mean"},
        "uneven_dp": True, "ref": True, "tiles": TILES, "advantages": True,
    },
}

UNEVEN_DP: dict[int, tuple[tuple[int, int], ...]] = {
    2: ((0, 3), (3, 8)),
    4: ((0, 1), (1, 4), (4, 5), (5, 8)),
    8: tuple((i, i + 1) for i in range(8)),
}

# (tp, cp, dp, cp_layout) per world size.
TOPOLOGIES: dict[int, list[tuple[int, int, int, str]]] = {
    2: [(1, 1, 2, "contiguous"), (2, 1, 1, "contiguous"), (1, 2, 1, "contiguous"),
        (1, 2, 1, "zigzag")],
    4: [(4, 1, 1, "contiguous"), (2, 2, 1, "zigzag"), (1, 2, 2, "contiguous"),
        (2, 1, 2, "contiguous")],
    8: [(2, 2, 2, "zigzag"), (4, 2, 1, "contiguous"), (1, 2, 4, "zigzag"),
        (8, 1, 1, "contiguous"), (2, 1, 4, "contiguous")],
}


def build_contract(
    case: dict[str, Any], tp: int, cp: int, dp: int, layout: str,
    tp_rank: int = 0, cp_rank: int = 0, dp_rank: int = 0,
) -> GRPOContract:
    bounds = UNEVEN_DP[dp] if case["uneven_dp"] and dp > 1 else None
    return GRPOContract.build(
        num_sequences=SEQS, seq_len=SEQ_LEN, group_size=GROUP,
        dp_world_size=dp, dp_rank=dp_rank, dp_sequence_bounds=bounds,
        logprob={"real_vocab_size": REAL_VOCAB, "padded_vocab_size": PADDED_VOCAB,
                 "num_vocab_tiles": case["tiles"], "logits_dtype": case["dtype"],
                 "tp_world_size": tp, "tp_rank": tp_rank, "cp_world_size": cp,
                 "cp_rank": cp_rank, "cp_layout": layout},
        **case["objective"],
    )


def run_case(
    case: dict[str, Any], contract: GRPOContract, data: dict[str, torch.Tensor],
    loss_op: GRPOLoss, tp_group: Any = None, world_group: Any = None,
) -> dict[str, Any]:
    """Run one loss call on this rank's slice; return fingerprints and the local gradient."""
    lp = contract.logprob
    rows = torch.tensor(contract.global_token_indices, dtype=torch.int64)
    cols = slice(lp.vocab_start, lp.vocab_end)
    dtype = lp.torch_dtype
    logits = data["logits"][rows, cols].to(dtype).requires_grad_()
    ref = data["ref"][rows, cols].to(dtype) if case["ref"] else None
    start, end = contract.sequence_range
    out = loss_op(
        logits, data["actions"][rows], data["old"][rows], data["rewards"][start:end],
        data["active"][rows], contract, ref_logits=ref, tp_group=tp_group,
        world_group=world_group,
        advantages=data["advantages"][start:end] if case.get("advantages") else None,
    )
    out.loss.backward()
    assert logits.grad is not None
    prints = {
        "loss": fingerprint(out.loss), "policy_loss": fingerprint(out.policy_loss),
        "kl": None if out.kl is None else fingerprint(out.kl),
        "advantages": fingerprint(out.advantages), "clip_fraction": fingerprint(out.clip_fraction),
        "ratio": fingerprint(out.ratio), "active_tokens": out.active_tokens,
    }
    prints.update({f"stats.{k}": fingerprint(v) for k, v in out.sequence_stats.tensors().items()})
    return {
        "prints": prints, "grad": logits.grad.detach().clone(), "rows": rows,
        "vocab": (lp.vocab_start, lp.vocab_end), "provenance": out.provenance,
    }


class CollectiveLog:
    """Wraps the collectives the loss could call and records (name, dtype) of each call."""

    NAMES = ("all_gather", "all_reduce", "reduce_scatter", "reduce", "all_to_all",
             "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> "CollectiveLog":
        for name in self.NAMES:
            original = getattr(dist, name)
            self._saved[name] = original

            def wrapper(*args: Any, _name: str = name, _orig: Any = original, **kw: Any) -> Any:
                tensor = args[1] if _name == "all_gather" else args[0]
                self.calls.append((_name, str(tensor.dtype)))
                return _orig(*args, **kw)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def mesh_worker(
    rank: int, topologies: list[tuple[int, int, int, str]], case_names: list[str],
    data: dict[str, torch.Tensor], negative: bool,
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for tp, cp, dp, layout in topologies:
        mesh = init_mesh(tp=tp, cp=cp, dp=dp)
        loss_op = GRPOLoss()
        for name in case_names:
            if name == TILE_CONTROL and tp * cp * dp != 2:
                continue
            case = CASES[name]
            contract = build_contract(case, tp, cp, dp, layout, mesh.tp_rank, mesh.cp_rank,
                                      mesh.dp_rank)
            with CollectiveLog() as log:
                result = run_case(case, contract, data, loss_op, mesh.tp_group, mesh.world_group)
            result["collectives"] = log.calls
            result["fingerprint"] = contract.cross_rank_fingerprint()
            results[f"{tp}x{cp}x{dp}-{layout}/{name}"] = result
    if negative:
        results["negative"] = negative_worker(rank, data)
    return results


def negative_worker(rank: int, data: dict[str, torch.Tensor]) -> dict[str, Any]:
    """On a 2x2x1 zigzag mesh: beta differs on the last rank; a NaN reward on one rank; a
    sequence without active token under ``sequence_mean`` (its tokens span both CP ranks); a
    +inf in a real column of an active row of one TP rank's logits (found by the op's forward,
    refused by every rank after the global gather)."""
    mesh = init_mesh(tp=2, cp=2, dp=1)
    case = CASES["bf16-token-k3"]
    outcome: dict[str, Any] = {}
    for label in ("beta", "reward", "empty", "actions", "advantages", "logits"):
        objective = dict(case["objective"])
        if label == "beta" and rank == 3:
            objective["beta"] = 0.06
        if label == "empty":
            objective["reduction"] = "sequence_mean"
        bad_case = {**case, "objective": objective, "advantages": label == "advantages" and rank == 3}
        contract = build_contract(bad_case, 2, 2, 1, "zigzag", mesh.tp_rank, mesh.cp_rank,
                                  mesh.dp_rank)
        local = dict(data)
        if label == "reward" and rank == 2:
            rewards = data["rewards"].clone()
            rewards[5] = float("nan")
            local["rewards"] = rewards
        if label == "actions" and rank == 1:  # a TP peer of rank 0 with another action
            actions = data["actions"].clone()
            row = next(i for i in contract.global_token_indices if bool(data["active"][i]))
            actions[row] = (int(actions[row]) + 1) % REAL_VOCAB
            local["actions"] = actions
        if label == "logits" and rank == 1:  # tp_rank 1 of cp_rank 0: a real column of its shard
            logits = data["logits"].clone()
            row = next(i for i in contract.global_token_indices if bool(data["active"][i]))
            logits[row, contract.logprob.vocab_start] = float("inf")
            local["logits"] = logits
        if label == "empty":
            active = data["active"].clone()
            active[3 * SEQ_LEN : 4 * SEQ_LEN] = False
            local["active"] = active
        with CollectiveLog() as log:
            try:
                run_case(bad_case, contract, local, GRPOLoss(), mesh.tp_group, mesh.world_group)
                outcome[label] = {"raised": None, "collectives": log.calls}
            except GRPOContractError as exc:
                outcome[label] = {"raised": str(exc), "collectives": log.calls}
    return outcome


# ----- the parent side -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def data() -> dict[str, torch.Tensor]:
    """Global inputs in global token order: ragged responses, NaN old log-probabilities on ignored
    rows (never read), a group of equal rewards, and trainer-given advantages beside the rewards."""
    return grpo_inputs(SEED, ragged=True, ignored_old=float("nan"), equal_group=True, advantages=True)


@pytest.fixture(scope="module")
def baseline(data: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Single-process (TP=CP=DP=1) results of every case, in this process."""
    out = {}
    for name, case in CASES.items():
        contract = build_contract(case, 1, 1, 1, "contiguous")
        out[name] = run_case(case, contract, data, GRPOLoss())
    return out


def reassemble(results: list[dict[str, Any]], key: str) -> torch.Tensor:
    """Full ``[tokens, padded_vocab]`` gradient from every rank's local piece."""
    first = results[0][key]["grad"]
    full = torch.full((SEQS * SEQ_LEN, PADDED_VOCAB), float("nan"), dtype=first.dtype)
    covered = torch.zeros(SEQS * SEQ_LEN, PADDED_VOCAB, dtype=torch.int64)
    for rank_results in results:
        piece = rank_results[key]
        start, end = piece["vocab"]
        full[piece["rows"], start:end] = piece["grad"]
        covered[piece["rows"], start:end] += 1
    assert int(covered.min()) == 1 and int(covered.max()) == 1, "every element from one rank"
    return full


@pytest.fixture(scope="module")
def mesh_results(data: dict[str, torch.Tensor]) -> dict[int, list[dict[str, Any]]]:
    names = list(CASES)
    return {
        world: run_workers(mesh_worker, world, TOPOLOGIES[world], names, data, world == 4,
                           timeout_s=240)
        for world in (2, 4, 8)
    }


def _keys(world: int) -> list[tuple[str, str]]:
    keys = []
    for tp, cp, dp, layout in TOPOLOGIES[world]:
        for name in CASES:
            if name == TILE_CONTROL and world != 2:
                continue
            keys.append((f"{tp}x{cp}x{dp}-{layout}/{name}", name))
    return keys


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_mesh_runs_are_bitwise_equal_to_single_process(
    world: int, mesh_results: dict[int, list[dict[str, Any]]],
    baseline: dict[str, dict[str, Any]],
) -> None:
    results = mesh_results[world]
    for key, name in _keys(world):
        expected = baseline[name]
        for rank, rank_results in enumerate(results):
            got = rank_results[key]
            assert got["prints"] == expected["prints"], f"{key} rank {rank}"
            assert got["provenance"]["fallback"] is False
            assert got["provenance"]["actual_backend"] == "cpu-vocab-parallel-logp-ws2"  # auto on cpu
            assert got["fingerprint"] == results[0][key]["fingerprint"]
        grad = reassemble(results, key)
        assert tensor_bytes(grad) == tensor_bytes(expected["grad"]), f"{key}: gradient bytes"


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_only_transport_collectives(
    world: int, mesh_results: dict[int, list[dict[str, Any]]]
) -> None:
    for key, _ in _keys(world):
        for rank_results in mesh_results[world]:
            calls = rank_results[key]["collectives"]
            assert calls, f"{key}: a multi-rank run must communicate"
            assert {name for name, _ in calls} == {"all_gather"}, f"{key}: {calls}"


def test_baseline_is_not_trivial(baseline: dict[str, dict[str, Any]]) -> None:
    """The compared tensors carry signal: clipping happens, gradients are non-zero."""
    for name, result in baseline.items():
        assert float(result["grad"].float().abs().max()) > 0.0, name
    clip = baseline["bf16-token-k3"]["prints"]["clip_fraction"]
    assert clip != fingerprint(torch.tensor(0.0))


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
def test_other_tile_count_changes_the_bytes(
    mesh_results: dict[int, list[dict[str, Any]]], baseline: dict[str, dict[str, Any]],
) -> None:
    """Negative control: the comparison sees a change of the numerical identity."""
    control, reference = baseline[TILE_CONTROL], baseline["bf16-token-k3"]

    def identity(grad: torch.Tensor, prints: dict[str, Any]) -> tuple[Any, ...]:
        # the gradient alone may round to the same bf16 bytes; the loss and ratios do not
        return tensor_bytes(grad), prints["loss"], prints["ratio"], prints["policy_loss"]

    want = identity(control["grad"], control["prints"])
    assert want != identity(reference["grad"], reference["prints"])
    for tp, cp, dp, layout in TOPOLOGIES[2]:
        key = f"{tp}x{cp}x{dp}-{layout}/{TILE_CONTROL}"
        got = identity(reassemble(mesh_results[2], key), mesh_results[2][0][key]["prints"])
        assert got == want, key


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
def test_preflight_mismatch_raises_on_every_rank_before_numerics(
    mesh_results: dict[int, list[dict[str, Any]]],
) -> None:
    for rank, rank_results in enumerate(mesh_results[4]):
        beta = rank_results["negative"]["beta"]
        assert beta["raised"] is not None, f"rank {rank} did not raise"
        assert "preflight mismatch" in beta["raised"], beta["raised"]
        assert "beta=" in beta["raised"]
        # Only the int64 preflight row travelled: no float tensor was ever exchanged.
        assert beta["collectives"] == [("all_gather", "torch.int64")], beta["collectives"]


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
def test_bad_input_on_one_rank_raises_on_every_rank(
    mesh_results: dict[int, list[dict[str, Any]]],
) -> None:
    for rank, rank_results in enumerate(mesh_results[4]):
        reward = rank_results["negative"]["reward"]
        assert reward["raised"] is not None, f"rank {rank} did not raise"
        if rank == 2:
            assert "rewards[5]=nan" in reward["raised"], reward["raised"]
        else:
            assert "ranks [2] rejected their local inputs" in reward["raised"]
        assert reward["collectives"] == [("all_gather", "torch.int64")]


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
def test_non_finite_logits_on_one_tp_rank_raise_the_same_error_on_every_rank(
    mesh_results: dict[int, list[dict[str, Any]]],
) -> None:
    """The op's forward flags the row (no second read of the logits); every rank raises the same
    error after the global gather, before the objective and any backward."""
    raised = [rank_results["negative"]["logits"]["raised"] for rank_results in mesh_results[4]]
    assert raised[0] is not None and raised == [raised[0]] * 4, raised
    assert "logits row " in raised[0] and "cp_rank=0" in raised[0], raised[0]
    assert "is active and holds a non-finite value in its real columns" in raised[0], raised[0]


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
def test_empty_sequence_is_rejected_on_every_rank_before_numerics(
    mesh_results: dict[int, list[dict[str, Any]]],
) -> None:
    """Each CP rank sees only part of sequence 3; the integer counts of the preflight see all."""
    for rank, rank_results in enumerate(mesh_results[4]):
        empty = rank_results["negative"]["empty"]
        assert empty["raised"] is not None, f"rank {rank} did not raise"
        assert "sequences [3] have no active token" in empty["raised"], empty["raised"]
        assert empty["collectives"] == [("all_gather", "torch.int64")]


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
def test_actions_that_differ_on_a_tp_peer_raise_on_every_rank_before_numerics(
    mesh_results: dict[int, list[dict[str, Any]]],
) -> None:
    """The world preflight carries a digest of each rank's actions and mask: a TP peer that
    holds other actions makes every rank (all TP groups, all CP ranks) raise together, before
    the logprob op's own TP agreement could stop one TP group alone."""
    for rank, rank_results in enumerate(mesh_results[4]):
        actions = rank_results["negative"]["actions"]
        assert actions["raised"] is not None, f"rank {rank} did not raise"
        assert "rank 1 (dp=0, cp=0, tp=1) hold actions" in actions["raised"], actions["raised"]
        assert actions["collectives"] == [("all_gather", "torch.int64")]


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
def test_advantages_given_on_one_rank_only_raise_on_every_rank_before_numerics(
    mesh_results: dict[int, list[dict[str, Any]]],
) -> None:
    """The gather's layout depends on whether advantages are given: the preflight agrees on it."""
    for rank, rank_results in enumerate(mesh_results[4]):
        given = rank_results["negative"]["advantages"]
        assert given["raised"] is not None, f"rank {rank} did not raise"
        assert "preflight mismatch" in given["raised"] and "give advantages= on every rank or on none" in given["raised"]
        assert given["collectives"] == [("all_gather", "torch.int64")]


def test_given_advantages_are_used_as_given(baseline: dict[str, dict[str, Any]], data: dict[str, torch.Tensor]) -> None:
    """The given-advantages case reports the trainer's advantages (bytes), and its loss differs from the
    same objective on the group's advantages (negative control: they are not ignored)."""
    given = baseline["fp32-given-advantages-uneven"]
    assert given["prints"]["advantages"] == fingerprint(data["advantages"])
    assert given["provenance"]["advantages"] == "given"
    case = {**CASES["fp32-given-advantages-uneven"], "advantages": False}
    group = run_case(case, build_contract(case, 1, 1, 1, "contiguous"), data, GRPOLoss())
    assert group["provenance"]["advantages"] == "group_mean_std"
    assert group["prints"]["loss"] != given["prints"]["loss"]
