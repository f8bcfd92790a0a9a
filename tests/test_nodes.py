"""Topologies across nodes without a cluster: layout, rule resources, the executor's sbatch line,
the per-node argv, node names, node-targeted faults, and what launch refuses outside Slurm.

The real cluster runs are in tests/test_slurm.py (marker ``slurm``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from rl_engine import cli, jsonio
from rl_engine.campaign import faults, nodes
from rl_engine.campaign.nodes import NodeLayout, NodeLayoutError
from rl_engine.campaign.plan import runner_args
from rl_engine.evidence import summary
from rl_engine.workflow import (
    RUNTIME_MARGIN_MIN,
    WorkflowConfigError,
    check_config,
    topology_resource_functions,
    topology_resources,
)

from _case_argv import TINY
from _workflow_util import REPO, SMALL_VOCAB


def config(**overrides: Any) -> dict[str, Any]:
    base = yaml.safe_load((REPO / "config.yaml").read_text())
    base.update(SMALL_VOCAB, topologies=["1x1", "2x2"])
    base.update(overrides)
    return base


# ----------------------------------------------------------------------------- layout
@pytest.mark.parametrize(("ranks", "per_node", "nodes_", "on_node"), [
    (1, 8, 1, 1), (8, 8, 1, 8), (4, 2, 2, 2), (32, 8, 4, 8), (12, 8, 2, 6), (4, 3, 2, 2), (6, 1, 6, 1),
])
def test_a_topology_takes_ceil_ranks_over_ranks_per_node_nodes(ranks: int, per_node: int, nodes_: int,
                                                                on_node: int) -> None:
    layout = NodeLayout(ranks, per_node)
    assert (layout.nodes, layout.ranks_on_node) == (nodes_, on_node)
    assert layout.nodes * layout.ranks_on_node == ranks


def test_uneven_split_is_refused_naming_the_values_and_the_fix() -> None:
    with pytest.raises(NodeLayoutError) as err:
        NodeLayout(8, 3)
    text = str(err.value)
    assert "8 ranks at ranks_per_node=3 take ceil(8/3)=3 nodes" in text
    assert "one of [1, 2, 4, 5, 6, 7, 8]" in text
    for bad in (0, -1, True, 65):
        with pytest.raises(NodeLayoutError, match="ranks_per_node"):
            NodeLayout(4, bad)  # type: ignore[arg-type]


def test_fitting_values_fit_every_topology() -> None:
    assert nodes.fitting_ranks_per_node([1, 4, 8]) == [1, 2, 4, 5, 6, 7, 8]
    assert nodes.fitting_ranks_per_node([6]) == [1, 2, 3, 4, 5, 6]  # 4 and 5: two nodes of 3
    assert nodes.fitting_ranks_per_node([5]) == [1, 5]
    for value in nodes.fitting_ranks_per_node([2, 6, 8]):
        for ranks in (2, 6, 8):
            NodeLayout(ranks, value)


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(("value", "parts"), [
    (0, ("config key 'ranks_per_node' has value 0", "less than the minimum of 1")),
    (65, ("config key 'ranks_per_node' has value 65", "greater than the maximum of 64")),
    ("2", ("config key 'ranks_per_node' has value '2'", "is not of type 'integer'")),
    (3, ("config key 'ranks_per_node' has value 3: topology '4x2' (topologies[2])",
         "take ceil(8/3)=3 nodes", "values that fit every listed topology: [1, 2, 4, 5, 6, 7, 8]")),
])
def test_check_config_refuses_a_bad_ranks_per_node(value: Any, parts: tuple[str, ...]) -> None:
    with pytest.raises(WorkflowConfigError) as err:
        check_config(config(ranks_per_node=value, topologies=["1x1", "2x2", "4x2"]))
    for part in parts:
        assert part in str(err.value), (part, str(err.value))


def test_ranks_per_node_is_required() -> None:
    cfg = config()
    del cfg["ranks_per_node"]
    with pytest.raises(WorkflowConfigError, match="'ranks_per_node' is a required property"):
        check_config(cfg)


def test_topology_resources_follow_ranks_per_node() -> None:
    cfg = check_config(config(ranks_per_node=2, topology_timeout_s=600, threads_per_rank=1))
    one = topology_resources(cfg, 1, 1)
    assert one == {"nodes": 1, "tasks": 1, "cpus_per_task": 1, "mem_mb": 3000, "runtime": 10 + RUNTIME_MARGIN_MIN,
                   "mpi": None, "gres": None, "tasks_per_gpu": None}
    two = topology_resources(cfg, 2, 2)
    assert (two["nodes"], two["tasks"], two["cpus_per_task"], two["mpi"]) == (2, 2, 2, "srun")
    cfg = check_config(config(ranks_per_node=8, topology_timeout_s=61, threads_per_rank=2, device="cuda"))
    gpu = topology_resources(cfg, 2, 2)
    assert (gpu["nodes"], gpu["cpus_per_task"], gpu["gres"], gpu["tasks_per_gpu"], gpu["runtime"]) == \
        (1, 8, "gpu:4", 0, 2 + RUNTIME_MARGIN_MIN)


def test_the_rules_resource_functions_give_the_same_values() -> None:
    cfg = check_config(config(ranks_per_node=2))
    functions = topology_resource_functions(cfg)
    wildcards = SimpleNamespace(tp="2", cp="2")
    assert {key: fn(wildcards) for key, fn in functions.items()} == topology_resources(cfg, 2, 2)


class _Resources(dict):
    def __getattr__(self, name: str) -> Any:
        return self[name]


def _sbatch(resources: dict[str, Any], threads: int) -> str:
    """The installed Slurm executor's sbatch line for a job with these resources (no submission)."""
    submit = pytest.importorskip("snakemake_executor_plugin_slurm.submit_string")
    utils = pytest.importorskip("snakemake_executor_plugin_slurm.utils")
    job = SimpleNamespace(resources=_Resources({k: v for k, v in resources.items() if v is not None}),
                          threads=threads, name="topology")
    params = {"run_uuid": "u", "slurm_logfile": "l.log", "comment_str": "c", "account": "", "partition": "",
              "workdir": "/w"}
    return submit.get_submit_command(job, params) + utils.set_gres_string(job)


