"""The capture format (rl_engine.capture.format) and the transformers capture helper.

A capture written and read back is the same bytes; every malformed capture (wrong shapes, a
dtype mismatch, float targets with NaN, targets out of range, non-finite logits, a truncated
or padded file) is refused with an error naming the tensor and the fix, and a refused write
leaves nothing at the path.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rl_engine import jsonio
from rl_engine.capture import Capture, CaptureError, build_metadata, read_capture, read_header, read_rows, write_capture
from rl_engine.capture.hf import capture_causal_lm, concat_captures
from rl_engine.tensorio import tensor_bytes

from _tiny_lm import LENGTHS, VOCAB, padded, sequences, tiny_model, variant


def _meta(dtype: str = "bf16") -> dict[str, str]:
    return build_metadata(engine="stand-in", engine_version="0", model="tiny", dtype=dtype, tp=1)


def _tensors(tokens: int = 6, vocab: int = 32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "logits": torch.randn(tokens, vocab, generator=gen).to(torch.bfloat16),
        "targets": torch.randint(0, vocab, (tokens,), generator=gen),
        "active": torch.tensor([True, True, False, True, True, True][:tokens]),
        "reported_logp": -torch.rand(tokens, generator=gen),
    }


def _raw_bytes(t: torch.Tensor) -> bytes:
    return tensor_bytes(t.view(torch.int16)) if t.dtype == torch.bfloat16 else tensor_bytes(t)


def test_write_then_read_gives_the_same_bytes_and_metadata(tmp_path: Path) -> None:
    t = _tensors()
    cap = Capture(t["logits"], t["targets"], t["active"], t["reported_logp"], _meta())
    path = tmp_path / "c.safetensors"
    digest = write_capture(path, cap)
    assert digest == jsonio.sha256_file(path)
    back = read_capture(path)
    for name in ("logits", "targets", "active", "reported_logp"):
        assert _raw_bytes(getattr(back, name)) == _raw_bytes(t[name]), name
    assert back.metadata == _meta()
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary left


def test_the_same_capture_written_twice_gives_the_same_bytes(tmp_path: Path) -> None:
    """safetensors writes the header's metadata in hash-map order, a new one on each call: the
    same capture got another SHA-256 (another case hash) each time it was written."""
    from safetensors.torch import save

    from rl_engine.capture.format import canonical_header

    t = _tensors()
    cap = Capture(t["logits"], t["targets"], t["active"], t["reported_logp"], _meta())
    digests = {write_capture(tmp_path / f"c{i}.safetensors", cap) for i in range(8)}
    assert len(digests) == 1
    raw = {save(dict(t), metadata=_meta()) for _ in range(8)}  # the library's own bytes
    assert len(raw) > 1  # negative control: they differ (7 metadata keys in a random order each time)
    assert len({canonical_header(data) for data in raw}) == 1
    assert read_header(tmp_path / "c0.safetensors").metadata == _meta()  # still a valid capture


def test_read_rows_reads_only_the_asked_rows_and_columns(tmp_path: Path) -> None:
    t = _tensors()
    path = tmp_path / "c.safetensors"
    write_capture(path, Capture(t["logits"], t["targets"], t["active"], None, _meta()))
    header = read_header(path)
    part = read_rows(path, header, [1, 2, 4, 5], (8, 16))
    assert _raw_bytes(part["logits"]) == _raw_bytes(t["logits"][[1, 2, 4, 5], 8:16].contiguous())
    assert tensor_bytes(part["targets"]) == tensor_bytes(t["targets"][[1, 2, 4, 5]])
    with pytest.raises(CaptureError, match=r"columns \[8, 40\) are outside"):
        read_rows(path, header, [0], (8, 40))


BUILD_REFUSALS = {
    "targets-shape": (lambda t, m: t.update(targets=t["targets"][:5]), r"tensor targets has shape \[5\]; it must be \[6\]"),
    "logits-3d": (lambda t, m: t.update(logits=t["logits"].reshape(2, 3, 32)), r"tensor logits has shape \[2, 3, 32\].*flatten"),
    "active-dtype": (lambda t, m: t.update(active=t["active"].to(torch.uint8)), r"tensor active has dtype"),
    "metadata-dtype": (lambda t, m: m.update(dtype="fp32"), r"metadata dtype='fp32' disagrees with tensor logits, which is bf16"),
    "reported-dtype": (lambda t, m: t.update(reported_logp=t["reported_logp"].double()), r"tensor reported_logp has dtype"),
    "float-targets-nan": (lambda t, m: t.update(targets=torch.tensor([1.0, float("nan"), 2, 3, 4, 5])),
                          r"tensor targets has dtype F32; it must be I64 \(targets are token ids: "
                          r"a float targets tensor is refused, NaN or not\)"),
    "targets-range": (lambda t, m: t["targets"].__setitem__(3, 32), r"tensor targets holds 32 at active token 3, outside \[0, 32\)"),
    "logits-nan": (lambda t, m: t["logits"].__setitem__((4, 7), float("nan")),
                   r"tensor logits has a non-finite value \(nan\) at token 4, column 7"),
    "logits-inf": (lambda t, m: t["logits"].__setitem__((0, 1), float("-inf")), r"non-finite value \(-inf\) at token 0, column 1.*-inf"),
    "reported-nan": (lambda t, m: t["reported_logp"].__setitem__(1, float("nan")), r"tensor reported_logp is nan at active token 1"),
    "no-active": (lambda t, m: t.update(active=torch.zeros(6, dtype=torch.bool)), r"tensor active has no true value"),
    "metadata-missing": (lambda t, m: m.pop("engine"), r"metadata is missing \['engine'\]"),
    "metadata-tp": (lambda t, m: m.update(tp="0"), r"metadata tp='0' must be"),
}


@pytest.mark.parametrize("case", sorted(BUILD_REFUSALS))
def test_a_malformed_capture_is_refused_and_nothing_is_written(case: str, tmp_path: Path) -> None:
    t, meta = _tensors(), _meta()
    change, message = BUILD_REFUSALS[case]
    change(t, meta)
    path = tmp_path / "c.safetensors"
    with pytest.raises(CaptureError, match=message):
        write_capture(path, Capture(t["logits"], t["targets"], t["active"], t["reported_logp"], meta))
    assert list(tmp_path.iterdir()) == []
    # the same tensors written by safetensors directly are refused by the reader
    save_file(t, str(path), metadata=meta)
    with pytest.raises(CaptureError, match=message):
        read_capture(path)


def test_inactive_targets_are_not_range_checked(tmp_path: Path) -> None:
    """An ignored position may hold -100 (transformers' ignore label); only active targets count."""
    t = _tensors()
    t["targets"][2] = -100  # token 2 is inactive
    write_capture(tmp_path / "c.safetensors", Capture(t["logits"], t["targets"], t["active"], None, _meta()))
    assert int(read_capture(tmp_path / "c.safetensors").targets[2]) == -100


def _written(tmp_path: Path) -> Path:
    t = _tensors()
    path = tmp_path / "c.safetensors"
    write_capture(path, Capture(t["logits"], t["targets"], t["active"], None, _meta()))
    return path


@pytest.mark.parametrize("cut", [4, 40, 100])
def test_a_truncated_file_is_refused_naming_the_byte_counts(cut: int, tmp_path: Path) -> None:
    path = _written(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - cut] if cut != 4 else data[:4])
    with pytest.raises(CaptureError, match=r"truncated"):
        read_capture(path)


