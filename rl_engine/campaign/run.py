"""Run one topology of a plan: each torchrun rank of ``TP x CP``, rank 0 writes the report.

::

    torchrun --standalone --nproc-per-node=<T*C> -m rl_engine.campaign.run DIR/plan.json --tp T --cp C

(the command the plan holds for each topology; ``python -m rl_engine launch --plan DIR/plan.json
--tp T --cp C`` runs it with a time limit). The case comes from the plan
(:mod:`rl_engine.campaign.plan`), the report is written beside it as ``tp<T>-cp<C>.json``. The
case's rules and the topology's are checked again on every rank before any collective.

What a run does, per rank: regenerate the inputs (:mod:`rl_engine.campaign.inputs`) and take
its rows (CP layout) and columns (TP shard), or, on a capture (:mod:`rl_engine.campaign.captured`),
check the file's SHA-256 before any collective and read only its rows and columns; dispatch the explicitly requested backend,
compute selected logprob, LSE and entropy and the gradient of the sum of active logprob
w.r.t. its local logits. Rank 0 gathers every rank's results, checks that the TP peers of
every CP group produced the same bytes, reassembles the tensors in global token and
vocabulary order, computes drift against the FP32 oracle (gating) and the FP64 oracle
(recorded only), and writes the raw ``<stem>.{logp,lse,entropy}.f32`` files and then the
report, each atomically. The report is validated against ``schemas/report.schema.json``
before anything is written.

Acceptance (``passed``): every rank materialised the requested backend without fallback,
outputs are byte-identical within every TP group, and LSE (all rows) and selected logprob
(active rows) are within ``atol + rtol * |ref|`` of the FP32 oracle (the case's tolerance).

Exit codes of :func:`main` (each rank's process):

* ``0``: the report was written and passed;
* ``1``: the report was written and failed acceptance (it is kept, with its ``failures``);
* ``2``: no valid report could be produced (the error is on stderr; no file is left at the
  output path: rank 0 removes stale outputs first and writes atomically, report last).

``torchrun`` folds any non-zero worker exit code into its own exit code 1; ``python -m
rl_engine launch`` restores the distinction from the artifacts (and uses 124 for its time
limit). ``RL_ENGINE_FAULT`` injects failures for tests (:mod:`rl_engine.campaign.faults`).
"""

from __future__ import annotations

import platform
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_engine import jsonio, schemas
from rl_engine.arith.portable import SPEC_VERSION
from rl_engine.campaign.captured import (
    case_inputs,
    case_rank_inputs,
    case_row_sampling,
    check_file,
    require_sampling_tensors,
)
from rl_engine.campaign.case import Case, CaseError
from rl_engine.campaign.faults import Fault, FaultError, fault_from_env
from rl_engine.campaign.inputs import inputs_sha256
from rl_engine.campaign.mask import MASK_FIELD, pack_mask
from rl_engine.campaign.nodes import node_name
from rl_engine.campaign.plan import (
    EXIT_FAILED,
    EXIT_NO_REPORT,
    EXIT_PASSED,
    load_plan,
    planned_entry,
    remove_outputs,
    report_path,
)
from rl_engine.capture.format import CaptureError
from rl_engine.distributed.mesh import LaunchEnv, MeshError, destroy, init_mesh
from rl_engine.logprob.comparison import ComparisonError, drift_failures
from rl_engine.logprob.contract import LOGITS_DTYPES, LogprobContract, LogprobContractError
from rl_engine.logprob.oracle import fp32_oracle
from rl_engine.logprob.registry import dispatch
from rl_engine.rundir import TENSOR_NAMES, Topology, report_tensors
from rl_engine.tables import SCHEMA_VERSION
from rl_engine.tensorio import DTYPE_NAMES, fingerprint, write_raw
from rl_engine.verb_parsers import run_parser as build_parser

MERGE_ORDER = (
    "per-tile FP32 (max, sum exp) with a fixed pairwise fold inside each tile; tiles merged "
    "in global tile order with the same fold, identically on every rank"
)


# ----- one rank -----------------------------------------------------------------------------
def rank_contract(case: Case, tp: int, cp: int, tp_rank: int, cp_rank: int) -> LogprobContract:
    """This rank's contract: :meth:`Case.contract`."""
    return case.contract(tp, cp, tp_rank, cp_rank)


