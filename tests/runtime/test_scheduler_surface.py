"""The scheduler surface of the real transports (zmq control, loopback bytes): typed errors at every
call with nothing half-created, poll before init, close and start lifecycles, registry timeouts,
and one failing message that never costs the others."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest

from pdkv.engine.loopback import LoopbackBackend, LoopbackFabric
from pdkv.errors import (
    InvalidArgumentError,
    MappingError,
    PdkvError,
    RegistryError,
    RouteUnavailableError,
    TransportClosedError,
)
from pdkv.mapping import BufferKind
from pdkv.protocol.effects import ReleaseKind
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.messages import (
    Heartbeat,
    Message,
    Origin,
    RankCoord,
    RankRoute,
    RouteTable,
    StateIndices,
)
from pdkv.protocol.poll import KVPoll
from pdkv.runtime import Registry
from pdkv.runtime._loop import ControlLoop
from pdkv.runtime.decode import DecodeConfig, DecodeTransport
from pdkv.runtime.prefill import PrefillConfig, PrefillTransport
from pdkv.testing.cluster import free_port
from pdkv.testing.faults import ChannelFaults, MessageRule
from pdkv.testing.synthetic import Capacity, RankMemory, verify_room
from tests.runtime.rig import SPEC, TIMEOUTS, Rig, wait_for
from tests.runtime.stub_channel import StubChannel

ROOM = RoomId(77)


def _ready_room(s: Rig, prefill: InstanceId, room: RoomId, pages: int) -> Any:
    receiver = s.decode.receiver(room, prefill)
    receiver.init(np.arange(10, 10 + pages), 1)
    sender = s.prefills[0].sender(room)
    sender.init(pages, 2)
    wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    return sender, receiver


def test_poll_before_init_is_bootstrapping_on_both_transports(rig_factory: Callable[..., Rig]) -> None:
    s = rig_factory()
    prefill = s.start_registered()
    assert s.prefills[0].sender(ROOM).poll() is KVPoll.Bootstrapping
    receiver = s.decode.receiver(ROOM, prefill)
    assert receiver.poll() is KVPoll.Bootstrapping
    assert receiver.failure() is None


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda x: x.send([-1, 2], start_token=0, last=True), "chunk_pages"),
        (lambda x: x.send([1.0, 2.0], start_token=0, last=True), "chunk_pages"),
        (lambda x: x.send([[1], [2]], start_token=0, last=True), "chunk_pages"),
        (lambda x: x.send("12", start_token=0, last=True), "chunk_pages"),
        (lambda x: x.send(None, start_token=0, last=True), "chunk_pages"),
        (lambda x: x.send([1, 2], start_token=0, last="yes"), "last"),
        (lambda x: x.send([1, 2], start_token="0", last=True), "start_token"),
        (
            lambda x: x.send([1, 2], start_token=0, last=True, state_indices=[(BufferKind.INDEX_K, [1])]),
            "state_indices",
        ),
        (
            lambda x: x.send(
                [1, 2],
                start_token=0,
                last=True,
                state_indices=[
                    StateIndices(kind=k, indices=[1]) for k in (*SPEC.state_kinds, *SPEC.state_kinds)
                ],
            ),
            "state_indices",
        ),
        (
            lambda x: x.send(
                [1, 2],
                start_token=0,
                last=False,
                state_indices=[StateIndices(kind=SPEC.state_kinds[0], indices=[1])],
            ),
            "state_indices",
        ),
    ],
)
def test_bad_send_arguments_name_room_argument_and_value(
    rig_factory: Callable[..., Rig], call: Callable[[Any], None], argument: str
) -> None:
    s = rig_factory()
    prefill = s.start_registered()
    sender, receiver = _ready_room(s, prefill, ROOM, 2)
    with pytest.raises(InvalidArgumentError, match=f"room {ROOM}: {argument}") as info:
        call(sender)
    assert info.value.argument == argument and info.value.room == ROOM
    # Nothing was queued: the correct chunk then completes the room.
    sender.send([1, 2], start_token=0, last=True)
    wait_for(lambda: receiver.poll() is KVPoll.Success)


def test_bad_receiver_init_creates_nothing_and_can_be_retried(rig_factory: Callable[..., Rig]) -> None:
    s = rig_factory()
    prefill = s.start_registered()
    receiver = s.decode.receiver(ROOM, prefill)
    with pytest.raises(InvalidArgumentError, match=f"room {ROOM}: aux_row"):
        receiver.init(np.arange(2), -1)
    with pytest.raises(MappingError, match="dst_pages repeats ids"):
        receiver.init([5, 5, 5, 5], 1)
    with pytest.raises(InvalidArgumentError, match="state_indices"):
        receiver.init([5, 6], 1, [StateIndices(kind=k, indices=[99]) for k in SPEC.state_kinds])
    assert receiver.poll() is KVPoll.Bootstrapping
    receiver.init([5, 6], 1)  # the same room, corrected
    sender = s.prefills[0].sender(ROOM)
    sender.init(2, 0)
    wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.send([3, 4], start_token=0, last=True)
    wait_for(lambda: receiver.poll() is KVPoll.Success)


@pytest.mark.parametrize("room", [0, -1, 2**63, None, "5", True, 1.0])
def test_room_ids_are_checked_where_they_enter(rig_factory: Callable[..., Rig], room: object) -> None:
    s = rig_factory()
    prefill = s.start()
    with pytest.raises(InvalidArgumentError, match="room id"):
        s.prefills[0].sender(room)  # type: ignore[arg-type]  # on purpose
    with pytest.raises(InvalidArgumentError, match="room id"):
        s.decode.receiver(room, prefill)  # type: ignore[arg-type]  # on purpose


def test_a_gapped_chunk_sequence_never_reports_success(rig_factory: Callable[..., Rig]) -> None:
    s = rig_factory()
    prefill = s.start_registered()
    sender, receiver = _ready_room(s, prefill, ROOM, 8)
    sender.send([0, 1, 2], start_token=0, last=False)
    with pytest.raises(MappingError, match=r"leaves positions 3\.\.3 unwritten"):
        sender.send([4, 5, 6, 7], start_token=4 * SPEC.page_size, last=True)
    with pytest.raises(MappingError, match="short of num_pages 8"):
        sender.send([3, 4], start_token=3 * SPEC.page_size, last=True)
    sender.abort("scheduler noticed")
    wait_for(lambda: receiver.poll() is KVPoll.Failed)
    wait_for(receiver.release_ready)


def test_close_fails_open_rooms_tells_peers_and_refuses_later_calls(rig_factory: Callable[..., Rig]) -> None:
    s = rig_factory()
    prefill = s.start_registered()
    sender, receiver = _ready_room(s, prefill, ROOM, 2)
    s.prefills[0].close()
    wait_for(lambda: receiver.poll() is KVPoll.Failed)
    assert "prefill transport closed" in str(receiver.failure() or "")
    assert sender.poll() is KVPoll.Failed
    calls: list[Callable[[], object]] = [
        lambda: sender.send([1, 2], start_token=0, last=True),
        lambda: s.prefills[0].sender(RoomId(5)).init(1, None),
        lambda: s.prefills[0].sender(RoomId(6)),
        lambda: s.prefills[0].per_layer.register(RoomId(5), [1], start_token=0),
        lambda: s.prefills[0].start(),
    ]
    for call in calls:
        with pytest.raises(TransportClosedError, match="closed"):
            call()
    # Seams issue, item 10: these answered as if nothing happened (True, a full timeout, accepted).
    with pytest.raises(TransportClosedError, match="wait_progress"):
        s.prefills[0].wait_progress(s.prefills[0].progress(), 5.0)
    with pytest.raises(TransportClosedError, match="on_layer_end"):
        s.prefills[0].per_layer.on_layer_end(0)
    s.decode.close()
    with pytest.raises(TransportClosedError, match="wait_registered"):
        s.decode.wait_registered(prefill, timeout_s=5.0)
    with pytest.raises(TransportClosedError, match="wait_progress"):
        s.decode.wait_progress(s.decode.progress(), 5.0)
    with pytest.raises(TransportClosedError):
        s.decode.receiver(RoomId(8), prefill)
    with pytest.raises(TransportClosedError):
        s.decode.connect(s.registry.address, timeout_s=1)
    with pytest.raises(TransportClosedError):
        s.decode.start()


@pytest.mark.parametrize("abort_delay_s", [0.0, 0.3])
def test_a_closing_prefill_answers_the_aborts_of_the_rooms_it_failed(
    rig_factory: Callable[..., Rig], abort_delay_s: float
) -> None:
    """The decode told a room failed by the prefill's close answers with an Abort; its AbortAck (no
    write of the room in flight) gives the pages back proven. A prefill that stopped answering as
    soon as its writes ended left the room waiting for the ack timeout, then in quarantine, and a
    decode closing meanwhile with its memory registered for good: about half the time with no delay
    (the Abort raced the stop), every time with the Abort 0.3 s on its way."""
    delay = (MessageRule(message="Abort"),) if abort_delay_s else ()
    s = rig_factory(decode_channel_faults=ChannelFaults(delay=delay, delay_s=abort_delay_s))
    prefill = s.start_registered()
    _, receiver = _ready_room(s, prefill, ROOM, 2)
    s.prefills[0].close()
    wait_for(lambda: receiver.poll() is KVPoll.Failed)
    assert "prefill transport closed" in str(receiver.failure() or "")
    wait_for(receiver.release_ready)  # 20 s at most: the ack timeout (5 s) and quarantine fit in it
    assert receiver.release_kind() is ReleaseKind.ACKED
    assert sum(c.delayed for c in s.decode_channels) == (1 if abort_delay_s else 0)
    s.decode.close()
    assert not s.decode.stuck_writes


def test_a_closing_prefill_waits_one_heartbeat_interval_for_an_abort_that_never_comes(
    rig_factory: Callable[..., Rig],
) -> None:
    """A decode rank that does not answer (here every Abort it sends is lost) holds a closing prefill
    for one heartbeat interval, not for the ack timeout; its room then takes the ack-timeout path."""
    beats = attrs.evolve(TIMEOUTS, heartbeat_interval=0.5)
    lost = ChannelFaults(drop=(MessageRule(message="Abort"),))
    s = rig_factory(decode_channel_faults=lost, timeouts=beats)
    prefill = s.start_registered()
    _, receiver = _ready_room(s, prefill, ROOM, 2)
    started = time.monotonic()
    s.prefills[0].close()
    waited = time.monotonic() - started
    assert beats.heartbeat_interval <= waited < beats.abort_ack, waited
    assert sum(c.dropped for c in s.decode_channels) >= 1
    wait_for(lambda: receiver.poll() is KVPoll.Failed)
    assert not receiver.release_ready()  # no ack came: it waits for the ack timeout, then quarantine
    s.decode.close(timeout_s=0.1)


def test_a_scheduler_blocked_in_wait_progress_is_woken_by_close_and_told(
    rig_factory: Callable[..., Rig],
) -> None:
    s = rig_factory()
    s.start_registered()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            s.decode.wait_progress(s.decode.progress(), 30.0)
        except TransportClosedError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    started = time.monotonic()
    s.decode.close()
    waiter.join(10.0)
    assert not waiter.is_alive() and time.monotonic() - started < 10.0
    assert len(errors) == 1


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, "5", True])
def test_every_duration_argument_is_checked_before_anything_changes(
    rig_factory: Callable[..., Rig], bad: object
) -> None:
    """Seams issue, item 11: start(announce_timeout_s=nan) never returned; close(timeout_s=nan) logged
    a false "transfers still running" and kept memory registered."""
    s = rig_factory()
    prefill = s.start_registered()
    calls: list[tuple[str, Callable[[], object]]] = [
        ("announce_timeout_s", lambda: s.prefills[0].start(announce_timeout_s=bad)),  # type: ignore[arg-type]  # the bad value under test
        ("timeout_s", lambda: s.prefills[0].close(timeout_s=bad)),  # type: ignore[arg-type]  # the same
        ("timeout_s", lambda: s.decode.close(timeout_s=bad)),  # type: ignore[arg-type]  # the same
        ("timeout_s", lambda: s.decode.connect(s.registry.address, timeout_s=bad)),  # type: ignore[arg-type]  # the same
        ("timeout_s", lambda: s.decode.wait_registered(prefill, timeout_s=bad)),  # type: ignore[arg-type]  # the same
        ("timeout_s", lambda: s.decode.wait_progress(0, bad)),  # type: ignore[arg-type]  # the same
    ]
    for argument, call in calls:
        with pytest.raises(
            InvalidArgumentError, match=f"{argument} must be a finite number of seconds"
        ) as info:
            call()
        assert info.value.argument == argument
    sender, receiver = _ready_room(s, prefill, ROOM, 2)  # nothing was closed or broken by them
    sender.send([1, 2], start_token=0, last=True)
    wait_for(lambda: receiver.poll() is KVPoll.Success)


@pytest.mark.parametrize(
    "registry", ["not a url", 8998, "tcp://127.0.0.1", "tcp://127.0.0.1:0", "http://h:1"]
)
def test_a_registry_that_is_not_an_address_is_refused_at_once(
    rig_factory: Callable[..., Rig], registry: object
) -> None:
    s = rig_factory()
    s.start()
    started = time.monotonic()
    with pytest.raises(InvalidArgumentError, match="registry must be"):
        s.decode.connect(registry, timeout_s=30)  # type: ignore[arg-type]  # the bad value under test
    assert time.monotonic() - started < 5.0  # at once, not after the 30 s of retries


def test_decode_close_fails_its_rooms_and_the_prefill_hears_of_it(rig_factory: Callable[..., Rig]) -> None:
    s = rig_factory()
    prefill = s.start_registered()
    sender, receiver = _ready_room(s, prefill, ROOM, 2)
    s.decode.close()
    assert receiver.poll() is KVPoll.Failed
    assert not s.decode.stuck_writes  # the prefill acknowledged: memory could go
    wait_for(lambda: sender.poll() is KVPoll.Failed)
    assert "decode transport closed" in str(sender.failure() or "")


def _prefill_alone(registry: str) -> tuple[PrefillTransport, LoopbackBackend]:
    memory = RankMemory(SPEC, Capacity(kv_pages=8, state_slots=2, aux_rows=2))
    backend = LoopbackBackend(fabric=LoopbackFabric("alone"))
    config = PrefillConfig(
        instance=InstanceId("p"),
        rank=RankCoord(tp=0),
        tp_size=1,
        layout=memory.layout,
        registry=registry,
        timeouts=TIMEOUTS,
    )
    return PrefillTransport(config, backend), backend


def test_a_failed_start_rolls_back_and_can_be_retried() -> None:
    port = free_port()
    transport, backend = _prefill_alone(f"tcp://127.0.0.1:{port}")
    before = threading.active_count()
    try:
        with pytest.raises(RouteUnavailableError, match=r"within 0\.5 s"):
            transport.start(announce_timeout_s=0.5)
        assert backend.statistics().registrations == 0  # rolled back
        wait_for(lambda: threading.active_count() <= before, timeout=5)  # no thread left behind
        from pdkv.runtime.channels import start_registry

        registry = start_registry(instance=InstanceId("p"), tp_size=1, cp_size=1, port=port)
        decode_memory = RankMemory(SPEC, Capacity(kv_pages=8, state_slots=2, aux_rows=2))
        decode_backend = LoopbackBackend(fabric=LoopbackFabric("alone"))
        decode = DecodeTransport(
            DecodeConfig(
                instance=InstanceId("d"), rank=RankCoord(tp=0), tp_size=1, layout=decode_memory.layout
            ),
            decode_backend,
        )
        try:
            transport.start(announce_timeout_s=10)
            assert backend.statistics().registrations > 0
            # The retried start serves: its new control thread receives (seams issue, item 9: it
            # used to log ChannelOwnershipError about 100 times a second and answer nothing).
            decode.start()
            prefill = decode.connect(registry.address, timeout_s=10)
            assert decode.wait_registered(prefill, timeout_s=10)
            assert transport._loop.handler_errors == 0
        finally:
            decode.close(timeout_s=2)
            decode_backend.close()
            transport.close()
            registry.stop()
    finally:
        transport.close()
        backend.close()


def test_connect_to_a_dead_registry_raises_route_unavailable_with_the_cause() -> None:
    memory = RankMemory(SPEC, Capacity(kv_pages=8, state_slots=2, aux_rows=2))
    backend = LoopbackBackend(fabric=LoopbackFabric("dead"))
    config = DecodeConfig(instance=InstanceId("d"), rank=RankCoord(tp=0), tp_size=1, layout=memory.layout)
    with (
        DecodeTransport(config, backend) as decode,
        pytest.raises(RouteUnavailableError, match=r"within 0\.5 s: no reply from"),
    ):
        decode.connect(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.5)
    backend.close()


@pytest.mark.parametrize(
    ("registry_key", "decode_key", "says"),
    [
        ("a" * 16, "b" * 16, "PDKV_AUTH_KEY is set here but the peer's key differs or is unset"),
        ("a" * 16, None, "the peer may require PDKV_AUTH_KEY, which is not set here"),
        (None, "b" * 16, "PDKV_AUTH_KEY is set here but the peer's key differs or is unset"),
    ],
)
def test_a_registry_with_another_auth_key_is_named_in_the_error(
    monkeypatch: pytest.MonkeyPatch, registry_key: str | None, decode_key: str | None, says: str
) -> None:
    """Seams issue, item 13: the registry dropped requests it could not authenticate, so the client
    timed out with nothing about the key. It now answers them with a refusal the client cannot verify."""
    from pdkv.runtime.channels import start_registry

    def key(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("PDKV_AUTH_KEY", raising=False)
        else:
            monkeypatch.setenv("PDKV_AUTH_KEY", value)

    key(registry_key)
    registry = start_registry(instance=InstanceId("p"), tp_size=1, cp_size=1)
    key(decode_key)
    memory = RankMemory(SPEC, Capacity(kv_pages=8, state_slots=2, aux_rows=2))
    backend = LoopbackBackend(fabric=LoopbackFabric("keys"))
    config = DecodeConfig(instance=InstanceId("d"), rank=RankCoord(tp=0), tp_size=1, layout=memory.layout)
    try:
        with DecodeTransport(config, backend) as decode, pytest.raises(RouteUnavailableError, match=says):
            decode.connect(registry.address, timeout_s=0.3)  # an unverifiable refusal: waits it out
    finally:
        registry.stop()
        backend.close()


def test_fanout_targets_follow_a_route_table_that_connect_replaced() -> None:
    # The targets are derived once per table (every room from one instance targets the same ranks);
    # a prefill instance that came back with another shape must not be served the old ones.
    memory = RankMemory(SPEC, Capacity(kv_pages=8, state_slots=2, aux_rows=2))
    prefill = Origin(instance=InstanceId("p"), epoch=Epoch(1), rank=RankCoord(tp=0))

    def table(tp_size: int) -> RouteTable:
        return RouteTable(
            origin=prefill,
            tp_size=tp_size,
            cp_size=1,
            page_size=SPEC.page_size,
            layout_digest=memory.layout.digest(),
            ranks=[
                RankRoute(
                    rank=RankCoord(tp=tp),
                    epoch=Epoch(1),
                    endpoint=Endpoint(f"tcp://127.0.0.1:{free_port()}"),
                    session=SessionId(f"s{tp}"),
                )
                for tp in range(tp_size)
            ],
            complete=True,
        )

    tables = [table(1), table(2)]
    backend = LoopbackBackend(fabric=LoopbackFabric("fanout"))
    config = DecodeConfig(instance=InstanceId("d"), rank=RankCoord(tp=0), tp_size=1, layout=memory.layout)
    with DecodeTransport(config, backend, query=lambda registry, query, timeout_s: tables.pop(0)) as decode:
        instance = decode.connect("registry")
        first, required = decode.fanout_targets(instance)
        assert [t.rank for t in first] == [RankCoord(tp=0)] and required == 1
        assert decode.fanout_targets(instance)[0] is first  # derived once for this table
        assert decode.connect("registry") == instance  # the instance now runs TP 2
        second, _ = decode.fanout_targets(instance)
        assert [t.rank for t in second] == [RankCoord(tp=0), RankCoord(tp=1)]
    backend.close()


def test_one_failing_message_never_costs_the_rest_of_its_batch() -> None:
    origin = Origin(instance=InstanceId("x"), epoch=Epoch(1), rank=RankCoord(tp=0))
    batch: list[Message] = [Heartbeat(origin=origin, seq=k) for k in range(5)]
    handled: list[int] = []

    def on_message(message: Message, now: float) -> None:
        assert isinstance(message, Heartbeat)
        if message.seq == 1:
            raise PdkvError("a handler bug")
        handled.append(message.seq)

    loop = ControlLoop(StubChannel(batch), name="t", on_message=on_message, on_tick=lambda now: None)
    loop.start()
    try:
        wait_for(lambda: len(handled) == 4, timeout=5)
    finally:
        loop.stop()
    assert handled == [0, 2, 3, 4] and loop.handler_errors == 1


def test_the_public_registry_learns_the_shape_and_serves_a_decode() -> None:
    with Registry("p") as registry:
        transport, backend = _prefill_alone(registry.address)
        memory = RankMemory(SPEC, Capacity(kv_pages=8, state_slots=2, aux_rows=2))
        decode_backend = LoopbackBackend(fabric=LoopbackFabric("alone"))
        config = DecodeConfig(instance=InstanceId("d"), rank=RankCoord(tp=0), tp_size=1, layout=memory.layout)
        try:
            transport.start(announce_timeout_s=10)  # tp/cp were not given: taken from this rank
            with DecodeTransport(config, decode_backend) as decode:
                assert decode.connect(registry.address, timeout_s=10) == InstanceId("p")
                assert decode.wait_registered(InstanceId("p"), timeout_s=10)
        finally:
            transport.close()
            backend.close()
            decode_backend.close()


def test_pdkv_registry_runs_standalone_until_stopped() -> None:
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdkv", "registry", "--instance", "p", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"pdkv registry of instance 'p' at tcp://127.0.0.1:{port}"
        transport, backend = _prefill_alone(f"tcp://127.0.0.1:{port}")
        try:
            transport.start(announce_timeout_s=10)  # announced to the standalone registry
        finally:
            transport.close()
            backend.close()
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_a_fatal_registry_refusal_is_raised_at_once_not_retried_until_the_timeout() -> None:
    with Registry("p", tp_size=2) as registry:  # the instance is TP 2; this rank says TP 1
        transport, backend = _prefill_alone(registry.address)
        try:
            with pytest.raises(RegistryError, match="tp_size") as refused:
                transport.start(announce_timeout_s=60)  # a refusal is not silence: no retry
            assert refused.value.peer == registry.address  # the error names who refused
            assert backend.statistics().registrations == 0  # rolled back
        finally:
            transport.close()
            backend.close()


def test_a_decode_prefix_is_never_written_and_the_rest_lands_byte_for_byte_under_cp(
    rig_factory: Callable[..., Rig],
) -> None:
    s = rig_factory(cp=2)
    prefill = s.start_registered()
    logical = np.array([9, 4, 13, 6, 7, 20], dtype=np.int64)
    dst = np.array([60, 61, 62, 63, 64, 65], dtype=np.int64)
    for key in SPEC.kv_keys():
        s.decode_memory[0].view(key)[dst] = 0
    receiver = s.decode.receiver(ROOM, prefill)
    receiver.init(dst, None, prefix_pages=2)  # the decode's prefix cache holds positions 0 and 1
    senders = [p.sender(ROOM) for p in s.prefills]
    for sender in senders:
        sender.init(len(logical), None)
    wait_for(lambda: all(x.poll() is KVPoll.WaitingForInput for x in senders))
    assert [x.decode_prefix_pages() for x in senders] == [2, 2]
    for sender in senders:  # the scheduler starts where the decode's prefix ends
        sender.send(logical[2:4], start_token=2 * SPEC.page_size, last=False)
        sender.send(logical[4:], start_token=4 * SPEC.page_size, last=True)
    wait_for(lambda: receiver.poll() is KVPoll.Success)
    checked, mismatches = verify_room(
        s.decode_memory[0],
        logical_ids=logical,
        dst_pages=dst,
        prefix_pages=2,  # positions 0 and 1 must be untouched (zero)
        state_src={},
        state_dst={},
        aux_src=None,
        aux_dst=None,
    )
    assert mismatches == [] and checked > 0
