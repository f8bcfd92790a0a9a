"""Reuse of the environment capture and of a passing focused suite across runs (rl_engine.record.reuse).

A new case is a new run directory; its environment and regression stages copy an earlier run's
files when the key of what the stage depends on is the same, and say so in their JSON, their
output and SUMMARY.md. Each test changes one thing the key covers and sees the stage run again;
the scratch projects play what a key that misses it would get wrong (a rebuilt extension with its
source reverted, a root conftest.py, an environment variable, a driver upgrade): a stale pass or
capture reused.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from rl_engine import jsonio, schemas
from rl_engine.record import environment, regression, reuse, suite_imports
from rl_engine.rundir import ENVIRONMENT, ENVIRONMENT_TEXT, JUNIT, PYTEST_LOG, REGRESSION


@pytest.fixture(autouse=True)
def _bare_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scratch suites' pytest without the installed plugins (hypothesis, xdist, ...): 0.8 s a
    start instead of 3.7 s here; the verb's own plugin is named with ``-p`` and still loads."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.fixture()
def quick_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """``env``'s torch one-liner (a Python that imports torch: about 2 s of CPU a capture) replaced by
    one that prints a line, where the claim is which capture is reused: the keys come from the probe
    (environment.json, in this process), the one-liner only writes environment.txt's text, whose
    commands and output tests/test_evidence.py::test_environment_records_commands_and_absent_tools checks."""
    monkeypatch.setattr(environment, "TORCH_ONE_LINER", "print('torch: the one-liner replaced by tests/test_reuse.py')")


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c",
                           "commit.gpgsign=false", *args], cwd=repo, check=True, capture_output=True, text=True)
    return done.stdout


def _suite(root: Path, body: str, name: str = "test_tiny.py") -> list[str]:
    (root / "tests").mkdir(exist_ok=True)
    (root / "tests" / name).write_text(body)
    return [f"tests/{name}"]


def _runner(root: Path, tests: list[str], capsys: pytest.CaptureFixture[str], cache: Path | None = None):
    """``regression --reuse-dir`` in ``root`` (the working directory): (exit code, regression.json, stdout)."""
    cache = cache or root / "results" / ".reuse"

    def run(name: str, *extra: str) -> tuple[int, dict[str, Any], str]:
        code = regression.main(["--output-dir", f"results/{name}", "--tests", *tests, "--reuse-dir", str(cache), *extra])
        return code, jsonio.load(root / "results" / name / REGRESSION), capsys.readouterr().out

    return run


def test_a_passing_suite_is_reused_by_the_next_run_and_rerun_when_a_test_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    tests = _suite(tmp_path, "def test_one():\n    assert 1 + 1 == 2\n")
    run = _runner(tmp_path, tests, capsys)
    code, first, _ = run("first")
    assert code == 0 and first["passed"] == 1 and "reused" not in first
    imported = {item["path"] for item in first["imported"]}  # what its pytest loaded, with SHA-256
    assert str((tmp_path / "tests" / "test_tiny.py").resolve()) in imported and os.path.realpath(sys.executable) in imported
    assert str(Path(suite_imports.__file__).resolve()) in imported
    code, second, out = run("second")  # same files, tests, environment: copied, pytest not run
    assert code == 0 and second["reused"]["from_run"] == "first" and "regression: reused" in out, out
    assert second["reused"]["from_commit"] is None  # not a git checkout
    assert {k: v for k, v in second.items() if k != "reused"} == first
    assert schemas.errors(second, "regression") == []
    for name in (PYTEST_LOG, JUNIT):
        assert (tmp_path / "results/second" / name).read_bytes() == (tmp_path / "results/first" / name).read_bytes()
    _suite(tmp_path, "def test_one():\n    assert 2 + 2 == 4\n")  # a changed test: a new key, pytest runs
    code, third, out = run("third")
    assert code == 0 and "reused" not in third and "regression: reused" not in out


def test_a_failing_suite_is_never_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    tests = _suite(tmp_path, "def test_one():\n    assert False\n")
    cache = tmp_path / ".reuse"
    for name in ("a", "b"):
        code = regression.main(["--output-dir", name, "--tests", *tests, "--reuse-dir", str(cache)])
        assert code == 1 and "reused" not in jsonio.load(tmp_path / name / REGRESSION)
    assert not list(cache.glob("regression-*")) and "regression: reused" not in capsys.readouterr().out


KERNEL_C = """#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject *value(PyObject *self, PyObject *args) { return PyLong_FromLong(VALUE); }
static PyMethodDef methods[] = {{"value", value, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kern", NULL, -1, methods};
PyMODINIT_FUNC PyInit_kern(void) { return PyModule_Create(&module); }
"""


def _build_kernel(root: Path, value: int) -> None:
    """``kern.c`` returning ``value``, compiled to ``kern<EXT_SUFFIX>`` beside it (ignored by git, as
    ``_fused_cpu*.so`` is)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler is needed (the fused kernel is built with one too)"
    (root / "kern.c").write_text(KERNEL_C.replace("VALUE", str(value)))
    subprocess.run([compiler, "-shared", "-fPIC", "-O0", f"-I{sysconfig.get_paths()['include']}", "kern.c", "-o",
                    f"kern{sysconfig.get_config_var('EXT_SUFFIX')}"], cwd=root, check=True, capture_output=True)


def test_a_kernel_rebuilt_from_altered_source_then_reverted_runs_the_suite_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The built object is ignored by git and the source is back to its committed bytes (``git
    status`` empty), so neither the checkout's files nor the static key change; the suite's pytest
    loaded that object, whose bytes did change: the suite runs again and fails."""
    monkeypatch.chdir(tmp_path)
    _build_kernel(tmp_path, 1)
    (tmp_path / ".gitignore").write_text("*.so\nresults/\n__pycache__/\n.pytest_cache/\n")
    tests = _suite(tmp_path, "import kern\n\n\ndef test_value():\n    assert kern.value() == 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "kernel")
    run = _runner(tmp_path, tests, capsys)
    code, first, _ = run("first")
    built = str((tmp_path / f"kern{sysconfig.get_config_var('EXT_SUFFIX')}").resolve())
    assert code == 0 and built in {item["path"] for item in first["imported"]}
    assert run("second")[1]["reused"]["from_commit"] == _git(tmp_path, "rev-parse", "HEAD").strip()  # control
    static = reuse.regression_key(tmp_path, tests, [], environment.probe(tmp_path, 20.0))
    _build_kernel(tmp_path, 2)
    (tmp_path / "kern.c").write_text(KERNEL_C.replace("VALUE", "1"))  # the source reverted, the object kept
    assert _git(tmp_path, "status", "--porcelain") == ""
    assert reuse.regression_key(tmp_path, tests, [], environment.probe(tmp_path, 20.0)) == static
    code, third, out = run("third")
    assert code == 1 and third["failed"] == 1 and "reused" not in third, out
    assert "not reusing the pass of run first" in out and built in out, out
    assert not list((tmp_path / "results" / ".reuse").glob("regression-*"))  # the stale pass is dropped
    _build_kernel(tmp_path, 1)  # the object rebuilt from the committed source: a new pass is stored and reused
    assert run("rebuilt")[0] == 0 and run("again")[1]["reused"]["from_run"] == "rebuilt"


def test_a_project_variable_or_a_root_conftest_runs_the_suite_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An environment variable of the project, and a root conftest.py that changes the arithmetic
    (as ``torch.set_flush_denormal`` would; here the decimal context's precision), each make a
    fresh run fail; the reuse must see them."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RL_ENGINE_SCALE", raising=False)
    tests = _suite(tmp_path, "import os\nfrom decimal import Decimal\n\n\ndef test_scale():\n"
                             "    assert os.environ.get('RL_ENGINE_SCALE', '1') == '1'\n\n\ndef test_third():\n"
                             "    assert str(Decimal(1) / Decimal(3)) == '0.' + '3' * 28\n")
    run = _runner(tmp_path, tests, capsys)
    assert run("first")[0] == 0
    monkeypatch.setenv("RL_ENGINE_SCALE", "2")
    code, scaled, out = run("scaled")
    assert code == 1 and scaled["failed"] == 1 and "reused" not in scaled, out
    monkeypatch.delenv("RL_ENGINE_SCALE")
    assert run("unscaled")[2].startswith("regression: reused the focused suite's pass of run first")  # control
    (tmp_path / "conftest.py").write_text("import decimal\n\ndecimal.getcontext().prec = 5\n")
    code, rooted, out = run("conftest")
    assert code == 1 and rooted["failed"] == 1 and "reused" not in rooted, out
    assert str((tmp_path / "conftest.py").resolve()) in {item["path"] for item in rooted["imported"]}


def test_the_static_regression_key_covers_what_the_suite_reads(tmp_path: Path) -> None:
    """The package as imported (its built objects included, its bytecode caches not), the tests'
    directory, pytest's configuration files and a root conftest.py, the environment variables that
    change results, the environment record but git's, the test list and the arguments; an untracked
    data file, an unrelated variable and the git record leave it unchanged."""
    repo, package = tmp_path / "repo", tmp_path / "site" / "rl_engine"
    repo.mkdir()
    (package / "logprob").mkdir(parents=True)
    (package / "mod.py").write_text("x = 1\n")
    kernel = package / "logprob" / f"_fused_cpu{sysconfig.get_config_var('EXT_SUFFIX')}"
    kernel.write_bytes(b"\x7fELF one")
    tests = _suite(repo, "def test_one():\n    pass\n")
    record = {"git": {"commit": "a" * 40}, "torch": {"version": "2"}, "nvidia": {"driver_version": None}}
    environ = {"HOME": "/root", "PATH": "/usr/bin"}

    def key(**changes: Any) -> str:
        args = {"tests": tests, "pytest_args": [], "record": record, "package": package, "environ": environ, **changes}
        return reuse.regression_key(repo, **args)

    base = key()
    assert key() == base
    for name, data in (("data.bin", b"\0"), ("notes.yaml", b"a: 1\n")):  # untracked data: not the suite's
        (repo / name).write_bytes(data)
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    assert key() == base
    assert key(environ={**environ, "HOME": "/home/other", "TERM": "dumb"}) == base
    assert key(record={**record, "git": {"commit": "b" * 40}}) == base
    changed = {
        "pytest argument": key(pytest_args=["-x"]),
        "test list": key(tests=[*tests, "tests/test_other.py"]),
        "environment record": key(record={**record, "nvidia": {"driver_version": "550.54.15"}}),
        **{f"variable {v}": key(environ={**environ, v: "1"}) for v in
           ("RL_ENGINE_FAULT", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_DETERMINISTIC", "CUBLAS_WORKSPACE_CONFIG",
            "PYTHONPATH", "PYTEST_ADDOPTS", "LD_PRELOAD", "TRITON_INTERPRET", "NCCL_ALGO")},
        "PATH": key(environ={**environ, "PATH": "/opt/bin:/usr/bin"}),
    }
    assert len(set(changed.values()) | {base}) == len(changed) + 1, changed
    edits = [(kernel, b"\x7fELF two"), (package / "mod.py", b"x = 2\n"), (repo / "tests" / "_helper.py", b"y = 1\n"),
             (repo / "conftest.py", b"import decimal\n"), (repo / "pytest.ini", b"[pytest]\n"),
             (repo / "tox.ini", b"[pytest]\n"), (repo / "setup.cfg", b"[tool:pytest]\n"),
             (repo / "pyproject.toml", b"[tool.pytest.ini_options]\n"), (repo / "tests" / "conftest.py", b"x = 1\n")]
    seen = {base}
    for path, data in edits:
        path.write_bytes(data)
        now = key()
        assert now not in seen, path
        seen.add(now)


def test_the_checkout_s_tracked_files_and_untracked_sources_are_in_the_key(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "schemas").mkdir(parents=True)
    (repo / "schemas" / "a.schema.json").write_text("{}\n")
    (repo / "docs.md").write_text("# a\n")
    (repo / ".gitignore").write_text("*.bin\n")
    tests = _suite(repo, "def test_one():\n    pass\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "first")
    listing, files = reuse.checkout_files(repo)
    assert listing == "git" and {p.relative_to(repo).as_posix() for p in files} == {
        ".gitignore", "docs.md", "schemas/a.schema.json", "tests/test_tiny.py"}
    record = {"git": None}

    def key() -> str:
        return reuse.regression_key(repo, tests, [], record, package=tmp_path / "pkg", environ={})

    (tmp_path / "pkg").mkdir()
    base = key()
    (repo / "ignored.bin").write_bytes(b"\0")
    (repo / "capture.safetensors").write_bytes(b"\0")  # untracked data
    assert key() == base
    (repo / "schemas" / "a.schema.json").write_text('{"type": "object"}\n')  # a tracked file the suite reads
    edited = key()
    assert edited != base
    (repo / "extra.py").write_text("x = 1\n")  # an untracked source file
    assert key() != edited


FAKE_NVIDIA_SMI = """#!/bin/sh
case "$*" in
  *--query-gpu=driver_version*) echo "DRIVER";;
  *--query-gpu=*) echo "0, NVIDIA H100 80GB HBM3, GPU-0f1e2d3c-0000-1111-2222-333344445555, 00000000:18:00.0, 96.00.99.00.01, 81559 MiB";;
  *) echo "| NVIDIA-SMI DRIVER    Driver Version: DRIVER    CUDA Version: 12.4 |";;
