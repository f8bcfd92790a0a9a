"""A campaign whose ranks run the Triton kernels (under the interpreter) has the eager fingerprints.

Real runs: ``plan`` and ``launch`` (torchrun, gloo ranks) with backend
``triton-vocab-parallel-logp-ws2`` and ``RL_ENGINE_TRITON_MODE=interpreter`` (the explicit
choice that lets the backend serve CPU tensors), TP x CP = 2x2 in the zigzag layout (TP and CP
sharding both; every rank runs the interpreter), on a small case. The single-rank path (the merge
kernel) gives the eager bytes in ``tests/test_triton_backend.py``; a 1x1 launch here would add a
torchrun and a rank (each a Python that imports torch) to show it again. Every report's four
fingerprints (logp, LSE, entropy, gradient) equal the eager backend's single-process replay, and
every report records the mode it ran in (``dispatch.modes == ["interpreter"]``). Without the variable the plan is refused (the backend
serves cuda only).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")
from test_fused_campaign import CASE, EAGER, FIELDS, _campaign, _flags  # noqa: E402

from rl_engine import cli  # noqa: E402
from rl_engine.campaign.replay import replay_candidate  # noqa: E402

pytestmark = pytest.mark.slow

TRITON = "triton-vocab-parallel-logp-ws2"


def test_interpreted_triton_campaign_has_the_eager_fingerprints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("RL_ENGINE_TRITON_MODE", raising=False)
    assert cli.main(["plan", *_flags(TRITON, "zigzag"), "--topologies", "1x1,2x1",
                     "--output", str(tmp_path / "refused.json")]) != 0
    assert "does not run on device='cpu'" in capsys.readouterr().err
    monkeypatch.setenv("RL_ENGINE_TRITON_MODE", "interpreter")
    expected = replay_candidate({**CASE, "backend": EAGER}).fingerprints()
    reports = _campaign(tmp_path / "zigzag", TRITON, "zigzag", ("2x2",))
    assert sorted(reports) == ["2x2"]
    for topology, report in reports.items():
        assert report["passed"] is True, (topology, report["failures"])
        assert report["actual_backend"] == TRITON and report["fallback"] is False
        assert report["dispatch"]["modes"] == ["interpreter"]
        prints = report["bitwise_fingerprints"]
        assert {k: prints[k] for k in FIELDS} == expected, topology
