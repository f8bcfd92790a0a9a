"""The reviewer's bundle: a byte-reproducible ``results/<name>.tar.gz`` and its ``.sha256``.

``python -m rl_engine archive --run-dir RUN --output results/NAME.tar.gz [--schemas DIR]``

* refuses (exit 1, nothing written) a run whose ``validation.json`` or ``crosscheck.json`` is
  missing or not ``passed``, or whose files no longer pass those gates when they are run again
  on the run as it is now (a report or tensor edited, deleted or added after the gates ran:
  Snakemake does not rerun a gate for a deleted intermediate file): no archive is ever built
  from failing evidence;
* packs, under one top folder ``NAME/``: every regular file of ``RUN`` (reports, raw ``*.f32``
  tensors, logs, ``SUMMARY.md``, the JSON artifacts; hidden files such as a crashed writer's
  ``.*.tmp`` are left out and listed on stderr; a symbolic link in ``RUN`` is an error), a copy
  of the schemas under ``NAME/schemas/``, ``NAME/REVIEWING.md`` (how to check the bundle with
  ``sha256sum -c`` alone and with ``python -m rl_engine verify``) and ``NAME/SHA256SUMS`` in
  ``sha256sum -c`` format over every other file, paths relative to ``NAME/``;
* is byte-reproducible: members sorted by name, ustar format, mtime 0, uid/gid 0, empty
  uname/gname, modes 0644 (files) and 0755 (directories), gzip header without name and with
  mtime 0, fixed compression level;
* is written atomically (temporary file in the output directory, fsync, rename), then
  ``NAME.tar.gz.sha256`` (``<hex>  NAME.tar.gz``) likewise. Stale outputs at both paths are
  removed first, so an interrupted run leaves nothing at the final path.

Exit 0 when written; 1 when refused; 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import gzip
import io
import re
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_engine import jsonio, schemas
from rl_engine.evidence.crosscheck import crosscheck_run
from rl_engine.evidence.rundir import CROSSCHECK, ENVIRONMENT, REVIEWING, SCHEMA_DIR, SUMS, VALIDATION, load_json
from rl_engine.evidence.validation import validate_run

SUFFIX = ".tar.gz"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
FIXED_MTIME = 0
FILE_MODE = 0o644
DIR_MODE = 0o755
GZIP_LEVEL = 9


class ArchiveError(ValueError):
    """An archive that must not be built: failing evidence, a bad name, an unsafe run dir."""


@dataclass(frozen=True)
class Built:
    path: Path
    sha256: str
    members: tuple[str, ...]


def archive_name(output: Path) -> str:
    """``NAME`` of ``.../NAME.tar.gz``; refuses names a shell or tar would mangle."""
    if not output.name.endswith(SUFFIX):
        raise ArchiveError(f"--output {output} must end in {SUFFIX}")
    name = output.name[: -len(SUFFIX)]
    if not NAME_PATTERN.match(name):
        raise ArchiveError(f"archive name {name!r} must match {NAME_PATTERN.pattern} (letters, digits, . _ + -)")
    return name


def check_gates(run_dir: Path) -> None:
    """Refuse unless both gates recorded ``passed: true``."""
    for name in (VALIDATION, CROSSCHECK):
        obj, found = load_json(run_dir / name)
        if found:
            raise ArchiveError(f"refusing to archive {run_dir}: {found[0]}; run the {name[:-5]} gate first")
        if not isinstance(obj, dict) or obj.get("passed") is not True:
            first = (obj.get("failures") or ["(no failures listed)"])[0] if isinstance(obj, dict) else "not an object"
            raise ArchiveError(f"refusing to archive {run_dir}: {name} did not pass (first failure: {first}); "
                               "no archive is built from failing evidence")


def check_evidence(run_dir: Path, schema_dir: Path) -> None:
    """Refuse unless the run, as it is now, still passes both gates (they may predate a change)."""
    found = [*validate_run(run_dir, schema_dir).findings, *crosscheck_run(run_dir)[1]]
    if found:
        raise ArchiveError(f"refusing to archive {run_dir}: its files no longer pass the gates that recorded "
                           f"a pass ({len(found)} problem(s), first: {found[0]}); rerun the validation and "
                           "crosscheck gates (in the workflow: snakemake --cores 8 --forcerun validation); "
                           "no archive is built from failing evidence")


def checkout_text(git: dict[str, Any]) -> str:
    """REVIEWING.md's section on getting rl_engine at the tested commit, from environment.json's git."""
    commit = git.get("commit")
    if git.get("available") is not True or not isinstance(commit, str):
        return f"""## rl_engine at the tested commit

No git state was recorded for this run ({git.get('reason')}): the tested code is not named by
a commit. Ask the sender for the source tree the run used; the verifier below does not need it.
"""
    dirty = ("""
The working tree was DIRTY when the run was made: it had changes that no commit holds, so this
commit gives the committed code, not exactly the tested code (the 'tested' row of the verifier
says the same).
""" if git.get("dirty") else """
The working tree was clean when the run was made: this commit is exactly the tested code.
""")
    return f"""## rl_engine at the tested commit

