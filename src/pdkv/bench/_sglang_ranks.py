"""The rank processes of ``pdkv bench sglang``: SGLang's transfer and pdkv's, a prefill and a decode each.

Owns: what the bench's processes exchange (plans, commands, results), the KV content both systems
move and its byte check, and the four kinds of rank: SGLang 0.5.23's prefill and decode (its KV
manager, sender, receiver and bootstrap server for the Mooncake or NIXL backend, got from SGLang's
``get_kv_class`` as its schedulers get them, over SGLang's own CPU MLA pool and metadata buffers)
and pdkv's (``PrefillTransport`` / ``DecodeTransport`` and their senders and receivers over
``pdkv.testing.synthetic.RankMemory``, the same geometry and bytes). Each rank runs in a process of
its own, answers the parent's commands one at a time and measures on its own side: the prefill
times ``send()`` -> its poll sees Success and the process CPU in between; the decode polls its
receiver to Success, then checks every byte of the request against the content rule.

SGLang's modules are imported only inside an SGLang rank's process, after ``pdkv.testing.gpu_stubs``
stood in for its GPU-only imports; every call into a stub after import is counted and reported
(the parent fails the run if any). Must not pick what is measured or when (the parent does) and
must not import SGLang at module level (the parent process imports this module).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt

from pdkv.bench.latency import wait_poll
from pdkv.engine import TransferBackend
from pdkv.engine.choice import make_backend
from pdkv.engine.mooncake import MooncakeConfig, MooncakeLogLevel
from pdkv.engine.nixl import NixlConfig
from pdkv.errors import InvalidArgumentError
from pdkv.mapping import BufferKind, ModelRole
from pdkv.protocol.poll import KVPoll
from pdkv.testing.synthetic import Capacity, ModelSpec, RankMemory, pattern, salt

IntArray = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

SGLANG_SYSTEMS = ("sglang/mooncake", "sglang/nixl")
BACKEND_NAMES = ("mooncake", "nixl")
"""pdkv's engines (``pdkv_backend``); ``pdkv/<engine>`` is compared with ``sglang/<engine>``."""
LOOPBACK = "127.0.0.1"  # every rank binds here only
KV_LORA_RANK = 512  # DeepSeek-V3's MLA latent and rope dims: 576 x bf16 = 1,152 B per token
ROPE_DIM = 64
PAGE_SIZE = 64
PAGE_BYTES = PAGE_SIZE * (KV_LORA_RANK + ROPE_DIM) * 2
AUX_ROWS = 4


# ----------------------------------------------------------------------------- the workload


@attrs.frozen(kw_only=True, eq=False)
class PageLists:
    """One request's pages: its pool pages on the prefill (by position) and on the decode."""

    src: IntArray
    dst: IntArray


