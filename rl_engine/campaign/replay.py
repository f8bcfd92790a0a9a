"""Replay the candidate of a campaign case at TP=1, CP=1 in one process, on any machine.

Because the candidate's arithmetic is ``docs/arithmetic.md`` (IEEE-754 operations in a fixed
order, TP deciding only who computes a tile), one process on a reviewer's laptop computes the
same bytes as every topology of the campaign did on its cluster. ``verify --recompute`` uses
this to require byte equality with the archived logp, LSE and entropy files and with all four
fingerprints, the gradient's included.

A report names the version of the arithmetic it was computed under (``arithmetic_spec``), and
each version is replayed under its own rules for ever: this installation's backends compute
:data:`rl_engine.arith.portable.SPEC_VERSION`; an earlier version (``rl-engine-arith/1``,
``docs/arithmetic-1.md``) is replayed by the NumPy implementation, :mod:`rl_engine.arith.spec_numpy`,
which computes every version it lists in ``SPECS``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from rl_engine.arith import spec_numpy
from rl_engine.arith.portable import SPEC_VERSION
from rl_engine.campaign.captured import case_inputs, case_row_sampling, replay_source
from rl_engine.campaign.case import SAMPLING_DEFAULTS, record_contract, record_op_sampling
from rl_engine.campaign.inputs import inputs_sha256
from rl_engine.logprob.backends.description import arith_backends as described_arith_backends
from rl_engine.logprob.registry import dispatch
from rl_engine.rundir import TENSOR_NAMES
from rl_engine.tensorio import fingerprint


@dataclass(frozen=True)
class Replay:
    """The candidate's outputs for a whole case: float32 ``[tokens]`` tensors and the gradient."""

    tensors: dict[str, torch.Tensor]  # by rundir.TENSOR_NAMES: logp, lse, entropy
    grad: torch.Tensor  # [tokens, padded_vocab] in the logits dtype

    def fingerprints(self) -> dict[str, str]:
        """The report's ``bitwise_fingerprints`` hashes of this replay."""
        found = {f"candidate_{name}_sha256": fingerprint(t) for name, t in self.tensors.items()}
        found["candidate_grad_sha256"] = fingerprint(self.grad)
        return found


def arith_backends(root: str | os.PathLike[str] | None = None) -> tuple[str, ...]:
    """The backends computing docs/arithmetic.md (this version, by their descriptions): any of them
    replays a case run with any other, byte for byte (tests/test_fused_cpu.py,
    tests/test_fused_campaign.py, tests/test_triton_backend.py, tests/test_triton_campaign.py): a
    Triton-backend campaign run on GPUs is replayed on a reviewer's CPU by the eager reference.
    ``root``: the folder of backend folders (default: rl_engine/logprob/backends/)."""
    return described_arith_backends(SPEC_VERSION, root)


REFERENCE_BACKEND = "pytorch-vocab-parallel-logp-ws2"


class ReplayError(ValueError):
    """A report's arithmetic version that this installation cannot replay."""


def case_source(case: Mapping[str, Any], root: str | os.PathLike[str],
                given: str | os.PathLike[str] | None = None) -> Path | None:
    """The capture a report's case replays from (None: the input recipe): ``given`` (``verify
    --capture``) or the archive's copy, each checked against the recorded SHA-256
    (:func:`rl_engine.campaign.captured.replay_source`)."""
    record = case.get("capture")
    return None if record is None else replay_source(record, root, given)


def regenerate_inputs(case: Mapping[str, Any], root: str | os.PathLike[str],
                      given: str | os.PathLike[str] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, str]]:
    """A report's case's whole inputs as ``verify --recompute`` regenerates them (the recipe, or the
    capture of :func:`case_source`), with their ``inputs_sha256``."""
    logits, targets, active = case_inputs(case, case_source(case, root, given))
    return logits, targets, active, inputs_sha256(logits, targets, active)


