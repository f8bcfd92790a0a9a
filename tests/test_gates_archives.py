"""Hostile or damaged archives handed to ``verify``: the cases tests/test_verify.py does not build.

tests/test_verify.py already covers the wrong outer checksum, truncated and corrupt gzip,
members added, removed and changed, SHA256SUMS edited to match a changed tensor, absolute
paths, ``..``, symbolic and hard links, devices, FIFOs, duplicates, a 257 MiB decompression
bomb and the count/total limits. Here: the same attacks hidden in tar header extensions (PAX,
GNU long names), a sparse member, a second tar hidden after the end-of-archive marker, a bomb
of trailing zeros, unsafe SHA256SUMS lines, a sidecar naming another file, a topology removed
or an unplanned report added with SHA256SUMS recomputed to match, and the real CLI in a
subprocess with its temporary directory and working directory watched (a symbolic link, and a
member the file system refuses to create, which must end as a failed row with ``--json``).

Every hostile archive gets a correct ``.sha256`` sidecar (unless the sidecar is the attack),
so the check under test, not the outer checksum, has to catch it. Each verify must exit
non-zero with a reason a reviewer understands and write nothing outside its temporary
directory, which is empty again afterwards.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from rl_engine import jsonio, schemas
from rl_engine.evidence import archive

from _archive_util import Entry, Good, file_entry, make_sandbox, resummed, run_verify, write_archive
from _archive_util import Sandbox as Box


@pytest.fixture(scope="module")
def good(tiny_archive: Good) -> Good:
    return tiny_archive  # conftest: the session's one tiny run, archived


@pytest.fixture()
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Box:
    return make_sandbox(tmp_path, monkeypatch)


def write(box: Box, good: Good, entries: list[Entry], fmt: int = tarfile.GNU_FORMAT, tail: bytes = b"") -> Path:
    """``entries`` under the good archive's name in ``box``'s ``in/``, with a correct ``.sha256``."""
    return write_archive(box.root / "in" / good.archive.name, entries, fmt=fmt, tail=tail)


def row(result: dict[str, Any], name: str) -> tuple[str, str]:
    check = [c for c in result["checks"] if c["name"] == name][0]
    return check["status"], "\n".join([check["detail"], *check["problems"]])


def test_rebuilt_good_archive_verifies(good: Good, box: Box, capsys: pytest.CaptureFixture[str]) -> None:
    """Negative control: the entries re-packed by this module's writer (GNU and PAX) verify."""
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        code, _, result = run_verify(write(box, good, list(good.entries), fmt=fmt), box, capsys)
        assert code == 0, result["failures"]


