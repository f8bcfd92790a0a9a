"""Ctrl-C reaches every job of a real workflow run, and GPUs bound what runs together.

Ctrl-C: a terminal sends SIGINT to its foreground process group. The test starts ``snakemake``
as the leader of a new process group and sends SIGINT to that group while the regression rule's
pytest runs (a test file that sleeps), which is what pressing Ctrl-C does. The regression rule
used ``timeout``, which moves itself and pytest into a process group of their own, so pytest
never saw the SIGINT and Snakemake waited for it to finish (about 34 s in the issue).

GPUs: on ``device: cuda`` each topology claims one GPU per rank; the workflow provides the
machine's GPU count unless ``--resources gpus=N`` is given. The dry runs use a ``sitecustomize``
that makes torch report CUDA with a chosen number of devices, so the parse-time check and the
count are exercised on a machine without GPUs; nothing runs on a GPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl_engine import workflow
from rl_engine.workflow import WorkflowConfigError

from _procs import mentioning
from _workflow_util import REPO, SMALL_VOCAB, copy_repo, env_for, run_name_of, snakemake_cmd, write_config

pytestmark = pytest.mark.slow  # end to end: snakemake runs (in the full suite, not the quick loop)

# Processes are found by their command line: each name holds this session's pid, so a second copy of
# the suite running beside this one is neither waited for nor killed.
SLEEPING_TEST = f"tests/test_sleeps_for_interrupt_{os.getpid()}.py"
# The sleeping tests sleep an hour: a run that ends at all was stopped, and no bound on the time it
# took to stop holds the verdict (a loaded machine, or a second copy of the suite beside this one,
# slows the stop by seconds; a lost signal waits out the hour). WAIT_LIMIT_S only bounds a failure.
SLEEP_S = 3600
WAIT_LIMIT_S = 300.0
CHILD_SLEEP = f"import time; time.sleep({SLEEP_S})  # child of test_workflow_signals {os.getpid()}"
# Patched when torch is imported, not imported here: snakemake and every job start through this hook,
# and most never import torch (the fake launches, the sources rule), so an import here cost each one
# torch's start (about 1.4 s of CPU).
FAKE_CUDA = '''"""Test hook of tests/test_workflow_signals.py: torch reports CUDA with FAKE_GPUS devices."""
import os
import sys

if os.environ.get("FAKE_GPUS"):
    from importlib.abc import MetaPathFinder
    from importlib.machinery import PathFinder

    def _fake_cuda(torch):
        import torch.distributed

        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: int(os.environ["FAKE_GPUS"])
        torch.distributed.is_nccl_available = lambda: True

    class _PatchTorchOnImport(MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "torch":
                return None
            spec = PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _fake_cuda(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchTorchOnImport())
'''


def test_ctrl_c_reaches_the_regression_job_at_once(tmp_path: Path) -> None:
    """The sleeping test says it is inside its sleep (a file); the SIGINT follows that, not a guess
    at how long pytest takes to start. The copy's conftest is emptied: the probe needs no torch."""
    repo = copy_repo(tmp_path)
    (repo / "tests" / "conftest.py").write_text('"""Emptied in this scratch copy: the sleeping test needs a quick start."""\n')
    inside = tmp_path / "inside-the-sleeping-test"
    (repo / SLEEPING_TEST).write_text(f"import pathlib\nimport time\n\n\ndef test_sleeps():\n"
                                      f"    pathlib.Path({str(inside)!r}).write_text('')\n    time.sleep({SLEEP_S})\n")
    write_config(repo, {**SMALL_VOCAB, "topologies": ["1x1", "2x1"], "regression": {"tests": [SLEEPING_TEST]}})
    target = f"results/{run_name_of(repo)}/regression.json"
    log = tmp_path / "snakemake.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(snakemake_cmd(target), cwd=repo, env=env_for(repo), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + WAIT_LIMIT_S
        while not inside.exists():  # pytest is inside the sleeping test
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "pytest did not reach the sleeping test"
            time.sleep(0.05)
        assert [p for p in mentioning(SLEEPING_TEST) if p != proc.pid], "the sleeping pytest is found by its command line"
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        try:
            proc.wait(timeout=WAIT_LIMIT_S)
        except subprocess.TimeoutExpired:
            pass
        elapsed = time.monotonic() - start
        stopped = proc.poll() is not None  # by the Ctrl-C, before the cleanup below kills what is left
        # the regression verb stops pytest and waits for it (proctree.KILL_GRACE_S); on a loaded machine the
        # last exits can trail snakemake's by a moment: poll for a bounded time, not one snapshot
        gone_by = time.monotonic() + 30.0
        while (lingering := mentioning(SLEEPING_TEST)) and time.monotonic() < gone_by:
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in mentioning(SLEEPING_TEST):
            os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    print(f"snakemake ended {elapsed:.1f} s after Ctrl-C")
    assert stopped and elapsed < SLEEP_S, (elapsed, text[-3000:])  # stopped, not waited out
    assert lingering == {}, (lingering, text[-3000:])
    assert proc.returncode != 0
    assert not (repo / target).exists()


