"""The codec a control socket is given: how messages become frames and back, injected by the caller.

Owns: the ``Encoder`` / ``Decoder`` protocols and ``WireCodec``, the bundle every socket class here
takes. Must not import ``pdkv.protocol`` (control and protocol are independent layers): this package
moves frames (``list[bytes]``) and never looks inside them; the runtime passes
``WireCodec(encode=codec.encode, decode=codec.decode, decode_error=RemoteProtocolError)``.

``decode_error`` is the one exception type that means "the peer sent bad bytes": sockets count and
skip it. Any other exception out of ``decode`` is a bug in the codec and propagates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import attrs

M = TypeVar("M")
_M_co = TypeVar("_M_co", covariant=True)
_M_contra = TypeVar("_M_contra", contravariant=True)


class Encoder(Protocol[_M_contra]):
    """Turns one message into its frames (a bug in the message is the caller's error, not the peer's)."""

    def __call__(self, message: _M_contra, /) -> list[bytes]: ...


class Decoder(Protocol[_M_co]):
    """Turns frames from the network into one message, or raises the codec's ``decode_error``."""

    def __call__(self, frames: Sequence[bytes], /) -> _M_co: ...


@attrs.frozen(kw_only=True)
class WireCodec(Generic[M]):
    """``encode`` and ``decode`` for messages ``M``, and the exception ``decode`` raises on bad input."""

    encode: Encoder[M]
    decode: Decoder[M]
    decode_error: type[Exception]
