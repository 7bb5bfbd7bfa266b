"""Wiring of ``pdkv.control`` (sockets, registry service) to ``pdkv.protocol`` (messages, codec).

Owns: the ``WireCodec`` of pdkv messages, the channel factories of the transports (the stream
channel by default, zmq's with ``PDKV_CONTROL_CHANNEL=zmq``; optional HMAC authentication from
``PDKV_AUTH_KEY``), and the registry calls (announce, query,
start a registry service for a prefill instance). ``pdkv.control`` knows frames, not messages; this
is the one place that joins the two.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Final

from pdkv import config
from pdkv.control.auth import Authenticator
from pdkv.control.bootstrap import RegistryService, request
from pdkv.control.channel import ControlChannel
from pdkv.control.framing import WireCodec
from pdkv.control.stream import StreamChannel
from pdkv.errors import ConfigError, LocalProtocolError, RegistryError, RemoteProtocolError
from pdkv.protocol import codec
from pdkv.protocol.ids import Epoch, InstanceId
from pdkv.protocol.messages import (
    Message,
    Origin,
    RankAnnounce,
    RankCoord,
    RegisterReject,
    RouteQuery,
    RouteTable,
)
from pdkv.protocol.registry import RouteBook
from pdkv.runtime._host import log_notice, new_epoch
from pdkv.runtime._loop import ChannelFactory, MessageChannel

log = logging.getLogger(__name__)

CODEC: WireCodec[Message] = WireCodec(
    encode=codec.encode, decode=codec.decode, decode_error=RemoteProtocolError
)


CHANNEL_KINDS: Final = ("stream", "zmq")
_CHANNEL_VAR: Final = config.declare(
    "PDKV_CONTROL_CHANNEL",
    "Control channel of the transports: stream (plain TCP, default) or zmq; both sides of a pair alike",
)


def channel_kind(env: Mapping[str, str] | None = None) -> str:
    """The control channel the transports build: ``PDKV_CONTROL_CHANNEL``, "stream" when unset."""
    source = os.environ if env is None else env
    kind = source.get(_CHANNEL_VAR.name, "stream")
    if kind not in CHANNEL_KINDS:
        raise ConfigError(f"{_CHANNEL_VAR.name}={kind!r} is not one of {', '.join(CHANNEL_KINDS)}")
    return kind


def control_channel_factory(
    kind: str | None = None, *, auth: Authenticator | None = None, port: int = 0
) -> ChannelFactory:
    """Channels of ``kind`` ("stream" or "zmq"; None: ``channel_kind()``) bound on ``port`` of the
    given host (0: a free one); ``auth`` defaults to ``PDKV_AUTH_KEY``.

    The two speak different wires: every rank of a deployment uses the same kind (a stream channel
    names a zmq peer in its log when one dials it). The stream channel is the default because it
    takes two thread crossings off each direction of every message (``pdkv.control.stream``)."""
    chosen = channel_kind() if kind is None else kind
    if chosen not in CHANNEL_KINDS:
        raise ConfigError(f"channel kind {chosen!r} is not one of {', '.join(CHANNEL_KINDS)}")
    key = auth if auth is not None else Authenticator.from_env()

    def make_stream(host: str) -> MessageChannel:
        return StreamChannel(CODEC, host=host, port=port, auth=key)

    def make_zmq(host: str) -> MessageChannel:
        return ControlChannel(CODEC, host=host, port=port, auth=key)

    return make_stream if chosen == "stream" else make_zmq


def zmq_channel_factory(auth: Authenticator | None = None) -> ChannelFactory:
    """zmq channels (``control_channel_factory("zmq")``), e.g. beside ranks of a release before the stream
    channel."""
    return control_channel_factory("zmq", auth=auth)


def announce_to_registry(
    address: str, message: RankAnnounce, timeout_s: float = 30.0, *, auth: Authenticator | None = None
) -> RouteTable:
    """Announce a prefill rank; ``auth`` signs the request (None: unsigned, no ``PDKV_AUTH_KEY``)."""
    reply = request(address, message, codec=CODEC, timeout_s=timeout_s, auth=auth)
    if isinstance(reply, RegisterReject):
        raise RegistryError(f"registry {address} refused {message.origin}: {reply.reason}", peer=address)
    if not isinstance(reply, RouteTable):
        raise RegistryError(
            f"registry {address} answered an announcement with {type(reply).__name__}", peer=address
        )
    return reply


def query_registry(
    address: str, message: RouteQuery, timeout_s: float, *, auth: Authenticator | None = None
) -> RouteTable | None:
    """The current route table, or None while the registry has none to give (no rank announced yet);
    ``RegistryError`` for a fatal refusal (asking again cannot help). ``auth`` as for announcing."""
    reply = request(address, message, codec=CODEC, timeout_s=timeout_s, auth=auth)
    if isinstance(reply, RegisterReject):
        if reply.retry:
            return None
        raise RegistryError(f"registry {address} refused the query: {reply.reason}", peer=address)
    if not isinstance(reply, RouteTable):
        raise RegistryError(f"registry {address} answered a query with {type(reply).__name__}", peer=address)
    return reply


def start_registry(
    *,
    instance: InstanceId,
    tp_size: int | None = None,
    cp_size: int | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> RegistryService[Message]:
    """Run the bootstrap registry of a prefill instance (a thread of this process); stop() it when done.

    ``tp_size`` / ``cp_size`` given here are checked against every announcement; left out, they are
    taken from the first rank that announces."""
    book = RouteBook(
        Origin(instance=instance, epoch=Epoch(new_epoch()), rank=RankCoord(tp=0)),
        tp_size=tp_size,
        cp_size=cp_size,
    )

    def handle(message: Message) -> Message | None:
        reply = book.handle(message)
        for notice in book.take_notices():  # rejections, restarts: the book only reports them
            log_notice(log, notice)
        return reply

    def refuse(reason: str) -> Message:
        # Fatal: a request it cannot read (another PDKV_AUTH_KEY, or none) is not read next time either.
        return RegisterReject(origin=book.origin, reason=reason, retry=False)

    service = RegistryService(
        CODEC, handle, host=host, port=port, auth=Authenticator.from_env(), refuse=refuse
    )
    service.start()
    return service


class Registry:
    """The bootstrap registry of one prefill instance, as an embedder runs it (``pdkv registry`` runs
    one standalone): prefill ranks announce themselves to it, decode ranks ask it for the route table.

    ``with Registry(InstanceId("prefill-0"), port=8998) as registry: ... registry.address``. Shapes not
    given are learnt from the first announcement; later ranks that disagree are refused with the reason.
    """

    def __init__(
        self,
        instance: InstanceId | str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tp_size: int | None = None,
        cp_size: int | None = None,
    ) -> None:
        self.instance = InstanceId(str(instance))
        self._host, self._port = host, port
        self._tp_size, self._cp_size = tp_size, cp_size
        self._service: RegistryService[Message] | None = None

    def start(self) -> Registry:
        if self._service is None:
            self._service = start_registry(
                instance=self.instance,
                tp_size=self._tp_size,
                cp_size=self._cp_size,
                host=self._host,
                port=self._port,
            )
        return self

    @property
    def address(self) -> str:
        """``tcp://host:port`` (``PrefillConfig.registry`` and ``DecodeTransport.connect`` take it)."""
        if self._service is None:
            raise LocalProtocolError(
                "the registry is not started: call start() (or use it as a context manager)"
            )
        return self._service.address

    def stop(self) -> None:
        if self._service is not None:
            self._service.stop()
            self._service = None

    def __enter__(self) -> Registry:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
