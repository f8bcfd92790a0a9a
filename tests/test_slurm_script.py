"""``.ci/slurm-cluster.sh stop`` leaves the machine as it found it: no slurm.conf of its own.

A config naming a controller that no longer runs makes every Slurm client wait for it
(``scontrol show config``: 9 s), and Snakemake's Slurm executor plugin runs that command when it
is imported, at every ``snakemake`` start whatever the executor: a machine that once ran the test
cluster would pay it on every workflow run. These cases run ``stop`` on files in a temporary
folder (the script's ``RL_ENGINE_SLURM_*`` overrides): no pidfile there, so nothing is signalled.

Also here: the script's ``pid_of`` takes a killed daemon that PID 1 has not reaped yet (a zombie) for
dead, so ``start`` restarts it (tests/test_slurm.py's dead-node test kills node2's slurmd, then
starts it again at once); and ``tests/_slurm_snakemake.py``, which the Slurm tests run Snakemake
through, keeps the executor's status checks at most ``CAP_S`` apart, and refuses an executor whose
check it cannot wrap.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "slurm-cluster.sh"
# the script's last check: a job step daemon of a cluster a concurrent test uses is a leak to it
STEPS_LEFT = "job step daemons still running"


def stop(tmp_path: Path, conf: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RL_ENGINE_SLURM_STATE": str(tmp_path / "state"), "RL_ENGINE_SLURM_CONF": str(conf),
           "RL_ENGINE_MUNGE_PID": str(tmp_path / "munged.pid")}
    done = subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 or STEPS_LEFT in done.stderr, done.stderr
    return done


@pytest.fixture
def written_conf(tmp_path: Path) -> Path:
    """A config as ``start`` writes it: its first line is the script's marker."""
    source = SCRIPT.read_text(encoding="utf-8")
    marker = source.split('CONF_MARKER="', 1)[1].split('"', 1)[0]
    conf = tmp_path / "etc" / "slurm.conf"
    conf.parent.mkdir()
    conf.write_text(f"{marker}: two slurmd (node1, node2) on this one host.\nClusterName=rlengine\n")
    return conf


def test_stop_removes_the_config_the_script_wrote(tmp_path: Path, written_conf: Path) -> None:
    stop(tmp_path, written_conf)
    assert not written_conf.exists()


def test_stop_keeps_a_config_it_did_not_write(tmp_path: Path, written_conf: Path) -> None:
    site = "ClusterName=site\nSlurmctldHost=head\n"  # the machine's own cluster
    written_conf.write_text(site)
    stop(tmp_path, written_conf)
    assert written_conf.read_text() == site


def pid_of(pidfile: Path) -> str:
    """The script's own ``pid_of`` (its function's text, run by bash) on ``pidfile``."""
    source = SCRIPT.read_text(encoding="utf-8")
    function = source[source.index("pid_of() {"):]
    function = function[:function.index("\n}\n") + 3]
    done = subprocess.run(["bash", "-c", f'{function}\npid_of "$1"', "pid_of", str(pidfile)], capture_output=True,
                          text=True, timeout=60, check=True)
    return done.stdout.strip()


def test_pid_of_takes_a_zombie_for_dead_and_a_live_process_for_live(tmp_path: Path) -> None:
    pidfile = tmp_path / "daemon.pid"
    dead = subprocess.Popen(["true"])  # not waited for: a zombie until this test reaps it
    live = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{dead.pid}/stat").read_text().split(") ", 1)[1][0] != "Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        pidfile.write_text(f"{dead.pid}\n")
        assert pid_of(pidfile) == ""
        pidfile.write_text(f"{live.pid}\n")
        assert pid_of(pidfile) == str(live.pid)  # control
    finally:
        live.kill()
        for proc in (dead, live):
            proc.wait()


@pytest.fixture
def wrapper(monkeypatch: pytest.MonkeyPatch) -> Any:
    """tests/_slurm_snakemake.py, with the executor class it patches restored after the test."""
    slurm = pytest.importorskip("snakemake_executor_plugin_slurm")
    monkeypatch.setattr(slurm.Executor, "check_active_jobs", slurm.Executor.check_active_jobs)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    import _slurm_snakemake

    return SimpleNamespace(module=_slurm_snakemake, executor=slurm.Executor)


def test_the_wrapper_caps_the_executors_next_status_check_and_passes_its_jobs_through(
        wrapper: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    async def check_active_jobs(self, active_jobs):  # the executor's contract: yields the jobs still running
        self.next_seconds_between_status_checks = self.interval_after
        for job in active_jobs:
            yield job

    monkeypatch.setattr(wrapper.executor, "check_active_jobs", check_active_jobs)
    wrapper.module._cap_status_checks()
    wrapped = wrapper.executor.check_active_jobs
    assert wrapped is not check_active_jobs and inspect.isasyncgenfunction(wrapped)

    async def run(executor: Any) -> list[str]:
        return [job async for job in wrapped(executor, ["a", "b"])]

    cap = wrapper.module.CAP_S
    for after, expected in ((42, cap), (cap + 0.5, cap), (cap, cap), (1, 1)):  # never longer, never shorter
        executor = SimpleNamespace(interval_after=after, next_seconds_between_status_checks=None)
        assert asyncio.run(run(executor)) == ["a", "b"]
        assert executor.next_seconds_between_status_checks == expected, (after, executor)


@pytest.mark.parametrize("shape", ["function", "missing attribute"])
def test_the_wrapper_refuses_an_executor_it_cannot_wrap(wrapper: Any, monkeypatch: pytest.MonkeyPatch,
                                                         shape: str) -> None:
    if shape == "function":
        def check_active_jobs(self, active_jobs):
            return list(active_jobs)
    else:
        async def check_active_jobs(self, active_jobs):  # never sets the interval the wrapper caps
            for job in active_jobs:
                yield job
    monkeypatch.setattr(wrapper.executor, "check_active_jobs", check_active_jobs)
    with pytest.raises(SystemExit) as refused:
        wrapper.module._cap_status_checks()
    assert "tests/_slurm_snakemake.py" in str(refused.value) and "update the wrapper" in str(refused.value)
    assert wrapper.executor.check_active_jobs is check_active_jobs  # left as it was
