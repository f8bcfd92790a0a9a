"""vLLM's V1 engine on rl_engine's logprob: capture the rollout's rows, return our logprob.

Two services on an offline ``vllm.LLM`` (vLLM 0.32, V1 engine; CPU and GPU builds alike):

- **capture**: every row the sampler samples from (the raw logits, before temperature or any
  processor, in the model's dtype), the sampled token, vLLM's returned logprob of it and the
  request's sampling parameters (temperature, top-k, top-p, min-p), kept as tensors in the worker
  (no Python object per vocabulary entry), and on request the prompt rows; :func:`collect` turns
  them into an ``rl-engine-capture/1`` :class:`~rl_engine.capture.Capture` (the parameters as its
  per-row sampling tensors), one sequence after another in the order of ``llm.generate``'s
  outputs, checked against the token ids vLLM returned.
- **our logprob inside vLLM** (``logprobs="raw"`` or ``"processed"``): the logprobs vLLM returns
  (the sampled token and the top-k it was asked for, and the prompt tokens' with
  ``prompt_logprobs``) are :func:`rl_engine.logprob.selected_logprob` of the very rows it sampled
  from: ``"raw"`` at temperature 1 (vLLM's default ``raw_logprobs``), ``"processed"`` the processed
  logprob of the distribution the request sampled from: its temperature (``x / T``, as vLLM's
  sampler divides; greedy requests at 1, as vLLM's ``processed_logprobs``) and its top-k, top-p and
  min-p as per-row parameters of ``selected_logprob`` (docs/arithmetic.md section 13, vLLM's order:
  temperature, min-p, top-k, top-p). The rollout and the trainer then run one logprob
  implementation, and the bytes do not depend on the batch the request was scheduled in (our op is
  batch invariant). The kept set is ours, not vLLM's: where they differ (vLLM keeps every tie at the
  k-th value) the token vLLM sampled may lie outside ours, and its returned logprob is ``-inf``.

How, and what of vLLM it relies on (all of it private, so :func:`install` checks each piece and
names vLLM's version when one is missing): ``LLM.collective_rpc`` (public) runs a function of this
module in each worker; there it wraps, on the instances only, the model runner's
``sampler.forward`` (the rows, the sampled tokens and the returned logprob tensors),
``_get_prompt_logprobs_dict``, ``model.compute_logits`` and ``sampler.gather_logprobs`` (the prompt
rows and their targets), and reads ``input_batch.req_ids``, ``discard_request_mask`` (rows of a
partial prefill, whose sample vLLM drops), ``query_start_loc`` and ``requests``. Speculative
decoding and more than one sample per request (``n > 1``) are refused. vLLM's tensor parallel
workers all see the full rows; the driver worker's record is used.

Recipes and measurements: docs/capture.md ("From vLLM"), docs/performance.md.
"""

from __future__ import annotations

import json
import math
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_engine.capture.format import (
    DTYPE_NAMES,
    REPORTED,
    REPORTED_PROCESSED,
    SAMPLING,
    Capture,
    CaptureError,
    RowSampling,
    build_metadata,
)

SUPPORTED_VERSIONS = ("0.32",)
LOGPROB_MODES = (None, "raw", "processed")
# vLLM's logprobs_mode under which each of our modes replaces values of the same kind: ours "raw" are
# logprobs at T = 1 (vLLM's raw_logprobs), ours "processed" logprobs under the request's temperature and truncation.
LOGPROBS_MODES_FOR = {"raw": ("raw_logprobs",), "processed": ("raw_logprobs", "processed_logprobs")}
# The sampler's truncation parameters, which our processed logprob models (per row, section 13).
SAMPLER_PARAMS = ("top_k", "top_p", "min_p")
# Sampling parameters that change the distribution vLLM samples from beyond the temperature and the
# truncation, with the value that leaves it unchanged: a processed logprob of rl_engine does not model
# them, so they are refused under logprobs="processed", and a capture of a request that sets one does
# not record sampling parameters (it would claim a distribution vLLM did not sample from).
PROCESSING_PARAMS = (("presence_penalty", (0.0, None)), ("frequency_penalty", (0.0, None)),
                     ("repetition_penalty", (1.0, None)), ("logit_bias", (None, {})), ("allowed_token_ids", (None, [])),
                     ("bad_words", (None, [])), ("min_tokens", (0, None)), ("structured_outputs", (None,)))
_STATE = "_rl_engine_vllm"
_ABSENT = object()
# vLLM's own threshold: a request with temperature below it is sampled greedily, and its processed
# logprobs are those of the raw logits (vllm/v1/sample/sampler.py, _SAMPLING_EPS).
GREEDY_EPS = 1e-5


