"""The bootstrap registry's rules, sans-IO: which prefill ranks an instance has and how to reach them.

Owns: ``RouteBook`` (one prefill instance's route table, built from ``RankAnnounce`` messages and
read with ``RouteQuery``) and its statistics. Must not do I/O, start threads or read a clock: the
socket service lives in ``pdkv.control.bootstrap`` and calls ``RouteBook.handle``; what an operator
should read comes out as ``Notice`` records (``take_notices``) for the driver to log.

Rules (every one that decides an answer is in this module):

- A book serves one prefill instance: an announcement from another instance is rejected.
- The instance's shape (``tp_size``, ``cp_size``, ``page_size``, ``layout_digest``) is fixed by the
  constructor where given, and otherwise by the first announcement accepted; an announcement that
  differs in any of them is rejected with both values. The shape never changes for the life of the
  book: an instance restarted with another shape needs a new registry.
- Per rank coordinate, the highest epoch wins: a higher epoch replaces the entry (the rank
  restarted), a lower one is rejected as stale (a late message of a previous life), and the same
  epoch is accepted again only with identical contents (a retried announcement); the same epoch
  with another endpoint or session is a conflict and is rejected.
- Every accepted announcement is answered with the current ``RouteTable`` (the acknowledgement);
  ``complete`` is True once all ``tp_size * cp_size`` ranks are listed. A query is answered with the
  same table.
- Refusals are answered with ``RegisterReject`` carrying the reason (the protocol has no dedicated
  registry refusal message; the announcing rank should treat it as fatal). A query that comes
  before the shape is known (nothing announced, no shape given) is also answered with a
  ``RegisterReject``: the decode side keeps asking until its own deadline.
"""

from __future__ import annotations

from collections import deque
from typing import Final

import attrs

from pdkv.errors import ConfigError
from pdkv.protocol.effects import Notice, NoticeLevel
from pdkv.protocol.messages import (
    MAX_RANKS,
    Message,
    Origin,
    RankAnnounce,
    RankCoord,
    RankRoute,
    RegisterReject,
    RouteQuery,
    RouteTable,
)

MAX_PENDING_NOTICES: Final = 1024


@attrs.frozen(kw_only=True)
class RouteBookStatistics:
    """Counters of one book since it was created."""

    accepted: int
    """Announcements that added a rank."""
    replaced: int
    """Announcements that replaced a rank's entry with a higher epoch."""
    repeated: int
    """Identical announcements of an entry already held (retries)."""
    rejected: int
    """Announcements refused for instance, shape or same-epoch conflict."""
    stale: int
    """Announcements refused because the rank already announced a higher epoch."""
    queries: int
    """Route queries answered (with a table or a refusal)."""


@attrs.frozen(kw_only=True)
class _Shape:
    tp_size: int
    cp_size: int
    page_size: int
    layout_digest: str

    @classmethod
    def of(cls, message: RankAnnounce) -> _Shape:
        return cls(
            tp_size=message.tp_size,
            cp_size=message.cp_size,
            page_size=message.page_size,
            layout_digest=message.layout_digest,
        )


