"""``Tombstones``: entries refused until they expire, replaced with their expiry, dropped when due."""

from __future__ import annotations

from pdkv.protocol._deadlines import Tombstones


def test_entries_expire_at_their_latest_expiry_and_only_then() -> None:
    book: Tombstones[int, str] = Tombstones()
    book.put(1, "aborted", 10.0)
    book.put(2, "cleared", 5.0)
    book.put(1, "cleared again", 20.0)  # replaced: the later expiry and value count
    assert book.next_expiry() == 5.0
    assert book.expire(9.0) == [2] and 2 not in book
    assert book.get(1) == "cleared again" and len(book) == 1
    assert book.next_expiry() == 20.0  # the stale 10.0 entry of room 1 does not fire
    assert book.expire(19.9) == [] and 1 in book
    assert book.expire(20.0) == [1] and book.get(1) is None and book.next_expiry() is None
