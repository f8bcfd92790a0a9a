"""The TP x CP logprob comparison campaign: plan the matrix, run one topology per torchrun.

Plan (prints the torchrun commands, writes ``plan.json``)::

    python rl_engine/testing/distributed_logprob_comparison.py --plan --device cpu --dtype bf16 \\
        --backend pytorch-vocab-parallel-logp-ws2 --real-vocab 151936 --padded-vocab 151936 \\
        --num-vocab-tiles 64 --batch 2 --seq 16 --prompt-tokens 8 --seed 123 --output DIR/plan.json

The plan holds, in the order TP=1/2/4 x CP=1/2 unless ``--topologies`` (a matrix: at least
two, as the cross-topology check compares them) or ``--tp`` and ``--cp`` (one topology)
says otherwise, one entry per topology: its report path ``DIR/tp<T>-cp<C>.json``,
the ``argv`` that runs it and the equivalent ``torchrun --standalone --nproc-per-node=<T*C>``
``command``. Running that command (or ``python -m rl_engine launch --plan DIR/plan.json
--tp T --cp C``) writes the report. Anything that makes a plan impossible is refused at
plan time, and the same checks run again on every rank before any collective.

What a run does, per rank: regenerate the inputs (:mod:`rl_engine.testing.inputs`), take
its rows (CP layout) and columns (TP shard), dispatch the explicitly requested backend,
compute selected logprob, LSE and entropy and the gradient of the sum of active logprob
w.r.t. its local logits. Rank 0 gathers every rank's results, checks that the TP peers of
every CP group produced the same bytes, reassembles the tensors in global token and
vocabulary order, computes drift against the FP32 oracle (gating) and the FP64 oracle
(recorded only), and writes the raw ``<stem>.{logp,lse,entropy}.f32`` files and then the
report, each atomically. The report is validated against ``schemas/report.schema.json``
before anything is written.

Acceptance (``passed``): every rank materialised the requested backend without fallback,
outputs are byte-identical within every TP group, and LSE (all rows) and selected logprob
(active rows) are within ``atol + rtol * |ref|`` of the FP32 oracle. Default tolerances:
bf16 atol 0.05, fp16 0.005, fp32 1e-5, rtol 0 (``--atol``/``--rtol`` override).

Exit codes of :func:`main` (each rank's process):

* ``0``: the report was written and passed;
* ``1``: the report was written and failed acceptance (it is kept, with its ``failures``);
* ``2``: no valid report could be produced (the error is on stderr; no file is left at the
  output path: rank 0 removes stale outputs first and writes atomically, report last).

``torchrun`` folds any non-zero worker exit code into its own exit code 1; ``python -m
rl_engine launch`` restores the distinction from the artifacts (and uses 124 for its time
limit). ``RL_ENGINE_FAULT`` injects failures for tests (:mod:`rl_engine.testing.faults`).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run as a script: import the rl_engine this file belongs to, not another installed copy,
    # so the code that runs is the code the plan's command points at.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import argparse
import platform
import socket
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from rl_engine import jsonio, schemas
from rl_engine.distributed.mesh import LaunchEnv, MeshError, ParallelDims, destroy, init_mesh
from rl_engine.logprob.portable import SPEC_VERSION
from rl_engine.logprob.comparison import ComparisonError, drift_failures, oracle_drift
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.oracle import fp32_oracle
from rl_engine.logprob.registry import dispatch
from rl_engine.tensorio import DTYPE_NAMES, fingerprint, write_raw
from rl_engine.testing.campaign import (
    CP_LAYOUTS,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TOPOLOGIES,
    DEVICE_DIST_BACKENDS,
    DTYPES,
    SCHEMA_VERSION,
    Case,
    PlanError,
    build_plan,
    check_matrix,
    parse_topologies,
)
from rl_engine.testing.faults import Fault, FaultError, fault_from_env
from rl_engine.testing.inputs import inputs_sha256, make_inputs
from rl_engine.testing.nodes import node_name

EXIT_PASSED = 0
EXIT_FAILED = 1
EXIT_NO_REPORT = 2
TENSOR_NAMES: tuple[str, ...] = ("logp", "lse", "entropy")
MERGE_ORDER = (
    "per-tile FP32 (max, sum exp) with a fixed pairwise fold inside each tile; tiles merged "
    "in global tile order with the same fold, identically on every rank"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="distributed_logprob_comparison.py",
        description="Plan (--plan) or run (under torchrun) the TP x CP logprob comparison.",
    )
    p.add_argument("--plan", action="store_true", help="write plan.json and print the commands")
    p.add_argument("--device", required=True, choices=sorted(DEVICE_DIST_BACKENDS))
    p.add_argument("--dist-backend", choices=sorted(set(DEVICE_DIST_BACKENDS.values())),
                   help="default: gloo on cpu, nccl on cuda")
    p.add_argument("--dtype", required=True, choices=DTYPES)
    p.add_argument("--backend", required=True, help="explicit backend id ('auto' is refused)")
    p.add_argument("--real-vocab", type=int, required=True)
    p.add_argument("--padded-vocab", type=int, required=True)
    p.add_argument("--num-vocab-tiles", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--prompt-tokens", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--tp", type=int, help="TP degree (a run needs it; with --cp plans one topology)")
    p.add_argument("--cp", type=int, help="CP degree (a run needs it; with --tp plans one topology)")
    p.add_argument("--topologies", help="plan only: <TP>x<CP>,... at least 2 (default 1x1,1x2,2x1,2x2,4x1,4x2)")
    p.add_argument("--cp-layout", default="contiguous", choices=CP_LAYOUTS)
    p.add_argument("--logit-scale", type=float, default=1.0)
    p.add_argument("--atol", type=float, help="default: bf16 0.05, fp16 0.005, fp32 1e-5")
    p.add_argument("--rtol", type=float, help="default 0")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                   help="process-group timeout in seconds (a lost rank fails the run)")
    p.add_argument("--output", required=True, help="plan.json (with --plan) or tp<T>-cp<C>.json")
    return p


def case_from_args(args: argparse.Namespace) -> Case:
    return Case.create(
        device=args.device, dist_backend=args.dist_backend, dtype=args.dtype, backend=args.backend,
        real_vocab=args.real_vocab, padded_vocab=args.padded_vocab,
        num_vocab_tiles=args.num_vocab_tiles, batch=args.batch, seq=args.seq,
        prompt_tokens=args.prompt_tokens, seed=args.seed, cp_layout=args.cp_layout,
        logit_scale=args.logit_scale, atol=args.atol, rtol=args.rtol,
        threads_per_rank=args.threads_per_rank, timeout_s=args.timeout_s,
    )


# ----- plan ---------------------------------------------------------------------------------
def plan_topologies(args: argparse.Namespace) -> tuple[tuple[int, int], ...]:
    if args.topologies is not None:
        if args.tp is not None or args.cp is not None:
            raise PlanError("give either --topologies or --tp/--cp, not both")
        topologies = parse_topologies(args.topologies)
        check_matrix(topologies)  # a matrix is what the cross-topology check compares
        return topologies
    if (args.tp is None) != (args.cp is None):
        raise PlanError("--tp and --cp plan one topology together; give both or neither")
    if args.tp is not None:
        return ((args.tp, args.cp),)
    return DEFAULT_TOPOLOGIES


def write_plan(args: argparse.Namespace, case: Case) -> int:
    plan = build_plan(case, plan_topologies(args), args.output)
    try:
        schemas.write_validated(args.output, plan, "plan")
    except schemas.ArtifactSchemaError as exc:
        raise PlanError(str(exc)) from None
    print(f"# plan {plan['case_id']}: {len(plan['topologies'])} topologies -> {args.output}")
    for entry in plan["topologies"]:
        print(entry["command"])
    return EXIT_PASSED


# ----- one rank -----------------------------------------------------------------------------
def output_paths(output: str) -> tuple[Path, dict[str, Path]]:
    report = Path(output)
    if report.suffix != ".json":
        raise PlanError(f"--output={output!r} must name the report, a .json file (tp<T>-cp<C>.json)")
    return report, {name: report.with_name(f"{report.stem}.{name}.f32") for name in TENSOR_NAMES}


def remove_outputs(output: str) -> None:
    """Remove a topology's report and raw tensors, so a failed run leaves nothing stale."""
    report, tensors = output_paths(output)
    for path in (report, *tensors.values()):
        path.unlink(missing_ok=True)


