"""Every schema in schemas/ is a valid draft 2020-12 schema whose references resolve, and
its fixtures behave: each valid fixture validates, each invalid case is refused for its reason.

Valid fixtures are whole documents in ``tests/fixtures/schemas/<schema name>/valid/*.json``.
Invalid cases are rows of ``tests/fixtures/schemas/<schema name>/invalid.json``, each named for
the rule it breaks: a JSON patch (RFC 6902) of the table's valid base document (or of another
valid variant the case names), or, for what no parsed document can hold (a NaN literal), a text
replacement in the base's text. Each carries an ``expect`` substring that the refusal (the
strict-JSON error or one schema error) must contain, so it fails for the intended reason; the
base must be accepted, so the change is what the validator refuses. The table format and its
strict applier (a typo in a path fails, it never gives back the valid base) are in
``tests/_schema_fixtures.py``.
New schemas are picked up automatically; fixtures of a schema belong to its owner.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from jsonschema import Draft202012Validator
from referencing.exceptions import Unresolvable

from rl_engine import jsonio, schemas

from _schema_fixtures import FixtureError, InvalidCase, all_invalid_cases, apply_patch, invalid_cases

SCHEMA_DIR = schemas.repo_schema_dir()
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "schemas"
SCHEMA_FILES = sorted(SCHEMA_DIR.glob("*.schema.json"))
SCHEMA_NAMES = [p.name[: -len(".schema.json")] for p in SCHEMA_FILES]
NOT_ARTIFACTS = {"defs"}  # shared pieces only, nothing is validated against it
FIXTURES_REQUIRED = {"report", "plan"}


def _valid_fixtures() -> list[Any]:
    return [
        pytest.param(path.parts[-3], path, id=f"{path.parts[-3]}/{path.name}")
        for path in sorted(FIXTURES.glob("*/valid/*.json"))
    ]


INVALID_CASES = [pytest.param(case, id=case.id) for case in all_invalid_cases()]


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def _refusal(name: str, text: str) -> list[str]:
    """What refuses ``text`` as a ``name`` artifact: the strict-JSON error, or the schema errors."""
    try:
        instance = jsonio.loads(text)
    except (jsonio.StrictJSONError, json.JSONDecodeError) as exc:
        return [str(exc)]
    return schemas.errors(instance, name)


def test_schema_directory_is_found() -> None:
    assert {"defs", "report", "plan"} <= set(SCHEMA_NAMES)


@pytest.mark.parametrize("path", SCHEMA_FILES, ids=SCHEMA_NAMES)
def test_schema_is_valid_draft_2020_12_without_an_id(path: Path) -> None:
    """No ``$id``: a schema is known by its file name and its ``$ref``s resolve beside it."""
    schema = json.loads(path.read_text(encoding="utf-8"))
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert "$id" not in schema
    assert [ref for ref in _refs(schema) if "://" in ref] == []  # no reference leaves the directory
    assert "$id" not in json.dumps({k: v for k, v in schema.items() if k != "$schema"})  # nor does a nested base
    assert isinstance(schema.get("title"), str) and schema["title"]
    Draft202012Validator.check_schema(schema)


def _resolve_all(name: str, directory: Path | None = None) -> int:
    loaded, registry = schemas.load(directory)
    schema = loaded[name]
    resolver = registry.resolver(base_uri=schemas.schema_id(name))
    refs = list(_refs(schema))
    for ref in refs:
        resolved = resolver.lookup(ref)  # raises referencing.exceptions.Unresolvable
        assert isinstance(resolved.contents, (dict, bool)), ref
    return len(refs)


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_every_reference_resolves(name: str) -> None:
    # Every schema shares pieces through $ref (defs, or its own $defs): zero references would
    # mean this check looked at nothing.
    assert _resolve_all(name) > 0, f"{name}.schema.json has no $ref to resolve"


def test_unresolvable_reference_is_detected(tmp_path: Path) -> None:
    """Negative control for the reference check: a dangling $ref fails to resolve."""
    broken = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "broken",
        "$ref": "defs.schema.json#/$defs/no_such_definition",
    }
    (tmp_path / "broken.schema.json").write_text(json.dumps(broken))
    for path in SCHEMA_FILES:
        if path.name == "defs.schema.json":
            (tmp_path / path.name).write_text(path.read_text())
    with pytest.raises(Unresolvable):
        _resolve_all("broken", tmp_path)
    assert _resolve_all("report") > 10  # the real schemas do use references


@pytest.mark.parametrize("name", sorted(set(SCHEMA_NAMES) - NOT_ARTIFACTS))
def test_artifact_schema_has_fixtures(name: str) -> None:
    valid = list(FIXTURES.glob(f"{name}/valid/*.json"))
    invalid = invalid_cases(name)
    if name not in FIXTURES_REQUIRED and not (valid or invalid):
        pytest.skip(f"no fixtures for {name} yet: add tests/fixtures/schemas/{name}/valid/ and invalid.json")
    assert valid, f"{name}: no valid fixture"
    assert invalid, f"{name}: no invalid case in tests/fixtures/schemas/{name}/invalid.json"


def test_fixture_directories_hold_only_valid_documents_and_one_table() -> None:
    """An invalid document is a row of invalid.json: a file elsewhere would never be tested."""
    for directory in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        assert directory.name in SCHEMA_NAMES, f"fixture directory {directory.name} names no schema"
        extra = sorted(p.name for p in directory.iterdir() if p.name not in ("valid", "invalid.json"))
        assert extra == [], f"{directory}: unexpected {extra}"
        assert {p.suffix for p in (directory / "valid").iterdir()} == {".json"}, directory


@pytest.mark.parametrize(("name", "path"), _valid_fixtures())
def test_valid_fixture_validates(name: str, path: Path) -> None:
    assert name in SCHEMA_NAMES, f"fixture directory {name} names no schema"
    assert schemas.errors(jsonio.load(path), name) == []


@pytest.mark.parametrize("case", INVALID_CASES)
def test_invalid_case_is_refused_for_its_reason(case: InvalidCase) -> None:
    """The base is accepted; the case breaks it, and the refusal names the rule it breaks."""
    assert case.schema in SCHEMA_NAMES, f"fixture directory {case.schema} names no schema"
    assert _refusal(case.schema, case.base_text()) == [], f"base {case.base} must be valid"
    problems = _refusal(case.schema, case.text())
    assert problems, f"{case.id} should be refused"
    assert any(case.expect in p for p in problems), (case.expect, problems)


@pytest.mark.parametrize("case", INVALID_CASES)
def test_invalid_case_differs_from_its_base(case: InvalidCase) -> None:
    if case.patch:
        assert json.loads(case.text()) != json.loads(case.base_text()), f"{case.id}: the patch changes nothing"
    else:
        assert case.text() != case.base_text(), f"{case.id}: the text edit changes nothing"


DOC = {"a": {"b": [1, 2], "c/d": 0, "e~f": 1}}


@pytest.mark.parametrize(("patch", "expected"), [
    ([{"op": "replace", "path": "/a/b/1", "value": 5}], {"a": {"b": [1, 5], "c/d": 0, "e~f": 1}}),
    ([{"op": "add", "path": "/a/b/-", "value": 3}], {"a": {"b": [1, 2, 3], "c/d": 0, "e~f": 1}}),
    ([{"op": "add", "path": "/a/b/0", "value": 0}], {"a": {"b": [0, 1, 2], "c/d": 0, "e~f": 1}}),
    ([{"op": "remove", "path": "/a/c~1d"}, {"op": "remove", "path": "/a/e~0f"}], {"a": {"b": [1, 2]}}),
    ([{"op": "add", "path": "/a/g", "value": {"h": None}}], {"a": {"b": [1, 2], "c/d": 0, "e~f": 1, "g": {"h": None}}}),
])
def test_patch_applier_follows_rfc_6902(patch: list[dict[str, Any]], expected: Any) -> None:
    before = json.loads(json.dumps(DOC))
    assert apply_patch(DOC, patch) == expected
    assert DOC == before  # the base is never modified


@pytest.mark.parametrize("patch", [
    [{"op": "replace", "path": "/a/x", "value": 1}],       # a typo: no such member
    [{"op": "remove", "path": "/a/b/2"}],                  # index out of range
    [{"op": "replace", "path": "/a/b/01", "value": 1}],    # not a plain index
    [{"op": "add", "path": "/a/x/y", "value": 1}],         # the parent does not exist
    [{"op": "add", "path": "/a/c~1d", "value": 1}],        # add over an existing member
    [{"op": "replace", "path": "a/b", "value": 1}],        # not a JSON Pointer
    [{"op": "replace", "path": "/a/b/0/x", "value": 1}],   # below a number
    [{"op": "move", "from": "/a/b", "path": "/a/z"}],      # unsupported operation
    [{"op": "replace", "path": "/a/b"}],                   # no value
    [],                                                     # changes nothing
])
def test_patch_applier_fails_loudly(patch: list[dict[str, Any]]) -> None:
    with pytest.raises(FixtureError):
        apply_patch(DOC, patch)


def test_text_case_must_find_its_text_once(tmp_path: Path) -> None:
    base = tmp_path / "base.json"
    base.write_text('{"a": 1.0, "b": 1.0}')
    with pytest.raises(FixtureError, match="occurs 0 times"):
        InvalidCase("x", "typo", base, "NaN", find='"c": 1.0', replace='"c": NaN').text()
    with pytest.raises(FixtureError, match="occurs 2 times"):
        InvalidCase("x", "ambiguous", base, "NaN", find="1.0", replace="NaN").text()
    assert InvalidCase("x", "ok", base, "NaN", find='"a": 1.0', replace='"a": NaN').text() == '{"a": NaN, "b": 1.0}'


@pytest.mark.parametrize("kind", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_literals_are_refused_before_validation(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "x.json"
    path.write_text('{"value": %s}' % kind)
    with pytest.raises(jsonio.StrictJSONError, match="non-finite literal"):
        jsonio.load(path)


def test_report_fixture_covers_the_guide_acceptance_fields() -> None:
    """The guide's acceptance fields and fingerprint names are required by the report schema."""
    report = jsonio.load(FIXTURES / "report" / "valid" / "tp2-cp2.json")
    required = schemas.load()[0]["report"]["required"]
    for key in ("passed", "requested_backend", "actual_backend", "fallback", "tp_outputs_bitwise_replicated",
                "bitwise_fingerprints", "launch_command"):
        assert key in required
        del_report = {k: v for k, v in report.items() if k != key}
        assert any(f"'{key}' is a required property" in e for e in schemas.errors(del_report, "report"))
    fp_required = schemas.load()[0]["report"]["properties"]["bitwise_fingerprints"]["required"]
    assert {"dtype", "shape", "candidate_logp_sha256", "candidate_lse_sha256"} <= set(fp_required)
