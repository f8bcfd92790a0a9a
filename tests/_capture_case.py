"""A tiny capture written by a test, and the campaign case that runs on it (not a test module).

16 tokens (2 sequences of 8) x 64 columns of bf16 logits from a seeded generator, the first
three positions of each sequence inactive with target -100 (as a trainer masks a prompt).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rl_engine.campaign.captured import capture_record
from rl_engine.campaign.case import Case, write_case_file
from rl_engine.capture import Capture, build_metadata, write_capture

BATCH, SEQ, VOCAB, TILES = 2, 8, 64, 4
CASE_FIELDS: dict[str, Any] = {
    "device": "cpu", "dtype": "bf16", "backend": "pytorch-vocab-parallel-logp-ws2",
    "real_vocab": VOCAB, "padded_vocab": VOCAB, "num_vocab_tiles": TILES, "batch": BATCH,
    "seq": SEQ, "prompt_tokens": 3, "seed": 0,
}


def tiny_capture(seed: int = 5) -> Capture:
    gen = torch.Generator().manual_seed(seed)
    tokens = BATCH * SEQ
    logits = (torch.randn(tokens, VOCAB, generator=gen) * 3).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (tokens,), generator=gen)
    active = (torch.arange(tokens) % SEQ) >= 3
    targets[~active] = -100
    meta = build_metadata(engine="test", engine_version="0", model="seeded-randn", dtype="bf16",
                          notes=f"tests/_capture_case.py seed {seed}")
    return Capture(logits, targets, active, None, meta)


def ragged_capture(prompts: tuple[int, ...] = (2, 5), seed: int = 5) -> Capture:
    """:func:`tiny_capture`'s logits with prompts of ``prompts`` tokens (one per sequence): a mask no
    ``prompt_tokens`` describes, as a trainer's batch of prompts of different lengths has."""
    base = tiny_capture(seed)
    position = torch.arange(BATCH * SEQ) % SEQ
    active = position >= torch.tensor(prompts).repeat_interleave(SEQ)
    gen = torch.Generator().manual_seed(seed + 1)
    targets = torch.where(active, torch.randint(0, VOCAB, (BATCH * SEQ,), generator=gen), torch.tensor(-100))
    meta = build_metadata(engine="test", engine_version="0", model="seeded-randn", dtype="bf16",
                          notes=f"tests/_capture_case.py seed {seed}, prompts {list(prompts)}")
    return Capture(base.logits, targets, active, None, meta)


# Per-row sampling of a rollout batch that mixes requests (one value per token of the 16): rows at
# temperature != 1, with and without truncation, every parameter alone and combined.
ROW_TEMPERATURE = (1.0, 0.7, 1.3, 0.5, 1.0, 0.9, 2.0, 0.7, 1.0, 0.6, 1.1, 1.0, 0.8, 1.5, 0.7, 1.0)
ROW_TOP_K = (0, 3, 0, 0, 5, 0, 2, 0, 0, 0, 4, 40, 0, 1, 0, 0)
ROW_TOP_P = (1.0, 1.0, 0.9, 1.0, 1.0, 0.5, 1.0, 0.8, 1.0, 1.0, 0.7, 0.95, 1.0, 1.0, 0.3, 1.0)
ROW_MIN_P = (0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.05, 0.0, 0.2, 0.0, 0.0, 0.0, 0.02, 0.0, 0.0, 0.0)


def row_sampling(**changes: tuple[float, ...]) -> Any:
    """The per-row :class:`~rl_engine.capture.RowSampling` of :data:`ROW_TEMPERATURE` and the rest
    (``changes`` replace a parameter's 16 values)."""
    from rl_engine.capture.format import RowSampling

    values = {"temperature": ROW_TEMPERATURE, "top_k": ROW_TOP_K, "top_p": ROW_TOP_P, "min_p": ROW_MIN_P, **changes}
    return RowSampling(torch.tensor(values["temperature"], dtype=torch.float32),
                       torch.tensor(values["top_k"], dtype=torch.int64),
                       torch.tensor(values["top_p"], dtype=torch.float32),
                       torch.tensor(values["min_p"], dtype=torch.float32))


OUTSIDE_ROWS = (4, 13)  # active rows whose random target falls outside the row's kept set (top_k 5 and 1)


