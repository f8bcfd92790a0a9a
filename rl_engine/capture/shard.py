"""One TP x CP rank's inputs from a capture: its own tokens and vocabulary columns only.

:func:`rank_inputs` checks that a rank's contract describes the capture (vocabulary, token
count, logits dtype) and reads, through safetensors' lazy slices, the rows
``contract.token_indices`` and the columns ``[contract.vocab_start, contract.vocab_end)``:
a rank never holds another rank's columns. The capture's rows are the contract's global token
order (``sequence * seq_len + position``), so a capture of ``tokens`` rows runs as
``num_sequences * seq_len == tokens``.

A campaign on captured logits (``rl_engine.campaign.run``, docs/capture.md) reads each rank's
inputs with it.
"""

from __future__ import annotations

import os

import torch

from rl_engine.capture.format import (
    ACTIVE,
    LOGITS,
    TARGETS,
    CaptureError,
    Header,
    read_header,
    read_rows,
)
from rl_engine.logprob.contract import LogprobContract


def check_contract(header: Header, contract: LogprobContract, where: str) -> None:
    """The contract must describe the capture: every column real, every row a token."""
    problems = []
    if contract.padded_vocab_size != header.vocab or contract.real_vocab_size != header.vocab:
        problems.append(f"real_vocab_size={contract.real_vocab_size} and padded_vocab_size="
                        f"{contract.padded_vocab_size} must both be the capture's vocab {header.vocab}")
    tokens = contract.num_sequences * contract.seq_len
    if tokens != header.num_tokens:
        problems.append(f"num_sequences * seq_len = {contract.num_sequences} * {contract.seq_len} "
                        f"= {tokens} must be the capture's {header.num_tokens} tokens")
    if contract.logits_dtype != header.logits_dtype:
        problems.append(f"logits_dtype={contract.logits_dtype!r} must be the capture's "
                        f"{header.logits_dtype!r} (the candidate sees the captured bits)")
    if problems:
        raise CaptureError(f"{where}: the contract does not describe this capture: "
                           + "; ".join(problems) + "; build it from the capture's header")


def rank_inputs(path: str | os.PathLike[str], contract: LogprobContract,
                header: Header | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(local logits [rank tokens, local vocab], targets, active)`` of this rank."""
    header = header if header is not None else read_header(path)
    check_contract(header, contract, str(path))
    part = read_rows(path, header, list(contract.token_indices),
                     (contract.vocab_start, contract.vocab_end))
    logits, targets, active = part[LOGITS], part[TARGETS], part[ACTIVE]
    bad = ~torch.isfinite(logits).all(dim=1)  # the rest of the value rules is the op's own
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise CaptureError(f"{path}: tensor logits has a non-finite value at token "
                           f"{contract.token_indices[row]} in columns [{contract.vocab_start}, "
                           f"{contract.vocab_end}); capture the raw LM-head logits")
    return logits, targets, active


__all__ = ["check_contract", "rank_inputs"]
