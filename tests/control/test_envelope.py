"""Several messages in one frame set: the envelope's bytes, its rejections, and two channels using it."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.control.auth import Authenticator
from pdkv.control.envelope import MAX_MESSAGES, EnvelopeError, is_envelope, pack, unpack
from pdkv.protocol import codec
from tests.control.helpers import AnyChannel, Pusher, heartbeat, receive_all

MakeChannel = Callable[..., AnyChannel]
PushTo = Callable[[str], Pusher]


# ---------------------------------------------------------------- bytes


def test_pack_lays_out_header_sizes_then_every_frame() -> None:
    frames = pack([[b"a1", b"a2"], [b"b1"], [b"c1", b"c2", b"c3"]])
    assert frames[0] == b"PDKE" + (1).to_bytes(2, "little") + (3).to_bytes(2, "little")
    assert frames[1] == b"\x02\x00\x01\x00\x03\x00"
    assert frames[2:] == [b"a1", b"a2", b"b1", b"c1", b"c2", b"c3"]
    assert is_envelope(frames) and not is_envelope(codec.encode(heartbeat(1)))
    assert unpack(frames) == [[b"a1", b"a2"], [b"b1"], [b"c1", b"c2", b"c3"]]


@pytest.mark.parametrize("count", [0, 1, MAX_MESSAGES + 1])
def test_pack_refuses_a_count_out_of_range(count: int) -> None:
    with pytest.raises(ValueError, match=r"2\.\.1024"):
        pack([[b"x"]] * count)


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([b"PDKE\x01\x00\x02\x00"], "header and a size frame"),
        ([b"PDKE\x01\x00\x02", b"\x01\x00\x01\x00", b"a", b"b"], "header of 7 bytes"),
        ([b"PDKE\x02\x00\x02\x00", b"\x01\x00\x01\x00", b"a", b"b"], "version 2, this side reads version 1"),
        ([b"PDKE\x01\x00\x01\x00", b"\x01\x00", b"a"], "1 messages"),
        ([b"PDKE\x01\x00\x02\x00", b"\x01\x00", b"a", b"b"], "size frame of 2 bytes"),
        ([b"PDKE\x01\x00\x02\x00", b"\x01\x00\x02\x00", b"a", b"b"], "do not cover the 2 frames"),
        ([b"PDKE\x01\x00\x02\x00", b"\x00\x00\x02\x00", b"a", b"b"], "do not cover"),
    ],
)
def test_unpack_rejects_what_does_not_add_up(frames: list[bytes], why: str) -> None:
    with pytest.raises(EnvelopeError, match=why):
        unpack(frames)


@settings(max_examples=300)
@given(
    count=st.integers(0, 70000),
    sizes=st.lists(st.integers(0, 70000), max_size=6),
    body=st.lists(st.binary(max_size=8), max_size=8),
)
def test_unpack_of_any_frames_returns_a_split_or_raises_envelope_error(
    count: int, sizes: list[int], body: list[bytes]
) -> None:
    """Fuzz: a peer controls every byte; the only outcome besides a split is EnvelopeError."""
    header = b"PDKE" + (1).to_bytes(2, "little") + (count % 65536).to_bytes(2, "little")
    frames = [header, struct.pack(f"<{len(sizes)}H", *(s % 65536 for s in sizes)), *body]
    try:
        messages = unpack(frames)
    except EnvelopeError:
        return
    assert [f for m in messages for f in m] == body
    assert len(messages) == count % 65536 and all(m for m in messages)


# ---------------------------------------------------------------- channels


@pytest.mark.parametrize("auth", [False, True])
def test_send_many_arrives_as_the_messages_in_order_in_one_frame_set(
    make_channel: MakeChannel, auth: bool
) -> None:
    key = Authenticator(key=b"k" * 32) if auth else None
    a, b = make_channel(auth=key), make_channel(auth=key)
    sent = [heartbeat(seq) for seq in range(40)]
    assert a.send_many(b.address, sent[:1])  # one message goes as a plain one
    assert a.send_many(b.address, sent[1:])
    assert receive_all(b, 40) == sent
    sa, sb = a.statistics(), b.statistics()
    assert (sa.sent, sa.envelopes_sent) == (40, 1)
    assert (sb.received, sb.envelopes_received, sb.malformed, sb.unauthenticated) == (40, 1, 0, 0)


def test_an_envelope_larger_than_a_wait_is_handed_out_over_several_waits(make_channel: MakeChannel) -> None:
    a, b = make_channel(), make_channel()
    a.send_many(b.address, [heartbeat(seq) for seq in range(5)])
    got = [m for _ in range(3) for m in b.wait(5.0, max_messages=2)]
    assert got == [heartbeat(seq) for seq in range(5)]
    assert b.recv(0.0) is None


def test_a_bad_message_inside_an_envelope_costs_only_itself(
    make_channel: MakeChannel, push_to: PushTo
) -> None:
    channel = make_channel()
    hostile = push_to(channel.address)
    good = [codec.encode(heartbeat(seq)) for seq in range(2)]
    hostile.send_multipart(pack([good[0], [b"PDKV garbage"], good[1]]))
    hostile.send_multipart([b"PDKE\x01\x00\x05\x00", b"\x01\x00", b"x"])  # counts do not add up: all of it
    hostile.send_multipart(codec.encode(heartbeat(9)))
    assert receive_all(channel, 3) == [heartbeat(0), heartbeat(1), heartbeat(9)]
    stats = channel.statistics()
    assert (stats.received, stats.malformed, stats.envelopes_received) == (3, 2, 1)