def test_regression_time_limit_stops_pytest_and_what_it_started(tmp_path: Path) -> None:
    """The verb's own --timeout-s (what replaced GNU timeout in the rule): exit 124, nothing left."""
    sleeping = tmp_path / "test_sleeps_in_child.py"
    sleeping.write_text("import subprocess, sys\n\n\ndef test_sleeps():\n"
                        f"    subprocess.run([sys.executable, '-c', {CHILD_SLEEP!r}])\n")
    out = tmp_path / "run"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "rl_engine", "regression", "--output-dir", str(out), "--tests",
                           str(sleeping), "--timeout-s", "3"], env=env_for(REPO), capture_output=True, text=True,
                          timeout=WAIT_LIMIT_S)
    elapsed = time.monotonic() - start
    assert done.returncode == 124, done.stderr
    assert "regression: pytest exceeded --timeout-s=3; it and every process it started were killed" in done.stderr
    assert elapsed < SLEEP_S, elapsed  # the limit stopped pytest: nothing waited out the child's sleep
    assert not (out / "regression.json").exists()
    assert mentioning(CHILD_SLEEP) == {}
    bad = subprocess.run([sys.executable, "-m", "rl_engine", "regression", "--output-dir", str(out), "--tests",
                          str(sleeping), "--timeout-s", "0"], env=env_for(REPO), capture_output=True, text=True)
    assert bad.returncode == 2 and "--timeout-s=0.0 must be > 0 (config regression.timeout_s)" in bad.stderr


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("gpus")
    repo = copy_repo(base)
    hook = base / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAKE_CUDA)
    write_config(repo, {**SMALL_VOCAB, "device": "cuda", "topologies": ["1x1", "2x1", "2x2", "4x1"]})
    return repo, hook


def dry_run(repo: Path, hook: Path, gpus: int, *args: str) -> str:
    done = subprocess.run(snakemake_cmd("-n", *args), cwd=repo, env=env_for(repo, {"FAKE_GPUS": str(gpus)}, prepend=hook),
                          capture_output=True, text=True, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-4000:]
    return text


def topology_gpus(text: str) -> dict[str, int]:
    """``tp<T>-cp<C>`` -> the gpus resource of its job in a dry run's job list."""
    found = {}
    for block in re.split(r"\n(?=(?:local)?rule )", text):
        label = re.search(r"output: \S+/(tp\d+-cp\d+)\.json", block)
        gpus = re.search(r"resources: .*?\bgpus=(\d+)", block)
        if block.startswith("rule topology:") and label and gpus:
            found[label.group(1)] = int(gpus.group(1))
    return found


FAKE_LAUNCH = '''"""Stands in for `python -m rl_engine launch` in a scratch copy: records when it ran, writes the outputs."""
import argparse, json, os, time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--plan"); p.add_argument("--tp", type=int); p.add_argument("--cp", type=int)
p.add_argument("--timeout-s"); p.add_argument("--ranks-per-node")
a = p.parse_args()
run = Path(a.plan).parent
start = time.time()
peers = os.environ.get("FAKE_LAUNCH_PEERS")
if peers:  # say it started, then hold on until a second launch has started (or a failure bound)
    Path(peers, f"{a.tp}x{a.cp}").write_text("")
    while len(os.listdir(peers)) < 2 and time.time() < start + 120:
        time.sleep(0.05)
else:
    time.sleep(2)
with open(os.environ["FAKE_LAUNCH_LOG"], "a") as log:
    log.write(json.dumps({"tp": a.tp, "cp": a.cp, "start": start, "end": time.time()}) + "\\n")
for suffix in (".json", ".logp.f32", ".lse.f32", ".entropy.f32"):
    (run / f"tp{a.tp}-cp{a.cp}{suffix}").write_text("")
'''


def scheduled(repo: Path, hook: Path, tmp_path: Path, *args: str, peers: bool = False) -> list[dict[str, float]]:
    """Run the topology jobs (launch replaced by FAKE_LAUNCH) and return when each ran. With
    ``peers`` each launch holds on until a second one has started: jobs the scheduler starts
    together then overlap however late a loaded machine starts the second, and a launch that has
    no peer to wait for (run alone) ends at the failure bound, its overlap missing."""
    name = run_name_of(repo)
    for stale in (repo / "results" / name).glob("tp*-cp*.*"):
        stale.unlink()
    record = tmp_path / "launches.jsonl"
    record.unlink(missing_ok=True)
    extra = {}
    if peers:
        started = tmp_path / "started"
        shutil.rmtree(started, ignore_errors=True)
        started.mkdir()
        extra["FAKE_LAUNCH_PEERS"] = str(started)
    targets = [f"results/{name}/{label}.json" for label in ("tp1-cp1", "tp2-cp1", "tp2-cp2", "tp4-cp1")]
    done = subprocess.run(snakemake_cmd(*targets, *args), cwd=repo, capture_output=True, text=True, timeout=600,
                          env=env_for(repo, {"FAKE_GPUS": "4", "FAKE_LAUNCH_LOG": str(record), **extra},
                                      prepend=hook))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return [json.loads(line) for line in record.read_text().splitlines()]