# ---------------------------------------------------------------- unsafe names in header extensions


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("pax absolute path", "has an absolute path"),
        ("pax dot-dot path", "contains '..' and would escape the extraction directory"),
        ("gnu long name with dot-dot", "contains '..' and would escape the extraction directory"),
        ("pax symlink target outside", "is a symbolic link"),
        ("sparse member", "is a sparse file"),
        ("backslash name", "contains a backslash"),
    ],
)
def test_unsafe_member_hidden_in_header_extensions(good: Good, box: Box, capsys: pytest.CaptureFixture[str],
                                                   kind: str, reason: str) -> None:
    target = box.root / "attack-target"
    info, data = file_entry(f"{good.name}/innocent.txt", b"owned\n")
    fmt = tarfile.PAX_FORMAT
    if kind == "pax absolute path":
        info.pax_headers = {"path": str(target)}
    elif kind == "pax dot-dot path":
        info.pax_headers = {"path": f"{good.name}/../../attack-target"}
    elif kind == "gnu long name with dot-dot":
        info.name, fmt = f"{good.name}/{'a' * 120}/../../../attack-target", tarfile.GNU_FORMAT
    elif kind == "pax symlink target outside":
        info.type, info.size, data = tarfile.SYMTYPE, 0, None
        info.pax_headers = {"linkpath": str(target)}
    elif kind == "sparse member":
        info.type, fmt = tarfile.GNUTYPE_SPARSE, tarfile.GNU_FORMAT
    elif kind == "backslash name":
        info.name = f"{good.name}/..\\..\\attack-target"
    entries = list(good.entries)
    entries.insert(len(entries) // 2, (info, data))
    code, _, result = run_verify(write(box, good, entries, fmt=fmt), box, capsys)
    status, text = row(result, "safe extraction")
    assert code == 1 and status == "FAIL"
    assert reason in text, text
    assert not target.exists() and not (box.root / "in" / "attack-target").exists()
    assert "report acceptance" not in {c["name"] for c in result["checks"]}  # nothing judged from it


# ---------------------------------------------------------------- streams that hide more than they show


def test_second_tar_hidden_after_the_end_marker(good: Good, box: Box, capsys: pytest.CaptureFixture[str]) -> None:
    """A second gzip member after the archive carries another tar: gzip readers concatenate them."""
    hidden = io.BytesIO()
    with tarfile.open(fileobj=hidden, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info, data = file_entry(f"{good.name}/tp2-cp2.json", b'{"passed": true}')
        tar.addfile(info, io.BytesIO(data))
    path = write(box, good, list(good.entries), tail=gzip.compress(hidden.getvalue(), mtime=0))
    code, _, result = run_verify(path, box, capsys)
    status, text = row(result, "safe extraction")
    assert code == 1 and status == "FAIL" and "data after the tar end-of-archive marker" in text


def test_bomb_of_trailing_zeros_after_the_end_marker(good: Good, box: Box, capsys: pytest.CaptureFixture[str]) -> None:
    """64 MiB of zeros after the end marker (a few KiB compressed): not skipped without bound."""
    zeros = gzip.compress(bytes(64 << 20), mtime=0)
    path = write(box, good, list(good.entries), tail=zeros)
    assert path.stat().st_size < good.archive.stat().st_size + (1 << 20)
    code, _, result = run_verify(path, box, capsys, "--max-total-mib", "4")
    status, text = row(result, "safe extraction")
    assert code == 1 and status == "FAIL"
    assert "refused as a possible decompression bomb" in text, text
    code, _, _ = run_verify(write(box, good, list(good.entries)), box, capsys, "--max-total-mib", "4")
    assert code == 0  # control: the same limits accept the archive without the trailing bomb


# ---------------------------------------------------------------- manifests and sidecars


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{digest}  ../../etc/passwd\n", "names an unsafe path '../../etc/passwd'"),
        ("{digest}  /etc/passwd\n", "names an unsafe path '/etc/passwd'"),
        ("{digest}  plan.json\n", "lists plan.json a second time"),
        ("not a checksum line\n", "is not '<sha256>  <path>'"),
    ],
)
def test_unsafe_or_malformed_sha256sums_line(good: Good, box: Box, capsys: pytest.CaptureFixture[str],
                                             line: str, reason: str) -> None:
    sums = f"{good.name}/{archive.SUMS}"
    text = good.data(archive.SUMS).decode() + line.format(digest=jsonio.sha256_bytes(good.data("plan.json")))
    entries = [file_entry(sums, text.encode()) if i.name == sums else (i, d) for i, d in good.entries]
    code, _, result = run_verify(write(box, good, entries), box, capsys)
    status, detail = row(result, "SHA256SUMS")
    assert code == 1 and status == "FAIL" and reason in detail, detail


