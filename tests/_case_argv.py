"""Case flags for the command line of ``python -m rl_engine plan`` (and the guide's script).

A test names a case by keyword (``real_vocab=60``) and gets the flags in that order
(``--real-vocab 60``), so a changed case is the same keywords with one value replaced,
never a search for a flag's position in a hand-written list.
"""

from __future__ import annotations

from typing import Any

from rl_engine.logprob.backends.eager.vocab_parallel import BACKEND_ID


def case_argv(**values: Any) -> list[str]:
    """``--name value`` for each keyword (``prompt_tokens`` -> ``--prompt-tokens``), in order."""
    argv = []
    for name, value in values.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


# The smallest torchrun case (real 60 < padded 64, 4 tiles): what the launch, node and Slurm
# tests plan when they look at the processes of a run, not at its numbers.
TINY = case_argv(device="cpu", dtype="bf16", backend=BACKEND_ID, real_vocab=60, padded_vocab=64, num_vocab_tiles=4,
                 batch=2, seq=8, prompt_tokens=4, seed=7, timeout_s=120)
