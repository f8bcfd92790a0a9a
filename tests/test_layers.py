"""No import runs up the layers: each module of rl_engine imports only its own layer or lower.

The layers, lowest first (docs/design.md has the table):

0. the foundations: ``tables`` (the constant tables), ``validators``, ``jsonio``, ``schemas``, ``tensorio``,
   ``arith/`` (the arithmetic's reference implementations: ``spec_numpy``, ``temperature``, ``division``,
   ``portable``, ``tiles``), ``rundir`` (the run directory's names),
   ``verb_parsers`` (the torch-free command lines of the verbs whose modules import torch);
1. the engine: ``logprob/`` and ``distributed/``;
2. ``grpo/`` (the loss, built on the engine), ``capture/`` (captured logits and the parity verb, built on the engine),
   ``integrations/`` (TRL's and verl's hooks onto the engine);
3. ``campaign/`` (case, run names, plan, runner, launch), ``record/`` (the records a run writes before its
   campaign: environment, git state, the focused regression, the engine's source digest);
4. ``evidence/`` (the checks);
5. the tools on top: ``workflow`` (what the Snakefile imports), ``benchmark/``, ``gpu_smoke``,
   ``testing/``, ``cli`` and ``__main__``.

Every ``import``/``from ... import`` in the source is read with :mod:`ast`, those inside
functions too (a deferred import is still a dependency). Inside a layer no import circle either:
two modules that import each other (directly or through others) are one module in two files.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rl_engine"
LAYERS: dict[str, int] = {
    "tables": 0, "validators": 0, "jsonio": 0, "schemas": 0, "tensorio": 0, "arith": 0, "rundir": 0, "__init__": 0,
    "verb_parsers": 0, "proctree": 0,
    "logprob": 1, "distributed": 1,
    "grpo": 2, "capture": 2, "integrations": 2,
    "campaign": 3, "record": 3,
    "evidence": 4,
    "workflow": 5, "benchmark": 5, "gpu_smoke": 5, "testing": 5, "cli": 5, "__main__": 5,
}


def unit_of(module: str) -> str:
    """``rl_engine.logprob.api`` -> ``logprob``; ``rl_engine.tables`` -> ``tables``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported(source: str) -> list[tuple[int, str]]:
    """Every rl_engine module (or package) the source imports, with its line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("rl_engine")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("rl_engine"):
            if node.module == "rl_engine":  # from rl_engine import jsonio, workflow
                found += [(node.lineno, f"rl_engine.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def upward_imports(unit: str, source: str) -> list[str]:
    """The imports of ``source`` (a module of ``unit``) from a layer above ``unit``'s."""
    return [f"line {line}: {module} (layer {LAYERS[unit_of(module)]}) from {unit} (layer {LAYERS[unit]})"
            for line, module in imported(source) if LAYERS[unit_of(module)] > LAYERS[unit]]


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    units = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in modules()}
    assert units <= set(LAYERS), sorted(units - set(LAYERS))


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_runs_up_the_layers(path: Path) -> None:
    unit = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    assert upward_imports(unit, path.read_text(encoding="utf-8")) == []


def test_the_engine_imports_nothing_of_the_campaign_the_evidence_or_the_workflow() -> None:
    """The issue's own statement, spelled out for logprob/ and distributed/."""
    banned = ("rl_engine.campaign", "rl_engine.evidence", "rl_engine.workflow")
    for path in modules():
        if path.relative_to(PACKAGE).parts[0] in ("logprob", "distributed"):
            bad = [m for _, m in imported(path.read_text(encoding="utf-8")) if m.startswith(banned)]
            assert bad == [], (path, bad)


def test_an_upward_import_is_found_negative_control() -> None:
    """The checker fails what the layers forbid: deferred, aliased and ``from rl_engine import`` forms."""
    source = (
        "from rl_engine.tables import DTYPES\n"
        "def f():\n"
        "    from rl_engine.campaign.tables import X as Y\n"
        "import rl_engine.evidence.verify\n"
        "from rl_engine import workflow\n"
    )
    found = upward_imports("logprob", source)
    assert sorted(text.split(":")[0] for text in found) == ["line 3", "line 4", "line 5"], found
    assert upward_imports("workflow", source) == []


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the rl_engine modules it imports (``from pkg import mod`` names the module ``pkg.mod``)."""
    graph: dict[str, set[str]] = {}
    for name, source in sources.items():
        edges = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    edges.add(full if full in sources else node.module)
        graph[name] = {edge for edge in edges if edge in sources and edge != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle() -> None:
    """No two modules of rl_engine import each other, directly or through others (deferred imports count)."""
    sources = {module_name(path): path.read_text(encoding="utf-8") for path in modules()}
    assert circles(import_graph(sources)) == []


def test_an_import_circle_is_found_negative_control() -> None:
    """The checker finds a deferred two-module circle and a three-module one, and passes a chain."""
    sources = {
        "rl_engine.a": "def f():\n    from rl_engine.b import g\n",
        "rl_engine.b": "from rl_engine import a\n",
        "rl_engine.c": "import rl_engine.d\n",
        "rl_engine.d": "from rl_engine.e import x\n",
        "rl_engine.e": "from rl_engine.c import y\n",
        "rl_engine.f": "from rl_engine.a import z\n",
    }
    assert circles(import_graph(sources)) == [["rl_engine.a", "rl_engine.b"], ["rl_engine.c", "rl_engine.d", "rl_engine.e"]]
