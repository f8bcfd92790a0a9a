"""How a gate ends: write its schema-valid result, print its findings, return its exit code."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rl_engine import schemas
from rl_engine.rundir import Finding


def finish_gate(
    verb: str,
    output: Path,
    result: dict[str, Any],
    schema_name: str,
    found: list[Finding],
    passed_message: str,
    schema_dir: Path | None = None,
) -> int:
    """Write a gate's schema-valid result, then report it: 0 passed, 1 findings or bad result.

    The result file is written either way (it is evidence of what failed); the findings go to
    stderr, one per line, naming file or topology and field.
    """
    try:
        schemas.write_validated(output, result, schema_name, schema_dir)
    except schemas.ArtifactSchemaError as exc:
        print(f"{verb}: {exc}", file=sys.stderr)
        return 1
    if found:
        print(f"{verb} FAILED ({len(found)} problems):", file=sys.stderr)
        for finding in found:
            print(f"  {finding}", file=sys.stderr)
        return 1
    print(passed_message)
    return 0
