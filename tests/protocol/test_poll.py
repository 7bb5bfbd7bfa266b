from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv.protocol.poll import KVPoll, consensus, consensus_columns


def test_values_are_sglangs() -> None:
    assert [(p.name, int(p)) for p in KVPoll] == [
        ("Failed", 0),
        ("Bootstrapping", 1),
        ("WaitingForInput", 2),
        ("Transferring", 3),
        ("Success", 4),
    ]


@given(st.lists(st.sampled_from(list(KVPoll)), min_size=1))
def test_one_failed_rank_fails_everyone_and_least_advanced_wins(polls: list[KVPoll]) -> None:
    result = consensus(polls)
    if KVPoll.Failed in polls:
        assert result is KVPoll.Failed
    assert result in polls
    assert all(result <= p for p in polls)


def test_columns_reduce_per_room_and_refuse_ragged_input() -> None:
    a = [KVPoll.Success, KVPoll.Transferring, KVPoll.Success]
    b = [KVPoll.Success, KVPoll.Success, KVPoll.Failed]
    assert consensus_columns([a, b]) == [KVPoll.Success, KVPoll.Transferring, KVPoll.Failed]
    with pytest.raises(ValueError, match="rank 1 polled 2 rooms"):
        consensus_columns([a, a[:2]])
    with pytest.raises(ValueError):
        consensus([])
