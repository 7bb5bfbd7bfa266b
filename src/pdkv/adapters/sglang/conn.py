"""SGLang's disaggregation interfaces (``sglang.srt.disaggregation.base.conn``) implemented over pdkv.

Owns: ``PdkvKVManager`` (one per scheduler rank: builds the layout from KVArgs, owns the rank's
``PrefillTransport`` or ``DecodeTransport``), ``PdkvKVSender`` / ``PdkvKVReceiver`` (one per request: thin
handles on a pdkv ``KVSender`` / ``KVReceiver``), ``PdkvKVBootstrapServer`` (the prefill instance's pdkv
bootstrap registry on SGLang's bootstrap port), and the translation of SGLang's conventions:

- poll values are SGLang's ``KVPoll`` ints (pdkv's ``KVPoll`` has the same values), from creation on;
- ``failure_exception()`` raises SGLang's ``KVTransferError`` carrying pdkv's failure cause and reason;
- the sender decides the last chunk itself (pages sent == ``num_kv_indices`` given to ``init``);
- ``get_transfer_metric()`` stays valid after ``clear()``;
- the decode radix cache: the decode names only the pages after its cached prefix and the prefix in
  tokens (``decode_prefix_len``); pdkv's request carries the prefix in pages (placeholder destinations for
  the prefix positions, never written) and the prefill's ``pop_decode_prefix_len()`` reads it back, so
  SGLang's prefill sends from the prefix on;
- deferred decode KV release: pages are safe once pdkv says every prefill rank acked the abort
  (``is_abort_release_safe``); SGLang's own 30 s bound is pdkv's abort-ack timeout;
- timeouts come from SGLang's ``SGLANG_DISAGGREGATION_*`` variables (then ``PDKV_*`` ones, see README);
- the draft model's state (MTP's NSA index buffers, named by KVArgs' ``draft_state_buffer_start/count``)
  is the draft model's in the layout, so a rolling deployment where one side registers it is served as
  ``PDKV_LAYOUT_POLICY`` says (default ``degrade_draft``); a decode room served without it says so
  (``PdkvKVReceiver.draft_skipped()``, logged once per room at INFO) so speculation can be turned off
  for that request;
- SGLang's CUDA events for a chunk (the early-send wait event, ``indices_event``) are waited for on the
  manager's ready thread (``ready.py``), never on the scheduler thread; without one nothing waits.

Refused at manager init with a ``ConfigError`` naming the feature (pdkv cannot do it, or this adapter does
not wire it yet): pipeline parallelism, DP attention / prefill DP-rank routing (``--dp-size``,
``--attn-dp-size``), attention and decode context parallelism, multi-node instances, PD role switch, the
``prefill_complete`` decode allocation policy, state types other than SWA and DSA/NSA, compressed-MLA
pools. Host destinations are declined through
``supports_host_destination``; MHA with a prefill TP different from the decode TP is refused when the
decode first meets that prefill.

Must not block the scheduler thread on the network beyond what SGLang's own backends do (only
``try_ensure_parallel_info`` waits, briefly, as Mooncake's HTTP query does), must not import pdkv
internals beyond the route query of ``try_ensure_parallel_info`` (``_query_route``: pdkv's public
surface has no non-blocking route query), and must not change behaviour for any other SGLang backend.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
from typing import Any, Final

import attrs
import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import KVTransferError
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgs

from pdkv.adapters.sglang.layout import layout_from_kv_args, state_kind_for
from pdkv.adapters.sglang.ready import DeferredChunk, ReadyWaiter
from pdkv.adapters.sglang.translate import (
    ChunkCursor,
    describe_failure,
    destinations_with_prefix,
    prefix_pages_of,
    state_indices_for,
)
from pdkv.engine import MooncakeConfig, NixlConfig, make_backend
from pdkv.errors import ConfigError, LocalProtocolError, MappingError, PdkvError
from pdkv.mapping import AttentionKind, BufferLayout
from pdkv.protocol import RoomId, Timeouts, room_id
from pdkv.protocol.ids import InstanceId
from pdkv.protocol.messages import Origin, RankCoord, RouteQuery
from pdkv.protocol.registration import DraftSkipped
from pdkv.runtime import (
    DecodeConfig,
    DecodeTransport,
    KVReceiver,
    KVSender,
    PrefillConfig,
    PrefillTransport,
    Registry,
    checksums_from_env,
    layout_policy_from_env,
)

log = logging.getLogger(__name__)

ABORT_BY_PREFILL: Final = "aborted by the SGLang prefill scheduler"
ABORT_BY_DECODE: Final = "aborted by the SGLang decode scheduler"
_QUERY_TIMEOUT_S: Final = 1.0
"""How long ``try_ensure_parallel_info`` waits for the registry (the scheduler retries on False)."""


# --------------------------------------------------------------------------- configuration


def timeouts_from_sglang_env() -> Timeouts:
    """pdkv deadlines from SGLang's variables; ``PDKV_*`` variables still apply to what SGLang lacks.

    ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` -> bootstrap, ``..._WAITING_TIMEOUT`` -> waiting,
    ``..._HEARTBEAT_INTERVAL`` -> heartbeat interval, interval x (``..._HEARTBEAT_MAX_FAILURE`` + 1) ->
    heartbeat timeout (a peer is lost after that many missed beats),
    ``..._DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` -> abort-ack wait.
    """
    interval = float(envs.SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL.get())
    max_failure = int(envs.SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE.get())
    return Timeouts.from_env(
        bootstrap=float(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()),
        waiting=float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()),
        heartbeat_interval=interval,
        heartbeat_timeout=interval * (max(max_failure, 1) + 1),
        abort_ack=float(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get()),
    )


def refuse_unsupported(server_args: ServerArgs, mode: DisaggregationMode) -> None:
    """Raise ``ConfigError`` naming the first SGLang feature pdkv's backend cannot serve."""
    checks: list[tuple[bool, str]] = [
        (int(getattr(server_args, "pp_size", 1)) > 1, "pipeline parallelism (--pp-size > 1)"),
        (
            bool(getattr(server_args, "enable_dp_attention", False))
            or int(getattr(server_args, "dp_size", 1)) > 1
            or int(getattr(server_args, "attn_dp_size", 1)) > 1,
            "data parallelism / DP attention (--dp-size, --attn-dp-size > 1: prefill DP-rank routing)",
        ),
        (
            int(getattr(server_args, "attn_cp_size", 1)) > 1,
            "attention context parallelism (--attn-cp-size > 1)",
        ),
        (
            int(getattr(server_args, "dcp_size", 1)) > 1,
            "decode context parallelism (--dcp-size > 1)",
        ),
        (
            str(getattr(server_args, "disaggregation_decode_allocation_policy", "early")) != "early",
            "--disaggregation-decode-allocation-policy other than 'early' (the sender's "
            "mark_prefill_complete() is not implemented)",
        ),
        (
            int(getattr(server_args, "nnodes", 1)) > 1,
            "instances spanning several nodes (--nnodes > 1): the adapter derives the bootstrap registry's "
            "address and the instance id from --host",
        ),
        (
            bool(getattr(server_args, "enable_pd_role_switch", False)),
            "PD role switch (--enable-pd-role-switch)",
        ),
    ]
    for refused, what in checks:
        if refused:
            raise ConfigError(f"the pdkv transfer backend does not support {what}")


