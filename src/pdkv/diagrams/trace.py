"""``pdkv trace ROOM LOGS...``: one room of a real run as a sequence diagram, from the JSON logs.

Owns: reading the transports' JSON log lines (``pdkv.runtime.json_log``; any other line is
skipped and counted) and drawing the records of one room as a Mermaid ``sequenceDiagram``: one
lane per rank, a message arrow at the time it was received (sender to receiver, with its time of
flight), a lost arrow for one sent and never received, notes for state changes, chunk submissions,
page releases and the room's warnings. Times are milliseconds since the room's first record.
Must not need anything but the log files (no running transport). ``--dot`` / ``--image`` give
the same steps as Graphviz DOT, or drawn by ``dot`` when it is installed.

Clocks: each record carries its process's wall clock; ranks on one host share it. For ranks on
several hosts the times (and a message received "before" it was sent) are as good as their clock
sync: the diagram keeps each message's receive time, and orders by it.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

from pdkv.diagrams._chart import Chart, Step, StepKind
from pdkv.errors import TraceLogError


@attrs.frozen(kw_only=True)
class Record:
    """One JSON log line of a transport, with the fields ``pdkv trace`` uses."""

    t: float
    proc: str
    event: str
    room: int | None
    rank: str
    epoch: int | None
    addr: str | None
    peer: str | None
    peer_addr: str | None
    msg: str | None
    state: str | None
    detail: str | None
    text: str
    level: str


@attrs.frozen(kw_only=True)
class Logs:
    records: tuple[Record, ...]
    skipped: int
    """Lines that were not JSON records (text logs, engine output)."""


def read_logs(paths: Iterable[str | Path]) -> Logs:
    """Every JSON record of the files (a folder: its ``*.jsonl`` files), in time order."""
    records: list[Record] = []
    skipped = 0
    for path in _files(paths):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                record = _parse(line)
                if record is None:
                    skipped += 1
                else:
                    records.append(record)
    if not records:
        names = ", ".join(str(p) for p in _files(paths)) or ", ".join(map(str, paths))
        what = f"{skipped} line(s), none a JSON log record" if skipped else "no lines"
        raise TraceLogError(
            f"no pdkv JSON log record in {names} ({what}): write them with PDKV_LOG_JSON=<folder or file>"
        )
    records.sort(key=lambda r: r.t)
    return Logs(records=tuple(records), skipped=skipped)


def _files(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            out += sorted(path.glob("*.jsonl"))
        elif path.exists():
            out.append(path)
        else:
            raise TraceLogError(f"no such log file or folder: {path}")
    return out


def _parse(line: str) -> Record | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        raw = json.loads(line)
    except ValueError:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("t"), int | float):
        return None

    def text(key: str) -> str | None:
        value = raw.get(key)
        return None if value is None else str(value)

    room = raw.get("room")
    epoch = raw.get("epoch")
    return Record(
        t=float(raw["t"]),
        proc=str(raw.get("proc") or "?"),
        event=str(raw.get("event") or "log"),
        room=room if isinstance(room, int) else _room_in_text(str(raw.get("text", ""))),
        rank=str(raw.get("rank") or raw.get("proc") or "?"),
        epoch=epoch if isinstance(epoch, int) else None,
        addr=text("addr"),
        peer=text("peer"),
        peer_addr=text("peer_addr"),
        msg=text("msg"),
        state=text("state"),
        detail=text("detail"),
        text=str(raw.get("text", "")),
        level=str(raw.get("level", "")),
    )


_ROOM_IN_TEXT = re.compile(r"\broom (\d+)\b")


def _room_in_text(text: str) -> int | None:
    """A plain log line of the runtime about one room says ``room N``."""
    match = _ROOM_IN_TEXT.search(text)
    return int(match.group(1)) if match else None


def rooms(logs: Logs) -> list[int]:
    """The rooms the logs mention, in order of first appearance."""
    seen: dict[int, None] = {}
    for r in logs.records:
        if r.room is not None:
            seen.setdefault(r.room, None)
    return list(seen)


def render(room: int, logs: Logs) -> str:
    """The Mermaid ``sequenceDiagram`` of ``room``; ``TraceLogError`` if no record names it."""
    return chart(room, logs).mermaid()


def chart(room: int, logs: Logs) -> Chart:
    """The steps of ``room`` across its ranks; ``TraceLogError`` if no record names it."""
    ranks_of_proc: dict[str, set[str]] = defaultdict(set)
    for r in logs.records:
        if r.event != "log":
            ranks_of_proc[r.proc].add(r.rank)
    # A plain log line names its process; a process with one rank is that rank's lane.
    # The host also logs each notice as a plain line: keep the traced one, which names its rank.
    noticed = {(r.proc, r.text) for r in logs.records if r.event == "notice"}
    mine = [
        _as_rank(r, ranks_of_proc)
        for r in logs.records
        if r.room == room and not (r.event == "log" and (r.proc, r.text) in noticed)
    ]
    if not mine:
        raise TraceLogError(
            f"no record of room {room} in the logs ({len(logs.records)} records read)", room=room
        )
    start = mine[0].t
    by_addr = {r.addr: r.rank for r in logs.records if r.addr is not None}
    ranks = {r.rank for r in mine} | {r.peer for r in mine if r.peer is not None}
    ranks |= {by_addr.get(r.peer_addr, r.peer_addr) for r in mine if r.peer_addr is not None}
    lanes = {rank: f"R{i}" for i, rank in enumerate(sorted(ranks, key=_lane_order))}
    # Match each receive with the first unmatched send of that message from that rank to that one.
    sends: dict[tuple[str, str, str | None], deque[Record]] = defaultdict(deque)
    for r in mine:
        if r.event == "send" and r.peer_addr is not None:
            sends[(r.rank, by_addr.get(r.peer_addr, r.peer_addr), r.msg)].append(r)
    timed: list[tuple[float, Step]] = []

    def note(t: float, lane: str, text: str) -> None:
        timed.append((t, Step(kind=StepKind.NOTE, lane=lane, time=_ms(t - start), lines=(text,))))

    for r in mine:
        if r.event == "recv" and r.peer is not None:
            queue = sends.get((r.peer, r.rank, r.msg))
            sent = queue.popleft() if queue else None
            flight = "" if sent is None else f" (sent {_ms(sent.t - start)})"
            step = Step(
                kind=StepKind.MESSAGE,
                lane=lanes[r.peer],
                to=lanes[r.rank],
                time=_ms(r.t - start),
                lines=(f"{r.msg or '?'}{flight}",),
            )
            timed.append((r.t, step))
        elif r.event == "state" and r.state:
            note(r.t, lanes[r.rank], r.state)
        elif r.event == "finished" and r.state == "Failed":
            note(r.t, lanes[r.rank], f"cause {r.detail or '?'}")
        elif r.event == "write":
            note(r.t, lanes[r.rank], f"submit {r.detail or ''}")
        elif r.event == "release":
            note(r.t, lanes[r.rank], f"pages released ({r.detail})")
        elif r.event in ("log", "notice") and r.level in ("WARNING", "ERROR", "CRITICAL"):
            note(r.t, lanes.setdefault(r.rank, f"R{len(lanes)}"), f"{r.level}: {_clip(r.text)}")
    # Sent and never received (lost, or the receiver's log is missing): drawn at their send time.
    for (sender, receiver, msg), queue in sends.items():
        for r in queue:
            step = Step(
                kind=StepKind.LOST,
                lane=lanes[sender],
                to=lanes[receiver],
                time=_ms(r.t - start),
                lines=(f"{msg or '?'} (no receive logged)",),
            )
            timed.append((r.t, step))
    timed.sort(key=lambda item: item[0])
    steps: list[Step] = []
    for i, (t, step) in enumerate(timed):
        previous = steps[-1] if steps else None
        # One note for what a lane did at once (within _MERGE_S) while nothing else happened.
        if (
            previous is not None
            and step.kind is StepKind.NOTE
            and previous.kind is StepKind.NOTE
            and previous.lane == step.lane
            and t - timed[i - 1][0] <= _MERGE_S
        ):
            steps[-1] = attrs.evolve(previous, lines=previous.lines + step.lines)
        else:
            steps.append(step)
    return Chart(
        title=f"room {room}",
        lanes=tuple((lane, rank) for rank, lane in lanes.items()),
        steps=tuple(steps),
    )


_MERGE_S = 0.001


def _as_rank(record: Record, ranks_of_proc: dict[str, set[str]]) -> Record:
    ranks = ranks_of_proc.get(record.proc, set())
    if record.event == "log" and len(ranks) == 1:
        return attrs.evolve(record, rank=next(iter(ranks)))
    return record


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _lane_order(rank: str) -> tuple[int, str]:
    return (0 if "decode" in rank else 1, rank)


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def main(
    room: int | None,
    paths: Sequence[str],
    *,
    dot: bool = False,
    image: str | None = None,
    out: str | None = None,
) -> int:
    """``pdkv trace``: the room's diagram (Mermaid, DOT, or drawn by Graphviz) on stdout or in
    ``out``; with no room, list the rooms the logs mention."""
    from pdkv.diagrams import draw

    try:
        logs = read_logs(paths)
        if room is None:
            print("\n".join(str(r) for r in rooms(logs)))
            return 0
        drawing = chart(room, logs)
    except TraceLogError as exc:
        print(f"pdkv trace: {exc}", file=sys.stderr)
        return 1
    text = drawing.dot() if dot or image is not None else drawing.mermaid()
    if image is not None:
        picture = draw(text, image)
        if picture is None:
            print(f"pdkv trace: --image {image} needs Graphviz's `dot` (Debian: graphviz)", file=sys.stderr)
            return 1
        if out is None:
            sys.stdout.buffer.write(picture)
        else:
            Path(out).write_bytes(picture)
        return 0
    if out is None:
        print(text, end="")
    else:
        Path(out).write_text(text)
    return 0