def test_the_executor_turns_the_resources_into_the_intended_sbatch_line() -> None:
    """Pins the plugin's translation: a wrong one would ask a cluster for the wrong nodes or GPUs."""
    cfg = check_config(config(ranks_per_node=2))
    line = _sbatch(topology_resources(cfg, 2, 2), threads=4)
    for part in ("--nodes=2", "--ntasks=2", "--cpus-per-task=2", "-t 15", "--mem 5000"):
        assert part in line.split(" ") or part in line, (part, line)
    assert "--ntasks-per-node" not in line and "--gpus" not in line
    single = _sbatch(topology_resources(cfg, 1, 1), threads=1)
    assert "--nodes=1" in single and "--ntasks=1" in single
    cuda = check_config(config(ranks_per_node=2, device="cuda"))
    gpu_line = _sbatch(topology_resources(cuda, 2, 2), threads=4)
    assert "--gres=gpu:2" in gpu_line and "--nodes=2" in gpu_line and "--ntasks=2" in gpu_line
    assert "--ntasks-per-gpu" not in gpu_line, gpu_line  # tasks_per_gpu=0 keeps `tasks` out of it
    # negative control: without tasks_per_gpu=0 the plugin would add --ntasks-per-gpu=<tasks>
    unguarded = {**topology_resources(cuda, 2, 2), "tasks_per_gpu": None}
    assert "--ntasks-per-gpu=2" in _sbatch(unguarded, threads=4)


# ----------------------------------------------------------------------------- node side
def test_node_name_prefers_slurms_name() -> None:
    assert nodes.node_name({"SLURMD_NODENAME": "node2"}) == "node2"
    import socket
    assert nodes.node_name({}) == socket.gethostname()
    assert nodes.node_name({"SLURMD_NODENAME": " "}) == socket.gethostname()


