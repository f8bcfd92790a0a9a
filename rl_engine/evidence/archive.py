"""The reviewer's bundle: a byte-reproducible ``results/<name>.tar.gz`` and its ``.sha256``.

``python -m rl_engine archive --run-dir RUN --output results/NAME.tar.gz --spec ARITHMETIC_MD
--schemas SCHEMA... --workflow SNAKEFILE RULES... --files FILE...``

The archive packs the files it is given, nothing else: the workflow's ``archive`` rule declares
every one as an input (environment, regression with its log and JUnit XML, plan, every report
and raw tensor, the two gate results, ``SUMMARY.md``, the rules' logs, the schemas), so
Snakemake decides what is stale: a report edited after the gates ran is a changed input of the
validation rule and of this one, and the gates, the summary and the archive run again; a file
that appears in the run directory and no rule declares is not packed at all. The verb

* refuses (exit 1, nothing written) a run whose ``validation.json`` or ``crosscheck.json`` is
  missing or not ``passed``: no archive is ever built from failing evidence. It reads the two
  records and does not run the gates again (the workflow's ``verify_archive`` runs the
  reviewer's verifier, every check, on the archive just built);
* refuses, naming the file and the fix, a given file that is missing, not a regular file, a
  symbolic link (or under one), outside ``RUN``, or named like what the archive adds
  (:data:`rl_engine.rundir.ARCHIVE_ONLY`: ``SHA256SUMS``, ``REVIEWING.md``, ``schemas/``,
  ``arithmetic.md``, the statement, the crate, ``workflow/``); a file list that lacks evidence ``verify``
  needs (:func:`rl_engine.rundir.Run.evidence_files` and ``SUMMARY.md``: the files the
  evidence names); and schema files that are not the set ``validation.json`` records it was
  checked with (names and SHA-256: the only files hashed beyond ``SHA256SUMS``, a few KiB);
* packs, under one top folder ``NAME/``: each given file at its path relative to ``RUN``, the
  schemas under ``NAME/schemas/``, the arithmetic specification as ``NAME/arithmetic.md``, the
  workflow's definition (``--workflow``: its ``Snakefile`` and ``rules/*.smk``) under
  ``NAME/workflow/``, ``NAME/REVIEWING.md`` (how to check the bundle with ``sha256sum -c`` alone,
  with other tools and with ``python -m rl_engine verify``), then, in this order, the Workflow Run
  RO-Crate ``NAME/ro-crate-metadata.json`` (:mod:`rl_engine.evidence.crate`: every file by name),
  the in-toto statement ``NAME/provenance.intoto.json`` (:mod:`rl_engine.evidence.provenance`:
  every file before it by SHA-256) and ``NAME/SHA256SUMS`` in ``sha256sum -c`` format over every
  other file, paths relative to ``NAME/``. The statement and the crate are built with the
  ``provenance`` extra's packages; without them the verb refuses before reading anything;
* is byte-reproducible: members sorted by name, ustar format, uid/gid 0, empty uname/gname,
  modes 0644 (files) and 0755 (directories), gzip header without name, fixed compression level,
  and one time for everything, ``SOURCE_DATE_EPOCH`` (:mod:`rl_engine.evidence.epoch`; 0 when
  unset): every member's mtime, the gzip header's mtime, the statement's ``startedOn`` and
  ``finishedOn`` and the crate's ``datePublished``. The same run directory and the same
  ``SOURCE_DATE_EPOCH`` give the same bytes; another ``SOURCE_DATE_EPOCH`` changes those times and
  nothing else. A malformed value is refused;
* is written atomically (temporary file in the output directory, fsync, rename), then
  ``NAME.tar.gz.sha256`` (``<hex>  NAME.tar.gz``) likewise. Stale outputs at both paths are
  removed first, so an interrupted run leaves nothing at the final path;
* streams: each given file is read in chunks from disk (once for ``SHA256SUMS``, once into the
  tar stream), never whole into memory, so a gigabyte capture (``capture.safetensors``, config
  ``inputs.archive: true``) is packed like any other file; the archive's SHA-256 is computed
  from the bytes as they are written.

Exit 0 when written; 1 when refused; 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import os
import re
import sys
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Union

from rl_engine import jsonio
from rl_engine.evidence import crate, provenance
from rl_engine.evidence.epoch import DEFAULT_EPOCH, SourceDateEpochError, source_date_epoch
from rl_engine.evidence.spec_doc import SPEC_DOC, SPEC_SOURCE, SpecDocError, check_spec_doc, spec_record, spec_version
from rl_engine.rundir import (
    ARCHIVE_ONLY,
    ARCHIVE_SUFFIX,
    CRATE,
    CROSSCHECK,
    REVIEWING,
    SCHEMA_DIR,
    STATEMENT,
    SUMMARY,
    SUMS,
    VALIDATION,
    WORKFLOW_DIR,
    WORKFLOW_FILE,
    Run,
)

SUFFIX = ARCHIVE_SUFFIX
SCHEMA_SUFFIX = ".schema.json"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
FIXED_MTIME = DEFAULT_EPOCH  # the members' and the gzip header's mtime when SOURCE_DATE_EPOCH is unset
FILE_MODE = 0o644
DIR_MODE = 0o755
GZIP_LEVEL = 9


Source = Union[bytes, Path]  # a member's content: in memory (small files the verb writes) or a file read in chunks


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


def check_gates(run: Run) -> None:
    """Refuse unless both gates recorded ``passed: true``."""
    run_dir = run.root
    for name in (VALIDATION, CROSSCHECK):
        obj, found = run.doc(name), run.found(name)
        if found:
            raise ArchiveError(f"refusing to archive {run_dir}: {found[0]}; run the {name[:-5]} gate first")
        if not isinstance(obj, dict) or obj.get("passed") is not True:
            first = (obj.get("failures") or ["(no failures listed)"])[0] if isinstance(obj, dict) else "not an object"
            raise ArchiveError(f"refusing to archive {run_dir}: {name} did not pass (first failure: {first}); "
                               "no archive is built from failing evidence")


def check_complete(run: Run, packed: set[str]) -> None:
    """Refuse a file list that lacks evidence ``verify`` needs: what the evidence names, and SUMMARY.md."""
    run_dir = run.root
    names, found = run.evidence_files()
    if found:
        raise ArchiveError(f"refusing to archive {run_dir}: {found[0]}")
    missing = [name for name in [*names, SUMMARY] if name not in packed]
    if missing:
        raise ArchiveError(f"refusing to archive {run_dir}: {run_dir / missing[0]} is evidence that verify needs but "
                           f"is not among the files to pack ({len(missing)} missing: {', '.join(missing)}); add it "
                           "to --files (the workflow's archive rule declares every one as an input)")


def check_schemas(run: Run, shipped: list[tuple[str, bytes]]) -> None:
    """Refuse schemas other than the ones ``validation.json`` records it used (verify would fail them).

    The only hashing here beyond SHA256SUMS, of a few KiB: the schemas are the one input the
    archive is handed besides the run, and a hand run may hand it another checkout's.
    """
    run_dir = run.root
    recorded = run.doc(VALIDATION)  # check_gates read it: a passed record
    used = recorded.get("schemas") if isinstance(recorded, dict) else None
    given = {rel[len(SCHEMA_DIR) + 1: -len(SCHEMA_SUFFIX)]: jsonio.sha256_bytes(data) for rel, data in shipped}
    if not isinstance(used, dict) or given == used:
        return  # (validation.schema.json requires the record)
    differ = sorted(n for n in set(given) | set(used) if given.get(n) != used.get(n))
    raise ArchiveError(f"refusing to archive {run_dir}: the schemas given ({', '.join(differ)} differ) are not the "
                       f"ones {VALIDATION} records it was checked with; pass the schema files the validation gate "
                       "used (the workflow's archive and validation rules declare the same list)")


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


# What REVIEWING.md says of the arithmetic, by the version the archive packs: an archive's
# REVIEWING.md is rendered again by verify, so the text of a version never changes.
_ARITHMETIC_CLAIM = {
    "rl-engine-arith/1": ("IEEE-754 basic operations in the fixed order of the specification", "no fused multiply-add",
                          "The verifier refuses a report made under another `arithmetic_spec` than its own."),
    "rl-engine-arith/2": ("IEEE-754 operations in the fixed order of the specification",
                          "no fused multiply-add but the ones it writes",
                          "The verifier replays each report under the `arithmetic_spec` it records (every version "
                          "rl_engine ever defined) and refuses one it does not know."),
}


# What REVIEWING.md says of the provenance statement and the RO-Crate, in an archive that holds them.
# An archive made before them holds neither, and its REVIEWING.md, rendered again by verify, keeps the
# text it was written with: the pieces below are empty for it (``described=False``).
_DESCRIBED_CONTENTS = """, the JSON schemas (`schemas/`, draft 2020-12) the artifacts were checked
against, and the workflow that made them (`workflow/Snakefile`, `workflow/rules/`). Two files
describe it in formats other tools read: `provenance.intoto.json`, an in-toto Statement v1
with the SLSA provenance v1 predicate, and `ro-crate-metadata.json`, which makes this folder a
Workflow Run RO-Crate."""
_PLAIN_CONTENTS = """, and the JSON schemas (`schemas/`, draft 2020-12) the artifacts were checked
against."""
_DESCRIBED_SECTION = r"""## The provenance statement and the RO-Crate, with other tools

