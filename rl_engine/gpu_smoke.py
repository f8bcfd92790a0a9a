"""``python -m rl_engine gpu-smoke``: portable bits on a GPU, in one command.

1. Runs the campaign of ``config.yaml`` (``--config``) with ``device: cuda``: a plan and one
   ``launch`` per topology that fits the machine's GPUs (TP x CP ranks, one GPU each; the
   topologies that do not fit are listed as skipped), once per campaign backend (``--backends``;
   on cuda by default the Triton backend ``triton-vocab-parallel-logp-ws2`` and the eager
   ``pytorch-vocab-parallel-logp-ws2``; on the CPU the config's backend), then the
   cross-topology check of each run.
2. Runs the same case on the CPU: a single-process replay (TP=1, CP=1) with every backend
   available on the CPU (``pytorch-vocab-parallel-logp-ws2`` and, where its kernel loads,
   ``cpu-vocab-parallel-logp-ws2``).
3. Requires that every device report's four fingerprints (logp, LSE, entropy, gradient)
   equal every CPU replay's: the promise of ``docs/arithmetic.md`` (the same bytes on any
   IEEE-754 device). Then the Triton backend's bitwise table (``smoke.json``'s ``bitwise``):
   logp, LSE, entropy and gradient of the Triton backend on the device (compiled kernels on
   cuda; Triton's interpreter on CPU tensors with ``--cpu-only``) against the fused CPU
   backend's bytes (the eager one where the C kernel does not load), at bf16, fp16 and fp32 and
   T = 1 and 0.7, on ``--bitwise-tokens`` tokens of the case's vocabulary; a difference fails.
4. Times ``forward`` (``no_grad``) and ``forward_backward`` (median of ``--repeats`` after one
   warm-up, device synchronised, nothing freed between repeats) of every backend available on
   the device (the Triton backend also with the entropy, and without validation), of ``naive``
   (``log_softmax(logits.float()).gather`` with autograd), of the read ``floor`` (forward:
   ``logits.amax(-1)`` in the logits' own dtype, a reduction that reads each byte once and
   writes one value a row; forward+backward: that and the copy floor) and of the ``copy_floor``
   (``out.copy_(logits)`` into a buffer made once: one read and one write of the logits' bytes,
   what a backward that writes a gradient must at least move) at ``--tokens`` tokens (default
   8192) of the case's vocabulary and dtype, with each path's peak device memory above the
   inputs (CUDA: ``torch.cuda.max_memory_allocated``; null on the CPU) and its ratios to the
   floor and to naive from the same run.
5. On cuda, the paper model beside the measurement: the roofline of the Triton backend's
   kernels for this case at ``--tokens`` tokens, compiled for the GPU's architecture as Triton
   compiles them at launch and read from their SASS (:func:`rl_engine.logprob.backends.triton.triton_aot.roofline`,
   its cubins under ``<output-dir>/roofline/``), and its predicted forward and
   forward+backward times (H100 SXM or H200 figures, by the device's name) beside the measured
   medians of the Triton backend and of the floor (``smoke.json``'s ``roofline``; ``null`` on
   the CPU, with the reason).

``--cpu-only`` does all of it with ``device: cpu`` (gloo ranks instead of GPUs, the Triton
kernels under the interpreter, no roofline): the dry run the test suite runs
(``tests/test_gpu_smoke.py``). Writes ``<output-dir>/smoke.json`` (checked against
``schemas/smoke.schema.json`` first, strict JSON; a document that does not match is not written)
and prints a summary. Exit codes: 0 every fingerprint equal; 1 a difference, a failed topology
(named on stderr) or a document that does not match its schema; 2 the smoke cannot start (no
CUDA without ``--cpu-only``, a bad config).

Usage on a GPU machine (CUDA build of torch installed, then ``pip install -e .``)::

    python -m rl_engine gpu-smoke --output-dir results/gpu-smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rl_engine import jsonio, schemas
from rl_engine.arith.tiles import chunk_rows_for_device
from rl_engine.campaign.case import Case, CaseError
from rl_engine.campaign.plan import build_plan
from rl_engine.campaign.replay import replay_candidate
from rl_engine.evidence.crosscheck import crosscheck_run
from rl_engine.logprob.backends.eager.vocab_parallel import BACKEND_ID
from rl_engine.logprob.registry import BackendUnavailableError, default_registry, dispatch
from rl_engine.rundir import LOGS, PLAN, Run, Topology
from rl_engine.tables import BENCH_PHASES, DEVICE_DIST_BACKENDS, EAGER_BACKEND, SCHEMA_VERSION, TRITON_BACKEND
from rl_engine.verb_parsers import gpu_smoke_parser as build_parser
from rl_engine.workflow import WorkflowConfigError, case_values, config_topologies, load_config

FIELDS = ("candidate_logp_sha256", "candidate_lse_sha256", "candidate_entropy_sha256",
          "candidate_grad_sha256")
EXIT_OK, EXIT_DIFFERS, EXIT_CANNOT_START = 0, 1, 2


class SmokeError(RuntimeError):
    """The smoke cannot start; the message says why and what to do."""


CUDA_CAMPAIGN_BACKENDS: tuple[str, ...] = (TRITON_BACKEND, EAGER_BACKEND)


def _device_case(config: dict[str, Any], device: str, backend: str | None = None) -> Case:
    values = case_values(config)
    values["device"] = device
    values["dist_backend"] = DEVICE_DIST_BACKENDS[device]
    if backend is not None:
        values["backend"] = backend
    devices = default_registry()[values["backend"]].capabilities.devices
    if backend is None and device not in devices:
        values["backend"] = BACKEND_ID  # e.g. the fused CPU backend in config.yaml: eager on cuda
    return Case.create(**values)


def campaign_backends(config: dict[str, Any], device: str, requested: str | None) -> list[str]:
    """The backends whose campaign the smoke runs: ``--backends`` (comma separated), else on
    cuda the Triton and the eager backend, on the CPU the config's backend."""
    if requested:
        names = [b.strip() for b in requested.split(",") if b.strip()]
        unknown = [b for b in names if b not in default_registry()]
        if unknown or not names or len(set(names)) != len(names):
            raise SmokeError(f"--backends={requested!r}: list registered backend ids once each, "
                             f"comma separated, from {list(default_registry())}")
        return names
    if device == "cuda":
        return list(CUDA_CAMPAIGN_BACKENDS)
    return [_device_case(config, device).backend]


