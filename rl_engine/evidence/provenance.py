"""The archive's provenance: an in-toto Statement v1 carrying the SLSA provenance v1 predicate.

``NAME/provenance.intoto.json`` says, in the format supply-chain tools read (``in-toto``,
``slsa-verifier``'s parsers, policy engines), which files the run produced and how:

* ``subject``: every file of the archive, by its path relative to ``NAME/`` and its SHA-256, but
  the two that cannot be listed (:data:`NOT_SUBJECTS`): the statement itself (a file cannot hold
  its own digest) and ``SHA256SUMS`` (written after the statement, it lists the statement's
  digest). ``ro-crate-metadata.json`` is a subject: the crate names files, never digests, so it is
  written first;
* ``predicate.buildDefinition``: ``buildType`` :data:`BUILD_TYPE` (this workflow; its parameters
  are documented in docs/reviewing.md), ``externalParameters`` (what a person chose: the
  workflow's entry point ``workflow/Snakefile``, ``config``, the config keys that give this run's
  case, i.e. SUMMARY.md's ``reproduce.yaml``, and ``sourceDateEpoch``, the time every date of the
  archive holds), ``internalParameters`` (what the workflow derived from them: the resolved
  ``case`` of ``plan.json``, its ``caseId``, and the ``commands`` the evidence records: the focused
  regression's and each topology's ``torchrun``) and ``resolvedDependencies`` (rl_engine's source
  as the git commit ``environment.json`` records, digest ``gitCommit``, annotated with the branch
  and whether the working tree was dirty; absent when no git state was recorded);
* ``predicate.runDetails``: ``builder.id`` :data:`BUILDER_ID` (a local ``snakemake`` run; no SLSA
  build level is claimed and the statement is not signed), ``builder.version`` (rl_engine,
  snakemake and Python as ``environment.json`` records them), ``metadata`` (``invocationId`` the
  run name, ``startedOn`` and ``finishedOn`` both :mod:`rl_engine.evidence.epoch`'s
  ``SOURCE_DATE_EPOCH``: the archive records no clock reading) and ``byproducts``
  (``environment.json``: its digest and the machine it names).

The statement is built with the in-toto project's Python bindings (``in-toto-attestation``,
protobuf messages: the field names, the RFC 3339 timestamps and ``Statement.validate``). Protobuf's
``Struct`` holds every number as a double (``7`` comes back ``7.0``, an integer over 2**53 rounded),
so the free-form objects (the two parameter objects and the annotations) are put back as the
evidence holds them after the library's JSON is made; the result is parsed back into the
library's messages, and must equal the library's statement. The package is needed to build an
archive (the ``provenance`` extra), never to check one: :func:`statement_problems` is what
``verify`` runs, with the JSON schemas shipped in the archive (``schemas/provenance.schema.json``:
the in-toto Statement and the SLSA predicate, written from their specifications) and the
archive's own files.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from rl_engine import schemas
from rl_engine.evidence.epoch import MAX_EPOCH, rfc3339
from rl_engine.rundir import ENVIRONMENT, STATEMENT, SUMS, Run

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
# rl_engine has no published home yet: the reserved top-level domain .invalid (RFC 2606) says that these
# TypeURIs name this project's build type and builder without resolving anywhere; docs/reviewing.md
# documents both, as SLSA asks of the page they would resolve to.
BUILD_TYPE = "https://rl-engine.invalid/buildtypes/evidence-workflow/v1"
BUILDER_ID = "https://rl-engine.invalid/builders/local-snakemake/v1"
WORKFLOW_ENTRY = "workflow/Snakefile"
SCHEMA = "provenance"  # schemas/provenance.schema.json: the Statement with the SLSA v1 predicate
NOT_SUBJECTS = frozenset({STATEMENT, SUMS})  # the statement cannot list itself; SHA256SUMS lists the statement
EXTRA = "provenance"  # the pyproject extra that installs the packages the archive verb builds with


class ProvenanceError(ValueError):
    """A provenance statement that cannot be built (a missing package, evidence it cannot describe)."""


def _library() -> tuple[Any, Any, Any, Any, Any]:
    """The in-toto bindings' Statement, ResourceDescriptor, provenance messages, Statement proto and protobuf's
    JSON mapping, or :class:`ProvenanceError` naming the extra to install."""
    try:
        from google.protobuf import json_format
        from in_toto_attestation.predicates.provenance.v1 import provenance_pb2
        from in_toto_attestation.v1 import statement_pb2
        from in_toto_attestation.v1.resource_descriptor import ResourceDescriptor
        from in_toto_attestation.v1.statement import Statement
    except ImportError as exc:
        raise ProvenanceError(f"the archive's {STATEMENT} is written with the in-toto-attestation package, which "
                              f"cannot be imported ({exc}); install it: pip install -e '.[{EXTRA}]' (the test "
                              "extra brings it too)") from None
    return Statement, ResourceDescriptor, provenance_pb2, statement_pb2, json_format


def require() -> None:
    """:class:`ProvenanceError` naming the extra to install when the in-toto bindings cannot be imported."""
    _library()


def reproduce_text(run: Run) -> str:
    """SUMMARY.md's ``reproduce.yaml`` of the run: the config keys that give its case."""
    from rl_engine.evidence.summary import SummaryError, load_evidence, reproduce_config

    try:
        return reproduce_config(load_evidence(run))
    except SummaryError as exc:
        raise ProvenanceError(f"cannot state the run's config: {exc}") from None


