"""typings/mooncake/engine.pyi against the installed binding: every stubbed method exists there with
the same number of parameters, the same types, the same optional ones and the same return type
(read from pybind11's signature line in each method's docstring)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import mooncake.engine as engine  # make test installs it: a missing engine is a failure, not a skip

STUB = Path(__file__).resolve().parents[2] / "typings" / "mooncake" / "engine.pyi"
SIGNATURE = re.compile(r"^(?P<name>\w+)\((?P<params>.*)\) -> (?P<ret>.+)$")


def _split(params: str) -> list[str]:
    out, depth, current = [], 0, ""
    for ch in params:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        out.append(current.strip())
    return out


def _normalize(annotation: str) -> str:
    return (
        annotation.replace("typing.", "")
        .replace("mooncake.engine.", "")
        .replace("List[", "list[")
        .replace(" ", "")
    )


def _binding(name: str) -> tuple[list[tuple[str, bool]], str]:
    doc = (getattr(engine.TransferEngine, name).__doc__ or "").strip().splitlines()[0]
    match = SIGNATURE.match(doc)
    assert match, f"unexpected binding signature for {name}: {doc!r}"
    params = _split(match.group("params"))[1:]  # drop self
    parsed = []
    for p in params:
        annotation, _, default = p.split(":", 1)[1].partition("=")
        kind = _normalize(annotation)
        if default.strip() == "None":  # pybind11 shows an optional argument as `str = None`
            kind += "|None"
        parsed.append((kind, bool(default)))
    return parsed, _normalize(match.group("ret"))


def _stubbed() -> dict[str, tuple[list[tuple[str, bool]], str]]:
    tree = ast.parse(STUB.read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TransferEngine"]
    methods: dict[str, tuple[list[tuple[str, bool]], str]] = {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("__"):
            continue
        args = fn.args.posonlyargs + fn.args.args
        defaults = [False] * (len(args) - len(fn.args.defaults)) + [True] * len(fn.args.defaults)
        params = [
            (_normalize(ast.unparse(a.annotation)) if a.annotation else "?", d)
            for a, d in zip(args, defaults, strict=True)
            if a.arg != "self"
        ]
        methods[fn.name] = (params, _normalize(ast.unparse(fn.returns)) if fn.returns else "None")
    return methods


def test_every_stubbed_method_matches_the_binding() -> None:
    stubbed = _stubbed()
    assert {
        "initialize",
        "get_rpc_port",
        "register_memory",
        "unregister_memory",
        "batch_transfer_async_write",
        "get_batch_transfer_status",
    } <= set(stubbed)
    for name, (params, ret) in stubbed.items():
        assert hasattr(engine.TransferEngine, name), f"stub declares {name}, the binding has none"
        bound_params, bound_ret = _binding(name)
        assert [p for p, _ in params] == [p for p, _ in bound_params], name
        assert [d for _, d in params] == [d for _, d in bound_params], f"{name}: optional parameters differ"
        assert ret == bound_ret, name


def test_the_methods_pdkv_calls_are_stubbed() -> None:
    source = (Path(__file__).resolve().parents[2] / "src" / "pdkv" / "engine" / "mooncake.py").read_text()
    called = set(re.findall(r"\.(\w+)\(", source)) & {
        n for n in dir(engine.TransferEngine) if not n.startswith("_")
    }
    assert called <= set(_stubbed()), called - set(_stubbed())