@attrs.frozen(kw_only=True)
class Case:
    """A request size of the bench: ``pages`` pages sent in ``chunks`` ``send()`` calls."""

    pages: int
    chunks: int = 1

    @property
    def label(self) -> str:
        return str(self.pages) if self.chunks == 1 else f"{self.pages}/{self.chunks}"

    def chunk_bounds(self) -> list[tuple[int, int]]:
        """(first position, end position) of each chunk: equal shares, the last takes the rest."""
        step = -(-self.pages // self.chunks)
        return [(start, min(start + step, self.pages)) for start in range(0, self.pages, step)]


@attrs.frozen(kw_only=True)
class Geometry:
    """The model both systems move: MLA, one KV buffer per layer, pages of ``page_bytes``."""

    layers: int
    page_size: int = PAGE_SIZE
    bytes_per_token: int = (KV_LORA_RANK + ROPE_DIM) * 2
    pool_pages: int
    """Pages per layer buffer, page 0 included (SGLang's pools keep page 0 as padding; no request
    uses it, on either system)."""

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.bytes_per_token


def kv_content(layer: int, pages: IntArray, page_bytes: int) -> U8:
    """What the prefill pool holds in ``pages`` of ``layer`` (either system): the synthetic model's
    content rule, never zero, different for every page, layer and byte column."""
    return pattern(salt(ModelRole.TARGET, BufferKind.KV, layer), pages, page_bytes)


def fill(layers: Sequence[U8], page_bytes: int) -> None:
    """Fill every page of every layer view from the content rule."""
    every = np.arange(layers[0].shape[0], dtype=np.int64)
    for layer, view in enumerate(layers):
        view[:] = kv_content(layer, every, page_bytes)


@attrs.frozen(kw_only=True)
class Check:
    """The byte check of one request on the decode: KV items ((layer, page) pairs) that differ from
    the prefill's, the first of them as (layer, position), and whether the aux row landed."""

    items: int
    mismatched: int
    first: tuple[int, int] | None
    aux_ok: bool

    @property
    def ok(self) -> bool:
        return self.mismatched == 0 and self.aux_ok


def check_pages(layers: Sequence[U8], dst: IntArray, expected: Sequence[U8], *, aux_ok: bool) -> Check:
    """Compare the decode's ``dst`` pages of every layer with ``expected`` (per layer, by position)."""
    mismatched = 0
    first: tuple[int, int] | None = None
    for layer, (view, want) in enumerate(zip(layers, expected, strict=True)):
        got = view[dst]
        if np.array_equal(got, want):
            continue
        bad = np.flatnonzero((got != want).any(axis=1))
        mismatched += int(bad.size)
        if first is None:
            first = (layer, int(bad[0]))
    return Check(items=len(layers) * int(dst.size), mismatched=mismatched, first=first, aux_ok=aux_ok)


def plant_wrong_byte(layers: Sequence[U8], dst: IntArray, room: int) -> tuple[int, int]:
    """The control: flip one byte of one landed page, as a transfer that wrote one wrong byte would
    have left it; returns the (layer, position) the check must report."""
    layer = room % len(layers)
    position = int(dst.size) - 1
    column = room % layers[layer].shape[1]
    layers[layer][dst[position], column] ^= 0xFF
    return layer, position


def aux_stamp(room: int, nbytes: int) -> U8:
    """The aux row a prefill writes for ``room`` before its last chunk (its first token, in serving)."""
    row: U8 = pattern(room % (1 << 31), np.array([room], dtype=np.int64), nbytes)[0]
    return row


# ----------------------------------------------------------------------------- plans and messages


@attrs.frozen(kw_only=True)
class RankPlan:
    """Everything a rank process needs, fixed at its start."""

    system: str
    """"sglang/mooncake", "sglang/nixl" or "pdkv/<backend>"."""
    role: str
    """"prefill" or "decode"."""
    geometry: Geometry
    page_lists: dict[int, PageLists]
    """By request size (pages): the decode precomputes what each must land as."""
    poll_s: float
    """The scheduler loop's longest wait between two polls."""
    wake: bool
    """pdkv: wait for the transport's progress between polls (else sleep ``poll_s``, as SGLang's)."""
    bootstrap: str = ""
    """SGLang decode: the prefill's bootstrap address; pdkv decode: the prefill's registry."""
    bootstrap_port: int = 0
    """SGLang prefill: the port its bootstrap server listens on."""
    tcp_queue: int | None = None
    """Mooncake's per-peer TCP queue (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER); None: its default."""
    hidden_size: int = 7168
    """SGLang's metadata buffers hold one hidden state per request (DeepSeek-V3's width)."""
    aux_bytes: int = 64
    """pdkv: bytes of its aux row (the bench sets SGLang's metadata row size)."""
    backend: str = "mooncake"
    """pdkv: the engine (``pdkv_backend``)."""


@attrs.frozen(kw_only=True)
class Open:
    room: int


@attrs.frozen(kw_only=True)
class Arm:
    room: int
    case: Case
    aux_row: int
    plant: bool = False


@attrs.frozen(kw_only=True)
class Go:
    room: int
    case: Case
    aux_row: int


@attrs.frozen(kw_only=True)
class Stop:
    pass


@attrs.frozen(kw_only=True)
class Ready:
    """A rank finished its start-up."""

    address: str = ""
    """pdkv prefill: its registry's address."""
    aux_bytes: int = 0
    """SGLang: the bytes of one request's metadata row (all its aux buffers)."""
    stubbed: tuple[str, ...] = ()
    """SGLang: the GPU-only packages stood in for."""


@attrs.frozen(kw_only=True)
class Done:
    """A command finished with nothing to report (Open, Arm)."""


@attrs.frozen(kw_only=True)
class PrefillResult:
    room: int
    state: int
    failure: str
    sent_at: float
    wall_s: float
    """``send()`` of the first chunk -> the poll that saw Success."""
    cpu_s: float
    """Process CPU (every thread) over the same span."""
    thread_cpu_s: float
    """The scheduler thread's own CPU over it (its ``send()`` calls and polls)."""


@attrs.frozen(kw_only=True)
class DecodeResult:
    room: int
    state: int
    failure: str
    success_at: float
    check: Check | None
    planted: tuple[int, int] | None


@attrs.frozen(kw_only=True)
class Stopped:
    stub_calls: tuple[str, ...]
    """Calls into a GPU stub outside import over the rank's whole life (must be empty)."""


@attrs.frozen(kw_only=True)
class Error:
    text: str


# ----------------------------------------------------------------------------- the rank loop


@runtime_checkable
class PrefillSide(Protocol):
    """A prefill rank: opens a room (its sender) when told, then sends and times it."""

    def open(self, room: int) -> None: ...

    def go(self, command: Go) -> PrefillResult: ...

    def close(self) -> None: ...


@runtime_checkable
class DecodeSide(Protocol):
    """A decode rank: asks for a room (``arm``), then polls it to its end and checks its bytes."""

    def arm(self, command: Arm) -> None: ...

    def finish(self, command: Arm) -> DecodeResult: ...

    def close(self) -> None: ...


def rank_main(system: str, conn: Connection) -> None:
    """A rank process of ``system``: SGLang's import first (it takes seconds), then its plan (the
    parent may need another rank's Ready to write it), set-up, Ready, then one command at a time
    until Stop."""
    try:
        if system in SGLANG_SYSTEMS:
            _import_sglang(system)
        plan = conn.recv()
        if not isinstance(plan, RankPlan) or plan.system != system:
            raise TypeError(f"a {system} rank's first message is its plan, not {plan!r}")
        _serve(plan, conn)
    except BaseException:
        conn.send(Error(text=traceback.format_exc()))
        raise
    if system in SGLANG_SYSTEMS:
        # Its report is sent. SGLang's KV managers start worker threads that nothing ends (its NIXL
        # manager's transfer workers are not daemons): the interpreter would wait for them at exit,
        # and the parent, after its 30 s join, would kill the process.
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _import_sglang(system: str) -> None:
    """Stand in for SGLang's GPU-only imports, then import what its scheduler's transfer path does."""
    import warnings

    from pdkv.testing import gpu_stubs

    gpu_stubs.install()  # before SGLang's first import: it imports triton & co at module level
    # SGLang's quantization modules warn at import that they need CUDA: nothing here uses them.
    warnings.filterwarnings("ignore", message="Only CUDA", category=UserWarning)
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    get_kv_class(TransferBackend(system.split("/", 1)[1]), KVClassType.MANAGER)


def _serve(plan: RankPlan, conn: Connection) -> None:
    import gc

    side: PrefillSide | DecodeSide
    if plan.system in SGLANG_SYSTEMS:
        side, ready, stub_calls = _sglang_side(plan)
    else:
        side, ready = _pdkv_side(plan)
        stub_calls = _no_stubs
    gc.freeze()  # as serving engines do after start-up: the start-up heap is never rescanned
    conn.send(ready)
    try:
        while True:
            command = conn.recv()
            if isinstance(command, Stop):
                break
            if isinstance(command, Open) and isinstance(side, PrefillSide):
                side.open(command.room)
                conn.send(Done())
            elif isinstance(command, Go) and isinstance(side, PrefillSide):
                conn.send(side.go(command))
            elif isinstance(command, Arm) and isinstance(side, DecodeSide):
                side.arm(command)
                conn.send(Done())  # the parent starts the prefill's send now; this side polls meanwhile
                conn.send(side.finish(command))
            else:
                raise TypeError(f"{plan.system} {plan.role}: unexpected command {command!r}")
    finally:
        side.close()
    conn.send(Stopped(stub_calls=stub_calls()))


def _no_stubs() -> tuple[str, ...]:
    return ()


def _poll_until(
    poll: Callable[[], int],
    wanted: tuple[KVPoll, ...],
    plan: RankPlan,
    timeout_s: float,
    progress: Any = None,
) -> KVPoll:
    return wait_poll(lambda: KVPoll(int(poll())), wanted, plan.poll_s, timeout_s, progress)


def _expected(plan: RankPlan) -> dict[int, list[U8]]:
    """What every request size must land as, per layer by position (computed once at start)."""
    return {
        pages: [
            kv_content(layer, lists.src, plan.geometry.page_bytes) for layer in range(plan.geometry.layers)
        ]
        for pages, lists in plan.page_lists.items()
    }


def _clear(layers: Sequence[U8], dst: IntArray) -> None:
    """Zero a request's destination pages before it is armed: a page it misses then shows."""
    for view in layers:
        view[dst] = 0


# ----------------------------------------------------------------------------- SGLang's ranks


def _sglang_side(
    plan: RankPlan,
) -> tuple[PrefillSide | DecodeSide, Ready, Callable[[], tuple[str, ...]]]:
    """SGLang's rank of ``plan``, its Ready, and the count of calls into GPU stubs after import."""
    backend_name = plan.system.split("/", 1)[1]
    os.environ["SGLANG_HOST_IP"] = "127.0.0.1"  # SGLang's ZMQ sockets and engine bind here only
    os.environ["MOONCAKE_PROTOCOL"] = "tcp"
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    if plan.tcp_queue is not None:
        os.environ["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] = str(plan.tcp_queue)
    else:
        os.environ.pop("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", None)
    if backend_name == "nixl":
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from pdkv.testing import gpu_stubs

    stubbed = gpu_stubs.install()  # done by _import_sglang already: the names stubbed
    rank = _SGLangRank(plan, backend_name)
    side: PrefillSide | DecodeSide = (
        _SGLangPrefill(rank, plan) if plan.role == "prefill" else _SGLangDecode(rank, plan)
    )
    return side, Ready(aux_bytes=rank.aux_bytes, stubbed=tuple(stubbed)), gpu_stubs.calls_outside_import


class _SGLangRank:
    """SGLang's process-wide set-up of one scheduler rank, as its scheduler makes it for PD."""

    def __init__(self, plan: RankPlan, backend_name: str) -> None:
        import torch
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode,
            KVClassType,
            MetadataBuffers,
            TransferBackend,
            get_kv_class,
            setup_state_kv_args,
        )
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
        from sglang.srt.server_args import ServerArgs

        self.plan = plan
        self.backend = TransferBackend(backend_name)
        self.mode = DisaggregationMode(plan.role)

        def kv_class(kind: KVClassType) -> Any:
            cls = get_kv_class(self.backend, kind)
            if cls is None:
                raise RuntimeError(f"SGLang has no {kind.value} class for {backend_name}")
            return cls

        self.kv_class = kv_class
        self.kinds = KVClassType
        args = ServerArgs(
            model_path="dummy",
            host="127.0.0.1",
            disaggregation_mode=plan.role,
            disaggregation_transfer_backend=backend_name,
            disaggregation_bootstrap_port=plan.bootstrap_port or 8998,
        )
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
        # The manager keeps the pipeline group (used only with PP > 1); no process groups exist here.
        get_parallel().override_permanently(pp_group=None)
        if backend_name == "mooncake":
            from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
                maybe_init_shared_mooncake_transfer_engine,
            )

            maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
        self.server: Any = None
        if self.mode is DisaggregationMode.PREFILL:
            self.server = kv_class(KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", plan.bootstrap_port)
        geometry = plan.geometry
        self.pool = MLATokenToKVPool(
            size=(geometry.pool_pages - 1) * geometry.page_size,
            page_size=geometry.page_size,
            dtype=torch.bfloat16,
            kv_lora_rank=KV_LORA_RANK,
            qk_rope_head_dim=ROPE_DIM,
            layer_num=geometry.layers,
            device="cpu",
            enable_memory_saver=False,
            start_layer=0,
            end_layer=geometry.layers - 1,
        )
        self.layers: list[U8] = [
            buffer.view(torch.uint8).reshape(-1).numpy().reshape(-1, geometry.page_bytes)
            for buffer in self.pool.kv_buffer
        ]
        if self.layers[0].shape[0] != geometry.pool_pages:
            raise RuntimeError(
                f"SGLang's pool has {self.layers[0].shape[0]} pages, not {geometry.pool_pages}"
            )
        self.metadata = MetadataBuffers(
            size=AUX_ROWS,
            hidden_size=plan.hidden_size,
            hidden_states_dtype=torch.bfloat16,
            max_sampling_mask_tokens=0,
        )
        kv_args = kv_class(KVClassType.KVARGS)()
        kv_args.engine_rank = 0
        kv_args.pp_rank = 0
        kv_args.system_dp_rank = 0
        kv_args.rust_http_port = None
        kv_args.kv_cache_dtype_str = "bfloat16"
        kv_args.kv_layout = None
        kv_args.prefill_start_layer = 0
        kv_args.prefill_end_layer = geometry.layers
        ptrs, lens, items = self.pool.get_contiguous_buf_infos()
        kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = ptrs, lens, items
        kv_args.num_draft_entries = 0
        kv_args.kv_layer_ids = []
        kv_args.page_size = geometry.page_size
        kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = self.metadata.get_buf_infos()
        kv_args.ib_device = None
        kv_args.gpu_id = 0
        if backend_name == "nixl":
            # CPU pools: UCX refuses host memory registered as VRAM (SGLang's default kind).
            kv_args.kv_data_mem_kinds = ["DRAM"] * len(ptrs)
        setup_state_kv_args(kv_args, self.pool, None, len(ptrs))
        self.aux_bytes = int(sum(kv_args.aux_item_lens))
        self.manager: Any = kv_class(KVClassType.MANAGER)(kv_args, self.mode, args, True)

    def close(self) -> None:
        for stop in (getattr(self.manager, "close", None), getattr(self.server, "close", None)):
            if stop is not None:
                try:
                    stop()
                except Exception:  # closing is best effort: the process ends right after
                    traceback.print_exc()


class _SGLangPrefill:
    def __init__(self, rank: _SGLangRank, plan: RankPlan) -> None:
        self.rank = rank
        self.plan = plan
        self.address = f"127.0.0.1:{plan.bootstrap_port}"
        self.sender_class = rank.kv_class(rank.kinds.SENDER)
        self.senders: dict[int, Any] = {}
        fill(rank.layers, plan.geometry.page_bytes)

    def open(self, room: int) -> None:
        self.senders[room] = self.sender_class(self.rank.manager, self.address, room)

    def go(self, command: Go) -> PrefillResult:
        sender = self.senders.pop(command.room)
        lists = self.plan.page_lists[command.case.pages]
        # SGLang's scheduler: init once the decode's request is in (WaitingForInput) ...
        state = _poll_until(sender.poll, (KVPoll.WaitingForInput,), self.plan, 60)
        if state is not KVPoll.WaitingForInput:
            return self._failed(command, sender, state)
        sender.init(command.case.pages, command.aux_row)
        # ... the forward wrote the request's first token into its metadata row.
        self.rank.metadata.bootstrap_room[command.aux_row, 0] = command.room
        self.rank.metadata.output_ids[command.aux_row, 0] = command.room % 50_000
        chunks = [lists.src[a:b].astype(np.int32) for a, b in command.case.chunk_bounds()]
        cpu0, thread0 = time.process_time(), time.thread_time()
        sent_at = time.monotonic()
        for chunk in chunks:
            sender.send(chunk)
        state = _poll_until(sender.poll, (KVPoll.Success,), self.plan, 120)
        done_at = time.monotonic()
        cpu1, thread1 = time.process_time(), time.thread_time()
        failure = _sglang_failure(sender) if state is KVPoll.Failed else ""
        sender.clear()
        return PrefillResult(
            room=command.room,
            state=int(state),
            failure=failure,
            sent_at=sent_at,
            wall_s=done_at - sent_at,
            cpu_s=cpu1 - cpu0,
            thread_cpu_s=thread1 - thread0,
        )

    def _failed(self, command: Go, sender: Any, state: KVPoll) -> PrefillResult:
        failure = _sglang_failure(sender) if state is KVPoll.Failed else f"stayed {state.name}"
        sender.clear()
        return PrefillResult(
            room=command.room, state=int(state), failure=failure, sent_at=0, wall_s=0, cpu_s=0, thread_cpu_s=0
        )

    def close(self) -> None:
        self.rank.close()


class _SGLangDecode:
    def __init__(self, rank: _SGLangRank, plan: RankPlan) -> None:
        self.rank = rank
        self.plan = plan
        self.receiver_class = rank.kv_class(rank.kinds.RECEIVER)
        self.expected = _expected(plan)
        self.receivers: dict[int, Any] = {}
        deadline = time.monotonic() + 60
        while not rank.manager.try_ensure_parallel_info(plan.bootstrap):
            if time.monotonic() > deadline:
                raise TimeoutError(f"SGLang's decode found no route from {plan.bootstrap}")
            time.sleep(0.05)

    def arm(self, command: Arm) -> None:
        lists = self.plan.page_lists[command.case.pages]
        _clear(self.rank.layers, lists.dst)
        self.rank.metadata.bootstrap_room[command.aux_row, 0] = 0
        self.rank.metadata.output_ids[command.aux_row, 0] = 0
        receiver = self.receiver_class(self.rank.manager, self.plan.bootstrap, command.room)
        receiver.init(0)
        receiver.send_metadata(lists.dst.astype(np.int32), command.aux_row, None, decode_prefix_len=0)
        self.receivers[command.room] = receiver

    def finish(self, command: Arm) -> DecodeResult:
        receiver = self.receivers.pop(command.room)
        state = _poll_until(receiver.poll, (KVPoll.Success,), self.plan, 120)
        success_at = time.monotonic()
        failure = _sglang_failure(receiver) if state is KVPoll.Failed else ""
        receiver.clear()
        check: Check | None = None
        planted: tuple[int, int] | None = None
        if state is KVPoll.Success:
            lists = self.plan.page_lists[command.case.pages]
            if command.plant:
                planted = plant_wrong_byte(self.rank.layers, lists.dst, command.room)
            metadata = self.rank.metadata
            aux_ok = (
                int(metadata.bootstrap_room[command.aux_row, 0].item()) == command.room
                and int(metadata.output_ids[command.aux_row, 0].item()) == command.room % 50_000
            )
            check = check_pages(self.rank.layers, lists.dst, self.expected[command.case.pages], aux_ok=aux_ok)
        return DecodeResult(
            room=command.room,
            state=int(state),
            failure=failure,
            success_at=success_at,
            check=check,
            planted=planted,
        )

    def close(self) -> None:
        self.rank.close()


def _sglang_failure(handle: Any) -> str:
    try:
        handle.failure_exception()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "Failed, no reason given"


# ----------------------------------------------------------------------------- pdkv's ranks


def pdkv_backend(name: str) -> TransferBackend:
    """pdkv's engine ``name`` (``mooncake`` or ``nixl``), bound to 127.0.0.1, its log at ERROR.
    Mooncake runs at its default TCP queue. NIXL runs over UCX's own choice of transports, written
    out (``all``: cma for the writes, tcp for the rest on this host) on the loopback device only, as
    SGLang's NIXL ranks here (``UCX_NET_DEVICES=lo``) and pdkv's own NIXL benches."""
    if name not in BACKEND_NAMES:
        raise InvalidArgumentError(
            f"backend: {name!r} is not one of {', '.join(BACKEND_NAMES)}", argument="backend", value=name
        )
    return make_backend(
        name,
        host=LOOPBACK,
        mooncake=MooncakeConfig(log_level=MooncakeLogLevel.ERROR),
        nixl=NixlConfig(ucx_tls="all", ucx_net_devices="lo", log_level="ERROR"),
    )


def _pdkv_side(plan: RankPlan) -> tuple[PrefillSide | DecodeSide, Ready]:
    os.environ.pop("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", None)  # pdkv runs on Mooncake's default queue
    if plan.role == "prefill":
        prefill = _PdkvPrefill(plan)
        return prefill, Ready(address=prefill.registry.address)
    return _PdkvDecode(plan), Ready()


def _pdkv_memory(plan: RankPlan) -> RankMemory:
    geometry = plan.geometry
    spec = ModelSpec.kv_only(
        layers=geometry.layers,
        page_size=geometry.page_size,
        kv_bytes_per_token=geometry.bytes_per_token,
        aux_item_bytes=plan.aux_bytes,
    )
    return RankMemory(spec, Capacity(kv_pages=geometry.pool_pages, state_slots=1, aux_rows=AUX_ROWS))


def _kv_views(memory: RankMemory) -> list[U8]:
    return [memory.view(key) for key in memory.spec.kv_keys()]


def _aux_view(memory: RankMemory) -> U8:
    return memory.view((ModelRole.TARGET, BufferKind.AUX, 0))


class _PdkvPrefill:
    def __init__(self, plan: RankPlan) -> None:
        from pdkv import InstanceId, PrefillConfig, PrefillTransport, RankCoord, Registry

        self.plan = plan
        self.memory = _pdkv_memory(plan)
        self.layers = _kv_views(self.memory)
        fill(self.layers, plan.geometry.page_bytes)
        self.registry = Registry(InstanceId("bench-prefill"), tp_size=1, cp_size=1).start()
        self.backend = pdkv_backend(plan.backend)
        self.transport = PrefillTransport(
            PrefillConfig(
                instance=InstanceId("bench-prefill"),
                rank=RankCoord(tp=0),
                tp_size=1,
                layout=self.memory.layout,
                registry=self.registry.address,
            ),
            self.backend,
        )
        self.transport.start()
        self.senders: dict[int, Any] = {}

    def open(self, room: int) -> None:
        self.senders[room] = self.transport.sender(room)

    def go(self, command: Go) -> PrefillResult:
        sender = self.senders.pop(command.room)
        lists = self.plan.page_lists[command.case.pages]
        waits = self.transport if self.plan.wake else None
        sender.init(command.case.pages, command.aux_row)
        state = _poll_until(sender.poll, (KVPoll.WaitingForInput, KVPoll.Transferring), self.plan, 60, waits)
        if state is KVPoll.Failed:
            failure = str(sender.failure() or "")
            sender.clear()
            return PrefillResult(
                room=command.room,
                state=int(state),
                failure=failure,
                sent_at=0,
                wall_s=0,
                cpu_s=0,
                thread_cpu_s=0,
            )
        _aux_view(self.memory)[command.aux_row] = aux_stamp(command.room, self.plan.aux_bytes)
        bounds = command.case.chunk_bounds()
        page_size = self.plan.geometry.page_size
        cpu0, thread0 = time.process_time(), time.thread_time()
        sent_at = time.monotonic()
        for n, (start, end) in enumerate(bounds):
            sender.send(lists.src[start:end], start_token=start * page_size, last=n == len(bounds) - 1)
        state = _poll_until(sender.poll, (KVPoll.Success,), self.plan, 120, waits)
        done_at = time.monotonic()
        cpu1, thread1 = time.process_time(), time.thread_time()
        failure = str(sender.failure() or "") if state is KVPoll.Failed else ""
        sender.clear()
        return PrefillResult(
            room=command.room,
            state=int(state),
            failure=failure,
            sent_at=sent_at,
            wall_s=done_at - sent_at,
            cpu_s=cpu1 - cpu0,
            thread_cpu_s=thread1 - thread0,
        )

    def close(self) -> None:
        try:
            self.transport.close()
        finally:
            self.backend.close()
            self.registry.stop()


class _PdkvDecode:
    def __init__(self, plan: RankPlan) -> None:
        from pdkv import DecodeConfig, DecodeTransport, InstanceId, RankCoord

        self.plan = plan
        self.memory = _pdkv_memory(plan)
        self.layers = _kv_views(self.memory)
        self.expected = _expected(plan)
        self.backend = pdkv_backend(plan.backend)
        self.transport = DecodeTransport(
            DecodeConfig(
                instance=InstanceId("bench-decode"),
                rank=RankCoord(tp=0),
                tp_size=1,
                layout=self.memory.layout,
            ),
            self.backend,
        )
        self.transport.start()
        self.prefill = self.transport.connect(plan.bootstrap, timeout_s=60)
        if not self.transport.wait_registered(self.prefill, timeout_s=60):
            raise RuntimeError("the pdkv prefill rank did not acknowledge registration")
        self.receivers: dict[int, Any] = {}

    def arm(self, command: Arm) -> None:
        lists = self.plan.page_lists[command.case.pages]
        _clear(self.layers, lists.dst)
        _aux_view(self.memory)[command.aux_row] = 0
        receiver = self.transport.receiver(command.room, self.prefill)
        receiver.init(lists.dst, command.aux_row)
        self.receivers[command.room] = receiver

    def finish(self, command: Arm) -> DecodeResult:
        receiver = self.receivers.pop(command.room)
        waits = self.transport if self.plan.wake else None
        state = _poll_until(receiver.poll, (KVPoll.Success,), self.plan, 120, waits)
        success_at = time.monotonic()
        failure = str(receiver.failure() or "") if state is KVPoll.Failed else ""
        deadline = time.monotonic() + 60
        while state is KVPoll.Failed and not receiver.release_ready() and time.monotonic() < deadline:
            time.sleep(self.plan.poll_s)
        receiver.clear()
        check: Check | None = None
        planted: tuple[int, int] | None = None
        if state is KVPoll.Success:
            lists = self.plan.page_lists[command.case.pages]
            if command.plant:
                planted = plant_wrong_byte(self.layers, lists.dst, command.room)
            aux_ok = bool(
                np.array_equal(
                    _aux_view(self.memory)[command.aux_row], aux_stamp(command.room, self.plan.aux_bytes)
                )
            )
            check = check_pages(self.layers, lists.dst, self.expected[command.case.pages], aux_ok=aux_ok)
        return DecodeResult(
            room=command.room,
            state=int(state),
            failure=failure,
            success_at=success_at,
            check=check,
            planted=planted,
        )

    def close(self) -> None:
        try:
            self.transport.close()
        finally:
            self.backend.close()
