"""The workflow tests' copy of the repository leaves out what .ci/run installs beside it.

A copy that took .ci/vllm-env (a link to, or a whole, vLLM environment), .ci/deepspeed-env and
.ci/op-env weighed 7.8 GB, and the workflow tests make many copies: one full run filled the disk.
"""

from __future__ import annotations

from _workflow_util import REPO, _ignore


def test_the_copy_leaves_out_ci_installs_and_keeps_ci_scripts() -> None:
    names = ["run", "slurm-cluster.sh", "triton-3.6", "vllm-env", "deepspeed-env", "op-env", "README.md"]
    assert _ignore(str(REPO / ".ci"), names) == {"triton-3.6", "vllm-env", "deepspeed-env", "op-env"}
    # elsewhere in the tree a directory named like an environment is the project's own and is copied
    assert _ignore(str(REPO / "docs"), ["vllm-env", "triton-3.6"]) == set()
