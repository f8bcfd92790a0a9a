"""Captured logits: the capture file format, a capture helper for transformers models, parity.

See ``docs/capture.md``. :mod:`rl_engine.capture.format` holds the file format (no
transformers import); :mod:`rl_engine.capture.hf` captures from a transformers causal LM;
:mod:`rl_engine.capture.parity` is the ``parity`` verb.
"""

from rl_engine.capture.format import (
    FORMAT,
    Capture,
    CaptureError,
    Header,
    RowSampling,
    build_metadata,
    read_capture,
    read_header,
    read_rows,
    write_capture,
)

__all__ = [
    "FORMAT", "Capture", "CaptureError", "Header", "RowSampling", "build_metadata", "read_capture",
    "read_header", "read_rows", "write_capture",
]