class VLLMIntegrationError(RuntimeError):
    """vLLM is missing, another version lacks what this module wraps, or a request is refused."""


@dataclass(frozen=True)
class Options:
    """What the worker-side recorder does; checked on the driver before anything is installed (the
    backend's name is checked by the first call of the op, in the worker)."""

    capture: bool = True
    prompt_rows: bool = False
    logprobs: str | None = None
    num_vocab_tiles: int | str = "auto"
    backend: str = "auto"
    real_vocab_size: int | None = None
    vllm_logprobs_mode: str = "raw_logprobs"

    def __post_init__(self) -> None:
        if self.logprobs not in LOGPROB_MODES:
            raise VLLMIntegrationError(f"logprobs={self.logprobs!r} is not one of {list(LOGPROB_MODES)}: "
                                       "None keeps vLLM's own, 'raw' returns ours at temperature 1, "
                                       "'processed' ours under the request's temperature, top_k, top_p and min_p")
        for name in ("capture", "prompt_rows"):
            if not isinstance(getattr(self, name), bool):
                raise VLLMIntegrationError(f"{name}={getattr(self, name)!r} must be True or False")
        tiles = self.num_vocab_tiles
        if tiles != "auto" and (isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1):
            raise VLLMIntegrationError(f"num_vocab_tiles={tiles!r} must be 'auto' or a positive integer that divides "
                                       "the vocabulary (the trainer must use the same count)")
        if not isinstance(self.backend, str) or not self.backend:
            raise VLLMIntegrationError(f"backend={self.backend!r} must be a backend name or 'auto'")
        allowed = LOGPROBS_MODES_FOR.get(self.logprobs)
        if allowed is not None and self.vllm_logprobs_mode not in allowed:
            raise VLLMIntegrationError(
                f"logprobs={self.logprobs!r} with vLLM's logprobs_mode={self.vllm_logprobs_mode!r}: rl_engine would "
                f"overwrite what vLLM returns with logprobs of another kind; create the LLM with logprobs_mode in "
                f"{list(allowed)} (raw_logprobs is vLLM's default)")
        if not self.capture and self.logprobs is None:
            raise VLLMIntegrationError("capture=False with logprobs=None would install a wrapper that does "
                                       "nothing; ask for capture=True, logprobs='raw' or logprobs='processed'")


@dataclass
class _Rows:
    """One request's record in the worker: sampled rows in step order, prompt rows by position."""

    logits: list[torch.Tensor] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    reported: list[float] = field(default_factory=list)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    unmodelled: str = ""  # the first parameter beyond temperature and truncation the request sets
    prompt: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _version() -> str:
    try:
        import vllm
    except ImportError as exc:
        raise VLLMIntegrationError("vllm is not installed: install the vLLM your site runs "
                                   "(pip install 'rl_engine[vllm]'), or on a CPU machine build the "
                                   "environment of scripts/vllm-cpu-env.sh") from exc
    return str(vllm.__version__)


def check_version(version: str) -> None:
    """Refuse a vLLM whose minor version this module was not built and tested against."""
    if not any(version == v or version.startswith(v + ".") or version.startswith(v + "+") for v in SUPPORTED_VERSIONS):
        raise VLLMIntegrationError(f"vLLM {version} is not a supported version ({', '.join(SUPPORTED_VERSIONS)}.x): "
                                   "rl_engine.integrations.vllm wraps private parts of vLLM's model runner; "
                                   "install a supported vLLM or port the wrappers (docs/capture.md)")


def _require(obj: Any, names: tuple[str, ...], where: str, version: str) -> None:
    for name in names:
        if not hasattr(obj, name):
            raise VLLMIntegrationError(f"vLLM {version}: {where} has no attribute {name!r}, which "
                                       "rl_engine.integrations.vllm wraps (a private API of the V1 model runner); "
                                       f"this vLLM is not one it supports ({', '.join(SUPPORTED_VERSIONS)}.x), or it "
                                       "runs its Model Runner V2 (set VLLM_USE_V2_MODEL_RUNNER=0)")


# ----------------------------------------------------------------------------------------------
# Worker side: runs inside vLLM's worker process (sent by LLM.collective_rpc).


