"""Shared output helpers for benchmarks: JSON lines on stdout, an aligned table on stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence


def emit(record: Mapping[str, object]) -> None:
    """One machine-readable JSON line on stdout."""
    print(json.dumps(record, sort_keys=True), flush=True)


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A human-readable table on stderr (so stdout stays machine-readable)."""
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = [title]
    for n, row in enumerate(cells):
        out.append("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    print("\n".join(out), file=sys.stderr, flush=True)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)
