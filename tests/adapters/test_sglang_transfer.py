"""Two SGLang processes move KV through pdkv over real Mooncake TCP on 127.0.0.1, byte for byte.

Each side uses SGLang's real CPU KV pool (``MLATokenToKVPool(device="cpu")``, 61 MLA layers),
``MetadataBuffers`` and KVArgs filled as SGLang's bootstrap queues fill them; every transfer class
comes from SGLang's ``get_kv_class`` after SGLang's ``load_plugins()``. Rooms of 1, 16 and 128 pages
(the last one 576 MB, with Mooncake's default TCP queue), chunked; rooms with a decode prefix (SGLang's
decode radix cache: the prefill sends only the pages after it, the decode's prefix pages stay untouched);
chunks with SGLang's CUDA events (stand-ins that complete later: pages or page ids written only then)
waited for off the scheduler thread; aborts by the decode before and
after its metadata and by the prefill. The decode compares the digest of the source pages with the
digest of its destination pages, checks every other page still holds its sentinel and that the aux
``bootstrap_room`` row landed; neither side called a GPU stub outside module import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdkv.testing.cluster import free_port
from tests.adapters.helpers import Child, children, requires_sglang

pytestmark = [requires_sglang, pytest.mark.slow]

SUCCESS, FAILED, BOOTSTRAPPING, WAITING_FOR_INPUT = 4, 0, 1, 2

ROOMS: list[dict[str, Any]] = [
    # one page, one chunk
    {"room": 101, "src_pages": [7], "dst_pages": [3], "chunks": [1], "prefill_row": 1, "decode_row": 2},
    # 16 pages in two chunks; runs and gaps on both sides, in another order on the decode
    {
        "room": 102,
        "src_pages": [*range(10, 18), 20, 22, 24, 26, 28, 30, 31, 32],
        "dst_pages": [*range(37, 29, -1), *range(5, 13)],
        "chunks": [5, 11],
        "prefill_row": 2,
        "decode_row": 3,
    },
]


LAYERS = 61  # DeepSeek-V3's layer count: one MLA buffer of 73,728 B per page per layer
PREFILL_PAGES = 160
DECODE_PAGES = 180
PAGE_BYTES = 64 * 576 * 2
_BLOCKS = [list(range(30 + 8 * i, 38 + 8 * i)) for i in range(16)]
ROOMS.append(
    # 128 pages x 61 layers (576 MB) in two chunks, runs of 8 in swapped order: one request of 8K tokens
    # moved with Mooncake's default TCP queue (SGLang's own backend needs it raised for this shape)
    {
        "room": 106,
        "src_pages": [p for i in range(0, 16, 2) for p in _BLOCKS[i + 1] + _BLOCKS[i]],
        "dst_pages": [*range(104, 168), *range(40, 104)],
        "chunks": [64, 64],
        "prefill_row": 6,
        "decode_row": 7,
    }
)

PREFIXED: list[dict[str, Any]] = [
    # SGLang's decode radix cache holds the first 3 pages (192 tokens): it names the 10 pages after them,
    # the prefill sends only those, in two chunks; the decode's own prefix pages stay untouched
    {
        "room": 107,
        "decode_prefix_dst": [27, 28, 29],
        "src_pages": [*range(40, 50)],
        "dst_pages": [*range(13, 20), 168, 169, 170],
        "chunks": [4, 6],
        "prefill_row": 7,
        "decode_row": 1,
    },
    # a one-page prefix and one page to send
    {
        "room": 108,
        "decode_prefix_dst": [4],
        "src_pages": [50],
        "dst_pages": [1],
        "chunks": [1],
        "prefill_row": 0,
        "decode_row": 0,
    },
]
ROOMS.extend(PREFIXED)

EVENTS: list[dict[str, Any]] = [
    # SGLang's early send under overlap scheduling: the first chunk's pages are still being written by
    # the forward (zero on the prefill until its event completes, 0.3 s later); its second chunk queues
    # behind it. Sent before the wait, the decode would get zeros.
    {
        "room": 109,
        "src_pages": [158, 159, 160, 9, 19],
        "dst_pages": [171, 172, 173, 174, 175],
        "chunks": [2, 3],
        "prefill_row": 8,
        "decode_row": 8,
        "early_send_event_s": 0.3,
    },
    # host-tensor page ids (supports_host_tensor_indices): the ids land in the tensor when the copy's
    # event completes; read earlier, they would name the wrong pages
    {
        "room": 110,
        "src_pages": [60, 61, 62],
        "dst_pages": [176, 177, 178],
        "chunks": [3],
        "prefill_row": 9,
        "decode_row": 9,
        "indices_event_s": 0.2,
    },
]
ROOMS.extend(EVENTS)

ABORTS: list[dict[str, Any]] = [
    # the decode aborts right after send_metadata: both sides fail, pages reusable only after the acks
    {
        "room": 103,
        "src_pages": [1, 2, 3, 4],
        "dst_pages": [20, 21, 22, 23],
        "chunks": [4],
        "prefill_row": 3,
        "decode_row": 4,
        "decode_abort": "after_metadata",
    },
    # the decode aborts before send_metadata: no page was named, the prefill is told all the same
    {
        "room": 104,
        "src_pages": [5],
        "dst_pages": [24],
        "chunks": [1],
        "prefill_row": 4,
        "decode_row": 5,
        "decode_abort": "before_metadata",
    },
    # the prefill aborts after its chunks were queued: the decode sees the failure with pdkv's reason
    {
        "room": 105,
        "src_pages": [6, 8],
        "dst_pages": [25, 26],
        "chunks": [1, 1],
        "prefill_row": 5,
        "decode_row": 6,
        "prefill_abort": True,
    },
]


# The engine comes from PDKV_BACKEND (SGLang's --disaggregation-transfer-backend names pdkv itself).
ENGINES = {
    "mooncake": {"PDKV_BACKEND": "mooncake"},
    "nixl": {"PDKV_BACKEND": "nixl", "PDKV_NIXL_UCX_NET_DEVICES": "lo"},
}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_two_processes_move_bytes_exactly(tmp_path: Path, engine: str) -> None:
    stop_file = tmp_path / "stop"
    base: dict[str, Any] = {
        "bootstrap_port": free_port(),
        "http_port": free_port(),
        "layers": LAYERS,
        "prefill_pages": PREFILL_PAGES,
        "decode_pages": DECODE_PAGES,
        "rooms": ROOMS + ABORTS,
        "timeout_s": 90,
        "grace_s": 2,
        "stop_file": str(stop_file),
    }
    with children() as started:
        env = ENGINES[engine]
        prefill = Child("prefill", {**base, "result": str(tmp_path / "prefill.json")}, tmp_path, env)
        started.append(prefill)
        decode = Child("decode", {**base, "result": str(tmp_path / "decode.json")}, tmp_path, env)
        started.append(decode)
        assert decode.wait(180) == 0, decode.log_tail()
        stop_file.touch()
        assert prefill.wait(120) == 0, prefill.log_tail()
        got_prefill, got_decode = prefill.result(), decode.result()

    for room in PREFIXED:
        # the prefill learnt the decode's prefix (in tokens, as SGLang's pop_decode_prefix_len answers)
        assert got_prefill["prefix_tokens"][str(room["room"])] == 64 * len(room["decode_prefix_dst"])
    assert got_prefill["prefix_tokens"]["102"] == 0
    for room in EVENTS:
        record = got_prefill["rooms"][str(room["room"])]
        # the chunk waited for its event off the scheduler thread, which did not wait (send returned
        # well before the event completed); the room's later chunks queued behind it
        assert record["events"] == [
            {"asked": True, "asked_on_scheduler_thread": False, "pdkv_sends_after_complete": True}
        ], record
        assert record["deferred_chunks"] == len(room["chunks"]), record
        assert record["longest_send_s"] < 0.15, record
    for room in ROOMS:
        if room not in EVENTS:  # no event: nothing waited, every chunk went to pdkv at once
            assert got_prefill["rooms"][str(room["room"])]["deferred_chunks"] == 0
    for room in ROOMS:
        key = str(room["room"])
        assert got_prefill["first_polls"][key] == BOOTSTRAPPING
        assert got_decode["first_polls"][key] == BOOTSTRAPPING
        assert got_decode["polls_after_init"][key] == WAITING_FOR_INPUT  # the prefill is resolved
        assert got_prefill["rooms"][key]["state"] == SUCCESS, got_prefill["rooms"][key]
        assert got_decode["rooms"][key]["state"] == SUCCESS, got_decode["rooms"][key]
        check = got_decode["verified"][key]
        assert check["digests_equal"] and check["mismatched_pages"] == 0, check
        assert check["aux_room"] == room["room"]
        assert check["aux_token"] == room["room"] % 50_000
        # metric valid after clear(): every layer's pages (+ aux rows), and clear() keeps Success
        record = got_prefill["rooms"][key]
        assert record["bytes"] >= len(room["src_pages"]) * LAYERS * PAGE_BYTES
        assert record["poll_after_clear"] == SUCCESS
    decode_abort = got_decode["rooms"]["103"]
    assert decode_abort["state"] == FAILED
    assert "aborted by the SGLang decode scheduler" in decode_abort["error"], decode_abort
    assert decode_abort["release_safe"] is True
    # The decode's Abort reaches the prefill whether or not it had opened the room: it polls Failed by
    # itself (the child aborts a room still Bootstrapping after a grace period; that must not be needed).
    # Success is possible only if every write ended before the abort arrived.
    prefill_103 = got_prefill["rooms"]["103"]
    assert prefill_103["state"] in (FAILED, SUCCESS) and "state_before_abort" not in prefill_103, prefill_103

    early_abort = got_decode["rooms"]["104"]
    assert early_abort["state"] == FAILED
    assert "aborted by the SGLang decode scheduler" in early_abort["error"], early_abort
    assert early_abort["release_safe"] is True
    prefill_104 = got_prefill["rooms"]["104"]
    assert prefill_104["state"] == FAILED and "state_before_abort" not in prefill_104, prefill_104
    assert "aborted by the SGLang decode scheduler" in prefill_104["error"], prefill_104

    prefill_abort = got_decode["rooms"]["105"]
    assert got_prefill["rooms"]["105"]["state"] == FAILED
    assert prefill_abort["state"] == FAILED
    assert prefill_abort["error"].startswith("KVTransferError") and "pdkv" in prefill_abort["error"]
    assert prefill_abort["release_safe"] is True

    # Every page outside the successful rooms still holds its sentinel, except possibly pages of the rooms
    # aborted after their destinations were sent (writes may have landed before the abort).
    succeeded = {p for room in ROOMS for p in room["dst_pages"]}
    maybe_written = {p for room in (ABORTS[0], ABORTS[2]) for p in room["dst_pages"]}
    verified = got_decode["verified"]
    assert set(verified["dirty_pages"]) <= maybe_written, verified["dirty_pages"]
    prefix_held = {p for room in PREFIXED for p in room["decode_prefix_dst"]}
    assert verified["prefix_pages_checked"] == len(prefix_held) == 4
    assert verified["prefix_pages_intact"] is True
    # every page of the pool (its padding page 0 too) is a destination, a held prefix page, or checked
    assert verified["untouched_pages"] + len(verified["dirty_pages"]) == (
        DECODE_PAGES + 1 - len(succeeded) - len(prefix_held)
    )
    assert got_decode["prefill_info"] == {"dp_size": 1, "follow_bootstrap_room": True}
    for side in (got_prefill, got_decode):
        assert side["stub_calls_outside_import"] == []


@pytest.mark.parametrize("switch", ["PDKV_KV_CHECKSUM"])
def test_checksums_on_every_room_is_verified_before_success(tmp_path: Path, switch: str) -> None:
    """The same transfer with pdkv's checksums on in both processes (the pdkv variable: SGLang's own
    ``--disaggregation-enable-kv-checksum`` turns them on too, but also runs SGLang's GPU-only digest):
    small rooms, chunked and with a decode prefix; each is verified by the decode before its Success,
    and the bytes still equal the source's."""
    rooms = [ROOMS[0], ROOMS[1], PREFIXED[0]]
    stop_file = tmp_path / "stop"
    base: dict[str, Any] = {
        "bootstrap_port": free_port(),
        "http_port": free_port(),
        "layers": 4,
        "prefill_pages": PREFILL_PAGES,
        "decode_pages": DECODE_PAGES,
        "rooms": rooms,
        "timeout_s": 90,
        "grace_s": 2,
        "stop_file": str(stop_file),
    }
    env = {switch: "1"}
    with children() as started:
        prefill = Child("prefill", {**base, "result": str(tmp_path / "prefill.json")}, tmp_path, env=env)
        started.append(prefill)
        decode = Child("decode", {**base, "result": str(tmp_path / "decode.json")}, tmp_path, env=env)
        started.append(decode)
        assert decode.wait(180) == 0, decode.log_tail()
        stop_file.touch()
        assert prefill.wait(120) == 0, prefill.log_tail()
        got_decode = decode.result()
    for room in rooms:
        key = str(room["room"])
        assert got_decode["rooms"][key]["state"] == SUCCESS, got_decode["rooms"][key]
        check = got_decode["verified"][key]
        assert check["digests_equal"] and check["mismatched_pages"] == 0, check
    assert got_decode["checksums"] == {"on": True, "rooms_verified": len(rooms), "checksum_failures": 0}