`provenance.intoto.json` lists every file of the bundle but itself and `SHA256SUMS` (which
holds its digest) as a subject with its SHA-256; its predicate names the workflow, the config
of the run (`externalParameters.config`), the tested commit (`resolvedDependencies`, digest
`gitCommit`) and the machine (`byproducts`). It is not signed: it says what the bundle holds in
a standard form, and proves no more than `SHA256SUMS`. Offline, with `jq` and `sha256sum`:

    jq -r '.subject[] | "\(.digest.sha256)  \(.name)"' provenance.intoto.json | sha256sum -c

and with the schemas shipped here (the Statement and the SLSA predicate, written from their
specifications): `check-jsonschema --schemafile schemas/provenance.schema.json
provenance.intoto.json`. `ro-crate-metadata.json` describes the workflow, its config, each
stage's run (what it read and wrote) and every other file; RO-Crate tools read it (ro-crate-py:
`python -c "from rocrate.rocrate import ROCrate; print(ROCrate('.').mainEntity)"`), and
`check-jsonschema --schemafile schemas/ro-crate-metadata.schema.json ro-crate-metadata.json`
checks its structure. Every time in the bundle (the tar members', the gzip header's, the
statement's and the crate's) is the one `SOURCE_DATE_EPOCH` the archive was built under, never a
clock reading, so the archive rebuilds byte for byte from the same run.

