"""``python -m rl_engine bench`` (:mod:`rl_engine.benchmark`) at tiny sizes: document shape, ratios
from the same run's rows, memory probe that sees real allocations, TP mode under torchrun with
every path, one input maker for both modes, refusal of bad flags.

No timing thresholds: times on a shared machine say nothing about correctness. What is
checked is that every reported ratio is the quotient of the rows it names, and that the
memory numbers come from allocations that are known to happen.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest

from rl_engine import jsonio, schemas
from rl_engine.benchmark import cli, paths, report
from rl_engine.benchmark.config import PATHS, PHASES, BenchConfig, BenchError
from rl_engine.benchmark.inputs import make_inputs
from rl_engine.benchmark.report import FUSED_TARGETS, TARGETS
from rl_engine.tensorio import tensor_bytes

from _head_products import products_counted

SMALL = ["--vocab", "512", "--tiles", "4", "--repeats", "2", "--warmup", "1", "--threads", "2"]


def _run(tmp_path: Path, name: str, *flags: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    assert cli.main([*flags, "--output", str(out)]) == 0
    doc = jsonio.load(out)
    assert schemas.errors(doc, "bench") == []
    return doc


def _ratios_from_rows(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Independent recomputation: candidate over naive and floor, per tokens and phase."""
    by = {(r["path"], r["phase"], r["tokens"]): r for r in rows}
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for (path, phase, tokens), row in by.items():
        if path != "candidate":
            continue
        entry: dict[str, float | None] = {}
        for other in ("naive", "floor"):
            ref = by[(other, phase, tokens)]
            entry[f"time_vs_{other}"] = row["median_s"] / ref["median_s"]
            mem, ref_mem = row["peak_mem_bytes"], ref["peak_mem_bytes"]
            entry[f"peak_mem_vs_{other}"] = (
                None if mem is None or ref_mem is None or ref_mem == 0 else mem / ref_mem
            )
        out.setdefault(str(tokens), {})[phase] = entry
    return out


@pytest.fixture(scope="module")
def timing_doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("bench"), "timing", "--tokens", "8", "24", "--no-memory", *SMALL)


def test_rows_cover_every_path_phase_and_size(timing_doc: dict[str, Any]) -> None:
    doc = timing_doc
    assert doc["mode"] == "tp1" and doc["threads"] == 2 and doc["config"]["threads"] == 2
    keys = sorted((r["path"], r["phase"], r["tokens"]) for r in doc["rows"])
    assert keys == sorted((p, ph, n) for p in paths.default_paths() for ph in PHASES for n in (8, 24))
    assert "triton" in PATHS and "triton" not in paths.default_paths()  # asked for by name on the cpu
    for r in doc["rows"]:
        assert (r["vocab"], r["dtype"], r["repeats"]) == (512, "bf16", 2)
        assert len(r["times_s"]) == 2 and r["median_s"] == sum(r["times_s"]) / 2
        assert r["min_s"] == min(r["times_s"]) and r["peak_mem_bytes"] is None


def test_ratios_are_the_quotients_of_this_runs_rows(timing_doc: dict[str, Any]) -> None:
    doc = timing_doc
    assert doc["ratios"] == _ratios_from_rows(doc["rows"])
    assert set(doc["ratios"]) == {"8", "24"}
    # negative control: a row from another run (one median changed) no longer matches
    other = copy.deepcopy(doc["rows"])
    naive = next(r for r in other if (r["path"], r["phase"], r["tokens"]) == ("naive", "forward", 24))
    naive["median_s"] *= 1.5
    assert _ratios_from_rows(other) != doc["ratios"]
    assert report.compute_ratios(other) != doc["ratios"]


