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
