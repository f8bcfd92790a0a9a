"""The engine's source digest: the one input through which an edited engine source reruns the jobs
that run the engine.

Declaring every ``rl_engine/*.py`` as a job's input would print about 70 file names per job; instead
the ``sources`` rule writes ``results/logs/<run>-sources.sha256``
(``sha256sum -c`` format, one line per source file) and the regression, plan and topology rules
depend on that one file. The rule's ``params`` carry the digest computed when the Snakefile is
parsed (:func:`source_digest`), so Snakemake's params trigger reruns it, and through the rewritten
file everything that depends on it, exactly when a source changed.

``python -m rl_engine sources --repo DIR --digest HEX --output FILE`` recomputes the digest and
refuses (exit 1, nothing written) when it is not ``--digest``: a source changed between parsing
and this job, so the file would not describe what the workflow planned.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

SOURCE_PACKAGES = ("rl_engine",)
SOURCE_SUFFIXES = (".py", ".c", ".h")


def engine_sources(repo: str | Path) -> list[str]:
    """The package's source files (Python and the fused kernel's C), relative to ``repo``, sorted."""
    repo = Path(repo)
    found = [p for package in SOURCE_PACKAGES for p in (repo / package).rglob("*")
             if p.is_file() and p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts]
    return sorted(str(p.relative_to(repo)) for p in found)


def source_lines(repo: str | Path) -> str:
    """``<sha256>  <path>`` per source file (the ``sha256sum`` format)."""
    lines = [f"{hashlib.sha256((Path(repo) / name).read_bytes()).hexdigest()}  {name}\n"
             for name in engine_sources(repo)]
    return "".join(lines)


def source_digest(repo: str | Path) -> str:
    """SHA-256 of :func:`source_lines`: changes exactly when a source file's name or bytes change."""
    return hashlib.sha256(source_lines(repo).encode()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_engine sources", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", required=True, type=Path, help="the checkout whose rl_engine/ is digested")
    parser.add_argument("--digest", required=True, help="the digest the workflow computed when it was parsed")
    parser.add_argument("--output", required=True, type=Path, help="the digest file to write")
    args = parser.parse_args(argv)
    lines = source_lines(args.repo)
    digest = hashlib.sha256(lines.encode()).hexdigest()
    if digest != args.digest:
        print(f"sources: the engine's sources changed since the workflow was parsed (digest {digest}, "
              f"--digest {args.digest}); run snakemake again", file=sys.stderr)
        return 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(lines, encoding="utf-8")
    print(f"sources: {len(lines.splitlines())} files, digest {digest}")
    return 0
