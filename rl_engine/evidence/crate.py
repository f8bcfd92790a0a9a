"""The archive as a Workflow Run RO-Crate: ``NAME/ro-crate-metadata.json``.

The archive's top folder is an RO-Crate 1.3 (https://w3id.org/ro/crate/1.3) whose root data entity
declares the Workflow Run RO-Crate profiles 0.6 (Process Run Crate, Workflow Run Crate, Provenance
Run Crate: https://w3id.org/ro/wfrun/) and Workflow RO-Crate 1.1, so RO-Crate tools (WorkflowHub,
``rocrate-validator``, ``runcrate``) read what the run was:

* **the workflow**: the main entity ``workflow/Snakefile`` (``File``, ``SoftwareSourceCode``,
  ``ComputationalWorkflow``, ``HowTo``; language Snakemake), whose rules are its tools
  (``#rule-<rule>``, ``SoftwareApplication``, described by the verb they run) and its steps
  (``#step-<rule>``, ``HowToStep`` in workflow order); the rule files ``workflow/rules/*.smk`` are
  packed beside it. Its one input is the config (``#param-config``);
* **the run**: ``#run``, a ``CreateAction`` of the workflow, whose ``object`` is the config (a
  ``PropertyValue`` holding SUMMARY.md's ``reproduce.yaml``) and the files the run read from the
  repository (the schemas, ``arithmetic.md``) and whose ``result`` is every file a stage wrote;
* **each stage's run**: one ``CreateAction`` per stage of the run directory (one per planned
  topology), ``#stage-<label>``: ``instrument`` the rule's tool, ``object`` the archived files the
  rule declares as inputs (:data:`STAGE_INPUTS`, the ``input:`` of ``workflow/rules/*.smk``;
  ``tests/test_provenance.py`` holds the two together), ``result`` its outputs and its log, all
  ``CompletedActionStatus`` (an archive is built only from passing gates); and the ``archive``
  stage, whose result is what it adds (``REVIEWING.md``, ``provenance.intoto.json``,
  ``SHA256SUMS``). A ``ControlAction`` per stage run ties it to its step, and an ``OrganizeAction``
  (``#engine``) to Snakemake, the engine, whose version ``environment.json`` records;
* **the files**: every file of the archive but this one is a ``File`` data entity in the root's
  ``hasPart`` (name, media type); ``ro-crate-metadata.json`` is the crate's metadata descriptor,
  never a data entity. The crate names files, never digests: ``provenance.intoto.json`` and
  ``SHA256SUMS`` hold those, and they hold this file's.

The root's ``datePublished`` is :mod:`rl_engine.evidence.epoch`'s ``SOURCE_DATE_EPOCH``; the
actions carry no times (the evidence records none). The root's ``license`` (which Workflow
RO-Crate requires) is ``#license``, which says that rl_engine has published no license and that the
bundle grants none. No stage's time, host or random identifier enters the file, so it rebuilds
byte for byte.

The crate is built with ro-crate-py (``rocrate``, the ``provenance`` extra): its entities, the
RO-Crate 1.3 context and metadata descriptor, the Snakemake ``ComputerLanguage`` and the Workflow
RO-Crate profile. ``verify`` needs no RO-Crate package: :func:`crate_problems` checks the
structural rules of RO-Crate 1.3 that hold offline (the JSON-LD context, a flat ``@graph`` of
unique ``@id``\\ s whose local references resolve, the metadata descriptor and the root data
entity, the declared profiles, the main workflow) and that the crate lists exactly the archive's
files, with ``schemas/ro-crate-metadata.schema.json`` (shipped in the archive) beside.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote, unquote

from rl_engine import schemas
from rl_engine.evidence.epoch import rfc3339
from rl_engine.rundir import CRATE, REVIEWING, SCHEMA_DIR, SPEC_DOC, STATEMENT, SUMS, WORKFLOW_FILE, Run, Stage, run_stages

RO_CRATE_VERSION = "1.3"
RO_CRATE_CONTEXT = re.compile(r"^https://w3id\.org/ro/crate/1\.[0-9]+/context$")
RO_CRATE_SPEC = re.compile(r"^https://w3id\.org/ro/crate/1\.[0-9]+$")
WORKFLOW_RUN_CONTEXT = "https://w3id.org/ro/terms/workflow-run/context"
PROFILES: dict[str, tuple[str, str]] = {  # @id -> (name, version) of each profile the root conforms to
    "https://w3id.org/ro/wfrun/process/0.6": ("Process Run Crate", "0.6"),
    "https://w3id.org/ro/wfrun/workflow/0.6": ("Workflow Run Crate", "0.6"),
    "https://w3id.org/ro/wfrun/provenance/0.6": ("Provenance Run Crate", "0.6"),
    "https://w3id.org/workflowhub/workflow-ro-crate/1.1": ("Workflow RO-Crate", "1.1"),
}
MAIN_WORKFLOW = "workflow/Snakefile"
MAIN_TYPES = frozenset({"File", "SoftwareSourceCode", "ComputationalWorkflow"})
ROOT = "./"
SCHEMA = "ro-crate-metadata"  # schemas/ro-crate-metadata.schema.json
COMPLETED = "http://schema.org/CompletedActionStatus"
ARCHIVE_ADDS = (REVIEWING, STATEMENT, SUMS)  # the archive stage's results (the crate is the descriptor)

# The run's files each rule of workflow/rules/*.smk declares as inputs: (rule, index of its output as
# rundir.stages lists it, or None for all its outputs); "topology" names every planned topology's
# outputs, "logs" the run directory's stage logs, "schemas" the shipped schemas, "spec" arithmetic.md and
# "workflow" the packed workflow definition. The tests read the rules' input: blocks against this table.
Selector = tuple[str, int | None]
STAGE_INPUTS: dict[str, tuple[Selector, ...]] = {
    "environment": (),
    "regression": (),
    "case": (),
    "capture": (("case", 0),),
    "plan": (("case", 0),),
    "topology": (("plan", 0),),
    "parity": (),
    "validation": (("environment", 0), ("regression", 0), ("case", 0), ("plan", 0), ("topology", None),
                   ("capture", None), ("parity", None), ("schemas", None)),
    "crosscheck": (("validation", 0), ("topology", None)),
    "summary": (("validation", 0), ("crosscheck", 0), ("capture", None), ("parity", None)),
    "archive": (("environment", None), ("regression", None), ("case", 0), ("plan", 0), ("topology", None),
                ("validation", 0), ("crosscheck", 0), ("summary", 0), ("capture", None), ("parity", None),
                ("logs", None), ("schemas", None), ("spec", None), ("workflow", None)),
}
# The verb each rule runs (``python -m rl_engine <verb>``): its tool's description.
RULE_VERBS: dict[str, str] = {
    "environment": "env", "regression": "regression", "case": "case", "capture": "copy-capture", "plan": "plan",
    "topology": "launch", "parity": "parity", "validation": "validate", "crosscheck": "crosscheck",
    "summary": "summary", "archive": "archive",
}
MEDIA_TYPES = {".json": "application/json", ".md": "text/markdown", ".log": "text/plain", ".txt": "text/plain",
               ".xml": "application/xml", ".f32": "application/octet-stream", ".png": "image/png",
               ".safetensors": "application/octet-stream", ".smk": "text/plain"}
EXTRA = "provenance"


class CrateError(ValueError):
    """A crate that cannot be built (a missing package, files it cannot describe)."""


def media_type(rel: str) -> str:
    """The media type a file's name says (``text/plain`` for SHA256SUMS and the Snakefile)."""
    if rel.endswith(".schema.json"):
        return "application/schema+json"
    return MEDIA_TYPES.get(PurePosixPath(rel).suffix, "text/plain")