def external_parameters(run: Run, epoch: int) -> dict[str, Any]:
    """What a person chose: the workflow's entry point, the config keys of this run's case, the time."""
    return {"workflow": WORKFLOW_ENTRY, "config": yaml.safe_load(reproduce_text(run)), "sourceDateEpoch": epoch}


def internal_parameters(run: Run) -> dict[str, Any]:
    """What the workflow derived: the resolved case, its id and the commands the evidence records."""
    plan = run.plan if isinstance(run.plan, dict) else {}
    regression = run.regression if isinstance(run.regression, dict) else {}
    return {"case": plan.get("case"), "caseId": plan.get("case_id"),
            "commands": {"regression": regression.get("command"),
                         "topologies": {item.topology.stem: item.command for item in run.planned}}}


def _git(run: Run) -> dict[str, Any]:
    env = run.environment if isinstance(run.environment, dict) else {}
    git = env.get("git")
    return git if isinstance(git, dict) else {}


def source_dependency(run: Run) -> dict[str, Any] | None:
    """rl_engine's source as the git commit ``environment.json`` records (None without git state)."""
    git = _git(run)
    if git.get("available") is not True or not isinstance(git.get("commit"), str):
        return None
    return {"name": "rl_engine", "digest": {"gitCommit": git["commit"]},
            "annotations": {"branch": git.get("branch"), "dirty": git.get("dirty"),
                            "untrackedFiles": git.get("untracked_files")}}


def builder_version(run: Run) -> dict[str, str]:
    """``builder.version``: rl_engine, snakemake and Python as ``environment.json`` records them."""
    env = run.environment if isinstance(run.environment, dict) else {}
    packages = env.get("packages") if isinstance(env.get("packages"), dict) else {}
    python = env.get("python") if isinstance(env.get("python"), dict) else {}
    found = {"rl_engine": packages.get("rl_engine"), "snakemake": packages.get("snakemake"),
             "python": python.get("version")}
    return {name: value for name, value in found.items() if isinstance(value, str)}


def environment_annotations(run: Run) -> dict[str, Any]:
    """The machine ``environment.json`` names: host, platform, CPU, Python, torch, CUDA and GPUs."""
    env = run.environment if isinstance(run.environment, dict) else {}
    torch = env.get("torch") if isinstance(env.get("torch"), dict) else {}
    python = env.get("python") if isinstance(env.get("python"), dict) else {}
    return {"hostname": env.get("hostname"), "platform": env.get("platform"), "cpu": env.get("cpu"),
            "python": python.get("version"), "torch": torch.get("version"), "cuda": torch.get("cuda"),
            "gpus": torch.get("gpus")}


