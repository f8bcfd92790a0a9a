"""The campaign on a real Slurm cluster: marker ``slurm``, ``pytest -m slurm``.

Needs the two-node cluster of ``.ci/slurm-cluster.sh start`` (``.ci/run`` starts it before the
tests and stops it after); every test here skips, saying so, when that cluster is not up.
The workflow runs in a temporary copy of the repository as the README says:
``snakemake --workflow-profile workflow/profiles/slurm --config ranks_per_node=2``, plus a
small config and a short first status check, through ``tests/_slurm_snakemake.py``, which keeps the
executor's status checks at most 3 s apart (the executor lengthens them by 10 s after each check
that saw no job end). With two ranks per node the 2x2 topology spans node1 and node2.

The campaign runs twice, in a thread of its own from the first test on (the module's other jobs
run on the cluster beside it), and every workflow test reads those two runs: first with a rank on
node2 of the 2x2 SIGKILLed mid-run (``RL_ENGINE_FAULT=kill:2x2:node2/0``), then the same command
without the fault.

1. a rank on node2 is killed mid-run: the job fails, no report is left, the other topology
   completes, and the next run redoes that topology alone;
2. the campaign then builds an archive that verifies (the ``verify_archive`` job); the 2x2
   report names node1 and node2, and each job asked Slurm for what its topology needs (the
   sbatch lines);
3. a bad ``ranks_per_node`` is refused while the workflow is parsed: no job reaches Slurm;
4. nothing is left behind: no job in the queue, no launch, torchrun or rank alive.

Beyond the workflow, ``launch`` is run in ``salloc`` allocations: its time limit and a SIGTERM
stop every node's tree (two runs at once, on distinct rendezvous ports, while the campaign runs),
and a node that dies mid-run fails the launch and leaves nothing.

Two copies of the suite may share the test cluster (CI on a loaded machine): each test looks only
at its own jobs (by the directory they were submitted from), ``salloc`` waits for free nodes, and
the test that kills node2's slurmd holds the cluster alone (:func:`cluster_use`, a ``flock``; the
campaign's thread holds it shared until its second run ends).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

from rl_engine import cli, jsonio
from rl_engine.proctree import descendants

from _case_argv import TINY
from _procs import environ, mentioning, parent
from _workflow_util import (
    CONFIG,
    SHORT_REGRESSION,
    SMALL_VOCAB,
    archive_of,
    copy_repo,
    env_for,
    jobs_run,
    run_name_of,
    write_config,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

NODES = ("node1", "node2")
CASE = {**SMALL_VOCAB, "topologies": ["1x1", "2x2"], "regression": SHORT_REGRESSION}


def run_of(repo: Path) -> Path:
    """The run directory the workflow names for the test config (its case, not ranks_per_node)."""
    return Path("results") / run_name_of(repo)
PROFILE = "workflow/profiles/slurm"
# a shorter first status check than the executor's 40 s (MinJobAge=900 of the test cluster
# keeps finished jobs visible to squeue far longer than 3x this)
FAST_POLL = ("--slurm-init-seconds-before-status-checks", "2")
RUN_LIMIT_S = 900.0  # a failure bound for slow machines, not a measured claim
STARTUP_LIMIT_S = 300.0  # likewise
REPO_ROOT = Path(__file__).resolve().parent.parent


def _cluster_problem() -> str | None:
    """Why the test cluster is not usable (None when node1 and node2 answer)."""
    if shutil.which("sinfo") is None:
        return "sinfo is not installed"
    try:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if done.returncode != 0:
        return f"sinfo failed: {done.stderr.strip()}"
    states = dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)
    # not idle* (not responding); a "-" suffix is a node the backfill scheduler planned for a pending job
    down = [n for n in NODES if not re.fullmatch(r"(idle|mix|alloc)-?", states.get(n, "missing"))]
    return f"nodes not up: {down} (sinfo: {states})" if down else None


CLUSTER_LOCK = Path(os.environ.get("RL_ENGINE_SLURM_STATE", "/var/tmp/rl-engine-slurm")) / "tests.lock"


@contextlib.contextmanager
def cluster_use(exclusive: bool = False) -> Iterator[None]:
    """Hold the test cluster: shared by the tests that only run jobs on it, exclusive for the one
    that kills a node's slurmd (a second copy of the suite on the same cluster would lose its
    steps on that node). ``flock`` on a file of the cluster's state directory; released on exit."""
    with open(CLUSTER_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="module")