def entity_id(rel: str) -> str:
    """A file's ``@id``: its path relative to the crate's root, percent-encoded as RO-Crate asks."""
    return quote(rel, safe="/")


def _relative(run: Run, paths: Sequence[Path]) -> list[str]:
    return [path.relative_to(run.root).as_posix() for path in paths]


def _selected(run: Run, selector: Selector, stages: Sequence[Stage], files: Collection[str]) -> list[str]:
    """The archived files ``selector`` (a :data:`STAGE_INPUTS` entry) names."""
    rule, index = selector
    if rule == "schemas":
        return sorted(rel for rel in files if rel.startswith(f"{SCHEMA_DIR}/"))
    if rule == "spec":
        return [SPEC_DOC]
    if rule == "workflow":
        return sorted(rel for rel in files if WORKFLOW_FILE.match(rel))
    if rule == "logs":
        return _relative(run, [stage.log for stage in stages])
    outputs = [path for stage in stages if stage.rule == rule
               for path in (stage.outputs if index is None else stage.outputs[index:index + 1])]
    return _relative(run, outputs)


def stage_files(run: Run, files: Collection[str]) -> list[tuple[Stage, list[str], list[str]]]:
    """Each stage of the run directory with the archived files it read (``object``) and wrote (``result``:
    its outputs and its log), in workflow order."""
    stages = run_stages(run.stages())
    present = set(files)
    out = []
    for stage in stages:
        read = [rel for selector in STAGE_INPUTS[stage.rule] for rel in _selected(run, selector, stages, files)]
        wrote = _relative(run, [*stage.outputs, stage.log])
        out.append((stage, [rel for rel in dict.fromkeys(read) if rel in present],
                    [rel for rel in wrote if rel in present]))
    return out