The evidence was made by rl_engine at commit `{commit}` (branch `{git.get('branch')}`,
recorded in `environment.json`). In a clone of the rl_engine repository you were given:

    git fetch origin                 # the commit must be on the remote you cloned
    git checkout {commit}
    test "$(git rev-parse HEAD)" = "{commit}"
    pip install -e '.[test]'         # on a CPU-only machine: add -c constraints/cpu.txt
{dirty}
`SUMMARY.md`'s Reproduction section gives the config and the exact commands of the run.
"""


def reviewing_text(name: str, git: dict[str, Any] | None = None) -> str:
    """REVIEWING.md of archive ``name``; ``git`` is environment.json's git record."""
    from rl_engine.logprob.portable import SPEC_VERSION

    return f"""# Reviewing {name}

This bundle is the evidence of one rl_engine validation run: the environment record, the
focused regression log and counts, the plan, one report per TP x CP topology with its raw
float32 tensors (`*.f32`), the validation and cross-topology results, `SUMMARY.md`, the
per-stage logs, and the JSON schemas (`schemas/`, draft 2020-12) the artifacts were checked
against.

## With `sha256sum` alone

    sha256sum -c {name}.tar.gz.sha256        # the archive is the one that was published
    tar -xzf {name}.tar.gz
    cd {name} && sha256sum -c SHA256SUMS       # every file is intact

`SHA256SUMS` lists every file of the bundle except itself. Each raw tensor's SHA-256 is
also the fingerprint recorded in its report: for example `sha256sum tp1-cp1.logp.f32`
equals `bitwise_fingerprints.candidate_logp_sha256` of `tp1-cp1.json`, and every report
records the same fingerprints.

The gradient is not backed by a file (it would be about 10 MB per topology):
`bitwise_fingerprints.candidate_grad_sha256` is compared across topologies (every report
must record the same hash), and `verify --recompute` recomputes it.

## The arithmetic, and replaying it

Every report records `arithmetic_spec` (`{SPEC_VERSION}`): the candidate's logp, LSE,
entropy and gradient are IEEE-754 basic operations in the fixed order of rl_engine's
`docs/arithmetic.md`, with its own exp and log, no library transcendental, no library
reduction and no fused multiply-add. Any conforming CPU or GPU computes the same bytes
(given gradual underflow, the IEEE default), so your machine can replay the candidate.

## With the verifier (offline, no GPU)

    python -m rl_engine verify {name}.tar.gz              # checksums, schemas, acceptance, fingerprints
    python -m rl_engine verify {name}.tar.gz --recompute  # also regenerate inputs, oracle drift, and replay the candidate

The verifier checks the outer `.sha256`, every `SHA256SUMS` line with no file missing or
extra, every JSON file against the schemas shipped here, the acceptance of every report
(passed, requested == actual backend, no fallback, TP outputs replicated, finite drift within
tolerance), each raw tensor against its fingerprint and all fingerprints across topologies.
It renders `SUMMARY.md` again from the evidence files with the function the `summary` step
used and requires the shipped one to be byte-identical, so the numbers you read are the
evidence's. It also requires the case's `atol`/`rtol` (plan and every report) to be no looser
than rl_engine's defaults for the dtype: a consistently raised tolerance fails unless you
pass `--accept-looser-tolerance`, which turns that row into a note naming the looser values.
The verifier refuses a report made under another `arithmetic_spec` than its own.
`--recompute` regenerates each report's inputs from its `case` (checking `inputs_sha256`),
recomputes the drift against the FP32 and FP64 oracles from the raw tensors, and replays the
candidate at TP=1 in one process: every topology's logp, LSE and entropy files and all four
fingerprints (the gradient's included) must equal the replay byte for byte, or it names the
first differing token. It reads
the archive member by member into a temporary directory and refuses links, devices, absolute
or `..` paths, duplicate names, oversized members and members the file system cannot create.
It exits 0 only when every check holds.

## Across nodes

Each report records, per rank, the node it ran on (`topology.ranks[].node`: the Slurm node
name, else the hostname) and `topology.nnodes`; `SUMMARY.md` lists the nodes per topology.
Acceptance requires `nnodes` to equal the number of distinct node names. A topology that
spans nodes is held to the same checks as one that does not: its TP peers must produce
identical bytes wherever they ran, and its fingerprints must equal every other topology's,
single-node ones included, so the numbers do not depend on the node placement either.

{checkout_text(git or {"available": False, "reason": "environment.json has no git record"})}"""