def prefill_instance_id(bootstrap_host: str, bootstrap_port: int) -> InstanceId:
    """The pdkv instance id of the prefill server whose bootstrap server listens at host:port.

    The bootstrap server and every prefill rank derive it from the same two values, so the registry
    accepts the ranks' announcements without another channel between the processes.
    """
    return InstanceId(f"sglang-prefill@{_reachable(bootstrap_host)}:{bootstrap_port}")


def _reachable(host: str) -> str:
    """An address a peer can connect to: a wildcard bind address becomes this host's address."""
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostbyname(socket.gethostname())
    return host


def _advertise_host(server_args: ServerArgs) -> str:
    return os.environ.get("PDKV_ADVERTISE_HOST") or _reachable(str(server_args.host))


def _mooncake_config(kv_args: KVArgs, host: str) -> MooncakeConfig:
    """``PDKV_MOONCAKE_*`` settings first; otherwise this rank's address, and RDMA on SGLang's IB device when
    ``--disaggregation-ib-device`` names one (TCP, Mooncake's default here, when it does not)."""
    config = MooncakeConfig.from_env()
    changes: dict[str, Any] = {}
    if "PDKV_MOONCAKE_HOSTNAME" not in os.environ:
        changes["local_hostname"] = host
    device = getattr(kv_args, "ib_device", None)
    if "PDKV_MOONCAKE_DEVICE" not in os.environ and isinstance(device, str) and device:
        changes["device_name"] = device
        if "PDKV_MOONCAKE_PROTOCOL" not in os.environ:
            changes["protocol"] = "rdma"  # SGLang named an IB device: it means RDMA
    return attrs.evolve(config, **changes)


