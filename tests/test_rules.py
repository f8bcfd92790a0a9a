"""The rules' shell lines, read as text: every path and value a rule puts on a
command line is quoted, and every rule that runs one verb runs it with ``exec``.

Quoting: a checkout at ``/home/me/My Projects/rl_engine`` gave ``--repo /home/me/My Projects/...``,
two words, and the environment rule failed on its argument parse; a value with a shell
metacharacter would have run as shell. Snakemake's ``:q`` quotes a placeholder (each item of a list).
``exec``: the verb replaces the job's shell, so a signal to the job (Ctrl-C, a scheduler's SIGKILL)
reaches the verb itself and no shell wrapper outlives it or rewrites its exit status. The topology
rule keeps a shell on purpose: it maps the launch's exit status 1 (a report that failed acceptance,
kept for the validation gate) to success, so it is the one named exception.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parent.parent / "workflow" / "rules"
SHELL_KEEPERS = {"topology"}  # maps an exit status: see the module docstring
PLACEHOLDER = re.compile(r"(?<!\{)\{([^{}]+)\}(?!\})")


def shells() -> dict[str, str]:
    """Each rule's shell command, its string literals joined as Python joins them."""
    found: dict[str, str] = {}
    for smk in sorted(RULES.glob("*.smk")):
        rule = None
        lines = smk.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if m := re.match(r"rule (\w+):", line):
                rule = m.group(1)
            if line.strip() == "shell:" and rule is not None:
                body = []
                for follow in lines[i + 1:]:
                    if not follow.startswith("        ") or not follow.strip():
                        break
                    body.append(follow.strip())
                found[rule] = ast.literal_eval("(" + "\n".join(body) + ")")
    return found


def test_every_rule_with_a_shell_is_read() -> None:
    rules = {m.group(1) for smk in RULES.glob("*.smk")
             for m in re.finditer(r"^rule (\w+):", smk.read_text(encoding="utf-8"), re.M)}
    assert set(shells()) == rules - {"all"}, sorted(rules - set(shells()))


@pytest.mark.parametrize("rule", sorted(shells()))
def test_every_placeholder_is_quoted(rule: str) -> None:
    unquoted = [p for p in PLACEHOLDER.findall(shells()[rule]) if not p.endswith(":q")]
    assert unquoted == [], f"rule {rule}: quote {unquoted} with :q"


@pytest.mark.parametrize("rule", sorted(shells()))
def test_one_verb_rules_exec_it(rule: str) -> None:
    shell = shells()[rule]
    if rule in SHELL_KEEPERS:
        assert not shell.startswith("exec "), f"rule {rule} maps the verb's exit status; it cannot exec"
    else:
        assert shell.startswith("exec python -m rl_engine "), f"rule {rule}: {shell[:60]!r}"


def test_the_check_finds_an_unquoted_placeholder() -> None:
    """Negative control: the placeholder pattern sees ``{params.repo}`` and ``{log}``, and not ``${{x}}``."""
    assert PLACEHOLDER.findall("exec a --repo {params.repo} > {log:q} ${{HOME}}") == ["params.repo", "log:q"]
