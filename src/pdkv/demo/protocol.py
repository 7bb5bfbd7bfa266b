"""``pdkv demo --protocol-only``: the protocol end to end, in memory (sans-IO endpoints, faulty link).

Owns: the in-memory scenario and its report. It drives the real protocol endpoints through
``pdkv.testing.EndpointPair`` on a fake clock (no sockets, no engine): a CP group of prefill ranks
and a decode rank handle a few rooms — chunked, aborted by either side, an engine failure, and one
whose TransferRequest is lost on the wire and is recovered by the waiting deadline — and the demo
prints each room's state history on both sides, then checks the safety promise (no write can land
after decode released a room's pages). Exit status is non-zero if any room ends otherwise than
planned or any safety check fails. Seconds to run; no engine or sockets needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import attrs

from pdkv.config import cli_int
from pdkv.protocol.config import Timeouts
from pdkv.protocol.ids import RoomId
from pdkv.protocol.messages import TransferRequest
from pdkv.protocol.poll import KVPoll
from pdkv.testing.endpoint_pair import EndpointPair, LinkFaults, RoomPlan


@attrs.frozen(kw_only=True)
class _Case:
    plan: RoomPlan
    story: str
    expect: KVPoll


def _cases() -> list[_Case]:
    return [
        _Case(
            plan=RoomPlan(room=RoomId(101), num_pages=12, chunk_pages=(4, 4, 4)),
            story="3 chunks",
            expect=KVPoll.Success,
        ),
        _Case(
            plan=RoomPlan(room=RoomId(102), num_pages=5, chunk_pages=(5,)),
            story="1 chunk",
            expect=KVPoll.Success,
        ),
        _Case(
            plan=RoomPlan(room=RoomId(103), num_pages=16, chunk_pages=(4, 4, 4, 4), abort_decode_at=0.0045),
            story="decode aborts mid-transfer",
            expect=KVPoll.Failed,
        ),
        _Case(
            plan=RoomPlan(room=RoomId(104), num_pages=8, chunk_pages=(4, 4), abort_prefill_at=0.004),
            story="prefill aborts mid-transfer",
            expect=KVPoll.Failed,
        ),
        _Case(
            plan=RoomPlan(room=RoomId(105), num_pages=8, chunk_pages=(4, 4)),
            story="engine fails chunk 1",
            expect=KVPoll.Failed,
        ),
        _Case(
            plan=RoomPlan(room=RoomId(106), num_pages=6, chunk_pages=(6,)),
            story="TransferRequest lost; waiting deadline",
            expect=KVPoll.Failed,
        ),
    ]


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(
        prog="pdkv demo --protocol-only", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--cp", type=cli_int(1), default=2, help="prefill CP ranks (default 2)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="one JSON object per room on stdout")
    args = parser.parse_args(list(argv))

    cases = _cases()
    lost_room = RoomId(106)
    pair = EndpointPair(
        cp_size=args.cp,
        seed=args.seed,
        faults=LinkFaults(max_delay=0.0005),
        timeouts=Timeouts(bootstrap=5.0, waiting=3.0, inflight=5.0, transfer=3.0, abort_ack=2.0),
        transfer_time=0.002,
        fail_write=lambda room, chunk, _rank: room == 105 and chunk == 1,
    )
    pair.link.drop_if = lambda _to, m: isinstance(m, TransferRequest) and m.room == lost_room
    pair.connect()
    for case in cases:
        pair.add_room(case.plan)
    pair.settle()

    rows = [_report(pair, case) for case in cases]
    failures = sum(not row.ok for row in rows)

    if args.json:
        for row in rows:
            print(json.dumps(attrs.asdict(row)))
    else:
        _print_report(rows, pair, args.cp)
    ok = failures == 0 and not pair.violations
    print(
        f"{'OK' if ok else 'FAILED'}: {len(rows) - failures}/{len(rows)} rooms as planned, "
        f"{len(pair.violations)} safety violations, fake time {pair.clock.now:.3f} s",
        file=sys.stderr,
    )
    return 0 if ok else 1


@attrs.frozen(kw_only=True)
class RoomReport:
    room: int
    story: str
    decode: list[str]
    prefill: list[list[str]]
    abort: str | None
    release: str
    reason: str
    ok: bool


def _report(pair: EndpointPair, case: _Case) -> RoomReport:
    room = case.plan.room
    abort = pair.decode.abort_state(room)
    release = pair.releases.get(room)
    return RoomReport(
        room=room,
        story=case.story,
        decode=[s.name for s in pair.decode.room_history(room)],
        prefill=[[s.name for s in p.room_history(room)] for p in pair.prefills if room in p.rooms()],
        abort=None if abort is None else abort.name,
        release="n/a" if release is None else ("safe" if release.safe else "UNSAFE"),
        reason=pair.decode.failure(room) or "",
        ok=pair.decode.poll(room) is case.expect and pair.decode.release_ready(room),
    )


def _print_report(rows: list[RoomReport], pair: EndpointPair, cp: int) -> None:
    out = sys.stdout
    print(
        f"pdkv demo (sans-IO): {cp} prefill CP ranks, 1 decode rank, in-memory link through the codec\n",
        file=out,
    )
    for row in rows:
        print(f"room {row.room}: {row.story}  [{'ok' if row.ok else 'UNEXPECTED'}]", file=out)
        print(f"  decode     : {' -> '.join(row.decode)}", file=out)
        for i, hist in enumerate(row.prefill):
            print(f"  prefill cp{i}: {' -> '.join(hist)}", file=out)
        if row.abort is not None:
            print(f"  abort      : {row.abort}, pages released {row.release}", file=out)
        if row.reason:
            print(f"  reason     : {row.reason}", file=out)
    link = pair.link.statistics()
    stats = pair.decode.statistics()
    print(
        f"\nlink: {link.posted} messages posted, {link.dropped} dropped, {link.delivered} delivered; "
        f"decode: {stats.rooms_succeeded} succeeded, {stats.rooms_failed} failed, "
        f"{stats.aborts_sent} aborts sent, {stats.unsafe_releases} unsafe releases",
        file=out,
    )