def replay_candidate(case: Mapping[str, Any], backend: str | None = None,
                     capture: str | os.PathLike[str] | None = None, spec: str = SPEC_VERSION) -> Replay:
    """Regenerate the case's inputs and compute the candidate on all of them, TP=1, CP=1, CPU.

    ``backend`` (default: the case's) names the backend that recomputes; ``verify
    --recompute`` passes the eager reference for a case of any ``arith_backends()`` backend, so a
    reviewer's machine needs no compiled kernel to check a fused-backend run. ``spec`` is the
    arithmetic version the report records: another than this installation's is replayed by the
    NumPy implementation of that version (:func:`replay_numpy`).
    The gradient is that of the sum of the selected logprobs over all tokens (what every
    topology's runner differentiates). A case on a capture reads it from ``capture`` (default:
    its recorded path) after checking its SHA-256.
    """
    if spec != SPEC_VERSION:
        return replay_numpy(case, spec, capture)
    logits, targets, active = case_inputs(case, capture)  # on a capture: its hash checked first
    contract = record_contract(case)
    # docs/arithmetic.md section 13, and each row's captured temperature (sampling: capture); {}: raw
    sampling = record_op_sampling(case, contract.num_tokens, "cpu", case_row_sampling(case, capture))
    op = dispatch(backend or str(case["backend"]), contract, "cpu", processed="sampling" in sampling,
                  row_temperature="temperature" in sampling).op
    x = logits.to(contract.torch_dtype).requires_grad_(True)
    out = op(x, targets, active, contract, compute_entropy=True, **sampling)
    out.selected_logp.backward(torch.ones_like(out.selected_logp))
    assert x.grad is not None and out.entropy is not None
    computed = {"logp": out.selected_logp, "lse": out.lse, "entropy": out.entropy}
    tensors = {name: computed[name].detach() for name in TENSOR_NAMES}
    return Replay(tensors, x.grad.detach())


_NUMPY_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def replay_numpy(case: Mapping[str, Any], spec: str, capture: str | os.PathLike[str] | None = None) -> Replay:
    """The candidate of ``case`` under arithmetic version ``spec``, by :mod:`rl_engine.arith.spec_numpy`.

    The inputs are the campaign's (the recipe's FP32 logits converted to the case's dtype as the
    runner converts them, or the capture's); the forward, and the gradient of the summed selected
    logprobs (``grad_logp = 1`` on every token, no LSE gradient), are NumPy's.
    """
    if spec not in spec_numpy.SPECS:
        raise ReplayError(f"arithmetic_spec {spec!r} is not one this rl_engine can replay ({', '.join(spec_numpy.SPECS)}); "
                          "verify with an rl_engine that implements it")
    logits, targets, active = case_inputs(case, capture)
    contract = record_contract(case)
    x = logits.to(contract.torch_dtype).contiguous()
    bits = x.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else x.numpy()
    dtype = _NUMPY_DTYPES[str(case["dtype"])]
    t, a = targets.numpy(), active.numpy()
    real, tiles = contract.real_vocab_size, contract.num_vocab_tiles
    temperature: Any = contract.temperature
    params: dict[str, Any] = {name: case[name] for name in SAMPLING_DEFAULTS if name in case}
    captured = case_row_sampling(case, capture)  # sampling: capture: every row's own parameters
    if captured is not None:
        temperature = captured.temperature.numpy()
        params = {"top_k": captured.top_k.numpy(), "top_p": captured.top_p.numpy(), "min_p": captured.min_p.numpy()}
    if params and spec == spec_numpy.SPEC_V1:
        held = "its capture's per-row sampling (sampling: capture)" if captured is not None else sorted(params)
        raise ReplayError(f"{spec_numpy.SPEC_V1} has no processed logprobs (top_k / top_p / min_p) and no temperature "
                          f"per row; the case holds {held}: an archive of that version cannot carry them")
    if params:  # docs/arithmetic.md section 13
        logp, lse, entropy, _kept, keep = spec_numpy.forward_processed(
            bits, dtype, t, a, real, tiles, True, temperature=temperature, **params)
        grad = spec_numpy.backward_processed(bits, dtype, t, a, lse, np.ones(len(t), np.float32), None, real,
                                             tiles, keep, temperature=temperature)
    else:
        logp, lse, entropy = spec_numpy.forward(bits, dtype, t, a, real, tiles, True, spec=spec,
                                                temperature=temperature)
        grad = spec_numpy.backward(bits, dtype, t, a, lse, np.ones(len(t), np.float32), None, real, tiles, spec=spec,
                                   temperature=temperature)
    computed = {"logp": logp, "lse": lse, "entropy": entropy}
    tensors = {name: torch.from_numpy(np.ascontiguousarray(computed[name])) for name in TENSOR_NAMES}
    if x.dtype == torch.bfloat16:
        grad_t = torch.from_numpy(grad.view(np.int16)).view(torch.bfloat16)
    else:
        grad_t = torch.from_numpy(grad)
    return Replay(tensors, grad_t)


__all__ = ["Replay", "ReplayError", "case_source", "regenerate_inputs", "replay_candidate", "replay_numpy"]
