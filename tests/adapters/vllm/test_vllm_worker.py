"""vLLM 0.33.0 (official wheel, .venv-vllm): two processes, each a model-less vLLM engine (real Scheduler,
real worker glue and connector factory, CPU KV tensors in the CPU backend's layout), move KV through the
pdkv connector over real Mooncake TCP on 127.0.0.1; the decode side runs as ``kv_both``. See
``worker_child`` for the requests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdkv.testing.cluster import free_port
from tests.adapters.vllm.helpers import VLLM_PYTHON, Child, read_json, requires_vllm

pytestmark = [requires_vllm, pytest.mark.slow]


@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "kv_checksum"])
def test_vllm_0_33_worker_side_over_mooncake_tcp(tmp_path: Path, checksum: bool) -> None:
    """``checksum``: kv_connector_extra_config ``kv_checksum`` on both instances: every load that
    completes was verified against the producer's checksums first; nothing else changes."""
    plan = tmp_path / "plan.json"
    ports = {
        "registry_port": free_port(),
        "both_registry_port": free_port(),
        "dist_ports": [free_port(), free_port()],
        "dead_port": free_port(),
        "kv_checksum": checksum,
    }
    plan.write_text(json.dumps(ports))
    children = [
        Child(VLLM_PYTHON, "tests.adapters.vllm.worker_child", [role, str(plan)], tmp_path, role)
        for role in ("prefill", "decode")
    ]
    try:
        for child in children:
            child.wait(timeout_s=240)
        prefill, decode = (read_json(tmp_path / f"{role}-result.json") for role in ("prefill", "decode"))
        assert prefill["ok"], prefill.get("error", "") + children[0].log_tail()
        assert decode["ok"], decode.get("error", "") + children[1].log_tail()
    finally:
        for child in children:
            child.stop()
    # A went layer by layer during the prefill's forward (2 layers), B whole when the decode asked
    assert (prefill["per_layer_registered"], prefill["layers_submitted"]) == (1, 2)
    assert prefill["sending"] == ["A", "B", "E", "G"]  # every held block set came back to vLLM
    assert (
        prefill["b_params"]["remote_registry"]
        == f"tcp://127.0.0.1:{json.loads(plan.read_text())['registry_port']}"
    )
    # every block of A and B holds the prefill's bytes, no other block of the decode was written
    assert decode["checked"] == {"A": [], "B": [], "G": []} and decode["stray_blocks"] == []
    # G: 4 blocks from the decode's prefix cache (A's, left as they were), 2 from the prefill
    assert decode["g_prefix_pages"] == 4 and decode["g_shares_a_blocks"]
    # A and B computed only their last prompt token; E's failed room was recomputed whole (100 tokens),
    # so was F's (40 tokens), whose prefill registry never answered
    assert decode["scheduled"] == {"A": [1, 1], "B": [1, 1], "E": [100, 1], "F": [40, 1], "G": [1, 1]}
    assert decode["e_pages_reported_invalid"]
    # C, aborted while loading, kept its blocks until pdkv released them; all blocks came back
    assert decode["held_after_abort"] and decode["free_blocks_back"]
    # with checksums: A, B and G (the loads that completed) were each verified before they counted
    verified = 3 if checksum else 0
    assert decode["checksums"] == {"on": checksum, "rooms_verified": verified, "checksum_failures": 0}
