"""Command line: ``pdkv demo | bench NAME | diagram [--check] [--image FMT] | trace ROOM LOGS... | registry``.

Owns: argument parsing and dispatch only; the work lives in the modules it calls.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="pdkv", description="KV-cache transport for PD disaggregation")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo", help="run the demo (main job); --protocol-only for the in-memory one", add_help=False
    )
    bench = sub.add_parser(
        "bench",
        help="run a benchmark: pdkv bench NAME [args] (NAME 'list' or 'all')",
        description="Benchmarks: pdkv bench list names them; pdkv bench NAME --help describes one.",
    )
    bench.add_argument("name", help="a benchmark's name, 'list' or 'all'")
    diagram = sub.add_parser(
        "diagram", help="write the state and sequence diagrams into specs/diagrams/ and specs/protocol.md"
    )
    diagram.add_argument("--check", action="store_true", help="exit 1 if the committed files differ")
    diagram.add_argument("--out", default=None, help="output folder (default: specs/diagrams)")
    diagram.add_argument(
        "--image",
        choices=("svg", "png"),
        default=None,
        help="also draw each .dot file (needs Graphviz's dot)",
    )
    trace = sub.add_parser(
        "trace", help="one room of a run as a Mermaid sequence diagram, from JSON logs (PDKV_LOG_JSON)"
    )
    trace.add_argument("room", help="the room id; 'list': the rooms the logs mention")
    trace.add_argument("--dot", action="store_true", help="Graphviz DOT instead of Mermaid")
    trace.add_argument("--image", choices=("svg", "png"), default=None, help="draw it (needs Graphviz's dot)")
    trace.add_argument("--out", default=None, help="write to this file instead of stdout")
    trace.add_argument(
        "logs",
        nargs="*",
        help="JSON log files, or folders of *.jsonl (e.g. a demo's --log-dir); default: $PDKV_LOG_JSON",
    )
    registry = sub.add_parser(
        "registry", help="run the bootstrap registry of a prefill instance until stopped"
    )
    registry.add_argument("--instance", required=True, help="the prefill instance id its ranks announce")
    registry.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    registry.add_argument("--port", type=int, default=8998, help="port to bind (default 8998; 0: any free)")
    registry.add_argument("--tp", type=int, default=None, help="expected prefill TP size (default: learnt)")
    registry.add_argument("--cp", type=int, default=None, help="expected prefill CP size (default: learnt)")

    if args and args[0] == "demo":
        from pdkv.demo import main as demo_main

        return demo_main(args[1:])
    if args and args[0] == "bench" and len(args) >= 2 and not args[1].startswith("-"):
        return _bench(args[1], args[2:])
    ns = parser.parse_args(args)
    if ns.command == "registry":
        return _registry(ns.instance, ns.host, ns.port, ns.tp, ns.cp)
    if ns.command == "diagram":
        from pdkv.diagrams import main as diagram_main

        return diagram_main(check=bool(ns.check), out=ns.out, image=ns.image)
    if ns.command == "trace":
        from pdkv.diagrams.trace import main as trace_main

        if ns.room != "list" and not ns.room.isdigit():
            parser.error(f"trace: ROOM must be a room id or 'list', not {ns.room!r}")
        default = os.environ.get("PDKV_LOG_JSON")
        logs = ns.logs or ([default] if default else [])
        if not logs:
            parser.error("trace: name the JSON logs (files or folders), or set PDKV_LOG_JSON")
        room = None if ns.room == "list" else int(ns.room)
        return trace_main(room, logs, dot=bool(ns.dot), image=ns.image, out=ns.out)
    parser.print_help()
    return 2


def _bench(name: str, rest: list[str]) -> int:
    from pdkv import bench

    names = bench.available()
    if name == "list":
        for n, doc in names.items():
            print(f"{n:12s} {doc}")
        return 0
    if name == "all":
        status = 0
        for n in names:
            print(f"== pdkv bench {n}", file=sys.stderr, flush=True)
            status |= bench.load(n)(rest)
        return status
    try:
        run = bench.load(name)
    except KeyError as exc:
        print(f"pdkv bench: {exc.args[0]}", file=sys.stderr)
        return 2
    return run(rest)


def _registry(instance: str, host: str, port: int, tp: int | None, cp: int | None) -> int:
    import logging
    import signal
    import threading

    from pdkv.runtime import Registry

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Registry(instance, host=host, port=port, tp_size=tp, cp_size=cp) as registry:
        print(f"pdkv registry of instance {instance!r} at {registry.address}", flush=True)
        stop.wait()
    return 0
