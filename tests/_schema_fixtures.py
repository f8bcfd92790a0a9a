"""Invalid schema fixtures: a table of changes to one valid document per schema.

``tests/fixtures/schemas/<schema>/invalid.json`` holds::

    {"base": "<file in valid/>",
     "cases": {"<rule it breaks>": {"patch": [<RFC 6902 operations>], "expect": "<substring>"},
               "<rule it breaks>": {"text": {"find": "...", "replace": "..."}, "expect": "..."}}}

A ``patch`` case applies JSON Patch operations (``add``, ``remove``, ``replace``; JSON Pointer
paths) to the parsed base. A ``text`` case is for what no parsed document can hold (a NaN
literal, say): it replaces the one occurrence of ``find`` in the base's text. A case may name
its own ``base`` when the rule it breaks belongs to another valid variant. ``expect`` is a
substring that the refusal (the strict-JSON error or one schema error) must contain.

The applier is strict where RFC 6902 is lenient, so a typo cannot quietly give back the valid
document: every path must exist (``add``: its parent must exist, and an object member must not
exist yet), list indices are plain decimals within range, and the table refuses duplicate or
unknown keys.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "schemas"
TABLE = "invalid.json"
_CASE_KEYS = {"base", "patch", "text", "expect"}
_INDEX = re.compile(r"0|[1-9][0-9]*")


class FixtureError(ValueError):
    """A fixture table or a patch that does not apply as written."""


def _pointer(path: str) -> list[str]:
    if not isinstance(path, str) or not path.startswith("/"):
        raise FixtureError(f"JSON Pointer {path!r} must start with '/' (the whole document is never patched)")
    return [token.replace("~1", "/").replace("~0", "~") for token in path[1:].split("/")]


def _index(container: list[Any], token: str, path: str, *, append: bool = False) -> int:
    if append and token == "-":
        return len(container)
    if not _INDEX.fullmatch(token):
        raise FixtureError(f"{path}: {token!r} is not a list index")
    index = int(token)
    if index >= len(container) + (1 if append else 0):
        raise FixtureError(f"{path}: index {index} is out of range (the list has {len(container)} items)")
    return index


def _child(node: Any, token: str, path: str) -> Any:
    if isinstance(node, dict):
        if token not in node:
            raise FixtureError(f"{path}: no member {token!r} (members: {sorted(node)})")
        return node[token]
    if isinstance(node, list):
        return node[_index(node, token, path)]
    raise FixtureError(f"{path}: {token!r} goes below a {type(node).__name__}")


def apply_patch(document: Any, patch: list[dict[str, Any]]) -> Any:
    """``document`` with the operations of ``patch`` applied in order; ``document`` is left as is."""
    if not isinstance(patch, list) or not patch:
        raise FixtureError(f"a patch is a non-empty list of operations, not {patch!r}")
    result = copy.deepcopy(document)
    for operation in patch:
        op, path = operation.get("op"), operation.get("path")
        wanted = {"op", "path", "value"} if op in ("add", "replace") else {"op", "path"}
        if op not in ("add", "remove", "replace") or set(operation) != wanted:
            raise FixtureError(f"unsupported operation {operation!r}: use add/replace (op, path, value) "
                               "or remove (op, path)")
        *parents, last = _pointer(path)
        parent = result
        for token in parents:
            parent = _child(parent, token, path)
        value = copy.deepcopy(operation.get("value"))
        if isinstance(parent, dict):
            if op == "add" and last in parent:
                raise FixtureError(f"{path}: member {last!r} exists already; use replace")
            if op != "add" and last not in parent:
                raise FixtureError(f"{path}: no member {last!r} to {op} (members: {sorted(parent)})")
            if op == "remove":
                del parent[last]
            else:
                parent[last] = value
        elif isinstance(parent, list):
            index = _index(parent, last, path, append=op == "add")
            if op == "add":
                parent.insert(index, value)
            elif op == "remove":
                del parent[index]
            else:
                parent[index] = value
        else:
            raise FixtureError(f"{path}: {last!r} goes below a {type(parent).__name__}")
    return result


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    duplicated = sorted({key for key in keys if keys.count(key) > 1})
    if duplicated:
        raise FixtureError(f"duplicate keys {duplicated}")
    return dict(pairs)


def _read_table(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicates)
    except ValueError as exc:  # FixtureError (a duplicate key) is one too
        raise FixtureError(f"{path}: {exc}") from None


@dataclass(frozen=True)
class InvalidCase:
    """One row of a schema's table: a valid base document and the change that breaks one rule."""

    schema: str
    name: str
    base: Path
    expect: str
    patch: tuple[dict[str, Any], ...] = ()
    find: str = ""
    replace: str = ""

    @property
    def id(self) -> str:
        return f"{self.schema}/{self.name}"

    def base_text(self) -> str:
        return self.base.read_text(encoding="utf-8")

    def text(self) -> str:
        """The invalid document as a file would hold it."""
        base = self.base_text()
        if self.patch:
            return json.dumps(apply_patch(json.loads(base), list(self.patch)), indent=2) + "\n"
        if base.count(self.find) != 1:
            raise FixtureError(f"{self.id}: {self.find!r} occurs {base.count(self.find)} times in "
                               f"{self.base.name}, not once")
        return base.replace(self.find, self.replace)


def invalid_cases(schema: str) -> list[InvalidCase]:
    """The cases of ``tests/fixtures/schemas/<schema>/invalid.json`` (none when it has no table)."""
    path = FIXTURES / schema / TABLE
    if not path.exists():
        return []
    table = _read_table(path)
    if set(table) != {"base", "cases"} or not isinstance(table["cases"], dict) or not table["cases"]:
        raise FixtureError(f"{path}: want exactly the keys 'base' and 'cases' (a non-empty object)")
    cases = []
    for name, row in table["cases"].items():
        where = f"{path}: case {name!r}"
        if not isinstance(row, dict) or not set(row) <= _CASE_KEYS or ("patch" in row) == ("text" in row):
            raise FixtureError(f"{where}: want 'expect', one of 'patch' or 'text', and maybe 'base'")
        if not isinstance(row.get("expect"), str) or not row["expect"].strip():
            raise FixtureError(f"{where}: 'expect' must be a non-empty substring of the refusal")
        base = FIXTURES / schema / "valid" / row.get("base", table["base"])
        if not base.is_file():
            raise FixtureError(f"{where}: base {base} is not a valid fixture")
        if "patch" in row:
            if not isinstance(row["patch"], list) or not row["patch"]:
                raise FixtureError(f"{where}: 'patch' must be a non-empty list of operations")
            cases.append(InvalidCase(schema, name, base, row["expect"], patch=tuple(row["patch"])))
        else:
            text = row["text"]
            if not isinstance(text, dict) or set(text) != {"find", "replace"} or text["find"] == text["replace"]:
                raise FixtureError(f"{where}: 'text' must be {{'find': ..., 'replace': ...}} and change something")
            cases.append(InvalidCase(schema, name, base, row["expect"], find=text["find"], replace=text["replace"]))
    return cases


def all_invalid_cases() -> list[InvalidCase]:
    return [case for directory in sorted(FIXTURES.iterdir()) if directory.is_dir()
            for case in invalid_cases(directory.name)]
