"""The one report of both modes: rows, ratios, targets, provenance, the rich table and the
checked JSON document (``schemas/bench.schema.json``)."""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import asdict
from typing import Any

import torch

from rl_engine import schemas
from rl_engine.benchmark.config import BACKEND_PATHS, BenchConfig, BenchError
from rl_engine.benchmark.memory import MEMORY_METHOD
from rl_engine.logprob.backends.eager.vocab_parallel import BACKEND_ID
from rl_engine.record.environment import cpu_model
from rl_engine.tables import SCHEMA_VERSION

SCHEMA = "bench"
# The eager candidate's targets: (name, phase, ratio key, limit).
TARGETS: tuple[tuple[str, str, str, float], ...] = (
    ("forward time <= 0.5x naive", "forward", "time_vs_naive", 0.5),
    ("forward+backward time <= 0.5x naive", "forward_backward", "time_vs_naive", 0.5),
    ("forward peak memory <= 0.25x naive", "forward", "peak_mem_vs_naive", 0.25),
    ("forward+backward peak memory <= 0.25x naive", "forward_backward", "peak_mem_vs_naive", 0.25),
    ("moonshot: forward time <= 1.5x floor", "forward", "time_vs_floor", 1.5),
)
# The fused backend's targets (path "fused"): (name, phase, ratio key, limit).
FUSED_TARGETS: tuple[tuple[str, str, str, float], ...] = (
    ("fused forward time <= 1.5x floor", "forward", "time_vs_floor", 1.5),
    ("fused forward+backward time <= 1.5x floor", "forward_backward", "time_vs_floor", 1.5),
    ("fused forward peak memory <= eager's", "forward", "peak_mem_vs_candidate", 1.0),
    ("fused forward+backward peak memory <= eager's", "forward_backward", "peak_mem_vs_candidate", 1.0),
    ("moonshot: fused forward time <= 1.2x floor", "forward", "time_vs_floor", 1.2),
)


