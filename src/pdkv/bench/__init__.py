"""Benchmarks behind ``pdkv bench NAME``: one module per benchmark, discovered by name.

Each module ``pdkv.bench.<name>`` defines ``main(argv: Sequence[str]) -> int`` and opens with a
docstring whose first line is its one-line help. Benchmarks print figures and ratios (one JSON
object per line on stdout, a human table on stderr); they never assert speed.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Sequence
from typing import cast

BenchMain = Callable[[Sequence[str]], int]


def available() -> dict[str, str]:
    """Benchmark name -> one-line help, for every module in this package."""
    found: dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        doc = (module.__doc__ or "").strip().splitlines()
        found[info.name] = doc[0] if doc else ""
    return found


def load(name: str) -> BenchMain:
    """The ``main`` of benchmark ``name`` (``per-layer`` = ``per_layer``); KeyError names the others."""
    name = name.replace("-", "_")
    names = available()
    if name not in names:
        raise KeyError(f"unknown benchmark {name!r}; available: {', '.join(names) or 'none'}")
    module = importlib.import_module(f"{__name__}.{name}")
    return cast(BenchMain, module.main)