def _collect(run_dir: Path) -> tuple[list[tuple[str, bytes]], list[str]]:
    files: list[tuple[str, bytes]] = []
    hidden: list[str] = []
    for path in sorted(run_dir.rglob("*")):
        rel = path.relative_to(run_dir).as_posix()
        if path.is_symlink():
            raise ArchiveError(f"{run_dir}/{rel} is a symbolic link; the run directory must hold regular files only")
        if any(part.startswith(".") for part in path.relative_to(run_dir).parts):
            if path.is_file():
                hidden.append(rel)
            continue
        if path.is_dir():
            continue
        if not path.is_file():
            raise ArchiveError(f"{run_dir}/{rel} is not a regular file")
        top = rel.split("/", 1)[0]
        if top in (SUMS, REVIEWING, SCHEMA_DIR):
            raise ArchiveError(f"{run_dir}/{rel} clashes with the archive's own {top}; rename or remove it")
        files.append((rel, path.read_bytes()))
    return files, hidden


def _info(name: str, size: int, is_dir: bool) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    info.size = 0 if is_dir else size
    info.mode = DIR_MODE if is_dir else FILE_MODE
    info.mtime = FIXED_MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def tar_gz_bytes(name: str, files: list[tuple[str, bytes]]) -> bytes:
    """The archive's bytes: ``files`` (paths relative to ``name/``) sorted, with their dirs."""
    entries: dict[str, bytes | None] = {name: None}
    for rel, data in files:
        parts = rel.split("/")
        for i in range(1, len(parts)):
            entries[f"{name}/{'/'.join(parts[:i])}"] = None
        entries[f"{name}/{rel}"] = data
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=FIXED_MTIME, compresslevel=GZIP_LEVEL) as gz:
        with tarfile.open(fileobj=gz, mode="w|", format=tarfile.USTAR_FORMAT) as tar:  # type: ignore[call-overload]
            for member in sorted(entries):
                data = entries[member]
                try:
                    info = _info(member, 0 if data is None else len(data), data is None)
                    tar.addfile(info, None if data is None else io.BytesIO(data))
                except ValueError as exc:
                    raise ArchiveError(f"cannot store {member!r} in a ustar archive: {exc}") from None
    return buffer.getvalue()


def sums_text(files: list[tuple[str, bytes]]) -> str:
    """``sha256sum -c`` lines (``<hex>  <path>``) over ``files``, sorted by path."""
    return "".join(f"{jsonio.sha256_bytes(data)}  {rel}\n" for rel, data in sorted(files))


def build(run_dir: Path, output: Path, schema_dir: Path) -> Built:
    """Check the gates, then write ``output`` and ``output.sha256`` atomically."""
    name = archive_name(output)
    sidecar = output.with_name(output.name + ".sha256")
    for stale in (output, sidecar):
        stale.unlink(missing_ok=True)
    if not run_dir.is_dir():
        raise ArchiveError(f"--run-dir {run_dir} is not a directory")
    if output.resolve().is_relative_to(run_dir.resolve()):
        raise ArchiveError(f"--output {output} must not lie inside the run directory it packs")
    check_gates(run_dir)
    check_evidence(run_dir, schema_dir)
    files, hidden = _collect(run_dir)
    for rel in hidden:
        print(f"archive: leaving out hidden file {rel} (not evidence)", file=sys.stderr)
    schema_files = sorted(schema_dir.glob("*.schema.json"))
    if not schema_files:
        raise ArchiveError(f"no *.schema.json in {schema_dir}; the archive must ship the schemas it was checked with")
    schemas.load(schema_dir)  # refuse to ship schemas that do not load
    files += [(f"{SCHEMA_DIR}/{p.name}", p.read_bytes()) for p in schema_files]
    environment, _ = load_json(run_dir / ENVIRONMENT)  # schema-valid: check_evidence passed
    git = environment.get("git") if isinstance(environment, dict) else None
    files.append((REVIEWING, reviewing_text(name, git if isinstance(git, dict) else None).encode("utf-8")))
    files.append((SUMS, sums_text(files).encode("utf-8")))
    data = tar_gz_bytes(name, files)
    digest = jsonio.sha256_bytes(data)
    output.parent.mkdir(parents=True, exist_ok=True)
    jsonio.atomic_write_bytes(output, data)
    jsonio.atomic_write_text(sidecar, f"{digest}  {output.name}\n")
    return Built(output, digest, tuple(sorted(rel for rel, _ in files)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_engine archive", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory to pack")
    parser.add_argument("--output", required=True, type=Path, help="results/NAME.tar.gz")
    parser.add_argument("--schemas", type=Path, default=None, help="schema directory to ship (default: the repository's)")
    args = parser.parse_args(argv)
    schema_dir = args.schemas or schemas.repo_schema_dir()
    try:
        built = build(args.run_dir, args.output, schema_dir)
    except ArchiveError as exc:
        print(f"archive: {exc}", file=sys.stderr)
        return 1
    except schemas.SchemaError as exc:
        print(f"archive: {exc}", file=sys.stderr)
        return 1
    print(f"archive: {built.path} ({len(built.members)} files)\nsha256: {built.sha256}")
    return 0


__all__ = ["ArchiveError", "Built", "archive_name", "build", "main", "reviewing_text", "sums_text", "tar_gz_bytes"]