def cluster() -> None:
    problem = _cluster_problem()
    if problem is not None:
        pytest.skip(f"no Slurm test cluster ({problem}); start one with `.ci/slurm-cluster.sh start` "
                    "(.ci/run does)")


@pytest.fixture
def shared_cluster(cluster: None) -> Iterator[None]:
    with cluster_use():
        yield


@pytest.fixture
def exclusive_cluster(cluster: None) -> Iterator[None]:
    with cluster_use(exclusive=True):
        yield


def slurm_snakemake(repo: Path, *args: str, ranks_per_node: str = "2", configfile: str = CONFIG,
                    extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(REPO_ROOT / "tests" / "_slurm_snakemake.py"), "--workflow-profile", PROFILE, "--configfile", configfile,
           *FAST_POLL, "--verbose", *args, "--config", f"ranks_per_node={ranks_per_node}"]
    return subprocess.run(cmd, cwd=repo, env=env_for(repo, extra_env), capture_output=True, text=True,
                          timeout=RUN_LIMIT_S)


def sbatch_lines(output: str) -> list[str]:
    """The executor's sbatch calls, without the --wrap'ed snakemake command."""
    return [line.split("sbatch call: ", 1)[1].split(" --wrap=", 1)[0]
            for line in output.splitlines() if "sbatch call: " in line]


def slurm_jobs(workdir: Path) -> list[str]:
    """The jobs slurmctld still knows (MinJobAge keeps finished ones) that were submitted from
    ``workdir`` or below it, one line each: another copy of the suite may share the test cluster,
    and its jobs are not this test's."""
    done = subprocess.run(["scontrol", "-o", "show", "job"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines()
            if line.startswith("JobId=") and _is_under(_field(line, "WorkDir"), workdir)]


def _field(line: str, name: str) -> str:
    """``name=value`` of one ``scontrol -o`` line (values hold no spaces in these tests' paths)."""
    found = re.search(rf"(?:^| ){name}=(\S*)", line)
    return found.group(1) if found else ""


def _is_under(path: str, root: Path) -> bool:
    return path != "" and (Path(path) == root or root in Path(path).parents)


def queued_jobs(*workdirs: Path) -> list[str]:
    """The queue's jobs (pending, running or completing) submitted from one of ``workdirs``."""
    done = subprocess.run(["squeue", "-h", "-o", "%i|%j|%T|%Z"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines()
            if any(_is_under(line.rsplit("|", 1)[-1], root) for root in workdirs)]


def _run_campaign(repo: Path) -> dict[str, Any]:
    """The campaign through the Slurm profile: a first run with a rank on node2 of the spanning 2x2
    SIGKILLed, what it left, then the rerun without the fault that completes the campaign."""
    run = repo / run_of(repo)
    with cluster_use():
        start = time.monotonic()
        failed = slurm_snakemake(repo, extra_env={"RL_ENGINE_FAULT": "kill:2x2:node2/0"})
        failed_text = failed.stdout + failed.stderr
        assert failed.returncode != 0, failed_text[-6000:]
        left = sorted(p.name for p in run.glob("tp2-cp2*"))
        failed_log = (run / "logs" / "tp2-cp2.log").read_text()
        single = (run / "tp1-cp1.json").stat().st_mtime_ns  # the other topology completed (keep-going)
        done = slurm_snakemake(repo)
        elapsed = time.monotonic() - start
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-8000:]
    return {"repo": repo, "run": run, "failed_text": failed_text, "failed_log": failed_log, "left": left,
            "single_mtime": single, "text": text, "elapsed": elapsed}


@pytest.fixture(scope="module")
def campaign_started(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Future[dict[str, Any]]]:
    """The campaign, started in a thread: the tests that need no campaign run on the cluster beside it.
    The module's teardown waits for it, so nothing of it outlives the module."""
    repo = copy_repo(tmp_path_factory.mktemp("slurm"))
    write_config(repo, CASE)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="slurm-campaign") as pool:
        yield pool.submit(_run_campaign, repo)


@pytest.fixture(scope="module")
def campaign(campaign_started: Future[dict[str, Any]]) -> dict[str, Any]:
    ran = campaign_started.result(timeout=3 * RUN_LIMIT_S)  # its assertion errors are raised here
    print(f"\nslurm campaign (faulted run, then the rerun): {ran['elapsed']:.1f} s")
    for line in sbatch_lines(ran["failed_text"]) + sbatch_lines(ran["text"]):
        print(line)
    return ran


