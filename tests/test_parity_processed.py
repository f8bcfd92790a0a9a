"""Parity's section 6 (``processed``) on synthetic captures that carry sampling parameters (no engine).

A rollout capture with per-row temperature, top-k, top-p and min-p (planted ties in bf16 logits) and
an engine report built from our own processed logprob: section 6 finds the report bitwise equal and
explains the whole gap (fraction 1); one token nudged by one ulp is the only residual and lowers the
fraction by exactly its share; an active target outside our kept set and one the engine reports as
``-inf`` are counted, listed and left out of the aggregates; a capture without sampling parameters has
``processed: null``; every report validates against parity.schema.json.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_engine import cli, jsonio, schemas
from rl_engine.capture import Capture, RowSampling, build_metadata, write_capture
from rl_engine.capture.parity import ParityOptions, build_report, sampled_logprob
from rl_engine.logprob import selected_logprob
from rl_engine.tensorio import tensor_bytes

VOCAB = 64
TEMPS = [1.0, 1.0, 0.7, 0.7, 0.7, 1.0, 1.0, 1.3, 1.3, 0.7, 1.0, 1.3]
TOP_K = [0, 0, 3, 0, 5, 0, 2, 0, 4, 3, 0, 0]
TOP_P = [1.0, 1.0, 1.0, 0.8, 1.0, 0.9, 1.0, 1.0, 0.7, 0.9, 1.0, 1.0]
MIN_P = [0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.2, 0.0, 0.05, 0.0, 0.0]
ACTIVE = [False, False] + [True] * 10
OUTSIDE = 2  # active token whose target is the row's smallest logit, outside top_k=3


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(len(TEMPS), VOCAB, generator=gen) * 2).round().to(torch.bfloat16)  # many ties
    targets = logits.float().argmax(dim=1)
    targets[OUTSIDE] = int(logits[OUTSIDE].float().argmin())
    targets[6] = int(logits[6].float().argsort(descending=True, stable=True)[1])  # 2nd of top_k=2: kept
    return logits, targets


def _sampling() -> RowSampling:
    return RowSampling(torch.tensor(TEMPS), torch.tensor(TOP_K), torch.tensor(TOP_P), torch.tensor(MIN_P))


def _ours_alone() -> torch.Tensor:
    """Our processed logprob of each row in a call of its own (scalar parameters; +0 on inactive rows)."""
    logits, targets = _rows()
    out = []
    for i in range(len(TEMPS)):
        got = selected_logprob(logits[i:i + 1], targets[i:i + 1], torch.tensor([ACTIVE[i]]), temperature=TEMPS[i],
                               top_k=TOP_K[i], top_p=TOP_P[i], min_p=MIN_P[i], backend="pytorch-vocab-parallel-logp-ws2")
        out.append(got.selected_logp)
    return torch.cat(out)


def _write(tmp_path: Path, reported: torch.Tensor | None, sampling: bool = True) -> tuple[Path, Path]:
    logits, targets = _rows()
    meta = build_metadata(engine="stand-in", engine_version="0", model="synthetic", dtype="bf16")
    active = torch.tensor(ACTIVE)
    rollout = Capture(logits, targets, active, None, meta, sampling=_sampling() if sampling else None,
                      reported_processed_logp=reported)
    paths = tmp_path / "rollout.safetensors", tmp_path / "trainer.safetensors"
    write_capture(paths[0], rollout)
    write_capture(paths[1], Capture(logits, targets, active, None, meta))
    return paths


def _report(tmp_path: Path, reported: torch.Tensor | None, sampling: bool = True) -> dict[str, Any]:
    report = build_report(*_write(tmp_path, reported, sampling), ParityOptions())
    assert schemas.errors(jsonio.loads(jsonio.dumps(report)), "parity") == []
    return report


def test_our_processed_logprob_of_the_capture_is_each_rows_own_call_and_the_control_differs(tmp_path: Path) -> None:
    from rl_engine.capture import read_capture

    path, _ = _write(tmp_path, None)
    cap = read_capture(path)
    logp, kept = sampled_logprob(cap, ParityOptions())
    assert tensor_bytes(logp) == tensor_bytes(_ours_alone())
    assert [i for i, k in enumerate(kept.tolist()) if not k] == [OUTSIDE]
    tempered, _ = sampled_logprob(cap, ParityOptions(), truncate=False)
    assert tensor_bytes(tempered) != tensor_bytes(logp)  # the truncation changes the bytes


def test_an_engine_reporting_our_processed_bytes_is_explained_in_full(tmp_path: Path) -> None:
    ours = _ours_alone()
    reported = ours.clone()
    reported[OUTSIDE] = -1.5  # the engine kept this target (e.g. a tie at the k-th value): finite
    section = _report(tmp_path, reported)["processed"]
    assert section["engine_reported"] and section["active_tokens"] == 10 and section["truncated_tokens"] == 8
    assert section["target_not_kept"] == {"count": 1, "tokens": [OUTSIDE]}
    assert section["engine_target_not_kept"] == {"count": 0, "tokens": []}
    assert section["counted_tokens"] == 9
    assert section["residual"]["max_abs"] == 0.0 and section["residual"]["tokens_differing"] == 0
    assert not section["residual"]["bitwise_equal"]  # the token outside our kept set is a difference
    assert section["fraction_explained"] == 1.0
    per = section["per_token"]
    assert per["processed_logp"][OUTSIDE] is None and per["target_kept"][OUTSIDE] is False
    assert per["gap"][:2] == [None, None]  # inactive
    # at temperature 1 with nothing on (token 10) the processed logprob is the raw one: no gap
    assert per["gap"][10] == 0.0 and per["explained"][10] == 0.0


def test_a_one_ulp_residual_is_counted_and_takes_exactly_its_share(tmp_path: Path) -> None:
    ours = _ours_alone()
    reported = ours.clone()
    reported[OUTSIDE] = float("-inf")  # the engine's sampler removed it too
    reported[4] = torch.nextafter(ours[4], torch.tensor(0.0))
    section = _report(tmp_path, reported)["processed"]
    assert section["engine_target_not_kept"] == {"count": 1, "tokens": [OUTSIDE]}
    assert section["residual"]["tokens_differing"] == 1 and not section["residual"]["bitwise_equal"]
    per = section["per_token"]
    counted = [i for i in range(len(TEMPS)) if ACTIVE[i] and i != OUTSIDE]
    gap = math.fsum(abs(per["gap"][i]) for i in counted)
    residual = abs(per["residual"][4])
    assert residual == abs(float(reported[4]) - float(ours[4])) > 0
    assert section["fraction_explained"] == 1.0 - residual / gap
    assert section["residual"]["max_abs"] == residual


def test_without_an_engine_report_the_split_is_still_reported(tmp_path: Path) -> None:
    section = _report(tmp_path, None)["processed"]
    assert not section["engine_reported"] and section["gap"] is None and section["residual"] is None
    assert section["fraction_explained"] is None and section["engine_target_not_kept"] is None
    per = section["per_token"]
    assert per["reported_processed_logp"] is None and per["gap"] is None
    # rows at temperature 1 with nothing on: no explained difference; tempered-only rows: no truncation part
    assert per["explained"][10] == 0.0
    assert section["explained"]["max_abs"] > 0 and section["truncation_part"]["max_abs"] > 0


def test_a_capture_without_sampling_parameters_has_no_section_6(tmp_path: Path) -> None:
    report = _report(tmp_path, None, sampling=False)
    assert report["processed"] is None
    assert report["captures"]["rollout"]["has_sampling"] is False


@pytest.mark.parametrize("backend", ["pytorch-vocab-parallel-logp-ws2"])
def test_the_verb_writes_section_6_and_its_figure(tmp_path: Path, backend: str) -> None:
    rollout, trainer = _write(tmp_path, _ours_alone())
    code = cli.main(["parity", str(rollout), str(trainer), "--output-dir", str(tmp_path / "p"), "--backend", backend])
    assert code == 0  # the two sides' logits are the same: our raw logprobs are bitwise equal
    report = jsonio.load(tmp_path / "p" / "parity.json")
    assert report["processed"]["fraction_explained"] == 1.0 and (tmp_path / "p" / "parity.png").stat().st_size > 0
    from rl_engine.capture.parity import figure_panels

    panel = figure_panels(report)[-1]
    assert panel.title == "rollout engine's processed logprob - our processed"
    # every counted token bitwise equal (exact zeros), the one outside our kept set not finite
    assert (panel.zeros, panel.non_finite, panel.values) == (9, 1, ())


def test_summary_md_has_a_row_for_section_6_only_when_the_report_has_one(tmp_path: Path) -> None:
    from rl_engine.evidence.summary import parity_section

    reported = _ours_alone()
    reported[4] = torch.nextafter(reported[4], torch.tensor(0.0))
    report = _report(tmp_path, reported)
    rows = dict(parity_section(report).rows)
    text = rows["6 Processed logprob (rollout's sampling parameters)"]
    assert "engine - ours: 1 of 9 counted tokens differ" in text
    assert f"{report['processed']['fraction_explained']!r}" in text and "1 target(s) outside our kept set" in text
    plain = _report(tmp_path / "plain", None, sampling=False)
    assert not any(name.startswith("6 ") for name, _ in parity_section(plain).rows)


@pytest.mark.parametrize("path, value", [(("fraction_explained",), 1.5), (("parameters_from",), "trainer"),
                                         (("target_not_kept", "count"), -1), (("per_token", "target_kept"), [1.0])])
def test_the_schema_refuses_a_damaged_section_6(tmp_path: Path, path: tuple[str, ...], value: object) -> None:
    report = jsonio.loads(jsonio.dumps(_report(tmp_path, _ours_alone())))
    node = report["processed"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert schemas.errors(report, "parity") != []
