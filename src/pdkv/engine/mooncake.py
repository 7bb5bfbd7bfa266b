"""Mooncake transfer-engine backend: the only module in pdkv that imports ``mooncake``.

Owns: ``MooncakeConfig`` (protocol, metadata server, device, and the ``MC_*`` settings that matter),
``MooncakeBackend`` (a ``TransferBackend`` over ``mooncake.engine.TransferEngine``) and
``load_transfer_engine`` (the import, turned into a clear ``EngineUnavailableError``). Must not assume
TCP: production runs ``rdma``; TCP-only facts (the per-peer lane queue) are named as such.

How the engine is driven (Mooncake 0.3.13; facts in FACTS.md and notes/peer-systems.md section 4):

- Arguments are passed positionally (older bindings have no argument names).
- A piece of a batch is launched with ``batch_transfer_async_write`` on the peer's lane thread (a
  batch id <= 0 means the engine refused it, e.g. the peer's handshake failed) and completed with
  ``get_batch_transfer_status`` on the lane's completer thread: it blocks, spinning, until the batch
  ends (0 ok, negative failed or timed out), so there is exactly one such waiter per peer however
  many batches are in flight (``pdkv.engine._threaded``). The spin takes a core from the engine's
  own transfer threads, so the completer first sleeps through most of the piece's expected transfer
  time (bytes over the fastest recent rate towards that peer, ``pdkv.engine._pacing``) and spins only
  for the rest (``MooncakeConfig.pace_status_waits``). A wait the pacer does not sleep before (a
  small piece on an idle lane, a first piece) yields the CPU once before it spins
  (``yield_before_status_wait``): the thread that has just launched a write would otherwise keep the
  core that the engine's transfer thread, woken by that launch, is queued for, and the spin lasts
  until the scheduler preempts it. A yield with nothing else runnable returns at once, and it keeps
  the interpreter lock (it is for native threads; releasing the lock could cost a switch interval).
- Over TCP a large piece (``WATCHED_PIECE_MIN_BYTES``, two entries or more) is launched as two
  batches (``MooncakeConfig.watch_large_pieces``): all its entries but the last, then the last alone.
  After the pacer's sleep the completer does not spin: it asks ``transfer_check_status`` about the
  one-entry batch every ``WATCH_POLL_S`` (that call inspects the first task of a batch only, which is
  all there is of that one) and sleeps in between; once that entry ended, the blocking status of the
  other batch decides the piece (it ends at once when the entries went in order, as they did in every
  trial here; when they did not, it spins for the rest, as before). Over TCP the engine's own threads
  move the bytes on the host's cores, and the spin took one of them: 72 MB as 976 blocks took 51.4 ms
  with the spin and 43.8 ms watched (p50 of 15 and 30, a scratch loop over the raw engine, 2 cores).
  In Mooncake 0.3.13 a ``transfer_check_status`` that reports the batch ended (1) or failed (-1) also
  frees it, and any later call naming that batch crashes the process: a batch so reported is never
  named again. A timed-out one (-2) is not freed; the blocking status frees it. The watch stops after
  the engine's own bound on the piece (bytes in ns plus ``MC_TRANSFER_TIMEOUT``) and leaves both
  batches to the blocking status, which enforces the engine's timeout. (Spinning at idle priority
  instead, tried first, saw ends up to seconds late on a host whose cores were saturated.)
- Over TCP every entry in flight towards one peer takes a slot in that peer's lane queue
  (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``, about 2,048 by default). A batch that overflows it is
  rejected whole, concurrent batches included, and the lane keeps refusing for about a second after.
  So the backend never has more than ``max_entries_in_flight`` entries in flight per peer: larger
  batches are split and the parts queued (``pdkv.engine._threaded``).
- The engine reads its ``MC_*`` settings from the environment: ``MC_LOG_LEVEL`` when the library
  is first imported, the others when an engine initializes. The backend sets the configured ones in
  ``os.environ`` before both. They are process-wide, so every backend of one process should be built
  from the same settings (the first import fixes the log level); the config wins over a value
  already in the environment, and settings left ``None`` leave the environment alone.
- A destination outside the peer's registered memory is refused by the peer, and the batch fails
  (status negative); the engine does not say which block, so neither can this backend.
- With ``P2PHANDSHAKE`` the engine picks its RPC port itself (``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT``)
  and ignores a port in ``local_hostname``; peers address ``host:rpc_port`` (``session_id``).

Timeouts: the engine fails a batch after about ``total bytes`` ns plus ``MC_TRANSFER_TIMEOUT`` s
(default 30 s, at least 5 s), so a worker is never stuck for ever; ``wait(timeout=...)`` on top of that
reports TIMED_OUT without cancelling anything (see ``pdkv.engine.backend``).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Final, Protocol

import attrs

from pdkv import config
from pdkv.engine import sockets
from pdkv.engine._pacing import CompletionPacer, PacingConfig
from pdkv.engine._threaded import PieceFailed, PieceJob, WorkerThreadBackend
from pdkv.engine.backend import MemoryRegion, RegistrationError
from pdkv.errors import ConfigError, EngineUnavailableError, TransferError
from pdkv.errors.engine import EngineInitError as EngineInitError

if TYPE_CHECKING:
    from mooncake.engine import TransferEngine

SYSTEM_PACKAGES = ("libibverbs1", "librdmacm1", "libnuma1")
log = logging.getLogger(__name__)
_ENGINE_START = threading.Lock()


def _native_yield() -> Callable[[], object]:
    """``sched_yield`` with the interpreter lock kept (ctypes ``PyDLL``): the yield is for the engine's
    native threads, which need no lock. ``os.sched_yield`` releases it, and a busy Python thread that
    takes it then keeps the waiter out for up to a switch interval (5 ms by default; measured: a
    9.5 ms call beside one busy thread, under 5 µs through ``PyDLL``)."""
    function = ctypes.PyDLL(None).sched_yield
    function.argtypes = []
    function.restype = ctypes.c_int
    return function


def _listening_ports() -> frozenset[int]:
    """This process's listening TCP ports; empty when sock_diag cannot be read (no proven cut then)."""
    try:
        return sockets.listening_ports()
    except (sockets.ConnectionCutUnavailableError, OSError):
        return frozenset()


