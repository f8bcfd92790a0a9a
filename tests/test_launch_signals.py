"""``python -m rl_engine launch`` cleans up when it is told to stop (SIGTERM, SIGHUP, SIGINT).

Snakemake cancelling a job, a CI time limit or a closed terminal signals ``launch``; torchrun
runs in its own session and its ranks in sessions of their own, so nothing reaches them
unless ``launch`` passes the stop on. Each case here starts a real ``launch`` of a real small
plan whose rank 1 hangs once the mesh is up, waits until torchrun and both ranks exist,
signals ``launch`` and checks: exit status ``128 + signal``, none of those processes (nor
anything else naming the report) left alive, no report or raw tensor on disk, and a message
in the log. The three signals run at the same time (one wall-clock wait for all).
Without the handlers, ``launch`` dies of the signal and torchrun and its ranks keep running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rl_engine import cli, jsonio, proctree
from rl_engine.proctree import alive, descendants, stop_tree

from _case_argv import TINY
from _procs import mentioning

REPO = Path(__file__).resolve().parent.parent
SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
STARTUP_LIMIT_S = 240.0  # a failure bound for slow machines, not a measured claim
EXIT_LIMIT_S = 120.0


def _plan(run: Path) -> Path:
    plan = run / "plan.json"
    assert cli.main(["plan", *TINY, "--tp", "1", "--cp", "2", "--output", str(plan)]) == 0
    return plan


def _runner_of(run: Path) -> str:
    """What torchrun's and every rank's command line holds: the runner module and the plan."""
    return f"-m rl_engine.campaign.run {run / 'plan.json'}"


def _start(run: Path, plan: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "RL_ENGINE_FAULT": "hang:1x2:1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "rl_engine", "launch", "--plan", str(plan), "--tp", "1", "--cp", "2",
         "--timeout-s", "600", "--log", str(run / "launch.log")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )


def test_signalled_launch_kills_torchrun_and_its_ranks_and_leaves_no_outputs(tmp_path: Path) -> None:
    runs = {sig: tmp_path / sig.name for sig in SIGNALS}
    procs: dict[signal.Signals, subprocess.Popen[bytes]] = {}
    watched: dict[signal.Signals, list[int]] = {}
    try:
        for sig, run in runs.items():
            run.mkdir()
            procs[sig] = _start(run, _plan(run))
        deadline = time.monotonic() + STARTUP_LIMIT_S
        for sig, run in runs.items():
            runner = _runner_of(run)
            # torchrun and its two ranks all carry the runner and the plan in their command lines
            while len(mentioning(runner)) < 3:
                assert procs[sig].poll() is None, procs[sig].communicate()[0].decode()
                assert time.monotonic() < deadline, f"{sig.name}: torchrun and 2 ranks never appeared"
                time.sleep(0.2)
            watched[sig] = sorted(set(mentioning(runner)) | {pid for pid, _ in descendants(procs[sig].pid)})
            assert len(watched[sig]) >= 3, watched[sig]
        for sig, proc in procs.items():
            proc.send_signal(sig)
        for sig, proc in procs.items():
            out = proc.communicate(timeout=EXIT_LIMIT_S)[0].decode()
            run = runs[sig]
            assert proc.returncode == 128 + sig, (sig.name, proc.returncode, out)
            assert [pid for pid in watched[sig] if alive(pid)] == [], sig.name
            assert mentioning(_runner_of(run)) == {}, sig.name
            assert sorted(p.name for p in run.iterdir()) == ["launch.log", "plan.json"], sig.name
            assert f"received {sig.name}" in out and "outputs removed" in out, out
        # negative control on the same evidence: the plan still names the output that is now absent
        for run in runs.values():
            assert jsonio.load(run / "plan.json")["topologies"][0]["output"] == "tp1-cp2.json"
    finally:
        for sig, proc in procs.items():  # never leave a hung rank behind, whatever failed above
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            for pid in mentioning(_runner_of(runs[sig])):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_descendants_and_alive_see_a_real_tree(tmp_path: Path) -> None:
    """The /proc helpers find a grandchild, by pid and start time, and see it die (negative control)."""
    proc = subprocess.Popen([sys.executable, "-c",
                             "import subprocess, sys, time; "
                             "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
                             "print(c.pid, flush=True); time.sleep(600)"],
                            stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        tree = descendants(proc.pid)
        assert grandchild in {pid for pid, _ in tree}
        assert proc.pid not in {pid for pid, _ in tree}
        assert alive(grandchild) and alive(proc.pid)
        assert descendants(grandchild) == set()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while alive(grandchild):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not alive(proc.pid)


# A torchrun stand-in that ignores SIGTERM and starts a "rank" in a session of its own that
# ignores SIGTERM too: only a SIGKILL aimed at the rank itself (not at the launcher's group)
# stops it.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
rank = subprocess.Popen([sys.executable, '-c',
    'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(600)'],
    start_new_session=True, stdout=subprocess.PIPE)
rank.stdout.readline()
print(rank.pid, flush=True)
time.sleep(600)
"""


def test_stop_tree_kills_a_rank_in_its_own_session_that_ignores_sigterm() -> None:
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    rank = int(proc.stdout.readline())
    try:
        assert os.getsid(rank) == rank != os.getsid(proc.pid)  # outside the launcher's session and group
        stop_tree(proc, grace_s=0.5)
        assert proc.returncode == -signal.SIGKILL  # SIGTERM was ignored: the grace ran out
        assert not alive(rank)
    finally:
        if alive(rank):
            os.kill(rank, signal.SIGKILL)


def test_a_signal_before_the_runner_starts_is_not_lost() -> None:
    """Recorded while disarmed, raised by arm(); handlers restored afterwards."""
    before = signal.getsignal(signal.SIGHUP)
    with proctree.StopSignals() as stops:
        os.kill(os.getpid(), signal.SIGHUP)  # delivered to this (main) thread: recorded only
        assert stops.received == [signal.SIGHUP]
        try:
            stops.arm()
        except proctree.Stopped as stop:
            assert stop.signum == signal.SIGHUP
        else:
            raise AssertionError("arm() must raise for a signal received before it")
        os.kill(os.getpid(), signal.SIGTERM)  # disarmed again by the raise: recorded, not raised
        assert stops.received == [signal.SIGHUP, signal.SIGTERM]
    assert signal.getsignal(signal.SIGHUP) is before


def test_supervise_reports_exit_time_limit_and_signal_and_stops_the_tree_only_then() -> None:
    """proctree.supervise, the one wait of launch (single and multi node) and the regression."""
    stopped: list[str] = []

    def child(code: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)

    with proctree.StopSignals() as stops:
        proc = child("raise SystemExit(3)")
        assert proctree.supervise(proc, 30, stops, lambda: stopped.append("exit")) == proctree.Outcome(code=3)
        assert stopped == []  # negative control: a child that ends by itself is not stopped
        proc = child("import time; time.sleep(60)")
        assert proctree.supervise(proc, 0.2, stops, lambda: (stopped.append("limit"), proc.kill())).timed_out
        proc = child("import os, signal, time; os.kill(os.getppid(), signal.SIGTERM); time.sleep(60)")
        ended = proctree.supervise(proc, 30, stops, lambda: (stopped.append("signal"), proc.kill()))
        assert ended == proctree.Outcome(signum=signal.SIGTERM)
    assert stopped == ["limit", "signal"]