def compute_rank(
    case: Case, tp: int, cp: int, rank: int, tp_rank: int, cp_rank: int, group: Any, device: torch.device
) -> dict[str, Any]:
    """This rank's local results (CPU tensors) and provenance, ready to gather on rank 0."""
    contract = rank_contract(case, tp, cp, tp_rank, cp_rank)
    # docs/arithmetic.md section 13 (processed) and section 6 step 0 per row (sampling: capture): {} is raw
    captured = case_row_sampling(case.to_dict(), rows=contract.token_indices)  # this rank's rows only
    sampling = case.op_sampling(contract.num_tokens, device, captured)
    selected = dispatch(case.backend, contract, device.type, processed="sampling" in sampling,
                        row_temperature="temperature" in sampling)
    local, targets, active = case_rank_inputs(case.to_dict(), contract)  # on a capture, run_topology checked its hash
    local = local.to(device=device, dtype=contract.torch_dtype).contiguous().requires_grad_(True)
    start = time.perf_counter()
    out = selected.op(local, targets.to(device), active.to(device), contract, group=group, compute_entropy=True,
                      **sampling)
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
        "backend_mode": selected.mode,
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
    dtype = LOGITS_DTYPES[case.dtype]
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


def _backend_failures(case: Case, results: list[dict[str, Any]]) -> list[str]:
    """Every rank must materialise the case's backend without fallback, under one contract."""
    failures = [
        f"backend: rank {r['rank']} requested {r['requested_backend']!r} and materialised "
        f"{r['actual_backend']!r} (fallback={r['fallback']}); expected {case.backend!r} without fallback"
        for r in results
        if r["actual_backend"] != case.backend or r["fallback"] or r["requested_backend"] != case.backend
    ]
    if len({r["contract_fingerprint"] for r in results}) != 1:
        failures.append("contract: ranks disagree on the contract fingerprint")
    return failures


def _fingerprint_section(tensors: dict[str, torch.Tensor], fingerprints: dict[str, str], n: int) -> dict[str, Any]:
    """``bitwise_fingerprints``: the aggregate tensors' hashes, dtypes and shapes."""
    return {
        "dtype": "float32",
        "shape": [n],
        **{f"candidate_{name}_sha256": fingerprints[name] for name in TENSOR_NAMES},
        "candidate_grad_sha256": fingerprint(tensors["grad"]),
        "grad_dtype": DTYPE_NAMES[tensors["grad"].dtype],
        "grad_shape": list(tensors["grad"].shape),
    }


def _environment_section(case: Case, tp: int, cp: int) -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": case.device,
        "dist_backend": case.dist_backend,
        "world_size": tp * cp,
        "threads_per_rank": case.threads_per_rank,
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
    }


