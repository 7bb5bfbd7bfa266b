"""One side (prefill or decode) of the two-process worker test, run in .venv-vllm (vLLM 0.33.0); the
decode runs in ``kv_both`` role (its worker holds a prefill transport too, on the same KV memory).

``python -m tests.adapters.vllm.worker_child prefill|decode PLAN.json``. Each process is a small vLLM
engine without a model: vLLM's real ``Scheduler`` (which builds the connector's scheduler side), vLLM's
worker glue (``KVConnectorModelRunnerMixin`` with a one-rank gloo group, ``ensure_kv_transfer_initialized``
building the worker side through vLLM's connector factory) over CPU KV tensors in the CPU backend's
layout, and a stand-in forward that writes a known pattern into the blocks it computes and reports each
layer to ``save_kv_layer`` as the attention decorator does. pdkv moves the bytes over Mooncake TCP.

Requests (files in the work dir order the two processes):
- A: the decode asks first, then the prefill computes it: sent layer by layer during the forward;
- B: the prefill finishes first, the decode asks with the prefill's returned ``kv_transfer_params``:
  sent whole when the decode asks;
- C: the decode aborts it while loading: blocks come back only after pdkv releases them;
- E: the router gave the decode a longer prompt than the prefill's: the room fails, its blocks are
  reported as load errors and vLLM recomputes the prompt;
- F: its prefill registry does not answer: the load fails after ``connect_timeout_s`` and is recomputed;
- G: its first 64 tokens are in the decode's prefix cache (A's blocks, marked after A finished): only the
  last two blocks come over (the prefill starts at the decode's prefix) and A's blocks keep the marker.
The decode checks every block of A and B against the pattern and that no other block was written.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.adapters.vllm import vllm_env as env

ROOT = env.quiet_environment()
MODEL = env.tiny_llama(ROOT)

import torch  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: E402
from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_initialized  # noqa: E402
from vllm.distributed.parallel_state import (  # noqa: E402
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin  # noqa: E402

from pdkv import KVPoll  # noqa: E402
from pdkv.adapters.vllm.connector import PdkvConnector, WorkerSide  # noqa: E402

SENTINEL = -1.0
PROMPTS = {
    "A": list(range(1, 101)),
    "B": list(range(200, 270)),
    "C": list(range(300, 340)),
    "E": list(range(400, 500)),
    "F": list(range(600, 640)),
    "G": list(range(1, 65)) + list(range(800, 826)),  # A's first 64 tokens, then its own
}
PREFILL_PROMPTS = {**PROMPTS, "E": PROMPTS["E"][:40]}  # the router's mistake: the decode's E is longer


def pattern(prompt: list[int], layer: int, position: int) -> torch.Tensor:
    """What the stand-in forward writes into the block at ``position``: like a model's KV, a function of
    the tokens up to that block's end (a shared prefix gives equal blocks); K and V differ."""
    seed = zlib.crc32(repr(prompt[: (position + 1) * env.BLOCK_SIZE]).encode()) % 9973
    block = torch.full(
        (2, env.HEADS, env.BLOCK_SIZE, env.HEAD_DIM), float(seed * 100 + layer * 10 + position)
    )
    block[1] += 5.0
    block.view(-1)[:64] += torch.arange(64, dtype=torch.float32)
    return block


MARKER = 777.0