esac
"""
FAKE_NVCC = """#!/bin/sh
echo "nvcc: NVIDIA (R) Cuda compiler driver"
echo "Cuda compilation tools, release RELEASE, VRELEASE.131"
echo "Build cuda_RELEASE.r12/compiler.0"
"""


def _fake_tools(folder: Path, driver: str, release: str) -> None:
    """``nvidia-smi`` and ``nvcc`` scripts that answer as a driver ``driver`` and a toolkit ``release`` would."""
    folder.mkdir(exist_ok=True)
    for name, text in (("nvidia-smi", FAKE_NVIDIA_SMI.replace("DRIVER", driver)),
                       ("nvcc", FAKE_NVCC.replace("RELEASE", release))):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.txt").write_text("a\n")
    _git(repo, "add", "a.txt")
    _git(repo, "commit", "-q", "-m", "first")
    return repo


def test_the_environment_capture_is_reused_until_the_git_status_changes(
        tmp_path: Path, repo: Path, capsys: pytest.CaptureFixture[str], quick_capture: None) -> None:
    cache = tmp_path / ".reuse"

    def run(name: str) -> tuple[dict, str]:
        assert environment.main(["--output-dir", str(tmp_path / name), "--repo", str(repo),
                                 "--reuse-dir", str(cache)]) == 0
        return jsonio.load(tmp_path / name / ENVIRONMENT), capsys.readouterr().out

    first, _ = run("first")
    second, out = run("second")
    assert "environment: reused the capture of run first" in out and second["reused"]["from_run"] == "first"
    assert second["reused"]["from_commit"] == first["git"]["commit"]
    assert {k: v for k, v in second.items() if k != "reused"} == first and schemas.errors(second, "environment") == []
    assert (tmp_path / "second" / ENVIRONMENT_TEXT).read_bytes() == (tmp_path / "first" / ENVIRONMENT_TEXT).read_bytes()
    (repo / "capture.safetensors").write_bytes(b"\0")  # untracked data: the record lists it, so a new capture
    third, out = run("third")
    assert "reused" not in third and third["git"]["untracked_data_files"] == ["capture.safetensors"], out


def test_a_driver_or_toolkit_upgrade_captures_and_tests_again(
        tmp_path: Path, repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        quick_capture: None) -> None:
    """The NVIDIA driver and nvcc are in environment.json, so in both keys; the upgraded machine's
    capture names the new driver, in the record and in environment.txt."""
    tools = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    cache = tmp_path / ".reuse"

    def run(name: str) -> tuple[dict, str, str]:
        assert environment.main(["--output-dir", str(tmp_path / name), "--repo", str(repo),
                                 "--reuse-dir", str(cache)]) == 0
        return (jsonio.load(tmp_path / name / ENVIRONMENT), (tmp_path / name / ENVIRONMENT_TEXT).read_text(),
                capsys.readouterr().out)

    _fake_tools(tools, "550.54.15", "12.4")
    old, old_text, _ = run("old")
    assert old["nvidia"]["driver_version"] == "550.54.15" and old["tools"] == {"nvidia_smi": True, "nvcc": True}
    assert old["nvidia"]["nvcc_version"] == "Cuda compilation tools, release 12.4, V12.4.131; Build cuda_12.4.r12/compiler.0"
    assert old["nvidia"]["gpus"][0].startswith("0, NVIDIA H100 80GB HBM3, GPU-0f1e2d3c")
    assert "Driver Version: 550.54.15" in old_text and schemas.errors(old, "environment") == []
    assert run("same")[0]["reused"]["from_run"] == "old"  # control: the same machine reuses
    tests = _suite(repo, "def test_one():\n    pass\n")
    keys = {"old": reuse.regression_key(repo, tests, [], environment.probe(repo, 20.0))}
    _fake_tools(tools, "560.35.03", "12.4")
    new, new_text, out = run("driver")
    assert "reused" not in new and new["nvidia"]["driver_version"] == "560.35.03", out
    assert "Driver Version: 560.35.03" in new_text and "550.54.15" not in new_text
    keys["driver"] = reuse.regression_key(repo, tests, [], environment.probe(repo, 20.0))
    _fake_tools(tools, "560.35.03", "12.6")  # the toolkit alone: the probe's record and both keys change
    toolkit = environment.probe(repo, 20.0)
    assert toolkit["nvidia"]["nvcc_version"].startswith("Cuda compilation tools, release 12.6")
    assert reuse.environment_key(toolkit) != reuse.environment_key(reuse.without_reused(new))
    keys["toolkit"] = reuse.regression_key(repo, tests, [], toolkit)
    assert len(set(keys.values())) == 3, keys


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, (*path, k))] or [path]
    if isinstance(value, list):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, (*path, i))] or [path]
    return [path]


def _changed(record: Any, path: tuple[Any, ...]) -> Any:
    """``record`` with the leaf at ``path`` given another value of its kind."""
    if not path:
        if isinstance(record, bool):
            return not record
        if isinstance(record, (int, float)):
            return record + 1
        if isinstance(record, str):
            return record + "x"
        return ["x"] if isinstance(record, list) else "x"
    head, rest = path[0], path[1:]
    if isinstance(record, dict):
        return {**record, head: _changed(record[head], rest)}
    return [_changed(v, rest) if i == head else v for i, v in enumerate(record)]


def test_every_field_environment_json_records_is_in_both_keys(
        tmp_path: Path, repo: Path, monkeypatch: pytest.MonkeyPatch, quick_capture: None) -> None:
    """The keys are made from the probe that writes environment.json: the key a capture stores is the
    hash of the record it wrote, and changing any one field of that record (the driver, a GPU, the torch
    build, a package, ...) changes the environment key and, but for git's, the regression key."""
    tools = tmp_path / "bin"
    _fake_tools(tools, "550.54.15", "12.4")
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    cache = tmp_path / ".reuse"
    assert environment.main(["--output-dir", str(tmp_path / "run"), "--repo", str(repo), "--reuse-dir", str(cache)]) == 0
    record = jsonio.load(tmp_path / "run" / ENVIRONMENT)
    stored = jsonio.load(next(cache.glob("environment-*")) / "origin.json")
    assert stored["key"] == reuse.environment_key(record) == reuse.environment_key(environment.probe(repo, 20.0))
    (tmp_path / "pkg").mkdir()
    tests = _suite(repo, "def test_one():\n    pass\n")

    def regression_key(rec: dict[str, Any]) -> str:
        return reuse.regression_key(repo, tests, [], rec, package=tmp_path / "pkg", environ={})

    leaves = _leaves(record)
    assert ("nvidia", "driver_version") in leaves and ("nvidia", "nvcc_version") in leaves and len(leaves) > 30
    env_base, reg_base = reuse.environment_key(record), regression_key(record)
    for leaf in leaves:
        other = _changed(record, leaf)
        assert reuse.environment_key(other) != env_base, leaf
        assert (regression_key(other) != reg_base) is (leaf[0] != "git"), leaf


def test_a_cached_pass_is_dropped_when_a_file_its_suite_loaded_changed(tmp_path: Path) -> None:
    loaded = tmp_path / "mod.py"
    loaded.write_text("x = 1\n")
    imported = [{"path": str(loaded), "sha256": reuse.file_sha256(loaded)}]
    assert reuse.changed_imports(imported) == []
    loaded.write_text("x = 2\n")
    assert [line.split(":")[0] for line in reuse.changed_imports(imported)] == [str(loaded)]
    loaded.unlink()
    assert "gone" in reuse.changed_imports(imported)[0]
    assert reuse.changed_imports(None) and reuse.changed_imports([])  # no record: never reused