def _topology_section(case: Case, tp: int, cp: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """``topology``: the degrees, the layout, the nodes and every rank's provenance."""
    return {
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
    }


def _reduction_section(case: Case, rank0: dict[str, Any]) -> dict[str, Any]:
    return {
        "num_vocab_tiles": case.num_vocab_tiles,
        "tile_width": rank0["tile_width"],
        "merge_order": MERGE_ORDER,
        "transport": (
            f"one {case.dist_backend} all_gather per call of every TP rank's tile partials "
            "and owned target logits within the TP group (transport only, nothing summed); "
            "rank 0 gathers outputs for reassembly"
        ),
    }


def build_report(
    case: Case,
    tp: int,
    cp: int,
    output: Path,
    command: str,
    results: list[dict[str, Any]],
    fault: Fault | None,
    timings: dict[str, float],
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Rank 0: the report's JSON and the tensors to write next to it.

    The ranks' outputs are checked (backend, contract, TP replication), assembled in global token
    order and compared with the oracles; the report records all of it with the fingerprints.
    """
    results = sorted(results, key=lambda r: r["rank"])
    start = time.perf_counter()
    tp_failures = tp_replication_failures(results)
    failures = _backend_failures(case, results) + tp_failures
    tensors = assemble(results, case)
    logits_fp32, targets, active = case_inputs(case.to_dict())
    if fault is not None and fault.kind == "perturb" and fault.applies(tp, cp):
        perturb(tensors["logp"], logits_fp32, targets, active, case)
    drift = case.drift(tensors["logp"], tensors["lse"], logits_fp32, targets, active,
                       case_row_sampling(case.to_dict()))  # sampling: capture: every row's, after its hash
    failures += drift_failures(drift)
    timings = {**timings, "oracle_s": time.perf_counter() - start}
    n = case.batch * case.seq
    tensor_files = report_tensors(output)
    fingerprints = {name: fingerprint(tensors[name]) for name in TENSOR_NAMES}
    rank0 = results[0]
    report = {
        "schema_version": SCHEMA_VERSION,
        "case_id": case.case_id,
        "case": {**case.to_dict(), "tp": tp, "cp": cp},
        "launch_command": command,
        "passed": not failures,
        "failures": failures,
        "requested_backend": case.backend,
        "actual_backend": rank0["actual_backend"],
        "arithmetic_spec": SPEC_VERSION,
        "fallback": any(r["fallback"] for r in results),
        "tp_outputs_bitwise_replicated": not tp_failures,
        "bitwise_fingerprints": _fingerprint_section(tensors, fingerprints, n),
        "tensors": {
            name: {"path": tensor_files[name].name, "sha256": fingerprints[name], "dtype": "float32", "shape": [n]}
            for name in TENSOR_NAMES
        },
        "inputs_sha256": inputs_sha256(logits_fp32, targets, active),
        # a capture's mask is its own (no rule of the case's integers gives it): recorded for acceptance
        **({MASK_FIELD: pack_mask(active.numpy())} if case.capture is not None else {}),
        "environment": _environment_section(case, tp, cp),
        "topology": _topology_section(case, tp, cp, results),
        "reduction": _reduction_section(case, rank0),
        "dispatch": {
            "rejections": [{"backend": b, "reason": why} for b, why in rank0["rejections"]],
            "modes": sorted({str(r["backend_mode"]) for r in results if r["backend_mode"] is not None}),
        },
        "timings": {**timings, "total_s": timings["total_s"] + timings["oracle_s"]},
        "drift": drift,
        "fault_injection": None if fault is None else fault.text,
    }
    return report, {name: tensors[name] for name in TENSOR_NAMES}


def write_report(output: Path, report: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Validate, then write the raw tensors and finally the report, each atomically."""
    try:
        schemas.require_valid(report, "report", what=output)
    except schemas.ArtifactSchemaError as exc:
        raise ComparisonError(str(exc)) from None
    tensor_files = report_tensors(output)
    try:
        for name, path in tensor_files.items():
            digest = write_raw(path, tensors[name])
            if digest != report["tensors"][name]["sha256"]:
                raise ComparisonError(f"{path}: written bytes hash to {digest}, not the fingerprint")
        jsonio.write_json(output, report)
    except BaseException:
        remove_outputs(output)
        raise


def run_topology(plan_path: str, tp: int, cp: int) -> int:
    """One rank of one planned topology under torchrun; rank 0 writes the report."""
    start = time.perf_counter()
    case, plan = load_plan(plan_path)
    entry = planned_entry(plan, tp, cp, plan_path)
    case.check_topology(tp, cp)
    output = report_path(plan_path, entry)
    fault = fault_from_env()
    launch = LaunchEnv.from_environ()
    if launch.rank == 0:
        remove_outputs(output)
    if case.capture is not None:  # the recorded bytes, on every rank, before any collective
        check_file(case.capture)
        require_sampling_tensors(case.to_dict())  # sampling: capture needs the capture's sampling tensors
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
        report, tensors = build_report(case, tp, cp, output, entry["command"], gathered, fault, timings)
        write_report(output, report, tensors)
        verdict = "passed" if report["passed"] else "FAILED: " + "; ".join(report["failures"])
        print(f"{Topology(tp, cp).stem}: {verdict} -> {output}")
        return EXIT_PASSED if report["passed"] else EXIT_FAILED
    finally:
        destroy()


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_NO_REPORT
    try:
        return run_topology(args.plan, args.tp, args.cp)
    except (CaseError, CaptureError, FaultError, MeshError, LogprobContractError, ComparisonError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NO_REPORT
    except Exception:  # noqa: BLE001 - any other failure: no valid report, say why
        traceback.print_exc()
        print("error: no valid report was produced", file=sys.stderr)
        return EXIT_NO_REPORT


if __name__ == "__main__":
    sys.exit(main())
