"""Text from a box or a bundle as a terminal or a notebook may show it: no character in it can act unseen.

A path, an op, a reason or a prompt that came from a box (or from a bundle, whoever wrote it) is hostile: a newline
starts a forged row, `\\x1b[1A` moves the cursor up over a real one, a backspace erases, a bidi override reorders,
a zero-width character hides a difference. Every control character (C0, DEL, C1) and every format character
(Unicode category Cf: bidi overrides, zero-width ones) is shown as its escape (`\\x1b`, `\\u202e`), the one rule the
kernel's box prompt (output_sanitiser.box_prompt, I16) and the CLI (`tkbox apply`, `tkbox show`, every error line)
share.
Pure functions; the lowest layer, so anything may use them.
"""

from __future__ import annotations

import unicodedata


def visible_char(c: str) -> str:
    """`c` itself, or its escape when it is a control or format character."""
    n = ord(c)
    if n < 0x20 or 0x7f <= n <= 0x9f:
        return f"\\x{n:02x}"
    if unicodedata.category(c) == "Cf":
        return f"\\u{n:04x}" if n <= 0xffff else f"\\U{n:08x}"
    return c


def visible(text: object) -> str:
    """`text` (made a str) on one line, every control and format character escaped (a newline too: `\\x0a`)."""
    return "".join(map(visible_char, str(text)))


def visible_lines(text: object) -> str:
    """`text` with its line breaks kept (`\\n` only) and every other control or format character escaped."""
    return "\n".join(visible(line) for line in str(text).split("\n"))