def test_node_torchrun_argv_joins_a_c10d_rendezvous_and_only_the_first_node_hosts_it(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    assert cli.main(["plan", *TINY, "--tp", "2", "--cp", "2", "--output", str(plan)]) == 0
    layout = NodeLayout(4, 2)
    runner = runner_args(plan, 2, 2)
    first = nodes.node_torchrun_argv(runner, layout, "10.0.0.1:29411", "rl-engine-7-tp2-cp2", 0)
    second = nodes.node_torchrun_argv(runner, layout, "10.0.0.1:29411", "rl-engine-7-tp2-cp2", 1)
    for argv in (first, second):
        assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
        assert {"--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29411",
                "--rdzv-id=rl-engine-7-tp2-cp2", "--max-restarts=0"} <= set(argv)
        assert "--standalone" not in argv
        assert argv[-len(runner):] == runner  # the runner, the plan and its topology, unchanged
    # what the plan's single-node command runs after torchrun's own flags
    command = jsonio.load(plan)["topologies"][0]["command"].split()
    assert command[3:] == runner
    assert "--rdzv-conf=is_host=1" in first and "--rdzv-conf=is_host=0" in second
    with pytest.raises(nodes.SlurmError, match="node rank 2"):
        nodes.node_torchrun_argv(runner, layout, "h:1", "id", 2)


def test_srun_argv_asks_for_one_task_per_node_with_its_cpus_and_gpus() -> None:
    job = nodes.SlurmJob("42", ("node1", "node2"))
    argv = nodes.srun_argv(NodeLayout(4, 2), job, 2, 0, ["cmd"])
    assert argv == ["srun", "--jobid=42", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=2",
                    "--kill-on-bad-exit=1", "cmd"]
    assert "--gres=gpu:2" in nodes.srun_argv(NodeLayout(4, 2), job, 2, 2, ["cmd"])
    with pytest.raises(nodes.SlurmError, match="holds 2 node"):
        job.check_nodes(4)


def test_slurm_job_needs_slurm_job_id() -> None:
    with pytest.raises(nodes.SlurmError, match="SLURM_JOB_ID is not set.*workflow/profiles/slurm"):
        nodes.SlurmJob.current({})


# ----------------------------------------------------------------------------- faults
def test_node_targeted_fault_parses_and_hits_only_that_node_and_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    fault = faults.parse_fault("kill:2x2:node2/0")
    assert (fault.kind, fault.node, fault.rank, fault.text) == ("kill", "node2", 0, "kill:2x2:node2/0")
    kills: list[tuple[int, int]] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    fault.trigger_after_mesh(2, 2, rank=0, node="node1", local_rank=0)
    fault.trigger_after_mesh(2, 2, rank=3, node="node2", local_rank=1)
    fault.trigger_after_mesh(2, 1, rank=0, node="node2", local_rank=0)
    assert kills == []
    fault.trigger_after_mesh(2, 2, rank=1, node="node2", local_rank=0)
    assert kills == [(os.getpid(), signal.SIGKILL)]
    with pytest.raises(faults.FaultError, match="does not parse"):
        faults.parse_fault("kill:2x2:node2/")
    with pytest.raises(faults.FaultError, match="does not parse"):
        faults.parse_fault("perturb:2x2:node2/0")


# ----------------------------------------------------------------------------- launch refusals
def _launch(plan: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    return subprocess.run(
        [sys.executable, "-m", "rl_engine", "launch", "--plan", str(plan), "--tp", "2", "--cp", "1",
         "--timeout-s", "60", *extra],
        cwd=REPO, env={**base, "PYTHONPATH": str(REPO), **(env or {})}, capture_output=True, text=True, timeout=120,
    )


def test_launch_refuses_a_multi_node_topology_outside_slurm_and_leaves_nothing(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    assert cli.main(["plan", *TINY, "--tp", "2", "--cp", "1", "--output", str(plan)]) == 0
    stale = tmp_path / "tp2-cp1.json"
    stale.write_text("{}")
    done = _launch(plan, "--ranks-per-node", "1")
    assert done.returncode == 2, done.stderr
    assert "SLURM_JOB_ID is not set" in done.stderr and "--workflow-profile workflow/profiles/slurm" in done.stderr
    assert not stale.exists()  # a stale report never survives a failed launch
    bad = _launch(plan, "--ranks-per-node", "0")
    assert bad.returncode == 2 and "--ranks-per-node=0 for topology 2x1" in bad.stderr, bad.stderr
    node = _launch(plan, "--ranks-per-node", "1", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "x")
    assert node.returncode == 2 and "SLURM_NODEID=''" in node.stderr, node.stderr
    half = _launch(plan, "--ranks-per-node", "1", "--rdzv-endpoint", "127.0.0.1:1")
    assert half.returncode == 2 and "go together" in half.stderr, half.stderr


# ----------------------------------------------------------------------------- evidence
def test_summary_nodes_column_and_acceptance_count_distinct_nodes() -> None:
    from rl_engine.evidence.acceptance import check_report

    fixture = Path(__file__).parent / "fixtures" / "schemas" / "report" / "valid" / "tp2-cp2-two-nodes.json"
    report = jsonio.load(fixture)
    assert summary.nodes_text(report) == "2: node1, node2"
    wrong = jsonio.load(fixture)
    wrong["topology"]["nnodes"] = 1
    found = [f for f in check_report(wrong, "r.json", fixture.parent) if f.field == "topology.nnodes"]
    assert found and "ran on 2 distinct node(s) ['node1', 'node2']" in found[0].message
    assert not [f for f in check_report(report, "r.json", fixture.parent) if f.field == "topology.nnodes"]
