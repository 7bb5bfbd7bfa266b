"""RouteBook, the registry's pure rules (pdkv.protocol.registry): no sockets, direct calls."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.errors import ConfigError
from pdkv.protocol.effects import NoticeLevel
from pdkv.protocol.ids import RoomId
from pdkv.protocol.messages import (
    Abort,
    RankAnnounce,
    RankCoord,
    RankRoute,
    RegisterReject,
    RouteTable,
)
from pdkv.protocol.registry import RouteBook
from tests.control.helpers import DECODE_ORIGIN, REGISTRY_ORIGIN, announce, route_query


def _route(message: RankAnnounce) -> RankRoute:
    return RankRoute(
        rank=message.origin.rank,
        epoch=message.origin.epoch,
        endpoint=message.endpoint,
        session=message.session,
    )


def _table(reply: object) -> RouteTable:
    assert isinstance(reply, RouteTable), reply
    return reply


def _reject(reply: object) -> RegisterReject:
    assert isinstance(reply, RegisterReject), reply
    return reply


def test_announcing_every_rank_completes_the_table() -> None:
    book = RouteBook(REGISTRY_ORIGIN)
    coords = [(0, 0), (1, 0), (0, 1), (1, 1)]
    replies = [book.announce(announce(tp, cp)) for tp, cp in coords]
    tables = [_table(r) for r in replies]
    assert [t.complete for t in tables] == [False, False, False, True]
    assert [len(t.ranks) for t in tables] == [1, 2, 3, 4]
    final = tables[-1]
    assert {r.rank: r for r in final.ranks} == {
        RankCoord(tp=tp, cp=cp): _route(announce(tp, cp)) for tp, cp in coords
    }
    assert (final.origin, final.tp_size, final.cp_size, final.page_size, final.layout_digest) == (
        REGISTRY_ORIGIN,
        2,
        2,
        16,
        "d1",
    )
    assert _table(book.query(route_query())) == final
    assert book.complete
    assert book.statistics().accepted == 4


def test_a_query_before_any_announcement_is_answered_with_a_reason() -> None:
    book = RouteBook(REGISTRY_ORIGIN)
    reply = _reject(book.query(route_query()))
    assert "has announced yet" in reply.reason
    assert reply.retry  # it passes by itself once a rank announces: ask again
    assert book.table() is None
    assert book.statistics().queries == 1


def test_a_book_given_its_shape_answers_queries_with_an_empty_table_at_once() -> None:
    book = RouteBook(REGISTRY_ORIGIN, tp_size=1, cp_size=2, page_size=16, layout_digest="d1")
    table = _table(book.query(route_query()))
    assert (table.ranks, table.complete, table.cp_size) == ((), False, 2)


def test_a_higher_epoch_replaces_and_a_lower_one_is_refused_as_stale() -> None:
    book = RouteBook(REGISTRY_ORIGIN)
    book.announce(announce(0, epoch=1))
    restarted = announce(0, epoch=2, port=30000)
    assert _table(book.announce(restarted)).ranks == (_route(restarted),)
    late = _reject(book.announce(announce(0, epoch=1)))
    assert "stale" in late.reason and "epoch 1" in late.reason and "epoch 2" in late.reason
    table = book.table()
    assert table is not None and table.ranks == (_route(restarted),)
    stats = book.statistics()
    assert (stats.accepted, stats.replaced, stats.stale) == (1, 1, 1)


def test_the_same_announcement_again_is_a_harmless_retry_but_a_conflict_is_refused() -> None:
    book = RouteBook(REGISTRY_ORIGIN)
    first = announce(1, 1)
    book.announce(first)
    assert _table(book.announce(first)).ranks == (_route(first),)
    conflict = _reject(book.announce(announce(1, 1, port=31000)))
    assert "already announced" in conflict.reason and "31000" in conflict.reason
    table = book.table()
    assert table is not None and table.ranks == (_route(first),)
    stats = book.statistics()
    assert (stats.accepted, stats.repeated, stats.rejected) == (1, 1, 1)


@pytest.mark.parametrize(
    ("odd", "words"),
    [
        (announce(1, page_size=32), ["page_size 32", "expected 16"]),
        (announce(1, digest="other"), ["layout_digest 'other'", "expected 'd1'"]),
        (announce(1, tp_size=4), ["tp_size 4", "expected 2"]),
        (announce(3, tp_size=4), ["tp_size 4"]),  # a rank outside the instance's tp size
        (announce(0, 2, cp_size=3), ["cp_size 3"]),  # ... or cp size
        (announce(1, instance="prefill-b"), ["instance 'prefill-b'", "serves 'prefill-a'"]),
    ],
)
def test_an_announcement_that_differs_from_the_first_is_refused_with_both_values(
    odd: RankAnnounce, words: list[str]
) -> None:
    book = RouteBook(REGISTRY_ORIGIN)
    book.announce(announce(0))
    reply = _reject(book.announce(odd))
    for word in words:
        assert word in reply.reason
    table = book.table()
    assert table is not None and table.ranks == (_route(announce(0)),)
    notices = book.take_notices()
    assert [n.level for n in notices] == [NoticeLevel.INFO, NoticeLevel.WARNING]
    assert reply.reason in notices[-1].text
    assert book.take_notices() == []


def test_a_configured_shape_refuses_even_the_first_announcement() -> None:
    book = RouteBook(REGISTRY_ORIGIN, page_size=64)
    reply = _reject(book.announce(announce(0)))
    assert "configured" in reply.reason and "page_size 16" in reply.reason
    assert not reply.retry  # fatal: retrying cannot help
    assert book.table() is None


def test_messages_other_than_announce_and_query_are_refused() -> None:
    book = RouteBook(REGISTRY_ORIGIN)
    reply = _reject(book.handle(Abort(origin=DECODE_ORIGIN, room=RoomId(1), reason="x")))
    assert "not Abort" in reply.reason
    assert isinstance(book.handle(announce(0)), RouteTable)
    assert isinstance(book.handle(route_query()), RouteTable)


@pytest.mark.parametrize(
    "kwargs", [{"tp_size": 0}, {"cp_size": True}, {"page_size": 2**21}, {"layout_digest": ""}]
)
def test_a_bad_configured_shape_is_a_config_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        RouteBook(REGISTRY_ORIGIN, **kwargs)  # type: ignore[arg-type]  # wrong values on purpose


# ---------------------------------------------------------------- property: the book against a model

_announcements = st.builds(
    lambda tp, cp, epoch, port, page: announce(tp, cp, epoch=epoch, port=port, page_size=page),
    tp=st.integers(0, 1),
    cp=st.integers(0, 1),
    epoch=st.integers(0, 3),
    port=st.sampled_from([40000, 40001]),
    page=st.sampled_from([16, 16, 16, 32]),
)


@settings(max_examples=300)
@given(sequence=st.lists(_announcements, max_size=20))
def test_any_sequence_of_announcements_follows_the_rules(sequence: list[RankAnnounce]) -> None:
    book = RouteBook(REGISTRY_ORIGIN)
    model: dict[RankCoord, RankAnnounce] = {}
    page_size: int | None = None
    for message in sequence:
        reply = book.announce(message)
        coord, epoch = message.origin.rank, message.origin.epoch
        known = model.get(coord)
        if page_size is not None and message.page_size != page_size:
            accepted = False
        elif known is None or epoch > known.origin.epoch:
            accepted = True
        else:
            accepted = epoch == known.origin.epoch and message == known
        if accepted:
            model[coord] = message
            page_size = message.page_size
        assert isinstance(reply, RouteTable) is accepted
        if isinstance(reply, RouteTable):
            assert reply.ranks == tuple(_route(model[c]) for c in sorted(model, key=lambda c: (c.cp, c.tp)))
            assert reply.complete is (len(model) == 4)
            assert reply.page_size == page_size
    assert book.complete is (len(model) == 4)
