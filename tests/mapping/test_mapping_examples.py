"""The worked examples of specs/mapping.md: each one run through pdkv.mapping, and the spec in sync.

The expected outputs in specs/mapping_examples.json were derived by hand from the formulas; this
test only compares. specs/mapping.md embeds every example as a JSON block, and the last test fails
when the two files disagree, so the spec and the tests cannot drift apart.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs
import pytest

from pdkv.errors import PdkvError
from pdkv.mapping import (
    AttentionKind,
    BlockCyclic,
    BufferKind,
    BufferLayout,
    BufferSpec,
    HeadGeometry,
    ItemLayout,
    LayerKey,
    ModelRole,
    OwnershipPolicy,
    PageInterleaved,
    PageRuns,
    StateLayerMap,
    Topology,
    TransferBlocks,
    chunk_page_start,
    clip_state,
    coalesce,
    compare_state_layers,
    cp_owned,
    decode_fanout,
    dst_for_positions,
    head_plan,
    kv_blocks,
    layer_blocks,
    prefill_fanout,
    required_dst_info_num,
    shape_batches,
    state_blocks,
)
from pdkv.mapping.landing import ScatterPlan, landing_slots, plan_landing, plan_scatter
from pdkv.mapping.staging import GatherPlan, StagingSources, plan_staged_pieces, staged_entries

SPECS = Path(__file__).resolve().parents[2] / "specs"
EXAMPLES: list[dict[str, Any]] = json.loads((SPECS / "mapping_examples.json").read_text())["examples"]


def _policy(data: dict[str, Any]) -> OwnershipPolicy:
    if data["name"] == "interleaved":
        return PageInterleaved(cp_size=data["cp_size"])
    assert data["name"] == "block_cyclic"
    return BlockCyclic(cp_size=data["cp_size"], block_pages=data["block_pages"])


def _heads(data: dict[str, Any]) -> HeadGeometry:
    return HeadGeometry(
        kv_heads=data["kv_heads"],
        head_start=data["head_start"],
        head_count=data["head_count"],
        head_bytes=data["head_bytes"],
        item_layout=ItemLayout(data["item_layout"]),
    )


def _layout(data: dict[str, Any]) -> BufferLayout:
    specs = [
        BufferSpec(
            kind=BufferKind(b["kind"]),
            model=ModelRole(b["model"]),
            layer_id=b["layer_id"],
            base_ptr=b["base_ptr"],
            length=b["length"],
            item_bytes=b["item_bytes"],
            heads=_heads(b["heads"]) if "heads" in b else None,
        )
        for b in data["buffers"]
    ]
    return BufferLayout.build(
        attention=AttentionKind(data["attention"]), page_size=data["page_size"], buffers=specs
    )


def _blocks(data: dict[str, Any]) -> TransferBlocks:
    return TransferBlocks(src=data["src"], dst=data["dst"], length=data["length"], buffer=data["buffer"])


def _run_chunk(inp: dict[str, Any], expected: dict[str, Any]) -> None:
    policy = _policy(inp["policy"])
    first = chunk_page_start(inp["start_token"], inp["page_size"])
    if "error" in expected:  # every rank's map is attempted; one of the calls must raise
        for cp_rank in range(policy.cp_size):
            dst_for_positions(
                inp["dst_pages"], cp_owned(inp["chunk_logical_pages"], first, cp_rank, policy).positions
            )
        return
    for rank in expected["ranks"]:
        owned = cp_owned(inp["chunk_logical_pages"], first, rank["cp_rank"], policy)
        assert owned.physical.tolist() == rank["physical"]
        assert owned.positions.tolist() == rank["positions"]
        dst = dst_for_positions(inp["dst_pages"], owned.positions)
        assert dst.tolist() == rank["dst"]
        assert coalesce(owned.physical, dst) == PageRuns(**rank["runs"])


def _run_blocks(inp: dict[str, Any], expected: dict[str, Any]) -> None:
    local, peer = _layout(inp["local"]), _layout(inp["peer"])
    if "runs" in inp:
        with_heads = any("heads" in b for b in inp["local"]["buffers"])
        build = kv_blocks if with_heads else layer_blocks
        got = build(PageRuns(**inp["runs"]), local, peer)
    else:
        state = inp["state"]
        got = state_blocks(BufferKind(state["kind"]), state["src_slots"], state["dst_slots"], local, peer)
    assert got == _blocks(expected["blocks"])


def _run_state_layers(inp: dict[str, Any], expected: dict[str, Any]) -> None:
    layer_map = StateLayerMap.from_layer_ids(inp["state_layers"], num_layers=inp["num_layers"])
    assert layer_map.slot_of(expected["slot_of"]["layers"]).tolist() == expected["slot_of"]["slots"]
    assert layer_map.layer_of(expected["layer_of"]["slots"]).tolist() == expected["layer_of"]["layers"]
    assert layer_map.has_state(list(range(inp["num_layers"]))).tolist() == expected["has_state"]
    diff = compare_state_layers(
        [LayerKey(model=ModelRole.TARGET, layer_id=i) for i in inp["state_layers"]],
        [LayerKey(model=ModelRole.TARGET, layer_id=i) for i in inp["peer_state_layers"]],
    )
    assert diff is not None
    assert [k.layer_id for k in diff.missing_here] == expected["missing_here"]
    assert [k.layer_id for k in diff.missing_there] == expected["missing_there"]


def _run_fanout(inp: dict[str, Any], expected: dict[str, Any]) -> None:
    topology = Topology(
        prefill_tp=inp["prefill_tp"],
        decode_tp=inp["decode_tp"],
        prefill_cp=inp["prefill_cp"],
        attention=AttentionKind(inp["attention"]),
        kv_heads=inp.get("kv_heads"),
    )
    for want in expected["decode"]:
        fanout = decode_fanout(topology, want["decode_tp_rank"])
        assert [{"tp": t.tp, "cp": t.cp, "dummy": t.dummy} for t in fanout.targets] == want["targets"]
        assert fanout.required_statuses == want["required_statuses"]
    for want in expected["prefill"]:
        p = want["prefill_tp_rank"]
        served = prefill_fanout(topology, p)
        assert list(served.decode_ranks) == want["decode_ranks"]
        assert served.dummy is want["dummy"]
        assert required_dst_info_num(topology, p) == want["required_dst_info_num"]
    if "plan" in expected:
        plan = head_plan(topology)
        assert {name: getattr(plan, name).tolist() for name in expected["plan"]} == expected["plan"]
        assert len(expected["plan"]) == len(attrs.fields(type(plan)))


def _sources(data: dict[str, Any], layout: BufferLayout) -> StagingSources:
    return StagingSources(
        buffer_region=data["buffer_region"],
        buffer_start=[b.base_ptr for b in layout.buffers],
        buffer_end=[b.base_ptr + b.length for b in layout.buffers],
        region_start=data["region_start"],
        region_bytes=data["region_bytes"],
    )


def _run_staged(inp: dict[str, Any], expected: dict[str, Any]) -> None:
    local, peer = _layout(inp["local"]), _layout(inp["peer"])
    blocks = kv_blocks(PageRuns(**inp["runs"]), local, peer)
    assert staged_entries(blocks) == expected["staged_entries"]
    pieces = plan_staged_pieces(blocks, _sources(inp["sources"], local), piece_bytes=inp["piece_bytes"])
    got = [
        {
            "nbytes": p.nbytes,
            "gather": {f.name: getattr(p.gather, f.name).tolist() for f in attrs.fields(GatherPlan)},
            "blocks": {name: getattr(p.blocks, name).tolist() for name in ("src", "dst", "length", "buffer")},
        }
        for p in pieces
    ]
    assert got == expected["pieces"]


def _run_landing(inp: dict[str, Any], expected: dict[str, Any]) -> None:
    local, peer = _layout(inp["local"]), _layout(inp["peer"])
    topology = Topology(attention=AttentionKind.MHA, **inp["topology"])
    lease = plan_landing(
        peer,
        topology,
        inp["decode_tp_rank"],
        first_position=inp["first_position"],
        slots=inp["slots"],
        base=inp["base"],
    )
    want = expected["lease"]
    assert [lease.source_tp_rank.tolist(), lease.offset.tolist(), lease.nbytes.tolist()] == [
        want["source_tp_rank"],
        want["offset"],
        want["nbytes"],
    ]
    assert lease.total_bytes == want["total_bytes"]
    region = lease.region_of(inp["source_tp_rank"])
    assert [b.base_ptr for b in region.buffers] == expected["region_bases"]
    slots = landing_slots(inp["positions"], lease)
    assert kv_blocks(coalesce(inp["physical"], slots), local, region) == _blocks(expected["writes"])
    plan = plan_scatter(
        lease,
        inp["source_tp_rank"],
        peer,
        positions=inp["positions"],
        dst_pages=inp["dst_pages"],
        regions=_sources(inp["regions"], peer),
    )
    assert {f.name: getattr(plan, f.name).tolist() for f in attrs.fields(ScatterPlan)} == expected["scatter"]


def _run_clip_state(inp: dict[str, Any], expected: dict[str, Any]) -> None:
    clipped = clip_state(inp["src"], inp["dst"])
    assert clipped.src.tolist() == expected["src"]
    assert clipped.dst.tolist() == expected["dst"]
    assert (clipped.clipped_src, clipped.clipped_dst) == (expected["clipped_src"], expected["clipped_dst"])


def _run_shape_batches(inp: dict[str, Any], expected: dict[str, Any]) -> None:
    batches = shape_batches(
        _blocks(inp["blocks"]),
        max_entries=inp["max_entries"],
        slice_bytes=inp["slice_bytes"],
        max_batch_bytes=inp["max_batch_bytes"],
    )
    assert batches == [_blocks(b) for b in expected["batches"]]


RUNNERS = {
    "chunk": _run_chunk,
    "blocks": _run_blocks,
    "state_layers": _run_state_layers,
    "fanout": _run_fanout,
    "clip_state": _run_clip_state,
    "shape_batches": _run_shape_batches,
    "staged": _run_staged,
    "landing": _run_landing,
}


@pytest.mark.parametrize("example", EXAMPLES, ids=[e["id"] for e in EXAMPLES])
def test_worked_example(example: dict[str, Any]) -> None:
    run = RUNNERS[example["kind"]]
    expected = example["expected"]
    if "error" in expected:
        with pytest.raises(PdkvError) as info:
            run(example["input"], expected)
        assert type(info.value).__name__ == expected["error"]
        assert expected["message_contains"] in str(info.value)
    else:
        run(example["input"], expected)


def test_the_examples_cover_what_the_spec_promises() -> None:
    assert len(EXAMPLES) >= 12
    assert len({e["id"] for e in EXAMPLES}) == len(EXAMPLES)
    chunks = [e for e in EXAMPLES if e["kind"] == "chunk" and "error" not in e["expected"]]
    assert {e["input"]["policy"]["cp_size"] for e in chunks} >= {1, 2, 4, 8}
    assert any(e["input"]["policy"]["name"] == "block_cyclic" for e in chunks)
    assert any(e["input"]["start_token"] > 0 for e in chunks)
    fanouts = [(e["input"]["prefill_tp"], e["input"]["decode_tp"]) for e in EXAMPLES if e["kind"] == "fanout"]
    assert (2, 1) in fanouts and (1, 2) in fanouts
    assert any(e["kind"] == "state_layers" for e in EXAMPLES)
    heads = [e["input"] for e in EXAMPLES if e["kind"] == "fanout" and "kv_heads" in e["input"]]
    shapes = {(i["kv_heads"], i["prefill_tp"], i["decode_tp"]) for i in heads}
    assert {(8, 2, 4), (8, 4, 2), (2, 4, 2), (2, 2, 4)} <= shapes  # both directions, dividing and replicating
    head_blocks = [
        e["input"]
        for e in EXAMPLES
        if e["kind"] == "blocks" and any("heads" in b for b in e["input"]["local"]["buffers"])
    ]
    counts = {
        (i["local"]["buffers"][0]["heads"]["head_count"], i["peer"]["buffers"][0]["heads"]["head_count"])
        for i in head_blocks
    }
    assert any(here > there for here, there in counts) and any(here < there for here, there in counts)


def test_the_spec_embeds_every_example_verbatim() -> None:
    text = (SPECS / "mapping.md").read_text()
    blocks = [json.loads(b) for b in re.findall(r"```json\n(.*?)\n```", text, flags=re.DOTALL)]
    embedded = [b for b in blocks if isinstance(b, dict) and "id" in b and "expected" in b]
    assert embedded == EXAMPLES