def statement(run: Run, name: str, digests: Mapping[str, str], epoch: int) -> dict[str, Any]:
    """The statement of archive ``name``: ``digests`` (path relative to ``NAME/`` -> SHA-256) are its subjects,
    ``epoch`` its time. Built and checked with the in-toto bindings (module docstring)."""
    Statement, ResourceDescriptor, provenance_pb2, statement_pb2, json_format = _library()
    listed = sorted(set(digests) & NOT_SUBJECTS)
    if listed:
        raise ProvenanceError(f"{', '.join(listed)} cannot be subjects of {STATEMENT} (module docstring)")
    if ENVIRONMENT not in digests:
        raise ProvenanceError(f"{ENVIRONMENT} is not among the archive's files; the statement's byproducts name it")
    subjects = [ResourceDescriptor(name=rel, digest={"sha256": digest}).pb for rel, digest in sorted(digests.items())]
    external, internal = external_parameters(run, epoch), internal_parameters(run)
    source = source_dependency(run)
    annotations = {"environment": environment_annotations(run), "source": source["annotations"] if source else None}

    predicate = provenance_pb2.Provenance()
    definition = predicate.build_definition
    definition.build_type = BUILD_TYPE
    if source is not None:
        definition.resolved_dependencies.append(
            ResourceDescriptor(name=source["name"], digest=source["digest"], annotations=source["annotations"]).pb)
    details = predicate.run_details
    details.builder.id = BUILDER_ID
    details.builder.version.update(builder_version(run))
    details.metadata.invocation_id = name
    details.metadata.started_on.FromSeconds(epoch)
    details.metadata.finished_on.FromSeconds(epoch)
    details.byproducts.append(ResourceDescriptor(name=ENVIRONMENT, digest={"sha256": digests[ENVIRONMENT]},
                                                 media_type="application/json",
                                                 annotations=annotations["environment"]).pb)
    body = json_format.MessageToDict(predicate)
    body["buildDefinition"]["externalParameters"] = external  # as the evidence holds them (module docstring)
    body["buildDefinition"]["internalParameters"] = internal
    if source is not None:
        body["buildDefinition"]["resolvedDependencies"][0]["annotations"] = annotations["source"]
    body["runDetails"]["byproducts"][0]["annotations"] = annotations["environment"]
    built = Statement(subjects, PREDICATE_TYPE, body)
    try:
        built.validate()
        doc = json_format.MessageToDict(built.pb)
        doc["predicate"] = body
        again = json_format.ParseDict(doc, statement_pb2.Statement())
        json_format.ParseDict(body, provenance_pb2.Provenance())  # the predicate's fields are the SLSA message's
    except (ValueError, json_format.ParseError) as exc:
        raise ProvenanceError(f"the in-toto bindings refuse the statement: {exc}") from None
    if again != built.pb:
        raise ProvenanceError("the statement's JSON does not parse back to the in-toto bindings' statement")
    return doc


# ----- the checks verify runs (no in-toto package needed) -------------------------------------------
def statement_problems(doc: Any, run: Run, name: str, files: Mapping[str, str], schema_dir: Path) -> list[str]:
    """Why ``doc`` (the parsed ``provenance.intoto.json``) is not the statement of archive ``name`` whose files
    are ``files`` (path relative to ``NAME/`` -> SHA-256): every problem, each naming what is wrong."""
    where = STATEMENT
    problems = schemas.document_problems(doc, SCHEMA, schema_dir, where)
    if not isinstance(doc, dict):
        return problems
    if doc.get("_type") != STATEMENT_TYPE:
        problems.append(f"{where}: _type is {doc.get('_type')!r}, not the in-toto Statement v1 {STATEMENT_TYPE!r}")
    if doc.get("predicateType") != PREDICATE_TYPE:
        problems.append(f"{where}: predicateType is {doc.get('predicateType')!r}, not the SLSA provenance v1 "
                        f"predicate {PREDICATE_TYPE!r}")
    problems += _subject_problems(doc.get("subject"), files)
    predicate = doc.get("predicate") if isinstance(doc.get("predicate"), dict) else {}
    problems += _predicate_problems(predicate, run, name, files)
    return problems


