"""Every arithmetic version stays replayable: an archive made under ``rl-engine-arith/1`` verifies.

``tests/fixtures/archives/`` holds the default campaign's archive as commit af6dba5 made it,
under ``rl-engine-arith/1`` (40 KB). This installation computes ``rl-engine-arith/2``; its
verifier must still pass that archive, ``--recompute`` included (the replay runs the NumPy
implementation of /1, :func:`rl_engine.campaign.replay.replay_numpy`), and the repository's
``docs/arithmetic-1.md`` is the very text the archive packs. Negative controls: the same case
replayed under /2 gives other bytes, a report claiming a version nobody defined is refused,
and a /1 archive whose reports are relabelled /2 fails.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from rl_engine.arith.portable import SPEC_VERSION
from rl_engine.arith.spec_numpy import SPEC_V1
from rl_engine.campaign.replay import ReplayError, replay_candidate, replay_numpy
from rl_engine.evidence.verify import verify

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "archives" / "rl-engine-logprob-af6dba5-case-c7d2b29e.tar.gz"
TOP = FIXTURE.name[: -len(".tar.gz")]


def _member(name: str) -> bytes:
    with tarfile.open(FIXTURE, "r:gz") as tar:
        handle = tar.extractfile(f"{TOP}/{name}")
        assert handle is not None
        return handle.read()


def _rows(checks: list) -> dict[str, str]:
    return {c.name: c.status() for c in checks}


def test_the_fixture_is_an_arith1_archive_and_its_spec_is_docs_arithmetic_1() -> None:
    report = json.loads(_member("tp1-cp1.json"))
    assert report["arithmetic_spec"] == SPEC_V1 != SPEC_VERSION
    assert _member("arithmetic.md") == (REPO / "docs" / "arithmetic-1.md").read_bytes()


def test_an_arith1_archive_verifies_with_recompute(tmp_path: Path) -> None:
    archive = tmp_path / FIXTURE.name
    shutil.copy(FIXTURE, archive)
    shutil.copy(FIXTURE.with_name(FIXTURE.name + ".sha256"), archive.with_name(archive.name + ".sha256"))
    checks = verify(archive, recompute_drift=True)
    rows = _rows(checks)
    assert [name for name, status in rows.items() if status == "FAIL"] == [], [
        (c.name, c.problems[:3]) for c in checks if c.passed is False]
    assert rows["candidate replayed"] == rows["arithmetic spec"] == rows["REVIEWING.md"] == "PASS"
    detail = next(c.detail for c in checks if c.name == "arithmetic spec")
    assert SPEC_V1 in detail and "replayed under its own" in detail


def test_replaying_the_arith1_case_under_arith2_gives_other_bytes() -> None:
    """Negative control: the /1 replay is what makes the archive verify."""
    case = json.loads(_member("tp1-cp1.json"))["case"]
    prints = json.loads(_member("tp1-cp1.json"))["bitwise_fingerprints"]
    recorded = {k: v for k, v in prints.items() if k.endswith("_sha256")}
    assert replay_numpy(case, SPEC_V1).fingerprints() == recorded
    current = replay_candidate(case).fingerprints()
    assert current != recorded
    assert current["candidate_lse_sha256"] != recorded["candidate_lse_sha256"]
    with pytest.raises(ReplayError, match="rl-engine-arith/9"):
        replay_numpy(case, "rl-engine-arith/9")


def _relabelled(tmp_path: Path, version: str) -> Path:
    """The fixture with every report's arithmetic_spec replaced and SHA256SUMS recomputed (a
    forger's work); the packed specification and REVIEWING.md are left as they are."""
    import hashlib

    with tarfile.open(FIXTURE, "r:gz") as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
    edited = {}
    for m, data in members:
        if data is not None and m.name.endswith(".json") and "/tp" in m.name:
            doc = json.loads(data)
            doc["arithmetic_spec"] = version
            edited[m.name] = json.dumps(doc, indent=2).encode()
    files = {m.name: edited.get(m.name, data) for m, data in members if data is not None}
    sums = "".join(f"{hashlib.sha256(d).hexdigest()}  {n[len(TOP) + 1:]}\n" for n, d in sorted(files.items())
                   if not n.endswith("/SHA256SUMS"))
    files[f"{TOP}/SHA256SUMS"] = sums.encode()
    out = tmp_path / FIXTURE.name
    with tarfile.open(out, "w:gz") as tar:
        for m, _ in members:
            if m.isdir():
                tar.addfile(m)
                continue
            data = files[m.name]
            m.size = len(data)
            tar.addfile(m, io.BytesIO(data))
    return out


@pytest.mark.parametrize("version", [SPEC_VERSION, "rl-engine-arith/9"])
def test_a_relabelled_arith1_archive_fails_the_arithmetic_spec(tmp_path: Path, version: str) -> None:
    checks = verify(_relabelled(tmp_path, version), skip_outer=True)
    row = next(c for c in checks if c.name == "arithmetic spec")
    assert row.passed is False
    text = " ".join(row.problems)
    if version == SPEC_VERSION:  # the packed text is /1's
        assert f"its first line names version '{SPEC_V1}'" in text
    else:
        assert "is not a version this verifier replays" in text