# What every engine start prints although nothing is wrong (glog to fd 2, some at ERROR level): the
# P2P handshake looks its own descriptor up before it publishes it, a TCP engine notes that it found no
# RDMA device and that it uses plain malloc. Logged at DEBUG instead; every other line passes through.
_STARTUP_NOISE: Final = (
    "Logging before InitGoogleLogging() is written to STDERR",
    "Local segment descriptor not found",
    "Using default malloc/free for protocol: tcp",
)
_TCP_STARTUP_NOISE: Final = ("No RDMA devices found",)


@contextlib.contextmanager
def startup_noise_filtered(protocol: MooncakeProtocol) -> Iterator[None]:
    """Route fd 2 through a pipe while the engine starts; then log its expected start-up lines at DEBUG
    and write every other line to stderr unchanged (the engine's real errors stay visible).

    The engine's own log level is ``MooncakeConfig.log_level`` (``MC_LOG_LEVEL``)."""
    noise = _STARTUP_NOISE + (_TCP_STARTUP_NOISE if protocol is MooncakeProtocol.TCP else ())
    sys.stderr.flush()
    try:
        saved = os.dup(2)
        read_end, write_end = os.pipe()
    except OSError:  # no fd 2 to redirect: nothing to filter
        yield
        return
    captured: list[bytes] = []

    def drain() -> None:
        while chunk := os.read(read_end, 65536):
            captured.append(chunk)

    reader = threading.Thread(target=drain, name="pdkv-mooncake-startup-log", daemon=True)
    reader.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer is gone: the reader sees the end
        os.close(saved)
        reader.join(5.0)
        os.close(read_end)
        for line in b"".join(captured).decode("utf-8", "replace").splitlines(keepends=True):
            if any(marker in line for marker in noise):
                log.debug("mooncake start-up: %s", line.rstrip())
            else:
                os.write(2, line.encode("utf-8", "replace"))


