"""JSON Schemas (draft 2020-12) of every artifact: loading, cross-file ``$ref`` and validation.

Schemas live in ``schemas/<name>.schema.json`` and carry no ``$id``: their identity is their
file name. Shared pieces sit in ``defs.schema.json`` and are referenced relatively
(``defs.schema.json#/$defs/...``), which resolves against the location a validator read the
schema from, so any standard validator (``check-jsonschema --schemafile
schemas/report.schema.json tp1-cp1.json``) finds the referenced file beside it, offline. (An
absolute ``$id`` on a domain would make validators fetch it from there; a relative ``$id`` is
resolved against the working directory by some validators.) A directory of schemas (the repository's, or the
copy inside an archive) is loaded as one registry keyed by file name, so a reviewer validates
with exactly the schemas that were shipped.

:func:`write_validated` is how every artifact is written: validated against its schema first,
then strict JSON atomically; an artifact that does not match is never written.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from rl_engine import jsonio


class SchemaError(ValueError):
    """A schema that is missing or itself invalid."""


class ArtifactSchemaError(ValueError):
    """An artifact that does not match its schema; it was not written."""


def repo_schema_dir() -> Path:
    """``schemas/`` of the source tree (the package is installed editable from it)."""
    return Path(__file__).resolve().parent.parent / "schemas"


def schema_id(name: str) -> str:
    """The registry key of a schema: its file name, what relative ``$ref``s name."""
    return f"{name}.schema.json"


@lru_cache(maxsize=1)
def _own_texts(directory: str) -> dict[str, str]:
    """The repository's own schema files, by file name, as text."""
    return {path.name: path.read_text(encoding="utf-8") for path in sorted(Path(directory).glob("*.schema.json"))}


def _load_dir(directory: Path) -> dict[str, dict[str, Any]]:
    """Every schema of ``directory``. Another directory's (an archive's shipped schemas) are each
    checked against the draft 2020-12 metaschema here, unless the file is byte for byte the
    repository's own of that name; the repository's own are checked by ``tests/test_schemas.py``
    instead, since the check costs about 1.5 s in every process that validates (each rank, each
    verb, each parse of the Snakefile; about 0.5 s of every ``verify`` of an archive whose shipped
    schemas are this checkout's)."""
    schemas: dict[str, dict[str, Any]] = {}
    own_dir = repo_schema_dir().resolve()
    own = directory.resolve() == own_dir
    own_texts = {} if own else _own_texts(str(own_dir))
    for path in sorted(directory.glob("*.schema.json")):
        text = path.read_text(encoding="utf-8")
        schema = json.loads(text)
        name = path.name[: -len(".schema.json")]
        if "$id" in schema:
            raise SchemaError(f"{path}: $id={schema['$id']!r} must be removed: a schema is known by its file "
                              "name, and its $refs resolve against the files beside it")
        try:
            if not own and own_texts.get(path.name) != text:
                Draft202012Validator.check_schema(schema)
        except Exception as exc:  # jsonschema.SchemaError
            raise SchemaError(f"{path}: not a valid draft 2020-12 schema: {exc}") from None
        schemas[name] = schema
    return schemas


@lru_cache(maxsize=8)
def _cached(directory: str) -> tuple[dict[str, dict[str, Any]], Registry]:
    schemas = _load_dir(Path(directory))
    registry: Registry = Registry().with_resources(
        (schema_id(n), Resource.from_contents(s, default_specification=DRAFT202012))
        for n, s in schemas.items()
    )
    return schemas, registry


def load(directory: str | Path | None = None) -> tuple[dict[str, dict[str, Any]], Registry]:
    """All schemas of a directory and a registry resolving their ``$id`` references."""
    return _cached(str(Path(directory or repo_schema_dir()).resolve()))


def validator(name: str, directory: str | Path | None = None) -> Draft202012Validator:
    schemas, registry = load(directory)
    if name not in schemas:
        raise SchemaError(f"no schema named {name!r} in {directory or repo_schema_dir()}")
    return Draft202012Validator(schemas[name], registry=registry)


def errors(instance: Any, name: str, directory: str | Path | None = None) -> list[str]:
    """Every validation error as ``<json path>: <message>``; empty when valid."""
    found = sorted(validator(name, directory).iter_errors(instance), key=lambda e: list(e.path))
    return [f"{e.json_path}: {e.message}" for e in found]


MAX_ERRORS_SHOWN = 5



def document_problems(doc: Any, name: str, directory: str | Path, where: str) -> list[str]:
    """The schema ``name``'s errors of ``doc``, each prefixed with ``where`` (the member it was read
    from), or why it could not be checked; "not a JSON object" for a document no rule below can read."""
    try:
        problems = [f"{where}: {error}" for error in errors(doc, name, directory)]
    except SchemaError as exc:
        problems = [f"{where}: cannot be checked against the shipped schema: {exc}"]
    if not isinstance(doc, dict) and not problems:
        problems = [f"{where}: not a JSON object"]
    return problems

def require_valid(instance: Any, name: str, directory: str | Path | None = None, what: str = "the artifact") -> None:
    """Raise :class:`ArtifactSchemaError` naming the first errors unless ``instance`` matches ``name``."""
    found = errors(instance, name, directory)
    if found:
        shown = "; ".join(found[:MAX_ERRORS_SHOWN]) + (f"; ... and {len(found) - MAX_ERRORS_SHOWN} more"
                                                        if len(found) > MAX_ERRORS_SHOWN else "")
        schema_file = Path(directory or repo_schema_dir()) / (name + ".schema.json")
        raise ArtifactSchemaError(f"{what} does not match {schema_file} ({len(found)} error(s): {shown}); "
                                  "it was not written: fix the code that builds it or the schema")


def write_validated(path: str | Path, instance: Any, name: str, directory: str | Path | None = None) -> None:
    """Validate ``instance`` against schema ``name``, then write it as strict JSON atomically.

    Raises :class:`ArtifactSchemaError` (nothing written at ``path``) when it does not match, and
    :class:`rl_engine.jsonio.StrictJSONError` when it holds a non-finite number.
    """
    require_valid(instance, name, directory, what=str(path))
    jsonio.write_json(path, instance)
