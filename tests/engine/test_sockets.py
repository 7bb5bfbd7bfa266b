"""Cutting connections through sock_diag: exactly the connections named, closed by their owner."""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
from collections.abc import Iterator

import pytest

from pdkv.engine import sockets
from pdkv.errors import TransferError

_WHY = sockets.can_cut_connections()
needs_cut = pytest.mark.skipif(_WHY is not None, reason=f"cannot destroy sockets here: {_WHY}")


@pytest.fixture
def listeners() -> Iterator[list[socket.socket]]:
    """Two listeners: an IPv4 one and a dual-stack IPv6 one (as Mooncake's data port is)."""
    v4 = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    v4.bind(("127.0.0.1", 0))
    v6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    v6.bind(("::", 0))
    made = [v4, v6]
    for s in made:
        s.listen(8)
    yield made
    for s in made:
        s.close()


def _port(s: socket.socket) -> int:
    return int(s.getsockname()[1])


def test_listening_ports_are_this_process_listeners(listeners: list[socket.socket]) -> None:
    ports = sockets.listening_ports()
    assert {_port(s) for s in listeners} <= ports


@needs_cut
def test_cut_ends_only_the_named_port_connections_and_their_readers_see_an_abort(
    listeners: list[socket.socket],
) -> None:
    v4, v6 = listeners
    client_a = socket.create_connection(("127.0.0.1", _port(v6)))  # v4 client on the dual-stack port
    accepted_a, _ = v6.accept()
    client_b = socket.create_connection(("127.0.0.1", _port(v4)))
    accepted_b, _ = v4.accept()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            accepted_a.recv(16)
        except OSError as exc:
            errors.append(exc)
        finally:
            accepted_a.close()  # as the engine does once its read failed

    reader = threading.Thread(target=read)
    reader.start()
    try:
        [seen] = sockets.connections_from({"127.0.0.1"}, {_port(v6)})
        assert (seen.remote_ip, seen.local_port) == ("127.0.0.1", _port(v6))  # the v4-mapped form shortened
        report = sockets.cut_connections({"127.0.0.1"}, {_port(v6)}, timeout_s=5.0)
        reader.join(5.0)
        assert [c.local_port for c in report.cut] == [_port(v6)]
        assert len(errors) == 1 and isinstance(errors[0], ConnectionAbortedError)
        assert sockets.connections_from({"127.0.0.1"}, {_port(v6)}) == []
        # The other port's connection is untouched and still carries bytes.
        client_b.sendall(b"ping")
        assert accepted_b.recv(4) == b"ping"
        # Nothing from another host is cut.
        assert sockets.cut_connections({"10.255.255.1"}, {_port(v4)}).cut == ()
        assert len(sockets.connections_from({"127.0.0.1"}, {_port(v4)})) == 1
    finally:
        reader.join(5.0)
        for s in (client_a, client_b, accepted_b):
            s.close()


@needs_cut
def test_a_cut_is_no_proof_while_the_owner_can_still_read_queued_bytes(
    listeners: list[socket.socket],
) -> None:
    # Seams issue, item 4: a destroyed socket leaves the kernel's table at once, but the bytes in its
    # receive queue stay readable by the owner. The cut used to "prove" itself there; the owner then
    # read every queued byte (the engine would have copied them into pages released as proven).
    v4, _ = listeners
    client = socket.create_connection(("127.0.0.1", _port(v4)))
    accepted, _ = v4.accept()
    try:
        client.sendall(b"x" * 65536)
        pause = threading.Event()
        for _ in range(500):  # until every byte is queued at the receiver (at most 5 s)
            if _rqueue_of(accepted) >= 65536:
                break
            pause.wait(0.01)
        with pytest.raises(TransferError, match=r"still open in this process .* may still be read"):
            sockets.cut_connections({"127.0.0.1"}, {_port(v4)}, timeout_s=0.3)
        assert sockets.connections_from({"127.0.0.1"}, {_port(v4)}) == []  # gone from the table ...
        accepted.setblocking(False)
        read = len(accepted.recv(1 << 17))
        assert read == 65536  # ... yet every queued byte was still there to be read
    finally:
        client.close()
        accepted.close()


@needs_cut
def test_a_cut_is_proof_once_the_owner_closed_the_destroyed_sockets(listeners: list[socket.socket]) -> None:
    v4, _ = listeners
    client = socket.create_connection(("127.0.0.1", _port(v4)))
    accepted, _ = v4.accept()

    def owner() -> None:  # the engine's reader: its read fails, and it closes the socket
        try:
            accepted.recv(16)
        except OSError:
            pass
        finally:
            accepted.close()

    reader = threading.Thread(target=owner)
    reader.start()
    try:
        report = sockets.cut_connections({"127.0.0.1"}, {_port(v4)}, timeout_s=5.0)
        assert [c.local_port for c in report.cut] == [_port(v4)]
        assert accepted.fileno() == -1  # returned only after the owner closed it
    finally:
        reader.join(5.0)
        client.close()


def _rqueue_of(s: socket.socket) -> int:
    """Bytes waiting in ``s``'s receive queue (FIONREAD)."""
    return int(struct.unpack("i", fcntl.ioctl(s.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])