_SYSTEM_LIBRARIES = ("libibverbs", "librdmacm", "libnuma")
# The engine's TCP lane queue default; an in-flight budget above it gets whole batches rejected.
TCP_DEFAULT_QUEUED_TRANSFERS_PER_PEER = 2048
# Mooncake 0.3.13 accepts 8,192 and 16,384, rejects 65,536 (falls back to 1,024), and treats values
# below 1,024 as 1,024; stay inside what was verified.
TCP_QUEUED_TRANSFERS_RANGE = (1024, 16384)


class MooncakeEngineApi(Protocol):
    """The part of ``mooncake.engine.TransferEngine`` this backend calls (all positional)."""

    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, /
    ) -> int: ...
    def get_rpc_port(self) -> int: ...
    def register_memory(self, buffer_addr: int, capacity: int, /) -> int: ...
    def unregister_memory(self, buffer_addr: int, /) -> int: ...
    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        /,
    ) -> int: ...
    def get_batch_transfer_status(self, batch_ids: list[int], /) -> int: ...
    def transfer_check_status(self, batch_id: int, /) -> int: ...


class MooncakeProtocol(enum.Enum):
    TCP = "tcp"
    RDMA = "rdma"


class MooncakeLogLevel(enum.Enum):
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


_IntValidator = Callable[[object, "attrs.Attribute[int | None]", "int | None"], None]


def _optional_int_in(low: int, high: int) -> _IntValidator:
    def check(_: object, attribute: attrs.Attribute[int | None], value: int | None) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(f"{attribute.name} must be an int in [{low}, {high}] or None, got {value!r}")

    return check


def _mc_names(_: object, attribute: attrs.Attribute[Mapping[str, str]], value: Mapping[str, str]) -> None:
    for key in value:
        if not key.startswith("MC_"):
            raise ConfigError(f"{attribute.name} holds Mooncake settings only (MC_*), got {key!r}")


def _to_protocol(value: MooncakeProtocol | str) -> MooncakeProtocol:
    try:
        return MooncakeProtocol(value)
    except ValueError:
        raise ConfigError(f"protocol must be 'tcp' or 'rdma', got {value!r}") from None


def _to_log_level(value: MooncakeLogLevel | str | None) -> MooncakeLogLevel | None:
    if value is None:
        return None
    try:
        return MooncakeLogLevel(value)
    except ValueError:
        raise ConfigError(f"log_level must be INFO, WARNING, ERROR or None, got {value!r}") from None