def kv_checksum_of(server_args: ServerArgs) -> bool:
    """pdkv's checksums per (buffer, page) (``PDKV_KV_CHECKSUM``) for this rank: on with SGLang's own
    switch, ``--disaggregation-enable-kv-checksum`` (0.5.23; SGLang then also runs its own digest per
    request, on the GPU), or with the pdkv variable."""
    return bool(getattr(server_args, "disaggregation_enable_kv_checksum", False)) or checksums_from_env()


def checksum_device_of(args: KVArgs, server_args: ServerArgs) -> str:
    """Where the KV pool lives, for the checksums: SGLang's GPU ``gpu_id`` on a CUDA device, else cpu."""
    device = str(getattr(server_args, "device", None) or "cuda")
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"cuda:{int(args.gpu_id)}"
    return "cpu"


def _nixl_config(kv_args: KVArgs) -> NixlConfig:
    """``PDKV_NIXL_*`` settings; UCX's devices are SGLang's IB devices when ``--disaggregation-ib-device``
    names some and ``PDKV_NIXL_UCX_NET_DEVICES`` does not."""
    config = NixlConfig.from_env()
    device = getattr(kv_args, "ib_device", None)
    if "PDKV_NIXL_UCX_NET_DEVICES" not in os.environ and isinstance(device, str) and device:
        names = ",".join(f"{d.strip()}:1" for d in device.split(",") if d.strip())
        config = attrs.evolve(config, ucx_net_devices=names)
    return config


@attrs.frozen(kw_only=True)
class PrefillInfo:
    """What SGLang's decode scheduler reads from ``prefill_info_table[bootstrap_addr]``."""

    instance: InstanceId
    tp_size: int
    cp_size: int
    dp_size: int = 1
    follow_bootstrap_room: bool = True


# --------------------------------------------------------------------------- manager


