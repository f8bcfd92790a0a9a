"""Hostile and careless captures: each case reproduces a probe that once lost data, hung, gave a
wrong verdict or a traceback, and checks what must happen instead.

- a FIFO, a device or a directory given as a capture is refused at once (never a blocking
  ``open``), by one helper (:func:`rl_engine.jsonio.open_regular`), with exit 2 from the verbs;
- ``copy-capture --output SRC`` refuses and leaves the source untouched;
- a case whose capture record claims other metadata than the file's own header is refused where
  the file is read (the record is compared with the header, not only the size and SHA-256);
- a deeply nested header is a :class:`CaptureError`, not a ``RecursionError``;
- the same hostile headers fed to ``read_header`` and to safetensors: whatever ``read_header``
  accepts, safetensors reads identically (``read_header`` may refuse more: the capture format's
  own rules), and the headers safetensors refuses are refused here too;
- ``cli.main`` maps an ``OSError`` to 2 (a refusal), never to 1 (a difference).
"""

from __future__ import annotations

import json
import os
import re
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from rl_engine import cli, jsonio
from rl_engine.campaign import captured
from rl_engine.capture import CaptureError, read_capture, read_header
from rl_engine.capture.parity import ParityError, ParityOptions, check_pair

from _capture_case import tiny_capture, write_tiny_capture