def test_sidecar_naming_another_archive(good: Good, box: Box, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(box, good, list(good.entries))
    digest = jsonio.sha256_bytes(path.read_bytes())
    path.with_name(path.name + ".sha256").write_text(f"{digest}  other-run.tar.gz\n")
    code, _, result = run_verify(path, box, capsys)
    status, detail = row(result, "outer checksum")
    assert code == 1 and status == "FAIL"
    assert f"names 'other-run.tar.gz', not {good.archive.name!r}" in detail


# ---------------------------------------------------------------- consistent tampering with SHA256SUMS recomputed


def test_topology_removed_with_sums_recomputed(good: Good, box: Box, capsys: pytest.CaptureFixture[str]) -> None:
    """The TP=2 x CP=2 report and tensors are dropped and SHA256SUMS recomputed: the plan still
    promises that topology, so its absence is named."""
    entries = resummed(good, [(i, d) for i, d in good.entries if "/tp2-cp2." not in i.name])
    code, _, result = run_verify(write(box, good, entries), box, capsys)
    assert code == 1
    assert row(result, "SHA256SUMS")[0] == "PASS"  # the manifest was made consistent...
    status, detail = row(result, "JSON schemas (shipped)")  # ...the plan was not
    assert status == "FAIL" and "tp2-cp2.json: (file): file is missing" in detail
    assert "tp2-cp2.json: (file): file is missing" in row(result, "cross-topology fingerprints")[1]


def test_unplanned_report_added_with_sums_recomputed(good: Good, box: Box, capsys: pytest.CaptureFixture[str]) -> None:
    """A failing report of a topology the plan does not list, added with SHA256SUMS recomputed
    (or left from an earlier plan in the run directory), must not ride along in a VERIFIED bundle."""
    report = json.loads(good.data("tp2-cp2.json"))
    report.update(passed=False, fallback=True)
    added = [file_entry(f"{good.name}/tp8-cp1.json", json.dumps(report).encode()),
             file_entry(f"{good.name}/tp8-cp1.logp.f32", bytes(64))]
    code, _, result = run_verify(write(box, good, resummed(good, list(good.entries) + added)), box, capsys)
    assert code == 1
    assert row(result, "SHA256SUMS")[0] == "PASS"
    status, detail = row(result, "report acceptance")
    assert status == "FAIL"
    assert "tp8-cp1.json: (file): topology tp8-cp1 is not in plan.json" in detail
    assert "tp8-cp1.logp.f32: (file): topology tp8-cp1 is not in plan.json" in detail
    code, _, _ = run_verify(write(box, good, resummed(good, list(good.entries))), box, capsys)
    assert code == 0  # control: recomputing SHA256SUMS alone changes nothing


# ---------------------------------------------------------------- the real CLI


def test_cli_on_a_hostile_archive_exits_1_and_writes_nowhere(good: Good, box: Box, tmp_path: Path) -> None:
    """``python -m rl_engine verify`` in a subprocess, TMPDIR and working directory empty and
    watched: a symlink to outside followed by a member written through it."""
    target = tmp_path / "attack-target"
    link = tarfile.TarInfo(f"{good.name}/link")
    link.type, link.linkname = tarfile.SYMTYPE, str(target)
    entries = list(good.entries)
    entries[3:3] = [(link, None), file_entry(f"{good.name}/link/payload", b"owned\n")]
    path = write(box, good, entries)
    env = {**os.environ, "TMPDIR": str(box.tmp)}
    done = subprocess.run([sys.executable, "-m", "rl_engine", "verify", str(path)], cwd=box.cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert f"verify: {path.name} FAILED 1 check(s):" in done.stderr
    assert f"safe extraction: member '{good.name}/link' is a symbolic link (to '{target}')" in done.stderr
    assert not target.exists()
    assert list(box.tmp.iterdir()) == [] and list(box.cwd.iterdir()) == []
    good_run = subprocess.run([sys.executable, "-m", "rl_engine", "verify", str(good.archive)], cwd=box.cwd,
                              env=env, capture_output=True, text=True, timeout=300)
    assert good_run.returncode == 0 and "VERIFIED" in good_run.stdout  # control through the same CLI
    assert list(box.tmp.iterdir()) == [] and list(box.cwd.iterdir()) == []


def test_cli_on_an_archive_the_file_system_refuses_prints_a_row_and_writes_json(good: Good, box: Box,
                                                                               tmp_path: Path) -> None:
    """Members ``deep/a/b`` then a file ``deep/a``: extraction hits EEXIST. The real CLI must end with
    a failed row, the failure on stderr and a schema-valid ``--json``, not a traceback."""
    entries = list(good.entries) + [file_entry(f"{good.name}/deep/a/b", b"x"), file_entry(f"{good.name}/deep/a", b"y")]
    path = write(box, good, entries)
    out = tmp_path / "verify.json"
    env = {**os.environ, "TMPDIR": str(box.tmp)}
    done = subprocess.run([sys.executable, "-m", "rl_engine", "verify", str(path), "--json", str(out)], cwd=box.cwd,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"safe extraction: member '{good.name}/deep/a' cannot be extracted" in done.stderr
    assert "safe extraction" in done.stdout and "FAIL" in done.stdout
    result = jsonio.load(out)
    assert schemas.errors(result, "verify") == [] and result["passed"] is False
    assert row(result, "safe extraction")[0] == "FAIL" and "File exists" in row(result, "safe extraction")[1]
    assert list(box.tmp.iterdir()) == [] and list(box.cwd.iterdir()) == []
