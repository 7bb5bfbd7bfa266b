"""Conformance suite for ``pdkv.engine.TransferBackend``: the cases every backend must pass.

Owns: the cases (``CASES``, each a named function of a ``BackendPair``), the peer-side harnesses that
hold registered destination memory and let a case look at it (``InProcessPeer`` in this process,
``SpawnedPeer`` in a child process started with multiprocessing "spawn", ``MetadataSyncedPeer`` for
engines that reach a peer through its metadata), and ready-made pairs for the shipped backends
(``loopback_pair``, ``mooncake_pair``, ``nixl_pair``). Must not know any backend's internals: a case
uses only the protocol, so a new backend passes or fails on behaviour alone.

Every case checks the bytes at the destination against an image it computes itself with numpy
slicing (never with the backend's code), and leaves the sender as it found it: no registration
left open, no batch unwaited (``run_case`` verifies both after the case).

A case failing raises ``ConformanceFailure`` (an ``AssertionError``, so pytest reports it as a test
failure); plain ``assert`` is not used because it vanishes under ``python -O``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import multiprocessing
import multiprocessing.connection
import threading
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from typing import Protocol

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.engine.backend import (
    BackendClosedError,
    BatchFailedError,
    BatchHandle,
    BatchStatus,
    MemoryRegion,
    Registration,
    RegistrationError,
    TransferBackend,
    UnregisteredMemoryError,
)
from pdkv.engine.loopback import LoopbackBackend, LoopbackConfig, LoopbackFabric
from pdkv.engine.mooncake import MooncakeBackend, MooncakeConfig
from pdkv.engine.nixl import NixlBackend, NixlConfig
from pdkv.errors import TransferError
from pdkv.mapping.blocks import TransferBlocks
from pdkv.mapping.layout import AttentionKind, BufferKind, BufferLayout, BufferSpec, ModelRole
from pdkv.runtime.checksum import WHOLE, BufferViews, Checksummer

ByteArray = npt.NDArray[np.uint8]

# Time limits for talking to a spawned peer: starting it (imports, engine start) and one request.
PEER_START_TIMEOUT_S = 120.0
PEER_CALL_TIMEOUT_S = 60.0
# How long a case waits for a batch that should finish (generous: shared 2-core machines).
BATCH_WAIT_S = 60.0


class ConformanceFailure(AssertionError):
    """A backend broke the contract of ``pdkv.engine.backend``."""


class PeerError(TransferError):
    """The peer harness failed: a request timed out, the child died, or it reported an error."""


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise ConformanceFailure(message)


# ------------------------------------------------------------------------------ memory helpers


class HostBuffer:
    """A zero-initialised byte buffer that looks like a tensor (``data_ptr``/``numel``/``element_size``)."""

    def __init__(self, nbytes: int, fill: int = 0) -> None:
        self.array: ByteArray = np.full(nbytes, fill, dtype=np.uint8)

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def numel(self) -> int:
        return int(self.array.size)

    def element_size(self) -> int:
        return 1

    def address(self, offset: int) -> int:
        return self.data_ptr() + offset


class _RegionStore:
    """Registered numpy allocations of one backend, addressable by raw address (the peer's memory)."""

    def __init__(self, backend: TransferBackend) -> None:
        self.backend = backend
        self._buffers: dict[int, tuple[HostBuffer, Registration]] = {}

    def allocate(self, nbytes: int, fill: int) -> MemoryRegion:
        buffer = HostBuffer(nbytes, fill)
        registration = self.backend.register(buffer)
        self._buffers[buffer.data_ptr()] = (buffer, registration)
        return registration.region

    def view(self, address: int, length: int) -> ByteArray:
        for base, (buffer, _) in self._buffers.items():
            if base <= address and address + length <= base + buffer.numel():
                return buffer.array[address - base : address - base + length]
        raise PeerError(f"range {address:#x}+{length} is not inside an allocation of this peer")

    def release(self, region: MemoryRegion) -> None:
        _, registration = self._buffers.pop(region.address)
        registration.close()

    def release_all(self) -> None:
        for base in list(self._buffers):
            buffer, _ = self._buffers[base]
            self.release(MemoryRegion(base, buffer.numel()))


class PeerMemory(Protocol):
    """Registered memory at the receiving end of a pair, and a way to look at it."""

    @property
    def session_id(self) -> str: ...

    def allocate(self, nbytes: int, fill: int = 0) -> MemoryRegion:
        """A new registered region of ``nbytes`` bytes, every byte set to ``fill``."""
        ...

    def fill(self, address: int, length: int, value: int) -> None: ...

    def read(self, address: int, length: int) -> bytes: ...

    def digest(self, address: int, length: int) -> str:
        """SHA-1 of the bytes (for large regions, instead of shipping them back)."""
        ...

    def release(self, region: MemoryRegion) -> None: ...

    def close(self) -> None: ...


class InProcessPeer:
    """The peer is another backend in this process (loopback, or two engines in one process)."""

    def __init__(self, backend: TransferBackend) -> None:
        self._store = _RegionStore(backend)
        self._summers: dict[tuple[tuple[tuple[int, int], ...], int], Checksummer] = {}

    @property
    def session_id(self) -> str:
        return self._store.backend.session_id

    def allocate(self, nbytes: int, fill: int = 0) -> MemoryRegion:
        return self._store.allocate(nbytes, fill)

    def fill(self, address: int, length: int, value: int) -> None:
        self._store.view(address, length)[:] = value

    def read(self, address: int, length: int) -> bytes:
        return self._store.view(address, length).tobytes()

    def digest(self, address: int, length: int) -> str:
        return hashlib.sha1(self._store.view(address, length).data).hexdigest()

    def release(self, region: MemoryRegion) -> None:
        self._store.release(region)

    def checksums(
        self, buffers: tuple[tuple[int, int], ...], item_bytes: int, items: object, positions: object
    ) -> npt.NDArray[np.uint32]:
        """``pdkv.runtime.checksum`` of whole items ``items`` at ``positions`` in each buffer
        ``(address, length)`` of this peer's memory, shape ``(buffers, items)`` (for benchmarks:
        what a decode rank's verification costs, on the memory the bytes landed in)."""
        summer = self._summers.get((buffers, item_bytes))
        if summer is None:
            specs = [
                BufferSpec(
                    kind=BufferKind.KV,
                    model=ModelRole.TARGET,
                    layer_id=i,
                    base_ptr=a,
                    length=n,
                    item_bytes=item_bytes,
                )
                for i, (a, n) in enumerate(buffers)
            ]
            layout = BufferLayout.build(attention=AttentionKind.MLA, page_size=1, buffers=specs)
            summer = self._summers[(buffers, item_bytes)] = Checksummer(BufferViews(layout))
        pairs = [(i, WHOLE) for i in range(len(buffers))]
        return summer.many(pairs, np.asarray(items, dtype=np.int64), np.asarray(positions, dtype=np.int64))

    def engine_metadata(self) -> bytes:
        """The peer backend's ``engine_metadata`` now (what its ``Register`` would carry)."""
        return self._store.backend.engine_metadata

    def close(self) -> None:
        self._store.release_all()
        self._store.backend.close()


# --------------------------------------------------------------------------- spawned peer


@attrs.frozen
class _Allocate:
    nbytes: int
    fill: int


@attrs.frozen
class _Fill:
    address: int
    length: int
    value: int


@attrs.frozen
class _Read:
    address: int
    length: int


@attrs.frozen
class _Digest:
    address: int
    length: int


@attrs.frozen
class _Release:
    address: int
    length: int


@attrs.frozen
class _Checksums:
    buffers: tuple[tuple[int, int], ...]
    item_bytes: int
    items: object
    positions: object


@attrs.frozen
class _Metadata:
    pass


@attrs.frozen
class _Stop:
    pass


_Request = _Allocate | _Fill | _Read | _Digest | _Release | _Checksums | _Metadata | _Stop


@attrs.frozen
class _Reply:
    ok: bool
    value: object
    error: str = ""


def _serve_peer(conn: multiprocessing.connection.Connection, factory: Callable[[], TransferBackend]) -> None:
    """Child process main: build the backend, announce its session id, serve requests until _Stop."""
    try:
        peer = InProcessPeer(factory())
    except Exception as exc:
        conn.send(_Reply(False, None, f"backend factory failed: {exc!r}"))
        return
    conn.send(_Reply(True, peer.session_id))
    try:
        while True:
            request = conn.recv()
            try:
                value: object = None
                if isinstance(request, _Stop):
                    peer.close()
                    conn.send(_Reply(True, None))
                    return
                if isinstance(request, _Allocate):
                    value = peer.allocate(request.nbytes, request.fill)
                elif isinstance(request, _Fill):
                    peer.fill(request.address, request.length, request.value)
                elif isinstance(request, _Read):
                    value = peer.read(request.address, request.length)
                elif isinstance(request, _Digest):
                    value = peer.digest(request.address, request.length)
                elif isinstance(request, _Release):
                    peer.release(MemoryRegion(request.address, request.length))
                elif isinstance(request, _Checksums):
                    value = peer.checksums(
                        request.buffers, request.item_bytes, request.items, request.positions
                    )
                elif isinstance(request, _Metadata):
                    value = peer.engine_metadata()
                conn.send(_Reply(True, value))
            except Exception as exc:  # the peer keeps serving; the caller gets the error
                conn.send(_Reply(False, None, repr(exc)))
    except (EOFError, OSError):
        peer.close()  # the parent went away: release the engine and exit


class SpawnedPeer:
    """The peer backend runs in a child process (multiprocessing "spawn"): real cross-process bytes.

    ``factory`` must be picklable (a class, a module-level function, or ``functools.partial`` of one).
    Every request has a time limit; ``close()`` stops the child, then terminates and kills it if it
    does not exit in time. Use it as a context manager so the child is stopped even on failure.
    """

    def __init__(
        self,
        factory: Callable[[], TransferBackend],
        *,
        start_timeout: float = PEER_START_TIMEOUT_S,
        call_timeout: float = PEER_CALL_TIMEOUT_S,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._call_timeout = call_timeout
        self._process: BaseProcess = context.Process(
            target=_serve_peer, args=(child_conn, factory), name="pdkv-spawned-peer", daemon=True
        )
        self._process.start()
        child_conn.close()
        try:
            reply = self._receive(start_timeout, "start")
            if not reply.ok or not isinstance(reply.value, str):
                raise PeerError(f"spawned peer did not start: {reply.error}")
            self._session_id: str = reply.value
        except BaseException:
            self._stop_process()
            raise

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _receive(self, timeout: float, what: str) -> _Reply:
        if not self._conn.poll(timeout):
            state = "alive" if self._process.is_alive() else f"exited with {self._process.exitcode}"
            raise PeerError(f"spawned peer gave no answer to {what} within {timeout:.0f} s (child {state})")
        try:
            reply = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise PeerError(
                f"spawned peer closed the pipe during {what} (exit {self._process.exitcode})"
            ) from exc
        if not isinstance(reply, _Reply):
            raise PeerError(f"spawned peer sent {type(reply).__name__} instead of a reply to {what}")
        return reply

    def _call(self, request: _Request) -> object:
        self._conn.send(request)
        reply = self._receive(self._call_timeout, type(request).__name__.lstrip("_").lower())
        if not reply.ok:
            raise PeerError(f"spawned peer failed {request!r}: {reply.error}")
        return reply.value

    def allocate(self, nbytes: int, fill: int = 0) -> MemoryRegion:
        region = self._call(_Allocate(nbytes, fill))
        if not isinstance(region, MemoryRegion):
            raise PeerError(f"spawned peer returned {region!r} for an allocation")
        return region

    def fill(self, address: int, length: int, value: int) -> None:
        self._call(_Fill(address, length, value))

    def read(self, address: int, length: int) -> bytes:
        data = self._call(_Read(address, length))
        if not isinstance(data, bytes):
            raise PeerError(f"spawned peer returned {type(data).__name__} for a read")
        return data

    def digest(self, address: int, length: int) -> str:
        value = self._call(_Digest(address, length))
        if not isinstance(value, str):
            raise PeerError(f"spawned peer returned {value!r} for a digest")
        return value

    def release(self, region: MemoryRegion) -> None:
        self._call(_Release(region.address, region.length))

    def checksums(
        self, buffers: tuple[tuple[int, int], ...], item_bytes: int, items: object, positions: object
    ) -> npt.NDArray[np.uint32]:
        """``InProcessPeer.checksums``, computed in the child on its memory."""
        value = self._call(_Checksums(buffers, item_bytes, items, positions))
        if not isinstance(value, np.ndarray):
            raise PeerError(f"spawned peer returned {type(value).__name__} for checksums")
        sums: npt.NDArray[np.uint32] = value
        return sums

    def engine_metadata(self) -> bytes:
        """The child backend's ``engine_metadata`` now (what its ``Register`` would carry)."""
        value = self._call(_Metadata())
        if not isinstance(value, bytes):
            raise PeerError(f"spawned peer returned {type(value).__name__} for its engine metadata")
        return value

    def close(self) -> None:
        try:
            if self._process.is_alive():
                self._call(_Stop())
        except (PeerError, OSError):
            pass  # stopped the hard way below
        finally:
            self._stop_process()

    def _stop_process(self) -> None:
        self._process.join(10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()

    def __enter__(self) -> SpawnedPeer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------ pairs


SlowDown = Callable[[TransferBackend], contextlib.AbstractContextManager[None]]


class BackendPair:
    """A sending backend, the peer it writes to, and what the cases need to know about them.

    ``new_sender`` builds another sender of the same kind (for cases that close one);
    ``unreachable_peer`` is a session id no backend answers at; ``slow_bytes`` is a write size that
    takes clearly longer than a function call, and ``slow_down`` (optional) makes the sender's
    batches slower while its context is open (for backends that are otherwise too fast to time out).
    """

    def __init__(
        self,
        *,
        new_sender: Callable[[], TransferBackend],
        peer: PeerMemory,
        unreachable_peer: str,
        slow_bytes: int,
        slow_down: SlowDown | None = None,
    ) -> None:
        self.new_sender = new_sender
        self.peer = peer
        self.unreachable_peer = unreachable_peer
        self.slow_bytes = slow_bytes
        self.slow_down = slow_down
        self.sender = new_sender()

    def slowly(self, backend: TransferBackend) -> contextlib.AbstractContextManager[None]:
        return self.slow_down(backend) if self.slow_down is not None else contextlib.nullcontext()

    def close(self) -> None:
        try:
            self.sender.close()
        finally:
            self.peer.close()


@contextlib.contextmanager
def _loopback_delay(backend: TransferBackend) -> Iterator[None]:
    if not isinstance(backend, LoopbackBackend):
        raise TypeError(f"loopback slow-down needs a LoopbackBackend, got {type(backend).__name__}")
    before = backend.faults
    backend.set_faults(attrs.evolve(before, delay_seconds=0.5, delay_batches=None))
    try:
        yield
    finally:
        backend.set_faults(before)


@contextlib.contextmanager
def loopback_pair(config: LoopbackConfig | None = None) -> Iterator[BackendPair]:
    """Two loopback backends on a private fabric; with ``announced_regions``, every sender hears of
    the peer's regions as a decode's ``Register`` would carry them (``MetadataSyncedPeer``)."""
    cfg = config or LoopbackConfig()
    fabric = LoopbackFabric("conformance")
    make = functools.partial(LoopbackBackend, cfg, fabric=fabric)
    inner = InProcessPeer(make())
    peer: InProcessPeer | MetadataSyncedPeer = inner
    new_sender: Callable[[], TransferBackend] = make
    if cfg.announced_regions:
        synced = MetadataSyncedPeer(inner)
        peer, new_sender = synced, lambda: synced.attach(make())
    pair = BackendPair(
        new_sender=new_sender,
        peer=peer,
        unreachable_peer="loopback:conformance:nobody",
        slow_bytes=1 << 20,
        slow_down=_loopback_delay,
    )
    try:
        yield pair
    finally:
        pair.close()


@contextlib.contextmanager
def mooncake_pair(config: MooncakeConfig | None = None) -> Iterator[BackendPair]:
    """A Mooncake sender in this process and a Mooncake peer in a spawned child (two engines, real TCP)."""
    cfg = config or MooncakeConfig()
    with SpawnedPeer(functools.partial(MooncakeBackend, cfg)) as peer:
        pair = BackendPair(
            new_sender=functools.partial(MooncakeBackend, cfg),
            peer=peer,
            # Port 1 on loopback: nothing listens there, so the handshake is refused at once.
            unreachable_peer=f"{cfg.local_hostname}:1",
            slow_bytes=128 << 20,  # ~0.1 s over TCP on 127.0.0.1
        )
        try:
            yield pair
        finally:
            pair.sender.close()


class MetadataSyncedPeer:
    """A spawned peer whose registrations reach every sender of the pair as a decode's ``Register``
    would carry them: after each allocation or release, each live sender gets ``add_peer`` with the
    peer's current ``engine_metadata`` (for engines that need metadata to reach a peer, as NIXL does).
    The cases see an ordinary ``PeerMemory``."""

    def __init__(self, peer: SpawnedPeer | InProcessPeer) -> None:
        self._peer = peer
        self._senders: list[TransferBackend] = []

    def attach(self, sender: TransferBackend) -> TransferBackend:
        """Make ``sender`` one that hears of the peer's registrations; returns it."""
        self._senders.append(sender)
        self._announce()
        return sender

    def _announce(self) -> None:
        metadata = self._peer.engine_metadata()
        live = []
        for sender in self._senders:
            try:
                sender.add_peer(self._peer.session_id, metadata)
            except BackendClosedError:
                continue  # a sender a case closed: forget it
            live.append(sender)
        self._senders = live

    @property
    def session_id(self) -> str:
        return self._peer.session_id

    def allocate(self, nbytes: int, fill: int = 0) -> MemoryRegion:
        region = self._peer.allocate(nbytes, fill)
        self._announce()
        return region

    def fill(self, address: int, length: int, value: int) -> None:
        self._peer.fill(address, length, value)

    def read(self, address: int, length: int) -> bytes:
        return self._peer.read(address, length)

    def digest(self, address: int, length: int) -> str:
        return self._peer.digest(address, length)

    def engine_metadata(self) -> bytes:
        return self._peer.engine_metadata()

    def checksums(
        self, buffers: tuple[tuple[int, int], ...], item_bytes: int, items: object, positions: object
    ) -> npt.NDArray[np.uint32]:
        return self._peer.checksums(buffers, item_bytes, items, positions)

    def release(self, region: MemoryRegion) -> None:
        self._peer.release(region)
        self._announce()

    def close(self) -> None:
        self._peer.close()


@contextlib.contextmanager
def nixl_pair(config: NixlConfig | None = None) -> Iterator[BackendPair]:
    """A NIXL sender in this process and a NIXL peer in a spawned child (two agents, real UCX)."""
    cfg = config or NixlConfig()
    with SpawnedPeer(functools.partial(NixlBackend, cfg)) as spawned:
        peer = MetadataSyncedPeer(spawned)
        pair = BackendPair(
            new_sender=lambda: peer.attach(NixlBackend(cfg)),
            peer=peer,
            unreachable_peer=f"{cfg.hostname}:pdkv-nobody",  # no metadata: nobody to write to
            slow_bytes=128 << 20,  # ~12 ms over cma, ~0.1 s over UCX tcp: a launch thread hand-off away
        )
        try:
            yield pair
        finally:
            pair.sender.close()


# ------------------------------------------------------------------------------------ cases


@attrs.frozen
class ConformanceCase:
    name: str
    run: Callable[[BackendPair], None]

    @property
    def summary(self) -> str:
        return (self.run.__doc__ or "").strip().splitlines()[0]


def run_case(pair: BackendPair, case: ConformanceCase) -> None:
    """Run one case, then check that it left no open registration and no unwaited batch."""
    before = pair.sender.statistics()
    case.run(pair)
    after = pair.sender.statistics()
    _expect(
        after.registrations == before.registrations,
        f"{case.name}: {after.registrations - before.registrations} registrations left open",
    )
    _expect(after.batches_in_flight == 0, f"{case.name}: {after.batches_in_flight} batches still in flight")
    _expect(after.batches_unwaited == 0, f"{case.name}: {after.batches_unwaited} batches never waited")


def _blocks(src: list[int], dst: list[int], length: list[int]) -> TransferBlocks:
    return TransferBlocks(src=src, dst=dst, length=length, buffer=[0] * len(src))


def _random_bytes(rng: np.random.Generator, nbytes: int) -> HostBuffer:
    buffer = HostBuffer(nbytes)
    buffer.array[:] = np.frombuffer(rng.bytes(nbytes), dtype=np.uint8)
    return buffer


def _expect_image(peer: PeerMemory, region: MemoryRegion, image: ByteArray, what: str) -> None:
    if image.size <= 1 << 20:
        got = np.frombuffer(peer.read(region.address, region.length), dtype=np.uint8)
        if not np.array_equal(got, image):
            wrong = np.flatnonzero(got != image)
            raise ConformanceFailure(
                f"{what}: {wrong.size} of {image.size} destination bytes differ, first at offset "
                f"{int(wrong[0])} (got {int(got[wrong[0]])}, expected {int(image[wrong[0]])})"
            )
    else:
        expected = hashlib.sha1(np.ascontiguousarray(image).data).hexdigest()
        _expect(peer.digest(region.address, region.length) == expected, f"{what}: destination bytes differ")


def _scattered_write(pair: BackendPair, *, blocks: int, block_bytes: int, seed: int) -> None:
    """Write ``blocks`` blocks to a random permutation of destination slots and check the image."""
    rng = np.random.default_rng(seed)
    nbytes = blocks * block_bytes
    source = _random_bytes(rng, nbytes)
    region = pair.peer.allocate(nbytes, fill=0xAB)
    slots = rng.permutation(blocks)
    try:
        with pair.sender.register(source):
            batch = _blocks(
                [source.address(i * block_bytes) for i in range(blocks)],
                [region.address + int(s) * block_bytes for s in slots],
                [block_bytes] * blocks,
            )
            outcome = pair.sender.write(pair.peer.session_id, batch, timeout=BATCH_WAIT_S)
            _expect(outcome.handle.entries == blocks, f"handle counts {outcome.handle.entries} entries")
        image = np.empty(nbytes, dtype=np.uint8)
        for i, slot in enumerate(slots.tolist()):
            image[slot * block_bytes : (slot + 1) * block_bytes] = source.array[
                i * block_bytes : (i + 1) * block_bytes
            ]
        _expect_image(pair.peer, region, image, f"{blocks} scattered blocks of {block_bytes} B")
    finally:
        pair.peer.release(region)


def case_writes_land(pair: BackendPair) -> None:
    """Blocks of mixed sizes from two source buffers land exactly; bytes around them are untouched."""
    rng = np.random.default_rng(1)
    first, second = _random_bytes(rng, 3 << 20), _random_bytes(rng, 1 << 16)
    region = pair.peer.allocate(4 << 20, fill=0xAB)
    # (source buffer, source offset, destination offset, length): odd sizes and offsets on purpose.
    plan = [
        (first, 0, 0, 1),
        (first, 7, 100, 4093),
        (second, 3, 1 << 20, 65_533),
        (first, 1 << 20, 2 << 20, 1 << 20),
        (second, 0, (4 << 20) - 512, 512),
    ]
    try:
        with pair.sender.register(first), pair.sender.register(second):
            batch = _blocks(
                [buf.address(s) for buf, s, _, _ in plan],
                [region.address + d for _, _, d, _ in plan],
                [n for _, _, _, n in plan],
            )
            handle = pair.sender.submit_write(pair.peer.session_id, batch)
            result = pair.sender.wait([handle], BATCH_WAIT_S)
            _expect(result.ok, f"write failed: {result.outcomes[0].reason}")
            _expect(result.bytes_completed == sum(n for *_, n in plan), "bytes_completed is wrong")
            again = pair.sender.wait([handle], 0.0)
            _expect(
                again.outcomes[0].status is BatchStatus.COMPLETED,
                f"waiting again on a finished handle gave {again.outcomes[0].status}",
            )
        image = np.full(4 << 20, 0xAB, dtype=np.uint8)
        for buf, s, d, n in plan:
            image[d : d + n] = buf.array[s : s + n]
        _expect_image(pair.peer, region, image, "mixed blocks")
    finally:
        pair.peer.release(region)


def case_zero_length_blocks(pair: BackendPair) -> None:
    """Zero-length blocks (even at unregistered addresses) move nothing; empty batches complete."""
    rng = np.random.default_rng(2)
    source = _random_bytes(rng, 4096)
    region = pair.peer.allocate(8192, fill=0xAB)
    try:
        with pair.sender.register(source):
            mixed = _blocks(
                [source.address(0), 8, source.address(100), source.address(4096)],
                [region.address, 16, region.address + 1000, region.address + 8192],
                [10, 0, 20, 0],
            )
            pair.sender.write(pair.peer.session_id, mixed, timeout=BATCH_WAIT_S)
            only_zero = _blocks([source.address(0)] * 3, [region.address + 5000] * 3, [0, 0, 0])
            outcome = pair.sender.write(pair.peer.session_id, only_zero, timeout=BATCH_WAIT_S)
            _expect(outcome.handle.total_bytes == 0, "an all-zero batch claims bytes")
            empty = pair.sender.write(pair.peer.session_id, TransferBlocks.empty(), timeout=BATCH_WAIT_S)
            _expect(empty.handle.entries == 0, "an empty batch claims entries")
        image = np.full(8192, 0xAB, dtype=np.uint8)
        image[0:10] = source.array[0:10]
        image[1000:1020] = source.array[100:120]
        _expect_image(pair.peer, region, image, "zero-length blocks")
    finally:
        pair.peer.release(region)


def case_many_small_blocks(pair: BackendPair) -> None:
    """4,096 blocks of 64 B written to a random permutation of slots land exactly."""
    _scattered_write(pair, blocks=4096, block_bytes=64, seed=3)


def case_oversized_batch_is_split(pair: BackendPair) -> None:
    """A batch of more than ``max_entries_in_flight`` blocks is split by the backend, not rejected."""
    blocks = 2 * pair.sender.max_entries_in_flight + 17
    _scattered_write(pair, blocks=blocks, block_bytes=32, seed=4)


def _writes_beside_batches_in_flight(pair: BackendPair) -> None:
    """``write_outcome`` of small batches, alone and while submitted batches are in flight from
    another thread, lands every one (a backend may write them on the calling thread)."""
    rng = np.random.default_rng(9)
    writes, block_bytes, blocks = 24, 64, 3
    nbytes = writes * blocks * block_bytes
    source = _random_bytes(rng, nbytes)
    region = pair.peer.allocate(nbytes, fill=0xAB)
    peer = pair.peer.session_id

    def batch(n: int) -> TransferBlocks:
        offsets = [(n * blocks + i) * block_bytes for i in range(blocks)]
        return _blocks(
            [source.address(o) for o in offsets],
            [region.address + o for o in offsets],
            [block_bytes] * blocks,
        )

    try:
        with pair.sender.register(source):
            submitted: list[BatchHandle] = []

            def submit_half() -> None:
                for n in range(1, writes, 2):
                    submitted.append(pair.sender.submit_write(peer, batch(n)))

            submitter = threading.Thread(target=submit_half)
            submitter.start()
            outcomes = [
                pair.sender.write_outcome(peer, batch(n), timeout=BATCH_WAIT_S) for n in range(0, writes, 2)
            ]
            submitter.join(BATCH_WAIT_S)
            result = pair.sender.wait(submitted, BATCH_WAIT_S)
            failed = {o.reason for o in (*outcomes, *result.outcomes) if not o.ok}
            _expect(not failed and len(submitted) == writes // 2, f"writes failed: {failed}")
            _expect(all(o.handle.entries == blocks for o in outcomes), "a write's handle counts its entries")
        _expect_image(pair.peer, region, source.array, "writes beside batches in flight")
    finally:
        pair.peer.release(region)


def case_concurrent_batches(pair: BackendPair) -> None:
    """Many batches in flight to one peer, together over the per-peer entry budget, all complete;
    so do ``write_outcome`` calls made while another thread's batches are in flight."""
    rng = np.random.default_rng(5)
    per_batch = pair.sender.max_entries_in_flight // 2 + 1
    batches, block_bytes = 6, 48
    nbytes = batches * per_batch * block_bytes
    source = _random_bytes(rng, nbytes)
    region = pair.peer.allocate(nbytes, fill=0xAB)
    try:
        with pair.sender.register(source):
            handles = []
            for b in range(batches):
                offsets = [(b * per_batch + i) * block_bytes for i in range(per_batch)]
                batch = _blocks(
                    [source.address(o) for o in offsets],
                    [region.address + nbytes - block_bytes - o for o in offsets],  # reversed order
                    [block_bytes] * per_batch,
                )
                handles.append(pair.sender.submit_write(pair.peer.session_id, batch))
            result = pair.sender.wait(handles, BATCH_WAIT_S)
            reasons = {o.reason for o in result.outcomes if not o.ok}
            _expect(result.ok, f"concurrent batches failed: {reasons}")
        blocks = source.array.reshape(-1, block_bytes)
        _expect_image(pair.peer, region, blocks[::-1].reshape(-1), "concurrent batches")
    finally:
        pair.peer.release(region)
    _writes_beside_batches_in_flight(pair)


def case_unregistered_destination_fails(pair: BackendPair) -> None:
    """A destination outside the peer's registered memory fails the batch with a typed error."""
    source = HostBuffer(8192, fill=7)
    region = pair.peer.allocate(4096, fill=0xAB)
    try:
        with pair.sender.register(source):
            crossing_end = _blocks([source.address(0)], [region.address + 4096 - 8], [16])
            # The sender's own memory is registered with the sender, never with the peer.
            foreign = _blocks([source.address(0)], [source.address(4096)], [16])
            for what, batch in (("crossing the region end", crossing_end), ("never registered", foreign)):
                handle = pair.sender.submit_write(pair.peer.session_id, batch)
                outcome = pair.sender.wait([handle], BATCH_WAIT_S).outcomes[0]
                _expect(
                    outcome.status is BatchStatus.FAILED,
                    f"destination {what}: expected FAILED, got {outcome.status}",
                )
                _expect(bool(outcome.reason), f"destination {what}: FAILED without a reason")
                try:
                    pair.sender.write(pair.peer.session_id, batch, timeout=BATCH_WAIT_S)
                except BatchFailedError as exc:
                    _expect(isinstance(exc, TransferError), "BatchFailedError is not a TransferError")
                else:
                    raise ConformanceFailure(f"write() with a destination {what} did not raise")
            # The failure is the batch's alone: the backend keeps working.
            good = _blocks([source.address(0)], [region.address], [64])
            pair.sender.write(pair.peer.session_id, good, timeout=BATCH_WAIT_S)
        head = np.frombuffer(pair.peer.read(region.address, 64), dtype=np.uint8)
        _expect(bool(np.all(head == 7)), "a write after a failed batch did not land")
    finally:
        pair.peer.release(region)


def case_large_scattered_write_lands_or_fails_whole(pair: BackendPair) -> None:
    """A large write in 64 scattered blocks lands exactly; the same write whose last block alone has a
    destination outside the peer's memory fails (a backend may wait for a large write's last entry
    apart from the rest), and the backend keeps working."""
    rng = np.random.default_rng(8)
    blocks = 64
    block_bytes = pair.slow_bytes // blocks
    nbytes = blocks * block_bytes
    source = _random_bytes(rng, nbytes)
    region = pair.peer.allocate(nbytes, fill=0xAB)
    slots = rng.permutation(blocks)
    src = [source.address(i * block_bytes) for i in range(blocks)]
    dst = [region.address + int(slot) * block_bytes for slot in slots]
    try:
        with pair.sender.register(source):
            pair.sender.write(
                pair.peer.session_id, _blocks(src, dst, [block_bytes] * blocks), timeout=BATCH_WAIT_S
            )
            image = np.empty(nbytes, dtype=np.uint8)
            for i, slot in enumerate(slots.tolist()):
                image[slot * block_bytes : (slot + 1) * block_bytes] = source.array[
                    i * block_bytes : (i + 1) * block_bytes
                ]
            _expect_image(pair.peer, region, image, f"{blocks} scattered blocks of {block_bytes} B")
            outside = [*dst[:-1], region.address + nbytes - block_bytes // 2]  # crosses the region's end
            handle = pair.sender.submit_write(
                pair.peer.session_id, _blocks(src, outside, [block_bytes] * blocks)
            )
            outcome = pair.sender.wait([handle], BATCH_WAIT_S).outcomes[0]
            _expect(
                outcome.status is BatchStatus.FAILED,
                f"a large write whose last block lies outside the peer's memory gave {outcome.status}",
            )
            pair.sender.write(pair.peer.session_id, _blocks(src[:1], dst[:1], [64]), timeout=BATCH_WAIT_S)
    finally:
        pair.peer.release(region)


def case_unregistered_source_rejected(pair: BackendPair) -> None:
    """A source outside every local registration is refused at submit, naming the block."""
    source = HostBuffer(4096)
    unregistered = HostBuffer(4096)
    region = pair.peer.allocate(4096)
    submitted = pair.sender.statistics().batches_submitted
    try:
        with pair.sender.register(source):
            batch = _blocks(
                [source.address(0), source.address(4000), unregistered.address(0)],
                [region.address, region.address + 100, region.address + 200],
                [16, 200, 16],  # block 1 runs past the end of its registration
            )
            try:
                pair.sender.submit_write(pair.peer.session_id, batch)
            except UnregisteredMemoryError as exc:
                _expect(exc.block == 1, f"the error names block {exc.block}, expected 1")
            else:
                raise ConformanceFailure("a source past the end of its registration was accepted")
        after = pair.sender.statistics().batches_submitted
        _expect(after == submitted, "a refused batch was counted as submitted")
    finally:
        pair.peer.release(region)


def case_unknown_peer_fails(pair: BackendPair) -> None:
    """A batch to a session id nobody answers at ends FAILED (not an exception, not a hang)."""
    source = HostBuffer(4096)
    with pair.sender.register(source):
        batch = _blocks([source.address(0)], [1 << 20], [64])
        handle = pair.sender.submit_write(pair.unreachable_peer, batch)
        outcome = pair.sender.wait([handle], BATCH_WAIT_S).outcomes[0]
        _expect(outcome.status is BatchStatus.FAILED, f"unknown peer: expected FAILED, got {outcome.status}")


def case_timeout_is_reported(pair: BackendPair) -> None:
    """A wait that gives up reports TIMED_OUT, the batch stays waitable, and it still completes."""
    rng = np.random.default_rng(6)
    nbytes = pair.slow_bytes
    source = _random_bytes(rng, nbytes)
    region = pair.peer.allocate(nbytes)
    try:
        with pair.sender.register(source):
            with pair.slowly(pair.sender):
                handle = pair.sender.submit_write(
                    pair.peer.session_id, _blocks([source.address(0)], [region.address], [nbytes])
                )
                early = pair.sender.wait([handle], 0.0)
            outcome = early.outcomes[0]
            _expect(outcome.status is BatchStatus.TIMED_OUT, f"wait(timeout=0) gave {outcome.status}")
            _expect(not early.ok and early.bytes_completed == 0, "a timed-out wait claims success or bytes")
            _expect(
                pair.sender.statistics().batches_unwaited >= 1, "a timed-out batch is not counted unwaited"
            )
            final = pair.sender.wait([handle], BATCH_WAIT_S)
            _expect(final.ok, f"the batch did not complete after its wait timed out: {final.outcomes[0]}")
        _expect_image(pair.peer, region, source.array, "the batch that timed out first")
    finally:
        pair.peer.release(region)


def case_registration_lifecycle(pair: BackendPair) -> None:
    """Registrations close once, refuse overlaps, and a closed one can no longer be a source."""
    source = HostBuffer(8192)
    region = pair.peer.allocate(4096)
    before = pair.sender.statistics().registrations
    try:
        registration = pair.sender.register(source)
        _expect(
            registration.region == MemoryRegion(source.data_ptr(), 8192),
            f"registration covers {registration.region}, expected the whole buffer",
        )
        _expect(pair.sender.statistics().registrations == before + 1, "registration not counted")
        try:
            pair.sender.register_range(source.address(4096), 8192)
        except RegistrationError:
            pass
        else:
            raise ConformanceFailure("an overlapping registration was accepted")
        with registration:
            pair.sender.write(
                pair.peer.session_id,
                _blocks([source.address(0)], [region.address], [8]),
                timeout=BATCH_WAIT_S,
            )
        _expect(registration.closed, "leaving the with-block did not close the registration")
        registration.close()  # idempotent
        pair.sender.unregister(registration)  # idempotent too
        _expect(pair.sender.statistics().registrations == before, "unregistration not counted")
        try:
            pair.sender.submit_write(
                pair.peer.session_id, _blocks([source.address(0)], [region.address], [8])
            )
        except UnregisteredMemoryError:
            pass
        else:
            raise ConformanceFailure("a closed registration was still accepted as a source")
    finally:
        pair.peer.release(region)


def case_close_waits_then_unregisters(pair: BackendPair) -> None:
    """Closing a backend waits for its batches, unregisters everything, and refuses new work."""
    rng = np.random.default_rng(7)
    nbytes = pair.slow_bytes
    source = _random_bytes(rng, nbytes)
    region = pair.peer.allocate(nbytes)
    sender = pair.new_sender()
    try:
        registration = sender.register(source)
        with pair.slowly(sender):
            handle = sender.submit_write(
                pair.peer.session_id, _blocks([source.address(0)], [region.address], [nbytes])
            )
            sender.close()
        # A zero-time wait can only say COMPLETED if the batch had already ended when close() returned.
        outcome = sender.wait([handle], 0.0).outcomes[0]
        _expect(
            outcome.status is BatchStatus.COMPLETED,
            f"after close() the batch is {outcome.status} (close must wait for every batch)",
        )
        _expect(registration.closed, "close() left a registration open")
        for attempt in (
            lambda: sender.submit_write(pair.peer.session_id, TransferBlocks.empty()),
            lambda: sender.register(HostBuffer(64)),
        ):
            try:
                attempt()
            except BackendClosedError:
                pass
            else:
                raise ConformanceFailure("a closed backend accepted new work")
        sender.close()  # idempotent
        _expect_image(pair.peer, region, source.array, "a batch finished by close()")
    finally:
        sender.close()
        pair.peer.release(region)


CASES: tuple[ConformanceCase, ...] = tuple(
    ConformanceCase(run.__name__.removeprefix("case_"), run)
    for run in (
        case_writes_land,
        case_zero_length_blocks,
        case_many_small_blocks,
        case_oversized_batch_is_split,
        case_concurrent_batches,
        case_unregistered_destination_fails,
        case_large_scattered_write_lands_or_fails_whole,
        case_unregistered_source_rejected,
        case_unknown_peer_fails,
        case_timeout_is_reported,
        case_registration_lifecycle,
        case_close_waits_then_unregisters,
    )
)
