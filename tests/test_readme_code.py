"""The README's code blocks are complete programs, run as pasted.

Every ```python block of README.md is extracted and run: the one-rank block with plain Python,
the mesh block under ``torchrun`` (CPU, gloo, TP=2 x CP=2, the command the README gives). Both
print the selected logprob's bytes (32 float32 values, in hex); the mesh's must equal the one
rank's, which is the README's promise. Both use the public API alone (``rl_engine.logprob.__all__``,
at most 8 names): two imports, ``torch`` and ``rl_engine.logprob``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.M | re.S)
MESH_COMMAND = "torchrun --standalone --nproc-per-node=4 mesh.py"
BYTES = re.compile(r"^[0-9a-f]{256}$")  # 32 float32 values
PUBLIC_IMPORT = re.compile(r"^from rl_engine\.logprob import (.+)$", re.M)


def python_blocks() -> list[str]:
    return BLOCK.findall(README.read_text(encoding="utf-8"))


def one_rank_block() -> str:
    (block,) = [b for b in python_blocks() if "init_mesh" not in b]
    return block


def mesh_block() -> str:
    (block,) = [b for b in python_blocks() if "init_mesh" in b]
    return block


def run_one_rank(block: str) -> str:
    """The block run as a program (its own globals, ``__main__``); what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, "README.md", "exec"), {"__name__": "__main__"})
    return printed.getvalue()


def test_the_readme_has_exactly_the_two_blocks() -> None:
    """Each block is a program: its imports are in it, and nothing is elided."""
    blocks = python_blocks()
    assert len(blocks) == 2
    for block in blocks:
        assert block.startswith("import ") and "..." not in block
    assert MESH_COMMAND in README.read_text(encoding="utf-8")


def test_the_blocks_import_torch_and_the_public_api_alone() -> None:
    import rl_engine.logprob

    assert len(rl_engine.logprob.__all__) <= 8, rl_engine.logprob.__all__
    for block in python_blocks():
        imports = [line for line in block.splitlines() if line.startswith(("import ", "from "))]
        assert len(imports) == 2 and imports[0] == "import torch", imports
        (names,) = PUBLIC_IMPORT.findall(imports[1])
        assert set(names.split(", ")) <= set(rl_engine.logprob.__all__), names


def test_the_public_names_load_and_an_internal_one_is_refused_by_name() -> None:
    import rl_engine.logprob

    for name in rl_engine.logprob.__all__:
        assert getattr(rl_engine.logprob, name).__name__ == name
    with pytest.raises(AttributeError, match="rl_engine.logprob.registry.dispatch"):
        rl_engine.logprob.dispatch  # noqa: B018 - an internal: imported from its module


def test_the_one_rank_block_runs_as_pasted_and_prints_its_bytes() -> None:
    printed = run_one_rank(one_rank_block()).split()
    assert len(printed) == 1 and BYTES.match(printed[0]), printed


def test_a_block_that_drifts_fails() -> None:
    """Negative control: the README's block with an argument the API does not take raises."""
    broken = one_rank_block().replace("real_vocab_size=1000", "real_vocab=1000")
    assert broken != one_rank_block()
    with pytest.raises(TypeError):
        run_one_rank(broken)


@pytest.mark.slow  # a torchrun of 4 processes
def test_the_mesh_block_under_torchrun_prints_the_one_rank_bytes(tmp_path: Path) -> None:
    (tmp_path / "mesh.py").write_text(mesh_block(), encoding="utf-8")
    program, *rest = MESH_COMMAND.split()
    assert program == "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *rest], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    printed = proc.stdout.split()
    assert len(printed) == 1 and BYTES.match(printed[0]), proc.stdout  # rank 0 alone prints
    assert printed == run_one_rank(one_rank_block()).split()