"""
_DESCRIBED_CHECKS = """ the provenance statement's subjects
(every file but itself and `SHA256SUMS`, each with its SHA-256) and the RO-Crate's files
(every file but itself),"""


def reviewing_text(name: str, git: dict[str, Any] | None = None, spec: bytes | None = None,
                   described: bool = True) -> str:
    """REVIEWING.md of archive ``name``; ``git`` is environment.json's git record; ``spec`` the
    packed specification, whose version decides what the text says of the arithmetic; ``described``
    whether the archive holds the provenance statement and the RO-Crate (every archive ``archive``
    builds; one made before them holds neither, and keeps the text it was written with)."""
    from rl_engine.arith.spec_numpy import SPEC_VERSION

    version = (spec_version(spec) if spec is not None else None) or SPEC_VERSION
    operations, fma, refuses = _ARITHMETIC_CLAIM.get(version, _ARITHMETIC_CLAIM[SPEC_VERSION])
    contents = _DESCRIBED_CONTENTS if described else _PLAIN_CONTENTS
    section = _DESCRIBED_SECTION if described else ""
    checks = _DESCRIBED_CHECKS if described else ""
    return f"""# Reviewing {name}

This bundle is the evidence of one rl_engine validation run: the environment record, the
focused regression log and counts, the plan, one report per TP x CP topology with its raw
float32 tensors (`*.f32`), the validation and cross-topology results, `SUMMARY.md`, the
per-stage logs{contents}

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

{section}## The arithmetic, and replaying it

