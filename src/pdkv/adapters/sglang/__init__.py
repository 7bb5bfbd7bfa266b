"""pdkv as a transfer backend of SGLang's prefill/decode disaggregation (SGLang 0.5.23).

Owns: the translation from SGLang's KVArgs to a pdkv ``BufferLayout`` (``layout``, pure, importable without
SGLang), the plugin that registers the ``pdkv`` backend with SGLang (``plugin``), and the classes SGLang
drives (``conn``). Must not be imported by pdkv's core, and importing this package must not import SGLang:
only ``plugin`` and ``conn`` do, and SGLang loads them through its ``sglang.srt.plugins`` entry point.
"""

from pdkv.adapters.sglang.environment import ADVERTISE_HOST
from pdkv.adapters.sglang.layout import (
    SUPPORTED_STATE_TYPES,
    KVArgsLike,
    layout_from_kv_args,
    state_kind_for,
)

__all__ = ["ADVERTISE_HOST", "SUPPORTED_STATE_TYPES", "KVArgsLike", "layout_from_kv_args", "state_kind_for"]
