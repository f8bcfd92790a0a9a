"""JSON Schemas (draft 2020-12) of every artifact: loading, cross-file ``$ref`` and validation.

Schemas live in ``schemas/<name>.schema.json`` with ``$id`` ``https://rl-engine.dev/schemas/
<name>.schema.json``; shared pieces sit in ``defs.schema.json`` and are referenced by
that ``$id``. A directory of schemas (the repository's, or the copy inside an archive) is
loaded as one registry, so a reviewer validates with exactly the schemas that were shipped.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

ID_PREFIX = "https://rl-engine.dev/schemas/"


class SchemaError(ValueError):
    """A schema that is missing or itself invalid."""


def repo_schema_dir() -> Path:
    """``schemas/`` of the source tree (the package is installed editable from it)."""
    return Path(__file__).resolve().parent.parent / "schemas"


def schema_id(name: str) -> str:
    return f"{ID_PREFIX}{name}.schema.json"


def _load_dir(directory: Path) -> dict[str, dict[str, Any]]:
    schemas: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.schema.json")):
        schema = json.loads(path.read_text(encoding="utf-8"))
        name = path.name[: -len(".schema.json")]
        if schema.get("$id") != schema_id(name):
            raise SchemaError(f"{path}: $id must be {schema_id(name)!r}, got {schema.get('$id')!r}")
        try:
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