def rank_contract(case: Case, tp: int, cp: int, tp_rank: int, cp_rank: int) -> LogprobContract:
    return LogprobContract(
        real_vocab_size=case.real_vocab,
        padded_vocab_size=case.padded_vocab,
        num_vocab_tiles=case.num_vocab_tiles,
        num_sequences=case.batch,
        seq_len=case.seq,
        tp_world_size=tp,
        tp_rank=tp_rank,
        cp_world_size=cp,
        cp_rank=cp_rank,
        cp_layout=case.cp_layout,
        logits_dtype=case.dtype,
    )


def compute_rank(
    case: Case, tp: int, cp: int, rank: int, tp_rank: int, cp_rank: int, group: Any, device: torch.device
) -> dict[str, Any]:
    """This rank's local results (CPU tensors) and provenance, ready to gather on rank 0."""
    contract = rank_contract(case, tp, cp, tp_rank, cp_rank)
    selected = dispatch(case.backend, contract, device.type)
    logits_fp32, targets, active = make_inputs(case)
    rows = torch.tensor(contract.token_indices, dtype=torch.int64)
    local = logits_fp32[rows, contract.vocab_start : contract.vocab_end]
    local = local.to(device=device, dtype=contract.torch_dtype).contiguous().requires_grad_(True)
    start = time.perf_counter()
    out = selected.op(
        local, targets[rows].to(device), active[rows].to(device), contract,
        group=group, compute_entropy=True,
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    forward_s = time.perf_counter() - start
    start = time.perf_counter()
    out.selected_logp.backward(torch.ones_like(out.selected_logp))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    backward_s = time.perf_counter() - start
    assert local.grad is not None and out.entropy is not None
    tensors = {
        "logp": out.selected_logp.detach().cpu(),
        "lse": out.lse.detach().cpu(),
        "entropy": out.entropy.detach().cpu(),
    }
    return {
        "rank": rank,
        "tp_rank": tp_rank,
        "cp_rank": cp_rank,
        "node": node_name(),
        "token_indices": list(contract.token_indices),
        "vocab_bounds": [contract.vocab_start, contract.vocab_end],
        "requested_backend": selected.requested_backend,
        "actual_backend": selected.actual_backend,
        "fallback": selected.fallback,
        "rejections": [list(pair) for pair in selected.rejections],
        "contract_fingerprint": contract.cross_rank_fingerprint(),
        "tile_width": contract.tile_width,
        "tensors": tensors,
        "fingerprints": {name: fingerprint(t) for name, t in tensors.items()},
        "grad": local.grad.detach().cpu(),
        "forward_s": forward_s,
        "backward_s": backward_s,
    }


# ----- rank 0: aggregate, judge, report -----------------------------------------------------
def tp_replication_failures(results: list[dict[str, Any]]) -> list[str]:
    """Byte comparison of every TP group's outputs; one message per disagreeing group."""
    failures = []
    for cp_rank in sorted({r["cp_rank"] for r in results}):
        group = sorted((r for r in results if r["cp_rank"] == cp_rank), key=lambda r: r["tp_rank"])
        for name in TENSOR_NAMES:
            seen = {r["fingerprints"][name] for r in group}
            if len(seen) != 1:
                per_rank = {r["rank"]: r["fingerprints"][name][:16] for r in group}
                failures.append(
                    f"tp_outputs_bitwise_replicated: {name} differs within the TP group of "
                    f"cp_rank={cp_rank} (per global rank: {per_rank})"
                )
    return failures


def assemble(results: list[dict[str, Any]], case: Case) -> dict[str, torch.Tensor]:
    """Reassemble logp/lse/entropy (global token order) and the full gradient (+vocab order).

    Outputs come from TP rank 0 of each CP group (its peers are compared byte for byte
    separately). Every token must be covered by exactly one CP rank and every column of
    every token by exactly one TP rank, or this raises.
    """
    n = case.batch * case.seq
    dtype = LogprobContract(case.real_vocab, case.padded_vocab, case.num_vocab_tiles, 1, 1,
                            logits_dtype=case.dtype).torch_dtype
    out = {name: torch.zeros(n, dtype=torch.float32) for name in TENSOR_NAMES}
    grad = torch.zeros(n, case.padded_vocab, dtype=dtype)
    row_cover = torch.zeros(n, dtype=torch.int64)
    col_cover = torch.zeros(n, case.padded_vocab, dtype=torch.int8)
    for r in results:
        idx = torch.tensor(r["token_indices"], dtype=torch.int64)
        start, end = r["vocab_bounds"]
        grad[idx, start:end] = r["grad"]
        col_cover[idx, start:end] += 1
        if r["tp_rank"] == 0:
            for name in TENSOR_NAMES:
                out[name][idx] = r["tensors"][name]
            row_cover[idx] += 1
    if not bool((row_cover == 1).all()) or not bool((col_cover == 1).all()):
        raise ComparisonError(
            "reassembly does not cover every token exactly once by CP and every column exactly "
            "once by TP; the rank layout is inconsistent"
        )
    out["grad"] = grad
    return out


def perturb(
    logp: torch.Tensor, logits_fp32: torch.Tensor, targets: torch.Tensor, active: torch.Tensor, case: Case
) -> int:
    """The ``perturb`` fault: move the first active token's logp out of tolerance; its index."""
    token = int(active.nonzero()[0, 0])
    ref = fp32_oracle(logits_fp32[token : token + 1], targets[token : token + 1],
                      active[token : token + 1], case.real_vocab).selected_logp[0]
    delta = 1e-3 + 2.0 * (case.atol + case.rtol * abs(float(ref)))
    logp[token] = logp[token] + delta
    return token


def build_report(
    case: Case,
    tp: int,
    cp: int,
    output: str,
    results: list[dict[str, Any]],
    fault: Fault | None,
    timings: dict[str, float],
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Rank 0: the report's JSON and the tensors to write next to it."""
    results = sorted(results, key=lambda r: r["rank"])
    start = time.perf_counter()
    failures: list[str] = []
    for r in results:
        if r["actual_backend"] != case.backend or r["fallback"] or r["requested_backend"] != case.backend:
            failures.append(
                f"backend: rank {r['rank']} requested {r['requested_backend']!r} and materialised "
                f"{r['actual_backend']!r} (fallback={r['fallback']}); expected {case.backend!r} "
                "without fallback"
            )
    if len({r["contract_fingerprint"] for r in results}) != 1:
        failures.append("contract: ranks disagree on the contract fingerprint")
    tp_failures = tp_replication_failures(results)
    failures += tp_failures
    tensors = assemble(results, case)
    logits_fp32, targets, active = make_inputs(case)
    if fault is not None and fault.kind == "perturb" and fault.applies(tp, cp):
        perturb(tensors["logp"], logits_fp32, targets, active, case)
    drift = oracle_drift(tensors["logp"], tensors["lse"], logits_fp32, targets, active,
                         case.real_vocab, case.dtype, case.atol, case.rtol)
    failures += drift_failures(drift)
    timings = {**timings, "oracle_s": time.perf_counter() - start}
    n = case.batch * case.seq
    _, tensor_files = output_paths(output)
    fingerprints = {name: fingerprint(tensors[name]) for name in TENSOR_NAMES}
    rank0 = results[0]
    report = {
        "schema_version": SCHEMA_VERSION,
        "case_id": case.case_id,
        "case": {**case.to_dict(), "tp": tp, "cp": cp},
        "launch_command": case.launch_command(tp, cp, output),
        "passed": not failures,
        "failures": failures,
        "requested_backend": case.backend,
        "actual_backend": rank0["actual_backend"],
        "arithmetic_spec": SPEC_VERSION,
        "fallback": any(r["fallback"] for r in results),
        "tp_outputs_bitwise_replicated": not tp_failures,
        "bitwise_fingerprints": {
            "dtype": "float32",
            "shape": [n],
            "candidate_logp_sha256": fingerprints["logp"],
            "candidate_lse_sha256": fingerprints["lse"],
            "candidate_entropy_sha256": fingerprints["entropy"],
            "candidate_grad_sha256": fingerprint(tensors["grad"]),
            "grad_dtype": DTYPE_NAMES[tensors["grad"].dtype],
            "grad_shape": list(tensors["grad"].shape),
        },
        "tensors": {
            name: {"path": tensor_files[name].name, "sha256": fingerprints[name],
                   "dtype": "float32", "shape": [n]}
            for name in TENSOR_NAMES
        },
        "inputs_sha256": inputs_sha256(logits_fp32, targets, active),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": case.device,
            "dist_backend": case.dist_backend,
            "world_size": tp * cp,
            "threads_per_rank": case.threads_per_rank,
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
        },
        "topology": {
            "tp": tp,
            "cp": cp,
            "world_size": tp * cp,
            "cp_layout": case.cp_layout,
            "nnodes": len({r["node"] for r in results}),
            "ranks": [
                {key: r[key] for key in ("rank", "tp_rank", "cp_rank", "node", "token_indices", "vocab_bounds",
                                         "actual_backend", "fallback", "contract_fingerprint")}
                for r in results
            ],
        },
        "reduction": {
            "num_vocab_tiles": case.num_vocab_tiles,
            "tile_width": rank0["tile_width"],
            "merge_order": MERGE_ORDER,
            "transport": (
                f"one {case.dist_backend} all_gather per call of every TP rank's tile partials "
                "and owned target logits within the TP group (transport only, nothing summed); "
                "rank 0 gathers outputs for reassembly"
            ),
        },
        "dispatch": {"rejections": [{"backend": b, "reason": why} for b, why in rank0["rejections"]]},
        "timings": {**timings, "total_s": timings["total_s"] + timings["oracle_s"]},
        "drift": drift,
        "fault_injection": None if fault is None else fault.text,
    }
    return report, {name: tensors[name] for name in TENSOR_NAMES}


def write_report(output: str, report: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Validate, then write the raw tensors and finally the report, each atomically."""
    try:
        schemas.require_valid(report, "report", what=output)
    except schemas.ArtifactSchemaError as exc:
        raise ComparisonError(str(exc)) from None
    _, tensor_files = output_paths(output)
    try:
        for name, path in tensor_files.items():
            digest = write_raw(path, tensors[name])
            if digest != report["tensors"][name]["sha256"]:
                raise ComparisonError(f"{path}: written bytes hash to {digest}, not the fingerprint")
        jsonio.write_json(output, report)
    except BaseException:
        remove_outputs(output)
        raise


def run_topology(args: argparse.Namespace, case: Case) -> int:
    """One rank of one topology under torchrun; rank 0 writes the report."""
    start = time.perf_counter()
    if args.topologies is not None:
        raise PlanError("--topologies is for --plan; a run takes --tp and --cp")
    if args.tp is None or args.cp is None:
        raise PlanError("a run needs --tp and --cp (or --plan to write a plan)")
    tp, cp = args.tp, args.cp
    case.check_topology(tp, cp)
    output_paths(args.output)
    fault = fault_from_env()
    launch = LaunchEnv.from_environ()
    ParallelDims(dp=1, cp=cp, tp=tp, world_size=launch.world_size)  # before any collective
    if launch.rank == 0:
        remove_outputs(args.output)
    torch.set_num_threads(case.threads_per_rank)
    mesh = init_mesh(tp=tp, cp=cp, device=case.device, timeout_s=case.timeout_s)
    try:
        dist.barrier()
        if fault is not None:
            fault.trigger_after_mesh(tp, cp, mesh.rank, node_name(), launch.local_rank)
        setup_s = time.perf_counter() - start
        result = compute_rank(case, tp, cp, mesh.rank, mesh.tp_rank, mesh.cp_rank, mesh.tp_group, mesh.device)
        gathered: list[Any] | None = [None] * (tp * cp) if mesh.rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if mesh.rank != 0:
            return EXIT_PASSED
        assert gathered is not None
        timings = {
            "setup_s": setup_s,
            "forward_s": max(r["forward_s"] for r in gathered),
            "backward_s": max(r["backward_s"] for r in gathered),
            "total_s": time.perf_counter() - start,
        }
        report, tensors = build_report(case, tp, cp, args.output, gathered, fault, timings)
        write_report(args.output, report, tensors)
        verdict = "passed" if report["passed"] else "FAILED: " + "; ".join(report["failures"])
        print(f"tp{tp}-cp{cp}: {verdict} -> {args.output}")
        return EXIT_PASSED if report["passed"] else EXIT_FAILED
    finally:
        destroy()


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_NO_REPORT
    try:
        case = case_from_args(args)
        if args.plan:
            return write_plan(args, case)
        return run_topology(args, case)
    except (PlanError, FaultError, MeshError, LogprobContractError, ComparisonError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NO_REPORT
    except Exception:  # noqa: BLE001 - any other failure: no valid report, say why
        traceback.print_exc()
        print("error: no valid report was produced", file=sys.stderr)
        return EXIT_NO_REPORT


if __name__ == "__main__":
    sys.exit(main())
