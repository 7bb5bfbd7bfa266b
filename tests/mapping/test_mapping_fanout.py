"""TP fan-out: one real source per CP rank for each decode rank, consistent counts on both sides."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv.errors import MappingError
from pdkv.mapping import (
    AttentionKind,
    PrefillTarget,
    Topology,
    TopologyError,
    decode_fanout,
    prefill_fanout,
    required_dst_info_num,
)


@st.composite
def mla_topologies(draw: st.DrawFn) -> Topology:
    small = draw(st.sampled_from([1, 2, 4]))
    ratio = draw(st.sampled_from([1, 2, 4, 8]))
    prefill_bigger = draw(st.booleans())
    prefill_tp, decode_tp = (small * ratio, small) if prefill_bigger else (small, small * ratio)
    return Topology(
        prefill_tp=prefill_tp, decode_tp=decode_tp, prefill_cp=draw(st.sampled_from([1, 2, 4, 8]))
    )


@given(mla_topologies())
def test_each_decode_rank_has_exactly_one_real_source_per_cp_rank(topology: Topology) -> None:
    for d in range(topology.decode_tp):
        fanout = decode_fanout(topology, d)
        real = fanout.real_targets
        assert sorted(t.cp for t in real) == list(range(topology.prefill_cp))
        assert len({t.tp for t in real}) == 1
        assert fanout.required_statuses == len(real) == topology.prefill_cp
        # every target (real or dummy) is a distinct existing prefill rank
        coords = [(t.tp, t.cp) for t in fanout.targets]
        assert len(set(coords)) == len(coords)
        assert all(0 <= tp < topology.prefill_tp and 0 <= cp < topology.prefill_cp for tp, cp in coords)


@given(mla_topologies())
def test_both_sides_agree_on_who_talks_to_whom(topology: Topology) -> None:
    requests_received: Counter[int] = Counter()
    dummy_seen: dict[int, set[bool]] = {}
    for d in range(topology.decode_tp):
        for target in decode_fanout(topology, d).targets:
            if target.cp == 0:  # every CP rank of a TP rank receives the same requests
                requests_received[target.tp] += 1
            dummy_seen.setdefault(target.tp, set()).add(target.dummy)
    for p in range(topology.prefill_tp):
        fanout = prefill_fanout(topology, p)
        assert required_dst_info_num(topology, p) == requests_received[p] == len(fanout.decode_ranks)
        assert dummy_seen[p] == {fanout.dummy}
        for d in fanout.decode_ranks:
            assert p in {t.tp for t in decode_fanout(topology, d).targets}
    # every prefill rank is addressed; real prefill ranks cover all decode ranks
    assert set(requests_received) == set(range(topology.prefill_tp))


def test_tp_2_to_1_mla_second_prefill_rank_is_a_dummy() -> None:
    topology = Topology(prefill_tp=2, decode_tp=1)
    fanout = decode_fanout(topology, 0)
    assert fanout.targets == (PrefillTarget(tp=0, cp=0, dummy=False), PrefillTarget(tp=1, cp=0, dummy=True))
    assert fanout.required_statuses == 1
    assert [required_dst_info_num(topology, p) for p in (0, 1)] == [1, 1]
    assert [prefill_fanout(topology, p).dummy for p in (0, 1)] == [False, True]


def test_tp_1_to_2_mla_one_prefill_rank_serves_both_decode_ranks() -> None:
    topology = Topology(prefill_tp=1, decode_tp=2)
    assert decode_fanout(topology, 0).targets == (PrefillTarget(tp=0, cp=0, dummy=False),)
    assert decode_fanout(topology, 1).targets == (PrefillTarget(tp=0, cp=0, dummy=False),)
    assert prefill_fanout(topology, 0).decode_ranks == (0, 1)
    assert required_dst_info_num(topology, 0) == 2


def test_cp_ranks_multiply_the_statuses() -> None:
    topology = Topology(prefill_tp=4, decode_tp=2, prefill_cp=2)
    fanout = decode_fanout(topology, 1)
    assert [(t.tp, t.cp, t.dummy) for t in fanout.targets] == [
        (2, 0, False),
        (2, 1, False),
        (3, 0, True),
        (3, 1, True),
    ]
    assert fanout.required_statuses == 2


def test_mha_equal_tp_is_one_to_one() -> None:
    topology = Topology(prefill_tp=4, decode_tp=4, attention=AttentionKind.MHA)
    assert decode_fanout(topology, 3).targets == (PrefillTarget(tp=3, cp=0, dummy=False),)
    assert required_dst_info_num(topology, 3) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill_tp": 2, "decode_tp": 4, "attention": AttentionKind.MHA}, "MHA splits heads"),
        ({"prefill_tp": 3, "decode_tp": 2}, "one must divide the other"),
        ({"prefill_tp": 0, "decode_tp": 2}, "prefill_tp must be a positive int"),
        ({"prefill_tp": 2, "decode_tp": 2, "prefill_cp": 0}, "prefill_cp must be a positive int"),
    ],
)
def test_unsupported_topologies_are_topology_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(TopologyError, match=message) as info:
        Topology(**kwargs)  # type: ignore[arg-type]  # mixed-type kwargs on purpose
    assert isinstance(info.value, MappingError)


def test_rank_outside_the_topology_is_an_error() -> None:
    topology = Topology(prefill_tp=2, decode_tp=4)
    with pytest.raises(TopologyError, match=r"decode_tp_rank must be an int in 0\.\.3"):
        decode_fanout(topology, 4)
    with pytest.raises(TopologyError, match=r"prefill_tp_rank must be an int in 0\.\.1"):
        required_dst_info_num(topology, 2)
