"""Clocks, power and temperature of a GPU, sampled beside ``gpu-smoke``'s timings.

A measured time means little without the clock it ran at: a GPU that throttles (power, heat) or
idles at a low clock is slower than the roofline's 1.98 GHz for reasons the kernels do not
own. :class:`Sampler` reads the GPU every ``interval_s`` seconds in a background thread while the
timings run, from NVML (``pynvml``) when it imports, else from ``nvidia-smi`` on ``PATH``; with
neither (a CPU dry run, a machine without the driver's tools) it records that telemetry is
absent and why, and samples nothing. Each timing row then gets the summary of the samples taken
while it ran (:meth:`Sampler.summary`; the first sample after it when none fell inside: a short
row). Nothing here changes a timing: the sampler runs on the host, beside the timed loop.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

QUERY: tuple[str, ...] = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")
FIELDS: tuple[str, ...] = ("sm_mhz", "mem_mhz", "power_w", "temperature_c")
DEFAULT_INTERVAL_S = 0.05


class TelemetryError(ValueError):
    """A sampler asked for with a bad interval or device."""


def _number(text: str) -> float | None:
    """A field of ``nvidia-smi --format=csv,noheader,nounits``: a number, or None (``[N/A]``)."""
    try:
        return float(text.strip())
    except ValueError:
        return None


def parse_nvidia_smi(line: str) -> dict[str, float | None]:
    """One CSV line of :data:`QUERY` as :data:`FIELDS` (a missing or ``[N/A]`` field is None)."""
    parts = line.strip().split(",")
    if len(parts) != len(QUERY):
        raise TelemetryError(f"nvidia-smi printed {line.strip()!r}: expected {len(QUERY)} fields ({', '.join(QUERY)})")
    return {name: _number(part) for name, part in zip(FIELDS, parts)}


@dataclass
class Sampler:
    """Samples of one GPU in a background thread (``with Sampler.detect(...) as s:``)."""

    source: str | None  # "nvml", "nvidia-smi", or None: absent
    reason: str | None  # why absent
    device: str = "0"  # nvidia-smi's -i (an index or a UUID)
    interval_s: float = DEFAULT_INTERVAL_S
    samples: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _nvml: Any = None
    _errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (isinstance(self.interval_s, (int, float)) and 0 < self.interval_s <= 60):
            raise TelemetryError(f"interval_s={self.interval_s!r} must be a number of seconds in (0, 60]")
        if self.source not in (None, "nvml", "nvidia-smi"):
            raise TelemetryError(f"source={self.source!r} must be 'nvml', 'nvidia-smi' or None (absent)")

    @classmethod
    def detect(cls, device: str = "0", interval_s: float = DEFAULT_INTERVAL_S) -> Sampler:
        """NVML if ``pynvml`` imports and initialises, else ``nvidia-smi`` on ``PATH``, else absent."""
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            handle = (pynvml.nvmlDeviceGetHandleByUUID(device) if device.startswith("GPU-")
                      else pynvml.nvmlDeviceGetHandleByIndex(int(device)))
            return cls("nvml", None, device, interval_s, _nvml=(pynvml, handle))
        except Exception:  # noqa: BLE001 - no NVML here: try the command line tool
            pass
        if shutil.which("nvidia-smi"):
            return cls("nvidia-smi", None, device, interval_s)
        return cls(None, "absent: neither pynvml (NVML) nor nvidia-smi on PATH", device, interval_s)

    def read(self) -> dict[str, float | None]:
        """One reading of :data:`FIELDS`."""
        if self.source == "nvml":
            nvml, handle = self._nvml
            return {"sm_mhz": float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
                    "mem_mhz": float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)),
                    "power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                    "temperature_c": float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))}
        done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(QUERY)}", "--format=csv,noheader,nounits",
                               "-i", self.device], capture_output=True, text=True, timeout=10, check=True)
        return parse_nvidia_smi(done.stdout.splitlines()[0] if done.stdout else "")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append({"t": time.perf_counter(), **self.read()})
            except Exception as exc:  # noqa: BLE001 - a failed reading is recorded, the timings go on
                if len(self._errors) < 5:
                    self._errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(self.interval_s)

    def __enter__(self) -> Sampler:
        if self.source is not None:
            self._thread = threading.Thread(target=self._loop, name="gpu-telemetry", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def summary(self, start: float, end: float) -> dict[str, Any] | None:
        """The samples taken in ``[start, end]`` (``time.perf_counter`` seconds): their count and each
        field's min, median and max; the first sample after ``end`` when none fell inside
        (``after: true``); None when nothing was sampled."""
        inside = [s for s in self.samples if start <= s["t"] <= end]
        after = False
        if not inside:
            later = [s for s in self.samples if s["t"] > end]
            if not later:
                return None
            inside, after = later[:1], True
        out: dict[str, Any] = {"samples": len(inside), "after": after}
        for name in FIELDS:
            values = [s[name] for s in inside if s[name] is not None]
            out[name] = ({"min": min(values), "median": statistics.median(values), "max": max(values)}
                         if values else None)
        return out

    def record(self) -> dict[str, Any]:
        """``smoke.json``'s ``telemetry``: the source (or why absent), the interval, every sample
        (times relative to the first) and the failed readings."""
        t0 = self.samples[0]["t"] if self.samples else 0.0
        return {"source": self.source, "reason": self.reason, "interval_s": self.interval_s, "device": self.device,
                "samples": [{**s, "t": round(s["t"] - t0, 6)} for s in self.samples], "errors": list(self._errors)}


__all__ = ["FIELDS", "QUERY", "Sampler", "TelemetryError", "parse_nvidia_smi"]
