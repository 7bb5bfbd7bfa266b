"""vLLM 0.33.0's real ``Scheduler`` drives the pdkv connector's scheduler side (run in .venv-vllm).

``python -m tests.adapters.vllm.scheduler_child RESULT.json`` runs every scenario in one process (vLLM's
config takes seconds to build on this machine) and writes ``{scenario: null | traceback}``; the pytest
side (``test_vllm_scheduler.py``) turns each entry into a test. Expected values are written out here
(block counts, token counts, the room derived independently from the transfer id), never read back
from the connector.
"""

from __future__ import annotations

import hashlib
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.adapters.vllm import vllm_env as env

ROOT = env.quiet_environment()
MODEL = env.tiny_llama(ROOT)

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from pdkv import ConfigError, RoomId  # noqa: E402
from pdkv.adapters.vllm.connector import (  # noqa: E402
    AbortSpec,
    LayerSaveSpec,
    PdkvConnector,
    PdkvConnectorMetadata,
    SendSpec,
)

REGISTRY = "tcp://127.0.0.1:45999"
PROMPT = list(range(1, 101))  # 100 tokens: 7 blocks of 16, the last one partial
PAGES = 7

SCENARIOS: dict[str, Callable[[], None]] = {}


def scenario(fn: Callable[[], None]) -> Callable[[], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


def expected_room(transfer_id: str) -> RoomId:
    digest = hashlib.blake2b(transfer_id.encode(), digest_size=8).digest()
    return RoomId(int.from_bytes(digest, "little") & (2**63 - 1))


def meta(output: Any) -> PdkvConnectorMetadata:
    m = output.kv_connector_metadata
    assert isinstance(m, PdkvConnectorMetadata), type(m)
    return m


def free_blocks(s: Any) -> int:
    return int(s.kv_cache_manager.block_pool.get_num_free_blocks())


def consumer_params(transfer_id: str) -> dict[str, Any]:
    return {"do_remote_prefill": True, "transfer_id": transfer_id, "remote_registry": REGISTRY}


_configs: dict[tuple[str, str], Any] = {}


def config(role: str, policy: str = "recompute") -> Any:
    key = (role, policy)
    if key not in _configs:
        extra = {} if role == "kv_consumer" else {"registry_port": 45999}
        _configs[key] = env.vllm_config(MODEL, role, extra=extra, policy=policy, max_num_batched_tokens=128)
    return _configs[key]


@scenario
def consumer_loads_then_computes_only_the_last_token() -> None:
    s = env.scheduler(config("kv_consumer"))
    assert isinstance(s.connector, PdkvConnector)
    start = free_blocks(s)
    r = env.request("d1", PROMPT, consumer_params("t-d1"))
    s.add_request(r)
    out = s.schedule()
    m = meta(out)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS, r.status
    assert dict(out.num_scheduled_tokens) == {}, out.num_scheduled_tokens
    assert len(m.loads) == 1 and not m.sends and not m.layer_saves, m
    load = m.loads[0]
    blocks = s.kv_cache_manager.get_block_ids("d1")[0]
    assert load.dst_pages == tuple(blocks[:PAGES]) and len(load.dst_pages) == PAGES, (load, blocks)
    assert load.prefix_pages == 0 and load.registry == REGISTRY and load.room == expected_room("t-d1"), load
    assert free_blocks(s) <= start - PAGES
    # the worker is not done yet: the request waits and is not asked for again
    s.update_from_output(out, env.runner_output(out, {"d1": r}))
    out = s.schedule()
    assert meta(out).loads == () and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s.update_from_output(out, env.runner_output(out, {"d1": r}, finished_recving={"d1"}))
    out = s.schedule()
    # 100 prompt tokens came over: vLLM computes only the last one again (to sample the next token)
    assert dict(out.num_scheduled_tokens) == {"d1": 1}, out.num_scheduled_tokens
    assert r.num_computed_tokens == 100, r.num_computed_tokens
    s.update_from_output(out, env.runner_output(out, {"d1": r}))
    assert r.num_output_tokens == 1 and r.kv_transfer_params["do_remote_prefill"] is False


@scenario
def consumer_load_error_recomputes_from_the_first_bad_block() -> None:
    s = env.scheduler(config("kv_consumer"))
    r = env.request("d2", PROMPT, consumer_params("t-d2"))
    s.add_request(r)
    out = s.schedule()
    load = meta(out).loads[0]
    bad = set(load.dst_pages[3:])  # what the worker reports for a room that failed after 3 blocks
    s.update_from_output(
        out, env.runner_output(out, {"d2": r}, finished_recving={"d2"}, invalid_block_ids=bad)
    )
    out = s.schedule()
    # blocks 0..2 (48 tokens) are kept, the other 52 prompt tokens are computed locally, nothing asked again
    assert dict(out.num_scheduled_tokens) == {"d2": 52}, out.num_scheduled_tokens
    assert meta(out).loads == (), meta(out)


@scenario
def consumer_load_error_fails_the_request_under_fail_policy() -> None:
    s = env.scheduler(config("kv_consumer", policy="fail"))
    r = env.request("d3", PROMPT, consumer_params("t-d3"))
    s.add_request(r)
    out = s.schedule()
    bad = set(meta(out).loads[0].dst_pages)
    s.update_from_output(
        out, env.runner_output(out, {"d3": r}, finished_recving={"d3"}, invalid_block_ids=bad)
    )
    out = s.schedule()
    assert "d3" not in out.num_scheduled_tokens and r.is_finished(), (r.status, out.num_scheduled_tokens)


@scenario
def consumer_abort_holds_blocks_until_the_worker_releases_them() -> None:
    s = env.scheduler(config("kv_consumer"))
    start = free_blocks(s)
    r = env.request("d4", PROMPT, consumer_params("t-d4"))
    s.add_request(r)
    out = s.schedule()
    load = meta(out).loads[0]
    s.update_from_output(out, env.runner_output(out, {"d4": r}))
    held = free_blocks(s)
    s.finish_requests("d4", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(s) == held, "blocks freed while a prefill may still write them"
    assert s.has_requests(), "vLLM must keep stepping until the worker releases the aborted room"
    out = s.schedule()
    assert meta(out).aborts == (
        AbortSpec(req_id="d4", room=load.room, reason="aborted by the vLLM decode scheduler"),
    )
    s.update_from_output(out, env.runner_output(out, {"d4": r}))
    assert free_blocks(s) == held
    out = s.schedule()
    s.update_from_output(out, env.runner_output(out, {"d4": r}, finished_recving={"d4"}))
    assert free_blocks(s) == start and not s.has_requests(), (free_blocks(s), start)


@scenario
def consumer_without_transfer_id_computes_locally() -> None:
    s = env.scheduler(config("kv_consumer"))
    r = env.request("d5", PROMPT, {"do_remote_prefill": True, "remote_registry": REGISTRY})
    s.add_request(r)
    out = s.schedule()
    assert dict(out.num_scheduled_tokens) == {"d5": 100} and meta(out).loads == ()


@scenario
def producer_layer_saves_then_holds_blocks_until_sent() -> None:
    s = env.scheduler(config("kv_producer"))
    start = free_blocks(s)
    r = env.request("p1", PROMPT, {"do_remote_decode": True, "transfer_id": "t-p1"}, max_tokens=1)
    s.add_request(r)
    out = s.schedule()
    blocks = tuple(s.kv_cache_manager.get_block_ids("p1")[0][:PAGES])
    assert dict(out.num_scheduled_tokens) == {"p1": 100}
    room = expected_room("t-p1")
    assert meta(out).layer_saves == (LayerSaveSpec(req_id="p1", room=room, pages=blocks, resident_pages=0),)
    outputs = s.update_from_output(out, env.runner_output(out, {"p1": r}))
    (finished,) = [o for eo in outputs.values() for o in eo.outputs if o.request_id == "p1"]
    expected = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": "t-p1",
        "remote_registry": REGISTRY,
    }
    params = finished.kv_transfer_params
    # vLLM adds its own keys (remote_prefill_cached_tokens) beside the connector's
    assert finished.finished and {k: params[k] for k in expected} == expected, params
    assert free_blocks(s) < start and s.has_requests(), "the blocks must stay held until the send finished"
    out = s.schedule()
    assert meta(out).sends == (SendSpec(req_id="p1", room=room, pages=blocks),), meta(out)
    s.update_from_output(out, env.runner_output(out, {"p1": r}))
    assert free_blocks(s) < start
    out = s.schedule()
    s.update_from_output(out, env.runner_output(out, {"p1": r}, finished_sending={"p1"}))
    assert free_blocks(s) == start and not s.has_requests()


@scenario
def producer_chunked_prefill_sends_the_whole_request_at_finish() -> None:
    s = env.scheduler(config("kv_producer"))
    prompt = list(range(1, 201))  # 200 tokens over a 128-token budget: two chunks
    r = env.request("p2", prompt, {"do_remote_decode": True}, max_tokens=1)
    s.add_request(r)
    out = s.schedule()
    assert dict(out.num_scheduled_tokens) == {"p2": 128} and meta(out).layer_saves == ()
    s.update_from_output(out, env.runner_output(out, {"p2": r}))
    out = s.schedule()
    assert dict(out.num_scheduled_tokens) == {"p2": 72} and meta(out).layer_saves == ()
    outputs = s.update_from_output(out, env.runner_output(out, {"p2": r}))
    (finished,) = [o for eo in outputs.values() for o in eo.outputs if o.request_id == "p2"]
    # no transfer id given: the request id is the transfer id
    assert finished.kv_transfer_params["transfer_id"] == "p2", finished.kv_transfer_params
    out = s.schedule()
    (send,) = meta(out).sends
    assert send.room == expected_room("p2") and len(send.pages) == 13, send


@scenario
def producer_abort_after_the_forward_aborts_the_room() -> None:
    s = env.scheduler(config("kv_producer"))
    start = free_blocks(s)
    r = env.request("p3", PROMPT, {"do_remote_decode": True, "transfer_id": "t-p3"}, max_tokens=1)
    s.add_request(r)
    out = s.schedule()
    assert len(meta(out).layer_saves) == 1
    s.finish_requests("p3", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(s) < start and s.has_requests()
    s.update_from_output(out, env.runner_output(out, {"p3": r}))
    out = s.schedule()
    assert (
        meta(out).aborts
        == (
            AbortSpec(
                req_id="p3", room=expected_room("t-p3"), reason="aborted by the vLLM prefill scheduler"
            ),
        )
        and meta(out).sends == ()
    )
    s.update_from_output(out, env.runner_output(out, {"p3": r}, finished_sending={"p3"}))
    assert free_blocks(s) == start and not s.has_requests()


@scenario
def producer_abort_before_the_forward_frees_at_once() -> None:
    s = env.scheduler(config("kv_producer"))
    start = free_blocks(s)
    r = env.request("p4", PROMPT, {"do_remote_decode": True}, max_tokens=1)
    s.add_request(r)
    s.finish_requests("p4", RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert meta(out) == PdkvConnectorMetadata()
    s.update_from_output(out, env.runner_output(out, {"p4": r}))
    assert free_blocks(s) == start and not s.has_requests(), (free_blocks(s), start)


@scenario
def producer_preemption_fails_the_layered_room_before_its_blocks_are_reused() -> None:
    s = env.scheduler(config("kv_producer"), num_blocks=16)
    y = env.request("y", list(range(600, 660)), None, max_tokens=300)
    x = env.request(
        "x", list(range(700, 760)), {"do_remote_decode": True, "transfer_id": "t-x"}, max_tokens=300
    )
    requests = {"x": x, "y": y}
    s.add_request(y)
    s.add_request(x)
    out = s.schedule()
    assert [save.req_id for save in meta(out).layer_saves] == ["x"]
    preempted: tuple[AbortSpec, ...] = ()
    for _ in range(200):  # both decode until 16 blocks run out and vLLM preempts the later request
        s.update_from_output(out, env.runner_output(out, requests))
        out = s.schedule()
        preempted = meta(out).preempted
        if preempted:
            break
    reason = "preempted by the vLLM prefill scheduler (its blocks were freed)"
    assert preempted == (AbortSpec(req_id="x", room=expected_room("t-x"), reason=reason),), preempted
    assert out.preempted_req_ids == {"x"}
    s.update_from_output(out, env.runner_output(out, requests))
    s.finish_requests(["x", "y"], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    # the failed room is reported by the worker once its sender is terminal: x's blocks wait for it
    assert [a.req_id for a in meta(out).aborts] == ["x"] and meta(out).sends == ()
    assert s.has_requests()
    s.update_from_output(out, env.runner_output(out, requests, finished_sending={"x"}))
    assert not s.has_requests()


@scenario
def both_roles_load_and_send_in_one_scheduler() -> None:
    s = env.scheduler(config("kv_both"))
    d = env.request("b1", PROMPT, consumer_params("t-b1"))
    p = env.request("b2", list(range(500, 540)), {"do_remote_decode": True}, max_tokens=1)
    s.add_request(d)
    s.add_request(p)
    out = s.schedule()
    m = meta(out)
    assert [x.req_id for x in m.loads] == ["b1"] and [x.req_id for x in m.layer_saves] == ["b2"], m
    assert dict(out.num_scheduled_tokens) == {"b2": 40}


def _refused(make: Callable[[], object], needle: str) -> None:
    try:
        make()
    except ConfigError as exc:
        assert needle in str(exc), str(exc)
        return
    raise AssertionError(f"no ConfigError mentioning {needle!r}")


@scenario
def refusals_at_construction() -> None:
    cfg = config("kv_consumer")
    worker = KVConnectorRole.WORKER
    _refused(lambda: PdkvConnector(cfg, worker, env.kv_cache_config(groups=2)), "one KV cache group, got 2")
    _refused(
        lambda: PdkvConnector(cfg, worker, env.kv_cache_config(sliding_window=True)), "SlidingWindowSpec"
    )
    tp = env.vllm_config(MODEL, "kv_consumer")
    tp.parallel_config.tensor_parallel_size = 2
    _refused(lambda: PdkvConnector(tp, worker, env.kv_cache_config()), "tensor parallelism")
    pp = env.vllm_config(MODEL, "kv_consumer")
    pp.parallel_config.pipeline_parallel_size = 2
    _refused(lambda: PdkvConnector(pp, worker, env.kv_cache_config()), "pipeline parallelism")
    # Speculative decoding stays refused: the drafter's KV layers are not described, so a layout policy
    # that leaves draft buffers out (issue 35) has nothing of the vLLM connector to apply to.
    spec = env.vllm_config(MODEL, "kv_consumer")
    spec.speculative_config = SimpleNamespace(method="eagle", num_speculative_tokens=2)
    _refused(lambda: PdkvConnector(spec, worker, env.kv_cache_config()), "speculative decoding")
    no_port = env.vllm_config(MODEL, "kv_producer")
    _refused(lambda: PdkvConnector(no_port, worker, env.kv_cache_config()), "registry_port")
    typo = env.vllm_config(MODEL, "kv_consumer", extra={"prefil_registry": REGISTRY})
    _refused(lambda: PdkvConnector(typo, worker, env.kv_cache_config()), "prefil_registry")


def main() -> None:
    results: dict[str, str | None] = {}
    for name, fn in SCENARIOS.items():
        try:
            fn()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
