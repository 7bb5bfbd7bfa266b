"""typings/nixl_cu12/_api.pyi against the installed package: every stubbed class and method exists in
nixl_cu12._api with the same parameters, in the same order, optional exactly where the stub says."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from pdkv.engine.nixl import load_nixl

STUB = Path(__file__).resolve().parents[2] / "typings" / "nixl_cu12" / "_api.pyi"
API = load_nixl()  # make test installs it: a missing NIXL is a failure, not a skip


def _stubbed() -> list[tuple[str, str, list[tuple[str, bool]]]]:
    """(class, method, [(parameter, has a default)]) for every method of every stubbed class."""
    found = []
    for node in ast.parse(STUB.read_text()).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef):
                args = item.args
                names = [a.arg for a in args.args]
                defaults = [False] * (len(names) - len(args.defaults)) + [True] * len(args.defaults)
                found.append((node.name, item.name, list(zip(names, defaults, strict=True))))
    return found


@pytest.mark.parametrize(
    ("cls", "method", "params"), _stubbed(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_stub_matches_the_installed_api(cls: str, method: str, params: list[tuple[str, bool]]) -> None:
    real = inspect.signature(getattr(getattr(API, cls), method))
    installed = [(p.name, p.default is not inspect.Parameter.empty) for p in real.parameters.values()]
    assert installed == params, f"{cls}.{method}: installed {installed}, stub {params}"


def test_the_stub_covers_what_the_backend_calls() -> None:
    methods = {m for c, m, _ in _stubbed() if c == "nixl_agent"}
    called = {
        "create_backend",
        "register_memory",
        "deregister_memory",
        "get_agent_metadata",
        "add_remote_agent",
        "remove_remote_agent",
        "get_xfer_descs",
        "initialize_xfer",
        "transfer",
        "check_xfer_state",
        "get_new_notifs",
    }
    assert called <= methods