def staged_runs(run: Run, files: Collection[str]) -> list[tuple[str, str, list[str], list[str]]]:
    """``(rule, label, read, wrote)`` of each stage run the crate describes: the run directory's stages
    (:func:`stage_files`), then the archive's, which reads what its rule declares and writes what it adds."""
    present = set(files)
    staged = [(stage.rule, stage.label, read, wrote) for stage, read, wrote in stage_files(run, present)]
    read = [rel for selector in STAGE_INPUTS["archive"] for rel in _selected(run, selector, run_stages(run.stages()), present)]
    staged.append(("archive", "archive", [rel for rel in dict.fromkeys(read) if rel in present],
                   [rel for rel in ARCHIVE_ADDS if rel in present]))
    return staged


def _library() -> tuple[Any, Any]:
    try:
        from rocrate.model.contextentity import ContextEntity
        from rocrate.rocrate import ROCrate
    except ImportError as exc:
        raise CrateError(f"the archive's {CRATE} is written with ro-crate-py (rocrate), which cannot be imported "
                         f"({exc}); install it: pip install -e '.[{EXTRA}]' (the test extra brings it too)") from None
    return ROCrate, ContextEntity


def require() -> None:
    """:class:`CrateError` naming the extra to install when ro-crate-py cannot be imported."""
    _library()


def _ref(entity: Any) -> dict[str, str]:
    return {"@id": entity if isinstance(entity, str) else entity.id}


