"""``python -m rl_engine <verb> ...``: what the workflow rules and reviewers call.

Each verb lives in its own module as ``main(argv: list[str]) -> int``; this file only maps
verbs to modules, so importing it costs nothing and every stage stays testable alone.
"""

from __future__ import annotations

import importlib
import sys

VERBS: dict[str, tuple[str, str]] = {
    "case": ("rl_engine.campaign.case", "write and check the case file (case.json) the plan is built from"),
    "copy-capture": ("rl_engine.campaign.captured", "copy the case's captured file into the run directory (inputs.archive: true)"),
    "plan": ("rl_engine.campaign.plan", "plan a TP x CP campaign from a case file: write plan.json, print the torchrun commands"),
    "run": ("rl_engine.campaign.run", "run one planned topology's comparison (each rank, under torchrun)"),
    "launch": ("rl_engine.campaign.launch", "run one planned topology with a time limit"),
    "env": ("rl_engine.record.environment", "capture environment.json and environment.txt"),
    "sources": ("rl_engine.record.sources", "write the engine's source digest file the workflow's jobs depend on"),
    "regression": ("rl_engine.record.regression", "run the focused pytest suite with counts"),
    "validate": ("rl_engine.evidence.validation", "validate artifacts and report acceptance"),
    "crosscheck": ("rl_engine.evidence.crosscheck", "cross-topology bitwise fingerprint check"),
    "summary": ("rl_engine.evidence.summary", "write SUMMARY.md from the evidence"),
    "archive": ("rl_engine.evidence.archive", "pack a byte-reproducible archive"),
    "verify": ("rl_engine.evidence.verify", "verify an archive offline"),
    "check-config": ("rl_engine.workflow", "validate config.yaml against its schema"),
    "bench": ("rl_engine.benchmark.cli", "benchmark every backend vs naive vs floor"),
    "parity": ("rl_engine.capture.parity", "compare a rollout engine's and a trainer's captured logits and logprobs"),
    "gpu-smoke": ("rl_engine.gpu_smoke", "campaign on cuda == the same case on the CPU, and forward timing"),
}


# what the `workflow` extra of pyproject.toml installs, by module (referencing comes with jsonschema)
WORKFLOW_MODULES = ("snakemake", "jsonschema", "referencing", "rich", "yaml")


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
    if any(arg in ("-h", "--help") for arg in rest):
        # a verb whose module imports torch (seconds) has its parser in rl_engine.verb_parsers
        from rl_engine.verb_parsers import PARSERS

        if verb in PARSERS:
            try:
                PARSERS[verb]().parse_args(rest)
            except SystemExit as exc:  # argparse printed the help (0) or a usage error (2)
                return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(importlib.import_module(VERBS[verb][0]).main(rest))
    except ModuleNotFoundError as exc:  # `pip install rl_engine` is the op alone: the verbs need the workflow extra
        if (exc.name or "").split(".")[0] not in WORKFLOW_MODULES:
            raise
        print(f"{verb}: {exc}: the verbs need rl_engine's workflow extra (pip install 'rl_engine[workflow]')",
              file=sys.stderr)
        return 2
    except OSError as exc:  # a file the verb was pointed at cannot be read or written: the message, no traceback
        # 2, as for every refusal: 1 is each verb's "the evidence shows a difference or a failure"
        print(f"{verb}: {exc}", file=sys.stderr)
        return 2