Every report records `arithmetic_spec` (`{version}`): the candidate's logp, LSE,
entropy and gradient are {operations}
packed beside this file, {spec_record(spec) if spec is not None else "(no specification packed)"}
(rl_engine's `docs/arithmetic.md`), with its own exp and log, no library transcendental, no
library reduction and {fma}. Any conforming CPU or GPU computes the same bytes
(given gradual underflow, the IEEE default), so your machine can replay the candidate.

## With the verifier (offline, no GPU)

    python -m rl_engine verify {name}.tar.gz              # checksums, schemas, acceptance, fingerprints
    python -m rl_engine verify {name}.tar.gz --recompute  # also regenerate inputs, oracle drift, and replay the candidate

The verifier checks the outer `.sha256`, every `SHA256SUMS` line with no file missing or
extra, every JSON file against the schemas shipped here,{checks} the acceptance of every report
(passed, requested == actual backend, no fallback, TP outputs replicated, finite drift within
tolerance), each raw tensor against its fingerprint and all fingerprints across topologies.
It renders `SUMMARY.md` again from the evidence files with the function the `summary` step
used and requires the shipped one to be byte-identical, so the numbers you read are the
evidence's. It also requires the case's `atol`/`rtol` (plan and every report) to be no looser
than rl_engine's defaults for the dtype: a consistently raised tolerance fails unless you
pass `--accept-looser-tolerance`, which turns that row into a note naming the looser values.
{refuses}
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


def given_files(run_dir: Path, files: Sequence[Path]) -> list[tuple[str, Path]]:
    """``(path relative to run_dir, path)`` of each given file, sorted; refuses what must not be packed."""
    root = Path(os.path.abspath(run_dir))
    packed: dict[str, Path] = {}
    for given in files:
        path = Path(os.path.abspath(given))
        try:
            rel = path.relative_to(root)
        except ValueError:
            raise ArchiveError(f"{given} lies outside the run directory {run_dir}; the archive packs files of the run "
                               f"only: move it into {run_dir} or leave it out of --files") from None
        if not rel.parts:
            raise ArchiveError(f"{given} is the run directory itself; name its files in --files")
        for i in range(1, len(rel.parts) + 1):
            if root.joinpath(*rel.parts[:i]).is_symlink():
                raise ArchiveError(f"{root.joinpath(*rel.parts[:i])} is a symbolic link; the run directory must "
                                   "hold regular files only: replace it by the file or leave it out of --files")
        if not path.is_file():
            raise ArchiveError(f"{given} is missing (or not a regular file); it is declared evidence of the run: "
                               "make it again (snakemake --cores 8 rebuilds every declared file) or leave it out "
                               "of --files")
        if rel.parts[0] in ARCHIVE_ONLY:
            raise ArchiveError(f"{given} clashes with the archive's own {rel.parts[0]}; rename it or leave it out "
                               "of --files")
        packed[rel.as_posix()] = path
    return sorted(packed.items())


def given_schemas(schema_files: Sequence[Path]) -> list[tuple[str, bytes]]:
    """``(schemas/<name>, bytes)`` of each given ``*.schema.json``, sorted."""
    shipped: dict[str, bytes] = {}
    for given in schema_files:
        if not given.name.endswith(SCHEMA_SUFFIX):
            raise ArchiveError(f"--schemas {given} is not a *{SCHEMA_SUFFIX} file; pass the schema files the run was "
                               "validated with (schemas/*.schema.json)")
        if given.is_symlink() or not given.is_file():
            raise ArchiveError(f"--schemas {given} is missing (or not a regular file); pass the schema files the run "
                               "was validated with (schemas/*.schema.json)")
        rel = f"{SCHEMA_DIR}/{given.name}"
        if rel in shipped:
            raise ArchiveError(f"--schemas names {given.name} twice; the archive ships one schemas/ folder")
        shipped[rel] = given.read_bytes()
    if not shipped:
        raise ArchiveError("no --schemas given; the archive must ship the schemas the run was validated with")
    return sorted(shipped.items())


def given_workflow(workflow_files: Sequence[Path]) -> list[tuple[str, Path]]:
    """``(workflow/<path>, path)`` of the workflow's definition, sorted: its ``Snakefile`` (exactly one) and
    rule files ``rules/<name>.smk`` beside it; refuses anything else."""
    snakefiles = [path for path in workflow_files if path.name == "Snakefile"]
    if len(snakefiles) != 1:
        raise ArchiveError(f"--workflow names {len(snakefiles)} files called Snakefile; give the workflow's one "
                           "Snakefile and its rules/*.smk (the workflow's archive rule passes them)")
    base = Path(os.path.abspath(snakefiles[0])).parent
    packed: dict[str, Path] = {}
    for given in workflow_files:
        path = Path(os.path.abspath(given))
        try:
            rel = f"{WORKFLOW_DIR}/{path.relative_to(base).as_posix()}"
        except ValueError:
            rel = ""
        if not WORKFLOW_FILE.match(rel):
            raise ArchiveError(f"--workflow {given} is neither the Snakefile nor a rules/<name>.smk file beside it "
                               f"({base}); pass the workflow's Snakefile and its rule files only")
        if given.is_symlink() or not given.is_file():
            raise ArchiveError(f"--workflow {given} is missing (or not a regular file); pass the workflow's files")
        if rel in packed:
            raise ArchiveError(f"--workflow names {rel} twice")
        packed[rel] = path
    return sorted(packed.items())


def _info(name: str, size: int, is_dir: bool, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    info.size = 0 if is_dir else size
    info.mode = DIR_MODE if is_dir else FILE_MODE
    info.mtime = mtime
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


class _HashingWriter:
    """A binary file that hashes what is written through it (the archive's SHA-256, in one pass)."""

    def __init__(self, inner: BinaryIO) -> None:
        self.inner = inner
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self.inner.write(data)

    def flush(self) -> None:
        self.inner.flush()


def write_tar_gz(handle: Any, name: str, files: Sequence[tuple[str, Source]], mtime: int = FIXED_MTIME) -> None:
    """Write the archive of ``files`` (paths relative to ``name/``) to ``handle``: sorted, with their
    dirs, every mtime (members' and gzip header's) ``mtime``; a :data:`Source` that is a path is
    streamed from the file, never read whole."""
    entries: dict[str, Source | None] = {name: None}
    for rel, data in files:
        parts = rel.split("/")
        for i in range(1, len(parts)):
            entries[f"{name}/{'/'.join(parts[:i])}"] = None
        entries[f"{name}/{rel}"] = data
    with gzip.GzipFile(filename="", mode="wb", fileobj=handle, mtime=mtime, compresslevel=GZIP_LEVEL) as gz:
        with tarfile.open(fileobj=gz, mode="w|", format=tarfile.USTAR_FORMAT) as tar:  # type: ignore[call-overload]
            for member in sorted(entries):
                try:
                    _add(tar, member, entries[member], mtime)
                except ValueError as exc:
                    raise ArchiveError(f"cannot store {member!r} in a ustar archive: {exc}") from None


def _add(tar: tarfile.TarFile, member: str, data: Source | None, mtime: int) -> None:
    if data is None:
        tar.addfile(_info(member, 0, True, mtime))
    elif isinstance(data, bytes):
        tar.addfile(_info(member, len(data), False, mtime), io.BytesIO(data))
    else:
        with open(data, "rb") as source:
            tar.addfile(_info(member, os.fstat(source.fileno()).st_size, False, mtime), source)


def tar_gz_bytes(name: str, files: Sequence[tuple[str, Source]], mtime: int = FIXED_MTIME) -> bytes:
    """The archive's bytes: ``files`` (paths relative to ``name/``) sorted, with their dirs."""
    buffer = io.BytesIO()
    write_tar_gz(buffer, name, files, mtime)
    return buffer.getvalue()


def _sha256(data: Source) -> str:
    return jsonio.sha256_bytes(data) if isinstance(data, bytes) else jsonio.sha256_file(data)


def sums_text(files: Sequence[tuple[str, Source]]) -> str:
    """``sha256sum -c`` lines (``<hex>  <path>``) over ``files``, sorted by path (files hashed in chunks)."""
    return sums_lines({rel: _sha256(data) for rel, data in files})


def sums_lines(digests: Mapping[str, str]) -> str:
    """``sha256sum -c`` lines (``<hex>  <path>``) of ``digests`` (path -> SHA-256), sorted by path."""
    return "".join(f"{digests[rel]}  {rel}\n" for rel in sorted(digests))


def described(run: Run, name: str, digests: Mapping[str, str], epoch: int) -> list[tuple[str, bytes]]:
    """What describes an archive whose other files have ``digests`` (path relative to ``NAME/`` -> SHA-256), in
    the order each needs the one before: the RO-Crate (every file by name), the in-toto statement (every file
    before it by digest, the crate's included) and SHA256SUMS (every file but itself)."""
    digests = dict(digests)
    try:
        crate_bytes = jsonio.dumps(crate.crate(run, name, [*digests, STATEMENT, SUMS], provenance.reproduce_text(run),
                                               epoch)).encode("utf-8")
        digests[CRATE] = _sha256(crate_bytes)
        statement_bytes = jsonio.dumps(provenance.statement(run, name, digests, epoch)).encode("utf-8")
    except (provenance.ProvenanceError, crate.CrateError) as exc:
        raise ArchiveError(f"refusing to archive {run.root}: {exc}") from None
    digests[STATEMENT] = _sha256(statement_bytes)
    return [(CRATE, crate_bytes), (STATEMENT, statement_bytes), (SUMS, sums_lines(digests).encode("utf-8"))]


def build(run_dir: Path, output: Path, files: Sequence[Path], schema_files: Sequence[Path], spec_file: Path,
          workflow_files: Sequence[Path], epoch: int | None = None) -> Built:
    """Check the recorded gates and the file list, then write ``output`` and ``output.sha256`` atomically.

    ``epoch`` is the archive's one time (:mod:`rl_engine.evidence.epoch`); None reads ``SOURCE_DATE_EPOCH``.
    """
    name = archive_name(output)
    sidecar = output.with_name(output.name + ".sha256")
    for stale in (output, sidecar):
        stale.unlink(missing_ok=True)
    try:
        epoch = source_date_epoch() if epoch is None else source_date_epoch({"SOURCE_DATE_EPOCH": str(epoch)})
        provenance.require()
        crate.require()
    except (SourceDateEpochError, provenance.ProvenanceError, crate.CrateError) as exc:
        raise ArchiveError(str(exc)) from None
    if not run_dir.is_dir():
        raise ArchiveError(f"--run-dir {run_dir} is not a directory")
    if output.resolve().is_relative_to(run_dir.resolve()):
        raise ArchiveError(f"--output {output} must not lie inside the run directory it packs")
    run = Run.load(run_dir)
    check_gates(run)
    packed = given_files(run_dir, files)
    check_complete(run, {rel for rel, _ in packed})
    shipped = given_schemas(schema_files)
    check_schemas(run, shipped)
    workflow = given_workflow(workflow_files)
    environment = run.environment  # in the list: check_complete passed
    git = environment.get("git") if isinstance(environment, dict) else None
    from rl_engine.arith.spec_numpy import SPEC_VERSION

    spec = spec_file.read_bytes()
    try:
        check_spec_doc(spec, SPEC_VERSION, str(spec_file))
    except SpecDocError as exc:
        raise ArchiveError(str(exc)) from None
    reviewing = reviewing_text(name, git if isinstance(git, dict) else None, spec)
    members: list[tuple[str, Source]] = [*packed, *shipped, (SPEC_DOC, spec), *workflow,
                                         (REVIEWING, reviewing.encode("utf-8"))]
    digests = {rel: _sha256(data) for rel, data in members}  # each file hashed once (a capture can be gigabytes)
    members += described(run, name, digests, epoch)
    hashed: list[_HashingWriter] = []

    def write(handle: BinaryIO) -> None:
        hashed.append(_HashingWriter(handle))
        write_tar_gz(hashed[0], name, members, epoch)

    output.parent.mkdir(parents=True, exist_ok=True)
    jsonio.atomic_write_stream(output, write)
    digest = hashed[0].digest.hexdigest()
    jsonio.atomic_write_text(sidecar, f"{digest}  {output.name}\n")
    return Built(output, digest, tuple(sorted(rel for rel, _ in members)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_engine archive", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="the run directory: the top folder of the bundle")
    parser.add_argument("--output", required=True, type=Path, help="results/NAME.tar.gz")
    parser.add_argument("--schemas", required=True, nargs="+", type=Path, metavar="SCHEMA",
                        help="the *.schema.json files the run was validated with (shipped under schemas/)")
    parser.add_argument("--files", required=True, nargs="+", type=Path, metavar="FILE",
                        help="the run's files to pack, each inside --run-dir (the workflow's archive rule passes "
                             "its declared inputs); nothing else of the run directory is packed")
    parser.add_argument("--spec", required=True, type=Path, metavar="ARITHMETIC_MD",
                        help=f"the arithmetic specification the reports claim ({SPEC_SOURCE}), packed as {SPEC_DOC}")
    parser.add_argument("--workflow", required=True, nargs="+", type=Path, metavar="WORKFLOW_FILE",
                        help="the workflow's definition, packed under workflow/: its Snakefile and rules/*.smk "
                             "(the RO-Crate's main entity)")
    args = parser.parse_args(argv)
    try:
        built = build(args.run_dir, args.output, args.files, args.schemas, args.spec, args.workflow)
    except (ArchiveError, OSError) as exc:
        print(f"archive: {exc}", file=sys.stderr)
        return 1
    print(f"archive: {built.path} ({len(built.members)} files)\nsha256: {built.sha256}")
    return 0


__all__ = [
    "ArchiveError", "Built", "Source", "archive_name", "build", "check_complete", "check_gates", "check_schemas", "described",
    "given_files", "given_schemas", "given_workflow", "main", "reviewing_text", "sums_lines", "sums_text",
    "tar_gz_bytes", "write_tar_gz",
]
