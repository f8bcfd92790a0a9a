"""The registered ops' settings: one frozen dataclass per op family, passed as ONE canonical JSON text.

``rl_engine::selected_logprob``, ``rl_engine::selected_logprob_from_hidden`` and their backward ops take
tensors and one ``str`` (:mod:`rl_engine.logprob.op_settings`). The text reads back to the same settings
bit for bit (floats included), anything but the canonical text of valid settings is refused naming the
problem, and under ``torch.compile`` another temperature is another text, hence one recompile, while
the same temperature reuses the graph.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from typing import Any

import pytest
import torch

import rl_engine.logprob.hidden  # noqa: F401 - registers rl_engine::selected_logprob_from_hidden
from rl_engine.logprob import selected_logprob
from rl_engine.logprob.contract import LogprobContractError
from rl_engine.logprob.op_settings import HeadGradSettings, HeadOpSettings, LogitsOpSettings, concrete
from rl_engine.tensorio import tensor_bytes

LOGITS = dict(real_vocab_size=1000, num_vocab_tiles=8, ignore_index=-100, compute_entropy=True, validate=True,
              backend="auto", chunk_rows=None, temperature=0.7)
HEAD = dict(real_vocab_size=1000, num_vocab_tiles=8, ignore_index=-100, compute_entropy=False, validate=True,
            backend="auto", chunk_tokens=5, grad_weight_fp32=True, temperature=0.7, matmul="auto", autocast="bf16",
            keep_logits=False)
OPS = ("selected_logprob", "selected_logprob_backward", "selected_logprob_from_hidden",
       "selected_logprob_from_hidden_backward")


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


@pytest.mark.parametrize("temperature", [0.7, 2.0**-64, 1.0, 2.0**64, 0.1 + 0.2, 7])
def test_the_text_reads_back_to_the_same_settings_bit_for_bit(temperature: float) -> None:
    for cls, fields in ((LogitsOpSettings, LOGITS), (HeadOpSettings, HEAD)):
        settings = cls(**{**fields, "temperature": temperature})
        text = settings.encode()
        back = cls.decode(text)
        assert back == settings and _bits(back.temperature) == _bits(float(temperature)), (cls, temperature)
        assert type(back.temperature) is float and back.encode() == text
        assert text == json.dumps(json.loads(text), sort_keys=True, allow_nan=False, separators=(",", ":"))
        assert list(json.loads(text)) == sorted(json.loads(text))


def test_the_backward_settings_nest_the_forward_s_and_read_back() -> None:
    grads = HeadGradSettings(HeadOpSettings(**{**HEAD, "temperature": 2.0**-64}), True, False)
    text = grads.encode()
    assert HeadGradSettings.decode(text) == grads
    assert json.loads(text)["head"] == json.loads(grads.head.encode())
    assert _bits(HeadGradSettings.decode(text).head.temperature) == _bits(2.0**-64)


def test_a_different_temperature_is_a_different_text_and_the_same_one_the_same_text() -> None:
    texts = {LogitsOpSettings(**{**LOGITS, "temperature": t}).encode() for t in (0.7, 0.7, 0.7000000000000001)}
    assert len(texts) == 2


def _non_tensor_arguments(schema: Any) -> list[tuple[str, str]]:
    """``(name, type)`` of every argument that is neither a Tensor nor an optional Tensor."""
    def tensor(kind: Any) -> bool:
        if isinstance(kind, torch.OptionalType):
            kind = kind.getElementType()
        return isinstance(kind, torch.TensorType)

    return [(a.name, str(a.type)) for a in schema.arguments if not tensor(a.type)]


@pytest.mark.parametrize("op", OPS)
def test_each_op_schema_holds_exactly_one_non_tensor_argument_the_settings_text(op: str) -> None:
    schema = getattr(torch.ops.rl_engine, op).default._schema
    assert _non_tensor_arguments(schema) == [("settings", "str")], str(schema)
    assert schema.arguments[-1].name == "settings"


def test_negative_control_scalar_arguments_are_seen_in_a_schema() -> None:
    schema = torch._C.parse_schema("f(Tensor x, Tensor? rows, int n, float? t, str settings) -> Tensor")
    assert _non_tensor_arguments(schema) == [("n", "int"), ("t", "Optional[float]"), ("settings", "str")]


def _good_text() -> str:
    return LogitsOpSettings(**LOGITS).encode()


BAD_TEXTS: dict[str, tuple[Any, str]] = {
    "not json": ("real_vocab_size=1000", "is not strict JSON (Expecting value: line 1 column 1 (char 0)); pass "
                 "LogitsOpSettings(...).encode()"),
    "not a str": (b"{}", "must be a str"),
    "nan": (_good_text().replace('"temperature":0.7', '"temperature":NaN'), "NaN is not a number in strict JSON"),
    "infinity": (_good_text().replace('"temperature":0.7', '"temperature":Infinity'), "Infinity is not a number"),
    "repeated key": (_good_text()[:-1] + ',"backend":"auto"}', "repeated keys ['backend']"),
    "missing field": (_good_text().replace('"chunk_rows":null,', ""), "missing ['chunk_rows']"),
    "unknown field": (_good_text()[:-1] + ',"top_k":5}', "unknown ['top_k']"),
    "not an object": ("[1000, 8]", "must be a JSON object of LogitsOpSettings's fields"),
    "a bad value": (_good_text().replace('"num_vocab_tiles":8', '"num_vocab_tiles":0'), "num_vocab_tiles=0 must be >= 1"),
    "a bad type": (_good_text().replace('"validate":true', '"validate":1'), "validate=1 must be True or False"),
    "a bad temperature": (_good_text().replace('"temperature":0.7', '"temperature":0.0'), "temperature=0.0 is outside"),
    "spaces": (json.dumps(json.loads(_good_text()), sort_keys=True), "is not the canonical text"),
    "unsorted keys": (json.dumps(dict(reversed(list(json.loads(_good_text()).items()))), separators=(",", ":")),
                      "is not the canonical text"),
    "an integer temperature": (_good_text().replace('"temperature":0.7', '"temperature":1'),
                               "is not the canonical text"),
    "the head's text": (HeadOpSettings(**HEAD).encode(), "unknown ['autocast', 'chunk_tokens'"),
}


@pytest.mark.parametrize("case", sorted(BAD_TEXTS))
def test_a_bad_settings_text_is_refused_naming_the_problem_and_the_fix(case: str) -> None:
    """A text that is not the canonical JSON of valid settings names what is wrong; one that does not
    parse as the settings also says how to make the text (``encode()``)."""
    text, problem = BAD_TEXTS[case]
    with pytest.raises(LogprobContractError, match=re.escape(problem)):
        LogitsOpSettings.decode(text)


def test_the_op_called_with_a_bad_settings_text_refuses_it_before_computing() -> None:
    logits = torch.randn(4, 1024)
    targets = torch.zeros(4, dtype=torch.int64)
    active = torch.ones(4, dtype=torch.bool)
    with pytest.raises(LogprobContractError, match=re.escape("missing ['chunk_rows']")):
        torch.ops.rl_engine.selected_logprob(logits, targets, active, None, BAD_TEXTS["missing field"][0])
    with pytest.raises(LogprobContractError, match="is not strict JSON"):
        torch.ops.rl_engine.selected_logprob_from_hidden(torch.randn(4, 8), torch.randn(1024, 8), targets, active,
                                                         None, "{")
    out = torch.ops.rl_engine.selected_logprob(logits, targets, active, None, _good_text())
    eager = selected_logprob(logits, targets, active, real_vocab_size=1000, num_vocab_tiles=8, compute_entropy=True,
                             temperature=0.7)
    assert [tensor_bytes(t) for t in out] == [tensor_bytes(eager.selected_logp), tensor_bytes(eager.lse),
                                              tensor_bytes(eager.entropy)]


@pytest.mark.parametrize("field, value, problem", [
    ("real_vocab_size", 0, "real_vocab_size=0 must be >= 1"),
    ("num_vocab_tiles", 2.0, "num_vocab_tiles=2.0 must be an integer"),
    ("ignore_index", True, "ignore_index=True must be an integer"),
    ("compute_entropy", 1, "compute_entropy=1 must be True or False"),
    ("validate", None, "validate=None must be True or False"),
    ("backend", "", "backend='' must be a non-empty string"),
    ("chunk_rows", 0, "chunk_rows=0 must be >= 1 (or None)"),
    ("chunk_rows", "8", "chunk_rows='8' must be a positive integer or None"),
    ("temperature", float("nan"), "temperature=nan must be finite"),
    ("temperature", True, "temperature must be a number"),
])
def test_the_logits_settings_refuse_a_bad_field_by_name(field: str, value: Any, problem: str) -> None:
    with pytest.raises(LogprobContractError, match=re.escape(problem)):
        LogitsOpSettings(**{**LOGITS, field: value})


@pytest.mark.parametrize("field, value, problem", [
    ("chunk_tokens", 0, "chunk_tokens=0 must be >= 1"),
    ("grad_weight_fp32", "yes", "grad_weight_fp32='yes' must be True or False"),
    ("keep_logits", 1, "keep_logits=1 must be True or False"),
    ("matmul", "blas", "matmul='blas' must be one of"),
    ("autocast", "torch.float64", "autocast='torch.float64' (autocast's dtype) is not one of"),
    ("temperature", 2.0**65, "is outside [2**-64, 2**64]"),
])
def test_the_head_settings_refuse_a_bad_field_by_name(field: str, value: Any, problem: str) -> None:
    with pytest.raises(LogprobContractError, match=re.escape(problem)):
        HeadOpSettings(**{**HEAD, field: value})
    with pytest.raises(LogprobContractError, match="want_weight=None must be True or False"):
        HeadGradSettings(HeadOpSettings(**HEAD), True, None)  # type: ignore[arg-type]


def test_settings_are_frozen_and_a_number_is_kept_exactly() -> None:
    settings = LogitsOpSettings(**{**LOGITS, "temperature": 3, "chunk_rows": 16})
    assert type(settings.temperature) is float and settings.temperature == 3.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.temperature = 0.5  # type: ignore[misc]
    assert _bits(concrete(0.7)) == _bits(0.7) and concrete(7) == 7 and concrete("auto") == "auto"
    assert concrete(True) is True and concrete(None) is None


@pytest.mark.parametrize("dynamic", [False, None])
def test_under_compile_another_temperature_recompiles_and_the_same_one_reuses_the_graph(dynamic: bool | None) -> None:
    """Each temperature's compiled bytes are the eager call's at that temperature; a temperature seen
    before adds no compilation, a new one adds one (``dynamic=False``: one frame per distinct value,
    as the float argument gave). Under automatic dynamic shapes (``dynamic=None``) dynamo traces the
    second distinct value as a symbolic float, which the settings text reads exactly and specialises
    by a guard. Negative control: 0.3's bytes are not 0.7's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 5, 1024, generator=gen) * 3).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (2, 5), generator=gen)

    def step(x: torch.Tensor, temperature: float) -> torch.Tensor:
        return selected_logprob(x, ids, real_vocab_size=1000, temperature=temperature).selected_logp

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter, dynamic=dynamic)
    found, frames = {}, []
    for temperature in (0.7, 0.7, 0.3, 1.0 / 3.0, 0.3, 0.7, 0.25):
        seen = temperature in found
        before = counter.frame_count
        found[temperature] = tensor_bytes(compiled(logits, temperature))
        assert found[temperature] == tensor_bytes(step(logits, temperature)), temperature
        assert (counter.frame_count == before) == seen, (temperature, counter.frame_count, before)
        frames.append(counter.frame_count)
    if dynamic is False:
        assert frames == [1, 1, 2, 3, 3, 3, 4]
    assert found[0.3] != found[0.7]
