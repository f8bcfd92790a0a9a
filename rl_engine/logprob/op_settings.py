"""The settings of one call of a registered op, as the op's one non-tensor argument.

``rl_engine::selected_logprob`` and ``rl_engine::selected_logprob_from_hidden`` (and their backward
ops) take their tensors as tensor arguments and everything else (vocabulary size, tile count,
backend, temperature, ...) as ONE ``str``: the canonical strict JSON of a frozen dataclass
(:class:`LogitsOpSettings`, :class:`HeadOpSettings`, :class:`HeadGradSettings`). The op, its fake
implementation, its ``setup_context`` and its backward all read that one object by field name, so a
new setting is one field here, not a parameter repeated in order in five signatures and unpacked by
position.

The text: ``json.dumps(..., sort_keys=True, allow_nan=False, separators=(",", ":"))``, one text per
settings value; floats are written as Python's shortest repr, which reads back to the same binary64
(``decode(s.encode()) == s`` exactly, ``0.7`` and ``2**-64`` included). :meth:`OpSettings.decode`
takes only that text: not JSON, NaN or Infinity, a repeated key, a missing or unknown field, a
value the dataclass refuses, or a text that is not the canonical one (other spacing, ``1`` for
``1.0``) raise :class:`~rl_engine.logprob.contract.LogprobContractError` naming what and the fix.

Under ``torch.compile`` the text is built while the graph is traced (:func:`settings_text`) and is
a constant of the graph: dynamo guards on every value it was built from, so another temperature (or
any other setting) is another text and a recompile, as the float argument specialized on its value
was. A temperature that dynamo had made symbolic is read exactly (``float.hex``, which guards on
the value); so is a symbolic integer (``operator.index``).
"""

from __future__ import annotations

import dataclasses
import json
import operator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rl_engine.arith.temperature import TemperatureError, temperature32
from rl_engine.logprob.backends.eager.vocab_parallel import check_chunk_rows
from rl_engine.logprob.contract import LOGITS_DTYPES
from rl_engine.logprob.errors import LogprobContractError
from rl_engine.logprob.head_matmul import MATMULS
from rl_engine.validators import int_problem, require


def _int(name: str, value: Any, minimum: int | None = None) -> None:
    if minimum is None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise LogprobContractError(f"{name}={value!r} must be an integer (got {type(value).__name__})")
        return
    require(int_problem(name, value, minimum), LogprobContractError)


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise LogprobContractError(f"{name}={value!r} must be True or False")


def _text(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise LogprobContractError(f"{name}={value!r} must be a non-empty string (an id such as 'auto')")


def _check_shared(settings: Any) -> None:
    """The fields both ops' settings share, checked alike."""
    _int("real_vocab_size", settings.real_vocab_size, 1)
    _int("num_vocab_tiles", settings.num_vocab_tiles, 1)
    _int("ignore_index", settings.ignore_index)
    _bool("compute_entropy", settings.compute_entropy)
    _bool("validate", settings.validate)
    _text("backend", settings.backend)


def _temperature(settings: Any) -> None:
    """``temperature`` as a binary64 float the arithmetic accepts; an integer becomes its float
    exactly as the eager call's first step (``float(T)``) makes it, so the text has one spelling."""
    try:
        temperature32(settings.temperature)
    except TemperatureError as exc:
        raise LogprobContractError(str(exc)) from None
    object.__setattr__(settings, "temperature", float(settings.temperature))


class OpSettings:
    """Encode to and decode from the one canonical strict JSON text (see the module docstring)."""

    NESTED: ClassVar[dict[str, type[OpSettings]]] = {}

    def encode(self) -> str:
        """The canonical text: sorted keys, no spaces, no NaN or Infinity."""
        fields = dataclasses.asdict(self)  # type: ignore[call-overload]  # every subclass is a dataclass
        return json.dumps(fields, sort_keys=True, allow_nan=False, separators=(",", ":"))

    @classmethod
    def decode(cls, text: Any) -> Any:
        """The settings whose canonical text is ``text``; anything else raises naming the problem."""
        fix = f"pass {cls.__name__}(...).encode(), the one text of a settings value"
        if not isinstance(text, str):
            raise LogprobContractError(f"settings={text!r} must be a str ({type(text).__name__} given); {fix}")
        try:
            raw = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
        except ValueError as exc:
            raise LogprobContractError(f"settings={text!r} is not strict JSON ({exc}); {fix}") from None
        settings = cls._from_mapping(raw, text, fix)
        if settings.encode() != text:
            raise LogprobContractError(
                f"settings={text!r} is not the canonical text {settings.encode()!r} (sorted keys, no spaces, "
                f"floats as repr); {fix}")
        return settings

    @classmethod
    def _from_mapping(cls, raw: Any, text: str, fix: str) -> Any:
        if not isinstance(raw, dict):
            raise LogprobContractError(f"settings={text!r} must be a JSON object of {cls.__name__}'s fields; {fix}")
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]  # every subclass is a dataclass
        missing, unknown = sorted(names - set(raw)), sorted(set(raw) - names)
        if missing or unknown:
            raise LogprobContractError(
                f"settings={text!r} does not hold {cls.__name__}'s fields (missing {missing}, unknown {unknown}); "
                f"{fix}")
        fields = {name: cls.NESTED[name]._from_mapping(value, text, fix) if name in cls.NESTED else value
                  for name, value in raw.items()}
        return cls(**fields)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number in strict JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"repeated keys {repeated}")
    return dict(pairs)


