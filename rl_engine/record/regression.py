"""Focused regression: the guide's step 1 with machine-readable counts.

``python -m rl_engine regression --output-dir RUN --tests FILE... [--pytest-arg ARG]... [--timeout-s S]``
runs ``sys.executable -m pytest -q -rs -p rl_engine.record.suite_imports FILE... [ARG]...
--junitxml=RUN/pytest-junit.xml`` as a subprocess, writes its combined output to
``RUN/pytest-focused.log`` (and echoes it), and writes ``RUN/regression.json``
(``schemas/regression.schema.json``) with the counts parsed from the JUnit XML: ``passed``,
``failed``, ``skipped``, ``errors``, ``total``, plus the command, the test files, pytest's exit
code, the duration and ``imported``: every file the pytest processes loaded, with its SHA-256
(:mod:`rl_engine.record.suite_imports`), which ``--reuse-dir`` checks before it reuses a pass
(:mod:`rl_engine.record.reuse`).

pytest runs in a process group of its own, and this verb stops it and everything it started
(:func:`rl_engine.proctree.stop_tree`, as ``launch`` does for torchrun) when it gets
SIGINT, SIGTERM or SIGHUP (Ctrl-C in the terminal, a cancelled Snakemake job) and when
``--timeout-s`` passes; then it writes no ``regression.json`` and exits ``128 + N`` or ``124``.
The workflow used GNU ``timeout``, which put itself and pytest in their own process group, out
of reach of the terminal's Ctrl-C: Snakemake waited for pytest to finish.

Exit 0 when pytest exited 0 and every test passed or was skipped; 1 when any test failed or
errored, no test ran, or pytest exited non-zero, or when ``regression.json`` would not match its
schema (then it is not written); 2 on a bad argument, a missing test file, or a checkout whose fused
kernel is not built (:func:`unbuilt_kernel`: nothing is run). On a failed
regression the verb still writes ``regression.json``, which a hand run keeps; under Snakemake a
failed job's outputs are deleted, so there the record of what failed is the rule's log
(``RUN/logs/regression.log``, which holds the echoed pytest output), not ``regression.json``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_engine import jsonio, schemas
from rl_engine.proctree import EXIT_TIMEOUT, KILL_GRACE_S, StopSignals, stop_tree, supervise
from rl_engine.record import environment, reuse, suite_imports
from rl_engine.rundir import JUNIT, PYTEST_LOG, REGRESSION
from rl_engine.tables import SCHEMA_VERSION

PROBE_TIMEOUT_S = 20.0  # per tool of the environment probe the regression key is made from


class RegressionStopped(RuntimeError):
    """pytest was stopped (time limit or signal); ``code`` is the verb's exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class JUnitError(ValueError):
    """A JUnit XML file that is missing or cannot be read as pytest's report."""


@dataclass(frozen=True)
class Counts:
    passed: int
    failed: int
    skipped: int
    errors: int

    def __post_init__(self) -> None:
        for name in ("passed", "failed", "skipped", "errors"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise JUnitError(f"{name} count must be a non-negative integer, got {value!r}")

    @property
    def total(self) -> int:
        return self.passed + self.failed + self.skipped + self.errors


def parse_junit(path: Path) -> Counts:
    """Counts from pytest's JUnit XML, summed over every ``<testsuite>``."""
    if not path.is_file():
        raise JUnitError(f"{path} was not written (pytest did not get as far as reporting)")
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        raise JUnitError(f"{path}: not valid XML ({exc})") from None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        raise JUnitError(f"{path}: no <testsuite> element")
    tests = failures = errors = skipped = 0
    for suite in suites:
        try:
            tests += int(suite.get("tests", "0"))
            failures += int(suite.get("failures", "0"))
            errors += int(suite.get("errors", "0"))
            skipped += int(suite.get("skipped", "0"))
        except ValueError as exc:
            raise JUnitError(f"{path}: a <testsuite> count is not an integer ({exc})") from None
    passed = tests - failures - errors - skipped
    if passed < 0:
        raise JUnitError(f"{path}: tests={tests} is less than failures+errors+skipped")
    return Counts(passed=passed, failed=failures, skipped=skipped, errors=errors)


PROGRESS = re.compile(r"\[\s*(\d+)%\]\s*$")  # the end of a ``pytest -q`` progress line


def progress_line(line: str, elapsed_s: float) -> str | None:
    """``regression: 48% of the focused suite, 12 s`` for a pytest ``-q`` progress line, else None."""
    match = PROGRESS.search(line)
    return f"regression: {match.group(1)}% of the focused suite, {elapsed_s:.0f} s\n" if match else None


def _copy_output(source: Any, handle: Any, progress: Any = None) -> None:
    start = time.monotonic()
    for line in source:
        handle.write(line)
        handle.flush()
        sys.stdout.write(line)
        sys.stdout.flush()
        shown = progress_line(line, time.monotonic() - start) if progress is not None else None
        if shown:
            progress.write(shown)
            progress.flush()


def _run_pytest(argv: list[str], log: Path, timeout_s: float | None, progress: Any = None,
                env: dict[str, str] | None = None) -> int:
    """pytest's exit code; :class:`RegressionStopped` after stopping it on a signal or the time limit."""
    with open(log, "w", encoding="utf-8") as handle, StopSignals() as stops:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True, env=env)
        copier = threading.Thread(target=_copy_output, args=(proc.stdout, handle, progress), daemon=True)
        copier.start()
        ended = supervise(proc, timeout_s, stops, lambda: stop_tree(proc, KILL_GRACE_S))
        copier.join()
    if ended.timed_out:
        raise RegressionStopped(EXIT_TIMEOUT, f"pytest exceeded --timeout-s={timeout_s:g}; it and every process "
                                              "it started were killed; regression.json not written")
    if ended.signum is not None:
        name = signal.Signals(ended.signum).name
        raise RegressionStopped(128 + ended.signum, f"received {name}; pytest and every process it started "
                                                    "were stopped; regression.json not written")
    assert ended.code is not None
    return ended.code