class PdkvKVManager(BaseKVManager):
    """One SGLang scheduler rank's pdkv transport (prefill or decode), built from SGLang's KVArgs."""

    supports_host_destination = False
    supports_role_switch = False
    supports_deferred_decode_kv_release = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: bool | None = False,
    ) -> None:
        mode = DisaggregationMode(getattr(disaggregation_mode, "value", disaggregation_mode))
        if mode not in (DisaggregationMode.PREFILL, DisaggregationMode.DECODE):
            raise ConfigError(f"the pdkv transfer backend serves prefill or decode, not {mode.value!r}")
        refuse_unsupported(server_args, mode)
        self.kv_args = args
        self.disaggregation_mode = mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.layout: BufferLayout = layout_from_kv_args(args, self.is_mla_backend)
        self.state_kinds = tuple(state_kind_for(t) for t in (getattr(args, "state_types", None) or ()))
        self.timeouts = timeouts_from_sglang_env()
        self.enable_deferred_decode_kv_release = bool(
            envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get()
        )
        self.page_size = self.layout.page_size
        self.tp_size = int(server_args.tp_size)
        self.rank = RankCoord(tp=int(args.engine_rank) % self.tp_size)
        self.host = _advertise_host(server_args)
        self.bootstrap_port = int(server_args.disaggregation_bootstrap_port)
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._connecting: dict[str, tuple[PrefillInfo]] = {}
        self._lock = threading.Lock()
        self._deferred: dict[int, KVReceiver] = {}
        self._to_clear: list[KVReceiver] = []
        self.ready_waiter = ReadyWaiter(self.timeouts.waiting)
        """Chunks whose GPU event has not completed yet wait here (its thread starts on first use)."""
        self.enable_all_cp_ranks_for_transfer = False  # read by SGLang's prefill before host-tensor sends
        # The engine: PDKV_BACKEND (SGLang 0.5.23's --disaggregation-transfer-backend names pdkv itself).
        self._backend = backend = make_backend(
            host=self.host, mooncake=_mooncake_config(args, self.host), nixl=_nixl_config(args)
        )
        self._prefill: PrefillTransport | None = None
        self._decode: DecodeTransport | None = None
        if mode is DisaggregationMode.PREFILL:
            self.instance = prefill_instance_id(str(server_args.host), self.bootstrap_port)
            self._prefill = PrefillTransport(
                PrefillConfig(
                    instance=self.instance,
                    rank=self.rank,
                    tp_size=self.tp_size,
                    layout=self.layout,
                    registry=f"tcp://{_reachable(str(server_args.host))}:{self.bootstrap_port}",
                    host=self.host,
                    timeouts=self.timeouts,
                    kv_checksum=kv_checksum_of(server_args),
                    checksum_device=checksum_device_of(args, server_args),
                    layout_policy=layout_policy_from_env(),
                ),
                backend,
            )
            self.register_to_bootstrap()
        else:
            self.instance = InstanceId(f"sglang-decode@{self.host}:{int(server_args.port)}")
            self._decode = DecodeTransport(
                DecodeConfig(
                    instance=self.instance,
                    rank=self.rank,
                    tp_size=self.tp_size,
                    layout=self.layout,
                    host=self.host,
                    timeouts=self.timeouts,
                    kv_checksum=kv_checksum_of(server_args),
                    checksum_device=checksum_device_of(args, server_args),
                    layout_policy=layout_policy_from_env(),
                ),
                backend,
            )
            self._decode.start()

    # -- both sides

    def register_to_bootstrap(self) -> None:
        """Prefill: register buffers with the engine and announce this rank to the bootstrap registry."""
        if self._prefill is not None:
            self._prefill.start()

    def close(self) -> None:
        """Stop the transport (unregisters memory, closes sockets) and its engine; the manager is unusable
        afterwards."""
        self.ready_waiter.close()
        for transport in (self._prefill, self._decode):
            if transport is not None:
                transport.close()
        self._backend.close()  # the manager made it: its engine goes with the transport

    @property
    def prefill_transport(self) -> PrefillTransport:
        if self._prefill is None:
            raise ConfigError("this SGLang manager is a decode manager: it has no prefill transport")
        return self._prefill

    @property
    def decode_transport(self) -> DecodeTransport:
        if self._decode is None:
            raise ConfigError("this SGLang manager is a prefill manager: it has no decode transport")
        return self._decode

    # -- decode side

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Connect to the prefill instance behind ``bootstrap_addr`` (host:port) once its route is complete.

        False while its registry has no complete route table (SGLang retries, then aborts the requests);
        ``ConfigError`` for a pairing pdkv cannot serve (MHA with a prefill TP different from ours).
        """
        if bootstrap_addr in self.prefill_info_table:
            return True
        decode = self.decode_transport
        pending = self._connecting.get(bootstrap_addr)
        if pending is not None:
            return self._registered(bootstrap_addr, *pending)
        registry = f"tcp://{bootstrap_addr}"
        table = _query_route(
            registry, Origin(instance=self.instance, epoch=decode.config.epoch, rank=self.rank)
        )
        if table is None or not table.complete:
            return False
        if self.layout.attention is AttentionKind.MHA and table.tp_size != self.tp_size:
            raise ConfigError(
                f"the pdkv transfer backend does not support MHA with prefill TP {table.tp_size} != "
                f"decode TP {self.tp_size} (prefill {bootstrap_addr})"
            )
        if table.cp_size != 1:
            raise ConfigError(
                f"prefill {bootstrap_addr} runs attention CP {table.cp_size}: not wired in this adapter"
            )
        instance = decode.connect(registry, timeout_s=max(_QUERY_TIMEOUT_S, 5.0))
        info = PrefillInfo(instance=instance, tp_size=table.tp_size, cp_size=table.cp_size)
        self._connecting[bootstrap_addr] = (info,)
        return self._registered(bootstrap_addr, info)

    def _registered(self, bootstrap_addr: str, info: PrefillInfo) -> bool:
        """Publish the prefill only once every rank of it accepted our registration: an abort sent to a
        rank still registering would not reach it (pdkv sends aborts to ready peers only)."""
        if not self.decode_transport.wait_registered(info.instance, timeout_s=_QUERY_TIMEOUT_S):
            return False
        self._connecting.pop(bootstrap_addr, None)
        self.prefill_info_table[bootstrap_addr] = info
        return True

    def track_abort(self, room: int, receiver: KVReceiver) -> None:
        with self._lock:
            self._deferred[room] = receiver

    def is_abort_release_safe(self, room: int, required_acks: int = 0) -> bool:
        """True once no prefill rank can still write into the room's pages (pdkv counted every ack).

        ``required_acks`` is SGLang's count; pdkv tracks the acks per prefill rank itself.
        """
        with self._lock:
            receiver = self._deferred.get(room)
        if receiver is None:
            return True
        return _release_ready(receiver)

    def clear_deferred_abort_state(self, room: int) -> None:
        with self._lock:
            receiver = self._deferred.pop(room, None)
        if receiver is not None:
            self.retire(receiver)

    def retire(self, receiver: KVReceiver) -> None:
        """Forget a receiver's room once pdkv allows it (after its abort acks); retried on later calls."""
        with self._lock:
            pending = [*self._to_clear, receiver]
            self._to_clear = []
        for item in pending:
            if not _release_ready(item):
                with self._lock:
                    self._to_clear.append(item)
                continue
            try:
                item.clear()
            except PdkvError as exc:  # already forgotten, or a transport closed under us
                log.debug("pdkv room %d not cleared: %s", item.room, exc)