def crate(run: Run, name: str, files: Collection[str], config_text: str, epoch: int) -> dict[str, Any]:
    """The crate of archive ``name`` whose files (paths relative to ``NAME/``) are ``files`` plus this one;
    ``config_text`` is the run's reproduce.yaml, ``epoch`` the archive's time (module docstring)."""
    ROCrate, ContextEntity = _library()
    present = sorted(set(files) - {CRATE})
    if MAIN_WORKFLOW not in present:
        raise CrateError(f"{MAIN_WORKFLOW} is not among the archive's files: the crate's main entity is the workflow")
    book = ROCrate(version=RO_CRATE_VERSION)
    book.metadata.extra_contexts.append(WORKFLOW_RUN_CONTEXT)
    root = book.root_dataset
    root["name"] = name
    root["description"] = ("The evidence of one rl_engine validation run: environment, focused regression, plan, one "
                           "report per TP x CP topology with its raw float32 tensors, the validation and "
                           "cross-topology gates, SUMMARY.md, the stage logs, the schemas, the arithmetic "
                           "specification and the workflow that made them.")
    root["datePublished"] = rfc3339(epoch)
    root["license"] = book.add(ContextEntity(book, "#license", properties={
        "@type": "CreativeWork", "name": "No license stated",
        "description": "rl_engine has published no license; this bundle grants none. Ask its sender."}))

    entities: dict[str, Any] = {}
    for rel in present:
        properties = {"name": PurePosixPath(rel).name, "encodingFormat": media_type(rel)}
        if rel == MAIN_WORKFLOW:
            properties["name"] = "rl_engine evidence workflow"
            properties["@type"] = ["File", "SoftwareSourceCode", "ComputationalWorkflow", "HowTo"]  # it has steps
            entities[rel] = book.add_workflow(dest_path=entity_id(rel), main=True, lang="snakemake",
                                              properties=properties)
        else:
            entities[rel] = book.add_file(dest_path=entity_id(rel), properties=properties)
    for profile, (title, version) in PROFILES.items():  # add_workflow added Workflow RO-Crate's: the same
        if book.get(profile) is None:
            book.add(ContextEntity(book, profile, properties={"@type": ["CreativeWork", "Profile"], "name": title,
                                                              "version": version}))
    root["conformsTo"] = [_ref(profile) for profile in PROFILES]
    workflow = entities[MAIN_WORKFLOW]
    parameter = book.add(ContextEntity(book, "#param-config", properties={
        "@type": "FormalParameter", "name": "config", "additionalType": "Text",
        "description": "The workflow's config: YAML over the repository's config.yaml (snakemake --configfile)",
        "conformsTo": {"@id": "https://bioschemas.org/profiles/FormalParameter/1.0-RELEASE"}}))
    workflow["input"] = [parameter]
    config = book.add(ContextEntity(book, "#config", properties={
        "@type": "PropertyValue", "name": "config", "value": config_text, "exampleOfWork": _ref(parameter),
        "description": "The config keys that give this run's case (SUMMARY.md's reproduce.yaml)"}))

    staged = staged_runs(run, present)
    rules = list(dict.fromkeys(rule for rule, _, _, _ in staged))
    tools, steps = {}, {}
    for position, rule in enumerate(rules):
        tools[rule] = book.add(ContextEntity(book, f"#rule-{rule}", properties={
            "@type": "SoftwareApplication", "name": rule,
            "description": f"the workflow's {rule} rule: python -m rl_engine {RULE_VERBS[rule]}"}))
        steps[rule] = book.add(ContextEntity(book, f"#step-{rule}", properties={
            "@type": "HowToStep", "name": rule, "position": position, "workExample": _ref(tools[rule])}))
    workflow["hasPart"] = [_ref(tools[rule]) for rule in rules]
    workflow["step"] = [_ref(steps[rule]) for rule in rules]

    actions, controls, produced = [], [], []
    for rule, label, read, wrote in staged:
        action = book.add_action(tools[rule], identifier=f"#stage-{label.replace(' ', '-')}",
                                 object=[entities[rel] for rel in read], result=[entities[rel] for rel in wrote],
                                 properties={"name": f"{label} of {name}", "actionStatus": _ref(COMPLETED)})
        actions.append(action)
        produced += wrote
        controls.append(book.add(ContextEntity(book, f"#control-{label.replace(' ', '-')}", properties={
            "@type": "ControlAction", "name": f"orchestrate {label}", "instrument": _ref(steps[rule]),
            "object": _ref(action)})))
    made = set(produced)
    inputs = [entities[rel] for rel in present if rel not in made and not WORKFLOW_FILE.match(rel)]
    run_action = book.add_action(workflow, identifier="#run", object=[config, *inputs],
                                 result=[entities[rel] for rel in present if rel in made],
                                 properties={"name": f"run {name} of the rl_engine evidence workflow",
                                             "actionStatus": _ref(COMPLETED)})
    environment = run.environment if isinstance(run.environment, dict) else {}
    packages = environment.get("packages") if isinstance(environment.get("packages"), dict) else {}
    engine_properties: dict[str, Any] = {"@type": "SoftwareApplication", "name": "Snakemake",
                                         "url": {"@id": "https://snakemake.readthedocs.io"}}
    if isinstance(packages.get("snakemake"), str):
        engine_properties["softwareVersion"] = packages["snakemake"]
    engine = book.add(ContextEntity(book, "#snakemake", properties=engine_properties))
    organize = book.add(ContextEntity(book, "#engine", properties={
        "@type": "OrganizeAction", "name": f"Snakemake's run of {name}", "instrument": _ref(engine),
        "object": [_ref(c) for c in controls], "result": _ref(run_action)}))
    root["mentions"] = [_ref(run_action), *(_ref(a) for a in actions), _ref(organize)]
    return book.metadata.generate()


