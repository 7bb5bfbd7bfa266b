"""MooncakeBackend against a fake engine: return codes to typed outcomes, settings, import errors.

The real engine runs in tests/integration/test_mooncake_backend.py; here the engine is a stand-in
whose methods take positional arguments only (as older bindings do) and return chosen codes.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import numpy as np
import pytest

from pdkv.engine import (
    BatchStatus,
    EngineInitError,
    MooncakeBackend,
    MooncakeConfig,
    MooncakeProtocol,
    RegistrationError,
    load_transfer_engine,
)
from pdkv.engine import mooncake as mooncake_module
from pdkv.engine.mooncake import check_rdma_devices
from pdkv.errors import ConfigError, EngineUnavailableError
from pdkv.mapping import TransferBlocks
from pdkv.testing.backend_conformance import HostBuffer


@attrs.frozen
class Write:
    peer: str
    src: list[int]
    dst: list[int]
    lengths: list[int]


@attrs.define
class FakeEngine:
    init_rc: int = 0
    register_rc: int = 0
    batch_ids: list[int] = attrs.Factory(list)  # consumed per submission; default 1
    statuses: list[int] = attrs.Factory(list)  # consumed per status call; default 0
    calls: list[tuple[object, ...]] = attrs.Factory(list)
    writes: list[Write] = attrs.Factory(list)
    env_at_init: dict[str, str] = attrs.Factory(dict)

    def initialize(self, hostname: str, metadata: str, protocol: str, device: str, /) -> int:
        self.calls.append(("initialize", hostname, metadata, protocol, device))
        self.env_at_init = {k: v for k, v in os.environ.items() if k.startswith("MC_")}
        return self.init_rc

    def get_rpc_port(self) -> int:
        return 15123

    def register_memory(self, address: int, length: int, /) -> int:
        self.calls.append(("register", address, length))
        return self.register_rc

    def unregister_memory(self, address: int, /) -> int:
        self.calls.append(("unregister", address))
        return 0

    def batch_transfer_async_write(
        self, peer: str, src: list[int], dst: list[int], lengths: list[int], /
    ) -> int:
        self.writes.append(Write(peer, list(src), list(dst), list(lengths)))
        return self.batch_ids.pop(0) if self.batch_ids else 1

    def get_batch_transfer_status(self, ids: list[int], /) -> int:
        self.calls.append(("status", list(ids)))
        return self.statuses.pop(0) if self.statuses else 0

    def transfer_check_status(self, batch_id: int, /) -> int:
        self.calls.append(("check", batch_id))
        return 1


@pytest.fixture(autouse=True)
def private_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # The backend writes MC_* settings into os.environ; keep them out of the other tests.
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("MC_")})


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def backend(engine: FakeEngine) -> Iterator[MooncakeBackend]:
    config = MooncakeConfig(local_hostname="10.0.0.5:7777", tcp_max_queued_transfers_per_peer=1024)
    with MooncakeBackend(config, engine_class=lambda: engine) as made:
        yield made


def _blocks(count: int, src: HostBuffer, length: int = 8) -> TransferBlocks:
    offsets = np.arange(count, dtype=np.int64) * length
    return TransferBlocks(
        src=src.data_ptr() + offsets,
        dst=0x10_0000 + offsets,
        length=np.full(count, length),
        buffer=np.zeros(count),
    )


def test_settings_reach_the_engine_before_initialize(engine: FakeEngine, backend: MooncakeBackend) -> None:
    assert engine.calls[0] == ("initialize", "10.0.0.5:7777", "P2PHANDSHAKE", "tcp", "")
    assert engine.env_at_init["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] == "1024"
    assert engine.env_at_init["MC_LOG_LEVEL"] == "WARNING"
    assert "MC_TRANSFER_TIMEOUT" not in engine.env_at_init  # None leaves the environment alone
    # P2PHANDSHAKE: the engine picks the port; the session id is host plus that port.
    assert backend.session_id == "10.0.0.5:15123"
    assert backend.max_entries_in_flight == 1024


def test_large_batch_is_split_and_zero_lengths_dropped(engine: FakeEngine, backend: MooncakeBackend) -> None:
    src = HostBuffer(2500 * 8)
    with backend.register(src):
        batch = _blocks(2500, src)
        batch = TransferBlocks(
            src=batch.src,
            dst=batch.dst,
            length=np.where(np.arange(2500) % 10 == 0, 0, 8),
            buffer=batch.buffer,
        )
        outcome = backend.write("peer:1", batch)
    assert outcome.status is BatchStatus.COMPLETED
    assert [len(w.src) for w in engine.writes] == [1024, 1024, 2250 - 2048]
    assert all(length == 8 for w in engine.writes for length in w.lengths)
    assert all(w.peer == "peer:1" for w in engine.writes)


def test_refused_submission_is_a_failed_outcome(engine: FakeEngine, backend: MooncakeBackend) -> None:
    engine.batch_ids = [0]
    src = HostBuffer(64)
    with backend.register(src):
        outcome = backend.wait([backend.submit_write("peer:1", _blocks(2, src))]).outcomes[0]
    assert outcome.status is BatchStatus.FAILED
    assert "refused" in outcome.reason and "batch id 0" in outcome.reason
    assert not [c for c in engine.calls if c[0] == "status"]  # never asked about a batch that does not exist


def test_negative_status_is_a_failed_outcome(engine: FakeEngine, backend: MooncakeBackend) -> None:
    engine.statuses = [-1]
    src = HostBuffer(64)
    with backend.register(src):
        outcome = backend.wait([backend.submit_write("peer:1", _blocks(2, src))]).outcomes[0]
    assert outcome.status is BatchStatus.FAILED and "status -1" in outcome.reason


def test_failure_of_one_piece_stops_the_rest(engine: FakeEngine, backend: MooncakeBackend) -> None:
    engine.statuses = [0, -1]
    src = HostBuffer(3000 * 8)
    with backend.register(src):
        outcome = backend.wait([backend.submit_write("peer:1", _blocks(3000, src))]).outcomes[0]
    assert outcome.status is BatchStatus.FAILED and "engine submission 2 of 3" in outcome.reason
    assert len(engine.writes) == 2


def test_register_failure_and_close_unregisters(engine: FakeEngine, backend: MooncakeBackend) -> None:
    kept = HostBuffer(64)
    backend.register(kept)
    engine.register_rc = -7
    with pytest.raises(RegistrationError, match="returned -7"):
        backend.register(HostBuffer(64))
    assert backend.statistics().registrations == 1
    backend.close()
    assert ("unregister", kept.data_ptr()) in engine.calls


def test_initialize_failure_is_typed(engine: FakeEngine) -> None:
    engine.init_rc = -1
    with pytest.raises(EngineInitError, match="returned -1"):
        MooncakeBackend(MooncakeConfig(), engine_class=lambda: engine)


def test_config_validation_and_environment() -> None:
    config = MooncakeConfig(
        protocol="rdma",  # the converter accepts the engine's spelling
        device_name="mlx5_0",
        transfer_timeout_s=10,
        log_level=None,
        extra_environment={"MC_TCP_LANES_PER_PEER": "2"},
    )
    assert config.protocol is MooncakeProtocol.RDMA
    assert config.environment() == {"MC_TRANSFER_TIMEOUT": "10", "MC_TCP_LANES_PER_PEER": "2"}
    assert config.entry_budget == 2048
    with pytest.raises(ConfigError, match="tcp' or 'rdma"):
        MooncakeConfig(protocol="ucx")
    with pytest.raises(ConfigError, match="tcp_max_queued_transfers_per_peer"):
        MooncakeConfig(tcp_max_queued_transfers_per_peer=65536)
    with pytest.raises(ConfigError, match="MC_"):
        MooncakeConfig(extra_environment={"LD_PRELOAD": "x"})
    # The switches are switches: a string such as "no" would have turned them on.
    with pytest.raises(ConfigError, match="pace_status_waits must be bool, got str 'no'"):
        MooncakeConfig(pace_status_waits="no")  # type: ignore[arg-type]  # the refused value
    with pytest.raises(ConfigError, match="yield_before_status_wait must be bool, got int 0"):
        MooncakeConfig(yield_before_status_wait=0)  # type: ignore[arg-type]  # the refused value


def test_config_from_env() -> None:
    config = MooncakeConfig.from_env(
        {
            "PDKV_MOONCAKE_PROTOCOL": "rdma",
            "PDKV_MOONCAKE_DEVICE": "mlx5_1",
            "PDKV_MOONCAKE_TRANSFER_TIMEOUT": "45",
        }
    )
    assert (config.protocol, config.device_name, config.transfer_timeout_s) == (
        MooncakeProtocol.RDMA,
        "mlx5_1",
        45,
    )
    with pytest.raises(ConfigError, match="PDKV_MOONCAKE_TRANSFER_TIMEOUT"):
        MooncakeConfig.from_env({"PDKV_MOONCAKE_TRANSFER_TIMEOUT": "soon"})


def _failing_import(error: ImportError) -> Callable[[str], ModuleType]:
    def import_module(name: str) -> ModuleType:
        raise error

    return import_module


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (ModuleNotFoundError("No module named 'mooncake'", name="mooncake"), "pdkv[mooncake-cpu]"),
        (
            ImportError("libibverbs.so.1: cannot open shared object file"),
            "apt-get install -y libibverbs1 librdmacm1 libnuma1",
        ),
        (ImportError("libnuma.so.1: cannot open shared object file"), "libibverbs1 librdmacm1 libnuma1"),
        (ImportError("libcudart.so.12: cannot open shared object file"), "mooncake-transfer-engine-non-cuda"),
        (ImportError("undefined symbol: foo"), "failed to import: undefined symbol"),
    ],
)
def test_missing_engine_says_what_to_install(error: ImportError, expected: str) -> None:
    with pytest.raises(
        EngineUnavailableError, match=expected.replace("[", r"\[").replace("]", r"\]")
    ) as raised:
        load_transfer_engine(_failing_import(error))
    assert isinstance(raised.value, ImportError)  # callers catching ImportError keep working


def test_real_engine_class_loads() -> None:
    engine_class = load_transfer_engine()
    assert engine_class.__name__ == "TransferEngine"


def test_without_mooncake_the_package_imports_and_the_backend_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # None in sys.modules makes `import mooncake.engine` fail as if the wheel were absent.
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    import pdkv.engine

    with pytest.raises(EngineUnavailableError, match=r"pip install 'pdkv\[mooncake-cpu\]'"):
        pdkv.engine.MooncakeBackend()


@attrs.define
class FakeTime:
    """A clock the fake engine advances (a status call "takes" ``transfer_s``) and a recorded sleep."""

    now: float = 100.0
    transfer_s: float = 0.0
    slept: list[float] = attrs.Factory(list)
    late_wake_s: float = 0.0  # a sleeper wakes this much after its sleep was due (a busy interpreter)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds + self.late_wake_s


@attrs.define
class TimedEngine(FakeEngine):
    """A fake engine on fake time: a transfer ends ``transfer_s`` after its launch, and the status
    call returns then (or at once, if called later)."""

    times: FakeTime = attrs.Factory(FakeTime)
    launched: list[float] = attrs.Factory(list)
    status_at: list[float] = attrs.Factory(list)

    def batch_transfer_async_write(
        self, peer: str, src: list[int], dst: list[int], lengths: list[int], /
    ) -> int:
        self.launched.append(self.times.now)
        return super().batch_transfer_async_write(peer, src, dst, lengths)

    def get_batch_transfer_status(self, ids: list[int], /) -> int:
        self.times.now = max(self.times.now, self.launched[-1] + self.times.transfer_s)
        self.status_at.append(self.times.now)
        return super().get_batch_transfer_status(ids)


@pytest.mark.parametrize("paced", [True, False])
def test_status_waits_are_paced_after_the_first_piece(paced: bool) -> None:
    engine = TimedEngine()
    times = engine.times
    config = MooncakeConfig(pace_status_waits=paced)
    source = HostBuffer(1 << 20)
    with MooncakeBackend(
        config, engine_class=lambda: engine, clock=times.clock, sleep=times.sleep
    ) as backend:
        backend.register(source)
        blocks = _blocks(4, source, length=256 << 10)  # 1 MiB per batch
        times.transfer_s = 0.010
        for _ in range(3):
            backend.write("peer:1", blocks)
            times.now += 1.0  # idle between batches: each starts at its own launch
        rate = backend.pacer("peer:1").rate
    assert len(engine.status_at) == 3
    if paced:
        # The first piece taught 1 MiB / 10 ms; the next ones sleep 75% of that before waiting.
        assert times.slept == [pytest.approx(0.0075), pytest.approx(0.0075)]
        assert rate == pytest.approx((1 << 20) / 0.010)
    else:
        assert times.slept == []
    # Pacing never delays the reported completion past the transfer's end in this model.
    ends = [s - t for s, t in zip(engine.status_at, engine.launched, strict=True)]
    assert ends == [pytest.approx(0.010)] * 3


def test_small_pieces_sleep_through_most_of_the_lane_floor() -> None:
    # A batch of a few KiB costs the engine's fixed time, which the status wait would spin through.
    engine = TimedEngine()
    times = engine.times
    source = HostBuffer(1 << 20)
    with MooncakeBackend(engine_class=lambda: engine, clock=times.clock, sleep=times.sleep) as backend:
        backend.register(source)
        blocks = _blocks(2, source, length=1 << 10)  # 2 KiB per batch
        times.transfer_s = 0.004
        for _ in range(3):
            backend.write("peer:1", blocks)
            times.now += 1.0
        floor = backend.pacer("peer:1").floor
    assert floor == pytest.approx(0.004)
    assert times.slept == [pytest.approx(0.003), pytest.approx(0.003)]  # 75% of the floor
    ends = [s - t for s, t in zip(engine.status_at, engine.launched, strict=True)]
    assert ends == [pytest.approx(0.004)] * 3


@pytest.mark.parametrize(("paced", "yields"), [(True, True), (False, True), (True, False)])
def test_a_status_wait_not_slept_for_yields_the_cpu_once_first(paced: bool, yields: bool) -> None:
    """The spinning status wait right after a launch would keep the core the engine's transfer thread
    is queued for: a wait the pacer did not sleep before yields once; one it slept before does not."""
    engine = TimedEngine()
    times = engine.times
    yielded: list[int] = []  # the status calls made before each yield

    def yield_cpu() -> None:
        yielded.append(len(engine.status_at))

    config = MooncakeConfig(pace_status_waits=paced, yield_before_status_wait=yields)
    source = HostBuffer(1 << 20)
    with MooncakeBackend(
        config, engine_class=lambda: engine, clock=times.clock, sleep=times.sleep, yield_cpu=yield_cpu
    ) as backend:
        backend.register(source)
        blocks = _blocks(4, source, length=256 << 10)
        times.transfer_s = 0.010
        for _ in range(3):
            backend.write("peer:1", blocks)
            times.now += 1.0
    assert len(engine.status_at) == 3
    if not yields:
        assert yielded == []
    elif paced:  # the first piece had no rate to sleep on; the two after it slept
        assert yielded == [0] and len(times.slept) == 2
    else:  # never slept for: each wait yields once, before its status call
        assert yielded == [0, 1, 2] and times.slept == []


def test_the_yield_before_a_status_wait_keeps_the_interpreter_lock() -> None:
    """The yield is for the engine's native threads. One that released the interpreter lock (as
    ``os.sched_yield`` does) would let a busy Python thread take it and keep the waiter out for up to
    a switch interval; here a busy thread counts, and no yield may let it count."""
    yield_cpu = mooncake_module._native_yield()
    counted = [0]
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            counted[0] += 1

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # no forced switch within a few yields; a released lock is taken at once
    thread = threading.Thread(target=busy, daemon=True)
    try:
        thread.start()
        while counted[0] == 0:
            time.sleep(0.001)
        for _ in range(30):  # os.sched_yield lets the busy thread count in about one call of three
            before = counted[0]
            yield_cpu()
            assert counted[0] == before
    finally:
        stop.set()
        thread.join(5.0)
        sys.setswitchinterval(previous)


@attrs.define
class CheckingEngine(FakeEngine):
    """Mooncake 0.3.13's ``transfer_check_status`` on fake time: the state of a batch's first task (1
    ended, 0 in progress, -1 failed, -2 timed out), scripted per call (1 once the script is spent).
    A batch reported ended or failed is freed, and naming it again crashes the real process: here,
    an AssertionError (which fails the test wherever it is raised)."""

    times: FakeTime = attrs.Factory(FakeTime)
    checks: list[int] = attrs.Factory(list)  # scripted states, one per call
    checked: list[int] = attrs.Factory(list)  # the batch ids asked about
    freed: set[int] = attrs.Factory(set)
    launched: int = 0

    def batch_transfer_async_write(
        self, peer: str, src: list[int], dst: list[int], lengths: list[int], /
    ) -> int:
        self.writes.append(Write(peer, list(src), list(dst), list(lengths)))
        self.launched += 1
        return self.batch_ids.pop(0) if self.batch_ids else 100 + self.launched

    def transfer_check_status(self, batch_id: int, /) -> int:
        assert batch_id not in self.freed, f"batch {batch_id} named after the engine freed it"
        self.checked.append(batch_id)
        state = self.checks.pop(0) if self.checks else 1
        if state in (1, -1):
            self.freed.add(batch_id)
        return state

    def get_batch_transfer_status(self, ids: list[int], /) -> int:
        assert not self.freed & set(ids), f"status of freed batches {sorted(self.freed & set(ids))}"
        return super().get_batch_transfer_status(ids)


def _large_write(
    engine: CheckingEngine,
    *,
    blocks: int = 32,
    block_bytes: int = 1 << 20,
    config: MooncakeConfig | None = None,
) -> tuple[BatchStatus, str]:
    times = engine.times
    source = HostBuffer(blocks * block_bytes)
    with MooncakeBackend(
        config or MooncakeConfig(transfer_timeout_s=5),
        engine_class=lambda: engine,
        clock=times.clock,
        sleep=times.sleep,
    ) as backend:
        backend.register(source)
        handle = backend.submit_write("peer:1", _blocks(blocks, source, length=block_bytes))
        outcome = backend.wait([handle]).outcomes[0]
    return outcome.status, outcome.reason


def test_a_large_piece_over_tcp_is_watched_through_its_last_entry_not_spun_for() -> None:
    """Over TCP the engine's threads move the bytes on the host's cores, which a spinning status wait
    shares: a large piece's last entry goes alone, the completer looks at it between short sleeps,
    and the blocking status of the rest comes once it ended."""
    engine = CheckingEngine(checks=[0, 0, 1])
    status, _ = _large_write(engine)  # 32 MiB in 32 blocks
    assert status is BatchStatus.COMPLETED
    main, last = engine.writes
    assert len(main.lengths) == 31 and len(last.lengths) == 1  # every block once, the last one alone
    offsets = [i << 20 for i in range(32)]
    assert main.dst + last.dst == [0x10_0000 + offset for offset in offsets]
    assert [s - main.src[0] for s in main.src + last.src] == offsets
    assert engine.checked == [102, 102, 102]
    assert engine.times.slept == [mooncake_module.WATCH_POLL_S] * 2  # between the looks
    assert ("status", [101]) in engine.calls and ("status", [101, 102]) not in engine.calls


@pytest.mark.parametrize(
    ("checks", "statuses", "status_of"),
    [
        ([-1], [], [101]),  # the last entry failed: freed; the rest still waited for
        ([0, 1], [-1], [101]),  # the rest failed
        ([0, -2], [-2], [101, 102]),  # timed out: not freed, so the blocking status takes both
        ([0] * 50, [-2], [101, 102]),  # still running at the engine's bound: both to the status
    ],
    ids=["last-failed", "rest-failed", "last-timed-out", "never-ends"],
)
def test_a_watched_piece_fails_whole_and_every_batch_is_ended_once(
    checks: list[int], statuses: list[int], status_of: list[int]
) -> None:
    engine = CheckingEngine(checks=checks, statuses=statuses)
    engine.times.late_wake_s = 1.0  # each look a second apart: the engine's bound (5 s) comes in 6 looks
    status, reason = _large_write(engine)
    assert status is BatchStatus.FAILED
    assert "engine reported status" in reason
    assert [c for c in engine.calls if c[0] == "status"] == [("status", status_of)]
    assert len(engine.checked) <= 7


@pytest.mark.parametrize(
    ("blocks", "block_bytes", "protocol", "watch"),
    [
        (3, 1 << 20, "tcp", True),
        (1, 32 << 20, "tcp", True),
        (32, 1 << 20, "rdma", True),
        (32, 1 << 20, "tcp", False),
    ],
    ids=["under-4MiB", "one-entry", "rdma", "switched-off"],
)
def test_small_one_entry_rdma_and_unwatched_pieces_are_one_batch(
    blocks: int, block_bytes: int, protocol: str, watch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mooncake_module, "check_rdma_devices", lambda _: None)
    engine = CheckingEngine()
    config = MooncakeConfig(
        protocol=protocol, device_name="mlx5_0" if protocol == "rdma" else "", watch_large_pieces=watch
    )
    status, _ = _large_write(engine, blocks=blocks, block_bytes=block_bytes, config=config)
    assert status is BatchStatus.COMPLETED
    assert len(engine.writes) == 1 and len(engine.writes[0].lengths) == blocks
    assert engine.checked == []


def test_a_refused_last_entry_fails_the_piece_after_the_rest_ended() -> None:
    engine = CheckingEngine(batch_ids=[101, -1])
    status, reason = _large_write(engine)
    assert status is BatchStatus.FAILED
    assert "refused the submission of 1 blocks" in reason
    assert [c for c in engine.calls if c[0] == "status"] == [("status", [101])]


def test_a_paced_wait_still_reports_a_failed_piece(engine: FakeEngine) -> None:
    times = FakeTime()
    source = HostBuffer(1 << 20)
    engine.statuses = [0, -1]
    with MooncakeBackend(engine_class=lambda: engine, clock=times.clock, sleep=times.sleep) as backend:
        backend.register(source)
        blocks = _blocks(4, source, length=256 << 10)
        backend.write("peer:1", blocks)  # instantaneous in fake time: teaches no rate
        result = backend.wait([backend.submit_write("peer:1", blocks)])
    assert result.outcomes[0].status is BatchStatus.FAILED
    assert "status -1" in result.outcomes[0].reason


def test_an_rdma_device_this_host_lacks_fails_at_start_naming_it(tmp_path: Path) -> None:
    # Mooncake itself would start without a word and move nothing over RDMA.
    (tmp_path / "mlx5_0").mkdir()
    check_rdma_devices("mlx5_0", root=str(tmp_path))  # present: fine
    with pytest.raises(EngineUnavailableError, match=r"\['mlx5_1'\] not found on this host .*\['mlx5_0'\]"):
        check_rdma_devices("mlx5_0,mlx5_1", root=str(tmp_path))
    with pytest.raises(EngineUnavailableError, match="needs device_name"):
        check_rdma_devices("", root=str(tmp_path))
    with pytest.raises(EngineUnavailableError, match="mlx9_9"):  # through the backend, before any engine call
        MooncakeBackend(MooncakeConfig(protocol="rdma", device_name="mlx9_9"), engine_class=_no_engine)


def _no_engine() -> Any:
    raise AssertionError("the engine must not be created for a device that does not exist")


@attrs.define
class NoisyEngine(FakeEngine):
    """Writes what the real engine's start-up writes to fd 2 (glog), plus one real error."""

    def initialize(self, hostname: str, metadata: str, protocol: str, device: str, /) -> int:
        os.write(2, b"WARNING: Logging before InitGoogleLogging() is written to STDERR\n")
        os.write(2, b"W1130 12:00:00.000000 1 topology.cpp:201] No RDMA devices found, check your device\n")
        os.write(2, b"E1130 12:00:00.000001 1 metadata.cpp:1098] Local segment descriptor not found\n")
        os.write(2, b"E1130 12:00:00.000002 1 tcp_transport.cpp:77] Failed to bind data port: in use\n")
        return super().initialize(hostname, metadata, protocol, device)


