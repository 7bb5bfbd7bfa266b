"""Control channels alone: round trip, CPU and messages/s of the stream and zmq channels across processes.

What a status or a request costs on the wire, without the transports around it. The bench (owner of
one channel of each kind) and an echo process (a spawned interpreter, the same two kinds, one owner
thread each) exchange real pdkv messages over TCP on 127.0.0.1: ``--messages`` ping-pongs (a Heartbeat
out, its HeartbeatAck back: the round trip, twice a message's one-way path), then a burst of as many
Heartbeats sent at once and answered one by one (messages/s both ways). Each round runs both kinds,
their order turning each round; the figures are medians over the rounds' samples and the ratios are
zmq's figure over the stream channel's in the same run. CPU is this process's (``time.process_time``)
per round trip: the sending and receiving side of one message each way.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from pdkv.bench._report import emit, table
from pdkv.config import cli_int
from pdkv.control import ControlChannel, StreamChannel
from pdkv.protocol.ids import Epoch, InstanceId
from pdkv.protocol.messages import Heartbeat, HeartbeatAck, Message, Origin, RankCoord
from pdkv.runtime.channels import CHANNEL_KINDS, CODEC

Channel = ControlChannel[Message] | StreamChannel[Message]
_ORIGIN = Origin(instance=InstanceId("bench-channel"), epoch=Epoch(1), rank=RankCoord(tp=0))


def _channel(kind: str) -> Channel:
    return ControlChannel(CODEC) if kind == "zmq" else StreamChannel(CODEC)


def _echo(channel: Channel, reply_to: str, stop: threading.Event) -> None:
    while not stop.is_set():
        for message in channel.wait(0.2):
            if isinstance(message, Heartbeat):
                channel.send(reply_to, HeartbeatAck(origin=_ORIGIN, seq=message.seq))


def echo_process(reply_to: dict[str, str], conn: Connection) -> None:
    """The far end: a channel of each kind, each answering every Heartbeat from its own thread."""
    stop = threading.Event()
    channels = {kind: _channel(kind) for kind in CHANNEL_KINDS}
    threads = [
        threading.Thread(target=_echo, args=(channels[kind], reply_to[kind], stop), daemon=True)
        for kind in CHANNEL_KINDS
    ]
    for thread in threads:
        thread.start()
    conn.send({kind: channel.address for kind, channel in channels.items()})
    conn.recv()  # "stop"
    stop.set()
    for thread in threads:
        thread.join(5.0)
    for channel in channels.values():
        channel.close()


def _acks(channel: Channel, count: int, timeout_s: float) -> int:
    got = 0
    deadline = time.monotonic() + timeout_s
    while got < count and time.monotonic() < deadline:
        got += sum(isinstance(m, HeartbeatAck) for m in channel.wait(deadline - time.monotonic()))
    return got


def _round(channel: Channel, to: str, messages: int) -> dict[str, Any]:
    rtts: list[float] = []
    cpu = time.process_time()
    for seq in range(messages):
        started = time.perf_counter()
        channel.send(to, Heartbeat(origin=_ORIGIN, seq=seq))
        if _acks(channel, 1, 10.0) != 1:
            raise RuntimeError(f"no answer to heartbeat {seq} through {channel!r}")
        rtts.append(time.perf_counter() - started)
    cpu_per_trip = (time.process_time() - cpu) / messages
    started = time.perf_counter()
    for seq in range(messages):
        channel.send(to, Heartbeat(origin=_ORIGIN, seq=seq))
    answered = _acks(channel, messages, 30.0)
    burst_s = time.perf_counter() - started
    return {
        "rtts": rtts,
        "cpu_per_trip": cpu_per_trip,
        "burst_per_s": answered / burst_s,
        "lost": messages - answered,
    }


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdkv bench channel", description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--messages", type=cli_int(1), default=2000, help="ping-pongs (and burst size) per round"
    )
    parser.add_argument("--rounds", type=cli_int(1), default=3)
    parser.add_argument("--quick", action="store_true", help="tiny run for tests")
    args = parser.parse_args(argv)
    messages, rounds = (50, 2) if args.quick else (args.messages, args.rounds)
    mine = {kind: _channel(kind) for kind in CHANNEL_KINDS}
    context = mp.get_context("spawn")
    conn, child_conn = context.Pipe()
    child = context.Process(
        target=echo_process, args=({k: c.address for k, c in mine.items()}, child_conn), daemon=True
    )
    child.start()
    samples: dict[str, list[dict[str, Any]]] = {kind: [] for kind in CHANNEL_KINDS}
    try:
        if not conn.poll(60.0):
            raise RuntimeError("the echo process did not start")
        theirs: dict[str, str] = conn.recv()
        for kind in CHANNEL_KINDS:  # connections up before anything is timed
            _round(mine[kind], theirs[kind], 5)
        for n in range(rounds):
            order = CHANNEL_KINDS if n % 2 == 0 else tuple(reversed(CHANNEL_KINDS))
            for kind in order:
                samples[kind].append(_round(mine[kind], theirs[kind], messages))
    finally:
        conn.send("stop")
        child.join(10.0)
        if child.is_alive():
            child.kill()
            child.join(5.0)
        for channel in mine.values():
            channel.close()
    figures: dict[str, dict[str, float]] = {}
    for kind, runs in samples.items():
        rtts = sorted(t for run in runs for t in run["rtts"])
        figures[kind] = {
            "rtt_p50_us": statistics.median(rtts) * 1e6,
            "rtt_p99_us": rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))] * 1e6,
            "cpu_per_trip_us": statistics.median(r["cpu_per_trip"] for r in runs) * 1e6,
            "burst_per_s": statistics.median(r["burst_per_s"] for r in runs),
            "lost": sum(r["lost"] for r in runs),
        }
        emit(
            {
                "bench": "channel",
                "kind": "channel",
                "channel": kind,
                "messages": messages,
                "rounds": rounds,
                **figures[kind],
            }
        )
    zmq, stream = figures["zmq"], figures["stream"]
    ratios = {
        "rtt_p50_zmq_over_stream": zmq["rtt_p50_us"] / stream["rtt_p50_us"],
        "cpu_zmq_over_stream": zmq["cpu_per_trip_us"] / stream["cpu_per_trip_us"],
        "burst_stream_over_zmq": stream["burst_per_s"] / zmq["burst_per_s"],
    }
    emit({"bench": "channel", "kind": "summary", **ratios})
    table(
        f"pdkv bench channel: Heartbeat -> HeartbeatAck between two processes over TCP on 127.0.0.1, "
        f"{messages} per round, {rounds} rounds (this process's CPU per round trip; burst: {messages} "
        f"sent at once, each answered)",
        ["channel", "rtt p50 µs", "rtt p99 µs", "CPU/trip µs", "burst msg/s", "lost"],
        [
            [k, f["rtt_p50_us"], f["rtt_p99_us"], f["cpu_per_trip_us"], f["burst_per_s"], f["lost"]]
            for k, f in figures.items()
        ],
    )
    table(
        "ratios (same run)",
        ["round trip zmq/stream", "CPU zmq/stream", "burst stream/zmq"],
        [[ratios["rtt_p50_zmq_over_stream"], ratios["cpu_zmq_over_stream"], ratios["burst_stream_over_zmq"]]],
    )
    return 0 if all(f["lost"] == 0 for f in figures.values()) else 1