# ----- the checks verify runs (no RO-Crate package needed) ------------------------------------------
def _ids(value: Any) -> list[str]:
    """The ``@id``\\ s a property value references (one reference or a list of them)."""
    items = value if isinstance(value, list) else [value]
    return [item["@id"] for item in items if isinstance(item, dict) and isinstance(item.get("@id"), str)]


def _types(entity: Mapping[str, Any]) -> set[str]:
    kind = entity.get("@type")
    return {kind} if isinstance(kind, str) else {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()


def _absolute(identifier: str) -> bool:
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", identifier))


def _graph(doc: Any, problems: list[str]) -> dict[str, dict[str, Any]]:
    """The ``@graph``'s entities by ``@id``; a duplicate, an entity without one and a nested entity are problems."""
    where = CRATE
    context = doc.get("@context")
    contexts = context if isinstance(context, list) else [context]
    if not any(isinstance(c, str) and RO_CRATE_CONTEXT.match(c) for c in contexts):
        problems.append(f"{where}: @context {context!r} names no RO-Crate context (https://w3id.org/ro/crate/1.x/context)")
    graph = doc.get("@graph")
    if not isinstance(graph, list):
        problems.append(f"{where}: @graph is not a list of entities")
        return {}
    entities: dict[str, dict[str, Any]] = {}
    for index, entity in enumerate(graph):
        identifier = entity.get("@id") if isinstance(entity, dict) else None
        if not isinstance(identifier, str) or not identifier:
            problems.append(f"{where}: @graph[{index}] has no @id")
            continue
        if identifier in entities:
            problems.append(f"{where}: @graph lists {identifier!r} twice (an @id names one entity)")
            continue
        if not _types(entity):
            problems.append(f"{where}: {identifier!r} has no @type")
        for key, value in entity.items():
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, dict) and set(item) != {"@id"}:
                    problems.append(f"{where}: {identifier!r}.{key} nests an object; an RO-Crate's @graph is flat "
                                    "(other entities are referenced by {\"@id\": ...})")
        entities[identifier] = entity
    return entities