def test_expected_engine_startup_lines_go_to_debug_and_real_errors_stay(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pdkv.engine.mooncake")
    with MooncakeBackend(MooncakeConfig(), engine_class=NoisyEngine):
        pass
    err = capfd.readouterr().err
    assert "Failed to bind data port: in use" in err  # the engine's real error is not hidden
    for noise in ("Local segment descriptor not found", "No RDMA devices found", "InitGoogleLogging"):
        assert noise not in err
        assert any(noise in record.getMessage() for record in caplog.records)
    print("after", file=sys.stderr)  # fd 2 is back where it was
    assert "after" in capfd.readouterr().err


def test_a_late_wake_from_a_pacing_sleep_never_raises_the_next_sleep() -> None:
    """The backend tells the pacer that it slept before a status wait: a piece that ended during the
    sleep, seen late because the sleeper woke late (a busy interpreter), says only that the piece
    took at most that long, so the floor, and every later sleep, stays (a planted ``slept=False`` at
    the call site let each late wake ratchet the floor up)."""
    engine = TimedEngine()
    times = engine.times
    source = HostBuffer(1 << 20)
    with MooncakeBackend(engine_class=lambda: engine, clock=times.clock, sleep=times.sleep) as backend:
        backend.register(source)
        blocks = _blocks(2, source, length=1 << 10)  # 2 KiB per batch: paced by the lane floor
        times.transfer_s = 0.004
        backend.write("peer:1", blocks)  # teaches the floor: 4 ms
        times.now += 1.0
        times.late_wake_s = 0.005
        backend.write("peer:1", blocks)  # slept 3 ms, woke at 8 ms: seen as an 8 ms piece
        times.late_wake_s = 0.0
        times.now += 1.0
        backend.write("peer:1", blocks)
        floor = backend.pacer("peer:1").floor
    assert floor == pytest.approx(0.004)
    assert times.slept == [pytest.approx(0.003), pytest.approx(0.003)]  # the same 75% both times
