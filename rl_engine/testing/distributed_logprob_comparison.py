"""The guide's planning command, kept at its documented path::

    python rl_engine/testing/distributed_logprob_comparison.py --plan --device cuda --dtype bf16 \
        --backend pytorch-vocab-parallel-logp-ws2 --real-vocab 151936 --padded-vocab 151936 \
        --num-vocab-tiles 64 --batch 2 --seq 16 --prompt-tokens 8 --seed 123 --output DIR/plan.json

It is ``python -m rl_engine plan`` (:mod:`rl_engine.campaign.plan`): it writes ``plan.json`` and
prints one torchrun command per topology, each running :mod:`rl_engine.campaign.run` from that
plan with its ``--tp``/``--cp``. Run them from the repository root (or with rl_engine installed).
"""

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run as a script: import the rl_engine this file belongs to, not another installed copy.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rl_engine.campaign.plan import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="distributed_logprob_comparison.py"))
