"""NIXL transfer backend (UCX underneath): the only module in pdkv that imports ``nixl``.

Owns: ``NixlConfig`` (the UCX and NIXL settings that matter, the progress intervals), ``NixlBackend`` (a
``TransferBackend`` over one ``nixl_agent`` with its UCX backend), ``load_nixl`` (the import, turned
into a clear ``EngineUnavailableError``; nixl's own logging is routed into Python's, off stdout) and the
peer metadata format (``encode_peer_metadata`` / ``decode_peer_metadata``). Must not assume TCP or cma:
production runs RDMA and cuda_ipc; facts that hold only for host transports are named as such. Why
each rule below holds is in ``specs/nixl.md`` (with the NIXL and UCX sources it rests on).

How the agent is driven (nixl-cu12 1.5.1, UCX 1.22 bundled; facts in ``notes/nixl.md``):

- One agent per backend, its progress thread off (the Python API fixes its delay at 0: it would spin a
  core per idle agent) and no listener thread; one UCX backend with one worker (``num_workers`` 1: every
  write to a peer goes through one UCX endpoint, which the fence rule needs) and peer error handling.
  The agent is single-threaded (``NIXL_THREAD_SYNC_NONE``): every call into it holds ``_agent_lock``.
- Peers: ``session_id`` is ``host:pdkv-<pid>-<random>`` (the agent's name; the host part is what a
  decode cuts, as with Mooncake). ``engine_metadata`` is the agent's metadata plus the list of regions
  registered here (address, length, DRAM/VRAM, device), sent in ``Register``; ``add_peer`` loads it.
  The region list lets a write be checked (and its memory kinds chosen) before NIXL sees it.
- A piece of a batch becomes one NIXL WRITE per (local kind, remote kind) group, posted on the lane's
  launcher (the submitting thread posts a small idle piece itself). With cma the post moves the bytes
  before it returns (DONE); otherwise the lane's completer polls ``check_xfer_state`` (which is what
  drives UCX) with a bounded, doubling wait between polls (``completion_poll_s`` up to
  ``completion_poll_max_s``), which the progress thread below cuts short: every call into the agent
  makes progress for all its transfers, so after each of its polls it checks the transfers a
  completer waits for and wakes that completer once they all ended. A completion made by the
  progress thread's poll is seen then, not at the completer's next poll (up to
  ``completion_poll_max_s`` later; the progress thread polls every ``busy_poll_s`` while a write is
  in flight). A piece still in progress after ``transfer_timeout_s`` is released and FAILED: its
  bytes at the peer are undefined and may still land (UCX cannot cancel a put); a later write to the
  same peer completing (pdkv's fence) proves they ended, because every NIXL WRITE ends with a UCX
  endpoint flush (``specs/nixl.md``, section 2).
- Target progress: with the progress thread off nothing moves towards this agent unless it calls in
  (UCX wire-up, and every byte over ``UCX_TLS=tcp``). A thread polls the agent every ``idle_poll_s``
  (a few % of a core at 1 ms on this machine; about 1% at 2 ms), every ``busy_poll_s`` for
  ``busy_window_s`` after a write notification arrived (each write carries one) or this backend
  launched a write its post did not complete (a cma post moves the bytes itself: nothing to
  progress). Nothing else spins.
- Failures are FAILED batches: a peer that died (or whose connection a decode cut) gives
  ``nixlRemoteDisconnectError``, and the peer's endpoint stays failed; the backend removes the peer and
  loads its metadata again on its next write (a new endpoint), so a peer that is still there, or comes
  back under the same name, is reachable again. The backend never sends a standalone notification: one
  queued to a peer that died before UCX noticed, followed by agent teardown, aborts the process
  inside UCX (``arbiter.c``, exit 134; reproduced here). ``close()`` waits for every batch, removes
  every peer, lets the worker progress for ``teardown_progress_s``, then drops the agent.
- Memory: a CUDA tensor registers as VRAM on its device; a raw range asks the CUDA driver what the
  pointer is (``cuPointerGetAttribute``; host memory when there is no driver); everything else is DRAM.
- UCX reads its ``UCX_*`` settings from the environment when an agent starts, NIXL its
  ``NIXL_LOG_LEVEL``: the backend sets the configured ones in ``os.environ`` first (process-wide, as
  Mooncake's ``MC_*``); settings left ``None`` leave the environment alone.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import enum
import functools
import importlib
import importlib.util
import itertools
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Final, Protocol, cast

import attrs
import msgpack
import numpy as np
import numpy.typing as npt

from pdkv import config
from pdkv.engine import sockets
from pdkv.engine._threaded import PieceFailed, PieceJob, WorkerThreadBackend
from pdkv.engine.backend import (
    BackendClosedError,
    MemoryRegion,
    Registration,
    RegistrationError,
)
from pdkv.errors import ConfigError, EngineUnavailableError
from pdkv.errors.engine import PeerMetadataError
from pdkv.mapping.blocks import IntArray, TransferBlocks

if TYPE_CHECKING:  # the stubs in typings/ (every build has the same API)
    from nixl_cu12._api import nixl_agent as _RealAgent
    from nixl_cu12._api import nixl_agent_config as _RealAgentConfig

log = logging.getLogger(__name__)

NIXL_MODULES: Final = ("nixl", "nixl_cu12", "nixl_cu13")
"""Where the Python API may live: the ``nixl`` meta package (it picks the CUDA build), or one build."""
INSTALL_HINT: Final = "pip install --no-deps nixl-cu12==1.5.1 (its metadata pulls a CUDA torch)"

_ENGINE_START = threading.Lock()  # agents start one at a time: the ports that appear meanwhile are its own

# Transports whose writes are done by a CPU of one of the two hosts, or travel in a TCP connection of the
# decode's: after pdkv's fence, a cut of those connections leaves nothing that can still land.
HOST_TRANSPORTS: Final = frozenset({"tcp", "cma", "self", "sm", "shm", "posix", "sysv", "xpmem", "knem"})
RDMA_DEVICES_ROOT: Final = "/sys/class/infiniband"

_WRITE_NOTIFICATION: Final = b"pdkv"
"""Carried by every write: the target's progress thread sees it and polls fast for a while."""

