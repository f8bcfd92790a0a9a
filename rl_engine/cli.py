"""``python -m rl_engine <verb> ...``: what the workflow rules and reviewers call.

Each verb lives in its own module as ``main(argv: list[str]) -> int``; this file only maps
verbs to modules, so importing it costs nothing and every stage stays testable alone.
"""

from __future__ import annotations

import importlib
import sys

VERBS: dict[str, tuple[str, str]] = {
    "plan": ("rl_engine.testing.distributed_logprob_comparison", "plan a TP x CP campaign: write plan.json, print the torchrun commands"),
    "compare": ("rl_engine.testing.distributed_logprob_comparison", "run one topology's comparison (each rank, under torchrun)"),
    "launch": ("rl_engine.testing.launch", "run one planned topology with a time limit"),
    "env": ("rl_engine.evidence.environment", "capture environment.json and environment.txt"),
    "regression": ("rl_engine.evidence.regression", "run the focused pytest suite with counts"),
    "validate": ("rl_engine.evidence.validation", "validate artifacts and report acceptance"),
    "crosscheck": ("rl_engine.evidence.crosscheck", "cross-topology bitwise fingerprint check"),
    "summary": ("rl_engine.evidence.summary", "write SUMMARY.md from the evidence"),
    "archive": ("rl_engine.evidence.archive", "pack a byte-reproducible archive"),
    "verify": ("rl_engine.evidence.verify", "verify an archive offline"),
    "check-config": ("rl_engine.evidence.config", "validate config.yaml against its schema"),
    "bench": ("rl_engine.benchmark.cli", "benchmark every backend vs naive vs floor"),
    "gpu-smoke": ("rl_engine.gpu_smoke", "campaign on cuda == the same case on the CPU, and forward timing"),
}


# plan and compare share the runner's parser (compare is the runner itself); each has its own help.
RUNNER_HELP: dict[str, str] = {
    "plan": ("Plan a TP x CP campaign without running it: check the case and every topology (the same rules "
             "every rank applies), write plan.json (schemas/plan.schema.json) with each topology's report path "
             "and exact torchrun command, and print those commands. --topologies lists the matrix (or --tp and "
             "--cp plan one); --output is plan.json. (--plan is implied.)"),
    "compare": ("Run one topology's comparison: launched once per rank by torchrun (see plan.json's commands), "
                "it computes the candidate backend's logprob, LSE, entropy and gradient on the case's seeded "
                "inputs, compares them with the full-vocabulary FP32 and FP64 oracles, and rank 0 writes the "
                "report (--output tp<T>-cp<C>.json) and its raw *.f32 tensors. Exit 0 passed, 1 failed "
                "acceptance (report kept), 2 no valid report."),
}


def runner_help(verb: str, module: object) -> str:
    """``--help`` of plan or compare: the runner's options under the verb's own name and description."""
    parser = module.build_parser()  # type: ignore[attr-defined]
    parser.prog = f"python -m rl_engine {verb}"
    parser.description = RUNNER_HELP[verb]
    return parser.format_help()


def usage() -> str:
    width = max(len(v) for v in VERBS)
    lines = ["usage: python -m rl_engine <verb> [args...]", "", "verbs:"]
    lines += [f"  {verb.ljust(width)}  {text}" for verb, (_, text) in VERBS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    verb, rest = args[0], args[1:]
    if verb not in VERBS:
        print(f"unknown verb {verb!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(VERBS[verb][0])
    try:
        if verb in RUNNER_HELP:
            if "-h" in rest or "--help" in rest:
                print(runner_help(verb, module))
                return 0
            return int(module.main(([] if verb == "compare" else ["--plan"]) + rest))
        return int(module.main(rest))
    except OSError as exc:  # a file the verb was pointed at cannot be read or written: the message, no traceback
        print(f"{verb}: {exc}", file=sys.stderr)
        return 1
