"""SGLang's own scheduler-side code drives pdkv on CPU: its prefill and decode queue classes.

The prefill process runs SGLang 0.5.23's real ``PrefillBootstrapQueue`` (sender creation, the poll
all-reduce over a one-rank gloo group, ``finalize_bootstrap``: ``pop_decode_prefix_len`` then ``init``)
and the scheduler mixin's ``send_kv_chunk`` (page ids from ``req_to_token``, from ``start_send_idx`` on,
chunked, the metadata row written by ``MetadataBuffers.set_buf``). The decode process is either the
hand-driven decode rank of the transfer test (a decode prefix it names itself) or SGLang's real
``DecodePreallocQueue`` / ``DecodeTransferQueue`` (prefill-info handshake, page allocation by SGLang's
allocator, a decode radix-cache hit turned into ``decode_prefix_len``, ``send_metadata`` once the
receiver polls WaitingForInput, the aux-row gate, the first token committed). Stand-ins only for the
scheduler object (the attributes these paths read) and the model forward (pages hold the test pattern).
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
    assert got_prefill["stub_calls_outside_import"] == []


BOTH_ROOMS: list[dict[str, Any]] = [
    # SGLang allocates the decode pages; the prefill sends in two chunks (2 + 3 pages)
    {"room": 203, "prefill_prefix_pages": [], "src_pages": [*range(10, 15)], "chunks": [2, 3]},
    {"room": 204, "prefill_prefix_pages": [], "src_pages": [30], "chunks": [1]},
    # the decode's radix cache holds the first 2 pages of this prompt: SGLang's decode names the 3 pages
    # after them with decode_prefix_len = 128 tokens, SGLang's prefill sends those (1 + 2 pages)
    {"room": 205, "prefill_prefix_pages": [1, 2], "src_pages": [20, 21, 22], "chunks": [1, 2]},
]


def test_sglang_prefill_and_decode_queues_move_bytes_exactly(tmp_path: Path) -> None:
    """Both sides SGLang's own queue code: the decode's DecodePreallocQueue allocates the pages and sends
    the metadata only after the receiver polled WaitingForInput, DecodeTransferQueue hands the request
    over once the aux row landed, with the prefill's first token."""
    stop_file = tmp_path / "stop"
    base: dict[str, Any] = {
        "bootstrap_port": free_port(),
        "http_port": free_port(),
        "layers": 8,
        "prefill_pages": 40,
        "decode_pages": 40,
        "rooms": BOTH_ROOMS,
        "timeout_s": 60,
        "stop_file": str(stop_file),
    }
    with children() as started:
        prefill = Child("prefill_queues", {**base, "result": str(tmp_path / "prefill.json")}, tmp_path)
        started.append(prefill)
        decode = Child("decode_queues", {**base, "result": str(tmp_path / "decode.json")}, tmp_path)
        started.append(decode)
        assert decode.wait(150) == 0, decode.log_tail()
        stop_file.touch()
        assert prefill.wait(90) == 0, prefill.log_tail()
        got_prefill, got_decode = prefill.result(), decode.result()

    assert got_decode["failed"] == [] and got_decode["streamed"] == []
    for room in BOTH_ROOMS:
        key = str(room["room"])
        assert got_prefill["rooms"][key]["state"] == SUCCESS, got_prefill["rooms"][key]
        received = got_decode["rooms"][key]
        assert received["state"] == SUCCESS, received
        assert len(received["dst_pages"]) == len(room["src_pages"])
        # the first token came through the metadata row, committed by SGLang's transfer queue
        assert received["output_ids"] == [room["room"] % 50_000]
        assert got_decode["committed"][f"req-{key}"] == room["room"] % 50_000
        check = got_decode["verified"][key]
        assert check["digests_equal"] and check["mismatched_pages"] == 0, check
        # the prefix positions map to the pages the radix cache held, which kept their own bytes
        assert received["prefix_pages"] == received["held_pages"]
        assert len(received["held_pages"]) == len(room["prefill_prefix_pages"])
        assert got_prefill["rooms"][key]["start_send_idx"] == PAGE * len(room["prefill_prefix_pages"])
    assert got_decode["verified"]["prefix_pages_checked"] == 2
    assert got_decode["verified"]["prefix_pages_intact"] is True
    assert got_decode["verified"]["dirty_pages"] == []
    for side in (got_prefill, got_decode):  # no GPU stub ran, building the queues included
        assert side["stub_calls_outside_import"] == []