@dataclass(frozen=True)
class LogitsOpSettings(OpSettings):
    """The settings of ``rl_engine::selected_logprob`` and its backward: the keyword arguments of
    :func:`rl_engine.logprob.api.selected_logprob` with the tile count resolved (``"auto"`` is
    resolved when the graph is traced) and the vocabulary size given; a temperature per row is a
    tensor argument, with ``temperature`` 1."""

    real_vocab_size: int
    num_vocab_tiles: int
    ignore_index: int
    compute_entropy: bool
    validate: bool
    backend: str
    chunk_rows: int | None
    temperature: float

    def __post_init__(self) -> None:
        _check_shared(self)
        check_chunk_rows(self.chunk_rows)  # the eager call's check and words
        if self.chunk_rows is not None:  # an integral type (numpy's) as the int of the same value: JSON's
            object.__setattr__(self, "chunk_rows", int(self.chunk_rows))
        _temperature(self)


@dataclass(frozen=True)
class HeadOpSettings(OpSettings):
    """The settings of ``rl_engine::selected_logprob_from_hidden``: the keyword arguments of
    :func:`rl_engine.logprob.hidden.selected_logprob_from_hidden` that a one-rank call takes, with the
    tile count resolved, ``autocast`` the logits' dtype name under autocast (``None``: the inputs'
    dtype) and ``keep_logits`` False where no gradient is wanted, resolved when the graph is traced."""

    real_vocab_size: int
    num_vocab_tiles: int
    ignore_index: int
    compute_entropy: bool
    validate: bool
    backend: str
    chunk_tokens: int
    grad_weight_fp32: bool
    temperature: float
    matmul: str
    autocast: str | None
    keep_logits: bool

    def __post_init__(self) -> None:
        _check_shared(self)
        _int("chunk_tokens", self.chunk_tokens, 1)
        _bool("grad_weight_fp32", self.grad_weight_fp32)
        _bool("keep_logits", self.keep_logits)
        if self.matmul not in MATMULS:
            raise LogprobContractError(f"matmul={self.matmul!r} must be one of {MATMULS} (default 'auto')")
        if self.autocast is not None and self.autocast not in LOGITS_DTYPES:
            raise LogprobContractError(f"autocast={self.autocast!r} (autocast's dtype) is not one of "
                                       f"{list(LOGITS_DTYPES)}; autocast to bf16 or fp16, or not at all")
        _temperature(self)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The logits' dtype under autocast, ``None`` without it."""
        return None if self.autocast is None else LOGITS_DTYPES[self.autocast]


@dataclass(frozen=True)
class HeadGradSettings(OpSettings):
    """The settings of ``rl_engine::selected_logprob_from_hidden_backward``: the forward's, and which
    of the two gradients (``hidden``'s, ``weight``'s) autograd asks for."""

    NESTED: ClassVar[dict[str, type[OpSettings]]] = {"head": HeadOpSettings}

    head: HeadOpSettings
    want_hidden: bool
    want_weight: bool

    def __post_init__(self) -> None:
        if not isinstance(self.head, HeadOpSettings):
            raise LogprobContractError(f"head={self.head!r} must be the forward's HeadOpSettings")
        _bool("want_hidden", self.want_hidden)
        _bool("want_weight", self.want_weight)


def concrete(value: Any) -> Any:
    """``value`` with a symbolic number made concrete: under ``torch.compile`` dynamo may trace a
    Python float or int argument as a symbol, which has no JSON text; ``float.hex`` and
    ``operator.index`` read its value exactly and guard on it (another value recompiles). A float,
    an int and anything else are returned with their value unchanged."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if isinstance(value, int):
        return operator.index(value)
    return float.fromhex(value.hex())


@torch.compiler.assume_constant_result
def _encoded(cls: type[OpSettings], fields: tuple[tuple[str, Any], ...]) -> str:
    """Run outside the traced graph (dynamo cannot trace ``json``'s C encoder); its result is a
    constant of the graph, guarded by the values ``fields`` came from."""
    return cls(**dict(fields)).encode()


def settings_text(cls: type[OpSettings], **fields: Any) -> str:
    """``cls(**fields).encode()``, also inside a graph that ``torch.compile`` traces.

    The dataclass is built in the traced code, so a refused setting raises its
    :class:`~rl_engine.logprob.contract.LogprobContractError` while the graph is traced: as is
    without ``fullgraph``; with ``fullgraph=True`` dynamo reports it as an "Observed exception"
    whose message holds the refusal. The values are made concrete first (:func:`concrete`)."""
    settings = cls(**{name: concrete(value) for name, value in fields.items()})
    return _encoded(cls, tuple((f.name, getattr(settings, f.name)) for f in dataclasses.fields(settings)))


__all__ = [
    "HeadGradSettings",
    "HeadOpSettings",
    "LogitsOpSettings",
    "OpSettings",
    "concrete",
    "settings_text",
]