def test_a_file_longer_than_its_header_is_refused(tmp_path: Path) -> None:
    path = _written(tmp_path)
    path.write_bytes(path.read_bytes() + b"\0\0")
    with pytest.raises(CaptureError, match=r"longer than its header says"):
        read_capture(path)


def test_a_header_that_lies_about_a_size_is_refused(tmp_path: Path) -> None:
    path = _written(tmp_path)
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + length].replace(b'"shape":[6]', b'"shape":[7]', 1)
    path.write_bytes(data[:8] + header + data[8 + length:])
    with pytest.raises(CaptureError, match=r"hold \d+ bytes, but shape \[7\]"):
        read_capture(path)


def test_overlapping_tensors_are_refused(tmp_path: Path) -> None:
    path = _written(tmp_path)
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header["active"]["data_offsets"] = [0, header["active"]["data_offsets"][1] - header["active"]["data_offsets"][0]]
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    text = text.ljust(length)
    path.write_bytes(data[:8] + text + data[8 + length:])
    with pytest.raises(CaptureError, match=r"without gaps or overlaps"):
        read_capture(path)


def test_an_unknown_tensor_is_refused(tmp_path: Path) -> None:
    t = _tensors()
    t["weights"] = torch.ones(6)
    save_file(t, str(tmp_path / "c.safetensors"), metadata=_meta())
    with pytest.raises(CaptureError, match=r"unknown tensor\(s\) \['weights'\]"):
        read_capture(tmp_path / "c.safetensors")


# --- the transformers helper ---------------------------------------------------------------

@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model()


def test_capture_shifts_targets_and_drops_padding(model: torch.nn.Module) -> None:
    seqs = sequences()
    ids, mask = padded(seqs, left=False)
    cap = capture_causal_lm(variant(model, torch.float32, "eager"), ids, mask)
    want = torch.cat([s[1:] for s in seqs])
    assert tensor_bytes(cap.targets) == tensor_bytes(want)
    assert cap.num_tokens == sum(len(s) - 1 for s in seqs) and cap.vocab == VOCAB
    assert bool(cap.active.all())
    assert cap.metadata["engine"] == "transformers" and cap.metadata["dtype"] == "fp32"
    assert "attn_implementation=eager" in cap.metadata["notes"]