def _fitting(config: dict[str, Any], max_ranks: int | None) -> tuple[list[tuple[int, int]], list[str]]:
    pairs = [(t.tp, t.cp) for t in config_topologies(config)]
    if max_ranks is None:
        return pairs, []
    fit = [(tp, cp) for tp, cp in pairs if tp * cp <= max_ranks]
    skipped = [f"{tp}x{cp}" for tp, cp in pairs if tp * cp > max_ranks]
    return fit, skipped


def run_device_campaign(case: Case, topologies: list[tuple[int, int]], run_dir: Path,
                        timeout_s: int) -> dict[str, Any]:
    """Plan and launch every topology; return each report (or the failure) by label."""
    (run_dir / LOGS).mkdir(parents=True, exist_ok=True)
    plan_path = run_dir / PLAN
    plan = build_plan(case, tuple(topologies), str(plan_path))
    schemas.write_validated(plan_path, plan, "plan")
    results: dict[str, Any] = {}
    for tp, cp in topologies:
        topology = Topology(tp, cp)
        label, log = topology.stem, run_dir / topology.log
        done = subprocess.run(
            [sys.executable, "-m", "rl_engine", "launch", "--plan", str(plan_path), "--tp", str(tp),
             "--cp", str(cp), "--timeout-s", str(timeout_s), "--log", str(log)],
            capture_output=True, text=True, timeout=timeout_s + 60, check=False,
        )
        report_path = run_dir / topology.report
        if done.returncode != 0 or not report_path.exists():
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else done.stderr[-2000:]
            results[label] = {"exit_code": done.returncode, "error": tail}
        else:
            results[label] = jsonio.loads(report_path.read_text(encoding="utf-8"))
    return results