def peak_gpus(runs: list[dict[str, float]]) -> int:
    """The most GPUs (ranks) held at once by the recorded jobs."""
    return max(sum(r["tp"] * r["cp"] for r in runs if r["start"] <= at["start"] < r["end"]) for at in runs)


def test_topologies_never_hold_more_gpus_together_than_the_node_has(fake_cuda: tuple[Path, Path], tmp_path: Path) -> None:
    """Snakemake's scheduler, with the workflow's own rules (only the launched program replaced):
    on a node with 4 GPUs, --cores 8 would run TP=2 x CP=2 and TP=4 x CP=1 together (8 ranks)."""
    repo, hook = fake_cuda
    (repo / "fake_launch.py").write_text(FAKE_LAUNCH)
    rule = repo / "workflow" / "rules" / "topology.smk"
    original = rule.read_text()
    rule.write_text(original.replace("python -m rl_engine launch", f"python {repo / 'fake_launch.py'}"))
    try:
        runs = scheduled(repo, hook, tmp_path)
        assert len(runs) == 4 and peak_gpus(runs) <= 4, runs
        # negative control: cores allow 8 ranks together
        unbounded = scheduled(repo, hook, tmp_path, "--resources", "gpus=16", peers=True)
        assert peak_gpus(unbounded) > 4, unbounded
    finally:
        rule.write_text(original)
        for fake in (repo / "results" / run_name_of(repo)).glob("tp*-cp*.*"):
            fake.unlink()


@pytest.fixture(scope="module")
def four_given(fake_cuda: tuple[Path, Path]) -> str:
    """A dry run on a machine with 2 GPUs given ``--resources gpus=4``: the claims of the jobs it plans,
    and the control of the parse-time refusal (the same campaign plans when 4 are provided). The
    machine's own count (FAKE_GPUS=4, no ``--resources``) plans the scheduled runs below."""
    repo, hook = fake_cuda
    return dry_run(repo, hook, 2, "--resources", "gpus=4")


def test_topology_jobs_claim_one_gpu_per_rank(four_given: str) -> None:
    assert topology_gpus(four_given) == {"tp1-cp1": 1, "tp2-cp1": 2, "tp2-cp2": 4, "tp4-cp1": 4}, four_given[-3000:]


def test_the_machine_provides_its_gpu_count_unless_given() -> None:
    class FakeWorkflow:
        def __init__(self, given: dict[str, int]) -> None:
            self.global_resources = dict(given)

        def register_resource(self, name: str, value: int) -> None:
            self.global_resources[name] = value

    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    wf = FakeWorkflow({})
    assert workflow.register_gpus(wf, "cuda") == count and wf.global_resources == {"gpus": count}
    wf = FakeWorkflow({"gpus": 8})
    assert workflow.register_gpus(wf, "cuda") is None and wf.global_resources == {"gpus": 8}
    wf = FakeWorkflow({})
    assert workflow.register_gpus(wf, "cpu") is None and wf.global_resources == {}
    assert [workflow.topology_gpus(d, 4, 2) for d in ("cuda", "cpu")] == [8, 0]
    config = {"device": "cuda", "topologies": ["1x1", "4x2"]}
    assert workflow.provide_gpus(FakeWorkflow({"gpus": 8}), config) == 8
    with pytest.raises(WorkflowConfigError, match=r"'topologies\[1\]' has value '4x2': needs 8 GPUs \(one per rank\) "
                                                  r"but 4 are provided \(--resources gpus"):
        workflow.provide_gpus(FakeWorkflow({"gpus": 4}), config)
    assert workflow.provide_gpus(FakeWorkflow({}), dict(config, device="cpu")) is None


def test_a_topology_with_more_ranks_than_gpus_is_refused_at_parse_time(fake_cuda: tuple[Path, Path], four_given: str) -> None:
    """Snakemake scales a claim above what is provided down and starts the job: 4 ranks on 2 GPUs."""
    repo, hook = fake_cuda
    done = subprocess.run(snakemake_cmd("-n"), cwd=repo, env=env_for(repo, {"FAKE_GPUS": "2"}, prepend=hook),
                          capture_output=True, text=True, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode != 0, text[-3000:]
    for index, topology in ((2, "2x2"), (3, "4x1")):
        assert (f"config key 'topologies[{index}]' has value '{topology}': needs 4 GPUs (one per rank) but 2 are "
                "provided (torch.cuda.device_count() on this machine)") in text, text[-3000:]
    assert "'1x1'" not in text and "'2x1'" not in text and "Building DAG of jobs" not in text
    assert 'File "' not in text
    assert "Building DAG of jobs" in four_given  # control: 4 GPUs provided, the same campaign plans (rc 0)


def test_cpu_topology_jobs_claim_no_gpu(fake_cuda: tuple[Path, Path]) -> None:
    repo, hook = fake_cuda
    text = dry_run(repo, hook, 4, "--config", "device=cpu")
    assert set(topology_gpus(text).values()) == {0}, text[-3000:]