def _in_thread(fn: Any, timeout: float = 20.0) -> Any:
    """Run ``fn`` in a daemon thread; fail (instead of hanging the suite) if it blocks."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} blocked for {timeout} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# ----------------------------------------------------------------------------- regular files only
@pytest.fixture()
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "trainer.safetensors"
    os.mkfifo(path)
    return path


def test_a_fifo_is_refused_at_once_by_every_capture_reader(fifo: Path, tmp_path: Path) -> None:
    for read in (read_header, read_capture, captured.file_sha256, jsonio.sha256_file, jsonio.load):
        with pytest.raises(jsonio.NotRegularFileError, match="is a FIFO"):
            _in_thread(lambda read=read: read(fifo))
    good = write_tiny_capture(tmp_path / "rollout.safetensors")
    with pytest.raises(ParityError, match=f"trainer capture: {fifo} is a FIFO"):
        _in_thread(lambda: check_pair(good, fifo, ParityOptions()))
    code = _in_thread(lambda: cli.main(["parity", str(good), str(fifo), "--output-dir", str(tmp_path / "out")]))
    assert code == 2 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("path", ["/dev/zero", "DIR"])
def test_a_device_or_a_directory_is_not_a_regular_file_rather_than_a_byte_count(path: str, tmp_path: Path) -> None:
    where = tmp_path if path == "DIR" else Path(path)
    kind = "a directory" if path == "DIR" else "a character device"
    with pytest.raises(jsonio.NotRegularFileError, match=f"is {kind}, not a regular file"):
        read_capture(where)
    with pytest.raises(CaptureError, match=f"inputs.capture=.*is {kind}, not a regular file"):
        captured.capture_record(where)


def test_a_missing_capture_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(CaptureError, match=f"no such file \\(looked for {tmp_path / 'nope.safetensors'}\\)"):
        captured.capture_record(tmp_path / "nope.safetensors")


def test_cli_maps_an_os_error_to_2_not_to_the_difference_code(tmp_path: Path) -> None:
    good = write_tiny_capture(tmp_path / "rollout.safetensors")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert cli.main(["parity", str(good), str(good), "--output-dir", str(blocker)]) == 2
    assert blocker.read_text() == "not a directory"


# ----------------------------------------------------------------------------- copy-capture
def test_copy_capture_onto_its_own_source_refuses_and_keeps_the_source(tmp_path: Path) -> None:
    source = write_tiny_capture(tmp_path / "capture.safetensors")
    record = captured.capture_record(source, archive=True)
    before = source.read_bytes()
    link = tmp_path / "hard-link.safetensors"
    os.link(source, link)
    for output in (source, tmp_path / "." / "capture.safetensors", link):
        with pytest.raises(CaptureError, match="is the capture itself"):
            captured.copy_capture(record, output)
        assert source.read_bytes() == before
    assert link.read_bytes() == before


def test_copy_capture_refused_for_changed_bytes_leaves_nothing_at_output(tmp_path: Path) -> None:
    source = write_tiny_capture(tmp_path / "capture.safetensors")
    record = {**captured.capture_record(source, archive=True), "sha256": "0" * 64}
    output = tmp_path / "run" / "capture.safetensors"
    output.parent.mkdir()
    output.write_bytes(b"an old copy")
    with pytest.raises(CaptureError, match="it changed since the case was made"):
        captured.copy_capture(record, output)
    assert not output.exists() and sorted(p.name for p in output.parent.iterdir()) == []


# ----------------------------------------------------------------------------- the record is the header
@pytest.mark.parametrize(("field", "value"), [
    ("metadata", {"engine": "vllm", "engine_version": "0.6.3", "model": "a-70B-model", "tp": "8"}),
    ("tokens", 3), ("vocab", 16), ("dtype", "fp32"),
])
def test_a_record_that_lies_about_its_capture_is_refused_where_the_file_is_read(
        tmp_path: Path, field: str, value: Any) -> None:
    source = write_tiny_capture(tmp_path / "capture.safetensors")
    honest = captured.capture_record(source)
    assert captured.check_file(honest) == source  # negative control: the honest record passes
    lie = dict(honest)
    lie[field] = {**honest["metadata"], **value} if field == "metadata" else value
    with pytest.raises(CaptureError, match=f"the case records {field}=.* but the file's header says"):
        captured.check_file(lie)
    with pytest.raises(CaptureError, match="does not describe this file"):
        captured.full_capture(lie)


# ----------------------------------------------------------------------------- read_header vs safetensors
def _file(tmp_path: Path, header: Any, data: bytes = b"", raw: bytes | None = None) -> Path:
    text = raw if raw is not None else json.dumps(header).encode("utf-8")
    path = tmp_path / f"h{len(list(tmp_path.iterdir()))}.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _valid_header() -> tuple[dict[str, Any], bytes]:
    cap = tiny_capture()
    tensors = {"logits": cap.logits, "targets": cap.targets, "active": cap.active}
    codes = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64", torch.bool: "BOOL"}
    header: dict[str, Any] = {"__metadata__": dict(cap.metadata)}
    data, offset = b"", 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes()
        header[name] = {"dtype": codes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        data += raw
        offset += len(raw)
    return header, data


def _hostile(tmp_path: Path) -> dict[str, Path]:
    header, data = _valid_header()
    cases: dict[str, Path] = {"valid": _file(tmp_path, header, data)}
    h = json.loads(json.dumps(header))
    h["logits"]["data_offsets"] = [False, header["logits"]["data_offsets"][1]]  # false == 0 in Python
    cases["bool offset"] = _file(tmp_path, h, data)
    h = json.loads(json.dumps(header))
    h["__metadata__"]["notes"] = "\ud800"
    cases["lone surrogate"] = _file(tmp_path, h, data)
    text = json.dumps(header).encode()
    cases["leading space"] = _file(tmp_path, None, data, raw=b" " + text)
    cases["duplicate key"] = _file(tmp_path, None, data,
                                   raw=text[:-1] + b', "__metadata__": ' + json.dumps(header["__metadata__"]).encode() + b"}")
    h = json.loads(json.dumps(header))
    h["logits"]["shape"] = [True] + h["logits"]["shape"][1:]
    cases["bool shape"] = _file(tmp_path, h, data)
    h = json.loads(json.dumps(header))
    h["logits"]["dtype"] = ["BF16"]
    cases["list dtype"] = _file(tmp_path, h, data)
    h = json.loads(json.dumps(header))
    h["__metadata__"] = []
    cases["list metadata"] = _file(tmp_path, h, data)
    cases["NaN literal"] = _file(tmp_path, None, data, raw=text[:-1] + b', "x": NaN}')
    cases["truncated"] = _file(tmp_path, header, data[:-1])
    return cases


def _safetensors_reads(path: Path) -> dict[str, Any] | str:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            return {"metadata": handle.metadata(),
                    "tensors": {k: (str(handle.get_tensor(k).dtype), list(handle.get_tensor(k).shape))
                                for k in handle.keys()}}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        return f"refused: {type(exc).__name__}"


READ_BY_BOTH = ("valid", "leading space")


def test_read_header_and_safetensors_agree_on_hostile_headers(tmp_path: Path) -> None:
    for name, path in _hostile(tmp_path).items():
        theirs = _safetensors_reads(path)
        try:
            header = read_header(path)
        except CaptureError:
            ours: Any = "refused"
        else:
            ours = {"metadata": header.metadata,
                    "tensors": {e.name: (str(captured_dtype(e.dtype)), list(e.shape)) for e in header.entries.values()}}
        if name in READ_BY_BOTH:  # the valid header (the negative control) and harmless variants
            assert ours == theirs, name
        else:
            assert ours == "refused", f"{name}: read_header accepted what it must refuse"
            assert isinstance(theirs, str) and theirs.startswith("refused"), f"{name}: safetensors read {theirs}"


def captured_dtype(code: str) -> torch.dtype:
    from rl_engine.capture.format import ST_DTYPES

    return ST_DTYPES[code]


def test_a_deeply_nested_header_is_a_capture_error_naming_the_file(tmp_path: Path) -> None:
    path = _file(tmp_path, None, raw=b'{"x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    with pytest.raises(CaptureError, match=f"{path}: .*nests arrays or objects deeper"):
        read_header(path)
    assert cli.main(["parity", str(path), str(path), "--output-dir", str(tmp_path / "o")]) == 2


# ----------------------------------------------------------------------------- refuse first
def test_parity_refuses_auto_and_a_file_as_output_dir_before_reading_any_logits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rl_engine.capture import parity

    good = write_tiny_capture(tmp_path / "rollout.safetensors")

    def no_report(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the report was computed before the refusal")

    monkeypatch.setattr(parity, "build_report", no_report)
    with pytest.raises(ParityError, match="backend='auto' must be a backend registered for the cpu"):
        parity.run(good, good, tmp_path / "out", ParityOptions(backend="auto"))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ParityError, match="exists and is not a directory"):
        parity.run(good, good, blocker, ParityOptions())


# ----------------------------------------------------------------------------- the run directory
def test_a_capture_inside_the_run_directory_is_refused_before_any_job(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from rl_engine.workflow import WorkflowConfigError, check_capture_location

    monkeypatch.chdir(tmp_path)
    run = "results/rl-engine-logprob-abc1234-case-0123abcd"
    inside = {"inputs": {"capture": f"{run}/capture.safetensors", "archive": True}}
    with pytest.raises(WorkflowConfigError, match="inputs.capture.*inside the run directory"):
        check_capture_location(inside, run)
    with pytest.raises(WorkflowConfigError, match="inside the run directory"):  # spelt another way
        check_capture_location({"inputs": {"capture": f"./results/../{run}/x/capture.safetensors"}}, run)
    check_capture_location({"inputs": {"capture": "captures/capture.safetensors"}}, run)  # controls
    check_capture_location({"inputs": {"capture": f"{run}-other/capture.safetensors"}}, run)
    check_capture_location({}, run)
    common = Path(__file__).resolve().parent.parent / "workflow" / "rules" / "common.smk"
    assert "check_capture_location(config, RUN)" in common.read_text()  # the workflow calls it


# ----------------------------------------------------------------------------- overflows are findings
@pytest.mark.parametrize("kind", ["ratio overflows", "fp32 logits near the range"])
def test_parity_on_overflowing_values_writes_the_report_and_counts_them(tmp_path: Path, kind: str) -> None:
    """Valid captures whose importance ratio overflows (the trainer's target logit 200 above the
    rollout's, relative to the row) or whose fp32 logits of +-3e38 give a -inf logprob: the report
    is written, the overflows counted in non_finite, the statistics they spoil null."""
    from rl_engine.capture import Capture, build_metadata, write_capture
    from rl_engine.capture.parity import run

    tokens, vocab = 4, 8
    targets = torch.tensor([1, 2, 3, 4])
    active = torch.ones(tokens, dtype=torch.bool)
    if kind == "ratio overflows":
        rollout_logits = torch.zeros(tokens, vocab)
        rollout_logits[torch.arange(tokens), targets] = -200.0
        trainer_logits = torch.zeros(tokens, vocab)
        dtype = torch.bfloat16
    else:
        rollout_logits = torch.zeros(tokens, vocab)
        rollout_logits[:, 0], rollout_logits[:, 1:] = 3e38, -3e38
        trainer_logits = rollout_logits.clone()
        trainer_logits[0, 5] = 1.0  # one row's logits differ; every logprob is -inf on both sides
        dtype = torch.float32
    paths = []
    for side, logits in (("rollout", rollout_logits), ("trainer", trainer_logits)):
        meta = build_metadata(engine="test", engine_version="0", model="m",
                              dtype={torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype])
        path = tmp_path / f"{side}.safetensors"
        write_capture(path, Capture(logits.to(dtype), targets, active, metadata=meta))
        paths.append(path)
    report = run(paths[0], paths[1], tmp_path / "out", ParityOptions())
    assert (tmp_path / "out" / "parity.json").is_file() and (tmp_path / "out" / "parity.png").is_file()
    ours, ratio = report["our_logprob"], report["importance_ratio"]["ours"]
    if kind == "ratio overflows":
        assert ours["non_finite"] == 0 and 199 < ours["max_abs_diff"] < 201
        assert ratio["non_finite"] == tokens and ratio["mean"] is None and ratio["min"] is None
        assert ratio["per_token"] == [None] * tokens
    else:
        assert ours["non_finite"] == tokens and ours["max_abs_diff"] is None and ours["mean_diff"] is None
        assert ours["rollout_logp"].count(None) == tokens
        assert jsonio.load(tmp_path / "out" / "parity.json")["our_logprob"]["non_finite"] == tokens


# ------------------------------------------------------------------ metadata: printable text only
@pytest.mark.parametrize("char", ["\x1b", "\x07", "\n", "\t", "\x9b", "\u202e"],
                         ids=["ESC", "BEL", "newline", "tab", "C1-CSI", "bidi-override"])
def test_control_characters_in_capture_metadata_are_refused_at_write_and_at_read(
        char: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A capture's ``notes`` (or any metadata value) holding ESC, BEL, a newline, a tab, a C1 control or a
    bidirectional override (each once reached SUMMARY.md raw: a second ``## Status`` heading, or an ESC
    that made the project's own archive fail verify): refused when the capture is built or written,
    and, for a file written by another tool, when it is read (the header check every reader runs),
    naming the key, the code point and its position; the parity verb then exits 2 with nothing
    written. Control: the same notes with the character written as the text ``\\x1b`` is accepted."""
    from safetensors.torch import save_file

    from rl_engine.capture import Capture, write_capture

    cap = tiny_capture()
    notes = f"rollout{char}\n## Status" if char != "\n" else "rollout\n\n## Status\n\nPASSED, signed: reviewer"
    code_point = f"U+{ord(char):04X}"
    pattern = re.escape(code_point)
    for key in ("notes", "model"):
        with pytest.raises(CaptureError, match=f"metadata {key} holds the control or bidirectional character {pattern} at position 7"):
            Capture(cap.logits, cap.targets, cap.active, None, {**cap.metadata, key: notes})
    path = tmp_path / "other-tool.safetensors"
    save_file({"logits": cap.logits, "targets": cap.targets, "active": cap.active}, str(path),
              metadata={**cap.metadata, "notes": notes})
    with pytest.raises(CaptureError, match=f"metadata notes holds the control or bidirectional character {pattern}"):
        read_header(path)
    with pytest.raises(CaptureError, match=pattern):
        read_capture(path)
    out = tmp_path / "out"
    assert cli.main(["parity", str(path), str(path), "--output-dir", str(out)]) == 2 and not out.exists()
    assert f"metadata notes holds the control or bidirectional character {code_point}" in capsys.readouterr().err
    good = tmp_path / "good.safetensors"
    write_capture(good, Capture(cap.logits, cap.targets, cap.active, None, {**cap.metadata, "notes": "rollout\\x1b"}))
    assert read_header(good).metadata["notes"] == "rollout\\x1b"
