"""pdkv.control: the only package that imports zmq (DESIGN sections 2, 4 and 7).

- ``stream``: ``StreamChannel``, the transports' default control channel: plain TCP, the sending
  thread writes to the kernel itself (no I/O thread between), one upkeep thread dials and catches up;
- ``channel``: ``ControlChannel``, the same surface over zmq: a PULL socket bound on host:port, cached
  PUSH sockets per destination, non-blocking sends, ``recv`` / ``wait`` (woken by ``wake()`` from other
  threads), counters; one receiving thread at a time (``_inbox`` holds what the two share: signing,
  verifying, decoding and the receive claim);
- ``auth``: optional HMAC-SHA256 tag frame with a timestamp (``Authenticator``, ``PDKV_AUTH_KEY``);
- ``bootstrap``: ``RegistryService`` (ROUTER socket on its own thread, answering with an injected
  handler, e.g. ``pdkv.protocol.registry.RouteBook.handle``) and ``request`` (DEALER client with
  bounded retries);
- ``framing``: ``WireCodec``, how a caller hands its codec in.

Must not import ``pdkv.protocol`` (an independent layer): everything here moves frames
(``list[bytes]``) and endpoint strings, and decodes only through the injected codec. Imports only
``pdkv.errors`` from the rest of pdkv.
"""

from pdkv.control.auth import Authenticator
from pdkv.control.bootstrap import RegistryService, RegistryStatistics, request
from pdkv.control.channel import ChannelOptions, ChannelStatistics, ControlChannel
from pdkv.control.errors import (
    AuthenticationError,
    ChannelClosedError,
    ChannelOwnershipError,
    ControlBindError,
    ControlError,
    ControlTimeoutError,
)
from pdkv.control.framing import Decoder, Encoder, WireCodec
from pdkv.control.stream import StreamChannel

__all__ = [
    "AuthenticationError",
    "Authenticator",
    "ChannelClosedError",
    "ChannelOptions",
    "ChannelOwnershipError",
    "ChannelStatistics",
    "ControlBindError",
    "ControlChannel",
    "ControlError",
    "ControlTimeoutError",
    "Decoder",
    "Encoder",
    "RegistryService",
    "RegistryStatistics",
    "StreamChannel",
    "WireCodec",
    "request",
]
