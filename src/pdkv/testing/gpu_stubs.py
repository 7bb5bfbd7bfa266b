"""Import-time stand-ins for SGLang's GPU-only dependencies, installed only when the real ones are missing.

Owns: a meta-path finder that provides ``triton``, ``sgl_kernel``, ``flashinfer`` and ``torchvision`` (and
their submodules) as modules whose every attribute is a recording stub, plus the count of calls made to any
stub. SGLang imports these at module level on paths unrelated to KV transfer (kernels decorated with
``@triton.jit`` and the like); those decorators run while a module body executes, and nothing else may
call a stub: ``calls_outside_import()`` lists every other call, and the SGLang adapter tests
(``tests/adapters``) and ``pdkv bench sglang`` assert it stays empty. Must not shadow an installed
package (``install()`` checks ``find_spec`` first) and must only be installed in a process of its own
that runs SGLang on CPU (a test's child process, a bench rank), never in a serving process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any

GPU_ONLY: tuple[str, ...] = ("triton", "sgl_kernel", "flashinfer", "torchvision")

_lock = threading.Lock()
_calls: list[tuple[str, bool]] = []


def calls() -> tuple[str, ...]:
    """Every call made to a stub so far, by dotted name, in order."""
    with _lock:
        return tuple(name for name, _ in _calls)


def calls_outside_import() -> tuple[str, ...]:
    """Calls made while no module body was executing: what ran a GPU-only function for real. Must be ()."""
    with _lock:
        return tuple(name for name, at_import in _calls if not at_import)


def _importing() -> bool:
    """True when a module's top-level code (other than ``__main__``) is on the stack."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") != "__main__":
            return True
        frame = frame.f_back
    return False


class _StubMeta(type):
    """Metaclass of every stub: a stub is a class (so ``isinstance(x, triton.X)`` and ``class Y(triton.X)``
    work, as torch and SGLang do at import) whose attributes, subscripts and calls are stubs again."""

    def __getattr__(cls, attr: str) -> type:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _stub(f"{cls.__qualname__}.{attr}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        at_import = _importing()
        with _lock:
            _calls.append((cls.__qualname__, at_import))
        # Used as a bare decorator (@triton.jit def f ...): hand the function back unchanged.
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _StubMeta):
            return args[0]
        return _stub(f"{cls.__qualname__}()")

    def __getitem__(cls, key: object) -> type:
        return _stub(f"{cls.__qualname__}[]")

    def __iter__(cls) -> Any:
        return iter(())

    def __repr__(cls) -> str:
        return f"<gpu stub {cls.__qualname__}>"


def _stub(name: str) -> type:
    stub = _StubMeta(name.rsplit(".", 1)[-1], (), {"__module__": name.split(".", 1)[0]})
    stub.__qualname__ = name
    return stub


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _stub(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: Sequence[str]) -> None:
        self.roots = tuple(roots)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".", 1)[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+pdkv.stub"  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


_installed: _StubFinder | None = None


def install() -> tuple[str, ...]:
    """Stub every GPU-only package that is not installed; returns the names stubbed (idempotent)."""
    global _installed
    if _installed is not None:
        return _installed.roots
    missing = tuple(name for name in GPU_ONLY if importlib.util.find_spec(name) is None)
    _installed = _StubFinder(missing)
    if missing:
        sys.meta_path.append(_installed)
    return missing