# The fused head (selected_logprob_from_hidden) against the logits made whole (path "lm_head").
HEAD_TARGETS: tuple[tuple[str, str, str, float], ...] = (
    ("fused lm_head forward peak memory <= 0.25x lm_head", "forward", "peak_mem_vs_lm_head", 0.25),
    ("fused lm_head forward+backward peak memory <= 0.25x lm_head", "forward_backward", "peak_mem_vs_lm_head", 0.25),
    ("fused lm_head forward time <= 1.2x lm_head", "forward", "time_vs_lm_head", 1.2),
    ("fused lm_head forward+backward time <= 1.2x lm_head", "forward_backward", "time_vs_lm_head", 1.2),
    ("fused lm_head forward time <= 1.2x naive lm_head", "forward", "time_vs_naive_lm_head", 1.2),
    ("fused lm_head forward+backward time <= 1.2x naive lm_head", "forward_backward", "time_vs_naive_lm_head", 1.2),
)
# The fused head keeping its forward's logits (keep_logits=True): within 1.2x of the naive head.
KEPT_HEAD_TARGETS: tuple[tuple[str, str, str, float], ...] = (
    ("kept fused lm_head forward time <= 1.2x naive lm_head", "forward", "time_vs_naive_lm_head", 1.2),
    ("kept fused lm_head forward+backward time <= 1.2x naive lm_head", "forward_backward",
     "time_vs_naive_lm_head", 1.2),
)
# The paths each other-than-candidate path is compared with, by path_ratios.
_RATIO_REFERENCES: dict[str, tuple[str, ...]] = {
    "fused_lm_head": ("lm_head", "naive_lm_head"),
    "fused_lm_head_kept": ("lm_head", "naive_lm_head", "fused_lm_head"),
}


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def compute_ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per tokens and phase: candidate time and peak memory over naive's and floor's.

    Computed from ``rows`` alone (a row per path, phase and tokens of one run).
    """
    index = {(r["path"], r["phase"], r["tokens"]): r for r in rows if r.get("tp", 1) == 1}
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for (path, phase, tokens), row in sorted(index.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        if path != "candidate":
            continue
        entry: dict[str, float | None] = {}
        for other in ("naive", "floor"):
            ref = index.get((other, phase, tokens))
            if ref is None:
                continue
            entry[f"time_vs_{other}"] = _ratio(row["median_s"], ref["median_s"])
            entry[f"peak_mem_vs_{other}"] = _ratio(row["peak_mem_bytes"], ref["peak_mem_bytes"])
        out.setdefault(str(tokens), {})[phase] = entry
    return out


def compute_path_ratios(
    rows: list[dict[str, Any]],
) -> dict[str, dict[str, dict[str, dict[str, float | None]]]]:
    """Per backend path other than ``candidate`` (``fused``), per tokens and phase: its time and
    peak memory over naive's, floor's and the eager candidate's, from ``rows`` alone."""
    index = {(r["path"], r["phase"], r["tokens"]): r for r in rows if r.get("tp", 1) == 1}
    out: dict[str, dict[str, dict[str, dict[str, float | None]]]] = {}
    for (path, phase, tokens), row in sorted(index.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        if path not in ("fused", "triton", "fused_lm_head", "fused_lm_head_kept", "processed"):
            continue
        entry: dict[str, float | None] = {}
        for other in _RATIO_REFERENCES.get(path, ("naive", "floor", "candidate")):
            ref = index.get((other, phase, tokens))
            if ref is None:
                continue
            entry[f"time_vs_{other}"] = _ratio(row["median_s"], ref["median_s"])
            entry[f"peak_mem_vs_{other}"] = _ratio(row["peak_mem_bytes"], ref["peak_mem_bytes"])
        out.setdefault(path, {}).setdefault(str(tokens), {})[phase] = entry
    return out


def group_rows(rows: list[dict[str, Any]], tp: int) -> list[dict[str, Any]]:
    """One row per (path, phase, tokens) of TP degree ``tp``: the slowest rank's (a TP group
    steps at the pace of its slowest rank)."""
    slowest: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in rows:
        if r.get("tp") != tp:
            continue
        key = (r["path"], r["phase"], r["tokens"])
        if key not in slowest or r["median_s"] > slowest[key]["median_s"]:
            slowest[key] = r
    return [{k: v for k, v in r.items() if k != "tp"} for r in slowest.values()]


def compute_tp_ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per TP degree: :func:`compute_ratios` and :func:`compute_path_ratios` of the slowest
    ranks' rows (:func:`group_rows`), all measured in this run."""
    out: dict[str, dict[str, Any]] = {}
    for tp in sorted({r["tp"] for r in rows if "tp" in r}):
        grouped = group_rows(rows, tp)
        out[str(tp)] = {"ratios": compute_ratios(grouped), "path_ratios": compute_path_ratios(grouped)}
    return out


def _targets_of(path: str, ratios: dict[str, dict[str, dict[str, float | None]]],
                table: tuple[tuple[str, str, str, float], ...]) -> list[dict[str, Any]]:
    out = []
    for tokens, phases in ratios.items():
        for name, phase, key, limit in table:
            value = phases.get(phase, {}).get(key)
            out.append({
                "target": name, "path": path, "tokens": int(tokens), "phase": phase, "ratio": key,
                "value": value, "limit": limit, "met": None if value is None else value <= limit,
            })
    return out


def evaluate_targets(
    ratios: dict[str, dict[str, dict[str, float | None]]],
    path_ratios: dict[str, dict[str, dict[str, dict[str, float | None]]]] | None = None,
) -> list[dict[str, Any]]:
    """The eager candidate's targets and the fused backend's, checked
    against the ratios of this run (``met`` null if not measured)."""
    out = _targets_of("candidate", ratios, TARGETS)
    if path_ratios and "fused" in path_ratios:
        out += _targets_of("fused", path_ratios["fused"], FUSED_TARGETS)
    if path_ratios and "fused_lm_head" in path_ratios:
        out += _targets_of("fused_lm_head", path_ratios["fused_lm_head"], HEAD_TARGETS)
    if path_ratios and "fused_lm_head_kept" in path_ratios:
        out += _targets_of("fused_lm_head_kept", path_ratios["fused_lm_head_kept"], KEPT_HEAD_TARGETS)
    return out


def machine() -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count() or 1,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def loadavg() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


def config_dict(config: BenchConfig) -> dict[str, Any]:
    out = asdict(config)
    out["tokens"] = list(config.tokens)
    out["paths"] = list(config.paths)
    out["phases"] = list(config.phases)
    out["tp"] = list(config.tp)
    out["chunk_rows"] = config.resolved_chunk_rows()
    out["triton_mode"] = config.triton_mode()
    return out


def timing_row(path: str, phase: str, tokens: int, config: BenchConfig, times: list[float],
               peak_mem_bytes: int | None) -> dict[str, Any]:
    """A row of either mode (the TP mode adds its rank's fields)."""
    return {
        "path": path, "phase": phase, "tokens": tokens, "vocab": config.vocab,
        "dtype": config.dtype, "median_s": statistics.median(times), "min_s": min(times),
        "times_s": times, "peak_mem_bytes": peak_mem_bytes, "repeats": len(times),
    }


def document(config: BenchConfig, mode: str, rows: list[dict[str, Any]],
             load_before: list[float]) -> dict[str, Any]:
    """The benchmark document of a run: its rows and what is computed from them alone."""
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "mode": mode,
        "backend": BACKEND_ID,
        "threads": config.threads,
        "config": config_dict(config),
        "machine": machine(),
        "loadavg": {"before": load_before, "after": loadavg()},
        "memory_method": None,
        "rows": rows,
        "ratios": {},
        "backends": {p: BACKEND_PATHS[p] for p in config.paths if p in BACKEND_PATHS},
        "targets": [],
    }
    if mode == "tp":
        doc["tp_ratios"] = compute_tp_ratios(rows)
    else:
        doc["memory_method"] = MEMORY_METHOD if config.memory else None
        doc["ratios"] = compute_ratios(rows)
        doc["path_ratios"] = compute_path_ratios(rows)
        doc["targets"] = evaluate_targets(doc["ratios"], doc["path_ratios"])
    return doc


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _fmt_mem(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def _entry(ratios: dict[str, Any], path_ratios: dict[str, Any], path: str, tokens: int,
           phase: str) -> dict[str, float | None]:
    table = ratios if path == "candidate" else path_ratios.get(path, {})
    return table.get(str(tokens), {}).get(phase, {})


def render_table(doc: dict[str, Any]) -> Any:
    """A rich table of the run (built from the document, so it shows what was written)."""
    from rich.table import Table

    backends = ", ".join(f"{p} = {b}" for p, b in doc.get("backends", {}).items()) or doc["backend"]
    if doc["mode"] == "tp":
        table = Table(title=f"{backends} under torchrun (gloo), slowest rank; vs naive (vocab-parallel) "
                            f"vs floor, {doc['config']['dtype']}, vocab {doc['config']['vocab']}, "
                            f"{doc['threads']} thread(s) in all")
        for col in ("tokens", "tp", "phase", "path", "median s", "comm share", "time / naive",
                    "time / floor", "time / eager"):
            table.add_column(col, justify="right")
        for tp, tables in doc["tp_ratios"].items():
            for r in group_rows(doc["rows"], int(tp)):
                is_backend = r["path"] in doc["backends"]
                entry = _entry(tables["ratios"], tables["path_ratios"], r["path"], r["tokens"], r["phase"])
                table.add_row(
                    str(r["tokens"]), tp, r["phase"], r["path"], f"{r['median_s']:.4f}",
                    f"{100 * r['comm_share']:.1f}%",
                    _fmt_ratio(entry.get("time_vs_naive")) if is_backend else "",
                    _fmt_ratio(entry.get("time_vs_floor")) if is_backend else "",
                    _fmt_ratio(entry.get("time_vs_candidate")) if r["path"] in ("fused", "triton") else "",
                )
        return table
    table = Table(title=f"{backends}; vs naive vs floor, {doc['config']['dtype']}, "
                        f"vocab {doc['config']['vocab']}, threads={doc['threads']}")
    for col in ("tokens", "phase", "path", "median s", "peak MiB", "time / naive", "time / floor",
                "mem / naive"):
        table.add_column(col, justify="right")
    for r in doc["rows"]:
        entry = _entry(doc["ratios"], doc.get("path_ratios", {}), r["path"], r["tokens"], r["phase"])
        is_cand = r["path"] in doc.get("backends", {"candidate": None})
        table.add_row(
            str(r["tokens"]), r["phase"], r["path"], f"{r['median_s']:.4f}",
            _fmt_mem(r["peak_mem_bytes"]),
            _fmt_ratio(entry.get("time_vs_naive")) if is_cand else "",
            _fmt_ratio(entry.get("time_vs_floor")) if is_cand else "",
            _fmt_ratio(entry.get("peak_mem_vs_naive")) if is_cand else "",
        )
    return table


def write_document(doc: dict[str, Any], output: str | None) -> None:
    try:
        if output:
            schemas.write_validated(output, doc, SCHEMA)
        else:
            schemas.require_valid(doc, SCHEMA, what="the benchmark document")
    except schemas.ArtifactSchemaError as exc:
        raise BenchError(str(exc)) from None
