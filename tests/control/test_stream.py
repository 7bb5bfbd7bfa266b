"""What only the stream channel has: its framing (cut anywhere, fuzzed), its greeting, its endpoint
parsing, and the promise it exists for: a sending thread writes to a connected peer itself."""

from __future__ import annotations

import math
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.control.stream import (
    GREETING,
    MAX_FRAMES,
    FrameReader,
    StreamChannel,
    StreamError,
    pack_frames,
    split_endpoint,
)
from pdkv.protocol.ids import RoomId
from pdkv.protocol.messages import Heartbeat, Message, TransferRequest
from tests.control.helpers import CODEC, DECODE_ORIGIN, heartbeat, receive_all

frame_sets = st.lists(st.lists(st.binary(max_size=300), min_size=1, max_size=6), max_size=8)


def _cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, at = [], 0
    for point in [*points, len(data)]:
        pieces.append(data[at:point])
        at = point
    return pieces


@settings(max_examples=300)
@given(sets=frame_sets, cuts=st.lists(st.integers(min_value=0), max_size=20))
def test_frame_sets_cut_anywhere_come_out_whole_and_in_order(
    sets: list[list[bytes]], cuts: list[int]
) -> None:
    wire = GREETING + b"".join(pack_frames(frames) for frames in sets)
    reader = FrameReader(max_frame_bytes=1024)
    got: list[list[bytes]] = []
    for piece in _cut(wire, cuts):
        got += reader.feed(piece)
    assert got == sets


@settings(max_examples=300)
@given(data=st.binary(max_size=600), cuts=st.lists(st.integers(min_value=0), max_size=10))
def test_any_bytes_give_frame_sets_or_a_stream_error_and_nothing_else(data: bytes, cuts: list[int]) -> None:
    reader = FrameReader(max_frame_bytes=64)
    try:
        for piece in _cut(GREETING + data, cuts):
            for frames in reader.feed(piece):
                assert 1 <= len(frames) <= MAX_FRAMES and all(len(f) <= 64 for f in frames)
    except StreamError:
        pass


def test_the_wire_is_the_documented_one() -> None:
    assert GREETING == b"PDKVS\x01\x00\x00"
    assert pack_frames([b"ab", b""]) == struct.pack("<II", 2, 2) + b"ab" + struct.pack("<I", 0)


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        (b"\xff\x00\x00\x00\x00\x00\x00\x01\x7f", "a zmq peer's"),
        (b"GET / HTTP/1.1\r\n", "not a pdkv stream channel's"),
        (GREETING + struct.pack("<I", 0), "of 0 frames"),
        (GREETING + struct.pack("<I", MAX_FRAMES + 1), f"of {MAX_FRAMES + 1} frames"),
        (GREETING + struct.pack("<II", 1, 65), "a frame of 65 bytes"),
    ],
)
def test_a_stream_that_is_not_ours_or_breaks_a_limit_is_named(wire: bytes, reason: str) -> None:
    with pytest.raises(StreamError, match=reason):
        FrameReader(max_frame_bytes=64).feed(wire)


@pytest.mark.parametrize(
    ("endpoint", "address"),
    [
        ("tcp://127.0.0.1:5555", ("127.0.0.1", 5555)),
        ("tcp://[::1]:5555", ("::1", 5555)),
        ("tcp://prefill-0.svc:80", ("prefill-0.svc", 80)),
        ("tcp://127.0.0.1:0", None),
        ("tcp://127.0.0.1:70000", None),
        ("tcp://127.0.0.1", None),
        ("tcp://:5555", None),
        ("udp://127.0.0.1:5555", None),
        ("tcp://127.0.0.1:55a", None),
    ],
)
def test_endpoints_are_split_or_refused(endpoint: str, address: tuple[str, int] | None) -> None:
    assert split_endpoint(endpoint) == address


MakeStream = Callable[..., StreamChannel[Message]]


