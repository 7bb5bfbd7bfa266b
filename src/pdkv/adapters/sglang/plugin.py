"""Registers pdkv as SGLang's ``pdkv`` disaggregation transfer backend, through SGLang's plugin mechanism.

Owns: ``register()``, the callable behind the ``sglang.srt.plugins`` entry point named ``pdkv`` (see
pyproject.toml). SGLang's ``load_plugins()`` runs it in every process that may build a transfer class (the
launcher, ``Engine``, each scheduler subprocess); it then applies the registered hooks itself. It:

1. adds a ``PDKV = "pdkv"`` member to SGLang's closed ``TransferBackend`` Enum, so that the schedulers'
   ``TransferBackend(server_args.disaggregation_transfer_backend)`` accepts ``"pdkv"``;
2. adds ``"pdkv"`` to the CLI choices of ``--disaggregation-transfer-backend``;
3. registers an AROUND hook on ``get_kv_class`` with SGLang's ``HookRegistry``, which answers pdkv's classes
   for ``TransferBackend.PDKV`` and defers to SGLang for every other backend. The registry rebinds the
   names that ``prefill.py``, ``decode.py`` and ``disagg_service.py`` imported with ``from ... import``.

Must not apply hooks itself (``load_plugins`` applies every plugin's hooks once, after all registered: an
early apply would make later plugins' hooks on the same target be skipped), must not import pdkv's
transfer classes before SGLang asks for one, and must not change SGLang's behaviour for other backends.
Every step is idempotent: running ``register()`` twice changes nothing the second time.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Final

from sglang.srt.arg_groups.choices import (
    DISAGG_TRANSFER_BACKEND_CHOICES,
    add_disagg_transfer_backend_choices,
)
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

log = logging.getLogger(__name__)

BACKEND_NAME: Final = "pdkv"
"""The value of ``--disaggregation-transfer-backend`` (and of ``TransferBackend.PDKV``)."""

MEMBER_NAME: Final = "PDKV"
GET_KV_CLASS: Final = "sglang.srt.disaggregation.utils.get_kv_class"
"""The hooked function, by the dotted path SGLang's HookRegistry resolves."""


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group: make ``pdkv`` a transfer backend of SGLang."""
    member = add_enum_member(TransferBackend, MEMBER_NAME, BACKEND_NAME)
    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    if not _hook_registered():
        HookRegistry.register(GET_KV_CLASS, _get_kv_class_around, HookType.AROUND)
    log.debug("pdkv registered as SGLang transfer backend %s", member)


def pdkv_backend() -> TransferBackend:
    """``TransferBackend.PDKV`` (present once ``register()`` ran)."""
    return TransferBackend(BACKEND_NAME)


def pdkv_classes() -> dict[KVClassType, type]:
    """The classes SGLang gets for ``TransferBackend.PDKV``, by kind (KVArgs stays SGLang's own)."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    from pdkv.adapters.sglang.conn import (
        PdkvKVBootstrapServer,
        PdkvKVManager,
        PdkvKVReceiver,
        PdkvKVSender,
    )

    return {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: PdkvKVManager,
        KVClassType.SENDER: PdkvKVSender,
        KVClassType.RECEIVER: PdkvKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: PdkvKVBootstrapServer,
    }


def _get_kv_class_around(
    original: Callable[[TransferBackend, KVClassType], type | None],
    transfer_backend: TransferBackend,
    class_type: KVClassType,
) -> type | None:
    if getattr(transfer_backend, "value", None) != BACKEND_NAME:
        return original(transfer_backend, class_type)
    return pdkv_classes().get(class_type)


def _hook_registered() -> bool:
    hooks = HookRegistry._hooks.get(GET_KV_CLASS, [])
    return any(hook is _get_kv_class_around for _, hook, _ in hooks)


_E = enum.Enum


def add_enum_member(cls: type[_E], name: str, value: str) -> _E:
    """Add ``name = value`` to a plain (object-valued) Enum class after its creation; idempotent.

    Enum classes are closed by design; SGLang's backend selection goes through ``TransferBackend(value)``,
    so the member must exist for a by-value lookup, iteration and ``TransferBackend.PDKV`` alike.
    """
    existing = cls._value2member_map_.get(value)
    if existing is not None:
        if existing.name != name:
            raise ValueError(f"{cls.__name__} already maps {value!r} to {existing.name}")
        return existing
    if name in cls.__members__:
        raise ValueError(f"{cls.__name__}.{name} already exists with another value")
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = cls  # type: ignore[attr-defined]
    type.__setattr__(cls, name, member)
    cls._member_map_[name] = member
    cls._member_names_.append(name)
    cls._value2member_map_[value] = member
    return member