def cpu_replays(case: Case) -> dict[str, dict[str, str]]:
    """The case at TP=1, CP=1 on the CPU, once per backend available on the CPU."""
    out: dict[str, dict[str, str]] = {}
    for backend_id, spec in default_registry().items():
        if "cpu" not in spec.capabilities.devices or spec.availability() is not None:
            continue
        replay = replay_candidate({**case.to_dict(), "backend": backend_id})
        out[backend_id] = replay.fingerprints()
    return out


PHASES: tuple[str, ...] = BENCH_PHASES


def _naive(logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
    return torch.where(active, logp, torch.zeros_like(logp))


def time_paths(case: Case, device: torch.device, tokens: int, repeats: int) -> list[dict[str, Any]]:
    """Forward and forward+backward time and peak memory of every backend available on
    ``device``, of naive and of the floor, with ratios from this run."""
    from rl_engine.benchmark.inputs import make_inputs

    inputs = make_inputs(tokens, case.padded_vocab, case.dtype, case.seed)
    logits = inputs.logits.to(device)
    targets = inputs.targets.clamp(max=case.real_vocab - 1).to(device)
    active = inputs.active.to(device)
    contract = case.contract(num_sequences=1, seq_len=tokens)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def timed(step: Any, phase: str) -> tuple[list[float], int | None]:
        samples = []
        peak = None
        for i in range(repeats + 1):  # nothing freed between repeats: the allocator's steady state
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            sync()
            start = time.perf_counter()
            if phase == "forward":
                with torch.no_grad():
                    step(logits)
            else:
                x = logits.detach().requires_grad_(True)
                out = step(x)
                if out is not None:
                    out.sum().backward()
            sync()
            if i:  # the first call warms up (and compiles)
                samples.append(time.perf_counter() - start)
            if cuda:
                used = torch.cuda.max_memory_allocated(device) - base
                peak = used if peak is None else max(peak, used)
        return samples, peak

    def backend_step(op: Any, entropy: bool, validate: bool) -> Any:
        def step(x: torch.Tensor) -> torch.Tensor:
            out = op(x, targets, active, contract, compute_entropy=entropy, validate=validate)
            return out.selected_logp if out.entropy is None else out.selected_logp + out.entropy
        return step

    copy_out = torch.empty_like(logits)

    def floor_step(x: torch.Tensor) -> None:  # one read of every byte, one value a row written
        x.detach().amax(dim=-1)
        return None

    def copy_step(x: torch.Tensor) -> None:  # one read and one write of every byte
        copy_out.copy_(x.detach())
        return None

    def floor_backward_step(x: torch.Tensor) -> None:  # the forward's read, then the copy
        floor_step(x)
        copy_step(x)
        return None

    paths: list[tuple[str, str | None, Any]] = []
    rows: list[dict[str, Any]] = []
    for backend_id in default_registry():
        try:
            op = dispatch(backend_id, contract, device.type).op
        except BackendUnavailableError as exc:
            rows.append({"path": backend_id, "skipped": str(exc)})
            continue
        paths.append((backend_id, "default", backend_step(op, False, True)))
        if backend_id == TRITON_BACKEND:  # the GPU path: the roofline's case and the fastest call too
            paths.append((backend_id, "entropy", backend_step(op, True, True)))
            paths.append((backend_id, "no_validation", backend_step(op, False, False)))
    paths.append(("naive", None, lambda x: _naive(x, targets, active)))
    timed_rows: list[dict[str, Any]] = []
    for phase in PHASES:
        floors = [("floor", None, floor_step if phase == "forward" else floor_backward_step),
                  ("copy_floor", None, copy_step)]
        for path, variant, step in paths + floors:
            samples, peak = timed(step, phase)
            row: dict[str, Any] = {"path": path, "phase": phase, "median_s": statistics.median(samples),
                                   "times_s": samples, "peak_bytes": peak}
            if variant is not None:
                row["variant"] = variant
            if path in default_registry():
                row["chunk_rows"] = chunk_rows_for_device(case.padded_vocab, device)
            timed_rows.append(row)
    for row in timed_rows:
        same = {r["path"]: r for r in timed_rows if r["phase"] == row["phase"] and r.get("variant") in (None, "default")}
        floor, naive = same["floor"], same["naive"]
        row["time_vs_floor"] = row["median_s"] / floor["median_s"] if floor["median_s"] > 0 else None
        row["time_vs_naive"] = row["median_s"] / naive["median_s"] if naive["median_s"] > 0 else None
        row["memory_vs_naive"] = (row["peak_bytes"] / naive["peak_bytes"]
                                  if row["peak_bytes"] is not None and naive["peak_bytes"] else None)
    return rows + timed_rows


BITWISE_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
BITWISE_TEMPERATURES: tuple[float, ...] = (1.0, 0.7)
BITWISE_OUTPUTS: tuple[str, ...] = ("logp", "lse", "entropy", "grad")


def _bitwise_bytes(op: Any, logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor,
                   contract: Any) -> dict[str, str]:
    """SHA-256 of logp, LSE, entropy and the gradient of a fixed weighting of the three."""
    from rl_engine.tensorio import fingerprint

    x = logits.detach().clone().requires_grad_(True)
    out = op(x, targets, active, contract, compute_entropy=True)
    rows = x.shape[0]
    weights = [torch.linspace(-1.0, 1.0, rows, device=x.device) * k for k in (1.0, 0.5, 0.25)]
    (grad,) = torch.autograd.grad((out.selected_logp, out.lse, out.entropy), x, weights)
    found = {"logp": out.selected_logp, "lse": out.lse, "entropy": out.entropy, "grad": grad}
    return {name: fingerprint(found[name].detach().cpu()) for name in BITWISE_OUTPUTS}


def bitwise_checks(case: Case, device: str, tokens: int) -> dict[str, Any]:
    """The Triton backend on ``device`` against the fused CPU bytes, per dtype and temperature.

    On cuda the compiled kernels; on the CPU (``--cpu-only``) the same kernel source under
    Triton's interpreter. The reference is the fused CPU backend, or the eager one where its C
    kernel does not load (named in ``reference``). Nothing is skipped on cuda: a Triton that
    does not load there is a failure (``reason``)."""
    from rl_engine.benchmark.inputs import make_inputs
    from rl_engine.logprob.backends.triton.triton_backend import TritonLogprob, triton_unavailable
    from rl_engine.tables import FUSED_CPU_BACKEND

    mode = "compiled" if device == "cuda" else "interpreter"
    why = triton_unavailable(mode)
    reference = FUSED_CPU_BACKEND if default_registry()[FUSED_CPU_BACKEND].availability() is None else EAGER_BACKEND
    result: dict[str, Any] = {"backend": TRITON_BACKEND, "mode": mode, "reference": reference, "tokens": tokens,
                              "rows": [], "reason": why}
    if why is not None:
        return result
    op = TritonLogprob(mode=mode)
    for dtype in BITWISE_DTYPES:
        inputs = make_inputs(tokens, case.padded_vocab, dtype, case.seed)
        targets = inputs.targets.clamp(max=case.real_vocab - 1)
        for temperature in BITWISE_TEMPERATURES:
            contract = dataclasses.replace(case, dtype=dtype, temperature=temperature).contract(
                num_sequences=1, seq_len=tokens)
            ref_op = dispatch(reference, contract, "cpu").op
            want = _bitwise_bytes(ref_op, inputs.logits, targets, inputs.active, contract)
            got = _bitwise_bytes(op, inputs.logits.to(device), targets.to(device), inputs.active.to(device),
                                 contract)
            result["rows"].append({"dtype": dtype, "temperature": temperature, "device_sha256": got,
                                   "reference_sha256": want,
                                   "equal": {k: got[k] == want[k] for k in BITWISE_OUTPUTS}})
    return result


GPU_MODELS = {"H200": "h200", "H100": "h100"}


def gpu_model(name: str) -> str | None:
    """The roofline model (``h100``/``h200``) of a CUDA device name, or None for another GPU."""
    return next((model for key, model in GPU_MODELS.items() if key in name.upper()), None)


def roofline_table(case: Case, device: str, tokens: int, timing: list[dict[str, Any]],
                   out_dir: Path) -> dict[str, Any]:
    """``smoke.json``'s ``roofline``: the predicted times of the Triton kernels next to the measured
    ones (cuda), or why there is none."""
    if device != "cuda":
        return {"rows": [], "reason": "no GPU: the roofline predicts a GPU's time (--cpu-only run)"}
    from rl_engine.logprob.backends.triton import triton_aot

    name = torch.cuda.get_device_name(0)
    model = gpu_model(name)
    major, minor = torch.cuda.get_device_capability(0)
    try:
        doc = triton_aot.roofline(out_dir / "roofline", arch=10 * major + minor, rows=tokens,
                                  case=(case.real_vocab, case.padded_vocab, case.num_vocab_tiles),
                                  dtype={"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[case.dtype])
    except Exception as exc:  # noqa: BLE001 - the prediction is an addition; say why it is missing
        return {"rows": [], "reason": f"the roofline could not be computed: {type(exc).__name__}: {exc}"}
    schemas.write_validated(out_dir / "roofline" / "roofline.json", doc, "roofline")
    gpus = [model] if model else ["h100", "h200"]
    rows = [dict(row, model=gpu) for gpu in gpus
            for row in triton_aot.predicted_vs_measured(doc, timing, gpu, TRITON_BACKEND)]
    reason = None if model else f"{name} is neither an H100 nor an H200: both models are shown"
    return {"rows": rows, "reason": reason, "arch": f"sm_{10 * major + minor}",
            "instructions_per_column": doc["instructions_per_column"]}


def smoke(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    config = load_config(args.config)
    device = "cpu" if args.cpu_only else "cuda"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SmokeError("CUDA is not available on this machine (torch "
                             f"{torch.__version__}); install a CUDA build of torch, or pass --cpu-only")
        max_ranks = args.max_ranks or torch.cuda.device_count()
    else:
        max_ranks = args.max_ranks
    backends = campaign_backends(config, device, args.backends)
    cases = {backend: _device_case(config, device, backend) for backend in backends}
    case = cases[backends[0]]
    topologies, skipped = _fitting(config, max_ranks)
    if not topologies:
        raise SmokeError(f"no topology of {config['topologies']} fits {max_ranks} rank(s); "
                         "add a 1x1 topology to the config or use a machine with more GPUs")
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    device_prints: dict[str, dict[str, dict[str, str]]] = {}
    for backend, backend_case in cases.items():
        print(f"[1/4] campaign on {device} with {backend}: "
              f"{', '.join(f'{tp}x{cp}' for tp, cp in topologies)}"
              + (f" (skipped, too few devices: {', '.join(skipped)})" if skipped else ""))
        run_dir = out_dir / f"campaign-{device}-{backend}"
        reports = run_device_campaign(backend_case, topologies, run_dir, args.timeout_s)
        prints_of: dict[str, dict[str, str]] = {}
        for label, report in reports.items():
            if "error" in report:
                problems.append(f"{device} {backend} campaign {label}: exit code {report['exit_code']}: "
                                f"{report['error'][-500:]}")
                continue
            if report.get("passed") is not True:
                problems.append(f"{device} {backend} campaign {label}: passed={report.get('passed')}: "
                                f"{report.get('failures')}")
            prints_of[label] = {k: report["bitwise_fingerprints"][k] for k in FIELDS}
        device_prints[backend] = prints_of
        _cross, cross_found = crosscheck_run(Run.load(run_dir), min_topologies=1)
        problems += [f"{device} {backend} campaign crosscheck: {f}" for f in cross_found]
    cpu_replays_result = cpu_replays(case)
    cpu_backends = list(cpu_replays_result)
    print(f"[2/4] the same case on the CPU (TP=1, CP=1): {', '.join(cpu_backends)}")
    for backend, prints_of in device_prints.items():
        for label, prints in prints_of.items():
            for backend_id, cpu in cpu_replays_result.items():
                for key in FIELDS:
                    if prints[key] != cpu[key]:
                        problems.append(f"{device} {backend} {label} {key} {prints[key]} differs from "
                                        f"the CPU replay with {backend_id}: {cpu[key]}")
    print(f"[3/4] the Triton backend on {device} against the CPU bytes: {', '.join(BITWISE_DTYPES)} x "
          f"T = {', '.join(map(str, BITWISE_TEMPERATURES))} at {args.bitwise_tokens} tokens")
    bitwise = bitwise_checks(case, device, args.bitwise_tokens)
    if bitwise["reason"] is not None:
        if device == "cuda":
            problems.append(f"bitwise: the Triton backend cannot run on cuda: {bitwise['reason']}")
        else:
            print(f"  skipped: {bitwise['reason']}")
    for row in bitwise["rows"]:
        for name, equal in row["equal"].items():
            if not equal:
                problems.append(f"bitwise: {TRITON_BACKEND} ({bitwise['mode']}) {row['dtype']} T={row['temperature']} "
                                f"{name} {row['device_sha256'][name]} differs from {bitwise['reference']}'s "
                                f"{row['reference_sha256'][name]}")
    print(f"[4/4] forward and forward+backward timing on {device} at {args.tokens} tokens")
    timing = time_paths(case, torch.device(device), args.tokens, args.repeats)
    roofline = roofline_table(case, device, args.tokens, timing, out_dir)
    result = {
        "schema_version": SCHEMA_VERSION,
        "device": device,
        "torch": torch.__version__,
        "cuda_device": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "case": case.to_dict(),
        "campaign_backends": backends,
        "topologies_run": [f"{tp}x{cp}" for tp, cp in topologies],
        "topologies_skipped": skipped,
        "device_fingerprints": device_prints,
        "cpu_fingerprints": cpu_replays_result,
        "cpu_backends": cpu_backends,
        "bitwise": bitwise,
        "timing": {"tokens": args.tokens, "repeats": args.repeats, "rows": timing},
        "roofline": roofline,
        "passed": not problems,
        "failures": problems,
    }
    schemas.write_validated(out_dir / "smoke.json", result, "smoke")  # checked, strict JSON, or nothing
    return result, problems


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    for name in ("tokens", "repeats", "timeout_s", "bitwise_tokens"):
        if getattr(args, name) < 1:
            print(f"gpu-smoke: --{name.replace('_', '-')}={getattr(args, name)} must be >= 1", file=sys.stderr)
            return EXIT_CANNOT_START
    try:
        result, problems = smoke(args)
    except (SmokeError, WorkflowConfigError, CaseError, OSError) as exc:
        print(f"gpu-smoke: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    except (schemas.ArtifactSchemaError, jsonio.StrictJSONError) as exc:
        print(f"gpu-smoke FAILED: smoke.json not written: {exc}", file=sys.stderr)
        return EXIT_DIFFERS
    for row in result["roofline"]["rows"]:
        print(f"  paper model ({row['model']}) {row['phase']:<16} predicted {row['predicted_ms']:.3f} ms, "
              f"measured {row['measured_ms']:.3f} ms ({row['measured_over_predicted']:.2f}x); floor predicted "
              f"{row['floor_predicted_ms']:.3f} ms, measured {row['floor_measured_ms']:.3f} ms")
    if result["roofline"].get("reason"):
        print(f"  paper model: {result['roofline']['reason']}")
    for row in result["timing"]["rows"]:
        if "median_s" in row:
            memory = "" if row["peak_bytes"] is None else f", peak {row['peak_bytes'] / 2**20:.0f} MiB"
            vs_floor = "n/a" if row["time_vs_floor"] is None else f"{row['time_vs_floor']:.2f}x"
            vs_naive = "n/a" if row["time_vs_naive"] is None else f"{row['time_vs_naive']:.2f}x"
            path = row["path"] + ("" if row.get("variant") in (None, "default") else f" ({row['variant']})")
            print(f"  {row['phase']:<16} {path:<34} {row['median_s']:.4f} s  "
                  f"({vs_floor} floor, {vs_naive} naive{memory})")
        else:
            print(f"  {row['path']:<34} skipped: {row['skipped']}")
    if problems:
        print(f"gpu-smoke FAILED ({len(problems)} problems):", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return EXIT_DIFFERS
    runs = sum(len(p) for p in result["device_fingerprints"].values())
    print(f"gpu-smoke passed: {runs} {result['device']} topology runs and "
          f"{len(result['cpu_fingerprints'])} CPU backends give identical fingerprints -> "
          f"{Path(args.output_dir) / 'smoke.json'}")
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
