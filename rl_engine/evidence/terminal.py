"""Text from an untrusted archive, made safe to print on a reviewer's terminal.

Every string ``verify`` prints may hold bytes an attacker chose (a branch name, a hostname, a
member name, a JSON value quoted in a finding). :func:`terminal_text` turns each control or
format character (Unicode categories ``Cc`` and ``Cf``: ESC, BEL, CSI, the C1 range, bidi
overrides, zero-width characters) into a visible escape such as ``\\x1b`` or ``\\u202e``, so
no ESC/OSC/CSI sequence (screen clearing, a window title, an OSC-8 hyperlink) reaches the
terminal, and cuts the text to a length a table renders quickly. Newlines are kept (rows hold
one problem a line). The result is plain text: the caller prints it as a ``rich.text.Text``,
never as markup, so a bracket such as ``[/]`` is shown as written and cannot raise.
"""

from __future__ import annotations

import unicodedata

MAX_PRINTED = 2000
_KEPT = frozenset("\n")


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}" if ch != "\t" else "\\t"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def terminal_text(text: str, limit: int = MAX_PRINTED) -> str:
    """``text`` with control/format characters escaped, cut to ``limit`` characters (with its length)."""
    cut = text if len(text) <= limit else text[:limit]
    shown = "".join(_escape(ch) if ch not in _KEPT and unicodedata.category(ch) in ("Cc", "Cf") else ch for ch in cut)
    return shown if len(text) <= limit else f"{shown}... ({len(text)} characters)"
