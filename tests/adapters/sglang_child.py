"""One SGLang-side process of the adapter tests: ``python -m tests.adapters.sglang_child SCENARIO PLAN``.

Owns: the scenarios that need SGLang imported (plugin registration; a prefill rank; a decode rank). Each
runs in its own interpreter because importing SGLang on CPU installs GPU stubs (``gpu_stubs``) that must
never leak into the pytest process. A scenario reads its plan (JSON) from the file named on the command
line and writes its result (JSON) to ``plan["result"]``; it exits non-zero only on a harness error, and
reports what it observed so the test decides. Must not pick ports or clean up processes: the test owns
both. Transfer classes come only from ``get_kv_class`` after SGLang's ``load_plugins()``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.adapters import gpu_stubs

T0 = time.monotonic()
gpu_stubs.install()

# SGLang's modules are imported below the stubs on purpose (they import triton & co at module level).
import torch  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.utils import (  # noqa: E402
    DisaggregationMode,
    KVClassType,
    MetadataBuffers,
    TransferBackend,
    get_kv_class,
)
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

T_IMPORTED = time.monotonic() - T0

PAGE = 64
KV_LORA_RANK = 512
ROPE_DIM = 64
SENTINEL = 0xA5
ROWS = 12  # metadata rows per side
PREFIX_MARK = 0x3C
TERMINAL = (KVPoll.Success, KVPoll.Failed)


def kv_class(kind: KVClassType) -> Any:
    """pdkv's class of one kind, only ever through SGLang's (hooked) ``get_kv_class``."""
    cls = get_kv_class(TransferBackend("pdkv"), kind)
    if cls is None:
        raise AssertionError(f"get_kv_class gave no {kind.value} class for pdkv")
    return cls


def layer_bytes(layer: int, pages: int) -> torch.Tensor:
    """What the prefill writes into one layer: ``pages + 1`` pages (SGLang's pool has one padding page) of
    seeded random bytes, shape (pages + 1, bytes per page). The decode regenerates it to compare."""
    item = PAGE * (KV_LORA_RANK + ROPE_DIM) * 2  # bf16
    gen = torch.Generator().manual_seed(1_000_003 * (layer + 1))
    words = torch.randint(-(2**63), 2**63 - 1, ((pages + 1) * item // 8,), dtype=torch.int64, generator=gen)
    return words.view(torch.uint8).view(pages + 1, item)


def layer_pages(pool: MLATokenToKVPool, layer: int) -> torch.Tensor:
    """One layer of the pool as (pages, bytes per page), sharing its memory."""
    raw = pool.kv_buffer[layer].view(torch.uint8).reshape(-1)
    item = PAGE * (KV_LORA_RANK + ROPE_DIM) * 2
    return raw.view(-1, item)


def make_pool(plan: dict[str, Any], pages: int) -> MLATokenToKVPool:
    return MLATokenToKVPool(
        size=pages * PAGE,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM,
        layer_num=int(plan["layers"]),
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=int(plan["layers"]) - 1,
    )


def make_kv_args(pool: MLATokenToKVPool, metadata: MetadataBuffers, engine_rank: int) -> Any:
    """KVArgs filled the way SGLang's prefill/decode bootstrap queues fill them (MLA, no draft, no state)."""
    from sglang.srt.disaggregation.utils import setup_state_kv_args

    kv_args = kv_class(KVClassType.KVARGS)()
    kv_args.engine_rank = engine_rank
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    kv_args.prefill_start_layer = 0
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = ptrs, lens, items
    kv_args.prefill_end_layer = None
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = []
    kv_args.page_size = pool.page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = metadata.get_buf_infos()
    kv_args.ib_device = None
    kv_args.gpu_id = 0
    setup_state_kv_args(kv_args, pool, None, len(ptrs))
    return kv_args


def server_args(plan: dict[str, Any], mode: str, **extra: Any) -> ServerArgs:
    return ServerArgs(
        model_path="dummy",
        host="127.0.0.1",
        port=int(plan.get("http_port", 30000)),
        disaggregation_mode=mode,
        disaggregation_transfer_backend="pdkv",
        disaggregation_bootstrap_port=int(plan["bootstrap_port"]),
        **extra,
    )


# --------------------------------------------------------------------------- scenarios


REFUSAL_CASES: tuple[tuple[str, str, tuple[str, ...], dict[str, object]], ...] = (
    # label, --disaggregation-mode, further command-line flags, KVArgs changes
    ("pp", "prefill", ("--pp-size", "2"), {}),
    ("dp_attention", "prefill", ("--enable-dp-attention", "--dp-size", "2", "--tp-size", "2"), {}),
    ("attn_dp", "prefill", ("--attn-dp-size", "2", "--tp-size", "2"), {}),
    ("role_switch", "prefill", ("--enable-pd-role-switch",), {}),
    ("attn_cp", "prefill", ("--attn-cp-size", "2", "--tp-size", "2"), {}),
    ("dcp", "decode", ("--dcp-size", "2", "--tp-size", "2"), {}),
    ("nnodes", "decode", ("--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "127.0.0.1:5000"), {}),
    ("allocation_policy", "decode", ("--disaggregation-decode-allocation-policy", "prefill_complete"), {}),
    ("decode_radix", "decode", ("--disaggregation-decode-enable-radix-cache",), {}),
    (
        "mamba_state",
        "prefill",
        (),
        {
            "state_types": ["mamba"],
            "state_data_ptrs": [[4096]],
            "state_data_lens": [[64]],
            "state_item_lens": [[64]],
        },
    ),
)


def parse_cli(argv: list[str]) -> tuple[ServerArgs | None, str]:
    """SGLang's own command-line parsing (``prepare_server_args``, as ``sglang serve`` and
    ``launch_server`` call it after ``load_plugins()``): the arguments, or None and argparse's error."""
    from sglang.srt.server_args import prepare_server_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return prepare_server_args(argv), ""
    except SystemExit as exc:
        lines = [line for line in err.getvalue().splitlines() if "error:" in line]
        return None, f"exit {exc.code}: {' '.join(lines)}"


def scenario_plugin(plan: dict[str, Any]) -> dict[str, Any]:
    """Registration: Enum member, CLI choice, get_kv_class everywhere SGLang calls it; the README's
    launch flags and the refusals, both through SGLang's real command-line parser."""
    import sglang.srt.disaggregation.decode as decode_mod
    import sglang.srt.disaggregation.prefill as prefill_mod
    import sglang.srt.managers.disagg_service as service_mod
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES

    readme = [list(argv) for argv in plan.get("readme_commands", [])]
    # Before the plugin loads, SGLang's parser does not know the backend.
    _, before_plugins = parse_cli(readme[0] if readme else ["--disaggregation-transfer-backend", "pdkv"])
    load_plugins()
    load_plugins()  # idempotent, as SGLang calls it in several places
    from pdkv.adapters.sglang import conn, plugin

    plugin.register()  # a second registration changes nothing
    backend = TransferBackend("pdkv")
    found: dict[str, dict[str, str | None]] = {}
    for name, module in (("prefill", prefill_mod), ("decode", decode_mod), ("disagg_service", service_mod)):
        found[name] = {}
        for kind in KVClassType:
            cls = module.get_kv_class(backend, kind)
            found[name][kind.value] = None if cls is None else f"{cls.__module__}.{cls.__qualname__}"
    mooncake = get_kv_class(TransferBackend.MOONCAKE, KVClassType.SENDER)
    parsed, _ = parse_cli(["--model-path", "dummy", "--disaggregation-transfer-backend", "pdkv"])
    launch: list[dict[str, Any]] = []
    for argv in readme:
        args, error = parse_cli(argv)
        if args is None:
            launch.append({"error": error})
            continue
        try:
            conn.refuse_unsupported(args, DisaggregationMode(args.disaggregation_mode))
            verdict = "served"
        except Exception as exc:
            verdict = f"{type(exc).__name__}: {exc}"
        launch.append(
            {
                "mode": args.disaggregation_mode,
                "backend": args.disaggregation_transfer_backend,
                "host": args.host,
                "port": args.port,
                "bootstrap_port": args.disaggregation_bootstrap_port,
                "ib_device": args.disaggregation_ib_device,
                "decode_radix_cache": args.disaggregation_decode_enable_radix_cache,
                "verdict": verdict,
            }
        )
    # Refusals go through the manager class SGLang gets, before any transport or engine exists.
    manager_cls = kv_class(KVClassType.MANAGER)
    pool = make_pool({**plan, "layers": 2}, 4)
    metadata = MetadataBuffers(
        size=2, hidden_size=16, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=0
    )
    refusals: dict[str, str] = {}
    base = [
        "--model-path",
        "dummy",
        "--disaggregation-transfer-backend",
        "pdkv",
        "--host",
        "127.0.0.1",
        "--disaggregation-bootstrap-port",
        str(plan["bootstrap_port"]),
    ]
    for label, mode, flags, kv_changes in REFUSAL_CASES:
        args, error = parse_cli([*base, "--disaggregation-mode", mode, *flags])
        if args is None:
            refusals[label] = f"not parsed: {error}"
            continue
        kv_args = make_kv_args(pool, metadata, engine_rank=0)
        for key, value in kv_changes.items():
            setattr(kv_args, key, value)
        try:
            manager_cls(kv_args, DisaggregationMode(mode), args, True).close()
            refusals[label] = "accepted"
        except Exception as exc:
            refusals[label] = f"{type(exc).__name__}: {exc}"
    timeouts = conn.timeouts_from_sglang_env()
    # pdkv's checksums follow SGLang's own switch (0.5.23's --disaggregation-enable-kv-checksum)
    with_flag, _ = parse_cli(
        [*base, "--disaggregation-mode", "decode", "--disaggregation-enable-kv-checksum"]
    )
    without, _ = parse_cli([*base, "--disaggregation-mode", "decode"])
    assert with_flag is not None and without is not None
    kv_checksum = {
        "flag": conn.kv_checksum_of(with_flag),
        "default": conn.kv_checksum_of(without),
        "device": conn.checksum_device_of(make_kv_args(pool, metadata, engine_rank=0), with_flag),
    }
    return {
        "kv_checksum": kv_checksum,
        "member": f"{backend!r}",
        "members": [m.value for m in TransferBackend],
        "in_choices": DISAGG_TRANSFER_BACKEND_CHOICES.count("pdkv"),
        "server_args_backend": server_args(plan, "prefill").disaggregation_transfer_backend,
        "cli_backend": None if parsed is None else parsed.disaggregation_transfer_backend,
        "before_plugins": before_plugins,
        "launch": launch,
        "classes": found,
        "mooncake_sender": f"{mooncake.__module__}.{mooncake.__qualname__}" if mooncake else None,
        "hooked": hasattr(prefill_mod.get_kv_class, "__wrapped__"),
        "refusals": refusals,
        "timeouts": {
            "bootstrap": timeouts.bootstrap,
            "waiting": timeouts.waiting,
            "heartbeat_interval": timeouts.heartbeat_interval,
            "heartbeat_timeout": timeouts.heartbeat_timeout,
            "abort_ack": timeouts.abort_ack,
        },
    }


def scenario_prefill(plan: dict[str, Any]) -> dict[str, Any]:
    """A prefill rank: bootstrap server + manager + one sender per room, chunks as the plan says."""
    load_plugins()
    server = kv_class(KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", int(plan["bootstrap_port"]))
    pool = make_pool(plan, int(plan["prefill_pages"]))
    layers = int(plan["layers"])
    for layer in range(layers):
        layer_pages(pool, layer).copy_(layer_bytes(layer, int(plan["prefill_pages"])))
    # Pages a "forward" is still writing when their chunk is sent: zero until their event completes.
    unwritten = {
        room: spec["src_pages"][: spec["chunks"][0]]
        for room, spec in ((int(r["room"]), r) for r in plan["rooms"])
        if spec.get("early_send_event_s")
    }
    for pages in unwritten.values():
        for layer in range(layers):
            layer_pages(pool, layer)[torch.tensor(pages)] = 0
    metadata = MetadataBuffers(
        size=ROWS, hidden_size=16, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=0
    )
    kv_args = make_kv_args(pool, metadata, engine_rank=0)
    mgr = kv_class(KVClassType.MANAGER)(
        kv_args, DisaggregationMode.PREFILL, server_args(plan, "prefill"), True
    )
    calls_before = len(gpu_stubs.calls_outside_import())
    addr = f"127.0.0.1:{plan['bootstrap_port']}"
    sender_cls = kv_class(KVClassType.SENDER)
    rooms = {int(r["room"]): r for r in plan["rooms"]}
    senders = {room: sender_cls(mgr, addr, room) for room in rooms}
    first_polls = {room: int(s.poll()) for room, s in senders.items()}
    outcome: dict[int, dict[str, Any]] = {}
    started: set[int] = set()
    prefix_tokens: dict[int, int] = {}
    events: dict[int, list[HostEvent]] = {}
    handed: dict[int, list[float]] = {}
    send_s: dict[int, float] = {}
    scheduler_thread = threading.get_ident()
    # Rooms the decode aborts may stay Bootstrapping here (pdkv answers Bootstrapping for a room this side
    # never opened, even once the decode's Abort tombstoned it): they get a grace period once the others
    # are done, then this side aborts them itself, as SGLang's prefill does on its bootstrap timeout.
    unreachable = {room for room, spec in rooms.items() if spec.get("decode_abort")}
    deadline = time.monotonic() + float(plan.get("timeout_s", 60))
    grace_end: float | None = None
    while len(outcome) < len(rooms) and time.monotonic() < deadline:
        if all(room in outcome for room in rooms if room not in unreachable):
            grace_end = grace_end or time.monotonic() + float(plan.get("grace_s", 3))
            if time.monotonic() > grace_end:
                break
        for room, sender in senders.items():
            if room in outcome:
                continue
            spec = rooms[room]
            state = int(sender.poll())
            if state == KVPoll.WaitingForInput and room not in started:
                started.add(room)
                row = int(spec["prefill_row"])
                metadata.bootstrap_room[row, 0] = room
                metadata.output_ids[row, 0] = room % 50_000
                src = list(spec["src_pages"])  # the pages after the decode's prefix, as SGLang sends
                prefix_tokens[room] = int(sender.pop_decode_prefix_len())
                sender.init(len(src), row)
                offset = 0
                events[room] = []
                if spec.get("early_send_event_s") or spec.get("indices_event_s"):
                    handed[room] = watch_pdkv_sends(sender)
                for index, size in enumerate(spec["chunks"]):
                    chunk: Any = torch.tensor(src[offset : offset + size], dtype=torch.int32).numpy()
                    kwargs: dict[str, Any] = {}
                    if index == 0 and spec.get("early_send_event_s"):
                        # SGLang's early send under overlap: the forward still writes these pages
                        event = HostEvent(
                            float(spec["early_send_event_s"]),
                            written(pool, src[:size], int(plan["prefill_pages"])),
                        )
                        sender._early_send_wait_event = event
                        events[room].append(event)
                    if index == 0 and spec.get("indices_event_s"):
                        # SGLang's host-tensor ids: a pinned tensor the D2H copy fills later
                        want = torch.tensor(src[offset : offset + size], dtype=torch.int64)
                        chunk = want + 1  # stale ids: the copy has not landed yet
                        event = HostEvent(float(spec["indices_event_s"]), copied(chunk, want))
                        kwargs["indices_event"] = event
                        events[room].append(event)
                    if sender.should_send_kv_chunk(len(chunk), offset + size == len(src)):
                        t_send = time.monotonic()
                        sender.send(chunk, **kwargs)
                        send_s[room] = max(send_s.get(room, 0.0), time.monotonic() - t_send)
                    offset += size
                if spec.get("prefill_abort"):
                    sender.abort()
            elif state in TERMINAL:
                record: dict[str, Any] = {"state": state}
                if state == KVPoll.Failed:
                    try:
                        sender.failure_exception()
                    except Exception as exc:
                        record["error"] = f"{type(exc).__name__}: {exc}"
                sender.clear()
                metric = sender.get_transfer_metric()
                record["bytes"] = metric.transfer_total_bytes
                record["latency_s"] = metric.transfer_latency_s
                record["poll_after_clear"] = int(sender.poll())
                record["deferred_chunks"] = sender.deferred_chunks
                record["longest_send_s"] = send_s.get(room, 0.0)
                record["events"] = [
                    {
                        "asked": bool(e.asked_from),
                        "asked_on_scheduler_thread": scheduler_thread in e.asked_from,
                        # every chunk of the room reached pdkv after the event completed
                        "pdkv_sends_after_complete": bool(handed.get(room))
                        and e.complete_at is not None
                        and min(handed[room]) >= e.complete_at,
                    }
                    for e in events.get(room, [])
                ]
                outcome[room] = record
        time.sleep(0.002)
    for room in sorted(unreachable - set(outcome)):
        sender = senders[room]
        before = int(sender.poll())
        sender.abort()
        settle = time.monotonic() + 10
        while int(sender.poll()) not in TERMINAL and time.monotonic() < settle:
            time.sleep(0.01)
        outcome[room] = {"state_before_abort": before, "state": int(sender.poll())}
    for room, sender in senders.items():
        if room not in outcome:
            outcome[room] = {"state": int(sender.poll()), "unfinished": True}
    timing: dict[str, float] = {"imported": T_IMPORTED, "rooms": time.monotonic() - T0}
    result = {
        "timing": timing,
        "first_polls": first_polls,
        "rooms": outcome,
        "prefix_tokens": prefix_tokens,
        "stub_calls_during_transfer": list(gpu_stubs.calls_outside_import()[calls_before:]),
        "stub_calls_outside_import": list(gpu_stubs.calls_outside_import()),
    }
    write_result(plan, result)
    stop = Path(plan["stop_file"])
    stop_deadline = time.monotonic() + float(plan.get("timeout_s", 60))
    while not stop.exists() and time.monotonic() < stop_deadline:
        time.sleep(0.05)
    t_close = time.monotonic()
    mgr.close()
    server.close()
    timing["close_s"] = time.monotonic() - t_close
    return result


def prompt(room: int, tokens: int) -> Any:
    """The token ids of a room's prompt: distinct per room (a radix cache must not match across rooms)."""
    from array import array

    return array("q", range(room * 100_000, room * 100_000 + tokens))


def scenario_prefill_queues(plan: dict[str, Any]) -> dict[str, Any]:
    """A prefill rank driven by SGLang's own prefill code: ``PrefillBootstrapQueue`` (add, pop_bootstrapped,
    finalize_bootstrap: ``pop_decode_prefix_len`` then ``init``), the scheduler mixin's ``send_kv_chunk``
    (chunked; it computes the page ids from ``req_to_token`` from ``start_send_idx`` on), and SGLang's
    poll all-reduce over a one-rank gloo group; then ``clear()`` and the metric as the inflight queue does.

    Stand-ins only where SGLang needs a live model: the scheduler object (the attributes those paths
    read) and the "forward" (the pages are filled with the test pattern before the request arrives).
    """

    import torch.distributed as dist
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue, SchedulerDisaggregationPrefillMixin
    from sglang.srt.disaggregation.utils import (
        ReqToMetadataIdxAllocator,
        poll_and_all_reduce_attn_cp_tp_group,
    )
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.sampling.sampling_params import SamplingParams

    load_plugins()
    args = server_args(plan, "prefill", page_size=PAGE)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    store = dist.HashStore()  # type: ignore[attr-defined]  # exported by torch.distributed at runtime
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    group = dist.group.WORLD
    server = kv_class(KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", int(plan["bootstrap_port"]))
    pages = int(plan["prefill_pages"])
    pool = make_pool(plan, pages)
    for layer in range(int(plan["layers"])):
        layer_pages(pool, layer).copy_(layer_bytes(layer, pages))
    metadata = MetadataBuffers(
        size=ROWS, hidden_size=16, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=0
    )
    allocator = PagedTokenToKVPoolAllocator(
        size=pages * PAGE, page_size=PAGE, dtype=torch.bfloat16, device="cpu", kvcache=pool, need_sort=False
    )
    req_to_token = ReqToTokenPool(
        size=4, max_context_len=pages * PAGE, device="cpu", enable_memory_saver=False
    )

    class Scheduler(SchedulerDisaggregationPrefillMixin):
        """What ``send_kv_chunk`` and the bootstrap queue read from SGLang's scheduler."""

        def __init__(self) -> None:
            self.server_args = args
            self.tp_worker = SimpleNamespace(
                model_runner=SimpleNamespace(
                    effective_logical_max_total_num_tokens=pages * PAGE, kv_cache_dtype_str="bfloat16"
                )
            )
            self.kv_shard_widening = 1
            self.token_to_kv_pool_allocator = allocator
            self.req_to_token_pool = req_to_token
            self.rust_server = None
            self.model_config = SimpleNamespace(
                hf_text_config=SimpleNamespace(), num_hidden_layers=int(plan["layers"])
            )
            self.attn_cp_cpu_group = group
            self.attn_tp_cpu_group = group
            self.processed_tokens_counter = 0
            self.disagg_metadata_buffers = metadata
            self.enable_staging = False
            self.disagg_prefill_pending_chunk_rids: set[str] = set()
            self.disagg_prefill_bootstrap_queue: Any = None

    scheduler = Scheduler()
    queue = PrefillBootstrapQueue(
        pool,
        None,
        ReqToMetadataIdxAllocator(ROWS),
        metadata,
        0,
        int(plan["bootstrap_port"]),
        pages * PAGE,
        scheduler,
        None,
        TransferBackend("pdkv"),
    )
    scheduler.disagg_prefill_bootstrap_queue = queue
    calls_before = len(gpu_stubs.calls_outside_import())
    reqs = {}
    room_of: dict[str, int] = {}
    for slot, spec in enumerate(plan["rooms"]):
        room = int(spec["room"])
        # The request's pages by position: the decode's prefix first (this side computed them too).
        by_position = [*spec["prefill_prefix_pages"], *spec["src_pages"]]
        tokens = len(by_position) * PAGE
        req = Req(
            rid=f"req-{room}",
            origin_input_text="",
            origin_input_ids=prompt(room, tokens),
            sampling_params=SamplingParams(max_new_tokens=8),
            bootstrap_host="127.0.0.1",
            bootstrap_port=int(plan["bootstrap_port"]),
            bootstrap_room=room,
            disagg_mode=DisaggregationMode.PREFILL,
        )
        req.kv.req_pool_idx = slot
        token_ids = torch.tensor(by_position, dtype=torch.int64)[:, None] * PAGE + torch.arange(PAGE)
        req_to_token.req_to_token[slot, :tokens] = token_ids.reshape(-1).to(req_to_token.req_to_token.dtype)
        req.output_ids.append(room % 50_000)  # the first token the "forward" sampled
        queue.add(req, num_kv_heads=1)
        reqs[room] = req
        room_of[req.rid] = room
    record: dict[int, dict[str, Any]] = {}
    waiting = dict(reqs)
    deadline = time.monotonic() + float(plan.get("timeout_s", 60))
    while waiting and time.monotonic() < deadline:
        for req in queue.pop_bootstrapped():  # finalize_bootstrap ran: pop_decode_prefix_len + init
            room = room_of[req.rid]
            spec = next(r for r in plan["rooms"] if int(r["room"]) == room)
            record[room] = {"start_send_idx": int(req.start_send_idx), "pending": bool(req.pending_bootstrap)}
            end = int(req.start_send_idx)
            for size in spec["chunks"][:-1]:
                end += size * PAGE
                scheduler.send_kv_chunk(req, last_chunk=False, end_idx=end)
            req.extend_end = len(req.origin_input_ids)
            scheduler.send_kv_chunk(req, last_chunk=True)
            waiting.pop(room)
        time.sleep(0.005)
    inflight = [reqs[room] for room in record]
    outcome: dict[int, dict[str, Any]] = {}
    while inflight and time.monotonic() < deadline:
        polls = poll_and_all_reduce_attn_cp_tp_group(
            [r.disagg_kv_sender for r in inflight], scheduler.attn_cp_cpu_group, scheduler.attn_tp_cpu_group
        )
        for req, state in zip(list(inflight), polls, strict=True):
            if state not in TERMINAL:
                continue
            room = room_of[req.rid]
            entry = {**record[room], "state": int(state)}
            if state == KVPoll.Failed:
                try:
                    req.disagg_kv_sender.failure_exception()
                except Exception as exc:
                    entry["error"] = f"{type(exc).__name__}: {exc}"
            req.disagg_kv_sender.clear()
            metric = req.disagg_kv_sender.get_transfer_metric()
            entry["bytes"] = metric.transfer_total_bytes
            entry["observed"] = req.time_stats.compute_and_observe_kv_transfer_metrics(metric) is not None
            outcome[room] = entry
            inflight.remove(req)
        time.sleep(0.005)
    for room in reqs:
        outcome.setdefault(room, {**record.get(room, {}), "unfinished": True})
    result = {
        "rooms": outcome,
        "stub_calls_during_transfer": list(gpu_stubs.calls_outside_import()[calls_before:]),
    }
    write_result(plan, result)
    stop = Path(plan["stop_file"])
    stop_deadline = time.monotonic() + float(plan.get("timeout_s", 60))
    while not stop.exists() and time.monotonic() < stop_deadline:
        time.sleep(0.05)
    queue.kv_manager.close()
    server.close()
    dist.destroy_process_group()
    return result


def scenario_decode_queues(plan: dict[str, Any]) -> dict[str, Any]:
    """A decode rank driven by SGLang's own decode code: ``DecodePreallocQueue`` (add, the prefill-info
    handshake, ``pop_preallocated``: real page allocation then ``send_metadata``) and
    ``DecodeTransferQueue`` (``pop_transferred``: the poll all-reduce, the aux ``bootstrap_room`` gate,
    the first token committed from the metadata row). A real (disabled) ``RadixCache`` and SGLang's page
    allocator; a stand-in scheduler object with what those paths read. Verifies the bytes as the
    hand-driven decode does, at the pages SGLang allocated."""

    import torch.distributed as dist
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    load_plugins()
    radix = any(spec.get("prefill_prefix_pages") for spec in plan["rooms"])
    args = server_args(plan, "decode", page_size=PAGE, disaggregation_decode_enable_radix_cache=radix)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    store = dist.HashStore()  # type: ignore[attr-defined]  # exported by torch.distributed at runtime
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    group = dist.group.WORLD
    # What SGLang's group setup would have written (one rank: the world group is the attention TP group).
    get_parallel().override_permanently(attn_tp_group=SimpleNamespace(cpu_group=group, world_size=1))
    pages = int(plan["decode_pages"])
    pool = make_pool(plan, pages)
    for layer in range(int(plan["layers"])):
        pool.kv_buffer[layer].view(torch.uint8).fill_(SENTINEL)
    metadata = MetadataBuffers(
        size=ROWS, hidden_size=16, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=0
    )
    allocator = PagedTokenToKVPoolAllocator(
        size=pages * PAGE, page_size=PAGE, dtype=torch.bfloat16, device="cpu", kvcache=pool, need_sort=False
    )
    req_to_token = ReqToTokenPool(
        size=4, max_context_len=pages * PAGE, device="cpu", enable_memory_saver=False
    )
    tree = RadixCache(
        CacheInitParams(
            disable=not radix,
            req_to_token_pool=req_to_token,
            token_to_kv_pool_allocator=allocator,
            page_size=PAGE,
        )
    )
    committed: dict[str, int] = {}
    streamed: list[str] = []
    scheduler = SimpleNamespace(
        server_args=args,
        tp_worker=SimpleNamespace(
            is_hybrid_swa=False, model_runner=SimpleNamespace(kv_cache_dtype_str="bfloat16")
        ),
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(), num_hidden_layers=int(plan["layers"])),
        spec_algorithm=SpeculativeAlgorithm.from_string(None),
        tree_cache=tree,
        enable_hisparse=False,
        enable_decode_hicache=False,
        enable_lora=False,
        enable_priority_scheduling=False,
        enable_overlap=False,
        random_seed=0,
        running_batch=SimpleNamespace(reqs=[]),
        waiting_queue=[],
        last_batch=None,
        sliding_window_size=None,
        kv_checksum_computer=None,
        metrics_collector=None,
        metrics_reporter=SimpleNamespace(enable_metrics=False),
        schedule_low_priority_values_first=False,
        disagg_decode_prealloc_queue=None,
        # the handoff token (from the prefill's metadata row) and streamed aborts, as the scheduler sees them
        batch_result_processor=SimpleNamespace(
            _maybe_update_reasoning_tokens=lambda req, token: committed.__setitem__(req.rid, int(token))
        ),
        output_streamer=SimpleNamespace(
            stream_output=lambda reqs, *a, **k: streamed.extend(r.rid for r in reqs)
        ),
    )
    rows = ReqToMetadataIdxAllocator(ROWS)
    transfer = DecodeTransferQueue(rows, metadata, scheduler, tree)
    prealloc = DecodePreallocQueue(
        req_to_token,
        allocator,
        None,
        rows,
        metadata,
        scheduler,
        transfer,
        tree,
        0,
        int(plan["bootstrap_port"]),
        pages * PAGE,
        0,
        TransferBackend("pdkv"),
    )
    scheduler.disagg_decode_prealloc_queue = prealloc
    calls_before = len(gpu_stubs.calls_outside_import())
    rooms = {int(r["room"]): r for r in plan["rooms"]}
    reqs: dict[int, Any] = {}
    room_of: dict[str, int] = {}
    held: dict[int, list[int]] = {}
    for room, spec in rooms.items():
        cached = len(spec.get("prefill_prefix_pages", []))
        tokens = (cached + len(spec["src_pages"])) * PAGE
        if cached:
            # An earlier request left the first pages in the decode's radix cache: SGLang's allocator
            # gave them, they hold this side's mark, the tree maps the prompt's first tokens to them.
            slots = allocator.alloc(cached * PAGE)
            assert slots is not None
            held[room] = [int(t) // PAGE for t in slots[::PAGE]]
            for layer in range(int(plan["layers"])):
                layer_pages(pool, layer)[torch.tensor(held[room])] = PREFIX_MARK
            tree.insert(InsertParams(key=RadixKey(prompt(room, cached * PAGE)), value=slots))
        req = Req(
            rid=f"req-{room}",
            origin_input_text="",
            origin_input_ids=prompt(room, tokens),
            sampling_params=SamplingParams(max_new_tokens=8),
            bootstrap_host="127.0.0.1",
            bootstrap_port=int(plan["bootstrap_port"]),
            bootstrap_room=room,
            disagg_mode=DisaggregationMode.DECODE,
        )
        prealloc.add(req)
        reqs[room] = req
        room_of[req.rid] = room
    rows_of: dict[int, int] = {}
    done: dict[int, Any] = {}
    failed: list[str] = []
    deadline = time.monotonic() + float(plan.get("timeout_s", 60))
    while len(done) + len(failed) < len(reqs) and time.monotonic() < deadline:
        ready, refused = prealloc.pop_preallocated()
        failed.extend(d.req.rid for d in refused)
        for decode_req in ready:
            rows_of[room_of[decode_req.req.rid]] = int(decode_req.metadata_buffer_index)
        transfer.extend(ready)
        for req in transfer.pop_transferred():
            done[room_of[req.rid]] = req
        time.sleep(0.005)
    outcome: dict[int, dict[str, Any]] = {}
    specs: dict[int, dict[str, Any]] = {}
    for room, req in reqs.items():
        if room not in done:
            outcome[room] = {"state": int(KVPoll.Failed), "unfinished": True}
            continue
        row = req_to_token.req_to_token[req.kv.req_pool_idx, : len(req.origin_input_ids) : PAGE]
        by_position = [int(t) // PAGE for t in row]
        cached = len(held.get(room, []))
        dst = by_position[cached:]  # the pages the prefill wrote: after the cached prefix
        outcome[room] = {
            "state": int(KVPoll.Success),
            "dst_pages": dst,
            "prefix_pages": by_position[:cached],
            "held_pages": held.get(room, []),
            "output_ids": list(req.output_ids),
        }
        specs[room] = {
            **rooms[room],
            "dst_pages": dst,
            "decode_row": rows_of[room],
            "decode_prefix_dst": held.get(room, []),
        }
    verified = verify(plan, pool, metadata, {**rooms, **specs}, outcome)
    result = {
        "rooms": outcome,
        "committed": committed,
        "streamed": streamed,
        "failed": failed,
        "verified": verified,
        "stub_calls_during_transfer": list(gpu_stubs.calls_outside_import()[calls_before:]),
    }
    prealloc.kv_manager.close()
    dist.destroy_process_group()
    return result


class HostEvent:
    """A stand-in for a CUDA event on CPU: completes ``delay_s`` after creation, on a timer thread, once
    ``on_complete`` ran (what the GPU stream would have finished: KV pages, copied page ids). Records the
    threads that asked whether it completed."""

    def __init__(self, delay_s: float, on_complete: Any) -> None:
        self._done = threading.Event()
        self.asked_from: set[int] = set()
        self.complete_at: float | None = None

        def fire() -> None:
            on_complete()
            self.complete_at = time.monotonic()
            self._done.set()

        self._timer = threading.Timer(delay_s, fire)
        self._timer.daemon = True
        self._timer.start()

    def query(self) -> bool:
        self.asked_from.add(threading.get_ident())
        return self._done.is_set()

    def synchronize(self) -> None:
        self.asked_from.add(threading.get_ident())
        self._done.wait()


def watch_pdkv_sends(sender: Any) -> list[float]:
    """When each of the adapter's calls to pdkv's ``KVSender.send`` for this room happened."""
    times: list[float] = []
    inner = sender._sender.send

    def send(*args: Any, **kwargs: Any) -> None:
        times.append(time.monotonic())
        inner(*args, **kwargs)

    sender._sender.send = send
    return times


def written(pool: MLATokenToKVPool, pages: list[int], pool_pages: int) -> Any:
    """What a forward's completion means for ``pages``: every layer holds its bytes."""

    def write() -> None:
        index = torch.tensor(pages)
        for layer in range(len(pool.kv_buffer)):
            layer_pages(pool, layer)[index] = layer_bytes(layer, pool_pages)[index]

    return write


def copied(target: torch.Tensor, ids: torch.Tensor) -> Any:
    """What a D2H copy's completion means: the host tensor holds the page ids."""
    return lambda: target.copy_(ids)


def scenario_decode(plan: dict[str, Any]) -> dict[str, Any]:
    """A decode rank: manager + one receiver per room; verifies every byte against the prefill's pattern."""
    load_plugins()
    pool = make_pool(plan, int(plan["decode_pages"]))
    layers = int(plan["layers"])
    prefix_held = [p for spec in plan["rooms"] for p in spec.get("decode_prefix_dst", [])]
    for layer in range(layers):
        pool.kv_buffer[layer].view(torch.uint8).fill_(SENTINEL)
        # pages of the decode's radix cache (a request's cached prefix): no transfer may touch them
        layer_pages(pool, layer)[torch.tensor(prefix_held, dtype=torch.int64)] = PREFIX_MARK
    metadata = MetadataBuffers(
        size=ROWS, hidden_size=16, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=0
    )
    kv_args = make_kv_args(pool, metadata, engine_rank=0)
    mgr = kv_class(KVClassType.MANAGER)(kv_args, DisaggregationMode.DECODE, server_args(plan, "decode"), True)
    calls_before = len(gpu_stubs.calls_outside_import())
    addr = f"127.0.0.1:{plan['bootstrap_port']}"
    deadline = time.monotonic() + float(plan.get("timeout_s", 60))
    while not mgr.try_ensure_parallel_info(addr):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no route from {addr}")
        time.sleep(0.05)
    t_route = time.monotonic() - T0
    info = mgr.prefill_info_table[addr]
    receiver_cls = kv_class(KVClassType.RECEIVER)
    rooms = {int(r["room"]): r for r in plan["rooms"]}
    receivers = {}
    first_polls = {}
    polls_after_init: dict[int, int] = {}
    for room, spec in rooms.items():
        receiver = receiver_cls(mgr, addr, room)
        first_polls[room] = int(receiver.poll())
        receiver.init(0)
        polls_after_init[room] = int(receiver.poll())  # SGLang allocates pages only on WaitingForInput
        if spec.get("decode_abort") == "before_metadata":
            receiver.abort()
        else:
            # SGLang's decode names the pages after its cached prefix and the prefix's length in tokens
            pages = torch.tensor(spec["dst_pages"], dtype=torch.int32).numpy()
            prefix_len = len(spec.get("decode_prefix_dst", [])) * PAGE
            receiver.send_metadata(pages, int(spec["decode_row"]), None, decode_prefix_len=prefix_len)
            if spec.get("decode_abort") == "after_metadata":
                receiver.abort()
        receivers[room] = receiver
    outcome: dict[int, dict[str, Any]] = {}
    while len(outcome) < len(rooms) and time.monotonic() < deadline:
        for room, receiver in receivers.items():
            if room in outcome:
                continue
            state = int(receiver.poll())
            if state not in TERMINAL:
                continue
            record: dict[str, Any] = {"state": state}
            if state == KVPoll.Failed:
                try:
                    receiver.failure_exception()
                except Exception as exc:
                    record["error"] = f"{type(exc).__name__}: {exc}"
                receiver.ensure_abort_notified(force_arm=True)
                release_deadline = time.monotonic() + 20
                while not mgr.is_abort_release_safe(room, len(receiver.bootstrap_infos)):
                    if time.monotonic() > release_deadline:
                        break
                    time.sleep(0.01)
                record["release_safe"] = mgr.is_abort_release_safe(room, len(receiver.bootstrap_infos))
                mgr.clear_deferred_abort_state(room)
            receiver.clear()
            outcome[room] = record
        time.sleep(0.002)
    for room, receiver in receivers.items():
        if room not in outcome:
            outcome[room] = {"state": int(receiver.poll()), "unfinished": True}
    t_rooms = time.monotonic() - T0
    verified = verify(plan, pool, metadata, rooms, outcome)
    result = {
        "timing": {
            "imported": T_IMPORTED,
            "route": t_route,
            "rooms": t_rooms,
            "verified": time.monotonic() - T0,
        },
        "prefill_info": {"dp_size": info.dp_size, "follow_bootstrap_room": info.follow_bootstrap_room},
        "first_polls": first_polls,
        "polls_after_init": polls_after_init,
        "rooms": outcome,
        "verified": verified,
        "stub_calls_during_transfer": list(gpu_stubs.calls_outside_import()[calls_before:]),
        "stub_calls_outside_import": list(gpu_stubs.calls_outside_import()),
        "checksums": {
            "on": mgr.decode_transport.config.kv_checksum,
            "rooms_verified": mgr.decode_transport.statistics().endpoint.rooms_verified,
            "checksum_failures": mgr.decode_transport.statistics().endpoint.checksum_failures,
        },
    }
    mgr.close()
    return result


def verify(
    plan: dict[str, Any],
    pool: MLATokenToKVPool,
    metadata: MetadataBuffers,
    rooms: dict[int, dict[str, Any]],
    outcome: dict[int, dict[str, Any]],
) -> dict[str, Any]:
    """Digest of source pages == digest of destination pages per successful room; every other page intact."""
    layers = int(plan["layers"])
    successful = {room: spec for room, spec in rooms.items() if outcome[room]["state"] == KVPoll.Success}
    digests = {room: (hashlib.sha256(), hashlib.sha256()) for room in successful}
    mismatched = dict.fromkeys(successful, 0)
    written = torch.zeros(int(plan["decode_pages"]) + 1, dtype=torch.bool)
    for spec in successful.values():
        written[torch.tensor(spec["dst_pages"])] = True
    prefix_held = torch.tensor(
        [p for spec in rooms.values() for p in spec.get("decode_prefix_dst", [])], dtype=torch.int64
    )
    prefix_intact = True
    written[prefix_held] = True  # checked against their own mark below
    dirty = torch.zeros_like(written)
    others = torch.nonzero(~written).reshape(-1)
    for layer in range(layers):
        want_all = layer_bytes(layer, int(plan["prefill_pages"]))
        got_all = layer_pages(pool, layer)
        for room, spec in successful.items():
            want = want_all[torch.tensor(spec["src_pages"])]
            got = got_all[torch.tensor(spec["dst_pages"])]
            digests[room][0].update(want.numpy().data)
            digests[room][1].update(got.numpy().data)
            if not torch.equal(want, got):
                mismatched[room] += int((want != got).any(dim=1).sum())
        dirty[others] |= (got_all[others] != SENTINEL).any(dim=1)
        prefix_intact &= bool((got_all[prefix_held] == PREFIX_MARK).all())
    report: dict[str, Any] = {}
    for room, spec in successful.items():
        row = int(spec["decode_row"])
        report[str(room)] = {
            "digests_equal": digests[room][0].hexdigest() == digests[room][1].hexdigest(),
            "mismatched_pages": mismatched[room],
            "aux_room": int(metadata.bootstrap_room[row, 0].item()),
            "aux_token": int(metadata.output_ids[row, 0].item()),
        }
    report["prefix_pages_intact"] = prefix_intact
    report["prefix_pages_checked"] = int(prefix_held.numel())
    report["dirty_pages"] = [int(p) for p in torch.nonzero(dirty).reshape(-1)]
    report["untouched_pages"] = int((~written).sum()) - len(report["dirty_pages"])
    return report


def write_result(plan: dict[str, Any], result: dict[str, Any]) -> None:
    path = Path(plan["result"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    tmp.replace(path)


SCENARIOS = {
    "plugin": scenario_plugin,
    "prefill": scenario_prefill,
    "prefill_queues": scenario_prefill_queues,
    "decode_queues": scenario_decode_queues,
    "decode": scenario_decode,
}


def main() -> int:
    scenario, plan_path = sys.argv[1], sys.argv[2]
    plan = json.loads(Path(plan_path).read_text())
    try:
        result = SCENARIOS[scenario](plan)
        result["stub_calls_outside_import"] = list(gpu_stubs.calls_outside_import())
        write_result(plan, result)
    except Exception:
        write_result(plan, {"harness_error": traceback.format_exc()})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