def test_response_mask_sets_active(model: torch.nn.Module) -> None:
    seqs = sequences()[:2]
    ids, mask = padded(seqs, left=True)
    response = mask.clone()
    response[:, : ids.shape[1] - 3] = 0  # only each sequence's last three tokens count
    cap = capture_causal_lm(variant(model, torch.float32, "eager"), ids, mask, response_mask=response)
    assert cap.active.tolist() == [False] * (len(seqs[0]) - 4) + [True] * 3 + [False] * (len(seqs[1]) - 4) + [True] * 3


def test_left_and_right_padding_capture_the_same_tokens_in_fp32(model: torch.nn.Module) -> None:
    """Rows do not depend on the padding side or the batch (to fp32 rounding of other shapes)."""
    seqs = sequences()
    eager = variant(model, torch.float32, "eager")
    right = capture_causal_lm(eager, *padded(seqs, left=False))
    left = concat_captures([capture_causal_lm(eager, *padded(seqs[:2], left=True)),
                            capture_causal_lm(eager, *padded(seqs[2:], left=True))])
    assert tensor_bytes(left.targets) == tensor_bytes(right.targets)
    assert float((left.logits - right.logits).abs().max()) < 1e-3


def test_position_ids_follow_the_mask_on_a_model_with_absolute_positions() -> None:
    """Llama's rotary positions hide a constant shift; GPT-2's learned absolute positions do not.
    With the helper's positions, left padding gives right padding's logits; with the default
    positions (counting the padding) they are far off (the negative control)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                      initializer_range=0.2)).eval()
    gpt2.set_attn_implementation("eager")
    seqs = sequences()[2:]  # lengths 9 and 5: the second is padded on the left by 4
    right = capture_causal_lm(gpt2, *padded(seqs, left=False))
    ids, mask = padded(seqs, left=True)
    left = capture_causal_lm(gpt2, ids, mask)
    assert float((left.logits - right.logits).abs().max()) < 1e-3
    with torch.no_grad():
        default = gpt2(input_ids=ids, attention_mask=mask).logits
    rows = mask[1].nonzero().flatten()[:-1]
    assert float((default[1, rows] - right.logits[len(seqs[0]) - 1:]).abs().max()) > 0.1


def test_a_sequence_with_a_hole_is_refused(model: torch.nn.Module) -> None:
    ids, mask = padded(sequences()[:1], left=False)
    mask[0, 2] = 0
    with pytest.raises(CaptureError, match=r"attention_mask: sequence 0 .* a hole"):
        capture_causal_lm(model, ids, mask)


def test_concat_refuses_captures_of_two_engines(model: torch.nn.Module) -> None:
    seqs = sequences()[:1]
    a = capture_causal_lm(variant(model, torch.float32, "eager"), *padded(seqs, left=False))
    b = capture_causal_lm(variant(model, torch.bfloat16, "eager"), *padded(seqs, left=False))
    with pytest.raises(CaptureError, match=r"capture 1 has metadata dtype='bf16'"):
        concat_captures([a, b])


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
def test_the_tiny_model_needs_no_network(tmp_path: Path) -> None:
    """Built from a config and captured with every network route refused and offline mode off
    (HF_HUB_OFFLINE=0; the other tests set 1): a download attempt would fail the run (the proxies point at a
    closed port)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    script = ("import sys, torch; sys.path.insert(0, 'tests'); from _tiny_lm import *\n"
              "from rl_engine.capture.hf import capture_causal_lm\n"
              "cap = capture_causal_lm(tiny_model(), *padded(sequences(), left=False))\n"
              "print(cap.num_tokens, cap.vocab)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env["HF_HUB_OFFLINE"] = "0"  # _tiny_lm sets it only when unset
    env.update({"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
                "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "",
                "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(root)})
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(sum(n - 1 for n in LENGTHS)), str(VOCAB)]
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").rglob("*.safetensors"))


def _sampling(tokens: int = 6) -> dict[str, torch.Tensor]:
    return {"temperature": torch.tensor([0.7, 1.0, 1.0, 0.7, 0.7, 1.3])[:tokens],
            "top_k": torch.tensor([5, 0, 0, 5, 5, 3])[:tokens],
            "top_p": torch.tensor([0.9, 1.0, 1.0, 0.9, 0.9, 1.0])[:tokens],
            "min_p": torch.tensor([0.0, 0.05, 0.0, 0.0, 0.0, 0.1])[:tokens],
            "reported_processed_logp": torch.tensor([-0.5, -1.0, float("nan"), float("-inf"), -0.25, -2.0])[:tokens]}


def _sampled_capture(t: dict[str, torch.Tensor]) -> Capture:
    from rl_engine.capture import RowSampling

    sampling = RowSampling(t["temperature"], t["top_k"], t["top_p"], t["min_p"])
    return Capture(t["logits"], t["targets"], t["active"], None, _meta(), sampling=sampling,
                   reported_processed_logp=t["reported_processed_logp"])


def test_a_capture_carries_each_rows_sampling_parameters_and_the_processed_report(tmp_path: Path) -> None:
    """Written and read back as the same bytes; -inf (a target outside the engine's kept set) is a valid
    processed report on an active token, NaN on an inactive one is not looked at; a capture without them
    (every capture written before they existed) reads with ``sampling`` None."""
    t = {**_tensors(), **_sampling()}
    path = tmp_path / "c.safetensors"
    write_capture(path, _sampled_capture(t))
    back = read_capture(path)
    assert back.sampling is not None and back.reported_logp is None
    for name in ("temperature", "top_k", "top_p", "min_p"):
        assert tensor_bytes(getattr(back.sampling, name)) == tensor_bytes(t[name]), name
    assert tensor_bytes(back.reported_processed_logp) == tensor_bytes(t["reported_processed_logp"])
    plain = _written(tmp_path / "old")
    assert read_capture(plain).sampling is None and read_capture(plain).reported_processed_logp is None
    joined = concat_captures([back, back])
    assert tensor_bytes(joined.sampling.top_k) == tensor_bytes(torch.cat([t["top_k"]] * 2))
    assert tensor_bytes(joined.reported_processed_logp) == tensor_bytes(torch.cat([t["reported_processed_logp"]] * 2))
    with pytest.raises(CaptureError, match="sampling is present in some captures only"):
        concat_captures([back, read_capture(plain)])


SAMPLING_REFUSALS = {
    "temperature-zero": (lambda t: t["temperature"].__setitem__(4, 0.0), r"tensor temperature is 0.0 at token 4.*> 0"),
    "top-k-minus-one": (lambda t: t["top_k"].__setitem__(2, -1), r"tensor top_k is -1 at token 2.*write vLLM's -1 as 0"),
    "top-p-zero": (lambda t: t["top_p"].__setitem__(0, 0.0), r"tensor top_p is 0.0 at token 0.*\(0, 1\]"),
    "min-p-above-one": (lambda t: t["min_p"].__setitem__(5, 1.5), r"tensor min_p is 1.5 at token 5.*\[0, 1\]"),
    "processed-nan": (lambda t: t["reported_processed_logp"].__setitem__(1, float("nan")),
                      r"tensor reported_processed_logp is nan at active token 1.*or -inf"),
    "processed-plus-inf": (lambda t: t["reported_processed_logp"].__setitem__(0, float("inf")),
                           r"reported_processed_logp is inf at active token 0"),
    "processed-dtype": (lambda t: t.update(reported_processed_logp=t["reported_processed_logp"].double()),
                        r"tensor reported_processed_logp has dtype"),
    "top-k-shape": (lambda t: t.update(top_k=t["top_k"][:5]), r"tensor top_k has shape \[5\]; it must be \[6\]"),
}


@pytest.mark.parametrize("case", sorted(SAMPLING_REFUSALS))
def test_bad_sampling_parameters_are_refused_at_write_and_at_read(case: str, tmp_path: Path) -> None:
    t = {**_tensors(), **_sampling()}
    change, message = SAMPLING_REFUSALS[case]
    change(t)
    path = tmp_path / "c.safetensors"
    with pytest.raises(CaptureError, match=message):
        write_capture(path, _sampled_capture(t))
    assert list(tmp_path.iterdir()) == []
    t.pop("reported_logp")
    save_file(t, str(path), metadata=_meta())
    with pytest.raises(CaptureError, match=message):
        read_capture(path)


@pytest.mark.parametrize("drop, message", [
    (("min_p",), r"sampling parameter tensor\(s\) \['min_p'\] are missing.*all of"),
    (("temperature", "top_k", "top_p", "min_p"), r"reported_processed_logp is present without the sampling parameters"),
])
def test_sampling_parameters_come_all_four_and_before_a_processed_report(drop: tuple[str, ...], message: str,
                                                                         tmp_path: Path) -> None:
    t = {**_tensors(), **_sampling()}
    for name in drop:
        t.pop(name)
    path = tmp_path / "c.safetensors"
    save_file(t, str(path), metadata=_meta())
    with pytest.raises(CaptureError, match=message):
        read_capture(path)
