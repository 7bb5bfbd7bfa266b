"""RegistryService and request() over real sockets, with the real RouteBook as the handler."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import pytest
import zmq

from pdkv.control import Authenticator, ControlError, ControlTimeoutError, RegistryService, request
from pdkv.control.auth import unix_ms
from pdkv.control.errors import ChannelClosedError
from pdkv.errors import ConfigError
from pdkv.protocol import codec
from pdkv.protocol.effects import NoticeLevel
from pdkv.protocol.messages import Heartbeat, HeartbeatAck, Message, RegisterReject, RouteTable
from pdkv.protocol.registry import RouteBook
from tests.control.helpers import (
    CODEC,
    DECODE_ORIGIN,
    KEY,
    OTHER_KEY,
    REGISTRY_ORIGIN,
    announce,
    eventually,
    heartbeat,
    route_query,
)

MakeRegistry = Callable[..., RegistryService[Message]]
RawSocket = Callable[[int, str], zmq.Socket[bytes]]

_LEVELS = {
    NoticeLevel.DEBUG: logging.DEBUG,
    NoticeLevel.INFO: logging.INFO,
    NoticeLevel.WARNING: logging.WARNING,
}
log = logging.getLogger("tests.control.registry")


def book_handler(book: RouteBook) -> Callable[[Message], Message | None]:
    """The wiring a runtime does: the book answers, its notices go to the log."""

    def handle(message: Message) -> Message | None:
        reply = book.handle(message)
        for notice in book.take_notices():
            log.log(_LEVELS[notice.level], "%s", notice.text)
        return reply

    return handle


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _ask(address: str, message: Message, timeout_s: float = 5.0, **kwargs: object) -> Message:
    return request(address, message, codec=CODEC, timeout_s=timeout_s, **kwargs)  # type: ignore[arg-type]  # kwargs are request's


def test_prefill_ranks_announce_and_decode_gets_the_complete_table(
    make_registry: MakeRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tests.control.registry")
    book = RouteBook(REGISTRY_ORIGIN)
    registry = make_registry(book_handler(book))
    before = _ask(registry.address, route_query())
    assert isinstance(before, RegisterReject)
    acks = [_ask(registry.address, announce(tp, cp)) for cp in range(2) for tp in range(2)]
    assert all(isinstance(ack, RouteTable) for ack in acks)
    assert [ack.complete for ack in acks if isinstance(ack, RouteTable)] == [False, False, False, True]
    table = _ask(registry.address, route_query())
    assert isinstance(table, RouteTable) and table.complete
    assert table == book.table()
    assert "joined (4/4 ranks)" in caplog.text
    # the service counts a reply just after sending it: the client may read it first
    assert eventually(lambda: registry.statistics().replies == 6)
    stats = registry.statistics()
    assert (stats.requests, stats.malformed, stats.handler_errors) == (6, 0, 0)
    assert stats.running


def test_a_refused_announcement_gets_the_reason_back(make_registry: MakeRegistry) -> None:
    book = RouteBook(REGISTRY_ORIGIN)
    registry = make_registry(book_handler(book))
    _ask(registry.address, announce(0))
    reply = _ask(registry.address, announce(1, page_size=64))
    assert isinstance(reply, RegisterReject) and "page_size 64" in reply.reason


def test_request_times_out_with_a_typed_error_when_nobody_listens() -> None:
    address = f"tcp://127.0.0.1:{_free_port()}"
    started = time.monotonic()
    with pytest.raises(ControlTimeoutError) as caught:
        _ask(address, route_query(), timeout_s=0.3, attempts=3)
    assert time.monotonic() - started >= 0.29
    error = caught.value
    assert (error.address, error.attempts, error.timeout_s) == (address, 3, 0.3)
    assert isinstance(error, TimeoutError)
    assert "RouteQuery" in str(error) and address in str(error)


def test_request_reaches_a_registry_that_starts_late(make_registry: MakeRegistry) -> None:
    port = _free_port()
    book = RouteBook(REGISTRY_ORIGIN)
    replies: list[Message | BaseException] = []

    def client() -> None:
        try:
            replies.append(_ask(f"tcp://127.0.0.1:{port}", announce(0), timeout_s=10.0))
        except BaseException as exc:
            replies.append(exc)

    thread = threading.Thread(target=client)
    thread.start()
    try:
        time.sleep(0.3)
        make_registry(book_handler(book), port=port)
    finally:
        thread.join(15.0)
    assert len(replies) == 1 and isinstance(replies[0], RouteTable)


def test_a_handler_that_raises_is_counted_and_the_service_keeps_serving(
    make_registry: MakeRegistry, raw_socket: RawSocket, caplog: pytest.LogCaptureFixture
) -> None:
    def handle(message: Message) -> Message | None:
        assert isinstance(message, Heartbeat)
        if message.seq == 13:
            raise RuntimeError("unlucky")
        if message.seq == 0:
            return None  # no reply by design
        return HeartbeatAck(origin=DECODE_ORIGIN, seq=message.seq)

    registry = make_registry(handle)
    client = raw_socket(zmq.DEALER, registry.address)
    client.send_multipart(codec.encode(heartbeat(13)))
    client.send_multipart(codec.encode(heartbeat(0)))
    assert eventually(lambda: registry.statistics().requests == 2)
    assert client.poll(100) == 0  # neither got an answer
    assert _ask(registry.address, heartbeat(5)) == HeartbeatAck(origin=DECODE_ORIGIN, seq=5)
    assert eventually(lambda: registry.statistics().replies == 1)
    stats = registry.statistics()
    assert stats.handler_errors == 1
    assert stats.running
    assert "unlucky" in caplog.text


def test_garbage_to_the_registry_is_counted_and_skipped(
    make_registry: MakeRegistry, raw_socket: RawSocket
) -> None:
    registry = make_registry(book_handler(RouteBook(REGISTRY_ORIGIN)))
    hostile = raw_socket(zmq.DEALER, registry.address)
    for frames in ([b"junk"], [b""], [b"PDKV", b"x", b"y"]):
        hostile.send_multipart(frames)
    assert isinstance(_ask(registry.address, announce(0)), RouteTable)
    assert eventually(lambda: registry.statistics().malformed == 3)
    assert hostile.poll(100) == 0  # garbage gets no answer


def test_a_registry_with_a_key_answers_only_signed_requests(
    make_registry: MakeRegistry, raw_socket: RawSocket
) -> None:
    auth = Authenticator(key=KEY)
    registry = make_registry(book_handler(RouteBook(REGISTRY_ORIGIN)), auth=auth)
    assert isinstance(_ask(registry.address, announce(0), auth=auth), RouteTable)
    intruder = raw_socket(zmq.DEALER, registry.address)
    intruder.send_multipart(codec.encode(route_query()))
    intruder.send_multipart(Authenticator(key=OTHER_KEY).sign(codec.encode(route_query()), unix_ms()))
    assert eventually(lambda: registry.statistics().unauthenticated == 2)
    assert intruder.poll(100) == 0
    assert registry.statistics().requests == 1
    with pytest.raises(ControlTimeoutError):  # and the client's side of it
        _ask(registry.address, route_query(), timeout_s=0.2, attempts=1)


def test_a_client_with_a_key_ignores_unsigned_replies(make_registry: MakeRegistry) -> None:
    registry = make_registry(book_handler(RouteBook(REGISTRY_ORIGIN)))  # answers without a tag
    with pytest.raises(ControlTimeoutError):
        _ask(registry.address, announce(0), timeout_s=0.3, attempts=1, auth=Authenticator(key=KEY))


def test_stop_is_idempotent_and_frees_the_port(make_registry: MakeRegistry) -> None:
    registry = make_registry(lambda message: None)
    port = int(registry.address.rsplit(":", 1)[1])
    assert registry.stop(timeout_s=5.0)
    assert registry.stop(timeout_s=5.0)
    assert not registry.running and not registry.statistics().running
    with pytest.raises(ChannelClosedError):
        registry.start()
    again = make_registry(lambda message: None, port=port)
    assert again.address == registry.address


def test_a_service_never_started_can_be_stopped() -> None:
    service = RegistryService(CODEC, lambda message: None)
    assert service.stop()
    assert not service.running


def test_context_manager_starts_and_stops() -> None:
    with RegistryService(CODEC, lambda message: message) as service:
        assert service.running
        assert _ask(service.address, heartbeat(3)) == heartbeat(3)
    assert not service.running


def test_request_argument_errors() -> None:
    with pytest.raises(ConfigError, match="attempts"):
        _ask("tcp://127.0.0.1:1", heartbeat(1), attempts=0)
    with pytest.raises(ConfigError, match="timeout_s"):
        _ask("tcp://127.0.0.1:1", heartbeat(1), timeout_s=0.0)
    with pytest.raises(ControlError, match="cannot dial"):
        _ask("no endpoint", heartbeat(1))


def test_a_reply_is_decoded_by_the_codec_not_trusted() -> None:
    # A "registry" that answers garbage first, then the real reply: the client skips the garbage.
    router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    result: list[Message] = []

    def client() -> None:
        result.append(_ask(f"tcp://127.0.0.1:{port}", heartbeat(8), timeout_s=10.0, attempts=1))

    thread = threading.Thread(target=client)
    thread.start()
    try:
        assert router.poll(10_000)
        routing_id, *_ = router.recv_multipart()
        router.send_multipart([routing_id, b"not a message"])
        router.send_multipart([routing_id, *codec.encode(heartbeat(9))])
    finally:
        thread.join(15.0)
        router.close(linger=0)
    assert result == [heartbeat(9)]


def test_a_reply_to_a_client_that_left_is_counted_as_dropped(
    make_registry: MakeRegistry, raw_socket: RawSocket
) -> None:
    arrived, left = threading.Event(), threading.Event()

    def echo_after_the_client_left(message: Message) -> Message | None:
        if message == heartbeat(1):
            arrived.set()
            left.wait(10.0)
        return message

    registry = make_registry(echo_after_the_client_left)
    client = raw_socket(zmq.DEALER, registry.address)
    client.send_multipart(codec.encode(heartbeat(1)))
    assert arrived.wait(10.0)
    client.close(linger=0)
    time.sleep(0.2)  # let the service's I/O thread see the disconnect before the reply goes out
    left.set()
    assert eventually(lambda: registry.statistics().dropped_replies == 1)
    assert _ask(registry.address, heartbeat(2)) == heartbeat(2)
    assert eventually(lambda: registry.statistics().replies == 1)