def run(output_dir: Path, tests: list[str], pytest_args: list[str],
        timeout_s: float | None = None, progress: Any = None) -> tuple[dict[str, Any], int]:
    """Run pytest, write the log, the JUnit XML and regression.json; return it and the exit code.

    Raises :class:`RegressionStopped` when pytest was stopped (``timeout_s`` or a signal).
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    junit = output_dir / JUNIT
    log = output_dir / PYTEST_LOG
    for stale in (junit, log, output_dir / REGRESSION):
        stale.unlink(missing_ok=True)
    imports = Path(tempfile.mkdtemp(prefix="rl_engine-imports-"))
    try:
        argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", suite_imports.PLUGIN, *tests, *pytest_args,
                f"--junitxml={junit}"]
        shown = ["python", *argv[1:]]
        start = time.monotonic()
        code = _run_pytest(argv, log, timeout_s, progress, {**os.environ, suite_imports.ENV_DIR: str(imports)})
        duration = time.monotonic() - start
        imported = suite_imports.collect(imports)
    finally:
        shutil.rmtree(imports, ignore_errors=True)
    try:
        counts = parse_junit(junit)
        problem = None
    except JUnitError as exc:
        counts, problem = Counts(0, 0, 0, 0), str(exc)
    result = {
        "schema_version": SCHEMA_VERSION,
        "command": shlex.join(shown),
        "tests": list(tests),
        "passed": counts.passed,
        "failed": counts.failed,
        "skipped": counts.skipped,
        "errors": counts.errors,
        "total": counts.total,
        "exit_code": code,
        "duration_s": round(duration, 3),
        "log": PYTEST_LOG,
        "junit": JUNIT if problem is None else None,
        "problem": problem,
        "imported": imported,
    }
    schemas.write_validated(output_dir / REGRESSION, result, "regression")
    failed = problem is not None or code != 0 or counts.failed or counts.errors or counts.total == 0
    return result, 1 if failed else 0


def unbuilt_kernel() -> str | None:
    """Why the focused suite cannot pass in the checkout it runs from, or None: a compiled module
    (the fused kernel, or the fused head's fixed-order logits; ``setup.py`` builds both at
    ``pip install -e .``) is not beside the ``rl_engine`` this process imports. Run from a checkout
    whose package was installed from another one, the suite's ``auto`` tests would otherwise fail
    saying that ``auto`` chose the eager backend."""
    import importlib.machinery

    import rl_engine

    package = Path(rl_engine.__file__).resolve().parent
    for where, what in (("logprob/backends/fused_cpu/_fused_cpu", "the fused kernel"),
                        ("logprob/_head_gemm", "the fused head's fixed-order product")):
        if not any((package / f"{where}{suffix}").is_file() for suffix in importlib.machinery.EXTENSION_SUFFIXES):
            return (f"{what} is not built in this checkout ({package.parent}: no {where}"
                    f"{importlib.machinery.EXTENSION_SUFFIXES[0]}): run `pip install -e .` here (in {package.parent}), "
                    "then run the workflow again; nothing was run")
    return None


def _reuse(reuse_dir: Path, key: str, origin: dict[str, Any], output_dir: Path, progress: Any) -> int:
    """Copy a cached pass into ``output_dir`` (regression.json gains ``reused``); exit 0."""
    cached = reuse.entry(reuse_dir, "regression", key)
    output_dir.mkdir(parents=True, exist_ok=True)
    for name in (PYTEST_LOG, JUNIT):
        jsonio.atomic_write_bytes(output_dir / name, (cached / name).read_bytes())
    result = {**jsonio.load(cached / REGRESSION), reuse.REUSED: reuse.reused_record(origin)}
    schemas.write_validated(output_dir / REGRESSION, result, "regression")
    line = (f"regression: reused the focused suite's pass of {reuse.reused_text(result[reuse.REUSED])}: "
            f"{result['passed']} passed, {result['skipped']} skipped; not run again: the same package, checkout "
            f"and test bytes, tests, arguments, environment variables and environment, and each of the "
            f"{len(result['imported'])} files its pytest loaded unchanged (key {key[:16]}; {cached})")
    print(line)
    if progress is not None:
        print(line, file=progress, flush=True)
    return 0


def _lookup(reuse_dir: Path | None, tests: list[str], pytest_args: list[str],
            progress: Any) -> tuple[str, dict[str, Any] | None, str | None]:
    """The static key, the cached pass to reuse (its ``origin.json``) or None, and this checkout's commit.

    A cached pass whose suite loaded a file that has other bytes now is dropped from the cache (and
    said so): it is not this code's pass."""
    if reuse_dir is None:
        return "", None, None
    record = environment.probe(Path.cwd(), PROBE_TIMEOUT_S)
    key = reuse.regression_key(Path.cwd(), tests, pytest_args, record)
    origin = reuse.lookup(reuse_dir, "regression", key, [REGRESSION, PYTEST_LOG, JUNIT])
    if origin is not None:
        try:
            imported = jsonio.load(reuse.entry(reuse_dir, "regression", key) / REGRESSION).get("imported")
        except (OSError, ValueError, AttributeError):
            imported = None
        changed = reuse.changed_imports(imported)
        if changed:
            line = (f"regression: not reusing the pass of {reuse.reused_text(reuse.reused_record(origin))}: "
                    f"{len(changed)} file(s) its pytest loaded differ now ({'; '.join(changed[:3])}"
                    f"{'; ...' if len(changed) > 3 else ''}); the cached pass is dropped and the suite runs")
            print(line)
            if progress is not None:
                print(line, file=progress, flush=True)
            reuse.discard(reuse_dir, "regression", key)
            origin = None
    return key, origin, record["git"]["commit"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_engine regression", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True, type=Path, help="run directory to write into")
    parser.add_argument("--tests", required=True, nargs="+", help="test files to run")
    parser.add_argument("--pytest-arg", action="append", default=[], help="extra pytest argument (repeatable)")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="wall-clock limit: stop pytest and what it started, exit 124 (default: none)")
    parser.add_argument("--reuse-dir", type=Path, default=None,
                        help="cache of earlier passing suites (rl_engine.record.reuse): copy the one whose key (the "
                             "package's bytes, built kernels included, the checkout's and the tests' bytes, pytest's "
                             "configuration, the test list and arguments, environment variables, the environment "
                             "record) is this run's and whose pytest loaded only files that still have the same "
                             "bytes, else run pytest and store a pass")
    parser.add_argument("--progress-fd", type=int, default=None,
                        help="also write one line per pytest progress line, and the counts, to this open file "
                             "descriptor (the workflow passes the console's, as its log takes stdout)")
    args = parser.parse_args(argv)
    if args.timeout_s is not None and not args.timeout_s > 0:
        parser.error(f"--timeout-s={args.timeout_s} must be > 0 (config regression.timeout_s)")
    missing = [t for t in args.tests if not Path(t.split("::", 1)[0]).exists()]
    if missing:
        print(f"regression: test file(s) not found: {', '.join(missing)}; fix --tests (config regression.tests)", file=sys.stderr)
        return 2
    unbuilt = unbuilt_kernel()
    if unbuilt:
        print(f"regression: {unbuilt}", file=sys.stderr)
        return 2
    try:
        progress = os.fdopen(args.progress_fd, "w", closefd=False) if args.progress_fd is not None else None
    except OSError as exc:
        parser.error(f"--progress-fd={args.progress_fd} is not an open file descriptor ({exc})")
    key, origin, commit = _lookup(args.reuse_dir, args.tests, args.pytest_arg, progress)
    if origin is not None:
        return _reuse(args.reuse_dir, key, origin, args.output_dir, progress)
    if progress is not None:
        print(f"regression: running the focused suite ({len(args.tests)} files); its log: "
              f"{args.output_dir / PYTEST_LOG}", file=progress, flush=True)
    try:
        result, code = run(args.output_dir, args.tests, args.pytest_arg, args.timeout_s, progress)
    except schemas.ArtifactSchemaError as exc:
        print(f"regression: {exc}", file=sys.stderr)
        return 1
    except RegressionStopped as exc:
        print(f"regression: {exc}", file=sys.stderr)
        return exc.code
    if code == 0 and result["imported"]:
        reuse.store(args.reuse_dir, "regression", key, {name: args.output_dir / name for name in
                                                         (REGRESSION, PYTEST_LOG, JUNIT)}, args.output_dir.name, commit)
    elif code == 0 and args.reuse_dir is not None:
        print("regression: the pass is not stored for reuse: pytest wrote no list of the files it loaded",
              file=sys.stderr)
    line = (f"regression: {result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped, "
            f"{result['errors']} errors (total {result['total']}, pytest exit {result['exit_code']})")
    print(line, file=sys.stderr if code else sys.stdout)
    if progress is not None:
        print(line, file=progress, flush=True)
    if result["problem"]:
        print(f"regression: {result['problem']}", file=sys.stderr)
    elif code and result["total"] == 0:
        print("regression: no test ran", file=sys.stderr)
    return code