METADATA_VERSION: Final = 1
MAX_PEER_REGIONS: Final = 1 << 16


class NixlMemory(enum.Enum):
    DRAM = "DRAM"
    VRAM = "VRAM"


class ErrorHandling(enum.Enum):
    PEER = "peer"  # UCX reports a failed peer (NIXL's nixlRemoteDisconnectError); pdkv's default
    NONE = "none"  # lets UCX_TLS=sm run alone, but a dead peer may go unreported: never in production


# ---------------------------------------------------------------------------------------- config


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{attribute.name} must be a positive number, got {value!r}")


def _positive_int(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive int, got {value!r}")


def _non_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{attribute.name} must be a number >= 0, got {value!r}")


def _ucx_or_nixl_names(
    _: object, attribute: attrs.Attribute[Mapping[str, str]], value: Mapping[str, str]
) -> None:
    for key in value:
        if not key.startswith(("UCX_", "NIXL_")):
            raise ConfigError(f"{attribute.name} holds UCX_* and NIXL_* settings only, got {key!r}")


def _optional_text(_: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"{attribute.name} must be a non-empty string or None, got {value!r}")


def _to_error_handling(value: ErrorHandling | str) -> ErrorHandling:
    try:
        return ErrorHandling(value)
    except ValueError:
        raise ConfigError(f"error_handling must be 'peer' or 'none', got {value!r}") from None


@attrs.frozen(kw_only=True)
class NixlConfig:
    """How to start one NIXL agent. ``environment()`` lists the ``UCX_*`` / ``NIXL_*`` variables it sets."""

    hostname: str = attrs.field(
        default="127.0.0.1",
        metadata=config.text_var("PDKV_NIXL_HOSTNAME", "NIXL: the address peers reach this host at"),
    )
    # UCX_TLS: None keeps UCX's choice (all transports it finds: cma + tcp on a host without RDMA).
    ucx_tls: str | None = attrs.field(
        default=None,
        validator=_optional_text,
        metadata=config.text_var("PDKV_NIXL_UCX_TLS", "NIXL: UCX_TLS (e.g. tcp, or rc,cuda_ipc)"),
    )
    # UCX_NET_DEVICES: None keeps UCX's choice (every device); tests on one host use "lo".
    ucx_net_devices: str | None = attrs.field(
        default=None,
        validator=_optional_text,
        metadata=config.text_var("PDKV_NIXL_UCX_NET_DEVICES", "NIXL: UCX_NET_DEVICES (e.g. mlx5_0:1, lo)"),
    )
    error_handling: ErrorHandling = attrs.field(default=ErrorHandling.PEER, converter=_to_error_handling)
    # NIXL_LOG_LEVEL for the library's own log lines (TRACE DEBUG INFO WARN ERROR FATAL).
    log_level: str | None = "WARN"
    # Any other UCX_* / NIXL_* setting, passed through verbatim.
    extra_environment: Mapping[str, str] = attrs.field(factory=dict, validator=_ucx_or_nixl_names)
    # Most entries in flight towards one peer (NIXL has no queue limit; the executor's shapes fit).
    max_entries_in_flight: int = attrs.field(default=8192, validator=_positive_int)
    # A piece still in progress this long after its post is released and FAILED.
    transfer_timeout_s: float = attrs.field(
        default=30.0,
        validator=_positive,
        metadata=config.seconds_var("PDKV_NIXL_TRANSFER_TIMEOUT", "NIXL: seconds before a write fails"),
    )
    idle_poll_s: float = attrs.field(default=0.002, validator=_positive)
    busy_poll_s: float = attrs.field(default=0.0001, validator=_positive)
    busy_window_s: float = attrs.field(default=0.1, validator=_non_negative)
    completion_poll_s: float = attrs.field(default=0.00005, validator=_positive)
    completion_poll_max_s: float = attrs.field(default=0.001, validator=_positive)
    # The submitting thread posts a piece itself only up to this size: a cma post copies every byte
    # before it returns (16 MiB: about 1.5 ms here); larger pieces go to the lane.
    inline_max_bytes: int = attrs.field(default=16 << 20, validator=_positive_int)
    teardown_progress_s: float = attrs.field(default=0.05, validator=_non_negative)

    def environment(self) -> dict[str, str]:
        """The variables this config sets before the agent starts."""
        env = dict(self.extra_environment)
        if self.ucx_tls is not None:
            env["UCX_TLS"] = self.ucx_tls
        if self.ucx_net_devices is not None:
            env["UCX_NET_DEVICES"] = self.ucx_net_devices
        if self.log_level is not None:
            env["NIXL_LOG_LEVEL"] = self.log_level
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NixlConfig:
        """Defaults, overridden by ``PDKV_NIXL_HOSTNAME``, ``_UCX_TLS``, ``_UCX_NET_DEVICES`` and
        ``_TRANSFER_TIMEOUT`` (seconds) when set."""
        return config.from_env(cls, env)


# ------------------------------------------------------------------------------- the nixl module


class XferHandle(Protocol):
    def release(self) -> None: ...


class NixlAgentApi(Protocol):
    """The part of ``nixl._api.nixl_agent`` this backend calls."""

    def create_backend(self, backend: str, initParams: dict[str, str]) -> None: ...
    def register_memory(self, reg_list: list[tuple[int, int, int, str]], mem_type: str) -> object: ...
    def deregister_memory(self, dereg_list: object) -> None: ...
    def get_agent_metadata(self) -> bytes: ...
    def add_remote_agent(self, metadata: bytes) -> bytes | str: ...
    def remove_remote_agent(self, agent: str) -> None: ...
    def get_xfer_descs(self, descs: npt.NDArray[np.uint64], mem_type: str) -> object: ...
    def initialize_xfer(
        self, operation: str, local_descs: object, remote_descs: object, remote_agent: str, notif_msg: bytes
    ) -> XferHandle: ...
    def transfer(self, handle: XferHandle) -> str: ...
    def check_xfer_state(self, handle: XferHandle) -> str: ...
    def get_new_notifs(self) -> Mapping[str, Sequence[bytes]]: ...


AgentFactory = Callable[[str, "NixlConfig"], NixlAgentApi]


@contextlib.contextmanager
def _nixl_logging_contained() -> Iterator[None]:
    """nixl configures a logger that prints INFO lines to stdout and changes ``logging.raiseExceptions``
    when first imported; keep the host's value and route nixl's lines through Python logging instead."""
    raise_exceptions = logging.raiseExceptions
    try:
        yield
    finally:
        logging.raiseExceptions = raise_exceptions
        nixl_logger = logging.getLogger("nixl")
        for handler in list(nixl_logger.handlers):
            nixl_logger.removeHandler(handler)
        nixl_logger.propagate = True
        level = os.environ.get("NIXL_LOG_LEVEL", "WARN").upper()
        nixl_logger.setLevel({"TRACE": 10, "DEBUG": 10, "INFO": 20, "ERROR": 40, "FATAL": 50}.get(level, 30))


def load_nixl(import_module: Callable[[str], ModuleType] = importlib.import_module) -> ModuleType:
    """The ``_api`` module of the installed NIXL Python package, or an ``EngineUnavailableError`` that
    says what to install."""
    missing: list[str] = []
    for name in NIXL_MODULES:
        try:
            with _nixl_logging_contained():
                return import_module(f"{name}._api")
        except ModuleNotFoundError as exc:
            if exc.name not in (name, f"{name}._api"):
                raise EngineUnavailableError(
                    f"{name} is installed but cannot load {exc.name}: {exc}"
                ) from exc
            missing.append(name)
        except ImportError as exc:
            raise EngineUnavailableError(f"{name}._api failed to import: {exc}") from exc
    raise EngineUnavailableError(f"NIXL is not installed (none of {', '.join(missing)}): {INSTALL_HINT}")


def real_agent_factory(api: ModuleType | None = None) -> AgentFactory:
    """A factory of real agents: progress thread and listener off, one UCX backend with one worker."""
    module = api or load_nixl()
    agent_class = cast("type[_RealAgent]", module.nixl_agent)
    config_class = cast("type[_RealAgentConfig]", module.nixl_agent_config)

    def make(name: str, cfg: NixlConfig) -> NixlAgentApi:
        agent_config = config_class(enable_prog_thread=False, enable_listen_thread=False, backends=[])
        with _nixl_logging_contained():
            agent = agent_class(name, agent_config)
            agent.create_backend(
                "UCX", {"num_workers": "1", "ucx_error_handling_mode": cfg.error_handling.value}
            )
        # Its transfer handles are nixl_xfer_handle, which the protocol's XferHandle describes.
        return cast(NixlAgentApi, agent)

    return make


# ------------------------------------------------------------------------------ memory kinds


_CU_POINTER_ATTRIBUTE_MEMORY_TYPE: Final = 2
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: Final = 9
_CU_MEMORYTYPE_DEVICE: Final = 2


class _CudaDriver:
    """``cuPointerGetAttribute`` from libcuda, loaded on first use (None when there is no driver)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded = False
        self._get: Callable[..., int] | None = None

    def _function(self) -> Callable[..., int] | None:
        with self._lock:
            if not self._loaded:
                self._loaded = True
                try:
                    self._get = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute
                except (OSError, AttributeError):
                    self._get = None
            return self._get

    def device_of(self, address: int) -> int | None:
        """The CUDA device whose memory ``address`` is, or None (host memory, or no CUDA here)."""
        get = self._function()
        if get is None:
            return None
        kind, device = ctypes.c_uint(0), ctypes.c_int(-1)
        if get(ctypes.byref(kind), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ctypes.c_uint64(address)) != 0:
            return None  # not a CUDA pointer (or the driver is not initialised: no device memory yet)
        if kind.value != _CU_MEMORYTYPE_DEVICE:
            return None
        if get(ctypes.byref(device), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ctypes.c_uint64(address)) != 0:
            return None
        return device.value


_CUDA = _CudaDriver()

MemoryOf = Callable[[int, object], tuple[NixlMemory, int]]


def memory_of(address: int, keepalive: object) -> tuple[NixlMemory, int]:
    """(kind, device) of a region: a CUDA tensor's own device, else what the CUDA driver says of the
    pointer, else host memory on device 0."""
    if getattr(keepalive, "is_cuda", False):
        device = getattr(getattr(keepalive, "device", None), "index", None)
        return NixlMemory.VRAM, int(device or 0)
    device_index = _CUDA.device_of(address)
    if device_index is not None:
        return NixlMemory.VRAM, device_index
    return NixlMemory.DRAM, 0


# ---------------------------------------------------------------------------- peer metadata


@attrs.frozen
class PeerRegions:
    """The regions a peer registered, sorted by address (arrays for a vectorised containment check)."""

    starts: IntArray
    ends: IntArray
    vram: npt.NDArray[np.bool_]
    devices: IntArray

    @classmethod
    def build(cls, regions: Sequence[tuple[int, int, NixlMemory, int]]) -> PeerRegions:
        ordered = sorted(regions)
        return cls(
            starts=np.array([r[0] for r in ordered], dtype=np.int64),
            ends=np.array([r[0] + r[1] for r in ordered], dtype=np.int64),
            vram=np.array([r[2] is NixlMemory.VRAM for r in ordered], dtype=np.bool_),
            devices=np.array([r[3] for r in ordered], dtype=np.int64),
        )

    def __len__(self) -> int:
        return int(self.starts.size)

    def locate(self, addresses: IntArray, lengths: IntArray) -> tuple[IntArray, int]:
        """Index of the region holding each block, and the first block held by none (-1: all held)."""
        if self.starts.size == 0:
            return np.zeros(addresses.size, dtype=np.int64), (0 if addresses.size else -1)
        slot = np.searchsorted(self.starts, addresses, side="right") - 1
        inside = (slot >= 0) & (addresses + lengths <= self.ends[np.maximum(slot, 0)])
        if inside.all():
            return slot, -1
        return slot, int(np.flatnonzero(~inside)[0])


@attrs.frozen
class PeerMetadata:
    """What ``engine_metadata`` carries: the agent's name, its NIXL metadata, its registered regions."""

    agent: str
    nixl: bytes
    regions: PeerRegions


def encode_peer_metadata(
    agent: str, nixl: bytes, regions: Sequence[tuple[int, int, NixlMemory, int]]
) -> bytes:
    """msgpack ``{"v": 1, "agent": str, "nixl": bin, "regions": [[address, length, kind, device], ...]}``."""
    body = {
        "v": METADATA_VERSION,
        "agent": agent,
        "nixl": nixl,
        "regions": [[a, n, kind.value, device] for a, n, kind, device in regions],
    }
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


def _bad(reason: str) -> PeerMetadataError:
    return PeerMetadataError(f"peer engine metadata: {reason}")


def decode_peer_metadata(blob: bytes) -> PeerMetadata:
    """The metadata a peer sent; ``PeerMetadataError`` for anything else (it is remote input)."""
    if not isinstance(blob, (bytes, bytearray)) or not blob:
        raise _bad("empty: the peer runs an engine that sends none (is it on Mooncake?)")
    try:
        body = msgpack.unpackb(bytes(blob), raw=False, strict_map_key=True, max_ext_len=0)
    except (ValueError, TypeError) as exc:  # msgpack's format, limit and UTF-8 errors
        raise _bad(f"not msgpack ({exc})") from None
    if not isinstance(body, dict) or set(body) != {"v", "agent", "nixl", "regions"}:
        keys = sorted(map(str, body)) if isinstance(body, dict) else type(body).__name__
        raise _bad(f"expected keys v, agent, nixl, regions; got {keys}")
    if body["v"] != METADATA_VERSION or type(body["v"]) is not int:
        raise _bad(f"version {body['v']!r}, this side reads version {METADATA_VERSION}")
    agent, nixl, items = body["agent"], body["nixl"], body["regions"]
    if not isinstance(agent, str) or not agent:
        raise _bad("agent must be a non-empty str")
    if not isinstance(nixl, bytes) or not nixl:
        raise _bad("nixl must be non-empty bytes")
    if not isinstance(items, list) or len(items) > MAX_PEER_REGIONS:
        raise _bad(f"regions must be a list of at most {MAX_PEER_REGIONS}")
    regions: list[tuple[int, int, NixlMemory, int]] = []
    for i, item in enumerate(items):
        if not (isinstance(item, list) and len(item) == 4):
            raise _bad(f"region {i} must be [address, length, kind, device]")
        address, length, kind, device = item
        ints_ok = all(type(v) is int for v in (address, length, device))
        in_range = (
            ints_ok and address > 0 and length > 0 and address + length < 2**63 and 0 <= device < 1 << 16
        )
        if not in_range:
            raise _bad(f"region {i} has address {address!r}, length {length!r}, device {device!r}")
        if kind not in ("DRAM", "VRAM"):
            raise _bad(f"region {i} has kind {kind!r}, expected DRAM or VRAM")
        regions.append((address, length, NixlMemory(kind), device))
    ordered = sorted(regions)
    for (a0, n0, *_), (a1, *_) in itertools.pairwise(ordered):
        if a0 + n0 > a1:
            raise _bad(f"regions {a0:#x}+{n0} and {a1:#x} overlap")
    return PeerMetadata(agent=agent, nixl=nixl, regions=PeerRegions.build(regions))


# ------------------------------------------------------------------------------------ backend


@attrs.define
class _Peer:
    metadata: PeerMetadata
    loaded: bool = False  # NIXL holds the agent's metadata now (it drops it on a disconnect)


@attrs.define(eq=False)
class _Region:
    region: MemoryRegion
    kind: NixlMemory
    device: int
    descriptors: object  # what register_memory returned, for deregister_memory


@attrs.define(eq=False)
class LaunchedWrite:
    """The NIXL transfers of one piece, and whether each is done."""

    handles: list[XferHandle]
    done: list[bool]
    launched_at: float


@attrs.define(eq=False)
class _AwaitedWrite:
    """The transfers of one piece a completer is waiting for: ``pending`` indexes ``token.handles``.
    Checked by the completer and by the progress thread, both under the agent lock; ``ended`` is set
    by the progress thread when it found the last pending one ended (DONE, ERR or an error)."""

    job: PieceJob
    token: LaunchedWrite
    pending: list[int]
    failure: str | None
    ended: threading.Event = attrs.Factory(threading.Event)


@attrs.frozen(kw_only=True)
class ProgressStatistics:
    """What the target-progress thread did (an operator's "is it spinning?")."""

    polls: int
    busy_polls: int
    notifications: int
    reconnects: int


_Table = npt.NDArray[np.uint64]
_Group = tuple[NixlMemory, NixlMemory, _Table, _Table]  # local kind, remote kind, their descriptor tables


def _descriptors(addresses: IntArray, lengths: IntArray, devices: IntArray) -> npt.NDArray[np.uint64]:
    """NIXL's N x 3 descriptor table: address, length, device id."""
    table = np.empty((addresses.size, 3), dtype=np.uint64)
    table[:, 0] = addresses
    table[:, 1] = lengths
    table[:, 2] = devices
    return table


def _nixl_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


def _disconnected(exc: BaseException) -> bool:
    return "Disconnect" in type(exc).__name__


class NixlBackend(WorkerThreadBackend[LaunchedWrite]):
    """A ``TransferBackend`` over one NIXL agent (one per rank).

    ``agent_factory`` replaces the real agent (tests pass a fake with the same methods); ``memory_kind``
    replaces the CUDA pointer query (tests); ``clock`` times the completion polls and ``sleep``, if
    given, replaces the completer's wait between two of them (a fake clock's: it cannot be cut short,
    so a completion the progress thread saw is only seen at the completer's next poll).
    """

    def __init__(
        self,
        config: NixlConfig | None = None,
        *,
        agent_factory: AgentFactory | None = None,
        memory_kind: MemoryOf = memory_of,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.config = cfg = config or NixlConfig()
        os.environ.update(cfg.environment())
        make_agent = agent_factory or real_agent_factory()
        host = cfg.hostname
        self._session_id = f"{host}:pdkv-{os.getpid()}-{secrets.token_hex(4)}"
        with _ENGINE_START:  # the ports that appear meanwhile are this agent's (its UCX tcp listeners)
            before = _listening_ports()
            try:
                agent = make_agent(self._session_id, cfg)
            except EngineUnavailableError:
                raise
            except Exception as exc:
                raise EngineUnavailableError(
                    f"NIXL agent {self._session_id!r} did not start ({_nixl_error(exc)}); check UCX_TLS "
                    f"({os.environ.get('UCX_TLS', 'unset')}) and UCX_NET_DEVICES "
                    f"({os.environ.get('UCX_NET_DEVICES', 'unset')})"
                ) from exc
            self._engine_ports = _listening_ports() - before
        self._agent: NixlAgentApi | None = agent
        self._agent_lock = threading.Lock()
        self._memory_kind = memory_kind
        self._registering = threading.local()  # the memory kind of the region being registered
        self._sleep = sleep
        self._awaited: set[_AwaitedWrite] = set()  # under the agent lock; see _finish_transfers
        self._peers: dict[str, _Peer] = {}
        self._refused: dict[str, str] = {}  # session -> why its metadata was refused (no peer then)
        self._registered: dict[int, _Region] = {}  # by address (under the registry lock)
        self._local_kinds = PeerRegions.build([])  # snapshot of ours, replaced on (un)registration
        self._metadata: bytes | None = None  # cached engine_metadata, cleared by (un)registration
        self._has_vram = False
        self._polls = self._busy_polls = self._notifications = self._reconnects = 0
        self._busy_until = 0.0
        self._stop = threading.Event()
        super().__init__(
            max_entries_in_flight=cfg.max_entries_in_flight, thread_name="pdkv-nixl", clock=clock
        )
        self._progress = threading.Thread(target=self._progress_loop, name="pdkv-nixl-progress", daemon=True)
        self._progress.start()
        # A backend nobody closed is closed while the interpreter is still whole: left to the end of the
        # process, the agent died with the progress thread inside it (a C++ terminate, 1 exit in 6).
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)

    # ------------------------------------------------------------------------- identity

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def engine_ports(self) -> frozenset[int]:
        """The TCP ports this backend's agent listens on (UCX's tcp interfaces)."""
        return self._engine_ports

    @property
    def engine_metadata(self) -> bytes:
        with self._registry_lock:
            if self._metadata is None:
                with self._agent_lock:
                    nixl = self._live_agent().get_agent_metadata()
                regions = [
                    (r.region.address, r.region.length, r.kind, r.device) for r in self._registered.values()
                ]
                self._metadata = encode_peer_metadata(self._session_id, nixl, regions)
            return self._metadata

    def add_peer(self, session: str, metadata: bytes) -> None:
        if self.closed:
            raise BackendClosedError(f"backend {self._session_id} is closed")
        try:
            decoded = decode_peer_metadata(metadata)
            if decoded.agent != session:
                raise PeerMetadataError(
                    f"peer engine metadata names agent {decoded.agent!r}, but the peer registered as "
                    f"{session!r}"
                )
            with self._agent_lock:
                try:
                    self._live_agent().add_remote_agent(decoded.nixl)
                except Exception as exc:
                    raise PeerMetadataError(
                        f"NIXL refused the metadata of {session!r}: {_nixl_error(exc)}"
                    ) from exc
                self._peers[session] = _Peer(metadata=decoded, loaded=True)
                self._refused.pop(session, None)
        except PeerMetadataError as exc:
            with self._agent_lock:
                if session not in self._peers:  # a peer known before keeps its older metadata
                    self._refused[session] = str(exc)
            raise

    def peers(self) -> list[str]:
        """Sessions whose metadata this backend holds."""
        with self._agent_lock:
            return sorted(self._peers)

    def progress_statistics(self) -> ProgressStatistics:
        return ProgressStatistics(
            polls=self._polls,
            busy_polls=self._busy_polls,
            notifications=self._notifications,
            reconnects=self._reconnects,
        )

    # ------------------------------------------------------------------------- registration

    def _live_agent(self) -> NixlAgentApi:
        if self._agent is None:
            raise RegistrationError(f"NIXL agent of {self._session_id} was released")
        return self._agent

    def register_range(self, address: int, length: int, *, keepalive: object = None) -> Registration:
        # A tensor (register() hands it on as keepalive) says itself whether it lives on a GPU; the kind
        # reaches _engine_register on this thread, inside the base class's registration.
        self._registering.kind = self._memory_kind(address, keepalive)
        try:
            return super().register_range(address, length, keepalive=keepalive)
        finally:
            self._registering.kind = None

    def _engine_register(self, region: MemoryRegion) -> None:
        chosen: tuple[NixlMemory, int] | None = getattr(self._registering, "kind", None)
        kind, device = chosen if chosen is not None else self._memory_kind(region.address, None)
        with self._agent_lock:
            try:
                descriptors = self._live_agent().register_memory(
                    [(region.address, region.length, device, "")], kind.value
                )
            except Exception as exc:
                raise RegistrationError(
                    f"NIXL register_memory({region.address:#x}, {region.length}, {kind.value} device "
                    f"{device}) failed: {_nixl_error(exc)}"
                ) from exc
        self._registered[region.address] = _Region(region, kind, device, descriptors)
        self._has_vram = self._has_vram or kind is NixlMemory.VRAM
        self._registrations_changed()

    def _engine_unregister(self, region: MemoryRegion) -> None:
        entry = self._registered.pop(region.address, None)
        self._registrations_changed()
        if entry is None:
            return
        with self._agent_lock:
            try:
                self._live_agent().deregister_memory(entry.descriptors)
            except Exception as exc:
                raise RegistrationError(
                    f"NIXL deregister_memory({region.address:#x}) failed: {_nixl_error(exc)}"
                ) from exc

    def _registrations_changed(self) -> None:
        self._metadata = None
        self._local_kinds = PeerRegions.build(
            [(r.region.address, r.region.length, r.kind, r.device) for r in self._registered.values()]
        )

    # ------------------------------------------------------------------------------ writes

    def _inline_launch_allowed(self, piece: TransferBlocks) -> bool:
        return piece.total_bytes <= self.config.inline_max_bytes

    def _plan(self, job: PieceJob, peer: _Peer) -> list[_Group]:
        """The piece as NIXL descriptor tables (address, length, device) per (local kind, remote kind),
        after checking every destination against the regions the peer said it registered."""
        piece = job.piece
        regions = peer.metadata.regions
        remote, outside = regions.locate(piece.dst, piece.length)
        if outside >= 0:
            raise PieceFailed(
                f"destination {int(piece.dst[outside]):#x}+{int(piece.length[outside])} (block {outside} of "
                f"{len(piece)}) is not inside a region {job.handle.peer} registered "
                f"({len(regions)} regions in its metadata)"
            )
        ours = self._local_kinds  # submit_write checked every source against our registrations
        local, _ = ours.locate(piece.src, piece.length)
        local_vram, remote_vram = ours.vram[local], regions.vram[remote]
        plan: list[_Group] = []
        for lv in (False, True):
            for rv in (False, True):
                rows = np.flatnonzero((local_vram == lv) & (remote_vram == rv))
                if rows.size == 0:
                    continue
                lengths = piece.length[rows]
                plan.append(
                    (
                        NixlMemory.VRAM if lv else NixlMemory.DRAM,
                        NixlMemory.VRAM if rv else NixlMemory.DRAM,
                        _descriptors(piece.src[rows], lengths, ours.devices[local[rows]]),
                        _descriptors(piece.dst[rows], lengths, regions.devices[remote[rows]]),
                    )
                )
        return plan

    def _launch(self, job: PieceJob) -> LaunchedWrite:
        name = job.handle.peer
        with self._agent_lock:
            peer = self._peers.get(name)
            refused = self._refused.get(name)
        if peer is None:
            if refused is not None:
                raise PieceFailed(f"cannot write to {name!r}: its engine metadata was refused ({refused})")
            raise PieceFailed(
                f"no NIXL metadata for peer {name!r}: it never registered with this rank (its Register "
                "carries the metadata) or it was removed"
            )
        plan = self._plan(job, peer)
        piece = job.piece
        launched = LaunchedWrite(handles=[], done=[], launched_at=self._clock())
        failure: str | None = None
        with self._agent_lock:
            agent = self._live_agent()
            try:
                if not peer.loaded:
                    # NIXL 1.5.1 keeps a peer whose endpoint failed (its connection stays failed):
                    # remove it first, or loading its metadata again keeps the dead endpoint.
                    with contextlib.suppress(Exception):
                        agent.remove_remote_agent(name)
                    agent.add_remote_agent(peer.metadata.nixl)
                    peer.loaded = True
                    self._reconnects += 1
                for local_kind, remote_kind, local_table, remote_table in plan:
                    local = agent.get_xfer_descs(local_table, local_kind.value)
                    remote = agent.get_xfer_descs(remote_table, remote_kind.value)
                    handle = agent.initialize_xfer("WRITE", local, remote, name, _WRITE_NOTIFICATION)
                    launched.handles.append(handle)
                    launched.done.append(False)
                    state = agent.transfer(handle)
                    if state == "ERR":
                        raise PieceFailed(f"NIXL refused to post {len(local_table)} blocks to {name!r} (ERR)")
                    launched.done[-1] = state == "DONE"
            except PieceFailed as exc:
                failure = str(exc)
            except Exception as exc:
                if _disconnected(exc):
                    peer.loaded = False  # NIXL forgot the peer; the next write loads it again
                failure = f"NIXL failed to post {len(piece)} blocks to {name!r}: {_nixl_error(exc)}"
        if not all(launched.done):
            # Something of it is still moving (tcp, or a transport that needs this agent's calls): the
            # progress thread polls fast while it does. A write whose post moved every byte (cma)
            # leaves nothing to progress: the thread stays at its idle interval (polling every
            # busy_poll_s for busy_window_s after each such write was CPU spent for nothing).
            self._busy_until = self._clock() + self.config.busy_window_s
        if failure is not None:
            # Transfers of the piece already posted must end before the piece is reported.
            self._finish_transfers(job, launched, failure)
            raise PieceFailed(failure)
        return launched

    def _complete(self, job: PieceJob, token: LaunchedWrite) -> None:
        failure = self._finish_transfers(job, token, None)
        if failure is not None:
            raise PieceFailed(failure)

    def _finish_transfers(self, job: PieceJob, token: LaunchedWrite, failure: str | None) -> str | None:
        """Poll the piece's transfers until each ended (or the timeout released it), release them all.
        Returns the first failure (``failure`` when given)."""
        cfg = self.config
        deadline = token.launched_at + cfg.transfer_timeout_s
        delay = cfg.completion_poll_s
        awaited = _AwaitedWrite(job, token, [i for i, done in enumerate(token.done) if not done], failure)
        try:
            # Nothing pending after a cma post (done inside it), or once the progress thread saw all end.
            while awaited.pending:
                with self._agent_lock:
                    self._check_transfers(awaited, self._agent)
                    if not awaited.pending:
                        break
                    # Watched by the progress thread from here on: under the lock of this poll, so no
                    # completion one of its polls makes can fall between this poll and the watch.
                    awaited.ended.clear()
                    self._awaited.add(awaited)
                if self._clock() >= deadline:
                    awaited.failure = awaited.failure or (
                        f"NIXL write of {len(job.piece)} blocks to {job.handle.peer!r} not complete after "
                        f"{cfg.transfer_timeout_s:g} s: released; its bytes at the peer are undefined until "
                        "a later write to that peer completes"
                    )
                    break
                self._busy_until = self._clock() + cfg.busy_window_s
                if self._sleep is None:
                    awaited.ended.wait(delay)  # set by the progress thread once every transfer ended
                else:
                    self._sleep(delay)
                delay = min(delay * 2, cfg.completion_poll_max_s)
        finally:
            with self._agent_lock:
                self._awaited.discard(awaited)
                for handle in token.handles:
                    try:
                        handle.release()
                    except Exception as exc:  # an in-flight handle that cannot be released: log, go on
                        log.warning(
                            "releasing a NIXL write to %s failed: %s", job.handle.peer, _nixl_error(exc)
                        )
                token.handles.clear()
        return awaited.failure

    def _check_transfers(self, awaited: _AwaitedWrite, agent: NixlAgentApi | None) -> None:
        """Ask NIXL about each pending transfer of ``awaited`` (agent lock held): those that ended leave
        ``pending``, the first failure is kept. Any thread that holds the lock may ask: the call is
        also what makes UCX progress."""
        still: list[int] = []
        peer = awaited.job.handle.peer
        for i in awaited.pending:
            if agent is None:
                awaited.failure = awaited.failure or "NIXL agent released while a write was in flight"
                continue
            try:
                state = agent.check_xfer_state(awaited.token.handles[i])
            except Exception as exc:
                if _disconnected(exc):
                    self._forget_connection(peer)
                awaited.failure = awaited.failure or f"NIXL write to {peer!r} failed: {_nixl_error(exc)}"
                continue
            if state == "DONE":
                awaited.token.done[i] = True
                continue
            if state == "ERR":
                awaited.failure = awaited.failure or f"NIXL reported the write to {peer!r} failed (ERR)"
                continue
            still.append(i)
        awaited.pending = still

    def _forget_connection(self, name: str) -> None:
        """NIXL dropped ``name`` after a disconnect (agent lock held): load it again on the next write."""
        peer = self._peers.get(name)
        if peer is not None:
            peer.loaded = False

    def _completion_bound_s(self, total_bytes: int) -> float:
        return self.config.transfer_timeout_s + 5.0

    # ------------------------------------------------------------------------- progress

    def _progress_loop(self) -> None:
        cfg = self.config
        interval = cfg.idle_poll_s
        while not self._stop.wait(interval):
            with self._agent_lock:
                agent = self._agent
                if agent is None:
                    return
                try:
                    notes = agent.get_new_notifs()
                except Exception as exc:  # never let the progress thread die
                    log.warning("NIXL progress of %s failed: %s", self._session_id, _nixl_error(exc))
                    notes = {}
                # That call made progress for every transfer of the agent: a completer waiting for
                # one it ended learns it now, not at its own next poll (up to completion_poll_max_s).
                for awaited in self._awaited:
                    if awaited.pending:
                        self._check_transfers(awaited, agent)
                        if not awaited.pending:
                            awaited.ended.set()
            now = self._clock()
            arrived = sum(len(v) for v in notes.values())
            self._polls += 1
            if arrived:
                self._notifications += arrived
                self._busy_until = now + cfg.busy_window_s
            busy = now < self._busy_until
            self._busy_polls += busy
            interval = cfg.busy_poll_s if busy else cfg.idle_poll_s

    # ------------------------------------------------------------------------------ cuts

    def cut_connections_from(self, host: str) -> int:
        """Destroy every TCP connection from ``host`` to this agent's UCX ports and wait until they are
        gone. A proof only where UCX moves bytes over host transports (tcp, cma, shared memory): over
        RDMA or cuda_ipc no socket carries them, and this raises ``ConnectionCutUnavailableError``."""
        unproven = self._unprovable_transports()
        if unproven is not None:
            raise sockets.ConnectionCutUnavailableError(unproven)
        if not self._engine_ports:
            raise sockets.ConnectionCutUnavailableError(
                "the agent's listening ports are unknown (sock_diag was not readable at its start)"
            )
        report = sockets.cut_connections(sockets.resolve_host(host), self._engine_ports)
        if report.cut:
            log.warning(
                "cut %d NIXL connection(s) from %s: %s",
                len(report.cut),
                host,
                ", ".join(c.describe() for c in report.cut),
            )
        return len(report.cut)

    def _unprovable_transports(self) -> str | None:
        """Why a TCP cut proves nothing here (None: UCX can only use host transports)."""
        tls = os.environ.get("UCX_TLS", "").strip().lower()
        if self._has_vram:
            return "VRAM is registered: UCX may write it with cuda_ipc or RDMA, which no TCP cut ends"
        if tls and tls not in ("all", "^"):
            names = {t.strip().lstrip("^") for t in tls.split(",") if t.strip()}
            if tls.startswith("^"):
                return f"UCX_TLS={tls} excludes transports instead of naming them: RDMA may be in use"
            extra = sorted(n for n in names if n not in HOST_TRANSPORTS)
            return None if not extra else f"UCX_TLS names {extra}, whose bytes no TCP cut ends"
        devices = sorted(os.listdir(RDMA_DEVICES_ROOT)) if os.path.isdir(RDMA_DEVICES_ROOT) else []
        if devices:
            return f"UCX_TLS is unset and RDMA devices {devices} exist: UCX may write over RDMA"
        return None

    # ----------------------------------------------------------------------------- closing

    def _engine_close(self) -> None:
        atexit.unregister(self._at_exit)
        self._stop.set()
        self._progress.join(10.0)
        with self._agent_lock:
            agent = self._agent
            if agent is None:
                return
            for name, peer in self._peers.items():
                if peer.loaded:
                    try:
                        agent.remove_remote_agent(name)
                    except Exception as exc:
                        log.debug("removing NIXL peer %s: %s", name, _nixl_error(exc))
            self._peers.clear()
            # Let the worker finish the endpoint closes it just started before the agent goes.
            deadline = time.monotonic() + self.config.teardown_progress_s
            while True:
                try:
                    agent.get_new_notifs()
                except Exception:
                    break
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.001)
            self._agent = None
        del agent  # the last reference: the agent's destructor releases UCX


