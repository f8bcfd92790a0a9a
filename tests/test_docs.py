"""The README and docs/: every relative link resolves, and the README's test command
is the one CI runs.

A link is ``[text](target)`` outside code; ``target`` is a path relative to the file that holds
it, optionally with ``#anchor``, which must be the GitHub anchor of a heading of the target.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INDENTED = re.compile(r"^(?: {4}|\t).*$", re.MULTILINE)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text without fenced blocks, indented code and code spans."""
    text = FENCE.sub("", text)
    text = INDENTED.sub("", text)
    return CODE_SPAN.sub("", text)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case; backticks, asterisks and punctuation other
    than '_' and '-' dropped; spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"[`*]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = anchor(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text(encoding="utf-8")))


def test_the_pages_have_links_to_check() -> None:
    assert (ROOT / "docs" / "arithmetic.md") in PAGES
    readme = links(ROOT / "README.md")
    assert "docs/arithmetic.md" in readme and len(readme) >= 10


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{fragment} in {dest.name}")
    assert broken == [], f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = set(links(ROOT / "README.md"))
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme]
    assert missing == []


def test_the_readme_stays_a_front_door_of_at_most_180_lines() -> None:
    """The reference (every configuration key, every flag) lives in docs/; the README points there."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 180, f"README.md has {len(lines)} lines; move detail to docs/"
    assert "Every key, the stages, run" in "\n".join(lines)  # the configuration's pointer to docs/workflow.md


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    """.ci/run installs, runs ruff and runs pytest with the README's command, byte for byte."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    install = next(line for line in ci if line.startswith("python -m pip install"))
    ruff_line = next(line for line in ci if line.startswith("python -m ruff check"))
    pytest_line = next(line for line in ci if line.startswith("python -m pytest"))
    command = f"{install.removeprefix('python -m ')} && {ruff_line} && {pytest_line}"
    assert command in (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_rule_walks_to_its_code_in_one_step() -> None:
    """docs/workflow.md's stage table names, for every rule of the workflow, the module whose
    ``main`` the rule's ``python -m rl_engine <verb>`` runs (cli.VERBS), and that file exists."""
    from rl_engine import cli

    table = (ROOT / "docs" / "workflow.md").read_text(encoding="utf-8")
    rules = {}
    for smk in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        for name, body in re.findall(r"^rule (\w+):\n((?:[ \t]+.*\n|\n)*)", smk.read_text(encoding="utf-8"), re.M):
            verb = re.search(r"python -m rl_engine ([\w-]+)", body)
            assert verb is not None, f"rule {name} ({smk.name}) does not call a verb"
            rules[name] = verb.group(1)
    assert {"environment", "regression", "case", "plan", "topology", "validation", "crosscheck", "summary",
            "archive", "verify_archive"} <= set(rules)
    for rule, verb in rules.items():
        row = re.search(rf"^\| `{rule}`[^\n]*\| `(rl_engine/[\w/]+\.py)`[^|\n]*\|$", table, re.M)
        assert row is not None, f"rule {rule}: no row naming its code in docs/workflow.md"
        module = cli.VERBS[verb][0]
        assert row.group(1) == module.replace(".", "/") + ".py", (rule, verb, module, row.group(1))
        assert (ROOT / row.group(1)).is_file()


# ----- drift: cited tests exist, tables are well formed ------------------------------

CITED_TEST = re.compile(r"\b(tests/[\w/]+\.py)::([\w:]+)")
CELL_SEPARATOR = re.compile(r"(?<!\\)\|")
DELIMITER_CELL = re.compile(r"^\s*:?-+:?\s*$")


def cited_tests(page: Path) -> list[tuple[str, str]]:
    """``(file, name)`` of every ``tests/<file>.py::<name>`` the page cites, code included."""
    return CITED_TEST.findall(page.read_text(encoding="utf-8"))


def missing_tests(citations: list[tuple[str, str]]) -> list[str]:
    """The citations whose file lacks the test: ``name`` (or ``Class::name``) is a ``def``/``class``."""
    missing = []
    for file, name in citations:
        path = ROOT / file
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        for part in name.split("::"):
            if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(part)}\b", text, re.M):
                missing.append(f"{file}::{name}")
                break
    return missing


def cells(row: str) -> list[str]:
    """A table row's cells as GitHub counts them: split on every ``|`` not escaped as ``\\|``
    (a ``|`` inside a code span splits too), less the outer pipes."""
    row = row.strip()
    row = row[1:] if row.startswith("|") else row
    row = row[:-1] if row.endswith("|") and not row.endswith("\\|") else row
    return CELL_SEPARATOR.split(row)


