"""One description per backend: the registry, the device table, the schema enum and the replay's
list are all read from ``rl_engine/logprob/backends/<name>/description.py``.

A stub backend written into a temporary folder of backend folders shows that each of the four
picks up a new backend from its one description and nothing else; the checked-in schema enum
equals the descriptions (and a stub makes it differ: the check bites).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rl_engine.arith.portable import SPEC_VERSION
from rl_engine.campaign.replay import arith_backends
from rl_engine.logprob.backends import description as described
from rl_engine.logprob.backends.description import BackendDescription, BackendDescriptionError
from rl_engine.logprob.backends.eager.vocab_parallel import VocabParallelLogprob
from rl_engine.logprob.contract import LogprobContract
from rl_engine.logprob.registry import default_registry, dispatch
from rl_engine.tables import EAGER_BACKEND, FUSED_CPU_BACKEND, TRITON_BACKEND

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ROOT / "rl_engine" / "logprob" / "backends"
STUB_ID = "stub-vocab-parallel-logp"
STUB = f'''
from rl_engine.logprob.backends.description import BackendDescription

DESCRIPTION = BackendDescription(
    backend_id={STUB_ID!r},
    summary="a stub: the eager engine under another id",
    devices=("cpu",),
    engine="rl_engine.logprob.backends.eager.vocab_parallel:VocabParallelLogprob",
    priority=5,
    arith_versions=({SPEC_VERSION!r},),
)
'''


def with_stub(tmp_path: Path) -> Path:
    """The checked-in backend folders (their descriptions) plus a stub's, under ``tmp_path``."""
    root = tmp_path / "backends"
    for folder in sorted(p for p in BACKENDS.iterdir() if (p / "description.py").is_file()):
        (root / folder.name).mkdir(parents=True)
        shutil.copy(folder / "description.py", root / folder.name / "description.py")
    (root / "stub").mkdir()
    (root / "stub" / "description.py").write_text(STUB, encoding="utf-8")
    return root


def test_the_built_in_backends_are_their_folders() -> None:
    assert described.schema_enum() == [EAGER_BACKEND, FUSED_CPU_BACKEND, TRITON_BACKEND]
    assert described.backend_devices() == {EAGER_BACKEND: ("cpu", "cuda"), FUSED_CPU_BACKEND: ("cpu",),
                                           TRITON_BACKEND: ("cuda",)}
    assert described.interpreter_devices() == {TRITON_BACKEND: ("cpu",)}
    assert arith_backends() == (EAGER_BACKEND, FUSED_CPU_BACKEND, TRITON_BACKEND)


def test_the_checked_in_schema_enum_is_the_descriptions(tmp_path: Path) -> None:
    defs = json.loads((ROOT / "schemas" / "defs.schema.json").read_text(encoding="utf-8"))["$defs"]
    assert defs["backend_id"]["enum"] == described.schema_enum(), (
        "schemas/defs.schema.json's backend_id enum must be rl_engine.logprob.backends.description.schema_enum()")
    # negative control: one more description and the checked-in enum no longer matches
    assert defs["backend_id"]["enum"] != described.schema_enum(with_stub(tmp_path))


def test_a_stub_backend_is_picked_up_from_its_one_description(tmp_path: Path) -> None:
    root = with_stub(tmp_path)
    registry = default_registry(root)
    assert list(registry) == [TRITON_BACKEND, FUSED_CPU_BACKEND, STUB_ID, EAGER_BACKEND]  # by priority
    assert registry[STUB_ID].capabilities.devices == frozenset({"cpu"})
    assert described.backend_devices(root)[STUB_ID] == ("cpu",)
    assert STUB_ID in described.schema_enum(root)
    assert STUB_ID in arith_backends(root)
    contract = LogprobContract(real_vocab_size=100, padded_vocab_size=128, num_vocab_tiles=4, num_sequences=1,
                               seq_len=2, logits_dtype="fp32")
    chosen = dispatch(STUB_ID, contract, "cpu", registry)
    assert isinstance(chosen.op, VocabParallelLogprob) and chosen.actual_backend == STUB_ID
    logits = torch.linspace(-3, 3, 2 * 128).reshape(2, 128)
    out = chosen.op(logits, torch.tensor([1, 7]), torch.tensor([True, True]), contract)
    reference = dispatch(EAGER_BACKEND, contract, "cpu").op(logits, torch.tensor([1, 7]), torch.tensor([True, True]),
                                                           contract)
    assert out.selected_logp.numpy().tobytes() == reference.selected_logp.numpy().tobytes()


def test_a_description_without_its_name_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "backends"
    (root / "broken").mkdir(parents=True)
    (root / "broken" / "description.py").write_text("OTHER = 1\n", encoding="utf-8")
    with pytest.raises(BackendDescriptionError, match="must define DESCRIPTION = BackendDescription"):
        described.descriptions(root)


def test_a_duplicate_id_is_refused(tmp_path: Path) -> None:
    root = with_stub(tmp_path)
    (root / "stub2").mkdir()
    (root / "stub2" / "description.py").write_text(STUB, encoding="utf-8")
    with pytest.raises(BackendDescriptionError, match=f"backend_id \\['{STUB_ID}'\\] is described twice"):
        described.descriptions(root)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("backend_id", "Bad Id", "backend_id='Bad Id' must be lower-case"),
    ("devices", ("tpu",), "devices=('tpu',) must name distinct devices from ['cpu', 'cuda']"),
    ("devices", (), "devices=() names no device"),
    ("engine", "no_colon", "engine='no_colon' must be 'package.module:attribute'"),
    ("priority", True, "priority=True must be an int"),
    ("arith_versions", "rl-engine-arith/2", "arith_versions='rl-engine-arith/2' must be a tuple"),
])
def test_a_bad_description_names_the_field(field: str, value: object, message: str) -> None:
    fields = dict(backend_id="x", summary="a test", devices=("cpu",), engine="a.b:C")
    with pytest.raises(BackendDescriptionError, match="backend description") as raised:
        BackendDescription(**{**fields, field: value})
    assert message in str(raised.value)
