"""The one Python block of docs/trainer.md that a test marks as its own, run as written.

Not a test module (no ``test_`` prefix). A block is marked by the HTML comment
``<!-- run by tests/<module>.py -->`` on the line before its fence; the mark must appear once.
"""

from __future__ import annotations

import re
from pathlib import Path

TRAINER_MD = Path(__file__).resolve().parents[1] / "docs" / "trainer.md"


def run_trainer_block(mark: str) -> None:
    """Execute the block after ``mark`` in docs/trainer.md as a script (``__name__ == "__main__"``)."""
    text = TRAINER_MD.read_text(encoding="utf-8")
    assert text.count(mark) == 1, f"{mark} must mark exactly one block of docs/trainer.md"
    block = re.search(re.escape(mark) + r"\n```python\n(.*?)^```", text, re.S | re.M)
    assert block is not None, f"no python block follows {mark}"
    exec(compile(block.group(1), "docs/trainer.md", "exec"), {"__name__": "__main__"})
