"""NixlBackend against a fake agent: peer metadata, planning by memory kind, failures, cuts, closing.

The real agent runs in tests/integration/test_nixl_backend.py (conformance over both UCX transports) and
tests/integration/test_nixl_faults.py; here the agent is a stand-in that records every call and
answers what a test chose, so each rule of the backend is checked without UCX.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

import attrs
import msgpack
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.engine import BackendClosedError, BatchStatus, NixlBackend, NixlConfig, PeerMetadataError
from pdkv.engine.nixl import (
    NixlAgentApi,
    NixlMemory,
    XferHandle,
    decode_peer_metadata,
    encode_peer_metadata,
    load_nixl,
    memory_of,
)
from pdkv.engine.sockets import ConnectionCutUnavailableError
from pdkv.errors import ConfigError, EngineUnavailableError
from pdkv.mapping import TransferBlocks
from pdkv.testing.backend_conformance import HostBuffer

PEER = "10.0.0.2:pdkv-7-peer"


class nixlRemoteDisconnectError(Exception):  # named as NIXL names it: the backend reads the name
    pass


@attrs.define(eq=False)
class FakeHandle:
    agent: FakeAgent
    local: Any
    remote: Any
    peer: str
    released: bool = False

    def release(self) -> None:
        self.released = True
        self.agent.calls.append(("release",))


@attrs.define
class FakeAgent:
    """Records calls; ``post_states`` / ``check_states`` are consumed per call (default DONE)."""

    name: str = ""
    post_states: list[str | Exception] = attrs.Factory(list)
    check_states: list[str | Exception] = attrs.Factory(list)
    notifications: list[dict[str, list[bytes]]] = attrs.Factory(list)
    load_error: Exception | None = None
    calls: list[tuple[object, ...]] = attrs.Factory(list)
    handles: list[FakeHandle] = attrs.Factory(list)
    env_at_start: dict[str, str] = attrs.Factory(dict)

    def create_backend(self, backend: str, initParams: dict[str, str]) -> None:
        self.calls.append(("create_backend", backend, dict(initParams)))

    def register_memory(self, reg_list: list[tuple[int, int, int, str]], mem_type: str) -> object:
        self.calls.append(("register", tuple(reg_list), mem_type))
        return ("reg", tuple(reg_list))

    def deregister_memory(self, dereg_list: object) -> None:
        self.calls.append(("deregister", dereg_list))

    def get_agent_metadata(self) -> bytes:
        return b"nixl-md-of-" + self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.calls.append(("add_remote", metadata))
        if self.load_error is not None:
            raise self.load_error
        return metadata

    def remove_remote_agent(self, agent: str) -> None:
        self.calls.append(("remove_remote", agent))

    def get_xfer_descs(self, descs: npt.NDArray[np.uint64], mem_type: str) -> object:
        return (mem_type, descs.copy())

    def initialize_xfer(
        self, operation: str, local_descs: object, remote_descs: object, remote_agent: str, notif_msg: bytes
    ) -> FakeHandle:
        self.calls.append(("xfer", operation, remote_agent, notif_msg))
        handle = FakeHandle(self, local_descs, remote_descs, remote_agent)
        self.handles.append(handle)
        return handle

    def _next(self, states: list[str | Exception]) -> str:
        state = states.pop(0) if states else "DONE"
        if isinstance(state, Exception):
            raise state
        return state

    def transfer(self, handle: XferHandle) -> str:
        self.calls.append(("post",))
        return self._next(self.post_states)

    def check_xfer_state(self, handle: XferHandle) -> str:
        self.calls.append(("check",))
        return self._next(self.check_states)

    def get_new_notifs(self) -> Mapping[str, Sequence[bytes]]:
        return self.notifications.pop(0) if self.notifications else {}

    def send_notif(self, *_: object) -> None:  # a standalone notification can abort UCX: never sent
        raise AssertionError("NixlBackend must never send a standalone notification")

    def names(self) -> list[object]:
        return [c[0] for c in self.calls]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@attrs.define
class Made:
    backend: NixlBackend
    agent: FakeAgent


@pytest.fixture
def make() -> Iterator[Any]:
    made: list[NixlBackend] = []

    def build(
        agent: FakeAgent | None = None,
        *,
        clock: FakeClock | None = None,
        memory_kind: Any = None,
        **config: Any,
    ) -> Made:
        fake = agent or FakeAgent()

        def factory(name: str, cfg: NixlConfig) -> NixlAgentApi:
            fake.name = name
            fake.env_at_start = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))}
            fake.create_backend("UCX", {"num_workers": "1"})
            return fake

        kwargs: dict[str, Any] = {"agent_factory": factory}
        if clock is not None:
            kwargs.update(clock=clock, sleep=clock.sleep)
        if memory_kind is not None:
            kwargs["memory_kind"] = memory_kind
        backend = NixlBackend(NixlConfig(hostname="10.0.0.1", **config), **kwargs)
        made.append(backend)
        return Made(backend, fake)

    yield build
    for backend in made:
        backend.close()


def peer_metadata(regions: list[tuple[int, int, NixlMemory, int]], agent: str = PEER) -> bytes:
    return encode_peer_metadata(agent, b"nixl-md-of-" + agent.encode(), regions)


def blocks(src: list[int], dst: list[int], length: list[int]) -> TransferBlocks:
    return TransferBlocks(src=src, dst=dst, length=length, buffer=[0] * len(src))


# ------------------------------------------------------------------------------- peer metadata


def test_metadata_round_trips_and_sorts_regions() -> None:
    regions = [(0x9000, 4096, NixlMemory.VRAM, 3), (0x1000, 4096, NixlMemory.DRAM, 0)]
    decoded = decode_peer_metadata(peer_metadata(regions))
    assert decoded.agent == PEER and decoded.nixl == b"nixl-md-of-" + PEER.encode()
    assert decoded.regions.starts.tolist() == [0x1000, 0x9000]
    assert decoded.regions.ends.tolist() == [0x2000, 0xA000]
    assert decoded.regions.vram.tolist() == [False, True]
    assert decoded.regions.devices.tolist() == [0, 3]


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (b"", "empty"),
        (b"\xc1", "not msgpack"),
        (msgpack.packb([1, 2]), "expected keys"),
        (msgpack.packb({"v": 2, "agent": "a", "nixl": b"x", "regions": []}), "version 2"),
        (msgpack.packb({"v": True, "agent": "a", "nixl": b"x", "regions": []}), "version True"),
        (msgpack.packb({"v": 1, "agent": "", "nixl": b"x", "regions": []}), "agent must be"),
        (msgpack.packb({"v": 1, "agent": "a", "nixl": "x", "regions": []}), "nixl must be"),
        (msgpack.packb({"v": 1, "agent": "a", "nixl": b"x", "regions": [[1, 2, 3]]}), "region 0 must be"),
        (msgpack.packb({"v": 1, "agent": "a", "nixl": b"x", "regions": [[0, 8, "DRAM", 0]]}), "address 0"),
        (msgpack.packb({"v": 1, "agent": "a", "nixl": b"x", "regions": [[8, 8, "HBM", 0]]}), "kind 'HBM'"),
        (
            msgpack.packb(
                {"v": 1, "agent": "a", "nixl": b"x", "regions": [[8, 8, "DRAM", 0], [12, 8, "DRAM", 0]]}
            ),
            "overlap",
        ),
    ],
)
def test_malformed_metadata_is_a_typed_error(blob: bytes, reason: str) -> None:
    with pytest.raises(PeerMetadataError, match=reason):
        decode_peer_metadata(blob)


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.sampled_from(["DRAM", "VRAM", "", "a"])
    | st.binary(max_size=5)
)
_NEAR_VALID = st.fixed_dictionaries(
    {
        "v": st.just(1) | _SCALARS,
        "agent": st.just("peer") | _SCALARS,
        "nixl": st.just(b"md") | _SCALARS,
        "regions": st.lists(st.lists(_SCALARS, max_size=5) | _SCALARS, max_size=4),
    }
)
_BLOBS = (
    st.binary(max_size=64)
    | _NEAR_VALID.map(msgpack.packb)
    | st.lists(_SCALARS, max_size=3).map(msgpack.packb)
)


@settings(max_examples=300)
@given(blob=_BLOBS)
def test_any_blob_decodes_or_raises_peer_metadata_error(blob: bytes) -> None:
    """Remote input: a decoded blob or PeerMetadataError, never another exception."""
    try:
        decoded = decode_peer_metadata(blob)
    except PeerMetadataError:
        return
    assert decoded.agent and decoded.nixl
    assert bool(np.all(decoded.regions.ends > decoded.regions.starts))


def test_add_peer_checks_the_session_and_remembers_a_refusal(make: Any) -> None:
    made = make()
    with pytest.raises(PeerMetadataError, match="names agent 'someone-else'"):
        made.backend.add_peer(PEER, peer_metadata([], agent="someone-else"))
    made.agent.load_error = RuntimeError("NIXL_ERR_BACKEND")
    with pytest.raises(PeerMetadataError, match="NIXL refused the metadata"):
        made.backend.add_peer(PEER, peer_metadata([(0x1000, 64, NixlMemory.DRAM, 0)]))
    assert made.backend.peers() == []
    source = HostBuffer(64)
    made.backend.register(source)
    outcome = made.backend.wait(
        [made.backend.submit_write(PEER, blocks([source.data_ptr()], [0x1000], [8]))], 5
    )
    (only,) = outcome.outcomes
    assert only.status is BatchStatus.FAILED and "engine metadata was refused" in only.reason
    assert "NIXL_ERR_BACKEND" in only.reason


def test_engine_metadata_lists_the_regions_and_follows_registration(make: Any) -> None:
    made = make()
    first = decode_peer_metadata(made.backend.engine_metadata)
    assert first.agent == made.backend.session_id and len(first.regions) == 0
    assert made.backend.session_id.startswith("10.0.0.1:pdkv-")
    buffer = HostBuffer(4096)
    registration = made.backend.register(buffer)
    second = decode_peer_metadata(made.backend.engine_metadata)
    assert second.regions.starts.tolist() == [buffer.data_ptr()] and second.regions.vram.tolist() == [False]
    registration.close()
    assert len(decode_peer_metadata(made.backend.engine_metadata).regions) == 0
    assert ("deregister", ("reg", ((buffer.data_ptr(), 4096, 0, ""),))) in made.agent.calls


# --------------------------------------------------------------------------------- writes


def test_destination_outside_the_peer_regions_fails_before_nixl_sees_it(make: Any) -> None:
    made = make()
    made.backend.add_peer(PEER, peer_metadata([(0x10000, 4096, NixlMemory.DRAM, 0)]))
    source = HostBuffer(64)
    made.backend.register(source)
    batch = blocks([source.data_ptr()] * 2, [0x10000, 0x10000 + 4090], [16, 16])
    (outcome,) = made.backend.wait([made.backend.submit_write(PEER, batch)], 5).outcomes
    assert outcome.status is BatchStatus.FAILED
    assert "block 1 of 2" in outcome.reason and "not inside a region" in outcome.reason
    assert "xfer" not in made.agent.names()


def test_a_piece_becomes_one_write_per_memory_kind_pair(make: Any) -> None:
    host, gpu = HostBuffer(256), HostBuffer(256)

    def kind(address: int, keepalive: object) -> tuple[NixlMemory, int]:
        return (NixlMemory.VRAM, 2) if address == gpu.data_ptr() else (NixlMemory.DRAM, 0)

    made = make(memory_kind=kind)
    made.backend.register(host)
    made.backend.register(gpu)
    assert ("register", ((gpu.data_ptr(), 256, 2, ""),), "VRAM") in made.agent.calls
    made.backend.add_peer(
        PEER, peer_metadata([(0x1000, 4096, NixlMemory.DRAM, 0), (0x9000, 4096, NixlMemory.VRAM, 5)])
    )
    batch = blocks(
        [host.data_ptr(), gpu.data_ptr(), gpu.data_ptr() + 8, host.data_ptr() + 8],
        [0x1000, 0x1010, 0x9000, 0x9010],
        [8, 8, 8, 8],
    )
    made.backend.write(PEER, batch, timeout=5)
    writes = made.agent.handles
    kinds = {(h.local[0], h.remote[0]): (h.local[1].tolist(), h.remote[1].tolist()) for h in writes}
    assert len(writes) == 4
    assert kinds == {
        ("DRAM", "DRAM"): ([[host.data_ptr(), 8, 0]], [[0x1000, 8, 0]]),
        ("VRAM", "DRAM"): ([[gpu.data_ptr(), 8, 2]], [[0x1010, 8, 0]]),
        ("VRAM", "VRAM"): ([[gpu.data_ptr() + 8, 8, 2]], [[0x9000, 8, 5]]),
        ("DRAM", "VRAM"): ([[host.data_ptr() + 8, 8, 0]], [[0x9010, 8, 5]]),
    }
    assert all(h.released for h in writes)
    assert all(c[3] == b"pdkv" for c in made.agent.calls if c[0] == "xfer")  # every write notifies


def test_a_write_still_in_progress_after_the_timeout_is_released_and_failed(make: Any) -> None:
    clock = FakeClock()
    agent = FakeAgent(post_states=["PROC"], check_states=["PROC"] * 100_000)
    made = make(agent, clock=clock, transfer_timeout_s=2.0, completion_poll_max_s=0.25)
    made.backend.add_peer(PEER, peer_metadata([(0x1000, 4096, NixlMemory.DRAM, 0)]))
    source = HostBuffer(64)
    made.backend.register(source)
    start = clock.now
    (outcome,) = made.backend.wait(
        [made.backend.submit_write(PEER, blocks([source.data_ptr()], [0x1000], [8]))], None
    ).outcomes
    assert outcome.status is BatchStatus.FAILED
    assert "not complete after 2 s: released" in outcome.reason
    assert 2.0 <= clock.now - start <= 2.6  # the polls back off to 0.25 s, never past the bound by much
    assert agent.handles[0].released


@attrs.define
class ProgressingAgent(FakeAgent):
    """Posts stay in progress until the agent made progress after them through ``get_new_notifs`` (the
    progress thread's call), then end as ``ends_as``. In UCX any call into the agent makes progress;
    here only the progress thread's does, as when the peer's answer arrives after the completer's
    poll: whoever polls next sees the write end."""

    ends_as: str = "DONE"
    progressed: bool = True

    def transfer(self, handle: XferHandle) -> str:
        self.calls.append(("post",))
        self.progressed = False
        return "PROC"

    def check_xfer_state(self, handle: XferHandle) -> str:
        self.calls.append(("check",))
        return self.ends_as if self.progressed else "PROC"

    def get_new_notifs(self) -> Mapping[str, Sequence[bytes]]:
        self.progressed = True
        return {}


@pytest.mark.parametrize("ends_as", ["DONE", "ERR"])
def test_a_write_the_progress_thread_saw_end_is_reported_without_waiting_for_the_next_poll(
    make: Any, ends_as: str
) -> None:
    agent = ProgressingAgent(ends_as=ends_as)
    # The completer's own polls are 30 s apart: only the progress thread can bring the news in time.
    made = make(
        agent, completion_poll_s=30.0, completion_poll_max_s=30.0, idle_poll_s=0.001, busy_poll_s=0.001
    )
    made.backend.add_peer(PEER, peer_metadata([(0x1000, 4096, NixlMemory.DRAM, 0)]))
    source = HostBuffer(64)
    made.backend.register(source)
    handle = made.backend.submit_write(PEER, blocks([source.data_ptr()], [0x1000], [8]))
    (outcome,) = made.backend.wait([handle], 10).outcomes
    if ends_as == "DONE":
        assert outcome.ok
    else:
        assert outcome.status is BatchStatus.FAILED and "(ERR)" in outcome.reason
    assert agent.handles[0].released
    assert not made.backend._awaited  # nothing left for the progress thread to watch


def test_a_disconnect_fails_the_batch_and_the_next_write_reconnects(make: Any) -> None:
    agent = FakeAgent(
        check_states=[nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")], post_states=["PROC"]
    )
    made = make(agent)
    metadata = peer_metadata([(0x1000, 4096, NixlMemory.DRAM, 0)])
    made.backend.add_peer(PEER, metadata)
    source = HostBuffer(64)
    made.backend.register(source)
    batch = blocks([source.data_ptr()], [0x1000], [8])
    (first,) = made.backend.wait([made.backend.submit_write(PEER, batch)], 5).outcomes
    assert first.status is BatchStatus.FAILED and "REMOTE_DISCONNECT" in first.reason
    agent.calls.clear()
    made.backend.write(PEER, batch, timeout=5)
    # NIXL keeps the failed endpoint: the peer is removed, then loaded again (a new endpoint).
    assert agent.names()[:3] == ["remove_remote", "add_remote", "xfer"]
    assert made.backend.progress_statistics().reconnects == 1


def test_a_post_that_raises_fails_the_batch_and_the_lane_goes_on(make: Any) -> None:
    agent = FakeAgent(post_states=[RuntimeError("NIXL_ERR_BACKEND")])
    made = make(agent)
    made.backend.add_peer(PEER, peer_metadata([(0x1000, 4096, NixlMemory.DRAM, 0)]))
    source = HostBuffer(64)
    made.backend.register(source)
    batch = blocks([source.data_ptr()], [0x1000], [8])
    (bad,) = made.backend.wait([made.backend.submit_write(PEER, batch)], 5).outcomes
    assert bad.status is BatchStatus.FAILED and "NIXL_ERR_BACKEND" in bad.reason
    assert made.backend.write(PEER, batch, timeout=5).ok
    assert all(h.released for h in agent.handles)


def test_large_pieces_are_posted_by_the_lane_not_the_submitting_thread(make: Any) -> None:
    made = make(inline_max_bytes=1024)
    assert made.backend._inline_launch_allowed(blocks([1], [2], [1024]))
    assert not made.backend._inline_launch_allowed(blocks([1], [2], [1025]))


# ---------------------------------------------------------------------- settings and progress


def test_settings_reach_the_environment_before_the_agent_starts(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("UCX_TLS", "UCX_NET_DEVICES", "NIXL_LOG_LEVEL", "UCX_RNDV_SCHEME"):
        monkeypatch.delenv(name, raising=False)
    made = make(
        ucx_tls="tcp",
        ucx_net_devices="lo",
        log_level="ERROR",
        extra_environment={"UCX_RNDV_SCHEME": "put_zcopy"},
    )
    assert made.agent.env_at_start == {
        "UCX_TLS": "tcp",
        "UCX_NET_DEVICES": "lo",
        "NIXL_LOG_LEVEL": "ERROR",
        "UCX_RNDV_SCHEME": "put_zcopy",
    }


def test_config_refuses_foreign_settings_and_bad_numbers() -> None:
    with pytest.raises(ConfigError, match="UCX_\\* and NIXL_\\*"):
        NixlConfig(extra_environment={"MC_TRANSFER_TIMEOUT": "5"})
    with pytest.raises(ConfigError, match="error_handling"):
        NixlConfig(error_handling="sometimes")
    with pytest.raises(ConfigError, match="idle_poll_s"):
        NixlConfig(idle_poll_s=0)
    assert NixlConfig.from_env(
        {"PDKV_NIXL_UCX_TLS": "tcp", "PDKV_NIXL_TRANSFER_TIMEOUT": "7.5"}
    ) == NixlConfig(ucx_tls="tcp", transfer_timeout_s=7.5)


def test_notifications_make_the_progress_thread_poll_fast(make: Any) -> None:
    agent = FakeAgent(notifications=[{"peer": [b"pdkv"]}])
    made = make(agent, idle_poll_s=0.001, busy_poll_s=0.0005, busy_window_s=30.0)
    deadline = time.monotonic() + 5
    while made.backend.progress_statistics().busy_polls < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = made.backend.progress_statistics()
    assert stats.notifications == 1 and stats.busy_polls >= 3


def test_a_write_done_inside_its_post_leaves_the_progress_thread_idle(make: Any) -> None:
    # cma: the post moves the bytes before it returns (DONE), so nothing is left for the agent to
    # progress, and the thread must not spin for busy_window_s after it.
    made = make(idle_poll_s=0.02, busy_poll_s=0.0005, busy_window_s=30.0)
    source = HostBuffer(64)
    made.backend.register(source)
    made.backend.add_peer(PEER, peer_metadata([(0x1000, 4096, NixlMemory.DRAM, 0)]))
    for _ in range(3):
        made.backend.write(PEER, blocks([source.data_ptr()], [0x1000], [16]), timeout=5)
    time.sleep(0.3)
    stats = made.backend.progress_statistics()
    assert stats.busy_polls == 0 and stats.polls <= 30  # idle: about 15 polls at 50 a second


def test_a_write_still_moving_after_its_post_makes_the_progress_thread_poll_fast(make: Any) -> None:
    # tcp: the bytes move only while this agent is called; the progress thread helps the completer.
    agent = FakeAgent(post_states=["PROC"], check_states=["PROC"] * 40)
    made = make(agent, idle_poll_s=0.05, busy_poll_s=0.0005, busy_window_s=30.0, completion_poll_max_s=0.002)
    source = HostBuffer(64)
    made.backend.register(source)
    made.backend.add_peer(PEER, peer_metadata([(0x1000, 4096, NixlMemory.DRAM, 0)]))
    made.backend.write(PEER, blocks([source.data_ptr()], [0x1000], [16]), timeout=5)
    assert made.backend.progress_statistics().busy_polls > 0


def test_idle_progress_polls_at_the_idle_interval(make: Any) -> None:
    made = make(idle_poll_s=0.02, busy_window_s=0.0)
    time.sleep(0.5)
    stats = made.backend.progress_statistics()
    assert 5 <= stats.polls <= 30 and stats.busy_polls == 0  # about 25 at 50 polls/s; never spinning


# ------------------------------------------------------------------------------ cuts, closing


def test_a_cut_is_refused_where_rdma_or_cuda_ipc_may_carry_the_bytes(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = make()
    monkeypatch.setenv("UCX_TLS", "rc,tcp")
    with pytest.raises(ConnectionCutUnavailableError, match="'rc'"):
        made.backend.cut_connections_from("10.0.0.2")
    monkeypatch.setenv("UCX_TLS", "^ud")
    with pytest.raises(ConnectionCutUnavailableError, match="excludes"):
        made.backend.cut_connections_from("10.0.0.2")
    monkeypatch.setenv("UCX_TLS", "tcp,cma")
    assert made.backend._unprovable_transports() is None


def test_a_cut_is_refused_once_vram_is_registered(make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    made = make(memory_kind=lambda address, keepalive: (NixlMemory.VRAM, 0))
    monkeypatch.setenv("UCX_TLS", "tcp")
    made.backend.register(HostBuffer(64))
    with pytest.raises(ConnectionCutUnavailableError, match="VRAM"):
        made.backend.cut_connections_from("10.0.0.2")


def test_close_removes_every_peer_then_drops_the_agent(make: Any) -> None:
    made = make(teardown_progress_s=0.0)
    made.backend.add_peer(PEER, peer_metadata([(0x1000, 4096, NixlMemory.DRAM, 0)]))
    buffer = HostBuffer(64)
    made.backend.register(buffer)
    made.backend.close()
    names = made.agent.names()
    assert names.index("deregister") < names.index("remove_remote")
    assert made.backend._agent is None
    with pytest.raises(BackendClosedError):
        made.backend.add_peer(PEER, peer_metadata([]))


# ---------------------------------------------------------------------------- module loading


def test_load_nixl_names_what_to_install() -> None:
    def missing(name: str) -> ModuleType:
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}", name=name.split(".")[0])

    with pytest.raises(EngineUnavailableError, match=r"pip install --no-deps nixl-cu12==1\.5\.1"):
        load_nixl(missing)


def test_load_nixl_keeps_its_logging_off_stdout(monkeypatch: pytest.MonkeyPatch) -> None:
    """nixl's first import adds a stdout handler to its logger and changes logging.raiseExceptions."""
    nixl_logger = logging.getLogger("nixl")
    monkeypatch.setattr(logging, "raiseExceptions", True)
    module = ModuleType("fake_nixl._api")

    def import_module(name: str) -> ModuleType:
        nixl_logger.addHandler(logging.StreamHandler(sys.stdout))
        nixl_logger.propagate = False
        logging.raiseExceptions = False
        return module

    try:
        assert load_nixl(import_module) is module
        assert logging.raiseExceptions is True
        assert nixl_logger.handlers == [] and nixl_logger.propagate
    finally:
        nixl_logger.handlers.clear()
        nixl_logger.propagate = True


def test_memory_of_a_cuda_tensor_is_its_device() -> None:
    class Device:
        index = 3

    class CudaTensor:
        is_cuda = True
        device = Device()

    assert memory_of(0x1000, CudaTensor()) == (NixlMemory.VRAM, 3)
    host = HostBuffer(64)
    # No CUDA driver here (or host memory): DRAM on device 0.
    assert memory_of(host.data_ptr(), host) == (NixlMemory.DRAM, 0)
