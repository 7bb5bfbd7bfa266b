"""The names README promises are importable from ``pdkv`` and are what they claim to be."""

from __future__ import annotations

import re
from pathlib import Path

import pdkv

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_resolves() -> None:
    for name in pdkv.__all__:
        assert getattr(pdkv, name) is not None, name


def test_readme_lists_exactly_the_public_surface() -> None:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- public-surface -->")[1].split("<!-- /public-surface -->")[0]
    listed = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", block))
    assert listed == set(pdkv.__all__) - {"__version__"}


def test_kvpoll_values_and_room_ids() -> None:
    assert [int(p) for p in pdkv.KVPoll] == [0, 1, 2, 3, 4]
    assert pdkv.room_id(5) == 5
    for bad in (0, -1, 2**63, True):
        try:
            pdkv.room_id(bad)
        except ValueError:
            continue
        raise AssertionError(f"room_id accepted {bad!r}")


def test_errors_form_one_hierarchy() -> None:
    for cls in (
        pdkv.ProtocolError,
        pdkv.LocalProtocolError,
        pdkv.RemoteProtocolError,
        pdkv.MappingError,
        pdkv.LayoutMismatchError,
        pdkv.TransferError,
        pdkv.EngineUnavailableError,
        pdkv.ConfigError,
    ):
        assert issubclass(cls, pdkv.PdkvError)
    assert issubclass(pdkv.LocalProtocolError, pdkv.ProtocolError)
    assert issubclass(pdkv.RemoteProtocolError, pdkv.ProtocolError)


def test_every_pdkv_error_the_package_raises_is_importable_from_pdkv() -> None:
    # Walk the library (not the test harnesses of pdkv.testing, nor the adapters, which import their
    # scheduler): an embedder catches what pdkv raises without knowing which module defines it.
    import importlib
    import inspect
    import pkgutil

    defined: dict[str, str] = {}
    for info in pkgutil.walk_packages(pdkv.__path__, "pdkv."):
        if info.name.startswith(("pdkv.adapters", "pdkv.testing", "pdkv.__main__")):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, pdkv.PdkvError) and obj.__module__ == info.name:
                defined[name] = info.name
    assert len(defined) > 30  # the walk found the package's errors
    missing = sorted(
        f"{name} ({module})" for name, module in defined.items() if getattr(pdkv, name, None) is None
    )
    assert missing == []
    # ... and every one of them lives under pdkv.errors (the other modules only re-export them).
    elsewhere = sorted(
        f"{name} ({module})"
        for name, module in defined.items()
        if module != "pdkv.errors" and not module.startswith("pdkv.errors.")
    )
    assert elsewhere == []
    assert isinstance(
        pdkv.InstanceId("prefill-0"), str
    )  # the README's PrefillConfig(instance=...) type-checks


def test_the_sans_io_core_imports_without_torch_or_zmq() -> None:
    """Rules as rows: ``import pdkv.protocol`` used to import all of pdkv through the eager top-level
    exports, torch and zmq included (1.36 s). The exports are lazy now (PEP 562), so the protocol can
    be read, tested and fuzzed alone; a fresh interpreter shows what one import pulls in."""
    import subprocess
    import sys

    probe = (
        "import sys, pdkv.protocol, pdkv.protocol.codec, pdkv.protocol.prefill, pdkv.protocol.decode;"
        "print(sorted(m for m in ('torch', 'zmq', 'pdkv.runtime', 'pdkv.engine') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_lazy_exports_are_the_defining_modules_objects_and_unknown_names_raise() -> None:
    from pdkv.protocol.poll import KVPoll
    from pdkv.runtime import PrefillTransport

    assert pdkv.KVPoll is KVPoll and pdkv.PrefillTransport is PrefillTransport
    assert set(pdkv.__all__) <= set(dir(pdkv))
    try:
        pdkv.NoSuchThing  # noqa: B018  # the attribute access is the test
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("an unknown name resolved")
