"""Control-plane costs: codec encode+decode, state-machine triggers, full room lifecycles (sans-IO).

Prints one JSON line per figure on stdout and a table on stderr. Figures are the best of
``--repeat`` timing runs (shared, noisy machines: the best run is the least disturbed one).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence

import numpy as np

from pdkv.bench._report import emit, table
from pdkv.protocol import codec
from pdkv.protocol.decode import DecodeEndpoint
from pdkv.protocol.effects import ChunkSpec, Send, Target
from pdkv.protocol.ids import Endpoint, Epoch, InstanceId, RoomId, SessionId
from pdkv.protocol.machines import (
    PREFILL_ABORT,
    ChunkMachine,
    PrefillAbortInput,
    PrefillAbortMachine,
    PrefillAbortState,
)
from pdkv.protocol.messages import (
    Origin,
    Outcome,
    RankCoord,
    RankRoute,
    Register,
    RegisterAck,
    RouteTable,
    TransferMetricData,
    TransferRequest,
    TransferStatus,
)
from pdkv.protocol.prefill import PrefillEndpoint
from pdkv.testing.endpoint_pair import default_layout


def best_us(fn: Callable[[], object], *, number: int, repeat: int) -> float:
    """Best-of-``repeat`` mean microseconds per call of ``fn`` over ``number`` calls."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best * 1e6


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdkv bench protocol", description=__doc__)
    parser.add_argument("--pages", type=int, default=4096, help="pages in the TransferRequest (default 4096)")
    parser.add_argument("--number", type=int, default=2000, help="calls per timing run")
    parser.add_argument("--repeat", type=int, default=5, help="timing runs (best is reported)")
    parser.add_argument("--quick", action="store_true", help="tiny run for tests")
    args = parser.parse_args(list(argv))
    number, repeat = (50, 2) if args.quick else (args.number, args.repeat)

    decode_origin = Origin(instance=InstanceId("decode"), epoch=Epoch(1), rank=RankCoord(tp=0))
    prefill_origin = Origin(instance=InstanceId("prefill"), epoch=Epoch(1), rank=RankCoord(tp=0))
    pages = np.random.default_rng(0).permutation(args.pages * 4)[: args.pages]
    request = TransferRequest(origin=decode_origin, room=RoomId(1), dst_pages=pages, dst_aux_row=3)
    frames = codec.encode(request)
    rows: list[tuple[str, float, str]] = []

    codec_us = best_us(lambda: codec.decode(codec.encode(request)), number=number, repeat=repeat)
    rows.append(
        (
            "codec encode+decode, TransferRequest",
            codec_us,
            f"{args.pages} pages, {sum(map(len, frames))} bytes",
        )
    )

    # The two messages of every room, as its receiver decodes them: the decode's request for a
    # 1-page room (read by the prefill's control path) and the prefill's Success status back.
    small = TransferRequest(origin=decode_origin, room=RoomId(2), dst_pages=[7], dst_aux_row=3)
    status = TransferStatus(
        origin=prefill_origin,
        room=RoomId(2),
        outcome=Outcome.SUCCESS,
        metric=TransferMetricData(pages=1, bytes=73728, seconds=1e-4),
    )
    for what, message in (("1-page TransferRequest", small), ("Success TransferStatus", status)):
        encoded = codec.encode(message)
        us = best_us(functools.partial(codec.decode, encoded), number=number, repeat=repeat)
        rows.append((f"codec decode, {what}", us, f"{sum(map(len, encoded))} bytes, once per room"))

    construct_us = best_us(lambda: ChunkMachine("bench"), number=number, repeat=repeat)
    # DRAINING --fenced--> DRAINING is a row that keeps the state with no guard or effect: repeatable.
    looping = PrefillAbortMachine("bench")
    trigger_us = best_us(lambda: looping.fire(PrefillAbortInput.FENCED), number=number, repeat=repeat)
    key = (PrefillAbortState.DRAINING, PrefillAbortInput.FENCED)
    table_us = best_us(lambda: PREFILL_ABORT.table[key], number=number * 10, repeat=repeat)
    rows.append(("machine construction (transitions)", construct_us, "per room/chunk/abort object"))
    rows.append(
        (
            "trigger (table check + transitions)",
            trigger_us,
            f"{trigger_us / max(table_us, 1e-9):.0f}x a bare table lookup",
        )
    )

    layout = default_layout(layers=61, pages=65536)
    prefill = PrefillEndpoint(origin=prefill_origin, layout=layout)
    register = Register(
        origin=decode_origin,
        tp_size=1,
        endpoint=Endpoint("inproc://d"),
        session=SessionId("d"),
        layout=layout,
    )
    prefill.receive(register, 0.0)
    decode = DecodeEndpoint(
        origin=decode_origin,
        tp_size=1,
        endpoint=Endpoint("inproc://d"),
        session=SessionId("d"),
        layout=layout,
    )
    route = RouteTable(
        origin=prefill_origin,
        tp_size=1,
        cp_size=1,
        page_size=layout.page_size,
        layout_digest=layout.digest(),
        ranks=[
            RankRoute(
                rank=prefill_origin.rank,
                epoch=Epoch(1),
                endpoint=Endpoint("inproc://p"),
                session=SessionId("p"),
            )
        ],
        complete=True,
    )
    decode.connect(route, 0.0)
    decode.receive(RegisterAck(origin=prefill_origin), 0.0)
    target = Target(instance=prefill_origin.instance, rank=prefill_origin.rank)
    n_pages = 64
    dst = np.arange(n_pages, dtype=np.int64)
    spec = ChunkSpec(pages=dst, start_token=0, last=True)
    counter = iter(range(1, 10**9))

    def prefill_room() -> None:
        room = RoomId(next(counter))
        prefill.open_room(room, num_pages=n_pages, aux_row=0, now=0.0)
        prefill.receive(TransferRequest(origin=decode_origin, room=room, dst_pages=dst, dst_aux_row=1), 0.0)
        prefill.queue_chunk(room, spec, 0.0)
        prefill.start_chunk(room, 0, 0.0)
        prefill.chunk_done(room, 0, TransferMetricData(pages=n_pages, bytes=1, seconds=0.0), 0.0)
        prefill.close_room(room, 0.0)

    def decode_room() -> None:
        room = RoomId(next(counter))
        effects = decode.open_room(room, targets=[target], dst_pages=dst, dst_aux_row=1, now=0.0)
        assert isinstance(effects[0], Send)
        decode.receive(TransferStatus(origin=prefill_origin, room=room, outcome=Outcome.SUCCESS), 0.0)
        decode.close_room(room, 0.0)

    lifecycle_number = max(10, number // 10)
    prefill_us = best_us(prefill_room, number=lifecycle_number, repeat=repeat)
    decode_us = best_us(decode_room, number=lifecycle_number, repeat=repeat)
    rows.append(("room lifecycle, prefill side", prefill_us, f"{n_pages}-page room, 1 chunk, sans-IO"))
    rows.append(("room lifecycle, decode side", decode_us, f"{n_pages}-page room, sans-IO"))

    for name, us, note in rows:
        emit({"bench": "protocol", "figure": name, "microseconds": round(us, 3), "note": note})
    table(f"pdkv bench protocol (best of {repeat} runs)", ["figure", "us", "note"], rows)
    return 0
