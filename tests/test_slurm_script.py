"""``.ci/slurm-cluster.sh stop`` leaves the machine as it found it: no slurm.conf of its own.

A config naming a controller that no longer runs makes every Slurm client wait for it
(``scontrol show config``: 9 s), and Snakemake's Slurm executor plugin runs that command when it
is imported, at every ``snakemake`` start whatever the executor: a machine that once ran the test
cluster would pay it on every workflow run. These cases run ``stop`` on files in a temporary
folder (the script's ``RL_ENGINE_SLURM_*`` overrides): no pidfile there, so nothing is signalled.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

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
