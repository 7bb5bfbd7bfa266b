"""Text that goes into a Mermaid line (shared by every diagram module): nothing else lives here."""

from __future__ import annotations

import re

_SPECIAL = re.compile(r"[#;]")


def mermaid_text(text: str) -> str:
    """``text`` safe on one Mermaid line: ``;`` would end the statement and ``#`` start an entity
    code, so both are written as entity codes (in one pass: the codes' own ``#``/``;`` stay)."""
    return _SPECIAL.sub(lambda m: f"#{ord(m.group(0))};", text).replace("\n", " ")