def _worker_install(worker: Any, options: dict[str, Any], version: str) -> str:
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise VLLMIntegrationError(f"vLLM {version}: the worker has no model_runner")
    _require(runner, ("sampler", "input_batch", "requests", "discard_request_mask", "query_start_loc",
                      "_get_prompt_logprobs_dict", "model"), "the model runner", version)
    _require(runner.sampler, ("forward", "gather_logprobs", "compute_logprobs"), "the sampler", version)
    _require(runner.model, ("compute_logits",), "the model", version)
    if getattr(runner, "speculative_config", None) is not None:
        raise VLLMIntegrationError("speculative decoding is on: its rows go through vLLM's rejection sampler, "
                                   "which rl_engine does not wrap; run the capture without a speculative_config")
    if getattr(runner, _STATE, None) is not None:
        _worker_uninstall(worker)
    state = _Recorder(runner, Options(**options))
    setattr(runner, _STATE, state)
    state.install()
    return type(runner).__name__


def _worker_uninstall(worker: Any) -> bool:
    runner = worker.model_runner
    state = getattr(runner, _STATE, None)
    if state is None:
        return False
    state.uninstall()
    setattr(runner, _STATE, None)
    return True


def _worker_collect(worker: Any, clear: bool) -> dict[str, Any]:
    state = getattr(worker.model_runner, _STATE, None)
    if state is None:
        raise VLLMIntegrationError("nothing is installed in this LLM: call rl_engine.integrations.vllm.install first")
    out = state.export()
    if clear:
        state.records.clear()
    return out