class Engine:
    """A model-less vLLM engine step: schedule, worker glue around a stand-in forward, update."""

    def __init__(self, role: str, extra: dict[str, Any], dist_port: int) -> None:
        self.config = env.vllm_config(MODEL, role, extra=extra, max_num_batched_tokens=256, engine_id=role)
        with set_current_vllm_config(self.config):
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{dist_port}",
                local_rank=0,
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
            ensure_kv_transfer_initialized(self.config, env.kv_cache_config())
        connector = get_kv_transfer_group()
        assert isinstance(connector, PdkvConnector) and connector.worker_side is not None
        self.connector = connector
        self.worker: WorkerSide = connector.worker_side
        self.caches = {
            name: torch.full((env.NUM_BLOCKS, 2, env.HEADS, env.BLOCK_SIZE, env.HEAD_DIM), SENTINEL)
            for name in env.layer_names()
        }
        connector.register_kv_caches(self.caches)
        self.scheduler = env.scheduler(self.config)
        self.requests: dict[str, Any] = {}
        self.outputs: dict[str, Any] = {}
        self.recving: set[str] = set()
        self.sending: set[str] = set()
        self.invalid: set[int] = set()
        self.on_recv: Callable[[str], None] = lambda _: None
        self.scheduled: dict[str, list[int]] = {}  # tokens computed per step, by request

    def add(self, req_id: str, prompt: list[int], params: dict[str, Any], max_tokens: int) -> None:
        r = env.request(req_id, prompt, params, max_tokens=max_tokens)
        self.requests[req_id] = r
        self.scheduler.add_request(r)

    def step(self, write_kv: bool) -> None:
        out = self.scheduler.schedule()
        for req_id, n in out.num_scheduled_tokens.items():
            self.scheduled.setdefault(req_id, []).append(int(n))
        if out.total_num_scheduled_tokens == 0:
            mro = KVConnectorModelRunnerMixin.kv_connector_no_forward(out, self.config)
            kv_out = mro.kv_connector_output or KVConnectorOutput()  # vLLM drops an empty one
        else:
            with (
                set_forward_context(None, self.config),
                KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_out,
            ):
                self.forward(out, write_kv)
        assert kv_out is not None
        self.sending |= set(kv_out.finished_sending or ())
        self.invalid |= set(kv_out.invalid_block_ids)
        for req_id in kv_out.finished_recving or ():
            self.recving.add(req_id)
            self.on_recv(req_id)
        mro = env.runner_output(
            out,
            self.requests,
            finished_sending=kv_out.finished_sending,
            finished_recving=kv_out.finished_recving,
            invalid_block_ids=kv_out.invalid_block_ids,
        )
        for engine_outputs in self.scheduler.update_from_output(out, mro).values():
            for o in engine_outputs.outputs:
                if o.finished:
                    self.outputs[o.request_id] = o

    def forward(self, out: Any, write_kv: bool) -> None:
        """Write each scheduled request's blocks (prefill), then report every layer as attention does."""
        for layer, name in enumerate(env.layer_names()):
            if write_kv:
                for req_id, n in out.num_scheduled_tokens.items():
                    r = self.requests[req_id]
                    blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
                    end = r.num_computed_tokens  # the scheduler already advanced it past this step
                    first = (end - n) // env.BLOCK_SIZE
                    last = (end - 1) // env.BLOCK_SIZE
                    for position in range(first, last + 1):
                        self.caches[name][blocks[position]] = pattern(r.prompt_token_ids, layer, position)
            self.connector.save_kv_layer(name, self.caches[name], None)

    def run_until(self, done: Callable[[], bool], timeout_s: float, write_kv: bool, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            self.step(write_kv)
            time.sleep(0.005)


def wait_file(path: Path, timeout_s: float, engine: Engine | None = None, write_kv: bool = False) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if any(path.parent.glob("*-failed")):
            raise AssertionError(f"the other side failed while this one waited for {path.name}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {path.name}")
        if engine is not None:
            engine.step(write_kv)
        time.sleep(0.01)


def run_prefill(plan: dict[str, Any], work: Path) -> dict[str, Any]:
    checksum = {"kv_checksum": True} if plan.get("kv_checksum") else {}  # kv_connector_extra_config
    e = Engine("kv_producer", {"registry_port": plan["registry_port"], **checksum}, plan["dist_ports"][0])
    (work / "prefill-ready").touch()
    # B: computed before the decode asks; its response goes to the decode as a router would pass it
    e.add("B", PREFILL_PROMPTS["B"], {"do_remote_decode": True, "transfer_id": "t-B"}, 1)
    e.add("G", PREFILL_PROMPTS["G"], {"do_remote_decode": True, "transfer_id": "t-G"}, 1)
    e.run_until(lambda: {"B", "G"} <= set(e.outputs), 30, True, "B and G to finish")
    (work / "B-params.json").write_text(json.dumps(e.outputs["B"].kv_transfer_params))
    # A: the decode asked first, so the forward sends it layer by layer
    wait_file(work / "asked-A", 60, e, True)
    time.sleep(1.0)  # the decode's request crosses the control channel
    before = e.worker.prefill.statistics().per_layer if e.worker.prefill else None
    e.add("A", PREFILL_PROMPTS["A"], {"do_remote_decode": True, "transfer_id": "t-A"}, 1)
    e.add("E", PREFILL_PROMPTS["E"], {"do_remote_decode": True, "transfer_id": "t-E"}, 1)
    e.run_until(lambda: {"A", "B", "E", "G"} <= e.sending, 90, True, "A, B, E and G to be sent (or fail)")
    assert e.worker.prefill is not None and before is not None
    after = e.worker.prefill.statistics().per_layer
    wait_file(work / "decode-done", 120, e, True)
    return {
        "per_layer_registered": after.registered - before.registered,
        "layers_submitted": after.layers_submitted - before.layers_submitted,
        "b_params": e.outputs["B"].kv_transfer_params,
        "sending": sorted(e.sending),
    }


def run_decode(plan: dict[str, Any], work: Path) -> dict[str, Any]:
    registry = f"tcp://127.0.0.1:{plan['registry_port']}"
    # kv_both: the decode also runs a prefill transport (and registry) on the same memory and engine
    extra = {
        "prefill_registry": registry,
        "connect_timeout_s": 3.0,
        "registry_port": plan["both_registry_port"],
        **({"kv_checksum": True} if plan.get("kv_checksum") else {}),
    }
    e = Engine("kv_both", extra, plan["dist_ports"][1])
    checked: dict[str, list[int]] = {}
    loads: dict[str, tuple[int, ...]] = {}

    def on_recv(req_id: str) -> None:
        # right when the worker reports the load: the blocks hold the prefill's KV
        if req_id not in ("A", "B", "G"):
            return
        pages = loads[req_id]
        # G's first 4 blocks are the decode's own (A's, marked after A finished): pdkv must not write them
        bad = [
            position
            for layer, name in enumerate(env.layer_names())
            for position, block in enumerate(pages)
            if not torch.equal(
                e.caches[name][block],
                torch.full_like(e.caches[name][block], MARKER)
                if req_id == "G" and position < 4
                else pattern(PROMPTS[req_id], layer, position),
            )
        ]
        checked[req_id] = bad

    e.on_recv = on_recv
    wait_file(work / "prefill-ready", 120)
    start_free = int(e.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def asked(req_id: str) -> bool:
        incoming = e.worker._in.get(req_id)
        receiver = None if incoming is None else incoming.receiver
        if receiver is None:
            return False
        loads[req_id] = incoming.spec.dst_pages if incoming is not None else ()
        return receiver.poll() in (KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success)

    e.add("A", PROMPTS["A"], {"do_remote_prefill": True, "transfer_id": "t-A"}, 2)
    e.run_until(lambda: asked("A"), 60, False, "A's receiver to ask")
    (work / "asked-A").touch()
    wait_file(work / "B-params.json", 60, e)
    e.add("B", PROMPTS["B"], json.loads((work / "B-params.json").read_text()), 2)
    e.run_until(lambda: asked("B"), 30, False, "B's receiver to ask")
    # C: aborted while loading (no prefill ever computes it)
    e.add("C", PROMPTS["C"], {"do_remote_prefill": True, "transfer_id": "t-C"}, 2)
    e.run_until(lambda: asked("C"), 30, False, "C's receiver to ask")
    free_before_abort = int(e.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())
    e.scheduler.finish_requests("C", RequestStatus.FINISHED_ABORTED)
    held_after_abort = int(e.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()) == free_before_abort
    e.add("E", PROMPTS["E"], {"do_remote_prefill": True, "transfer_id": "t-E"}, 2)
    e.run_until(lambda: asked("E"), 30, False, "E's receiver to ask")
    e_pages = set(loads["E"])
    # F: its prefill registry does not answer: after connect_timeout_s the load fails and is recomputed
    dead = f"tcp://127.0.0.1:{plan['dead_port']}"
    e.add("F", PROMPTS["F"], {"do_remote_prefill": True, "transfer_id": "t-F", "remote_registry": dead}, 2)
    e.run_until(
        lambda: {"A", "B", "E", "F"} <= set(e.outputs) and {"C", "E", "F"} <= e.recving,
        90,
        False,
        "A and B to finish, C to be released, E and F to be recomputed",
    )
    # G: its first 64 tokens are in the decode's prefix cache (A's blocks): only the rest comes over
    for name in env.layer_names():
        for block in loads["A"][:4]:
            e.caches[name][block] = MARKER
    e.add("G", PROMPTS["G"], {"do_remote_prefill": True, "transfer_id": "t-G"}, 2)
    e.run_until(lambda: asked("G"), 30, False, "G's receiver to ask")
    g_prefix = e.worker._in["G"].spec.prefix_pages if "G" in e.worker._in else -1
    e.run_until(lambda: "G" in e.outputs, 60, False, "G to finish")
    written = {b for req in ("A", "B", "G") for b in loads[req]}
    stray = [
        (name, block)
        for name in env.layer_names()
        for block in range(env.NUM_BLOCKS)
        if block not in written and not bool((e.caches[name][block] == SENTINEL).all())
    ]
    (work / "decode-done").touch()
    e.step(False)
    assert e.worker.decode is not None
    endpoint = e.worker.decode.statistics().endpoint
    return {
        "checksums": {
            "on": e.worker.decode.config.kv_checksum,
            "rooms_verified": endpoint.rooms_verified,
            "checksum_failures": endpoint.checksum_failures,
        },
        "checked": checked,
        "stray_blocks": stray[:8],
        "held_after_abort": held_after_abort,
        "free_blocks_back": int(e.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()) == start_free,
        "e_pages_reported_invalid": e_pages <= e.invalid and bool(e_pages),
        "scheduled": {r: e.scheduled.get(r, []) for r in ("A", "B", "E", "F", "G")},
        "g_prefix_pages": g_prefix,
        "g_shares_a_blocks": loads["G"][:4] == loads["A"][:4],
    }


def main() -> None:
    role, plan_path = sys.argv[1], Path(sys.argv[2])
    plan = json.loads(plan_path.read_text())
    work = plan_path.parent
    result: dict[str, Any]
    try:
        result = {"ok": True, **(run_prefill(plan, work) if role == "prefill" else run_decode(plan, work))}
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
        (work / f"{role}-failed").touch()
    (work / f"{role}-result.json").write_text(json.dumps(result, indent=1, default=str))
    get_kv_transfer_group().shutdown()


if __name__ == "__main__":
    main()