def _subject_problems(subject: Any, files: Mapping[str, str]) -> list[str]:
    where = f"{STATEMENT}: subject"
    if not isinstance(subject, list):
        return [f"{where}: not a list of resource descriptors"]
    expected = {rel: digest for rel, digest in files.items() if rel not in NOT_SUBJECTS}
    problems: list[str] = []
    listed: dict[str, Any] = {}
    for index, entry in enumerate(subject):
        rel = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(rel, str):
            problems.append(f"{where}[{index}]: has no name (every subject is a file of the archive by its path)")
        elif rel in listed:
            problems.append(f"{where}[{index}]: lists {rel} a second time")
        else:
            listed[rel] = entry.get("digest")
    for rel in sorted(set(listed) & NOT_SUBJECTS):
        problems.append(f"{where}: lists {rel}, which cannot be a subject: the statement cannot hold its own digest "
                        f"and {SUMS} holds the statement's (extra subject)")
    for rel in sorted(set(listed) - set(expected) - NOT_SUBJECTS):
        problems.append(f"{where}: lists {rel}, which is not a file of the archive (extra subject)")
    for rel in sorted(set(expected) - set(listed)):
        problems.append(f"{where}: does not list {rel}, a file of the archive (missing subject)")
    for rel in sorted(set(expected) & set(listed)):
        digest = listed[rel].get("sha256") if isinstance(listed[rel], dict) else None
        if digest != expected[rel]:
            problems.append(f"{where}: {rel}: digest.sha256 is {digest!r} but the file's SHA-256 is {expected[rel]} "
                            "(changed digest or changed file)")
    return problems


def _predicate_problems(predicate: dict[str, Any], run: Run, name: str, files: Mapping[str, str]) -> list[str]:
    where = f"{STATEMENT}: predicate"
    problems: list[str] = []
    definition = predicate.get("buildDefinition") if isinstance(predicate.get("buildDefinition"), dict) else {}
    details = predicate.get("runDetails") if isinstance(predicate.get("runDetails"), dict) else {}
    if definition.get("buildType") != BUILD_TYPE:
        problems.append(f"{where}.buildDefinition.buildType is {definition.get('buildType')!r}, not this workflow's "
                        f"{BUILD_TYPE!r}")
    metadata = details.get("metadata") if isinstance(details.get("metadata"), dict) else {}
    if metadata.get("invocationId") != name:
        problems.append(f"{where}.runDetails.metadata.invocationId is {metadata.get('invocationId')!r}, not the "
                        f"archive's run name {name!r}")
    external = definition.get("externalParameters") if isinstance(definition.get("externalParameters"), dict) else {}
    epoch = external.get("sourceDateEpoch")
    if isinstance(epoch, int) and not isinstance(epoch, bool) and 0 <= epoch <= MAX_EPOCH:
        for key in ("startedOn", "finishedOn"):
            if metadata.get(key) != rfc3339(epoch):
                problems.append(f"{where}.runDetails.metadata.{key} is {metadata.get(key)!r}, not the "
                                f"externalParameters.sourceDateEpoch {epoch} ({rfc3339(epoch)}) the archive's "
                                "times are")
    else:
        problems.append(f"{where}.buildDefinition.externalParameters.sourceDateEpoch is {epoch!r}, not a number "
                        f"of seconds from 0 to {MAX_EPOCH}")
    deps = definition.get("resolvedDependencies") or []
    commits = [d.get("digest", {}).get("gitCommit") for d in deps if isinstance(d, dict) and isinstance(d.get("digest"), dict)
               and d.get("name") == "rl_engine"]
    source = source_dependency(run)
    if source is None and commits:
        problems.append(f"{where}.buildDefinition.resolvedDependencies names rl_engine at commit {commits[0]!r} but "
                        f"{ENVIRONMENT} records no git state")
    if source is not None and commits != [source["digest"]["gitCommit"]]:
        problems.append(f"{where}.buildDefinition.resolvedDependencies: rl_engine's gitCommit is "
                        f"{commits[0] if commits else None!r} but {ENVIRONMENT} records commit "
                        f"{source['digest']['gitCommit']}")
    byproducts = details.get("byproducts") or []
    env = [b for b in byproducts if isinstance(b, dict) and b.get("name") == ENVIRONMENT]
    digest = env[0].get("digest", {}).get("sha256") if env and isinstance(env[0].get("digest"), dict) else None
    if digest != files.get(ENVIRONMENT):
        problems.append(f"{where}.runDetails.byproducts: {ENVIRONMENT}'s digest is {digest!r}, not the file's "
                        f"SHA-256 {files.get(ENVIRONMENT)}")
    return problems


__all__ = [
    "BUILDER_ID", "BUILD_TYPE", "NOT_SUBJECTS", "PREDICATE_TYPE", "ProvenanceError", "SCHEMA", "STATEMENT_TYPE",
    "reproduce_text", "require", "statement", "statement_problems",
]