def sampled_capture(seed: int = 5, **changes: tuple[float, ...]) -> Capture:
    """:func:`tiny_capture` with the rollout's per-row sampling tensors (:func:`row_sampling`) and, as a
    sampler draws them, targets among each active row's largest logits (the ``row % 3``-th largest),
    except on :data:`OUTSIDE_ROWS`, which keep :func:`tiny_capture`'s random targets."""
    base = tiny_capture(seed)
    ranked = base.logits.float().argsort(dim=1, descending=True, stable=True)
    rows = torch.arange(BATCH * SEQ)
    targets = torch.where(base.active, ranked[rows, rows % 3], base.targets)
    targets[list(OUTSIDE_ROWS)] = base.targets[list(OUTSIDE_ROWS)]
    meta = build_metadata(engine="test", engine_version="0", model="seeded-randn", dtype="bf16",
                          notes=f"tests/_capture_case.py seed {seed}, per-row sampling")
    return Capture(base.logits, targets, base.active, None, meta, sampling=row_sampling(**changes))


def write_tiny_capture(path: Path, seed: int = 5) -> Path:
    write_capture(path, tiny_capture(seed))
    return path


def write_trainer_side(path: Path, seed: int = 5, scale: float = 1.001, rollout: Capture | None = None) -> Path:
    """The same tokens, targets and mask as ``rollout`` (default :func:`tiny_capture` of ``seed``), the
    logits in fp32 and scaled by ``scale``: a trainer's capture whose logits differ from the rollout's on
    every token."""
    rollout = tiny_capture(seed) if rollout is None else rollout
    meta = build_metadata(engine="test-trainer", engine_version="0", model="seeded-randn", dtype="fp32",
                          notes=f"tests/_capture_case.py seed {seed} x {scale}")
    write_capture(path, Capture(rollout.logits.float() * scale, rollout.targets, rollout.active, None, meta))
    return path


def capture_case(path: Path, archive: bool = False, **changes: Any) -> Case:
    return Case.create(**{**CASE_FIELDS, **changes}, capture=capture_record(path, archive))


def launch_topology(plan: Path, topology: str) -> int:
    """The ``launch`` verb of one topology (``"TPxCP"``) of ``plan``, in this process (its torchrun and
    ranks are the processes), with no ``RL_ENGINE_FAULT`` of the caller's; its exit code."""
    import pytest

    from rl_engine import cli

    tp, cp = topology.split("x")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("RL_ENGINE_FAULT", raising=False)
        return cli.main(["launch", "--plan", str(plan), "--tp", tp, "--cp", cp, "--timeout-s", "120",
                         "--log", str(plan.parent / "logs" / f"tp{tp}-cp{cp}.log")])


def verify_archive(archive: Path, tmp_path: Path, *flags: str) -> tuple[int, dict[str, dict]]:
    """``verify`` of ``archive`` with ``flags``: its exit code and its checks by name."""
    from rl_engine import jsonio
    from rl_engine.evidence import verify

    out = tmp_path / "verify.json"
    code = verify.main([str(archive), "--json", str(out), *flags])
    return code, {c["name"]: c for c in jsonio.load(out)["checks"]}


def campaign_to_archive(tmp_path: Path, case: Case, topologies: tuple[str, ...],
                        recorded_from: Path) -> tuple[Path, Path]:
    """``case`` through every verb (plan, each topology's ranks, validate, crosscheck, summary, archive),
    with the environment and focused-suite files of the session's run ``recorded_from`` (conftest's tiny
    run: :func:`_evidence_run.copy_recorded`): the run directory and the archive. Asserts each verb's
    success. The ranks are the runner a torchrun rank calls, on gloo processes forked from one that
    imported torch (tests/_multiproc.py), not a torchrun launch (a process that imports torch per rank):
    the ``launch`` verb on a capture case is tests/test_capture_campaign.py's snakemake run's (so the
    run has no topology log to declare)."""
    from rl_engine import cli

    from _evidence_run import copy_recorded, declared_files, pack, run_forked

    run_dir = tmp_path / "rl-engine-test-run"
    (run_dir / "logs").mkdir(parents=True)
    write_case_file(run_dir / "case.json", case, tuple(tuple(int(x) for x in t.split("x")) for t in topologies))
    assert cli.main(["plan", "--case", str(run_dir / "case.json"), "--output", str(run_dir / "plan.json")]) == 0
    for topology in topologies:
        run_forked(run_dir / "plan.json", topology)
    copy_recorded(recorded_from, run_dir)
    for verb, out in (("validate", "validation.json"), ("crosscheck", "crosscheck.json"), ("summary", "SUMMARY.md")):
        assert cli.main([verb, "--run-dir", str(run_dir), "--output", str(run_dir / out)]) == 0, verb
    archive = tmp_path / "out" / f"{run_dir.name}.tar.gz"
    assert pack(run_dir, archive, declared_files(run_dir, topologies)) == 0
    return run_dir, archive