def _close_at_exit(backend: weakref.ref[NixlBackend]) -> None:
    alive = backend()
    if alive is not None and not alive.closed:
        try:
            alive.close()
        except Exception as exc:  # exiting anyway: say why the engine did not close cleanly
            log.warning("closing NIXL backend %s at exit: %s", alive.session_id, exc)


def _listening_ports() -> frozenset[int]:
    """This process's listening TCP ports; empty when sock_diag cannot be read (no proven cut then)."""
    try:
        return sockets.listening_ports()
    except (sockets.ConnectionCutUnavailableError, OSError):
        return frozenset()


def nixl_available() -> bool:
    """Whether a NIXL Python package is installed here (without importing it)."""
    return any(importlib.util.find_spec(name) is not None for name in NIXL_MODULES)


class RawNixlWriter:
    """The raw NIXL agent, with no pdkv code in the path: what a benchmark compares ``NixlBackend``
    with. One agent (progress thread off, as the backend's), one registered source region, peers
    loaded from the metadata a ``NixlBackend`` published; ``write`` moves a block list as one NIXL
    WRITE and polls its state without sleeping until it is done (the fastest completion the agent
    offers, at the cost of a spinning core). DRAM on both sides only.

    Metadata reaches it as pdkv's exchange carries it (``connect`` with a peer's ``engine_metadata``)."""

    def __init__(self, config: NixlConfig, sources: Sequence[tuple[int, int]]) -> None:
        """``sources``: the (address, length) regions blocks are read from (registered here)."""
        os.environ.update(config.environment())
        self.name = f"{config.hostname}:pdkv-raw-{os.getpid()}-{secrets.token_hex(4)}"
        self._agent: NixlAgentApi | None = real_agent_factory()(self.name, config)
        self._sources = [
            self._agent.register_memory([(address, length, 0, "")], "DRAM") for address, length in sources
        ]

    def connect(self, metadata: bytes) -> str:
        """Load a peer from its ``engine_metadata``; returns its agent name."""
        peer = decode_peer_metadata(metadata)
        self._live().add_remote_agent(peer.nixl)
        return peer.agent

    def _live(self) -> NixlAgentApi:
        if self._agent is None:
            raise RegistrationError(f"raw NIXL agent {self.name} was closed")
        return self._agent

    def write(self, peer: str, blocks: TransferBlocks) -> None:
        """``blocks`` (local ``src`` -> ``peer``'s ``dst``) as one WRITE; raises unless it completed."""
        agent = self._live()
        zeros = np.zeros(len(blocks), dtype=np.int64)
        handle = agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs(_descriptors(blocks.src, blocks.length, zeros), "DRAM"),
            agent.get_xfer_descs(_descriptors(blocks.dst, blocks.length, zeros), "DRAM"),
            peer,
            b"",
        )
        try:
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL write of {len(blocks)} blocks to {peer} ended {state}")
        finally:
            handle.release()

    def close(self) -> None:
        agent, self._agent = self._agent, None
        if agent is not None:
            for descriptors in self._sources:
                agent.deregister_memory(descriptors)


__all__ = [
    "ErrorHandling",
    "LaunchedWrite",
    "NixlAgentApi",
    "NixlBackend",
    "NixlConfig",
    "NixlMemory",
    "PeerMetadata",
    "PeerRegions",
    "ProgressStatistics",
    "RawNixlWriter",
    "decode_peer_metadata",
    "encode_peer_metadata",
    "load_nixl",
    "memory_of",
    "nixl_available",
    "real_agent_factory",
]
