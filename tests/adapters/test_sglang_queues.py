"""SGLang's own prefill code drives pdkv: ``PrefillBootstrapQueue`` and the scheduler's ``send_kv_chunk``.

The prefill process runs SGLang 0.5.23's real ``PrefillBootstrapQueue`` (sender creation, the poll
all-reduce, ``finalize_bootstrap``: ``pop_decode_prefix_len`` then ``init``) and the scheduler mixin's
``send_kv_chunk`` (page ids from ``req_to_token``, from ``start_send_idx`` on, chunked, the metadata
row written by ``MetadataBuffers.set_buf``), with a stand-in scheduler object carrying what those paths
read. The decode process is the adapter test's decode rank (receivers driven as ``decode.py`` does), one
request with a decode prefix. Bytes are verified as in the transfer test.

SGLang's decode queues (``DecodePreallocQueue`` / ``DecodeTransferQueue``) are not driven: see
``sglang_child.scenario_prefill_queues`` and the README for what stops them on CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdkv.testing.cluster import free_port
from tests.adapters.helpers import Child, children, requires_sglang

pytestmark = [requires_sglang, pytest.mark.slow]

SUCCESS = 4
PAGE = 64

ROOMS: list[dict[str, Any]] = [
    # the decode holds the first 3 pages (its radix cache); SGLang's prefill sends the 7 after them
    # in two chunks (3 + 4 pages), from start_send_idx = 192 tokens
    {
        "room": 201,
        "prefill_prefix_pages": [1, 2, 3],
        "src_pages": [*range(10, 17)],
        "decode_prefix_dst": [4, 5, 6],
        "dst_pages": [*range(20, 27)],
        "chunks": [3, 4],
        "decode_row": 1,
    },
    # no prefix, one chunk
    {
        "room": 202,
        "prefill_prefix_pages": [],
        "src_pages": [30, 31],
        "dst_pages": [8, 9],
        "chunks": [2],
        "decode_row": 2,
    },
]


def test_sglang_prefill_queue_and_send_kv_chunk_move_bytes_exactly(tmp_path: Path) -> None:
    stop_file = tmp_path / "stop"
    base: dict[str, Any] = {
        "bootstrap_port": free_port(),
        "http_port": free_port(),
        "layers": 8,
        "prefill_pages": 40,
        "decode_pages": 40,
        "rooms": ROOMS,
        "timeout_s": 60,
        "stop_file": str(stop_file),
    }
    with children() as started:
        prefill = Child("prefill_queues", {**base, "result": str(tmp_path / "prefill.json")}, tmp_path)
        started.append(prefill)
        decode = Child("decode", {**base, "result": str(tmp_path / "decode.json")}, tmp_path)
        started.append(decode)
        assert decode.wait(150) == 0, decode.log_tail()
        stop_file.touch()
        assert prefill.wait(90) == 0, prefill.log_tail()
        got_prefill, got_decode = prefill.result(), decode.result()

    for room in ROOMS:
        key = str(room["room"])
        sent = got_prefill["rooms"][key]
        # SGLang's finalize_bootstrap set start_send_idx from pop_decode_prefix_len (tokens)
        assert sent["start_send_idx"] == PAGE * len(room.get("decode_prefix_dst", [])), sent
        assert sent["state"] == SUCCESS and sent["observed"] is True, sent
        assert sent["bytes"] >= len(room["src_pages"]) * 8 * PAGE * 576 * 2
        assert got_decode["rooms"][key]["state"] == SUCCESS, got_decode["rooms"][key]
        check = got_decode["verified"][key]
        assert check["digests_equal"] and check["mismatched_pages"] == 0, check
        assert check["aux_room"] == room["room"]
        assert check["aux_token"] == room["room"] % 50_000
    verified = got_decode["verified"]
    assert verified["prefix_pages_intact"] is True and verified["prefix_pages_checked"] == 3
    assert verified["dirty_pages"] == []
    assert got_prefill["stub_calls_during_transfer"] == []
