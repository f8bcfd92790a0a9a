"""The state of a git checkout: the one definition of "commit", "branch" and "dirty".

:func:`read_git_state` asks git for ``HEAD``, its short form, the current branch and
``git status --porcelain=v1 -z --untracked-files=all``. A checkout is **dirty** when the code
that runs may differ from the commit:

- a tracked file has a staged or unstaged change (whatever its kind), or
- an untracked, not ignored file could change what runs: a source file (:func:`is_source`:
  ``.py``, ``.pyx``, ``.pxd``, ``.c``, ``.h``, ``.cc``, ``.cpp``, ``.cu``, ``.cuh``, ``.smk``,
  a ``Snakefile``, ``.pth``), a build or packaging file (``pyproject.toml``, ``setup.py``,
  ``setup.cfg``, ``MANIFEST.in``), or any file under the directories the package and the
  workflow read their code, schemas and rules from, and the focused suite its tests and fixtures
  from (``rl_engine/``, ``workflow/``, ``schemas/``, ``tests/``).

Any other untracked file (a capture, a figure, a worked example's YAML or output) is **data**:
it is listed (:attr:`GitState.untracked_data_files`) and counted in environment.json, and does
not make the checkout dirty, since nothing the workflow runs imports or includes it (a config
file given with ``--configfile`` reaches the evidence through the config, whose case values the
case hash covers). Ignored files (``.gitignore``, ``.git/info/exclude``) are neither.
``environment.json``'s git record is built from it; anything else that needs "dirty" (such as
a run name) should call it rather than ask git itself, so no two records can disagree about
whether the tested tree was clean.

Outside a git checkout, without a ``git`` executable, or when git does not answer within the
time limit, :class:`GitStateError` says why; callers record that (no commit) rather than fail.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TIMEOUT_S = 20.0
SHORT_LENGTH = 7
COMMIT = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")
UNTRACKED = "??"
SOURCE_SUFFIXES = frozenset({".py", ".pyx", ".pxd", ".c", ".h", ".cc", ".cpp", ".cu", ".cuh", ".smk", ".pth"})
SOURCE_NAMES = frozenset({"Snakefile", "pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in"})
SOURCE_DIRS = ("rl_engine/", "workflow/", "schemas/", "tests/")


def is_source(path: str) -> bool:
    """Whether an untracked file at ``path`` (relative to the checkout, ``/``-separated) could
    change what the package or the workflow runs (the module docstring's rule)."""
    name = path.rsplit("/", 1)[-1]
    suffix = name[name.rfind("."):] if "." in name.lstrip(".") else ""
    return suffix in SOURCE_SUFFIXES or name in SOURCE_NAMES or path.startswith(SOURCE_DIRS)


class GitStateError(RuntimeError):
    """The git state of a directory cannot be read (not a checkout, no git, git timed out)."""


@dataclass(frozen=True)
class Change:
    """One line of ``git status --porcelain``: the two-letter status and the path."""

    status: str
    path: str

    def __post_init__(self) -> None:
        if len(self.status) != 2 or not self.path:
            raise GitStateError(f"Change needs a two-letter status and a path, got {self.status!r} {self.path!r}")


@dataclass(frozen=True)
class GitState:
    """``HEAD`` of a checkout and every change against it (untracked-but-not-ignored included)."""

    commit: str
    short_commit: str
    branch: str | None  # None on a detached HEAD
    changes: tuple[Change, ...] = ()

    def __post_init__(self) -> None:
        if not COMMIT.match(self.commit):
            raise GitStateError(f"commit must be a full hexadecimal object id, got {self.commit!r}")
        if not self.commit.startswith(self.short_commit) or len(self.short_commit) < 4:
            raise GitStateError(f"short_commit {self.short_commit!r} is not a prefix of {self.commit!r}")
        if self.branch == "":
            raise GitStateError("branch must be a name or None (detached HEAD), not empty")
        object.__setattr__(self, "changes", tuple(self.changes))

    @property
    def dirty(self) -> bool:
        """A tracked change, or an untracked source file (:func:`is_source`)."""
        return any(c.status != UNTRACKED or is_source(c.path) for c in self.changes)

    @property
    def changed_files(self) -> tuple[str, ...]:
        """Every path git status lists, tracked changes and untracked files alike, in git's order."""
        return tuple(c.path for c in self.changes)

    @property
    def untracked_files(self) -> tuple[str, ...]:
        return tuple(c.path for c in self.changes if c.status == UNTRACKED)

    @property
    def untracked_data_files(self) -> tuple[str, ...]:
        """Untracked files that do not make the checkout dirty (not :func:`is_source`)."""
        return tuple(path for path in self.untracked_files if not is_source(path))


def _git(repo: Path, timeout_s: float, *args: str) -> str:
    argv = ["git", "-C", str(repo), *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        raise GitStateError("git is not installed (no git executable on PATH)") from None
    except subprocess.TimeoutExpired:
        raise GitStateError(f"'git {' '.join(args)}' did not answer within {timeout_s} s") from None
    except OSError as exc:
        raise GitStateError(f"git could not run: {exc}") from None
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[0] if done.stderr.strip() else f"exit code {done.returncode}"
        raise GitStateError(f"'git {' '.join(args)}' failed in {repo}: {reason}")
    return done.stdout


def parse_porcelain(text: str) -> tuple[Change, ...]:
    """Entries of ``git status --porcelain=v1 -z`` (a rename's original path is skipped)."""
    fields = text.split("\0")
    changes: list[Change] = []
    index = 0
    while index < len(fields):
        entry = fields[index]
        index += 1
        if not entry:
            continue
        if len(entry) < 4 or entry[2] != " ":
            raise GitStateError(f"unexpected git status entry {entry!r}")
        status = entry[:2]
        changes.append(Change(status, entry[3:]))
        if "R" in status or "C" in status:
            index += 1  # -z puts the source of a rename or copy in the next field
    return tuple(changes)


def read_git_state(repo: str | Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> GitState:
    """The :class:`GitState` of the checkout containing ``repo``, or :class:`GitStateError`."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise GitStateError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    path = Path(repo)
    commit = _git(path, timeout_s, "rev-parse", "--verify", "HEAD").strip()
    short = _git(path, timeout_s, "rev-parse", f"--short={SHORT_LENGTH}", "HEAD").strip()
    branch = _git(path, timeout_s, "branch", "--show-current").strip() or None
    status = _git(path, timeout_s, "status", "--porcelain=v1", "-z", "--untracked-files=all")
    return GitState(commit, short, branch, parse_porcelain(status))


__all__ = ["Change", "GitState", "GitStateError", "is_source", "parse_porcelain", "read_git_state"]