@attrs.frozen(kw_only=True)
class MooncakeConfig:
    """How to start one Mooncake engine. ``environment()`` lists the ``MC_*`` variables it sets."""

    protocol: MooncakeProtocol = attrs.field(
        default=MooncakeProtocol.TCP,
        converter=_to_protocol,
        metadata=config.text_var("PDKV_MOONCAKE_PROTOCOL", "Mooncake: tcp or rdma"),
    )
    # The address peers reach this engine at (no port).
    local_hostname: str = attrs.field(
        default="127.0.0.1",
        validator=config.non_empty_text,
        metadata=config.text_var(
            "PDKV_MOONCAKE_HOSTNAME", "Mooncake: the address peers reach this engine at"
        ),
    )
    # Or "etcd://host:port", "http://host:port/metadata" ...
    metadata_server: str = attrs.field(
        default="P2PHANDSHAKE",
        metadata=config.text_var("PDKV_MOONCAKE_METADATA_SERVER", "Mooncake: metadata server (P2PHANDSHAKE)"),
    )
    # RDMA NICs, e.g. "mlx5_0,mlx5_1"; "" for TCP.
    device_name: str = attrs.field(
        default="", metadata=config.text_var("PDKV_MOONCAKE_DEVICE", "Mooncake: RDMA device names")
    )
    # MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER (TCP only); None keeps the engine default (2,048).
    tcp_max_queued_transfers_per_peer: int | None = attrs.field(
        default=None, validator=_optional_int_in(*TCP_QUEUED_TRANSFERS_RANGE)
    )
    # MC_TRANSFER_TIMEOUT in seconds; the engine clamps it to at least 5.
    transfer_timeout_s: int | None = attrs.field(
        default=None,
        validator=_optional_int_in(5, 86_400),
        metadata=config.int_var(
            "PDKV_MOONCAKE_TRANSFER_TIMEOUT", "Mooncake: MC_TRANSFER_TIMEOUT, whole seconds"
        ),
    )
    log_level: MooncakeLogLevel | None = attrs.field(
        default=MooncakeLogLevel.WARNING, converter=_to_log_level
    )
    # Any other MC_* setting, passed through verbatim (e.g. MC_TCP_LANES_PER_PEER, MC_SLICE_SIZE).
    extra_environment: Mapping[str, str] = attrs.field(factory=dict, validator=_mc_names)
    # Most entries in flight towards one peer; None: the TCP lane queue size, or 2,048 for RDMA.
    max_entries_in_flight: int | None = attrs.field(default=None, validator=_optional_int_in(1, 1 << 20))
    # Sleep through most of a piece's expected transfer time before the (spinning) status wait.
    pace_status_waits: bool = attrs.field(default=True, validator=config.instance_of(bool))
    # Yield the CPU once before a status wait that was not slept for (see the module docstring).
    yield_before_status_wait: bool = attrs.field(default=True, validator=config.instance_of(bool))
    # Over TCP, watch a large piece through its last entry instead of spinning for it (see the module
    # docstring); off: one batch and one spinning wait, as for every other piece. The watch rests on
    # how Mooncake 0.3.13's transfer_check_status frees a batch: a binding that differs needs it off.
    watch_large_pieces: bool = attrs.field(default=True, validator=config.instance_of(bool))

    def environment(self) -> dict[str, str]:
        """The ``MC_*`` variables this config sets before the engine initializes."""
        env = dict(self.extra_environment)
        if self.tcp_max_queued_transfers_per_peer is not None:
            env["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] = str(self.tcp_max_queued_transfers_per_peer)
        if self.transfer_timeout_s is not None:
            env["MC_TRANSFER_TIMEOUT"] = str(self.transfer_timeout_s)
        if self.log_level is not None:
            env["MC_LOG_LEVEL"] = self.log_level.value
        return env

    @property
    def entry_budget(self) -> int:
        """Entries the backend keeps in flight per peer (see the module docstring)."""
        if self.max_entries_in_flight is not None:
            return self.max_entries_in_flight
        if self.protocol is MooncakeProtocol.TCP:
            return self.tcp_max_queued_transfers_per_peer or TCP_DEFAULT_QUEUED_TRANSFERS_PER_PEER
        return TCP_DEFAULT_QUEUED_TRANSFERS_PER_PEER

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> MooncakeConfig:
        """Defaults, overridden by ``PDKV_MOONCAKE_PROTOCOL``, ``_HOSTNAME``, ``_METADATA_SERVER``,
        ``_DEVICE`` and ``_TRANSFER_TIMEOUT`` (whole seconds) when set."""
        return config.from_env(cls, env)


def load_transfer_engine(
    import_module: Callable[[str], ModuleType] = importlib.import_module,
) -> type[TransferEngine]:
    """``mooncake.engine.TransferEngine``, or an ``EngineUnavailableError`` that says what to install."""
    try:
        import_module("mooncake.engine")
    except ModuleNotFoundError as exc:
        if exc.name not in ("mooncake", "mooncake.engine"):
            raise _unavailable(exc) from exc
        raise EngineUnavailableError(
            "the Mooncake transfer engine is not installed: pip install 'pdkv[mooncake-cpu]' "
            "(mooncake-transfer-engine-non-cuda, CPU memory, TCP or RDMA) or 'pdkv[mooncake]' (CUDA build)"
        ) from exc
    except ImportError as exc:
        raise _unavailable(exc) from exc
    from mooncake.engine import TransferEngine

    return TransferEngine


def _unavailable(exc: ImportError) -> EngineUnavailableError:
    message = str(exc)
    if any(lib in message for lib in _SYSTEM_LIBRARIES):
        packages = " ".join(SYSTEM_PACKAGES)
        return EngineUnavailableError(
            f"mooncake.engine is installed but cannot load a system library ({message}); it links "
            f"against RDMA and NUMA libraries even for protocol tcp. On Debian/Ubuntu: "
            f"apt-get install -y {packages}"
        )
    if "libcudart" in message:
        return EngineUnavailableError(
            f"the CUDA build of Mooncake needs the CUDA runtime ({message}); on a machine without "
            "CUDA install mooncake-transfer-engine-non-cuda (pip install 'pdkv[mooncake-cpu]')"
        )
    return EngineUnavailableError(f"mooncake.engine failed to import: {message}")


def _session_host(local_hostname: str) -> str:
    # "[::1]:1234" / "host:1234" -> the host part; the engine ignores the port under P2PHANDSHAKE.
    if local_hostname.startswith("["):
        return local_hostname.split("]", 1)[0] + "]"
    if local_hostname.count(":") == 1:
        return local_hostname.split(":", 1)[0]
    return local_hostname


@attrs.frozen
class LaunchedPiece:
    """A piece the engine accepted: its batch id, when it was launched (the backend's clock) and, for a
    watched piece, the batch of its last entry (launched after the others)."""

    batch_id: int
    launched_at: float
    last_entry: int | None = None


WATCHED_PIECE_MIN_BYTES: Final = 4 << 20
"""Over TCP a piece of at least this many bytes is watched through its last entry instead of spun for
(module docstring): about 2 ms at this machine's 2 GB/s, long enough that a look every
``WATCH_POLL_S`` sees its end with little delay. One page of a 61-layer MLA model (4.5 MB) is
watched; a smaller piece's wait is mostly slept through, or short."""

WATCH_POLL_S: Final = 0.0002
"""Between two looks at a watched piece's last entry: the most its end can be seen late. Raw engine
on this machine, 75% of the expected time slept first, then spun for or watched (p50 / p90): 4.5
MB in 61 blocks 3.35 / 4.51 ms spun for, 3.38 / 4.03 watched every 0.2 ms, 3.71 / 4.31 every 0.5
ms; 72 MB in 976 blocks 48.6 / 94.6 spun for, 42.6 / 89.0 watched (0.2 or 0.5 ms alike)."""


_COMPLETION_SLACK_S: Final = 5.0
"""Added to the engine's own bound on a status wait (pacing sleep, scheduling) when deciding whether
a waiter with a timeout may complete a piece itself (``WorkerThreadBackend._completion_bound_s``)."""

RDMA_DEVICES_ROOT: Final = "/sys/class/infiniband"
"""Where Linux lists the RDMA devices of this host (one directory each, e.g. ``mlx5_0``)."""


def check_rdma_devices(device_name: str, root: str = RDMA_DEVICES_ROOT) -> None:
    """``EngineUnavailableError`` naming every requested RDMA device this host does not have.

    Mooncake itself starts without a word when a named device is missing (only an engine log line),
    and then moves nothing over RDMA: a typo in ``device_name`` must fail at start, loudly.
    """
    wanted = [name.strip() for name in device_name.split(",") if name.strip()]
    if not wanted:
        raise EngineUnavailableError("protocol 'rdma' needs device_name (e.g. 'mlx5_0'); none was given")
    present = sorted(os.listdir(root)) if os.path.isdir(root) else []
    missing = [name for name in wanted if name not in present]
    if missing:
        raise EngineUnavailableError(
            f"RDMA device(s) {missing} not found on this host (present under {root}: {present or 'none'}); "
            "check device_name / --disaggregation-ib-device, or use protocol 'tcp'"
        )


class MooncakeBackend(WorkerThreadBackend[LaunchedPiece]):
    """A ``TransferBackend`` over one Mooncake ``TransferEngine`` (one per rank).

    ``engine_class`` replaces the real engine (tests pass a fake with the same positional API).
    """

    def __init__(
        self,
        config: MooncakeConfig | None = None,
        *,
        engine_class: Callable[[], MooncakeEngineApi] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        yield_cpu: Callable[[], object] | None = None,
    ) -> None:
        """``clock`` and ``sleep`` pace the status waits, ``yield_cpu`` gives up the CPU before one (tests
        pass fakes)."""
        self.config = config or MooncakeConfig()
        cfg = self.config
        # Before the import and the engine's start: some settings (MC_LOG_LEVEL) are read when the
        # library loads, the others when the engine initializes.
        os.environ.update(cfg.environment())
        # MC_TRANSFER_TIMEOUT as the engine reads it (the config's value, or one set outside; the
        # engine clamps it to at least 5 s): what bounds a status wait (_completion_bound_s).
        try:
            self._engine_timeout_s = max(5, int(os.environ.get("MC_TRANSFER_TIMEOUT", "30")))
        except ValueError:
            self._engine_timeout_s = 30
        if cfg.protocol is MooncakeProtocol.RDMA:
            check_rdma_devices(cfg.device_name)
        make_engine = engine_class or load_transfer_engine()
        engine = make_engine()
        with _ENGINE_START:  # the ports that appear meanwhile are this engine's (rpc and TCP data)
            before = _listening_ports()
            with startup_noise_filtered(cfg.protocol):
                rc = engine.initialize(
                    cfg.local_hostname, cfg.metadata_server, cfg.protocol.value, cfg.device_name
                )
            self._engine_ports = _listening_ports() - before
        if rc != 0:
            raise EngineInitError(
                f"TransferEngine.initialize({cfg.local_hostname!r}, {cfg.metadata_server!r}, "
                f"{cfg.protocol.value!r}, {cfg.device_name!r}) returned {rc}: check that the metadata "
                "server is reachable and, for rdma, that the device names exist (ibv_devices)"
            )
        self._engine: MooncakeEngineApi | None = engine
        if cfg.metadata_server == "P2PHANDSHAKE":
            self._session_id = f"{_session_host(cfg.local_hostname)}:{engine.get_rpc_port()}"
        else:
            self._session_id = cfg.local_hostname
        self._sleep = sleep
        self._yield_cpu = yield_cpu if yield_cpu is not None else _native_yield()
        self._pacers: dict[str, CompletionPacer] = {}
        self._pacers_lock = threading.Lock()
        super().__init__(max_entries_in_flight=cfg.entry_budget, thread_name="pdkv-mooncake", clock=clock)

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def engine_ports(self) -> frozenset[int]:
        """The TCP ports this backend's engine listens on (its RPC port and its TCP data port)."""
        return self._engine_ports

    def cut_connections_from(self, host: str) -> int:
        """Destroy every connection from ``host`` to this engine's ports and wait until they are gone
        (Mooncake's server sessions have no read deadline: only this ends a stalled one)."""
        if not self._engine_ports:
            raise sockets.ConnectionCutUnavailableError(
                "the engine's listening ports are unknown (sock_diag was not readable at its start)"
            )
        report = sockets.cut_connections(sockets.resolve_host(host), self._engine_ports)
        if report.cut:
            log.warning(
                "cut %d engine connection(s) from %s: %s",
                len(report.cut),
                host,
                ", ".join(c.describe() for c in report.cut),
            )
        return len(report.cut)

    def _live_engine(self) -> MooncakeEngineApi:
        if self._engine is None:
            raise TransferError(f"Mooncake engine of {self._session_id} was released")
        return self._engine

    def _engine_register(self, region: MemoryRegion) -> None:
        rc = self._live_engine().register_memory(region.address, region.length)
        if rc != 0:
            raise RegistrationError(
                f"Mooncake register_memory({region.address:#x}, {region.length}) returned {rc} "
                "(overlapping or zero-length region, or the NIC refused the memory)"
            )

    def _engine_unregister(self, region: MemoryRegion) -> None:
        rc = self._live_engine().unregister_memory(region.address)
        if rc != 0:
            raise RegistrationError(f"Mooncake unregister_memory({region.address:#x}) returned {rc}")

    def _launch(self, job: PieceJob) -> LaunchedPiece:
        peer, piece = job.handle.peer, job.piece
        src, dst, length = piece.src.tolist(), piece.dst.tolist(), piece.length.tolist()
        engine = self._live_engine()
        launched_at = self._clock()
        if not self._watched(piece.total_bytes, len(length)):
            return LaunchedPiece(self._submit_batch(engine, peer, src, dst, length), launched_at)
        batch_id = self._submit_batch(engine, peer, src[:-1], dst[:-1], length[:-1])
        try:
            last_entry = self._submit_batch(engine, peer, src[-1:], dst[-1:], length[-1:])
        except PieceFailed:
            engine.get_batch_transfer_status([batch_id])  # the rest is in flight: it ends first
            raise
        return LaunchedPiece(batch_id, launched_at, last_entry)

    def _watched(self, total_bytes: int, entries: int) -> bool:
        return (
            self.config.watch_large_pieces
            and self.config.protocol is MooncakeProtocol.TCP
            and entries >= 2
            and total_bytes >= WATCHED_PIECE_MIN_BYTES
        )

    @staticmethod
    def _submit_batch(
        engine: MooncakeEngineApi, peer: str, src: list[int], dst: list[int], length: list[int]
    ) -> int:
        batch_id = engine.batch_transfer_async_write(peer, src, dst, length)
        if batch_id <= 0:
            raise PieceFailed(
                f"engine refused the submission of {len(length)} blocks (batch id {batch_id}): "
                f"peer {peer!r} unreachable (handshake failed) or the arguments are invalid"
            )
        return batch_id

    def pacer(self, peer: str) -> CompletionPacer:
        """The status-wait pacing of ``peer``'s lane (its learnt rate is in ``rate``)."""
        with self._pacers_lock:
            pacer = self._pacers.get(peer)
            if pacer is None:
                pacer = self._pacers[peer] = CompletionPacer(PacingConfig())
            return pacer

    def _complete(self, job: PieceJob, token: LaunchedPiece) -> None:
        nbytes = job.piece.total_bytes
        pacer = self.pacer(job.handle.peer) if self.config.pace_status_waits else None
        delay = 0.0
        if pacer is not None:
            delay = pacer.sleep_before_wait(nbytes, token.launched_at, self._clock())
        if delay > 0:
            self._sleep(delay)
        elif self.config.yield_before_status_wait:
            self._yield_cpu()
        engine = self._live_engine()
        batches, status = [token.batch_id], 0
        if token.last_entry is not None:
            give_up_at = token.launched_at + nbytes * 1e-9 + self._engine_timeout_s  # the engine's bound
            ended = self._watch(engine, token.last_entry, give_up_at)
            if ended is None:
                batches.append(token.last_entry)  # not freed: the blocking status waits for it too
            else:
                status = ended
        status = engine.get_batch_transfer_status(batches) or status
        if pacer is not None:
            pacer.completed(nbytes, token.launched_at, self._clock(), slept=delay > 0)
        if status != 0:
            raise PieceFailed(
                f"engine reported status {status} for {len(job.piece)} blocks to {job.handle.peer!r}: "
                "transport error, destination not registered at the peer, queue full, or "
                "MC_TRANSFER_TIMEOUT exceeded"
            )

    def _watch(self, engine: MooncakeEngineApi, batch_id: int, give_up_at: float) -> int | None:
        """Look at a watched piece's last entry until it ended: 0 done, -1 failed (the engine freed
        the batch either way), or None when it timed out or ``give_up_at`` passed (not freed)."""
        while True:
            state = engine.transfer_check_status(batch_id)
            if state == 1:
                return 0
            if state == -1:
                return -1
            if state != 0 or self._clock() >= give_up_at:
                return None
            self._sleep(WATCH_POLL_S)

    def _completion_bound_s(self, total_bytes: int) -> float:
        """The engine fails a batch after about its bytes in ns plus its transfer timeout; a pacing
        sleep and scheduling get a few seconds more."""
        return total_bytes * 1e-9 + self._engine_timeout_s + _COMPLETION_SLACK_S

    def _engine_close(self) -> None:
        # The binding has no shutdown call; dropping the last reference runs the engine's destructor.
        self._engine = None