def _check_size(name: str, value: int | None, upper: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= upper:
        raise ConfigError(f"{name} must be None or an int in [1, {upper}], got {value!r}")


class RouteBook:
    """Route table of one prefill instance, fed by ``announce`` and read by ``query`` (see module rules)."""

    def __init__(
        self,
        origin: Origin,
        *,
        tp_size: int | None = None,
        cp_size: int | None = None,
        page_size: int | None = None,
        layout_digest: str | None = None,
    ) -> None:
        """``origin`` names the registry: its instance is the prefill instance whose ranks announce.

        Shape values given here are checked against every announcement; the others are taken from
        the first one accepted.
        """
        _check_size("tp_size", tp_size, MAX_RANKS)
        _check_size("cp_size", cp_size, MAX_RANKS)
        _check_size("page_size", page_size, 2**20)
        digest_ok = layout_digest is None or (isinstance(layout_digest, str) and 0 < len(layout_digest) <= 64)
        if not digest_ok:
            raise ConfigError(f"layout_digest must be None or 1..64 characters, got {layout_digest!r}")
        self.origin = origin
        given = dict(tp_size=tp_size, cp_size=cp_size, page_size=page_size, layout_digest=layout_digest)
        self._expected: dict[str, int | str] = {k: v for k, v in given.items() if v is not None}
        self._shape: _Shape | None = None
        if tp_size and cp_size and page_size and layout_digest:  # all given: the shape is known up front
            self._shape = _Shape(
                tp_size=tp_size, cp_size=cp_size, page_size=page_size, layout_digest=layout_digest
            )
        self._entries: dict[RankCoord, RankAnnounce] = {}
        # Bounded: a driver that never takes the notices must not grow the book forever.
        self._notices: deque[Notice] = deque(maxlen=MAX_PENDING_NOTICES)
        self._accepted = 0
        self._replaced = 0
        self._repeated = 0
        self._rejected = 0
        self._stale = 0
        self._queries = 0

    # ------------------------------------------------------------------ inputs

    def handle(self, message: Message) -> Message | None:
        """The reply to any message a registry receives (the service's handler)."""
        if isinstance(message, RankAnnounce):
            return self.announce(message)
        if isinstance(message, RouteQuery):
            return self.query(message)
        reason = f"a registry answers RankAnnounce and RouteQuery, not {type(message).__name__}"
        self._notice(NoticeLevel.WARNING, f"refused {type(message).__name__} from {message.origin}: {reason}")
        return RegisterReject(origin=self.origin, reason=reason)

    def announce(self, message: RankAnnounce) -> RouteTable | RegisterReject:
        """Record a prefill rank; the current table when accepted, the reason when refused."""
        who = f"{message.origin} at {message.endpoint}"
        if message.origin.instance != self.origin.instance:
            return self._reject(
                who,
                f"announces instance {message.origin.instance!r}, "
                f"this registry serves {self.origin.instance!r}",
            )
        difference = self._shape_difference(message)
        if difference is not None:
            return self._reject(who, difference)
        coord = message.origin.rank
        known = self._entries.get(coord)
        if known is not None and message.origin.epoch < known.origin.epoch:
            self._stale += 1
            reason = (
                f"stale announcement: rank {coord} epoch {message.origin.epoch}, "
                f"the registry holds epoch {known.origin.epoch}"
            )
            self._notice(NoticeLevel.WARNING, f"refused {who}: {reason}")
            return RegisterReject(origin=self.origin, reason=reason)
        if known is not None and message.origin.epoch == known.origin.epoch:
            if message != known:
                return self._reject(
                    who,
                    f"rank {coord} epoch {message.origin.epoch} already announced as "
                    f"{known.endpoint} / {known.session}, now as {message.endpoint} / {message.session}",
                )
            self._repeated += 1
            return self._table_of(self._pin(message))
        shape = self._pin(message)
        self._entries[coord] = message
        if known is None:
            self._accepted += 1
            count = f"{len(self._entries)}/{self._rank_count(shape)}"
            self._notice(NoticeLevel.INFO, f"rank {who} joined ({count} ranks)")
        else:
            self._replaced += 1
            self._notice(
                NoticeLevel.INFO,
                f"rank {coord} restarted: epoch {known.origin.epoch} -> {message.origin.epoch}, "
                f"now at {message.endpoint}",
            )
        return self._table_of(shape)

    def query(self, message: RouteQuery) -> RouteTable | RegisterReject:
        """The current table, or a refusal while the instance's shape is still unknown."""
        self._queries += 1
        if self._shape is None:
            # No notice: decode ranks poll until their deadline, and the counter tells how often.
            reason = f"no prefill rank of instance {self.origin.instance!r} has announced yet"
            return RegisterReject(origin=self.origin, reason=reason, retry=True)
        return self._table_of(self._shape)

    # ------------------------------------------------------------------ reading

    def table(self) -> RouteTable | None:
        """The current table (None while the shape is unknown)."""
        return None if self._shape is None else self._table_of(self._shape)

    @property
    def complete(self) -> bool:
        return self._shape is not None and len(self._entries) == self._rank_count(self._shape)

    def take_notices(self) -> list[Notice]:
        """Log lines accumulated since the last call, oldest first (the driver logs them at their level).

        At most ``MAX_PENDING_NOTICES`` are kept between calls; older ones are dropped.
        """
        notices = list(self._notices)
        self._notices.clear()
        return notices

    def statistics(self) -> RouteBookStatistics:
        return RouteBookStatistics(
            accepted=self._accepted,
            replaced=self._replaced,
            repeated=self._repeated,
            rejected=self._rejected,
            stale=self._stale,
            queries=self._queries,
        )

    # ------------------------------------------------------------------ internals

    def _shape_difference(self, message: RankAnnounce) -> str | None:
        offered = _Shape.of(message)
        if self._shape is not None:
            reference = attrs.asdict(self._shape)
            source = "the instance's"
        else:
            reference = self._expected
            source = "the configured"
        differences = [
            f"{name} {getattr(offered, name)!r} (expected {value!r})"
            for name, value in reference.items()
            if getattr(offered, name) != value
        ]
        if not differences:
            return None
        return f"differs from {source} shape: " + ", ".join(differences)

    def _pin(self, message: RankAnnounce) -> _Shape:
        if self._shape is None:
            self._shape = _Shape.of(message)
        return self._shape

    def _table_of(self, shape: _Shape) -> RouteTable:
        ranks = [
            RankRoute(rank=coord, epoch=entry.origin.epoch, endpoint=entry.endpoint, session=entry.session)
            for coord, entry in sorted(self._entries.items(), key=lambda item: (item[0].cp, item[0].tp))
        ]
        return RouteTable(
            origin=self.origin,
            tp_size=shape.tp_size,
            cp_size=shape.cp_size,
            page_size=shape.page_size,
            layout_digest=shape.layout_digest,
            ranks=ranks,
            complete=len(ranks) == self._rank_count(shape),
        )

    @staticmethod
    def _rank_count(shape: _Shape) -> int:
        return shape.tp_size * shape.cp_size

    def _reject(self, who: str, reason: str) -> RegisterReject:
        self._rejected += 1
        self._notice(NoticeLevel.WARNING, f"refused {who}: {reason}")
        return RegisterReject(origin=self.origin, reason=reason)

    def _notice(self, level: NoticeLevel, text: str) -> None:
        self._notices.append(Notice(level=level, text=text))