def crate_problems(doc: Any, files: Collection[str], schema_dir: Path) -> list[str]:
    """Why ``doc`` (the parsed ``ro-crate-metadata.json``) is not a Workflow Run RO-Crate of an archive whose files
    (paths relative to ``NAME/``) are ``files``: every problem, each naming what is wrong."""
    where = CRATE
    problems = schemas.document_problems(doc, SCHEMA, schema_dir, where)
    if not isinstance(doc, dict):
        return problems
    entities = _graph(doc, problems)
    descriptor = entities.get(CRATE, {})
    if not descriptor:
        problems.append(f"{where}: no metadata descriptor (an entity with @id {CRATE!r})")
    elif "CreativeWork" not in _types(descriptor):
        problems.append(f"{where}: the metadata descriptor's @type is not CreativeWork")
    specs = _ids(descriptor.get("conformsTo"))
    if descriptor and not any(RO_CRATE_SPEC.match(spec) for spec in specs):
        problems.append(f"{where}: the metadata descriptor's conformsTo {specs} names no RO-Crate version "
                        "(https://w3id.org/ro/crate/1.x)")
    about = _ids(descriptor.get("about"))
    if descriptor and about != [ROOT]:
        problems.append(f"{where}: the metadata descriptor is about {about}, not the root data entity {ROOT!r}")
    root = entities.get(ROOT, {})
    if not root:
        problems.append(f"{where}: no root data entity (@id {ROOT!r})")
        return problems
    if "Dataset" not in _types(root):
        problems.append(f"{where}: the root data entity's @type is not Dataset")
    for key in ("name", "description", "datePublished", "license"):
        if root.get(key) in (None, "", []):
            problems.append(f"{where}: the root data entity has no {key}")
    declared = _ids(root.get("conformsTo"))
    for profile in PROFILES:
        if profile not in declared:
            problems.append(f"{where}: the root data entity does not conform to {profile} ({PROFILES[profile][0]})")
        elif profile not in entities:
            problems.append(f"{where}: the profile {profile} the root conforms to has no entity in @graph")
    for identifier, entity in entities.items():
        for key, value in entity.items():
            for target in _ids(value) if key != "@id" else []:
                if not _absolute(target) and target not in entities:
                    problems.append(f"{where}: {identifier!r}.{key} references {target!r}, which is no entity of "
                                    "the crate")
    problems += _file_problems(entities, root, files)
    main = _ids(root.get("mainEntity"))
    workflow = entities.get(main[0], {}) if len(main) == 1 else {}
    if not workflow or not MAIN_TYPES <= _types(workflow) or not _ids(workflow.get("programmingLanguage")):
        problems.append(f"{where}: the root's mainEntity {main} is not a workflow (a data entity of types "
                        f"{sorted(MAIN_TYPES)} with a programmingLanguage)")
    for identifier, entity in entities.items():
        if _types(entity) & {"CreateAction", "ControlAction", "OrganizeAction"} and not _ids(entity.get("instrument")):
            problems.append(f"{where}: the action {identifier!r} has no instrument")
    return problems


def _file_problems(entities: Mapping[str, dict[str, Any]], root: Mapping[str, Any], files: Collection[str]) -> list[str]:
    """The crate's data entities against the archive's files: every file but the crate's own, each once."""
    where = CRATE
    expected = set(files) - {CRATE}
    parts: list[str] = []
    pending, seen = list(_ids(root.get("hasPart"))), set()
    while pending:  # the root's parts, and a Dataset's own parts (a directory of the crate)
        identifier = pending.pop(0)
        if identifier in seen:
            continue
        seen.add(identifier)
        entity = entities.get(identifier, {})
        if "Dataset" in _types(entity):
            pending += _ids(entity.get("hasPart"))
        else:
            parts.append(identifier)
    listed = {unquote(identifier) for identifier in parts}
    typed = {unquote(i) for i, e in entities.items() if "File" in _types(e)}
    problems = []
    for rel in sorted(expected - listed):
        problems.append(f"{where}: does not list {rel}, a file of the archive (missing from the root's hasPart)")
    for rel in sorted((listed | typed) - expected):
        problems.append(f"{where}: lists {rel}, which is not a file of the archive (extra data entity)")
    for rel in sorted((listed & expected) - typed):
        problems.append(f"{where}: {rel} is listed but its entity is not of @type File")
    return problems


__all__ = ["CrateError", "PROFILES", "STAGE_INPUTS", "crate", "crate_problems", "media_type", "require", "stage_files",
           "staged_runs"]
