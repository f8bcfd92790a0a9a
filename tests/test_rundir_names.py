"""Read from the source: a run's file names are built only in
``rl_engine/rundir/names.py``, and the stage list is written there only. The rest of the
``rundir`` package (``load.py``, which reads a run, and the ``__init__.py`` facade) is scanned
like every other module.

"Built" means a path made from a name: ``run / "plan.json"``, ``os.path.join(d, "case.json")``,
``Path("x.json")``, ``p.with_name("tp1-cp1.json")``, an f-string ``f"{run}/plan.json"`` or
``f"tp{t}-cp{c}"``. Docstrings, messages and templates that mention a file by name are prose,
not paths, and are not counted (an f-string with a space in it is not a name). The workflow's
rules and Snakefile take every run path from rundir (through common.smk), so a quoted run file
name there is a second copy. A stage list is a literal list or
tuple of three or more of rundir's stage names. Each check has a negative control on a snippet
that builds a name the way the old code did.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from rl_engine import rundir
from rl_engine.rundir import names as owner_module

REPO = Path(__file__).resolve().parent.parent
OWNER = REPO / "rl_engine" / "rundir" / "names.py"  # the one module that builds run file names and lists the stages
NAMES = sorted({value for key, value in vars(owner_module).items() if key.isupper() and isinstance(value, str)
                and re.search(r"\.(json|f32|md|log|safetensors|png|xml|txt|sha256|gz)$", value)})
TENSOR_SUFFIXES = tuple(name[len("tp1-cp1"):] for name in rundir.Topology(1, 1).tensors.values())  # ".logp.f32", ...
STEM = re.compile(r"tp(\d+|\{\})-cp(\d+|\{\})")
PATH_CALLS = ("path.join", "Path", "PurePath", "with_name", "with_suffix", "joinpath")
STAGE_NAMES = {stage.rule for stage in rundir.stages("results/x", [rundir.Topology(1, 1)], capture=True, parity=True)}


def run_file_literal(text: str) -> bool:
    """A literal that names a run file: one of rundir's names (alone or at a path's end), a
    tensor suffix, or a ``tp<T>-cp<C>`` stem."""
    if any(text == name or text.endswith("/" + name) for name in NAMES):
        return True
    return text.endswith(TENSOR_SUFFIXES) or bool(STEM.search(text))


def built_names(source: str) -> list[tuple[int, str]]:
    """(line, literal) of every run file name ``source`` builds a path or stem from."""
    found = []
    for node in ast.walk(ast.parse(source)):
        literals: list[str] = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            literals = [s.value for s in (node.left, node.right) if isinstance(s, ast.Constant) and isinstance(s.value, str)]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith(PATH_CALLS):
            literals = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        elif isinstance(node, ast.JoinedStr):  # a name or a path has no spaces; a message or template has
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            literals = [] if re.search(r"\s", text) else [text]
        found += [(node.lineno, text) for text in literals if run_file_literal(text)]
    return found


def stage_lists(source: str) -> list[tuple[int, list[str]]]:
    """(line, names) of every literal list or tuple holding three or more stage names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.List, ast.Tuple)):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in STAGE_NAMES]
            if len(names) >= 3:
                found.append((node.lineno, names))
    return found


PY_FILES = sorted(p for p in (REPO / "rl_engine").rglob("*.py") if p != OWNER)
RULE_FILES = sorted([REPO / "workflow" / "Snakefile", *(REPO / "workflow" / "rules").glob("*.smk")])


@pytest.mark.parametrize("path", PY_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_but_rundir_builds_a_run_file_name(path: Path) -> None:
    assert built_names(path.read_text(encoding="utf-8")) == [], f"{path}: build the name from rl_engine.rundir"


@pytest.mark.parametrize("path", PY_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_but_rundir_lists_the_stages(path: Path) -> None:
    assert stage_lists(path.read_text(encoding="utf-8")) == [], f"{path}: take the stages from rl_engine.rundir.stages"


def rule_problems(text: str) -> list[str]:
    """Run file names quoted in a rule file's ``text`` (``docs/...`` is a source of the checkout,
    not a run file), and bracketed lists, over any number of lines, of three or more stage names."""
    problems = [literal for pair in re.findall(r"\"([^\"\n]*)\"|'([^'\n]*)'", text) for literal in pair
                if literal and not literal.startswith("docs/") and run_file_literal(literal)]
    for bracket in re.findall(r"[\[(][^\[\]()]*[\])]", text):
        names = [n for n in re.findall(r"[\"'](\w+)[\"']", bracket) if n in STAGE_NAMES]
        if len(names) >= 3:
            problems.append(f"a stage list: {names}")
    return problems


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_no_rule_quotes_a_run_file_name_or_lists_the_stages(path: Path) -> None:
    assert rule_problems(path.read_text(encoding="utf-8")) == [], f"{path}: take the paths from common.smk"


def test_the_rule_check_finds_a_quoted_name_and_a_stage_list_negative_control() -> None:
    snippet = """rule x:
    input: "results/{name}/plan.json", spec="docs/arithmetic.md"
    output: f"{RUN}/tp{wildcards.tp}-cp1.lse.f32"
STAGES = [
    "environment",
    "regression",
    "case",
]
"""
    assert rule_problems(snippet) == ["results/{name}/plan.json", "{RUN}/tp{wildcards.tp}-cp1.lse.f32",
                                      "a stage list: ['environment', 'regression', 'case']"]


def test_the_checks_find_names_built_the_old_way_negative_control() -> None:
    """The forms the old code used are found; prose that mentions a file is not."""
    snippet = '''
def f(run, tp, cp, stem):
    """Reads plan.json and writes SUMMARY.md."""
    a = run / "plan.json"
    b = os.path.join(run, "case.json")
    c = f"tp{tp}-cp{cp}"
    d = f"{stem}.logp.f32"
    e = Path(run, "validation.json")
    g = f"{run}/crosscheck.json"
    raise ValueError("plan.json is missing")
STAGES = ["environment", "regression", "case", "plan"]
'''
    found = sorted(text for _, text in built_names(snippet))
    assert found == sorted(["plan.json", "case.json", "tp{}-cp{}", "{}.logp.f32", "validation.json",
                            "{}/crosscheck.json"]), found
    assert stage_lists(snippet) == [(11, ["environment", "regression", "case", "plan"])]
    assert {"plan.json", "case.json", "SUMMARY.md", "capture.safetensors"} <= set(NAMES)  # the names are rundir's
    assert {"case", "capture", "parity", "validation", "verify_archive"} <= STAGE_NAMES


def test_the_owner_is_the_module_that_lists_the_stages_negative_control() -> None:
    """The one file left out of the scan is the names module, which the checks would fail (it lists
    stages); the rest of the rundir package is scanned like every other module."""
    assert Path(owner_module.__file__).resolve() == OWNER
    assert stage_lists(OWNER.read_text(encoding="utf-8")) != []
    package = REPO / "rl_engine" / "rundir"
    assert {package / "__init__.py", package / "load.py"} <= set(PY_FILES)
    assert OWNER not in PY_FILES