@functools.cache
def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _release_ready(receiver: KVReceiver) -> bool:
    try:
        return receiver.release_ready()
    except PdkvError:
        return True


class _ProcessAuth:
    """``PDKV_AUTH_KEY`` read once per process, on first use (SGLang imports this module early)."""

    def __init__(self) -> None:
        self._read = False
        self._auth: Any = None

    def get(self) -> Any:
        if not self._read:
            from pdkv.control.auth import Authenticator

            self._auth, self._read = Authenticator.from_env(), True
        return self._auth


_AUTH = _ProcessAuth()


def _query_route(registry: str, origin: Origin) -> Any:
    """The prefill instance's route table, or None while its registry has none (or does not answer)."""
    from pdkv.control.errors import ControlError
    from pdkv.runtime.channels import query_registry

    try:
        return query_registry(registry, RouteQuery(origin=origin), _QUERY_TIMEOUT_S, auth=_AUTH.get())
    except (ControlError, PdkvError) as exc:
        log.debug("bootstrap registry %s not ready: %s", registry, exc)
        return None


# --------------------------------------------------------------------------- sender (prefill)


class PdkvKVSender(BaseKVSender):
    """One request on a prefill rank. Created before the decode asked for the room: polls Bootstrapping."""

    def __init__(
        self,
        mgr: BaseKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        if not isinstance(mgr, PdkvKVManager):
            raise ConfigError(f"PdkvKVSender needs a PdkvKVManager, got {type(mgr).__name__}")
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self._sender: KVSender = mgr.prefill_transport.sender(room_id(self.bootstrap_room))
        self._cursor: ChunkCursor | None = None
        self._concluded: int | None = None
        self._metric: KVTransferMetric | None = None
        self._prefix: int | None = None
        self._early_send_wait_event: object | None = None  # set by SGLang's scheduler before a send
        self._local_failure: str | None = None
        self._aborted = False
        self.deferred_chunks = 0
        """Chunks that waited for a GPU event (or queued behind one) before going to pdkv."""

    def pop_decode_prefix_len(self) -> int:
        """Tokens the decode already holds (its radix cache); SGLang's prefill sends from there on.

        Known once the decode's requests are in (SGLang asks on WaitingForInput); 0 before that. Unlike
        Mooncake's, asking twice gives the same answer.
        """
        return self._prefix_pages() * self.kv_mgr.page_size

    def _prefix_pages(self) -> int:
        if self._prefix is None:
            pages = self._sender.decode_prefix_pages()
            if pages is None:
                return 0
            self._prefix = int(pages)
        return self._prefix

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """``num_kv_indices`` pages to send, those after the decode's prefix; the metadata row ``aux_index``.

        pdkv counts the whole request (prefix included) and the first chunk starts after the prefix.
        """
        prefix = self._prefix_pages()
        self._cursor = ChunkCursor(self.bootstrap_room, int(num_kv_indices), first=prefix)
        self._sender.init(prefix + self._cursor.num_pages, None if aux_index is None else int(aux_index))

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 and not (self._cursor is not None and self._cursor.finished)

    @property
    def supports_host_tensor_indices(self) -> bool:
        """SGLang then hands each chunk's page ids as a pinned host tensor still being copied, with the
        copy's CUDA event (``indices_event``): pdkv reads the ids off the scheduler thread once it
        completed, so the scheduler does not wait for the copy. Only where CUDA runs."""
        return _cuda_available()

    def send(
        self,
        kv_indices: Any,
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
        indices_event: object | None = None,
    ) -> None:
        """Queue one chunk's pages; the chunk that completes ``num_kv_indices`` pages is the last one.

        With a CUDA event (SGLang's early-send wait event set on this sender, or ``indices_event``) the
        chunk waits for it on the manager's ready thread and goes to pdkv from there; later chunks of
        the room queue behind it. Without one (always on CPU) it goes to pdkv now and nothing waits.
        """
        events = tuple(e for e in (self._early_send_wait_event, indices_event) if e is not None)
        self._early_send_wait_event = None  # it belongs to this chunk only
        if self._cursor is None:
            raise LocalProtocolError(
                f"room {self.bootstrap_room}: send() before init()", machine="sglang-sender", trigger="send"
            )
        # Ids still being copied are read after their event; their count is known already.
        count = len(kv_indices) if indices_event is not None else int(np.size(kv_indices))
        if self._cursor.finished and count == 0:
            return
        start, last = self._cursor.advance(count)
        state = state_indices_for(self.kv_mgr.state_kinds, state_indices) if last else None
        start_token = start * self.kv_mgr.page_size
        waiter = self.kv_mgr.ready_waiter
        if not events and not waiter.pending(self.bootstrap_room):
            self._send_now(kv_indices, start_token, last, state)
            return
        self.deferred_chunks += 1
        waiter.submit(
            DeferredChunk(
                room=self.bootstrap_room,
                events=events,
                send=lambda: self._send_now(kv_indices, start_token, last, state),
                fail=self._fail_deferred,
                cancelled=self._deferred_cancelled,
            )
        )

    def _send_now(self, kv_indices: Any, start_token: int, last: bool, state: Any) -> None:
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        self._sender.send(pages, start_token=start_token, last=last, state_indices=state)

    def _fail_deferred(self, reason: str) -> None:
        """A waited chunk could not go (its event timed out or raised, or pdkv refused it): the room
        fails here and pdkv tells the decode."""
        self._local_failure = reason
        try:
            self._sender.abort(reason)
        except PdkvError as exc:
            log.debug("room %d: abort after a deferred chunk failed: %s", self.bootstrap_room, exc)

    def _deferred_cancelled(self) -> bool:
        if self._aborted or self._local_failure is not None:
            return True
        try:
            return int(self._sender.poll()) == KVPoll.Failed
        except PdkvError:
            return True

    def poll(self) -> int:
        if self._concluded is not None:
            return self._concluded
        if self._local_failure is not None:
            return int(KVPoll.Failed)
        return int(self._sender.poll())

    def failure_exception(self) -> None:
        reason = self._local_failure or describe_failure(self._sender.failure())
        raise KVTransferError(self.bootstrap_room, f"pdkv: {reason}")

    def get_transfer_metric(self) -> KVTransferMetric:
        if self._metric is None:
            self._metric = self._read_metric()
        return self._metric

    def _read_metric(self) -> KVTransferMetric:
        try:
            metric = self._sender.metric()
        except PdkvError:
            # A room this side never opened (the decode aborted it first) has moved nothing.
            return KVTransferMetric(transfer_latency_s=None, transfer_total_bytes=0)
        return KVTransferMetric(
            transfer_latency_s=float(metric.seconds) if metric.pages else None,
            transfer_total_bytes=int(metric.bytes),
        )

    def clear(self) -> None:
        if self._concluded is not None:
            return
        state = self.poll()
        if state in (KVPoll.Success, KVPoll.Failed):
            self._metric = self._read_metric()
        try:
            self._sender.clear()
        except PdkvError as exc:  # e.g. a room this side never opened: nothing to forget
            log.debug("room %d: pdkv clear() in state %d: %s", self.bootstrap_room, state, exc)
        self._concluded = state

    def abort(self) -> None:
        self._aborted = True  # chunks still waiting for their GPU event are dropped
        self._sender.abort(ABORT_BY_PREFILL)


# --------------------------------------------------------------------------- receiver (decode)


class PdkvKVReceiver(BaseKVReceiver):
    """One request on a decode rank. Polls Bootstrapping until ``init`` resolved the prefill, then
    WaitingForInput until ``send_metadata`` opened the pdkv room, then the room's state."""

    def __init__(self, mgr: BaseKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        if not isinstance(mgr, PdkvKVManager):
            raise ConfigError(f"PdkvKVReceiver needs a PdkvKVManager, got {type(mgr).__name__}")
        if bootstrap_room is None:
            raise ConfigError("the pdkv transfer backend needs a bootstrap_room for every request")
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.room: RoomId = room_id(self.bootstrap_room)
        self._receiver: KVReceiver | None = None
        self._metadata_sent = False
        self._local_failure: str | None = None
        self.abort_notified = False
        self.bootstrap_infos: list[RankCoord] = []
        self.conclude_state: int | None = None
        self.require_staging = False

    @property
    def supports_host_destination(self) -> bool:
        return False

    def init(self, prefill_dp_rank: int) -> None:
        if prefill_dp_rank not in (0, None):
            self._fail_locally(f"prefill DP rank {prefill_dp_rank} requested: pdkv serves one DP rank")
            return
        if not self.kv_mgr.try_ensure_parallel_info(self.bootstrap_addr):
            self._fail_locally(f"no complete route from the prefill at {self.bootstrap_addr}")
            return
        info = self.kv_mgr.prefill_info_table[self.bootstrap_addr]
        decode = self.kv_mgr.decode_transport
        self._receiver = decode.receiver(self.room, info.instance)
        targets, _ = decode.fanout_targets(info.instance)
        self.bootstrap_infos = [t.rank for t in targets if not t.dummy]

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
    ) -> None:
        if self._local_failure is not None or self._receiver is None:
            return
        if str(getattr(destination, "value", destination)) != KVTransferDestination.DEVICE.value:
            self._fail_locally(f"destination {destination!r}: pdkv writes device (registered) memory only")
            return
        try:
            prefix = prefix_pages_of(self.bootstrap_room, decode_prefix_len, self.kv_mgr.page_size)
        except MappingError as exc:
            self._fail_locally(str(exc))
            return
        state = state_indices_for(self.kv_mgr.state_kinds, state_indices) or ()
        self._receiver.init(
            destinations_with_prefix(prefix, kv_indices),
            None if aux_index is None else int(aux_index),
            state,
            prefix_pages=prefix,
        )
        self._metadata_sent = True

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self._local_failure is not None:
            return KVPoll.Failed
        if self._receiver is None:
            return KVPoll.Bootstrapping
        if not (self._metadata_sent or self.abort_notified):
            # init() resolved the prefill: SGLang's decode now allocates pages and calls send_metadata
            # only once it polls WaitingForInput (DecodePreallocQueue's handshake waiters).
            return KVPoll.WaitingForInput
        return int(self._receiver.poll())

    def failure_exception(self) -> None:
        if self._local_failure is not None:
            reason = self._local_failure
        elif self._receiver is not None:
            reason = describe_failure(self._receiver.failure())
        else:
            reason = "failed before the room was opened"
        raise KVTransferError(self.bootstrap_room, f"pdkv: {reason}")

    def abort(self) -> None:
        """Fail the room and tell its prefill ranks, also before ``send_metadata`` (pdkv then tells them the
        room is refused, so the prefill scheduler polls Failed instead of waiting for its deadline)."""
        if self._receiver is not None:
            if not self.abort_notified:
                self._notify_abort(ABORT_BY_DECODE)
        elif self._local_failure is None:
            # init() did not resolve the prefill: no prefill rank can know of the room or our pages.
            self._fail_locally(ABORT_BY_DECODE + " before the prefill was resolved")

    def ensure_abort_notified(self, force_arm: bool = False) -> None:
        """Make sure every prefill rank is told to stop (SGLang's deferred release then waits for acks)."""
        if self._receiver is not None and not self.abort_notified:
            self._notify_abort(ABORT_BY_DECODE)

    def _notify_abort(self, reason: str) -> None:
        assert self._receiver is not None
        try:
            self._receiver.abort(reason)
        except LocalProtocolError as exc:  # terminal already: pdkv keeps the pages held until acks anyway
            log.debug("room %d: abort in a terminal state: %s", self.bootstrap_room, exc)
        self.abort_notified = True
        self.kv_mgr.track_abort(self.bootstrap_room, self._receiver)

    def is_abort_release_safe(self) -> bool:
        return self._receiver is None or _release_ready(self._receiver)

    def draft_skipped(self) -> DraftSkipped | None:
        """What of the draft model's state this request did not receive (a rolling deployment: the prefill
        and this decode register different draft state buffers), None when nothing was left out. The
        target model's KV and state all arrived; speculative decoding should be off for this request."""
        return None if self._receiver is None else self._receiver.draft_skipped()

    def clear(self) -> None:
        if self.conclude_state is not None:
            return
        self.conclude_state = self.poll()
        skipped = self.draft_skipped() if self.conclude_state == KVPoll.Success else None
        if skipped is not None:
            log.info("room %d: %s", self.bootstrap_room, skipped)
        if self._receiver is not None and (self._metadata_sent or self.abort_notified):
            self.kv_mgr.retire(self._receiver)

    def _fail_locally(self, reason: str) -> None:
        log.warning("room %d (prefill %s): %s", self.bootstrap_room, self.bootstrap_addr, reason)
        self._local_failure = reason


# --------------------------------------------------------------------------- bootstrap server


class PdkvKVBootstrapServer(BaseKVBootstrapServer):
    """The prefill instance's pdkv bootstrap registry (``pdkv.Registry``), on SGLang's
    ``--disaggregation-bootstrap-port``.

    SGLang does not give its bootstrap server the instance's shape: the registry learns TP, CP, page size
    and layout from the first rank that announces, and refuses later ranks that disagree.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = int(port)
        self.instance = prefill_instance_id(host, self.port)
        bind = "0.0.0.0" if host in ("", "0.0.0.0", "::") else host
        self._registry = Registry(self.instance, host=bind, port=self.port).start()

    @property
    def address(self) -> str:
        return self._registry.address

    def close(self) -> None:
        self._registry.stop()

    # SGLang's bootstrap servers expose no stop; tests and embedders call close().