class _Recorder:
    """The wrappers on one model runner and what they recorded."""

    def __init__(self, runner: Any, options: Options) -> None:
        self.runner = runner
        self.options = options
        self.records: dict[str, _Rows] = {}
        self._prompt: list[tuple[int, torch.Tensor]] | None = None
        self._hidden: torch.Tensor | None = None

    # installation --------------------------------------------------------------------------
    def install(self) -> None:
        sampler, runner = self.runner.sampler, self.runner
        original_forward = sampler.forward
        original_prompt = runner._get_prompt_logprobs_dict
        original_logits = runner.model.compute_logits
        original_gather = sampler.gather_logprobs
        recorder = self

        def forward(_self: Any, logits: torch.Tensor, sampling_metadata: Any, *args: Any, **kwargs: Any) -> Any:
            # vLLM's sampler divides by the temperature and applies penalties in place once the rows are
            # float32; float32 rows are not copied by its .to(float32), so keep the raw ones first
            raw = logits.clone() if logits.dtype == torch.float32 else logits
            output = original_forward(logits, sampling_metadata, *args, **kwargs)
            recorder.on_sample(raw, sampling_metadata, output)
            return output

        def prompt_logprobs(hidden_states: torch.Tensor, num_scheduled_tokens: Any) -> Any:
            recorder._prompt, recorder._hidden = [], hidden_states
            try:
                return original_prompt(hidden_states, num_scheduled_tokens)
            finally:
                recorder._prompt, recorder._hidden = None, None

        def compute_logits(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            logits = original_logits(hidden_states, *args, **kwargs)
            if recorder._prompt is not None and recorder._hidden is not None:
                recorder.on_prompt_logits(hidden_states, logits)
            return logits

        def gather_logprobs(scores: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> Any:
            out = original_gather(scores, num_logprobs, token_ids)
            if recorder._prompt is not None:
                return recorder.on_prompt_gather(token_ids, out)
            return out

        targets = [(sampler, "forward", types.MethodType(forward, sampler))]
        if self.options.prompt_rows or self.options.logprobs is not None:
            targets += [(runner, "_get_prompt_logprobs_dict", prompt_logprobs),
                        (runner.model, "compute_logits", compute_logits), (sampler, "gather_logprobs", gather_logprobs)]
        # what each wrapped attribute was on the instance itself (usually nothing: a class method)
        self._saved = [(obj, name, vars(obj).get(name, _ABSENT)) for obj, name, _ in targets]
        for obj, name, wrapper in targets:
            setattr(obj, name, wrapper)

    def uninstall(self) -> None:
        """Put every wrapped attribute back as it was on its instance."""
        for obj, name, before in self._saved:
            if before is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, before)
        self._saved = []

    # the sampled rows ------------------------------------------------------------------------
    def on_sample(self, logits: torch.Tensor, metadata: Any, output: Any) -> None:
        runner = self.runner
        num = logits.shape[0]
        req_ids = list(runner.input_batch.req_ids[:num])
        if len(req_ids) != num:
            raise VLLMIntegrationError(f"the sampler got {num} rows for {len(req_ids)} requests; rl_engine "
                                       "captures one row per request and step (no speculative decoding)")
        discard = runner.discard_request_mask.np[:num].copy()
        sampled = output.sampled_token_ids[:, 0].to(torch.int64)
        temps = self._temperatures(metadata, num, logits.device)
        tensors = output.logprobs_tensors
        self._check_processing(req_ids)
        params = self._sampler_params(req_ids)
        if self.options.logprobs is not None:
            if tensors is not None:
                self._replace(logits, sampled, temps, tensors, params)
        reported = self._reported(tensors, sampled) if self._reported_kind() is not None else None
        if not self.options.capture:
            return
        rows = logits.detach().to("cpu", copy=True)
        tokens = sampled.cpu().tolist()
        temps_host = temps.cpu().tolist()
        for i, req in enumerate(req_ids):
            if discard[i]:
                continue
            rec = self.records.setdefault(req, _Rows())
            rec.logits.append(rows[i])
            rec.tokens.append(tokens[i])
            rec.reported.append(math.nan if reported is None else float(reported[i]))
            rec.temperature = temps_host[i]
            rec.top_k, rec.top_p, rec.min_p = (params[0][i].item(), params[1][i].item(), params[2][i].item())
            rec.unmodelled = self._unmodelled(req)

    def _temperatures(self, metadata: Any, num: int, device: torch.device) -> torch.Tensor:
        """Each row's temperature as vLLM's sampler applies it (greedy rows: 1)."""
        temp = getattr(metadata, "temperature", None)
        if metadata.all_greedy or temp is None:
            return torch.ones(num, dtype=torch.float32, device=device)
        temp = temp[:num].to(torch.float32)
        return torch.where(temp < GREEDY_EPS, torch.ones_like(temp), temp)

    def _check_processing(self, req_ids: list[str]) -> None:
        """Refuse, naming the request and the parameter, what our logprob or capture does not model."""
        for req in req_ids:
            params = getattr(self.runner.requests[req], "sampling_params", None)
            if params is None:
                continue
            if self.options.capture and getattr(params, "structured_outputs", None) is not None:
                raise VLLMIntegrationError(f"request {req} uses structured outputs: vLLM masks its rows with -inf before "
                                           "sampling, so they are not the model's logits; capture without them")
            if self.options.logprobs != "processed":
                continue
            unmodelled = self._unmodelled(req)
            if unmodelled:
                raise VLLMIntegrationError(
                    f"request {req} sets {unmodelled}: processed logprobs after it are not rl_engine's (the "
                    "temperature, top_k, top_p and min_p are); use logprobs='raw', or sample without it")

    def _unmodelled(self, req: str) -> str:
        """``name=value`` of the first parameter of ``req`` beyond temperature and truncation ('' if none)."""
        params = getattr(self.runner.requests[req], "sampling_params", None)
        for name, neutral in PROCESSING_PARAMS:
            value = getattr(params, name, None)
            if value not in neutral:
                return f"{name}={value!r}"
        return ""

    def _sampler_params(self, req_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's ``(top_k int64, top_p float32, min_p float32)`` as vLLM applies them (off: 0, 1, 0;
        vLLM's ``top_k=-1`` and ``0`` are off; a greedy request's are off, as vLLM's SamplingParams sets)."""
        ks, ps, ms = [], [], []
        for req in req_ids:
            params = getattr(self.runner.requests[req], "sampling_params", None)
            k = getattr(params, "top_k", 0)
            p = getattr(params, "top_p", 1.0)
            m = getattr(params, "min_p", 0.0)
            ks.append(int(k) if k is not None and k > 0 else 0)
            ps.append(1.0 if p is None else float(p))
            ms.append(0.0 if m is None else float(m))
        return (torch.tensor(ks, dtype=torch.int64), torch.tensor(ps, dtype=torch.float32),
                torch.tensor(ms, dtype=torch.float32))

    def _ours(self, logits: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor | None,
              params: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """selected_logprob of ``logits`` rows at ``targets`` in one call: ``temps`` holds each row's
        temperature (vLLM's float32 values, taken exactly: a temperature per row), ``None`` is 1;
        ``params``: each row's ``(top_k, top_p, min_p)``, per-row parameters of the call (None: off)."""
        from rl_engine.logprob import selected_logprob

        sampler = {} if params is None else {name: value.to(logits.device) for name, value in zip(SAMPLER_PARAMS, params)}
        got = selected_logprob(logits, targets, torch.ones(targets.shape, dtype=torch.bool, device=logits.device),
                               num_vocab_tiles=self.options.num_vocab_tiles, backend=self.options.backend,
                               real_vocab_size=self.options.real_vocab_size,
                               temperature=1.0 if temps is None else temps, **sampler)
        return got.selected_logp

    def _replace(self, logits: torch.Tensor, sampled: torch.Tensor, temps: torch.Tensor, tensors: Any,
                 params: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Overwrite the logprob values vLLM is about to return with ours (same token ids, same shape)."""
        values = tensors.logprobs
        ids = tensors.logprob_token_ids
        rows = logits.shape[0]
        processed = self.options.logprobs == "processed"
        if ids.numel() == 0:  # logprobs=-1: every column of every row
            raise VLLMIntegrationError("logprobs=-1 (every vocabulary entry) with rl_engine's logprob is refused: "
                                       "ask for the sampled token and a top-k (logprobs=k)")
        width = ids.shape[1]
        flat_rows = torch.arange(rows, device=logits.device).repeat_interleave(width)
        flat_ids = ids.to(torch.int64).reshape(-1)
        index = flat_rows.cpu()
        ours = self._ours(logits.index_select(0, flat_rows), flat_ids,
                          temps.index_select(0, flat_rows) if processed else None,
                          tuple(p.index_select(0, index) for p in params) if processed else None)  # type: ignore[arg-type]
        values.copy_(ours.reshape(rows, width).to(values.dtype))

    def _reported_kind(self) -> str | None:
        """What the values vLLM returns are: ``"raw"`` (logprobs at temperature 1: a capture's
        ``reported_logp``), ``"processed"`` (under the request's temperature and truncation: its
        ``reported_processed_logp``), or None (logits, not logprobs)."""
        if self.options.logprobs is not None:
            return self.options.logprobs
        return {"raw_logprobs": "raw", "processed_logprobs": "processed"}.get(self.options.vllm_logprobs_mode)

    @staticmethod
    def _reported(tensors: Any, sampled: torch.Tensor) -> torch.Tensor | None:
        """The logprob vLLM returns for each row's sampled token (None when none was asked for)."""
        if tensors is None:
            return None
        if tensors.logprob_token_ids.numel() == 0:  # full rows (logprobs=-1)
            values = tensors.logprobs.gather(1, sampled.view(-1, 1).to(tensors.logprobs.device))[:, 0]
        else:
            values = tensors.logprobs[:, 0]
        return values.to(torch.float32).cpu()

    # the prompt rows -------------------------------------------------------------------------
    def on_prompt_logits(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        base = self._hidden
        assert base is not None and self._prompt is not None
        stride = base.stride(0)
        offset = (hidden.storage_offset() - base.storage_offset()) // stride
        self._prompt.append((offset, logits))

    def on_prompt_gather(self, token_ids: torch.Tensor, out: Any) -> Any:
        assert self._prompt is not None
        if not self._prompt:
            return out
        offset, logits = self._prompt.pop()
        runner = self.runner
        num = runner.input_batch.num_reqs
        starts = runner.query_start_loc.np[:num].tolist()
        if offset not in starts:
            raise VLLMIntegrationError(f"prompt rows at offset {offset} belong to no request (starts {starts})")
        req = runner.input_batch.req_ids[starts.index(offset)]
        start = int(runner.requests[req].num_computed_tokens)
        targets = token_ids.to(torch.int64)
        if self.options.logprobs is not None:
            token_col, values = out[0], out[1]
            flat = token_col.to(torch.int64)
            width = flat.shape[1]
            rows = torch.arange(logits.shape[0], device=logits.device).repeat_interleave(width)
            ours = self._ours(logits.index_select(0, rows), flat.reshape(-1), None)
            values = ours.reshape(values.shape).to(values.dtype)
            out = type(out)(token_col, values, *out[2:]) if isinstance(out, tuple) else out
        if self.options.capture and self.options.prompt_rows:
            rec = self.records.setdefault(req, _Rows())
            for i in range(logits.shape[0]):
                rec.prompt[start + i] = (logits[i].detach().to("cpu", copy=True), targets[i].cpu())
        return out

    # export ----------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        out: dict[str, Any] = {"__options__": dict(self.options.__dict__), "__reported__": self._reported_kind()}
        for req, rec in self.records.items():
            prompt = [rec.prompt[k] for k in sorted(rec.prompt)]
            out[req] = {
                "logits": torch.stack(rec.logits) if rec.logits else None,
                "tokens": torch.tensor(rec.tokens, dtype=torch.int64),
                "reported": torch.tensor(rec.reported, dtype=torch.float32),
                "temperature": rec.temperature,
                "top_k": rec.top_k, "top_p": rec.top_p, "min_p": rec.min_p, "unmodelled": rec.unmodelled,
                "prompt_positions": sorted(rec.prompt),
                "prompt_logits": torch.stack([p[0] for p in prompt]) if prompt else None,
                "prompt_targets": torch.stack([p[1] for p in prompt]) if prompt else None,
            }
        return out


class WorkerExtension:
    """vLLM's ``worker_extension_cls`` for this module: ``LLM(..., worker_extension_cls=WORKER_EXTENSION)``.

    With it, :func:`install` and :func:`collect` call the worker by method name, which works with
    vLLM's engine in its own process and no insecure serialization; without it they send this
    module's functions, which works in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``."""

    def rl_engine_install(self, options: dict[str, Any], version: str) -> str:
        return _worker_install(self, options, version)

    def rl_engine_uninstall(self) -> bool:
        return _worker_uninstall(self)

    def rl_engine_collect(self, clear: bool) -> dict[str, Any]:
        return _worker_collect(self, clear)


WORKER_EXTENSION = f"{__name__}.WorkerExtension"


# ----------------------------------------------------------------------------------------------
# Driver side.


def _rpc(llm: Any, name: str, args: tuple[Any, ...] = ()) -> list[Any]:
    """Call the worker by name when the worker extension is installed, else send the function."""
    parallel = getattr(getattr(llm.llm_engine, "vllm_config", None), "parallel_config", None)
    if getattr(parallel, "worker_extension_cls", "") == WORKER_EXTENSION:
        return llm.collective_rpc(f"rl_engine_{name}", args=args)
    return llm.collective_rpc(globals()[f"_worker_{name}"], args=args)


def install(llm: Any, *, capture: bool = True, prompt_rows: bool = False, logprobs: str | None = None,
            num_vocab_tiles: int | str = "auto", backend: str = "auto") -> None:
    """Install the recorder (and, with ``logprobs``, our logprob) in every worker of ``llm``.

    ``capture``: keep every sampled row for :func:`collect`; ``prompt_rows``: keep the prompt rows
    too (the requests must ask for ``prompt_logprobs``, which is when vLLM computes them);
    ``logprobs``: ``None`` leaves vLLM's returned logprobs alone, ``"raw"`` makes them ours at
    temperature 1, ``"processed"`` ours under the request's temperature, top-k, top-p and min-p. ``num_vocab_tiles`` and
    ``backend`` are :func:`~rl_engine.logprob.selected_logprob`'s (the trainer must use the same
    tile count to get the same bytes: ``auto`` is the API's rule on both sides)."""
    version = _version()
    check_version(version)
    vocab = _real_vocab(llm)
    config = getattr(llm.llm_engine, "vllm_config", None)
    parallel = getattr(config, "parallel_config", None)
    if getattr(parallel, "pipeline_parallel_size", 1) != 1:
        raise VLLMIntegrationError(f"pipeline_parallel_size={parallel.pipeline_parallel_size}: the first worker never "
                                   "samples under pipeline parallelism; capture with pipeline_parallel_size=1")
    if getattr(config, "use_v2_model_runner", False):
        raise VLLMIntegrationError("vLLM runs its Model Runner V2, whose sampler rl_engine does not wrap; set "
                                   "VLLM_USE_V2_MODEL_RUNNER=0 before creating the LLM")
    mode = str(getattr(getattr(llm.llm_engine, "model_config", None), "logprobs_mode", "raw_logprobs"))
    options = Options(capture=capture, prompt_rows=prompt_rows, logprobs=logprobs, num_vocab_tiles=num_vocab_tiles,
                      backend=backend, real_vocab_size=vocab, vllm_logprobs_mode=mode)
    _rpc(llm, "install", (dict(options.__dict__), version))


def uninstall(llm: Any) -> None:
    """Remove the wrappers from every worker; what was recorded is dropped."""
    _rpc(llm, "uninstall")


def _real_vocab(llm: Any) -> int | None:
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    size = getattr(config, "get_vocab_size", None)
    return int(size()) if callable(size) else None


def _engine_info(llm: Any) -> tuple[str, int]:
    engine = llm.llm_engine
    config = getattr(engine, "model_config", None) or getattr(getattr(engine, "vllm_config", None), "model_config", None)
    model = str(getattr(config, "served_model_name", None) or getattr(config, "model", "unknown"))
    parallel = getattr(getattr(engine, "vllm_config", None), "parallel_config", None)
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    return model, tp


def _record_of(recorded: dict[str, Any], request_id: str) -> dict[str, Any] | None:
    """The worker's record of an output: vLLM 0.32's engine appends ``-<8 hex digits>`` to the id."""
    if request_id in recorded:
        return recorded[request_id]
    found = [k for k in recorded if k.rpartition("-")[0] == request_id]
    if len(found) > 1:
        raise VLLMIntegrationError(f"request {request_id} matches several recorded requests {found}; "
                                   "collect after each generate call (clear=True, the default)")
    return recorded[found[0]] if found else None


def collect(llm: Any, outputs: list[Any], *, model_name: str | None = None, notes: str = "",
            clear: bool = True) -> Capture:
    """The recorded rows of ``outputs`` (``llm.generate``'s return, in its order) as one capture.

    Per request: its prompt rows when they were recorded (inactive; row ``i`` predicts prompt
    token ``i + 1``), then one active row per generated token (the row it was sampled from, the
    token as target, vLLM's returned logprob). The rows are those of a trainer's capture of
    ``prompt + generated`` tokens. Each row's sampling parameters (temperature, top-k, top-p, min-p as
    vLLM applied them; off on prompt rows) are the capture's sampling tensors, and per request in
    ``notes``; a request that sets a parameter our processed logprob does not model (a penalty,
    ``logit_bias``, ...) leaves the sampling tensors out, and ``notes`` names it. vLLM's returned
    logprob is ``reported_logp`` where it is a logprob at temperature 1 (its default ``raw_logprobs``,
    or ours with ``logprobs="raw"``), ``reported_processed_logp`` where it is the processed one (its
    ``processed_logprobs``, or ours with ``logprobs="processed"``). Refused: an output whose recorded tokens are not
    the ones vLLM returned, a request with ``n > 1``, a request whose prompt rows are missing when
    prompt rows were asked for. With vLLM's asynchronous scheduling a request that stopped (EOS, a stop
    token) was sampled once more before the stop was seen and vLLM dropped that token: recorded rows past
    the returned tokens are dropped too, and counted in ``notes``. The capture's ``notes`` are one line
    of JSON (a capture's metadata holds no newline); the caller's ``notes`` are its ``"notes"`` key."""
    version = _version()
    recorded = dict(_rpc(llm, "collect", (clear,))[0])
    options = recorded.pop("__options__", {})
    kind = recorded.pop("__reported__", None)
    logits, targets, active, reported, per_request, gen_reported = [], [], [], [], [], []
    sampling: dict[str, list[torch.Tensor]] = {name: [] for name in SAMPLING}
    dtype = None
    for out in outputs:
        if len(out.outputs) != 1:
            raise VLLMIntegrationError(f"request {out.request_id} has {len(out.outputs)} samples; collect takes n=1 "
                                       "requests (one sequence each)")
        rec = _record_of(recorded, str(out.request_id))
        if rec is None:
            raise VLLMIntegrationError(f"request {out.request_id} has no recorded rows: was it generated after "
                                       f"install() on this LLM? recorded: {sorted(recorded)[:8]}")
        generated = list(out.outputs[0].token_ids)
        tokens = rec["tokens"].tolist()
        extra = len(tokens) - len(generated)
        if extra > 0 and tokens[:len(generated)] == generated:  # sampled after a stop vLLM had not yet seen
            rec = {**rec, "logits": rec["logits"][:len(generated)], "tokens": rec["tokens"][:len(generated)],
                   "reported": rec["reported"][:len(generated)]}
            tokens = tokens[:len(generated)]
        if tokens != generated:
            raise VLLMIntegrationError(f"request {out.request_id}: the recorded sampled tokens {tokens[:8]}... are not "
                                       f"the ones vLLM returned {generated[:8]}...; the rows cannot be matched")
        prompt = list(out.prompt_token_ids or [])
        if options.get("prompt_rows") and rec["prompt_logits"] is None and len(prompt) > 1:
            raise VLLMIntegrationError(f"request {out.request_id} has no prompt rows although install(prompt_rows=True) "
                                       "asked for them: vLLM computes them only for requests with prompt_logprobs set "
                                       "(SamplingParams(prompt_logprobs=0))")
        if rec["prompt_logits"] is not None:
            positions = rec["prompt_positions"]
            if positions != list(range(len(prompt) - 1)):
                raise VLLMIntegrationError(f"request {out.request_id}: prompt rows recorded at positions {positions[:8]}..., "
                                           f"not 0..{len(prompt) - 2}; ask for prompt_logprobs on every request "
                                           "and keep prefix caching off (enable_prefix_caching=False)")
            if rec["prompt_targets"].tolist() != prompt[1:]:
                raise VLLMIntegrationError(f"request {out.request_id}: the prompt rows' targets are not the prompt's tokens")
            logits.append(rec["prompt_logits"])
            targets.append(rec["prompt_targets"])
            active.append(torch.zeros(len(prompt) - 1, dtype=torch.bool))
            reported.append(torch.zeros(len(prompt) - 1, dtype=torch.float32))
            _extend_sampling(sampling, len(prompt) - 1, 1.0, 0, 1.0, 0.0)
        _extend_sampling(sampling, len(generated), rec["temperature"], rec["top_k"], rec["top_p"], rec["min_p"])
        logits.append(rec["logits"])
        targets.append(rec["tokens"])
        active.append(torch.ones(len(generated), dtype=torch.bool))
        reported.append(rec["reported"])
        gen_reported.append(rec["reported"])
        dtype = rec["logits"].dtype
        per_request.append({"request_id": out.request_id, "prompt_tokens": len(prompt),
                            "generated_tokens": len(generated), "temperature": rec["temperature"],
                            "top_k": rec["top_k"], "top_p": rec["top_p"], "min_p": rec["min_p"],
                            "unmodelled": rec["unmodelled"],
                            "first_token": prompt[0] if prompt else None, "rows_after_stop_dropped": max(extra, 0),
                            "prompt_rows": rec["prompt_logits"] is not None})
    if not per_request:
        raise VLLMIntegrationError("no outputs given: pass the list llm.generate returned")
    if dtype not in DTYPE_NAMES:
        raise CaptureError(f"vLLM sampled from {dtype} logits; a capture holds bf16, fp16 or fp32")
    rep = torch.cat(reported)
    act = torch.cat(active)
    # a request with no token has nothing to miss; a processed logprob may be -inf (outside the kept set)
    found = [bool((~torch.isnan(r)).all()) for r in gen_reported]
    if any(found) and not all(found):  # all or none: a capture's reported logprob covers every active token
        missing = [req["request_id"] for req, ok in zip(per_request, found) if not ok]
        raise VLLMIntegrationError(f"vLLM returned a reported logprob for some requests but not for {missing}: "
                                   "ask every request for logprobs=0 (or more), or none of them")
    has_reported = all(found) and kind is not None
    unmodelled = {req["request_id"]: req["unmodelled"] for req in per_request if req["unmodelled"]}
    rows = None if unmodelled else RowSampling(*(torch.cat(sampling[name]).to(SAMPLING_DTYPES[name])
                                                 for name in SAMPLING))
    tensor = {"raw": REPORTED, "processed": REPORTED_PROCESSED}.get(kind or "") if has_reported else None
    if tensor == REPORTED_PROCESSED and rows is None:
        tensor = None  # a processed logprob under parameters the capture cannot state is not kept
    model, tp = _engine_info(llm)
    why = ", ".join(f"{r} {u}" for r, u in unmodelled.items())
    vllm_info = {"requests": per_request,
                 "reported_logp": "returned by vLLM" if tensor == REPORTED else "absent",
                 "reported_processed_logp": "returned by vLLM" if tensor == REPORTED_PROCESSED else "absent",
                 "sampling": "recorded" if rows is not None else f"absent: parameters rl_engine does not model: {why}"}
    info = {**({"notes": notes} if notes else {}), "vllm": vllm_info}
    text = json.dumps(info, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return Capture(logits=torch.cat(logits), targets=torch.cat(targets), active=act,
                   reported_logp=rep if tensor == REPORTED else None,
                   metadata=build_metadata(engine="vllm", engine_version=version, model=model_name or model,
                                           dtype=DTYPE_NAMES[dtype], tp=tp, notes=text),
                   sampling=rows, reported_processed_logp=rep if tensor == REPORTED_PROCESSED else None)


SAMPLING_DTYPES = {"temperature": torch.float32, "top_k": torch.int64, "top_p": torch.float32, "min_p": torch.float32}


def _extend_sampling(sampling: dict[str, list[torch.Tensor]], rows: int, temperature: float, top_k: int,
                     top_p: float, min_p: float) -> None:
    """Append ``rows`` rows of one request's parameters to the capture's sampling columns."""
    for name, value in zip(SAMPLING, (temperature, top_k, top_p, min_p)):
        sampling[name].append(torch.full((rows,), value, dtype=SAMPLING_DTYPES[name]))


__all__ = ["LOGPROB_MODES", "SUPPORTED_VERSIONS", "WORKER_EXTENSION", "Options", "VLLMIntegrationError",
           "WorkerExtension", "check_version", "collect", "install", "uninstall"]