def _salloc_launch(run: Path, plan: Path, timeout_s: int, fault: str) -> subprocess.Popen[str]:
    """``launch`` of the plan's 2x2 at two ranks per node inside a fresh two-node allocation."""
    env = env_for(REPO_ROOT, {"RL_ENGINE_FAULT": fault})
    return subprocess.Popen(
        ["salloc", "--nodes=2", "--ntasks=2", "--cpus-per-task=2", "--quiet",
         sys.executable, "-m", "rl_engine", "launch", "--plan", str(plan), "--tp", "2", "--cp", "2",
         "--timeout-s", str(timeout_s), "--ranks-per-node", "2", "--log", str(run / "launch.log")],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def test_time_limit_and_stop_signal_kill_every_nodes_tree(campaign_started: Future[dict[str, Any]],
                                                          shared_cluster: None, tmp_path: Path) -> None:
    """A rank on node2 hangs. One launch hits its time limit (124), another is sent SIGTERM while
    its ranks run on both nodes (143); the two run at once, on distinct rendezvous ports. Each
    stops its srun with SIGUSR1 (srun would SIGKILL the step on SIGTERM), each node's launch
    kills its own torchrun and ranks, and nothing of either run survives. The campaign's thread runs its
    jobs on the same nodes meanwhile (it starts first: the module's first test)."""
    runs = {name: tmp_path / name for name in ("limit", "sigterm")}
    plans = {}
    for name, run in runs.items():
        run.mkdir()
        plans[name] = run / "plan.json"
        assert cli.main(["plan", *TINY, "--topologies", "1x1,2x2", "--output", str(plans[name])]) == 0
    procs = {"limit": _salloc_launch(runs["limit"], plans["limit"], 40, "hang:2x2:node2/0"),
             "sigterm": _salloc_launch(runs["sigterm"], plans["sigterm"], 600, "hang:2x2:node2/0")}
    deadline = time.monotonic() + STARTUP_LIMIT_S
    ranks: dict[int, str] = {}
    while time.monotonic() < deadline:  # both nodes' ranks of the second run are up
        ranks = mentioning(f"-m rl_engine.campaign.run {plans['sigterm']}")
        runners = [c for c in ranks.values() if "torch.distributed.run" not in c]  # the ranks, not their torchruns
        if len(runners) == 4:
            break
        assert procs["sigterm"].poll() is None, procs["sigterm"].communicate()[0]
        time.sleep(0.5)
    else:
        pytest.fail(f"the 2x2 ranks did not start: {ranks}")
    outer = {pid: c for pid, c in mentioning(str(plans["sigterm"])).items()
             if " launch " in c and "--rdzv-endpoint" not in c and "salloc" not in c}
    assert len(outer) == 1, outer
    os.kill(next(iter(outer)), signal.SIGTERM)
    codes = {name: proc.wait(timeout=STARTUP_LIMIT_S) for name, proc in procs.items()}
    logs = {name: (run / "launch.log").read_text() for name, run in runs.items()}
    assert codes == {"limit": 124, "sigterm": 128 + signal.SIGTERM}, (codes, logs)
    endpoints = {re.search(r"c10d rendezvous at (\S+);", text).group(1) for text in logs.values()}
    assert len(endpoints) == 2, endpoints
    for name, text in logs.items():
        for node in NODES:
            assert re.search(rf"error: topology 2x2, node {node} \(node rank [01] of 2\): received SIGUSR1; "
                             "its torchrun and ranks were killed", text), (name, node, text[-3000:])
        assert not list(runs[name].glob("tp2-cp2*")), name  # no partial report
        assert mentioning(str(runs[name])) == {}, name


def test_bad_ranks_per_node_is_refused_before_any_job_reaches_slurm(cluster: None, tmp_path: Path) -> None:
    repo = copy_repo(tmp_path)
    write_config(repo, {**CASE, "topologies": ["1x1", "2x1", "4x2"]})
    for value, message in (("3", "config key 'ranks_per_node' has value 3 (given with --config ranks_per_node=...; the config file "
                            "has ranks_per_node: 8): topology '4x2' (topologies[2])"),
                           ("0", "config key 'ranks_per_node' has value 0")):
        done = slurm_snakemake(repo, ranks_per_node=value)
        text = done.stdout + done.stderr
        assert done.returncode != 0, text[-4000:]
        assert "WorkflowConfigError" in text and message in text, text[-4000:]
        assert "sbatch call" not in text and "Building DAG of jobs" not in text, text[-4000:]
    assert slurm_jobs(repo) == []
    assert list((repo / "results").iterdir()) == []
    assert not (repo / ".snakemake" / "slurm_logs").exists()


def test_a_rank_killed_on_node2_fails_the_job_and_the_rerun_redoes_that_topology_alone(
        campaign: dict[str, Any]) -> None:
    failed_text, log = campaign["failed_text"], campaign["failed_log"]
    assert jobs_run(failed_text).get("topology") == 2, jobs_run(failed_text)
    assert campaign["left"] == []  # no report and no partial tensor of the killed topology
    assert "srun: error: node2: task 1: Exited with exit code 2" in log, log[-4000:]
    assert "error: topology 2x2, node node2 (node rank 1 of 2): torchrun exited with" in log, log[-4000:]
    assert "SIGKILL" in log and "no valid report was written; outputs removed" in log, log[-4000:]
    counts = jobs_run(campaign["text"])  # the rerun: that topology alone, then what follows it
    assert counts.get("topology") == 1 and "environment" not in counts and "regression" not in counts, counts
    assert (campaign["run"] / "tp1-cp1.json").stat().st_mtime_ns == campaign["single_mtime"]
    assert jsonio.load(campaign["run"] / "tp2-cp2.json")["topology"]["nnodes"] == 2


def test_campaign_through_the_slurm_profile_spans_both_nodes_and_verifies(campaign: dict[str, Any]) -> None:
    repo, run, text = campaign["repo"], campaign["run"], campaign["text"]
    counts = jobs_run(text)
    # the archive was built and the verify_archive job verified it (the run exited 0)
    assert counts.get("archive") == 1 and counts.get("verify_archive") == 1, counts
    assert archive_of(repo).name == f"{run.name}.tar.gz"
    assert jsonio.load(repo / "results" / f"{run.name}.verify.json")["passed"] is True
    report = jsonio.load(run / "tp2-cp2.json")
    ranks = report["topology"]["ranks"]
    print("tp2-cp2 ranks:", [(r["rank"], r["node"]) for r in ranks])
    assert report["topology"]["nnodes"] == 2
    assert sorted(r["node"] for r in ranks) == ["node1", "node1", "node2", "node2"]
    single = jsonio.load(run / "tp1-cp1.json")
    assert single["topology"]["nnodes"] == 1 and single["topology"]["ranks"][0]["node"] in NODES
    # the spanning topology's bytes equal the single-node one's
    assert report["bitwise_fingerprints"] == single["bitwise_fingerprints"]
    summary = (run / "SUMMARY.md").read_text()
    assert re.search(r"^\| 2 \| 2 \| 4 \| 2: node1, node2 \|", summary, re.M), summary
    log = (run / "logs" / "tp2-cp2.log").read_text()
    assert "4 ranks on 2 nodes (node1,node2) x 2, c10d rendezvous at 127.0.0.1:" in log, log[-3000:]


def test_each_job_asked_slurm_for_what_its_topology_needs(campaign: dict[str, Any]) -> None:
    lines = sbatch_lines(campaign["failed_text"])  # the first run submitted every job
    spanning = [line for line in lines if "rule_topology_wildcards_2_2" in line]
    single = [line for line in lines if "rule_topology_wildcards_1_1" in line]
    assert len(spanning) == 1 and len(single) == 1, lines
    for part in ("--nodes=2", "--ntasks=2", "--cpus-per-task=2", "-t 15", "--mem 5000"):
        assert part in spanning[0], (part, spanning[0])
    for part in ("--nodes=1", "--ntasks=1", "--cpus-per-task=1"):
        assert part in single[0], (part, single[0])
    local = {"case", "plan", "validation", "crosscheck", "summary", "archive", "verify_archive"}
    every = lines + sbatch_lines(campaign["text"])
    assert not [line for line in every if any(f"rule_{rule} " in line or f"rule_{rule}'" in line for rule in local)]
    assert any("rule_environment" in line for line in lines) and any("rule_regression" in line for line in lines)


def test_a_dead_node_fails_the_launch_and_leaves_nothing(exclusive_cluster: None, tmp_path: Path) -> None:
    """node2 dies mid-run: its slurmd, its job step daemon and every process of the step are
    SIGKILLed at once, and Slurm is told it is DOWN (as a site's health check would, instead of
    waiting out SlurmdTimeout). The launch fails (2) with no report and nothing alive; node2 is then
    brought back (``.ci/slurm-cluster.sh start`` restarts its slurmd). It holds the cluster alone
    (:func:`cluster_use`): another copy of the suite's jobs on node2 would die with it."""
    plan = tmp_path / "plan.json"
    assert cli.main(["plan", *TINY, "--topologies", "1x1,2x2", "--output", str(plan)]) == 0
    proc = _salloc_launch(tmp_path, plan, 600, "hang:2x2:node2/0")
    try:
        deadline = time.monotonic() + STARTUP_LIMIT_S
        parts: dict[int, str] = {}
        while time.monotonic() < deadline:
            runners = [c for c in mentioning(f"-m rl_engine.campaign.run {plan}").values()
                       if "torch.distributed.run" not in c]  # the ranks, not their torchruns
            parts = {pid: c for pid, c in mentioning(str(plan)).items() if "--rdzv-endpoint" in c
                     and " launch " in c and not c.startswith("srun")}  # each node's launch
            if len(runners) == 4 and len(parts) == 2:
                break
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.5)
        else:
            pytest.fail(f"the 2x2 ranks did not start: {parts}")
        node2 = [pid for pid in parts if environ(pid).get("SLURMD_NODENAME") == "node2"]
        assert len(node2) == 1, parts
        stepd = parent(node2[0])
        slurmd = [pid for pid, c in mentioning("slurmd -N node2").items() if "slurmd" in c[:7]]
        assert len(slurmd) == 1, slurmd
        for pid in [*slurmd, stepd, *(child for child, _ in descendants(stepd))]:
            os.kill(pid, signal.SIGKILL)
        # slurmctld would find node2 silent after SlurmdTimeout (30 s) and mark it DOWN; a site's
        # health check marks it at once, as here (the node's processes are already dead)
        down = subprocess.run(["scontrol", "update", "NodeName=node2", "State=DOWN",
                               "Reason=rl-engine test: node2 killed"], capture_output=True, text=True, timeout=30)
        assert down.returncode == 0, down.stderr
        out, _ = proc.communicate(timeout=STARTUP_LIMIT_S)
        log = (tmp_path / "launch.log").read_text() + out  # launch's own messages go to stderr
        assert proc.returncode == 2, (proc.returncode, log[-3000:])
        assert "Node failure on node2" in log and "no valid report was written; outputs removed" in log, log[-3000:]
        # the surviving node's launch ended: its ranks failed first, or Slurm told it to stop
        assert re.search(r"node node1 \(node rank 0 of 2\): (torchrun exited with|received SIGTERM; its torchrun "
                         r"and ranks were killed)", log), log[-3000:]
        assert not list(tmp_path.glob("tp2-cp2*"))
        assert mentioning(str(tmp_path)) == {}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # the DOWN set above stays until it is lifted (slurmctld's own would end when slurmd registers)
        subprocess.run(["scontrol", "update", "NodeName=node2", "State=RESUME"], capture_output=True, timeout=30)
        restarted = subprocess.run([str(REPO_ROOT / ".ci" / "slurm-cluster.sh"), "start"], capture_output=True,
                                   text=True, timeout=120)
        assert restarted.returncode == 0, restarted.stderr
    assert _cluster_problem() is None


def test_nothing_is_left_behind(campaign: dict[str, Any]) -> None:
    """Runs last: the queue is empty and no launch, torchrun, rank or job step of the runs is alive."""
    # this copy's jobs: the campaign's (submitted from its repository) and the salloc launches
    # (from the checkout); a second copy of the suite on the same test cluster has its own
    repo = campaign["repo"]
    assert queued_jobs(repo, REPO_ROOT) == []
    assert mentioning(str(repo)) == {}
    # a multi-node launch's rendezvous id, in a process Slurm started for one of this copy's
    # jobs (the suite's other worker may run multi-node launches of its own, outside Slurm)
    ours = {_field(line, "JobId") for line in slurm_jobs(repo) + slurm_jobs(REPO_ROOT)}
    assert ours, "no job of the campaign is known to slurmctld (MinJobAge keeps them 900 s)"
    assert [pid for pid in mentioning("--rdzv-id=rl-engine-") if environ(pid).get("SLURM_JOB_ID") in ours] == []
