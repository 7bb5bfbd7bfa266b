"""What travels between vLLM's prefill and decode instances in ``kv_transfer_params``, and the adapter's
settings from ``kv_connector_extra_config``.

Owns: ``room_for`` (a router's transfer id -> pdkv ``RoomId``), ``ConsumerParams`` (what a decode request
must carry), ``AdapterSettings``. Must not import vLLM or do I/O: tests use it in the main environment.

The conversation, all in ``kv_transfer_params`` (the router copies the prefill's response into the decode
request, as for vLLM's other P/D connectors):

- prefill request: ``{"do_remote_decode": true, "transfer_id": T}`` (``transfer_id`` optional: the
  request id is used when absent);
- prefill response (``request_finished``): ``{"do_remote_prefill": true, "do_remote_decode": false,
  "transfer_id": T, "remote_registry": "tcp://host:port"}``;
- decode request: that response (``remote_registry`` may be left out when the decode's
  ``kv_connector_extra_config`` names ``prefill_registry``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Final

import attrs

from pdkv.errors import ConfigError
from pdkv.protocol import RoomId, room_id

_MAX_ROOM: Final = 2**63 - 1


def room_for(transfer_id: object) -> RoomId:
    """The 63-bit room both sides derive from the router's transfer id.

    An int in 1..2**63-1 is the room itself (a router that already allocates pdkv rooms); any other
    value (vLLM's string request ids) is hashed (BLAKE2b, 63 bits, never 0).
    """
    if isinstance(transfer_id, int) and not isinstance(transfer_id, bool) and 0 < transfer_id <= _MAX_ROOM:
        return room_id(transfer_id)
    digest = hashlib.blake2b(str(transfer_id).encode(), digest_size=8).digest()
    return room_id(int.from_bytes(digest, "little") & _MAX_ROOM or 1)


@attrs.frozen(kw_only=True)
class ConsumerParams:
    """A decode request's ``kv_transfer_params``, read: which room, from which prefill registry."""

    transfer_id: str | int
    registry: str

    @classmethod
    def parse(cls, params: Mapping[str, Any] | None, default_registry: str | None) -> ConsumerParams | None:
        """None when the request asks for no remote prefill; ``ConfigError`` when it asks but lacks what
        pdkv needs (the scheduler side logs it and lets vLLM compute the prompt locally)."""
        if not params or not params.get("do_remote_prefill"):
            return None
        transfer_id = params.get("transfer_id")
        if not isinstance(transfer_id, str | int) or isinstance(transfer_id, bool):
            raise ConfigError(f"do_remote_prefill without a transfer_id (str or int): {dict(params)!r}")
        registry = params.get("remote_registry") or default_registry
        if not isinstance(registry, str) or not registry.startswith("tcp://"):
            raise ConfigError(
                "do_remote_prefill without a prefill registry: give remote_registry in kv_transfer_params "
                f"or prefill_registry in kv_connector_extra_config (got {registry!r})"
            )
        return cls(transfer_id=transfer_id, registry=registry)


def producer_transfer_id(params: Mapping[str, Any] | None, request_id: str) -> str | int | None:
    """The transfer id of a prefill request that asks for a remote decode (None: it does not ask)."""
    if not params or not params.get("do_remote_decode"):
        return None
    given = params.get("transfer_id")
    if isinstance(given, str | int) and not isinstance(given, bool):
        return given
    return request_id


@attrs.frozen(kw_only=True)
class AdapterSettings:
    """``kv_connector_extra_config`` keys the adapter reads (all optional).

    ``host``: this instance's address for peers (pdkv control sockets, Mooncake, the registry; default
    127.0.0.1). ``registry_port``: where a producer's bootstrap registry listens (0: any free port; the
    address goes back to the router in ``remote_registry``). ``instance``: the pdkv instance id
    (default ``vllm-<role>@host:engine_id``). ``prefill_registry``: a consumer's default prefill
    registry. ``connect_timeout_s``: how long a consumer waits for a prefill registry before the
    requests that need it fail (and are recomputed). ``kv_checksum``: pdkv's checksums per (buffer,
    page), computed by the producer and verified by the consumer before a request's KV counts as
    received (None: ``PDKV_KV_CHECKSUM`` decides; set it on both instances). ``backend``: the transfer
    engine, ``mooncake`` or ``nixl`` (default: ``PDKV_BACKEND``, else mooncake; ``pdkv.engine.make_backend``).
    """

    host: str = "127.0.0.1"
    registry_port: int = 0
    instance: str | None = None
    prefill_registry: str | None = None
    connect_timeout_s: float = 30.0
    kv_checksum: bool | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool))
    )
    backend: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(("mooncake", "nixl")))
    )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> AdapterSettings:
        extra = dict(extra or {})
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config has keys the pdkv connector does not know: {unknown} "
                f"(known: {sorted(known)})"
            )
        try:
            return cls(**extra)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"kv_connector_extra_config is invalid: {exc}") from exc