def _fused_ratios_from_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Independent recomputation: fused over naive, floor and the eager candidate."""
    by = {(r["path"], r["phase"], r["tokens"]): r for r in rows}
    out: dict[str, Any] = {}
    for (path, phase, tokens), row in by.items():
        if path != "fused":
            continue
        entry: dict[str, float | None] = {}
        for other in ("naive", "floor", "candidate"):
            ref = by[(other, phase, tokens)]
            entry[f"time_vs_{other}"] = row["median_s"] / ref["median_s"]
            mem, ref_mem = row["peak_mem_bytes"], ref["peak_mem_bytes"]
            entry[f"peak_mem_vs_{other}"] = (
                None if mem is None or ref_mem is None or ref_mem == 0 else mem / ref_mem
            )
        out.setdefault(str(tokens), {})[phase] = entry
    return {"fused": out}


def test_every_available_backend_has_rows_and_its_ratios(timing_doc: dict[str, Any]) -> None:
    doc = timing_doc
    assert doc["backends"] == {"candidate": "pytorch-vocab-parallel-logp-ws2",
                               "fused": "cpu-vocab-parallel-logp-ws2"}
    assert {r["path"] for r in doc["rows"]} == {"candidate", "fused", "naive", "floor"}
    assert doc["path_ratios"] == _fused_ratios_from_rows(doc["rows"])


def test_an_unavailable_fused_kernel_is_left_out_by_default_and_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rl_engine.logprob.backends.fused_cpu import fused_cpu

    monkeypatch.setattr(fused_cpu, "kernel_unavailable", lambda: "the compiled module is not built")
    assert paths.default_paths() == ("candidate", "naive", "floor")
    with pytest.raises(BenchError, match="paths contains 'fused' but backend cpu-vocab-parallel-logp-ws2 "
                                         "is unavailable here: the compiled module is not built"):
        BenchConfig(tokens=(8,), vocab=512, tiles=4, paths=("fused", "floor"))


def test_targets_are_read_from_the_ratios(timing_doc: dict[str, Any]) -> None:
    doc = timing_doc
    assert len(doc["targets"]) == 2 * (len(TARGETS) + len(FUSED_TARGETS))
    for t in doc["targets"]:
        if t["path"] == "fused":
            value = doc["path_ratios"]["fused"][str(t["tokens"])][t["phase"]][t["ratio"]]
        else:
            value = doc["ratios"][str(t["tokens"])][t["phase"]][t["ratio"]]
        assert t["value"] == value
        assert t["met"] == (None if value is None else value <= t["limit"])
    memory = [t for t in doc["targets"] if t["ratio"].startswith("peak_mem")]
    assert memory and all(t["met"] is None for t in memory)  # --no-memory: not measured, not "met"


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
def test_memory_probe_sees_the_naive_paths_fp32_copies(tmp_path: Path) -> None:
    """Two paths (each probe is a fresh Python that imports torch): the naive one and a backend's; the
    ratios of every path are checked on the timing run's rows, the memory ratios here."""
    tokens, vocab = 64, 16384
    doc = _run(tmp_path, "memory", "--tokens", str(tokens), "--vocab", str(vocab), "--tiles", "8",
               "--repeats", "1", "--warmup", "0", "--threads", "2", "--paths", "naive", "fused")
    peaks = {(r["path"], r["phase"]): r["peak_mem_bytes"] for r in doc["rows"]}
    assert set(peaks) == {(p, ph) for p in ("naive", "fused") for ph in PHASES}
    assert all(isinstance(v, int) and v >= 0 for v in peaks.values())
    fp32_logits = tokens * vocab * 4
    # naive forward holds logits.float() and log_softmax's FP32 output at once
    assert peaks[("naive", "forward")] >= 2 * fp32_logits * 0.95
    # naive forward+backward also builds FP32 gradients on top of its saved output
    assert peaks[("naive", "forward_backward")] > peaks[("naive", "forward")]
    # every forward+backward returns a gradient of the logits (bf16): it is counted
    assert peaks[("fused", "forward_backward")] >= tokens * vocab * 2 * 0.95
    rows = {(r["path"], r["phase"]): r for r in doc["rows"]}
    for phase in PHASES:  # the memory ratios are the quotients of this run's peaks
        got, ref = rows[("fused", phase)], rows[("naive", phase)]
        assert doc["path_ratios"]["fused"][str(tokens)][phase] == {
            "time_vs_naive": got["median_s"] / ref["median_s"],
            "peak_mem_vs_naive": got["peak_mem_bytes"] / ref["peak_mem_bytes"]}
    assert doc["memory_method"] and "fresh subprocess" in doc["memory_method"]


