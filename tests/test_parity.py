"""``python -m rl_engine parity``: two captures of one token batch from a tiny transformers model.

The rollout side runs the batch in bf16 as one right-padded mixed batch with eager attention;
the trainer side runs the same sequences split into two left-padded batches with SDPA (bf16, and
fp32). The report must find the differing logits and show our logprob's difference coming from
them alone; the same capture twice gives zero everywhere (as bytes); an engine reporting a naive
bf16 log_softmax shows up in section 4; bad inputs are refused (exit 2) with nothing written.
"""

from __future__ import annotations

import copy
import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_engine import cli, jsonio, schemas
from rl_engine.capture import Capture, parity, read_capture, write_capture
from rl_engine.capture.hf import capture_causal_lm, concat_captures
from rl_engine.capture.parity import ParityOptions, our_logprob

from _tiny_lm import padded, sequences, tiny_model, variant


def _f32(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


@pytest.fixture(scope="module")
def caps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("captures")
    model, seqs = tiny_model(), sequences()
    response = [torch.ones(len(s), dtype=torch.int64) for s in seqs]
    for r in response:
        r[:3] = 0  # the first tokens are the prompt: not scored
    rollout_model = variant(model, torch.bfloat16, "eager")
    ids, mask = padded(seqs, left=False)
    resp, _ = padded(response, left=False)
    rollout = capture_causal_lm(rollout_model, ids, mask, response_mask=resp, notes="rollout")

    def trainer(dtype: torch.dtype) -> Capture:
        m = variant(model, dtype, "sdpa")
        parts = []
        for group in (slice(0, 1), slice(1, 4)):
            ids, mask = padded(seqs[group], left=True)
            resp, _ = padded(response[group], left=True)
            parts.append(capture_causal_lm(m, ids, mask, response_mask=resp, notes="trainer"))
        return concat_captures(parts)

    paths = {"rollout": root / "rollout.safetensors", "trainer": root / "trainer.safetensors",
             "trainer32": root / "trainer32.safetensors"}
    write_capture(paths["rollout"], rollout)
    write_capture(paths["trainer"], trainer(torch.bfloat16))
    write_capture(paths["trainer32"], trainer(torch.float32))
    return paths


def _parity(rollout: Path, trainer: Path, out: Path, *extra: str) -> tuple[int, dict[str, Any] | None]:
    code = cli.main(["parity", str(rollout), str(trainer), "--output-dir", str(out), *extra])
    report = jsonio.load(out / "parity.json") if (out / "parity.json").exists() else None
    return code, report


@pytest.fixture(scope="module")
def spliced(caps: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trainer's capture with the rollout's logits rows spliced in on every other token."""
    rollout, trainer = read_capture(caps["rollout"]), read_capture(caps["trainer"])
    logits = trainer.logits.clone()
    logits[::2] = rollout.logits[::2]  # equal logits rows on every other token
    path = tmp_path_factory.mktemp("spliced") / "spliced.safetensors"
    write_capture(path, Capture(logits, trainer.targets, trainer.active, None, trainer.metadata))
    return path


@pytest.fixture(scope="module")
def parity_of(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``parity`` of a pair with the default options, run once per pair in this module (several tests
    read the same report): ``(exit code, a copy of the report, output directory)``."""
    made: dict[tuple[Path, Path], tuple[int, dict[str, Any] | None, Path]] = {}

    def of(rollout: Path, trainer: Path) -> tuple[int, dict[str, Any] | None, Path]:
        if (rollout, trainer) not in made:
            out = tmp_path_factory.mktemp("parity") / "out"
            made[(rollout, trainer)] = (*_parity(rollout, trainer, out), out)
        code, report, out = made[(rollout, trainer)]
        return code, copy.deepcopy(report), out

    return of


def test_bf16_eager_vs_sdpa_logits_differ_and_our_difference_comes_from_them(caps: dict[str, Path],
                                                                           parity_of: Any) -> None:
    code, report, out = parity_of(caps["rollout"], caps["trainer"])
    assert code == 1 and report is not None and report["verdict"] == "different"
    assert schemas.errors(report, "parity") == []
    lg, lp = report["logits"], report["our_logprob"]
    assert not lg["bitwise_equal"] and lg["tokens_differing"] > 0 and lg["columns_differing"] > 0
    assert lg["max_abs_diff"] > 0 and lg["max_rel_diff"] > 0
    assert lp["tokens_differing"] > 0 and lp["from_logits_only"] and lp["control"]["bitwise_equal"]
    # every token whose logp differs has differing logits
    rows = lg["per_token"]["columns_differing"]
    assert all(rows[i] > 0 for i, same in enumerate(lp["per_token"]["bitwise_equal"]) if not same)
    assert report["captures"]["rollout"]["sha256"] == jsonio.sha256_file(caps["rollout"])
    assert report["captures"]["trainer"]["metadata"]["notes"] == "attn_implementation=sdpa; trainer"
    png = (out / "parity.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    assert matplotlib.image.imread(str(out / "parity.png")).shape[0] > 100


def test_logits_made_equal_on_some_tokens_make_our_logprob_equal_exactly_there(caps: dict[str, Path], spliced: Path,
                                                                              parity_of: Any) -> None:
    """Attribution per token: splice the rollout's logits rows into the trainer's capture on every
    other token; our logprob is then bitwise equal on exactly those tokens (and differs on others)."""
    code, report, _ = parity_of(caps["rollout"], spliced)
    assert code == 1 and report is not None
    lg, lp = report["logits"], report["our_logprob"]
    active = report["targets_and_mask"]["per_token"]["active"]
    diffs = lp["per_token"]["diff"]
    for i, on in enumerate(active):
        if on and i % 2 == 0:
            assert lg["per_token"]["columns_differing"][i] == 0
            assert _f32([diffs[i]]) == _f32([0.0])
    assert lp["from_logits_only"] and 0 < lp["tokens_differing"] < report["targets_and_mask"]["active_tokens"]


def test_the_parity_figure_counts_exact_zeros_apart_from_parity_json(caps: dict[str, Path], spliced: Path,
                                                                    parity_of: Any) -> None:
    """parity.png: every count it shows comes from parity.json (recounted here from the per-token
    arrays): the exact zeros of our logprob and of the logits apart from the histogram, the ratio's
    bounds and how many tokens lie outside them; and it is readable at the size it is shown."""
    code, report, out = parity_of(caps["rollout"], spliced)  # equal logits rows on every other token
    assert code == 1 and report is not None
    active = report["targets_and_mask"]["per_token"]["active"]
    on = [i for i, a in enumerate(active) if a]
    logp_diff = report["our_logprob"]["per_token"]["diff"]
    logit_diff = report["logits"]["per_token"]["max_abs_diff"]
    ratio = report["importance_ratio"]["ours"]["per_token"]
    low, high = report["importance_ratio"]["bounds"]
    panels = parity.figure_panels(json.loads((out / "parity.json").read_text()))
    assert [p.title.split(":")[0] for p in panels] == ["our logprob", "logits"] + ["importance ratio (ours)"] * 2
    ours, logits, ratios, near_one = panels
    assert near_one.log_scale and near_one.zeros == sum(1 for i in on if ratio[i] == 1.0)
    assert sorted(near_one.values) == sorted(abs(ratio[i] - 1) for i in on if ratio[i] != 1.0)
    zeros = sum(1 for i in on if logp_diff[i] == 0)
    assert 0 < zeros < len(on) and ours.zeros == zeros and ours.active == len(on)
    assert sorted(ours.values) == sorted(logp_diff[i] for i in on if logp_diff[i] != 0)  # zeros not in the histogram
    assert logits.zeros == sum(1 for i in on if logit_diff[i] == 0) == len(range(0, len(active), 2)) - sum(
        1 for i in range(0, len(active), 2) if not active[i])
    assert ratios.marks == (low, high) and ratios.zeros == -1
    outside = sum(1 for i in on if not low <= ratio[i] <= high)
    assert f"outside [{low:.3g}, {high:.3g}]: {outside} of {len(on)}" in ratios.note()
    assert f"exactly 0: {zeros} of {len(on)} active tokens" in ours.note()
    assert f"bitwise equal on {zeros} of {len(on)} active tokens" in parity.headline(report)
    equal_rows = [i for i in on if report["logits"]["per_token"]["columns_differing"][i] == 0]
    assert (f"logits rows bitwise equal on {len(equal_rows)} of {len(on)} active tokens (tokens "
            f"{', '.join(str(i) for i in equal_rows[:6])}, ...); our logprob bytes are equal on all "
            f"{len(equal_rows)}") in parity.headline(report)
    png = (out / "parity.png").read_bytes()
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert png[12:16] == b"IHDR" and width == 1280 and height >= 800, (width, height)



def test_bf16_vs_fp32_trainer(caps: dict[str, Path], parity_of: Any) -> None:
    code, report, _ = parity_of(caps["rollout"], caps["trainer32"])
    assert code == 1 and report is not None
    assert not report["logits"]["same_dtype"] and report["logits"]["tokens_differing"] == report["targets_and_mask"]["active_tokens"]
    assert report["our_logprob"]["tokens_differing"] > 0


def test_the_same_capture_twice_is_zero_everywhere_as_bytes(caps: dict[str, Path], parity_of: Any) -> None:
    code, report, _ = parity_of(caps["rollout"], caps["rollout"])
    assert code == 0 and report is not None and report["verdict"] == "bitwise_equal"
    n = report["targets_and_mask"]["tokens"]
    lp = report["our_logprob"]
    assert _f32(lp["rollout_logp"]) == _f32(lp["trainer_logp"])
    assert _f32(lp["per_token"]["diff"]) == bytes(4 * n)
    assert report["logits"]["per_token"]["columns_differing"] == [0] * n
    assert struct.pack(f"<{n}d", *report["logits"]["per_token"]["max_abs_diff"]) == bytes(8 * n)
    assert _f32(report["importance_ratio"]["ours"]["per_token"]) == _f32([1.0] * n)
    assert report["importance_ratio"]["ours"]["outside_bounds"] == 0


def test_an_engine_reporting_naive_bf16_log_softmax_shows_up_in_section_4(caps: dict[str, Path], tmp_path: Path) -> None:
    rollout, trainer = read_capture(caps["rollout"]), read_capture(caps["trainer"])
    naive = torch.log_softmax(rollout.logits, dim=-1)  # bf16 in, bf16 out: the stand-in engine's kernel
    reported = naive.gather(1, rollout.targets.clamp(min=0).unsqueeze(1)).squeeze(1).float()
    reported[~rollout.active] = float("nan")  # what an engine may leave on tokens it did not score
    ours_trainer, _ = our_logprob(trainer, ParityOptions())
    r_path, t_path = tmp_path / "r.safetensors", tmp_path / "t.safetensors"
    write_capture(r_path, Capture(rollout.logits, rollout.targets, rollout.active, reported, rollout.metadata))
    # negative control: a trainer that reports exactly our op's logprob
    write_capture(t_path, Capture(trainer.logits, trainer.targets, trainer.active, ours_trainer, trainer.metadata))
    code, report = _parity(r_path, t_path, tmp_path / "out")
    assert code == 1 and report is not None
    engine = report["engine_vs_ours"]
    assert not engine["rollout"]["bitwise_equal"] and engine["rollout"]["tokens_differing"] > 0
    assert engine["rollout"]["max_abs_diff"] > 1e-3  # bf16 rounding of the log-softmax
    assert engine["trainer"]["bitwise_equal"] and engine["trainer"]["tokens_differing"] == 0
    assert report["importance_ratio"]["engines"] is not None
    inactive = [i for i, on in enumerate(report["targets_and_mask"]["per_token"]["active"]) if not on]
    assert inactive and all(engine["rollout"]["per_token"]["diff"][i] is None for i in inactive)
    assert all(engine["rollout"]["per_token"]["reported_logp"][i] is None for i in inactive)


def test_ratio_statistics_are_the_exp_of_the_per_token_differences(caps: dict[str, Path], tmp_path: Path) -> None:
    code, report = _parity(caps["rollout"], caps["trainer32"], tmp_path, "--ratio-bounds", "0.999", "1.001")
    assert code == 1 and report is not None
    ratio, diffs = report["importance_ratio"]["ours"], report["our_logprob"]["per_token"]["diff"]
    active = report["targets_and_mask"]["per_token"]["active"]
    on = [i for i, a in enumerate(active) if a]
    for i in on:
        assert abs(ratio["per_token"][i] - math.exp(diffs[i])) <= 4e-7 * math.exp(diffs[i])
    values = [ratio["per_token"][i] for i in on]
    assert ratio["min"] == min(values) and ratio["max"] == max(values)
    assert ratio["mean"] == math.fsum(values) / len(values)
    outside = sum(1 for v in values if not 0.999 <= v <= 1.001)
    assert ratio["outside_bounds"] == outside > 0 and ratio["share_outside_bounds"] == outside / len(values)


def test_different_targets_are_refused_naming_the_first_token(caps: dict[str, Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    trainer = read_capture(caps["trainer"])
    targets = trainer.targets.clone()
    first = int(trainer.active.nonzero()[1, 0])
    targets[first] = (targets[first] + 1) % trainer.vocab
    path = tmp_path / "t.safetensors"
    write_capture(path, Capture(trainer.logits, targets, trainer.active, None, trainer.metadata))
    out = tmp_path / "out"
    code, _ = _parity(caps["rollout"], path, out)
    assert code == 2 and not out.exists()
    assert f"tensor targets differs at token {first}" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["truncated", "float-targets", "tiles", "backend", "bounds"])
def test_bad_inputs_are_refused_with_nothing_written(damage: str, caps: dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file

    trainer, extra = caps["trainer"], []
    if damage == "truncated":
        trainer = tmp_path / "t.safetensors"
        trainer.write_bytes(caps["trainer"].read_bytes()[:-100])
        expect = "trainer capture: "
    elif damage == "float-targets":
        cap = read_capture(caps["trainer"])
        trainer = tmp_path / "t.safetensors"
        targets = cap.targets.float()
        targets[0] = float("nan")
        save_file({"logits": cap.logits, "targets": targets, "active": cap.active}, str(trainer), metadata=dict(cap.metadata))
        expect = "tensor targets has dtype F32; it must be I64"
    elif damage == "tiles":
        extra, expect = ["--num-vocab-tiles", "3"], "num_vocab_tiles"
    elif damage == "backend":
        extra, expect = ["--backend", "auto-magic"], "backend='auto-magic' is not registered"
    else:
        extra, expect = ["--ratio-bounds", "1.2", "0.8"], "--ratio-bounds=1.2 0.8 must be"
    out = tmp_path / "out"
    code, _ = _parity(caps["rollout"], trainer, out, *extra)
    assert code == 2 and not out.exists()
    assert expect in capsys.readouterr().err


def test_the_workflow_exit_code_makes_a_difference_a_finding_but_a_refusal_still_fails(
        caps: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], parity_of: Any) -> None:
    """The parity stage passes --difference-exit-code 0: a difference is a finding (exit 0, report
    written); a refusal is exit 2 with nothing written, whatever the flag."""
    code, report = _parity(caps["rollout"], caps["trainer"], tmp_path / "a", "--difference-exit-code", "0")
    assert code == 0 and report is not None and report["verdict"] == "different"
    assert "a difference is a finding" in capsys.readouterr().out
    code, _, _ = parity_of(caps["rollout"], caps["trainer"])  # negative control: the default
    assert code == 1
    code, report = _parity(caps["rollout"], caps["trainer"], tmp_path / "c", "--difference-exit-code", "0",
                           "--num-vocab-tiles", "3")
    assert code == 2 and report is None and not (tmp_path / "c").exists()


def test_check_pair_refuses_what_the_verb_refuses_without_reading_logits(caps: dict[str, Path], tmp_path: Path) -> None:
    from rl_engine.capture.parity import ParityError, check_pair

    check_pair(caps["rollout"], caps["trainer"], ParityOptions())  # negative control: a good pair passes
    trainer = read_capture(caps["trainer"])
    targets = trainer.targets.clone()
    first = int(trainer.active.nonzero()[0, 0])
    targets[first] = (targets[first] + 1) % trainer.vocab
    other = tmp_path / "t.safetensors"
    write_capture(other, Capture(trainer.logits, targets, trainer.active, None, trainer.metadata))
    for args, named in (((caps["rollout"], other, ParityOptions()), f"tensor targets differs at token {first}"),
                        ((caps["rollout"], caps["trainer"], ParityOptions(num_vocab_tiles=3)), "num_vocab_tiles"),
                        ((caps["rollout"], caps["trainer"], ParityOptions(backend="auto")), "registered for the cpu"),
                        ((caps["rollout"], tmp_path / "absent", ParityOptions()), "trainer capture: ")):
        with pytest.raises(ParityError) as info:
            check_pair(*args)
        assert named in str(info.value), str(info.value)


def test_the_fused_backend_gives_the_same_logprob_bytes_and_is_recorded(caps: dict[str, Path], tmp_path: Path,
                                                                       parity_of: Any) -> None:
    _, eager, _ = parity_of(caps["rollout"], caps["trainer"])
    _, fused = _parity(caps["rollout"], caps["trainer"], tmp_path / "fused", "--backend", "cpu-vocab-parallel-logp-ws2")
    assert eager is not None and fused is not None
    for side in ("rollout_logp", "trainer_logp"):
        assert _f32(eager["our_logprob"][side]) == _f32(fused["our_logprob"][side])
    assert fused["backend"] == "cpu-vocab-parallel-logp-ws2"
    assert fused["our_logprob"]["provenance"]["trainer"]["actual_backend"] == "cpu-vocab-parallel-logp-ws2"
    assert eager["our_logprob"]["provenance"]["trainer"]["actual_backend"] == "pytorch-vocab-parallel-logp-ws2"


def test_the_worked_example_of_docs_capture_md_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The page's python block as written, then its parity command: exit 1, the differences come
    from the logits alone, and the first token of each sequence is equal on both sides."""
    import re

    page = (Path(__file__).resolve().parent.parent / "docs" / "capture.md").read_text(encoding="utf-8")
    example = page.split("### Worked example", 1)[1]
    block = re.search(r"```python\n(.*?)```", example, re.S)
    assert block is not None
    monkeypatch.chdir(tmp_path)
    exec(compile(block.group(1), "docs/capture.md", "exec"), {})
    command = re.search(r"\n    (python -m rl_engine parity .*)\n", example)
    assert command is not None
    argv = command.group(1).split()[3:]
    assert cli.main(argv) == 1
    report = jsonio.load(tmp_path / "parity" / "parity.json")
    lp, lg = report["our_logprob"], report["logits"]
    assert lp["from_logits_only"] and lp["control"]["bitwise_equal"] and not lg["bitwise_equal"]
    starts = [0, 6, 17]  # each sequence's first row (lengths 7, 12, 9)
    assert [lg["per_token"]["columns_differing"][i] for i in starts] == [0, 0, 0]
    assert all(lp["per_token"]["bitwise_equal"][i] for i in starts)
    table = capsys.readouterr().out
    lines = re.findall(r"\n    (│ [1-5] .*│)", example)
    assert len(lines) == 6
    for line in lines:  # the page's table rows that no kernel choice changes, exactly
        if line.startswith(("│ 1", "│ 4")):
            assert line in table, line
    assert "from the logits only; control ok" in table and "from the logits only; control ok" in lines[2]
    # the page's end-to-end config, on these captures, passes the workflow's config check with both stages
    import yaml

    from rl_engine.workflow import check_config, stage_flags

    whole = page.split("## Worked example: from a capture to a verified archive", 1)[1]
    overrides = yaml.safe_load(re.search(r"```yaml\n(.*?)```", whole, re.S).group(1))  # type: ignore[union-attr]
    for section, keys in (("inputs", ("capture",)), ("parity", ("rollout", "trainer"))):
        for key in keys:
            overrides[section][key] = str(tmp_path / overrides[section][key])
    root = Path(__file__).resolve().parent.parent
    config = {**yaml.safe_load((root / "config.yaml").read_text()), **overrides}
    monkeypatch.chdir(root)  # where snakemake runs (the focused tests' paths)
    assert stage_flags(check_config(config)) == {"capture": True, "parity": True}


def test_the_default_tile_count_is_the_api_s_auto_rule_so_our_in_engine_logprob_compares_bitwise(
        caps: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The verb's, the options' and the workflow's default ``num_vocab_tiles`` is ``selected_logprob``'s own
    default (read from its signature: this fails the day they diverge), resolved by the API's resolver: a
    rollout that reports ``selected_logprob(logits, targets, active)`` with every default is bitwise equal
    to ours in section 4. Negative control: one tile (the verb's old default) gives other bytes there."""
    import inspect

    from rl_engine.campaign.casename import report_parity_identity
    from rl_engine.logprob import selected_logprob
    from rl_engine.logprob.api import resolve_vocab_tiles
    from rl_engine.verb_parsers import parity_parser
    from rl_engine.workflow.config import PARITY_DEFAULTS, config_parity

    api_default = inspect.signature(selected_logprob).parameters["num_vocab_tiles"].default
    assert parity_parser().parse_args(["r", "t", "--output-dir", "o"]).num_vocab_tiles == api_default
    assert ParityOptions().num_vocab_tiles == api_default == PARITY_DEFAULTS["num_vocab_tiles"]
    rollout = read_capture(caps["rollout"])
    reported = selected_logprob(rollout.logits, rollout.targets, rollout.active).selected_logp
    path = tmp_path / "in-engine.safetensors"
    write_capture(path, Capture(rollout.logits, rollout.targets, rollout.active, reported, rollout.metadata))
    code, report = _parity(path, caps["trainer"], tmp_path / "auto")
    assert code == 1 and report is not None
    engine = report["engine_vs_ours"]["rollout"]
    assert engine["bitwise_equal"] and engine["tokens_differing"] == 0
    on = [d for d, a in zip(engine["per_token"]["diff"], report["targets_and_mask"]["per_token"]["active"]) if a]
    assert _f32(on) == bytes(4 * len(on))  # +0.0 on every active token, as bytes
    expected = resolve_vocab_tiles(api_default, rollout.vocab)
    assert report["num_vocab_tiles"] == expected["resolved"] == 8  # 4096 columns at max_tp 8: tiles of 512
    assert report["num_vocab_tiles_rule"] == {"requested": "auto", "rule": expected["rule"], "max_tp": 8}
    assert "│ 4 rollout engine vs ours │ bitwise equal" in capsys.readouterr().out
    # the workflow's case hash holds the count parity.json records, so verify computes the same name
    section = {"rollout": str(path), "trainer": str(caps["trainer"])}
    identity = config_parity({"parity": section})
    assert identity == report_parity_identity(report) == config_parity({"parity": {**section, "num_vocab_tiles": 8}})
    # negative control: another tile count gives other bytes on some tokens
    code, one = _parity(path, caps["trainer"], tmp_path / "one", "--num-vocab-tiles", "1")
    assert code == 1 and one is not None and one["num_vocab_tiles_rule"]["rule"] == "given"
    assert not one["engine_vs_ours"]["rollout"]["bitwise_equal"] and one["engine_vs_ours"]["rollout"]["tokens_differing"] > 0


def test_auto_tiles_without_a_count_for_the_vocabulary_is_refused_naming_the_option(tmp_path: Path) -> None:
    """50257 columns have no count under the auto rule: refused (exit 2, nothing written) naming
    --num-vocab-tiles; an explicit count that divides them is accepted (the control)."""
    from rl_engine.capture import build_metadata
    from rl_engine.capture.parity import ParityError, check_pair

    gen = torch.Generator().manual_seed(3)
    vocab = 50257
    logits = torch.randn(2, vocab, generator=gen).to(torch.bfloat16)
    cap = Capture(logits, torch.tensor([1, 2]), torch.tensor([True, True]), None,
                  build_metadata(engine="e", engine_version="1", model="m", dtype="bf16"))
    path = tmp_path / "c.safetensors"
    write_capture(path, cap)
    with pytest.raises(ParityError, match=r"num_vocab_tiles: .*50257.*--num-vocab-tiles N"):
        check_pair(path, path, ParityOptions())
    assert check_pair(path, path, ParityOptions(num_vocab_tiles=1)) == 1
    code, _ = _parity(path, path, tmp_path / "out")
    assert code == 2 and not (tmp_path / "out").exists()


def _near_one_report(caps: dict[str, Path], parity_of: Any) -> dict[str, Any]:
    """A real report whose ratios (and our logprob differences) are then set to values all within 1e-5
    of 1 (their logarithms): 1 exactly, and 1 + k * 2^-23 and 1 - k * 2^-24 for k up to 60 (3.6e-6)."""
    _, report, _ = parity_of(caps["rollout"], caps["trainer"])
    assert report is not None
    act = report["targets_and_mask"]["per_token"]["active"]
    ratios = []
    for i, on in enumerate(act):
        k = 3 * i if on else 0
        value = 1.0 if i % 5 == 0 else (1.0 + k * 2.0**-23 if i % 2 else 1.0 - k * 2.0**-24)
        ratios.append(value)
    report["importance_ratio"]["ours"]["per_token"] = ratios
    assert all(abs(r - 1) < 1e-5 for r in ratios) and len({r for r, a in zip(ratios, act) if a}) > 10
    return report


def test_ratios_within_1e_5_of_1_are_visible_on_the_log_scale_panel(caps: dict[str, Path], parity_of: Any) -> None:
    """parity.png's |ratio - 1| panel spreads ratios that are all within 1e-5 of 1 over most of its width
    (log bins and axis), where the linear ratio panel, whose axis spans the bounds [0.8, 1.2], draws them
    all inside one pixel (the negative control that shows why the panel exists); the exact ones are
    counted apart, and every bar's count comes from the report."""
    report = _near_one_report(caps, parity_of)
    act = report["targets_and_mask"]["per_token"]["active"]
    ratios = [r for r, a in zip(report["importance_ratio"]["ours"]["per_token"], act) if a]
    fig = parity.build_figure(report)
    linear_ax, log_ax = fig.axes[2], fig.axes[3]
    assert log_ax.get_xscale() == "log" and linear_ax.get_xscale() == "linear"
    assert "|ratio - 1|" in log_ax.get_title()
    fig.canvas.draw()

    def pixels(ax: Any, low: float, high: float) -> float:
        return float(ax.transData.transform((high, 0))[0] - ax.transData.transform((low, 0))[0])

    deviations = [abs(r - 1) for r in ratios if r != 1.0]
    assert pixels(linear_ax, min(ratios), max(ratios)) < 1.0  # one pixel: invisible as a spread
    assert pixels(log_ax, min(deviations), max(deviations)) > 0.5 * log_ax.bbox.width
    bars = [p.get_height() for p in log_ax.patches]
    assert sum(bars) == len(deviations) and sum(1 for h in bars if h) > 3
    exact = sum(1 for r in ratios if r == 1.0)
    texts = " ".join(t.get_text() for t in log_ax.texts)
    assert exact > 0 and f"exactly 1: {exact} of {len(ratios)} active tokens" in texts
    assert f"largest {max(deviations):.3g}" in texts
    png = parity.render_png(report)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_title_says_which_rows_had_equal_logits_and_whether_they_gave_equal_bytes(
        caps: dict[str, Path], parity_of: Any) -> None:
    """No equal logits row (bf16 against fp32 logits): the title says so and claims nothing about equal
    logits giving equal bytes; the sentence of the old title, a vacuous "yes", is gone in every case.
    Some equal rows with equal bytes: named, "equal on all". An equal row whose bytes differ (the
    report edited to say so): named, "DIFFER"."""
    _, none_equal, _ = parity_of(caps["rollout"], caps["trainer32"])
    assert none_equal is not None and none_equal["our_logprob"]["from_logits_only"]  # vacuously true
    active = none_equal["targets_and_mask"]["active_tokens"]
    title = parity.headline(none_equal)
    assert title.endswith(f"logits rows bitwise equal on 0 of {active} active tokens: no token where equal "
                          "logits could give equal logprob bytes")
    _, same, _ = parity_of(caps["rollout"], caps["rollout"])
    assert same is not None
    act = same["targets_and_mask"]["per_token"]["active"]
    on = [i for i, a in enumerate(act) if a]
    assert parity.headline(same).endswith(f"bitwise equal on {len(on)} of {len(on)} active tokens (tokens "
                                          f"{', '.join(map(str, on[:6]))}, ...); our logprob bytes are equal "
                                          f"on all {len(on)}")
    same["our_logprob"]["from_logits_only"] = False
    same["our_logprob"]["tokens_equal_logits_different_logp"] = [on[1]]
    assert parity.headline(same).endswith(f"; our logprob bytes DIFFER on 1 of them (token {on[1]})")
    for report in (none_equal, same):
        assert "equal logits give equal logprob bytes" not in parity.headline(report)