def _channel(made: list[StreamChannel[Message]], **kwargs: object) -> StreamChannel[Message]:
    channel: StreamChannel[Message] = StreamChannel(CODEC, **kwargs)  # type: ignore[arg-type]  # test kwargs
    made.append(channel)
    return channel


@pytest.fixture
def stream_channel() -> Iterator[MakeStream]:
    made: list[StreamChannel[Message]] = []
    yield lambda **kwargs: _channel(made, **kwargs)
    for channel in made:
        channel.close()


def test_a_connected_sender_writes_its_messages_itself_without_the_upkeep_thread(
    stream_channel: MakeStream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reason the stream channel exists: once the connection is up, a frame set goes from the
    sending thread into the kernel; the upkeep thread only dials and catches up."""
    sender, receiver = stream_channel(), stream_channel()
    assert sender.send(receiver.address, heartbeat(0))
    assert receive_all(receiver, 1) == [heartbeat(0)]  # the dial (the upkeep thread's) is done
    flushed: list[object] = []
    monkeypatch.setattr(sender, "_flush", flushed.append)  # the upkeep thread can no longer write
    for seq in range(1, 101):
        assert sender.send(receiver.address, heartbeat(seq))
    assert sender.send_many(receiver.address, [heartbeat(101), heartbeat(102)])
    assert receive_all(receiver, 102) == [heartbeat(seq) for seq in range(1, 103)]
    assert flushed == []


def test_what_the_kernel_cannot_take_at_once_is_queued_in_order_and_flushed(
    stream_channel: MakeStream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver that does not read fills the kernel's buffers (24 MB of page lists here, more than
    loopback buffers hold): sends neither block nor reorder, and the upkeep thread writes the rest."""
    sender, receiver = stream_channel(), stream_channel()
    assert sender.send(receiver.address, heartbeat(0))
    assert receive_all(receiver, 1) == [heartbeat(0)]  # connected: later sends try the kernel first
    flushes: list[int] = []
    flush = sender._flush  # the upkeep thread's writer, counted

    def counted(peer: Any) -> None:
        flushes.append(len(peer.queue))
        flush(peer)

    monkeypatch.setattr(sender, "_flush", counted)
    pages = np.arange(100_000, dtype=np.int64)
    big = [TransferRequest(origin=DECODE_ORIGIN, room=RoomId(n + 1), dst_pages=pages) for n in range(30)]
    done = threading.Event()

    def send_all() -> None:
        for message in big:
            assert sender.send(receiver.address, message)
        done.set()

    thread = threading.Thread(target=send_all)
    thread.start()
    assert done.wait(30.0), "a send blocked"
    thread.join(5.0)
    got = receive_all(receiver, len(big), timeout_s=60.0)
    assert [m.room for m in got if isinstance(m, TransferRequest)] == [m.room for m in big]
    assert any(flushes), "everything fitted in the kernel: the queued path was not exercised"


def test_a_zmq_peer_dialling_a_stream_channel_is_told_apart_in_the_log(
    stream_channel: MakeStream, caplog: pytest.LogCaptureFixture
) -> None:
    from pdkv.control import ControlChannel

    receiver = stream_channel()
    with ControlChannel(CODEC) as zmq_sender:
        zmq_sender.send(receiver.address, heartbeat(1))
        assert receiver.recv(0.5) is None
    assert receiver.statistics().malformed >= 1
    assert "a zmq peer's" in caplog.text


def test_a_sender_that_talks_back_on_its_connection_is_not_a_peer(stream_channel: MakeStream) -> None:
    """The dialling side only writes; bytes from the other end (no pdkv channel sends any) close the
    connection, and the messages after it go on a new one."""
    sender = stream_channel()
    with socket.socket() as fake:
        fake.bind(("127.0.0.1", 0))
        fake.listen(1)
        address = f"tcp://127.0.0.1:{fake.getsockname()[1]}"
        assert sender.send(address, heartbeat(1))
        conn, _ = fake.accept()
        with conn:
            conn.settimeout(5.0)
            assert _read(conn, len(GREETING)) == GREETING
            conn.sendall(b"hello?")
            _read(conn, None)  # returns at the sender's close (a timeout would raise)
        assert sender.send(address, heartbeat(2))
        again, _ = fake.accept()  # dialled again, with the greeting first
        with again:
            again.settimeout(5.0)
            assert _read(again, len(GREETING)) == GREETING


def _read(conn: socket.socket, count: int | None) -> bytes:
    """``count`` bytes, or (None) everything until the other end closes."""
    data = b""
    while count is None or len(data) < count:
        piece = conn.recv(4096 if count is None else count - len(data))
        if not piece:
            break
        data += piece
    return data


def test_wait_closed_waits_for_the_flush_and_refuses_an_open_channel(stream_channel: MakeStream) -> None:
    channel = stream_channel()
    with pytest.raises(Exception, match="close it first"):
        channel.wait_closed(0.1)
    receiver = stream_channel()
    for seq in range(50):
        channel.send(receiver.address, heartbeat(seq))
    channel.close(flush_s=10.0)
    assert channel.wait_closed(10.0)
    got = receive_all(receiver, 50)
    assert [m.seq for m in got if isinstance(m, Heartbeat)] == list(range(50))


@pytest.mark.parametrize("timeout_s", [-1.0, math.nan, math.inf])
def test_wait_closed_refuses_a_timeout_it_cannot_honour(stream_channel: MakeStream, timeout_s: float) -> None:
    channel = stream_channel()
    channel.send(stream_channel().address, heartbeat(1))  # an upkeep thread to wait for
    channel.close(flush_s=1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        channel.wait_closed(timeout_s)
    assert channel.wait_closed(None)  # None waits as long as the flush takes


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_ipv6_endpoints_bind_dial_and_advertise(stream_channel: MakeStream) -> None:
    sender, receiver = stream_channel(host="::1"), stream_channel(host="::", advertise_host="::1")
    assert sender.address.startswith("tcp://[::1]:") and receiver.address.startswith("tcp://[::1]:")
    assert sender.send(receiver.address, heartbeat(6))
    assert receiver.recv(5.0) == heartbeat(6)


def _resolving(monkeypatch: pytest.MonkeyPatch, name: str, entries: list[tuple[Any, ...]]) -> None:
    """``name`` resolves to ``entries`` in this order (the dialling code's lookup; other names as ever)."""
    real = socket.getaddrinfo

    def resolve(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        return list(entries) if host == name else real(host, port, *args, **kwargs)

    monkeypatch.setattr("pdkv.control.stream.socket.getaddrinfo", resolve)


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_a_name_whose_first_address_refuses_the_connection_is_dialled_at_its_next_one(
    stream_channel: MakeStream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host name that resolves to ::1 first and 127.0.0.1 second, a peer listening on 127.0.0.1
    only: the sender dialled ::1 alone, again every reconnect interval, and never delivered."""
    receiver = stream_channel()
    port = int(receiver.address.rpartition(":")[2])
    _resolving(
        monkeypatch,
        "both.pdkv.test",
        [
            (socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("::1", port, 0, 0)),
            (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", port)),
        ],
    )
    sender = stream_channel()
    assert sender.send(f"tcp://both.pdkv.test:{port}", heartbeat(7))
    assert receiver.recv(5.0) == heartbeat(7)


def test_an_address_the_connect_call_itself_refuses_is_passed_over_for_the_next(
    stream_channel: MakeStream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other way an address fails: at the call, before any packet (as a host without IPv6 refuses
    ::1; here an IPv6 literal on an IPv4 socket, which needs no IPv6 on the test host)."""
    receiver = stream_channel()
    port = int(receiver.address.rpartition(":")[2])
    _resolving(
        monkeypatch,
        "both.pdkv.test",
        [
            (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("::1", port)),
            (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", port)),
        ],
    )
    sender = stream_channel()
    assert sender.send(f"tcp://both.pdkv.test:{port}", heartbeat(8))
    assert receiver.recv(5.0) == heartbeat(8)