def _tp_ratios_from_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Independent recomputation: per TP degree, the slowest rank's median of every path, then
    every backend over naive and floor (and fused over the eager candidate)."""
    slowest: dict[tuple[int, str, str, int], float] = {}
    for r in rows:
        key = (r["tp"], r["path"], r["phase"], r["tokens"])
        slowest[key] = max(slowest.get(key, 0.0), r["median_s"])
    out: dict[str, Any] = {}
    for (tp, path, phase, tokens), median in slowest.items():
        if path not in ("candidate", "fused"):
            continue
        others = ("naive", "floor") if path == "candidate" else ("naive", "floor", "candidate")
        entry: dict[str, float | None] = {}
        for other in others:
            entry[f"time_vs_{other}"] = median / slowest[(tp, other, phase, tokens)]
            entry[f"peak_mem_vs_{other}"] = None
        tables = out.setdefault(str(tp), {"ratios": {}, "path_ratios": {}})
        table = tables["ratios"] if path == "candidate" else tables["path_ratios"].setdefault(path, {})
        table.setdefault(str(tokens), {})[phase] = entry
    return out


@pytest.fixture(scope="module")
def tp_doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("bench-tp"), "tp", "--tp", "2", "--tokens", "8", *SMALL)


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
def test_tp_mode_under_torchrun_reports_every_rank(tp_doc: dict[str, Any]) -> None:
    doc = tp_doc
    assert doc["mode"] == "tp" and doc["config"]["tp"] == [2]
    keys = sorted((r["tp"], r["rank"], r["path"], r["phase"]) for r in doc["rows"])
    assert keys == sorted((2, rank, p, ph) for rank in (0, 1) for p in paths.default_paths() for ph in PHASES)
    for r in doc["rows"]:
        assert r["local_vocab"] == 256 and r["threads_per_rank"] == 1
        assert len(r["comm_s"]) == r["repeats"] == 2
        assert 0 <= r["comm_median_s"] <= r["median_s"]
        assert r["comm_share"] == r["comm_median_s"] / r["median_s"]
        assert all(math.isfinite(t) and t > 0 for t in r["times_s"])
    # the floor reads its shard without a collective; every other path all-gathers or all-reduces
    assert all((r["comm_median_s"] == 0) == (r["path"] == "floor") for r in doc["rows"])


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
def test_tp_mode_times_the_fused_and_eager_backends_against_this_runs_baselines(
    tp_doc: dict[str, Any],
) -> None:
    doc = tp_doc
    assert doc["backends"] == {"candidate": "pytorch-vocab-parallel-logp-ws2",
                               "fused": "cpu-vocab-parallel-logp-ws2"}
    assert {"candidate", "fused"} <= {r["path"] for r in doc["rows"]}
    assert doc["tp_ratios"] == _tp_ratios_from_rows(doc["rows"])
    values = [v for t in doc["tp_ratios"].values() for v in _leaves(t) if v is not None]
    assert values and all(math.isfinite(v) and v > 0 for v in values)
    assert set(doc["tp_ratios"]["2"]["path_ratios"]["fused"]["8"]["forward"]) >= {
        "time_vs_naive", "time_vs_floor", "time_vs_candidate"}
    assert doc["ratios"] == {} and doc["targets"] == []  # the targets are TP=1's
    # negative control: one rank slower in a copy changes the recomputation
    other = copy.deepcopy(doc["rows"])
    next(r for r in other if r["path"] == "naive" and r["rank"] == 1)["median_s"] *= 10
    assert report.compute_tp_ratios(other) != doc["tp_ratios"]


def _leaves(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [leaf for value in node.values() for leaf in _leaves(value)]
    return [node]


def test_a_tp_shard_holds_the_columns_of_the_logits_tp1_sees() -> None:
    full = make_inputs(300, 512, "bf16", 7)  # more rows than one block: the cut is per block
    for start, stop in ((0, 256), (256, 512), (128, 384)):
        shard = make_inputs(300, 512, "bf16", 7, columns=(start, stop))
        assert shard.logits.shape == (300, stop - start)
        assert tensor_bytes(shard.logits) == tensor_bytes(full.logits[:, start:stop].contiguous())
        assert tensor_bytes(shard.targets) == tensor_bytes(full.targets) and bool(shard.active.all())
    with pytest.raises(BenchError, match=r"columns=\(256, 600\) must satisfy"):
        make_inputs(8, 512, "bf16", 7, columns=(256, 600))


def test_the_tp_baseline_check_refuses_a_naive_path_that_computes_something_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rl_engine.benchmark import tp

    config = BenchConfig(tokens=(8,), vocab=512, tiles=4, threads=1)
    inputs = make_inputs(8, 512, "bf16", 0)
    tp.check_naive(inputs, config, config.contract(8), None)  # the real naive path agrees
    real = paths._naive_logp
    monkeypatch.setattr(paths, "_naive_logp", lambda *a: real(*a) * 1.01)
    with pytest.raises(BenchError, match="the naive path's logprob differs from the candidate's"):
        tp.check_naive(inputs, config, config.contract(8), None)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--tokens", "8", "--tiles", "5"], "tiles=5 does not divide vocab=512"),
        (["--tokens", "8", "8"], "repeats a count"),
        (["--tokens", "0"], "tokens contains 0"),
        (["--tokens", "8", "--repeats", "0"], "repeats=0 must be a positive integer"),
        (["--tokens", "8", "--chunk-rows", "0"], "chunk_rows=0 must be >= 1"),
        (["--tokens", "8", "--tp", "3"], "tp degree 3 must be >= 1 and divide tiles=4"),
    ],
)
def test_bad_flags_are_refused_with_the_field_named(
    flags: list[str], needle: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    base = ["--vocab", "512", "--tiles", "4"]
    out = tmp_path / "never.json"
    assert cli.main([*base, *flags, "--output", str(out)]) == 2
    assert needle in capsys.readouterr().err
    assert not out.exists()


def test_config_refuses_unknown_paths() -> None:
    with pytest.raises(BenchError, match=r"paths=\['fast'\] must be a non-empty subset"):
        BenchConfig(tokens=(8,), vocab=512, tiles=4, paths=("fast",))


def test_a_size_that_does_not_fit_in_free_memory_is_refused_up_front(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rl_engine.benchmark import memory

    config = BenchConfig(tokens=(8192,), vocab=151936, tiles=64)
    monkeypatch.setattr(memory, "mem_available", lambda: 12 * 2**30)
    with pytest.raises(BenchError, match=r"tokens=8192 .* needs about 17\.9 GiB .* MemAvailable is 12\.0 GiB"):
        memory.check_memory_headroom(8192, config)
    memory.check_memory_headroom(8192, BenchConfig(tokens=(8192,), paths=("candidate", "floor")))
    monkeypatch.setattr(memory, "mem_available", lambda: 20 * 2**30)
    memory.check_memory_headroom(8192, config)  # enough: no error


# ----- the Triton path: on the cpu only under Triton's interpreter, asked for by name -----
TRITON_FLAGS = ["--tokens", "4", "--no-memory", "--repeats", "1", "--warmup", "0", "--vocab", "512",
                "--tiles", "4", "--threads", "2"]


def test_the_triton_path_runs_under_the_interpreter_and_is_recorded_as_such(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("RL_ENGINE_TRITON_MODE", "interpreter")
    assert "triton" not in paths.default_paths()  # even with the interpreter chosen: by name only
    doc = _run(tmp_path, "triton", *TRITON_FLAGS, "--paths", "candidate", "triton", "naive", "floor")
    assert doc["config"]["triton_mode"] == "interpreter" and doc["config"]["device"] == "cpu"
    assert doc["backends"]["triton"] == "triton-vocab-parallel-logp-ws2"
    assert {(r["path"], r["phase"]) for r in doc["rows"] if r["path"] == "triton"} == {
        ("triton", phase) for phase in PHASES}
    by = {(r["path"], r["phase"]): r for r in doc["rows"]}
    for phase in PHASES:  # its ratios are the quotients of this run's rows
        entry = doc["path_ratios"]["triton"]["4"][phase]
        for other in ("naive", "floor", "candidate"):
            assert entry[f"time_vs_{other}"] == by[("triton", phase)]["median_s"] / by[(other, phase)]["median_s"]
    # negative control: the same document saying it ran compiled kernels on the cpu is refused
    bad = copy.deepcopy(doc)
    bad["config"]["device"] = "tpu"
    assert schemas.errors(bad, "bench") != []


def test_the_triton_path_on_the_cpu_without_the_interpreter_is_refused_naming_the_fix(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.delenv("RL_ENGINE_TRITON_MODE", raising=False)
    out = tmp_path / "never.json"
    assert cli.main([*TRITON_FLAGS, "--paths", "triton", "floor", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert ("paths contains 'triton' on device='cpu' but the backend runs in compiled mode, which serves "
            "cuda; set RL_ENGINE_TRITON_MODE=interpreter") in err, err
    assert not out.exists()
    monkeypatch.setenv("RL_ENGINE_TRITON_MODE", "interpreter")  # the TP mode runs the cpu backends only
    with pytest.raises(BenchError, match=r"paths contains 'triton' with tp=\[2\]"):
        BenchConfig(tokens=(4,), vocab=512, tiles=4, paths=("triton", "floor"), tp=(2,))


def test_cuda_is_refused_where_there_is_none_and_its_unsupported_combinations_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(BenchError, match=r"device='cuda' but torch.cuda.is_available\(\) is False"):
            BenchConfig(tokens=(4,), vocab=512, tiles=4, paths=("naive",), device="cuda", memory=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the checks that follow, in order
    for fields, needle in (({"paths": ("fused", "naive")}, "runs on the cpu only"),
                           ({"paths": ("naive",), "memory": True}, "pass --no-memory"),
                           ({"paths": ("naive",), "tp": (2,)}, "the TP mode runs on the cpu")):
        with pytest.raises(BenchError, match=needle):
            BenchConfig(**{"tokens": (4,), "vocab": 512, "tiles": 4, "device": "cuda", "memory": False, **fields})
    with pytest.raises(BenchError, match=r"device='tpu' is not one of \['cpu', 'cuda'\]"):
        BenchConfig(tokens=(4,), vocab=512, tiles=4, paths=("naive",), device="tpu")


def test_on_a_gpu_the_clock_waits_for_the_kernels_before_it_starts_and_stops() -> None:
    from rl_engine.benchmark.timing import time_round_robin

    events: list[str] = []
    steps = {"a": (lambda: events.append("step"), lambda: None)}
    times, _ = time_round_robin(steps, warmup=1, repeats=2, sync=lambda: events.append("sync"))
    assert len(times["a"]) == 2
    assert events == ["step", "sync", "step", "sync", "sync", "step", "sync"]  # warm-up unsynced


def test_each_sample_starts_after_a_collection_and_the_heap_is_unfrozen_after() -> None:
    """The collection before each sample frees the cyclic garbage of the step before (the objects
    alive when timing began are frozen: the collection traverses only the steps' own); the freeze
    ends with the timing, also when a step raises."""
    import gc
    import weakref

    from rl_engine.benchmark.timing import time_round_robin

    class Cycle:
        pass

    made: list[weakref.ref[Cycle]] = []
    alive_at_start: list[bool] = []
    alive_after_step: list[bool] = []

    def step() -> None:
        alive_at_start.append(bool(made) and made[-1]() is not None)
        cycle = Cycle()
        cycle.self = cycle  # type: ignore[attr-defined]  # freed by the collector only
        made.append(weakref.ref(cycle))

    def reset() -> None:
        alive_after_step.append(made[-1]() is not None)

    assert gc.get_freeze_count() == 0
    gc.disable()  # no automatic collection between a step and its reset: only the loop's own
    try:
        time_round_robin({"a": (step, reset), "b": (step, reset)}, warmup=1, repeats=3)
    finally:
        gc.enable()
    assert gc.get_freeze_count() == 0
    assert alive_at_start[2:] == [False] * 6  # each sample: the previous step's cycle was collected
    assert all(alive_after_step)  # control: until the collection, the cycle lives

    def failing() -> None:
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        time_round_robin({"a": (failing, lambda: None)}, warmup=0, repeats=1)
    assert gc.get_freeze_count() == 0


@pytest.mark.slow  # four memory-probe subprocesses
def test_the_fused_head_is_measured_against_the_logits_made_whole(tmp_path: Path) -> None:
    """``lm_head`` (hidden @ weight.T, then the op) and ``fused_lm_head`` (selected_logprob_from_hidden,
    256 tokens at a time): rows, ratios from this run's rows, the head targets, and a memory probe
    that sees the whole logits only in the materialised path (1024 x 16384 bf16: 32 MiB). The forward
    phase only (each probe is a fresh Python): the memory test above probes both phases."""
    tokens, vocab = 1024, 16384
    doc = _run(tmp_path, "head", "--tokens", str(tokens), "--vocab", str(vocab), "--tiles", "8", "--repeats", "1",
               "--warmup", "0", "--threads", "2", "--paths", "lm_head", "fused_lm_head", "--hidden-size", "64",
               "--phases", "forward")
    rows = {(r["path"], r["phase"]): r for r in doc["rows"]}
    assert set(rows) == {(p, "forward") for p in ("lm_head", "fused_lm_head")}
    logits = tokens * vocab * 2
    assert rows[("lm_head", "forward")]["peak_mem_bytes"] >= logits * 0.95
    # The whole logits would put the fused path at 1.0 or more; its chunks (256 of 1024 tokens) and
    # the allocator's arenas of two threads measured 0.34 of them on a quiet machine and 0.59 on a
    # loaded one (RSS moves in the kernel's pages, huge ones included): the bound sits between.
    assert rows[("fused_lm_head", "forward")]["peak_mem_bytes"] < logits * 0.75
    got, ref = rows[("fused_lm_head", "forward")], rows[("lm_head", "forward")]
    assert doc["path_ratios"]["fused_lm_head"][str(tokens)] == {"forward": {
        "time_vs_lm_head": got["median_s"] / ref["median_s"],
        "peak_mem_vs_lm_head": got["peak_mem_bytes"] / ref["peak_mem_bytes"]}}
    names = {t["target"] for t in doc["targets"] if t["path"] == "fused_lm_head"}
    assert names == {name for name, *_ in report.HEAD_TARGETS}
    assert doc["config"]["hidden_size"] == 64


def test_the_head_paths_need_a_hidden_size_and_a_hidden_size_needs_them() -> None:
    with pytest.raises(BenchError, match=r"paths contains \['fused_lm_head'\] but hidden_size=None; pass --hidden-size"):
        BenchConfig(tokens=(8,), vocab=512, tiles=4, paths=("fused_lm_head",))
    with pytest.raises(BenchError, match="hidden_size=64 is given but no path uses it"):
        BenchConfig(tokens=(8,), vocab=512, tiles=4, paths=("candidate",), hidden_size=64)
    assert not {"lm_head", "fused_lm_head"} & set(paths.default_paths())


def test_the_naive_head_is_what_a_trainer_writes_and_the_fused_head_s_ratio_is_taken_against_it() -> None:
    """``naive_lm_head``: ``log_softmax((hidden @ weight.T).float()).gather`` with autograd (its bytes
    and its gradients are torch's own, computed here again); ``fused_lm_head``'s ratios name it."""
    import torch

    config = BenchConfig(tokens=(8,), vocab=512, tiles=4, dtype="fp32", paths=("naive_lm_head", "fused_lm_head"),
                         hidden_size=16)
    inputs = make_inputs(8, 512, "fp32", 7, hidden_size=16)
    forward, _ = paths.build_step("naive_lm_head", "forward", inputs, config)
    h, w = inputs.hidden.clone().requires_grad_(True), inputs.weight.clone().requires_grad_(True)
    want = torch.log_softmax(h @ w.T, dim=-1).gather(1, inputs.targets.unsqueeze(1)).squeeze(1)
    assert tensor_bytes(forward()) == tensor_bytes(want.detach())
    both, _ = paths.build_step("naive_lm_head", "forward_backward", inputs, config)
    want.sum().backward()
    assert [tensor_bytes(g) for g in both()] == [tensor_bytes(h.grad), tensor_bytes(w.grad)]
    rows = [{"path": p, "phase": "forward", "tokens": 8, "median_s": t, "peak_mem_bytes": None}
            for p, t in (("naive_lm_head", 2.0), ("fused_lm_head", 1.5))]
    ratios = report.compute_path_ratios(rows)["fused_lm_head"]["8"]["forward"]
    assert ratios["time_vs_naive_lm_head"] == 0.75
    names = {t["target"]: t["met"] for t in report.evaluate_targets({}, {"fused_lm_head": {"8": {"forward": ratios}}})}
    assert names["fused lm_head forward time <= 1.2x naive lm_head"] is True


def test_the_kept_head_path_keeps_the_logits_and_its_ratios_name_naive_and_the_recomputing_head() -> None:
    """``fused_lm_head_kept``: ``selected_logprob_from_hidden(..., keep_logits=True)``, the gradients the
    bytes of ``fused_lm_head``'s; its ratios are taken against ``naive_lm_head``, ``fused_lm_head`` (and
    ``lm_head``), and its two targets are within 1.2x of the naive head."""
    config = BenchConfig(tokens=(8,), vocab=512, tiles=4, dtype="fp32",
                         paths=("naive_lm_head", "fused_lm_head", "fused_lm_head_kept"), hidden_size=16)
    inputs = make_inputs(8, 512, "fp32", 7, hidden_size=16)
    found, products = {}, {}
    for path in ("fused_lm_head", "fused_lm_head_kept"):
        step, _ = paths.build_step(path, "forward_backward", inputs, config)
        with products_counted() as calls:
            found[path] = [tensor_bytes(g) for g in step()]
        products[path] = len(calls)
    assert found["fused_lm_head_kept"] == found["fused_lm_head"]
    assert products == {"fused_lm_head": 2, "fused_lm_head_kept": 1}  # one chunk: forward (+ backward's again)
    rows = [{"path": p, "phase": "forward_backward", "tokens": 8, "median_s": t, "peak_mem_bytes": None}
            for p, t in (("naive_lm_head", 2.0), ("fused_lm_head", 3.0), ("fused_lm_head_kept", 1.5))]
    ratios = report.compute_path_ratios(rows)["fused_lm_head_kept"]["8"]["forward_backward"]
    assert ratios["time_vs_naive_lm_head"] == 0.75 and ratios["time_vs_fused_lm_head"] == 0.5
    targets = report.evaluate_targets({}, {"fused_lm_head_kept": {"8": {"forward_backward": ratios}}})
    met = {t["target"]: t["met"] for t in targets if t["path"] == "fused_lm_head_kept"}
    assert met == {"kept fused lm_head forward time <= 1.2x naive lm_head": None,
                   "kept fused lm_head forward+backward time <= 1.2x naive lm_head": True}