def tables(text: str) -> list[list[str]]:
    """Every table outside fenced code: runs of lines that start with ``|``."""
    found: list[list[str]] = []
    current: list[str] = []
    for line in FENCE.sub("", text).splitlines() + [""]:
        if line.lstrip().startswith("|"):
            current.append(line)
        elif current:
            found.append(current)
            current = []
    return found


def table_problems(rows: list[str]) -> list[str]:
    """What is wrong with one table: a missing delimiter row, or a row whose cell count is not
    the header's (the delimiter row included)."""
    if len(rows) < 2 or not all(DELIMITER_CELL.match(c) for c in cells(rows[1])):
        return [f"{rows[0].strip()!r}: no delimiter row (|---|...) under the header"]
    width = len(cells(rows[0]))
    return [f"row {i} has {len(cells(row))} cells, the header {width}: {row.strip()[:80]!r}"
            for i, row in enumerate(rows[1:], start=2) if len(cells(row)) != width]


def test_the_pages_cite_tests_to_check() -> None:
    assert ("tests/test_distributed_grpo_loss.py",
            "test_actions_that_differ_on_a_tp_peer_raise_on_every_rank_before_numerics") in cited_tests(
        ROOT / "docs" / "checks.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_test_exists(page: Path) -> None:
    assert missing_tests(cited_tests(page)) == [], page.relative_to(ROOT)


def test_a_cited_test_that_is_gone_is_found() -> None:
    """Negative controls: a name the file lacks, a prefix of a real name, a missing file."""
    assert missing_tests([("tests/test_docs.py", "test_every_cited_test_exists")]) == []
    assert missing_tests([("tests/test_docs.py", "test_no_such_test"),
                          ("tests/test_docs.py", "test_every_cited_test"),
                          ("tests/test_nowhere.py", "test_x")]) == [
        "tests/test_docs.py::test_no_such_test", "tests/test_docs.py::test_every_cited_test",
        "tests/test_nowhere.py::test_x"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_is_well_formed(page: Path) -> None:
    found = tables(page.read_text(encoding="utf-8"))
    problems = [p for rows in found for p in table_problems(rows)]
    assert problems == [], f"{page.relative_to(ROOT)}: " + "; ".join(problems)


def test_a_malformed_table_is_found() -> None:
    """Negative controls: 3 header cells over 4 delimiter cells (the config table's old
    defect), a short row, a pipe in a code span, no delimiter row; and an escaped pipe is fine."""
    assert table_problems(["| a | b |", "|---|---|", "| `x\\|y` | 2 |"]) == []
    assert table_problems(["| a | b | c |", "|---|---|---|---|", "| 1 | 2 | 3 |"])
    assert table_problems(["| a | b |", "|---|---|", "| 1 |"])
    assert table_problems(["| a | b |", "|---|---|", "| `x|y` | 2 |"])
    assert table_problems(["| a | b |", "| 1 | 2 |"])
    assert len(tables("x\n\n| a |\n|---|\n\n```\n| not | a table |\n```\n| b |\n|---|\n")) == 2


def test_tests_readme_maps_every_test_file() -> None:
    """tests/README.md names every test file (a new file without a row fails here)."""
    tests = Path(__file__).resolve().parent
    text = (tests / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in sorted(tests.glob("test_*.py")) if f"`{p.name}`" not in text]
    assert missing == []


def test_no_code_or_test_cites_a_tracker_issue_number() -> None:
    """Docstrings and comments say why, not which tracker entry asked: a clone has no tracker."""
    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"\b[Ii]ssues? \d")
    files = [p for d in ("rl_engine", "tests", "workflow") for p in (root / d).rglob("*")
             if p.is_file() and p.suffix in (".py", ".smk", ".c", ".h", ".yaml", ".rst") or p.name == "Snakefile"]
    found = [f"{p.relative_to(root)}:{n}" for p in files
             for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if pattern.search(line)]
    assert files and found == []


HISTORY = re.compile(r"(^|\s|\"\"\"|#)Before:|\b(it|they|jobs?|this|that|the code|we) used to\b|\bNow (it|they|the [a-z]+) [a-z]+s\b")


def test_docstrings_say_why_not_history() -> None:
    """A docstring or comment says why the code is as it is, not what it was ("Before: ...",
    "... used to ...", "Now it ..."): a reader of a clone has only the code in front of them."""
    root = Path(__file__).resolve().parents[1]
    files = [p for d in ("rl_engine", "tests", "workflow") for p in (root / d).rglob("*.py")]
    found = [f"{p.relative_to(root)}:{n}" for p in files if p.name != "test_docs.py"
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if HISTORY.search(line)]
    assert files and found == []
    for control in ('    """Before: the kernel crashed."""', "    # Before: unchecked", "The jobs used to declare every file",
                    "Now it raises, naming the flag"):
        assert HISTORY.search(control), control
