"""pdkv against SGLang 0.5.23's own KV transfer: send -> prefill Success and prefill CPU, in one run.

The benchmark to run before adopting pdkv. SGLang's transfer as its schedulers use it (the
``MooncakeKVManager``, ``MooncakeKVSender`` / ``MooncakeKVReceiver`` and its bootstrap server, got
from SGLang's ``get_kv_class``; with NIXL installed, its NIXL backend's classes too) and pdkv's
public API (``PrefillTransport`` / ``DecodeTransport``, ``KVSender`` / ``KVReceiver``) move the
same requests: a 61-layer MLA model (DeepSeek-V3's 576 x bf16 per token, 72 KiB pages of 64
tokens), the same page lists on both sides (70% of pages in runs of 2-16, contiguous on both,
the rest single pages; drawn once per size), pools of the same geometry and bytes. Each system
has its own prefill and decode process on 127.0.0.1; the parent only orchestrates.

A request: the decode asks for it (SGLang: ``receiver.init`` + ``send_metadata``; pdkv:
``receiver.init``), the prefill waits until it is in (untimed), then ``send()`` of its chunks (one,
or several for the chunked case) is timed to the prefill's poll seeing Success, with the prefill
process's CPU time (every thread) over the same span and the scheduler thread's own share. Every
request's bytes are checked on the decode (its pages zeroed before, every KV byte and the aux row
compared after): a wrong byte fails the run. One request per system after warm-up plants a wrong
byte as a control, which the check must find. The systems run interleaved, one request each per
size per round (``--small-repeats`` each, 5 by default, for sizes of up to 16 pages: a few ms per
request, whose median over 5 moved too much between runs), the order turning each round; figures
are medians and ranges over the requests, and
the ratios are pdkv's speed (SGLang's median / pdkv's) and CPU (pdkv's median / SGLang's), each
pdkv system against SGLang on its own engine.

SGLang's Mooncake backend sends a request's KV as one engine batch (5,063 entries at 128 pages),
which Mooncake's default per-peer TCP queue (2,048) rejects: its processes run with
``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` raised (``--sglang-tcp-queue``); pdkv's at the default.
SGLang's GPU-only imports are stood in for by ``pdkv.testing.gpu_stubs`` in its processes; every
call into a stub after import is counted and printed, and any fails the run. ``--sglang``
names SGLang's backends to run (Mooncake, and NIXL when ``nixl`` and ``nixl-cu12`` are installed),
``--backend`` pdkv's engines (Mooncake, and NIXL when ``pdkv.NixlBackend`` loads); the ratios pair
each pdkv system with SGLang on the same engine, never across engines. SGLang's NIXL processes
(its progress thread spins a core each, idle or not) are stopped (SIGSTOP) outside their turns;
pdkv's NIXL processes are not (its backend drives progress itself: 0.7% of a core per idle process
here, against 98% for SGLang's).

This module owns the start-up, the rounds, the checks that fail a run and the report; the ranks
are ``_sglang_ranks``'. It must not import SGLang (its stubs stay in SGLang's own processes) and
asserts no speed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import multiprocessing as mp
import os
import signal
import socket
import statistics
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np

from pdkv.bench._report import emit, table
from pdkv.bench._sglang_ranks import (
    AUX_ROWS,
    BACKEND_NAMES,
    PAGE_BYTES,
    Arm,
    Case,
    Check,
    DecodeResult,
    Done,
    Error,
    Geometry,
    Go,
    Open,
    PageLists,
    PrefillResult,
    RankPlan,
    Stop,
    Stopped,
    rank_main,
)
from pdkv.bench.latency import RAW_TCP_QUEUE, Progress, place_pages
from pdkv.engine.nixl import load_nixl
from pdkv.errors import EngineUnavailableError, InvalidArgumentError
from pdkv.protocol.poll import KVPoll

DEFAULT_CASES = "1,16,128,128/4"
SGLANG_BACKENDS = ("mooncake", "nixl")
# SGLang's NIXL prefill finishes a request's work in the background after its Success: stopped at
# once, it does it during its next request (measured here: a 128-page request took 210 ms when its
# processes were stopped right after the one before, 130 ms when stopped 0.3 s after it, 128 ms when
# never stopped).
PAUSE_GRACE_S = 0.3
PAUSED_SYSTEMS = ("sglang/nixl",)
"""Stopped (SIGSTOP) outside their turns: SGLang's NIXL progress threads spin a core per process (98%
of one, idle, measured here). Not pdkv/nixl: 0.7% of a core per idle process (its backend polls every
2 ms), and a pdkv rank stopped for long would be declared silent by its peer."""


# ----------------------------------------------------------------------------- the parent's side of a rank


class RankProcess:
    """One rank process: its commands and answers, with a timeout and the rank's name on every error."""

    def __init__(self, system: str, role: str, ctx: Any) -> None:
        self.name = f"{system} {role}"
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=rank_main,
            args=(system, child_conn),
            name=f"pdkv-bench-{system.replace('/', '-')}-{role}",
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self.stopped: Stopped | None = None
        self.paused = False
        self.killed = False
        """It did not exit within 30 s of its Stop (a thread that nothing ends): killed."""

    def configure(self, plan: RankPlan) -> None:
        """Its plan: it sets up and answers Ready (``receive``)."""
        self.conn.send(plan)

    def ask(self, command: object, timeout_s: float = 180) -> Any:
        self.conn.send(command)
        return self.receive(timeout_s)

    def receive(self, timeout_s: float = 180) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.1):
            if not self.process.is_alive():
                raise RuntimeError(f"{self.name} died (exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not answer within {timeout_s:g} s")
        message = self.conn.recv()
        if isinstance(message, Error):
            raise RuntimeError(f"{self.name} failed:\n{message.text}")
        return message

    def pause(self, paused: bool) -> None:
        if paused != self.paused and self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGSTOP if paused else signal.SIGCONT)
            self.paused = paused

    def stop(self) -> None:
        """Ask it to stop and collect its report; kill it if it does not go (by its own pid)."""
        self.pause(False)
        try:
            if self.process.is_alive():
                self.conn.send(Stop())
                answer = self.receive(60)
                if isinstance(answer, Stopped):
                    self.stopped = answer
        except (RuntimeError, OSError, EOFError) as exc:
            print(f"  {self.name}: {exc}", file=sys.stderr)
        finally:
            self.process.join(30)
            if self.process.is_alive():
                self.killed = True
                self.process.kill()
                self.process.join(10)
            self.conn.close()


@attrs.define
class System:
    """One transfer implementation under test: its two ranks and its outcomes per case label."""

    name: str
    prefill: RankProcess
    decode: RankProcess
    pause_between_turns: bool = False
    """Stop its processes (SIGSTOP) outside its turns, ``PAUSE_GRACE_S`` after its request: SGLang's
    NIXL progress threads spin a core each, idle or not, which would slow every other system."""
    runs: dict[str, list[Outcome]] = attrs.Factory(dict)

    @property
    def is_pdkv(self) -> bool:
        return self.name.startswith("pdkv/")

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        for rank in (self.prefill, self.decode):
            rank.pause(False)
        try:
            yield
        finally:
            if self.pause_between_turns:
                time.sleep(PAUSE_GRACE_S)
            self.idle()

    def idle(self) -> None:
        if self.pause_between_turns:
            for rank in (self.prefill, self.decode):
                rank.pause(True)


@attrs.frozen(kw_only=True)
class Outcome:
    prefill: PrefillResult
    decode: DecodeResult

    @property
    def succeeded(self) -> bool:
        return self.prefill.state == int(KVPoll.Success) and self.decode.state == int(KVPoll.Success)

    @property
    def check(self) -> Check | None:
        return self.decode.check


def run_request(system: System, case: Case, room: int, aux_row: int, *, plant: bool = False) -> Outcome:
    """One request through one system: the prefill opens the room, the decode asks for it, the
    prefill sends and times it, the decode polls to Success and checks the bytes."""
    with system.turn():
        _expect(system.prefill, system.prefill.ask(Open(room=room)), Done)
        _expect(
            system.decode, system.decode.ask(Arm(room=room, case=case, aux_row=aux_row, plant=plant)), Done
        )
        prefill = _expect(
            system.prefill, system.prefill.ask(Go(room=room, case=case, aux_row=aux_row)), PrefillResult
        )
        decode = _expect(system.decode, system.decode.receive(), DecodeResult)
    return Outcome(prefill=prefill, decode=decode)


_T = TypeVar("_T")


def _expect(rank: RankProcess, answer: object, kind: type[_T]) -> _T:
    if not isinstance(answer, kind):
        raise RuntimeError(f"{rank.name} answered {answer!r}, not a {kind.__name__}")
    return answer


# ----------------------------------------------------------------------------- start-up


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def nixl_installed() -> bool:
    """SGLang's NIXL backend imports ``nixl`` (the meta package), which needs a ``nixl_cu*`` wheel."""
    if importlib.util.find_spec("nixl") is None:
        return False
    return any(importlib.util.find_spec(name) is not None for name in ("nixl_cu12", "nixl_cu13"))


def nixl_problem() -> str:
    """Why pdkv's NIXL backend cannot load here ("" when it can): its own import check."""
    try:
        load_nixl()
    except EngineUnavailableError as exc:
        return str(exc)
    return ""


def pdkv_nixl_loads() -> bool:
    return not nixl_problem()


def parse_names(text: str, choices: Sequence[str], argument: str) -> list[str]:
    """``mooncake,nixl``: distinct names of ``choices``, in order; ``InvalidArgumentError`` naming
    ``argument`` otherwise."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(choices))
    if unknown or not names or len(set(names)) != len(names):
        raise InvalidArgumentError(
            f"{argument}: a list of distinct names of {', '.join(choices)}, got {text!r}",
            argument=argument,
            value=text,
        )
    return names


def sglang_installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


def parse_cases(text: str) -> list[Case]:
    """``1,16,128,128/4``: pages, or pages/chunks; ``InvalidArgumentError`` naming ``cases`` otherwise."""
    cases: list[Case] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        pages_text, _, chunks_text = item.partition("/")
        try:
            pages, chunks = int(pages_text), int(chunks_text or 1)
        except ValueError:
            pages = chunks = 0
        if pages < 1 or not 1 <= chunks <= pages:
            raise InvalidArgumentError(
                f"cases: {item!r} is not PAGES or PAGES/CHUNKS with 1 <= CHUNKS <= PAGES",
                argument="cases",
                value=text,
            )
        cases.append(Case(pages=pages, chunks=chunks))
    if not cases:
        raise InvalidArgumentError(f"cases: no case in {text!r}", argument="cases", value=text)
    return cases


def draw_page_lists(
    cases: Sequence[Case], run_fraction: float, max_run: int, seed: int
) -> dict[int, PageLists]:
    """One pair of page lists per request size, shared by every system (and by a size's chunked case)."""
    rng = np.random.default_rng(seed)
    lists: dict[int, PageLists] = {}
    for pages in sorted({case.pages for case in cases}):
        src, dst = place_pages(pages, run_fraction, max_run, rng)
        lists[pages] = PageLists(src=src + 1, dst=dst + 1)  # page 0: SGLang's padding page, never used
    return lists


def start_systems(args: argparse.Namespace, cases: list[Case], progress: Progress) -> list[System]:
    """Every rank process at once; then the plans, each once what it needs is up (SGLang's prefill
    first: its Ready gives the metadata row size that pdkv's aux row copies)."""
    page_lists = draw_page_lists(cases, args.run_fraction, args.max_run, args.seed)
    base = RankPlan(
        system="",
        role="",
        geometry=Geometry(layers=args.layers, pool_pages=max(page_lists) + 1),
        page_lists=page_lists,
        poll_s=args.sglang_poll_us / 1e6,
        wake=False,
        hidden_size=args.hidden_size,
    )
    ctx = mp.get_context("spawn")
    names = [f"sglang/{backend}" for backend in args.sglang]
    pdkv_names = [f"pdkv/{backend}" for backend in args.backend]
    started: list[RankProcess] = []

    def start(system: str, role: str) -> RankProcess:
        rank = RankProcess(system, role, ctx)
        started.append(rank)
        return rank

    try:
        # Every process starts now (imports take most of the start-up); each gets its plan once
        # what it needs is up: SGLang's decode its prefill's bootstrap server, pdkv's prefills the
        # size of SGLang's metadata row, pdkv's decodes their prefill's registry.
        pairs = [(name, start(name, "prefill"), start(name, "decode")) for name in names]
        pdkv_pairs = [(name, start(name, "prefill"), start(name, "decode")) for name in pdkv_names]
        progress.show(f"starting {', '.join(names + pdkv_names)} (SGLang's import takes a while) ...")
        ports = {name: free_port() for name in names}
        for name, prefill, _ in pairs:
            plan = attrs.evolve(base, system=name, tcp_queue=_queue(args, name))
            prefill.configure(attrs.evolve(plan, role="prefill", bootstrap_port=ports[name]))
        readies = []
        for name, prefill, decode in pairs:
            readies.append(prefill.receive(300))
            plan = attrs.evolve(base, system=name, tcp_queue=_queue(args, name))
            decode.configure(attrs.evolve(plan, role="decode", bootstrap=f"127.0.0.1:{ports[name]}"))
        pdkv_plans = {
            name: attrs.evolve(
                base,
                system=name,
                poll_s=args.pdkv_poll_us / 1e6,
                wake=not args.sleep_poll,
                aux_bytes=readies[0].aux_bytes,
                backend=engine_of(name),
            )
            for name in pdkv_names
        }
        for name, prefill, _ in pdkv_pairs:
            prefill.configure(attrs.evolve(pdkv_plans[name], role="prefill"))
        for name, prefill, decode in pdkv_pairs:
            registry = prefill.receive(300).address
            decode.configure(attrs.evolve(pdkv_plans[name], role="decode", bootstrap=registry))
        systems: list[System] = []
        for name, prefill, decode in pairs + pdkv_pairs:
            decode.receive(300)
            system = System(name, prefill, decode, pause_between_turns=name in PAUSED_SYSTEMS)
            system.idle()
            systems.append(system)
        stubbed = sorted({name for ready in readies for name in ready.stubbed})
        progress.show(f"ready: {', '.join(s.name for s in systems)}; GPU-only imports stubbed: {stubbed}")
        return systems
    except BaseException:
        for rank in started:
            rank.stop()
        raise


def _queue(args: argparse.Namespace, system: str) -> int | None:
    return (args.sglang_tcp_queue or None) if system == "sglang/mooncake" else None


# ----------------------------------------------------------------------------- the run


@attrs.define
class Run:
    """What one invocation found: the requests verified, the controls, the stub calls, the failures."""

    cases: list[Case]
    systems: list[System]
    failures: list[str] = attrs.Factory(list)
    controls: dict[str, bool] = attrs.Factory(dict)
    verified: dict[str, int] = attrs.Factory(dict)
    stub_calls: dict[str, int] = attrs.Factory(dict)
    room: int = 0

    def next_room(self) -> int:
        self.room += 1
        return self.room

    def accept(self, system: str, case: Case, outcome: Outcome, *, planted: bool = False) -> bool:
        """Record one request's result: True when it counts (succeeded, every byte right). A failed
        request or a wrong byte is a failure of the run; a planted wrong byte must be found, alone,
        where it was planted."""
        where = f"{system} {case.label} pages, room {outcome.prefill.room}"
        if not outcome.succeeded:
            self.failures.append(
                f"{where}: prefill {KVPoll(outcome.prefill.state).name}, decode "
                f"{KVPoll(outcome.decode.state).name}: {outcome.prefill.failure or outcome.decode.failure}"
            )
            return False
        check = outcome.check
        if check is None:
            self.failures.append(f"{where}: the decode reported no byte check")
            return False
        if planted:
            found = check.mismatched == 1 and check.first == outcome.decode.planted and check.aux_ok
            self.controls[system] = found
            if not found:
                self.failures.append(
                    f"{where}: the wrong byte planted at layer/position {outcome.decode.planted} was not "
                    f"found alone ({check})"
                )
            return False
        if not check.ok:
            self.failures.append(
                f"{where}: {check.mismatched} of {check.items} KV items differ (first at layer/position "
                f"{check.first}), aux row {'right' if check.aux_ok else 'wrong'}"
            )
            return False
        self.verified[system] = self.verified.get(system, 0) + 1
        return True

    def stub_report(self, rank: str, calls: tuple[str, ...] | None) -> None:
        """An SGLang rank's calls into GPU stubs after import (None: it never reported)."""
        self.stub_calls[rank] = -1 if calls is None else len(calls)
        if calls is None:
            self.failures.append(f"{rank}: no report of its GPU stub calls (it did not stop cleanly)")
        elif calls:
            self.failures.append(f"{rank}: {len(calls)} calls into GPU stubs after import: {list(calls[:8])}")

    def missing_controls(self) -> list[str]:
        return [s.name for s in self.systems if not self.controls.get(s.name)]

    def passed(self) -> bool:
        """No failure, and every system's control found."""
        return not self.failures and not self.missing_controls()


SMALL_CASE_PAGES = 16
"""Cases of up to this many pages take ``--small-repeats`` requests per system per round."""


def requests_per_round(args: argparse.Namespace, case: Case) -> int:
    """Measured requests per system of ``case`` in one round: ``--small-repeats`` for a small case
    (its requests take milliseconds, and a median of 5 over a spread of 3-12 ms at one page moved
    the ratio by 0.5x from run to run), else one."""
    return int(args.small_repeats) if case.pages <= SMALL_CASE_PAGES else 1


def measure(args: argparse.Namespace, run: Run) -> None:
    """Warm-up rounds, one control per system, then the measured rounds: every system once per size
    per round (small sizes ``requests_per_round`` times, the systems interleaved each time), the
    systems' order turning each round. One progress line per round (the last request's times)."""
    for round_index in range(args.warmup + args.rounds):
        warm = round_index < args.warmup
        turn = round_index % len(run.systems)
        order = run.systems[turn:] + run.systems[:turn]
        started = time.monotonic()
        shown: list[str] = []
        for case in run.cases:
            times: dict[str, float] = {}
            for _ in range(1 if warm else requests_per_round(args, case)):
                for system in order:
                    room = run.next_room()
                    outcome = run_request(system, case, room, room % AUX_ROWS)
                    if run.accept(system.name, case, outcome):
                        times[system.name] = outcome.prefill.wall_s
                        if not warm:
                            system.runs.setdefault(case.label, []).append(outcome)
            figures = " | ".join(
                f"{times[s.name] * 1e3:.3g}" if s.name in times else "-" for s in run.systems
            )
            shown.append(f"{case.label}: {figures}")
        label = "warm-up" if warm else f"round {round_index - args.warmup + 1}/{args.rounds}"
        print(
            f"  {label} ({time.monotonic() - started:.1f} s, ms {' | '.join(s.name for s in run.systems)}): "
            + "  ".join(shown),
            file=sys.stderr,
            flush=True,
        )
        if round_index == max(0, args.warmup - 1):
            controls(run)


def controls(run: Run) -> None:
    """One request per system whose decode flips a landed byte before its check: it must be found."""
    case = Case(pages=min(c.pages for c in run.cases))
    for system in run.systems:
        room = run.next_room()
        run.accept(
            system.name, case, run_request(system, case, room, room % AUX_ROWS, plant=True), planted=True
        )


# ----------------------------------------------------------------------------- the report


PREFILL_MS = "prefill_success_ms"
CPU_MS = "prefill_cpu_ms"
Figures = dict[str, dict[str, float]]
"""One system's figures at one case: figure name -> median, min and max (ms)."""


def _spread(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _ms(stats: dict[str, float]) -> dict[str, float]:
    return {key: value * 1e3 for key, value in stats.items()}


def case_figures(outcomes: Sequence[Outcome]) -> Figures:
    """One system's measured requests at one case, in ms: ->P, ->D, prefill CPU, scheduler thread CPU."""
    return {
        PREFILL_MS: _ms(_spread([o.prefill.wall_s for o in outcomes])),
        "decode_success_ms": _ms(_spread([o.decode.success_at - o.prefill.sent_at for o in outcomes])),
        CPU_MS: _ms(_spread([o.prefill.cpu_s for o in outcomes])),
        "scheduler_thread_cpu_ms": _ms(_spread([o.prefill.thread_cpu_s for o in outcomes])),
    }


def engine_of(system: str) -> str:
    """The engine a system runs on: ``pdkv/nixl`` and ``sglang/nixl`` -> ``nixl``."""
    return system.partition("/")[2]


@attrs.frozen(kw_only=True)
class Ratio:
    """One pdkv system against SGLang on the same engine, at one case."""

    pdkv: str
    versus: str
    speed: float
    """SGLang's ->P median / pdkv's: above 1, pdkv is faster."""
    cpu: float
    """pdkv's prefill CPU median / SGLang's: below 1, pdkv spends less."""


def _quotient(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def paired_ratios(figures: Mapping[str, Figures]) -> dict[str, Ratio]:
    """Each pdkv system's ratios against SGLang on its own engine (pdkv/mooncake vs sglang/mooncake,
    pdkv/nixl vs sglang/nixl), by pdkv system; none for a pdkv system whose engine SGLang did not run
    (engines are never crossed: the ratio is about the transfer layer, not the engine under it)."""
    ratios: dict[str, Ratio] = {}
    for name, mine in figures.items():
        versus = f"sglang/{engine_of(name)}"
        theirs = figures.get(versus)
        if not name.startswith("pdkv/") or theirs is None:
            continue
        ratios[name] = Ratio(
            pdkv=name,
            versus=versus,
            speed=_quotient(theirs[PREFILL_MS]["median"], mine[PREFILL_MS]["median"]),
            cpu=_quotient(mine[CPU_MS]["median"], theirs[CPU_MS]["median"]),
        )
    return ratios


def report_order(names: Sequence[str]) -> list[str]:
    """The table's rows at one case: grouped by engine (in the order each engine first appears), SGLang's
    system first, then pdkv's on the same engine, so each pair sits together."""
    engines = list(dict.fromkeys(engine_of(name) for name in names))
    return sorted(names, key=lambda name: (engines.index(engine_of(name)), name.startswith("pdkv/"), name))


def report(
    args: argparse.Namespace, cases: Sequence[Case], results: Mapping[str, Mapping[str, Sequence[Outcome]]]
) -> None:
    """JSON lines (a ``case`` record per system and case, a ``ratio`` record per pair) and the table.
    ``results``: by system, by case label, the measured requests."""
    rows: list[list[object]] = []
    for case in cases:
        nbytes = case.pages * args.layers * PAGE_BYTES
        figures = {name: case_figures(runs.get(case.label, [])) for name, runs in results.items()}
        for name, figure in figures.items():
            emit(
                {
                    "bench": "sglang",
                    "kind": "case",
                    "case": case.label,
                    "pages": case.pages,
                    "chunks": case.chunks,
                    "layers": args.layers,
                    "bytes": nbytes,
                    "system": name,
                    "engine": engine_of(name),
                    "rounds": args.rounds,
                    "requests": len(results[name].get(case.label, [])),
                    "tcp_queue": _queue(args, name),
                    **figure,
                }
            )
        ratios = paired_ratios(figures)
        for ratio in ratios.values():
            emit(
                {
                    "bench": "sglang",
                    "kind": "ratio",
                    "case": case.label,
                    "engine": engine_of(ratio.pdkv),
                    "pdkv": ratio.pdkv,
                    "versus": ratio.versus,
                    "speed": ratio.speed,
                    "cpu": ratio.cpu,
                }
            )
        for name in report_order(list(figures)):
            theirs = figures[name]
            pair = ratios.get(name)
            rows.append(
                [
                    case.label,
                    f"{nbytes / 1e6:.1f}",
                    name,
                    len(results[name].get(case.label, [])),
                    theirs[PREFILL_MS]["median"],
                    f"{theirs[PREFILL_MS]['min']:.3g}-{theirs[PREFILL_MS]['max']:.3g}",
                    theirs["decode_success_ms"]["median"],
                    theirs[CPU_MS]["median"],
                    f"{theirs[CPU_MS]['min']:.3g}-{theirs[CPU_MS]['max']:.3g}",
                    theirs["scheduler_thread_cpu_ms"]["median"],
                    "" if pair is None else f"{pair.speed:.2f}x",
                    "" if pair is None else f"{pair.cpu:.2f}",
                    "" if pair is None else f"vs {pair.versus}",
                ]
            )
    queue = args.sglang_tcp_queue
    table(
        "\n".join(
            [
                f"pdkv bench sglang: {args.layers} MLA layers, pages of {PAGE_BYTES:,} B, {args.rounds} "
                f"round{'s' if args.rounds > 1 else ''} interleaved, {args.small_repeats} request"
                f"{'s' if args.small_repeats > 1 else ''} per system per round of each case of up to "
                f"{SMALL_CASE_PAGES} pages (medians and ranges over the requests; 'n': how many)",
                "  ->P: send() -> the prefill's poll sees Success; ->D: send() -> the decode's poll does; "
                "CPU: the prefill process over ->P, every thread (sched: its scheduler thread alone)",
                "  pdkv speed: SGLang's ->P median / pdkv's, on the same engine (pdkv/mooncake vs "
                "sglang/mooncake, pdkv/nixl vs sglang/nixl); CPU ratio: pdkv's CPU median / SGLang's",
                f"  SGLang's Mooncake TCP queue: {f'raised to {queue:,}' if queue else 'the default'} "
                "(it sends a request as one engine batch); pdkv's: Mooncake's default; NIXL: UCX's "
                "default transports on lo, both",
                f"  schedulers: SGLang's sleep {args.sglang_poll_us:g} us between polls, pdkv's "
                f"{'sleep' if args.sleep_poll else 'wait for progress up to'} {args.pdkv_poll_us:g} us",
            ]
        ),
        [
            "case",
            "MB",
            "system",
            "n",
            "->P p50",
            "->P range",
            "->D p50",
            "CPU p50",
            "CPU range",
            "sched CPU",
            "pdkv speed",
            "CPU ratio",
            "pair",
        ],
        rows,
    )


# ----------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[Case]]:
    """The options, checked (a bad one exits 2 naming it, as argparse does), ``auto`` resolved:
    ``--sglang`` and ``--backend`` become lists of engines. ``--quick`` shrinks the workload only: its
    engines are the same as a full run's."""
    parser = argparse.ArgumentParser(prog="pdkv bench sglang", description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--cases",
        default=DEFAULT_CASES,
        help=f"request sizes: pages, or pages/chunks (default {DEFAULT_CASES})",
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="measured rounds (one request per size per system)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    parser.add_argument(
        "--small-repeats",
        type=int,
        default=5,
        help=f"requests per system per round of each case of up to {SMALL_CASE_PAGES} pages, "
        "interleaved (they take milliseconds: more of them steady their medians)",
    )
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument(
        "--hidden-size", type=int, default=7168, help="SGLang's metadata row: one hidden state"
    )
    parser.add_argument("--run-fraction", type=float, default=0.7)
    parser.add_argument("--max-run", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--backend",
        default="auto",
        help="pdkv's engines, comma-separated: mooncake, nixl (auto: mooncake, and nixl when pdkv's NIXL "
        "backend loads); each is compared with SGLang on the same engine",
    )
    parser.add_argument(
        "--sglang",
        default="auto",
        help="SGLang's backends to compare with, comma-separated: mooncake, nixl (auto: mooncake, and nixl "
        "when nixl and nixl-cu12 are installed)",
    )
    parser.add_argument(
        "--sglang-tcp-queue",
        type=int,
        default=RAW_TCP_QUEUE,
        help="MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER in SGLang's Mooncake processes (0: Mooncake's default, "
        f"which refuses SGLang's 128-page batch; default {RAW_TCP_QUEUE:,})",
    )
    parser.add_argument(
        "--sglang-poll-us", type=float, default=100.0, help="SGLang's schedulers' sleep between polls"
    )
    parser.add_argument(
        "--pdkv-poll-us",
        type=float,
        default=None,
        help="pdkv's schedulers' longest wait for progress between polls "
        "(default 5,000; 100 with --sleep-poll)",
    )
    parser.add_argument(
        "--sleep-poll", action="store_true", help="pdkv's schedulers sleep between polls, as SGLang's"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny run for tests: 4 layers, 1 page, 1 round, the same engines",
    )
    args = parser.parse_args(list(argv))
    if args.quick:
        args.layers, args.cases, args.rounds, args.warmup, args.small_repeats = 4, "1", 1, 1, 1
    if args.rounds < 1 or args.warmup < 0 or args.layers < 1:
        parser.error("--rounds must be >= 1, --warmup >= 0 and --layers >= 1")
    if args.small_repeats < 1:
        parser.error(f"--small-repeats must be >= 1, got {args.small_repeats}")
    if args.pdkv_poll_us is None:
        args.pdkv_poll_us = 100.0 if args.sleep_poll else 5000.0
    if args.backend == "auto":
        args.backend = "mooncake,nixl" if pdkv_nixl_loads() else "mooncake"
    if args.sglang == "auto":
        args.sglang = "mooncake,nixl" if nixl_installed() else "mooncake"
    try:
        cases = parse_cases(args.cases)
        args.backend = parse_names(args.backend, BACKEND_NAMES, "backend")
        args.sglang = parse_names(args.sglang, SGLANG_BACKENDS, "sglang")
    except InvalidArgumentError as exc:
        parser.error(f"--{exc}")
    return args, cases


def unavailable(args: argparse.Namespace) -> str:
    """Why the systems ``args`` names cannot run here ("" when they can)."""
    if not sglang_installed():
        return "SGLang is not installed (make sglang installs its pinned CPU closure)"
    if "nixl" in args.backend and (problem := nixl_problem()):
        return f"--backend nixl, but pdkv's NIXL backend cannot load: {problem}"
    if "nixl" in args.sglang and not nixl_installed():
        return "--sglang nixl, but nixl / nixl-cu12 are not installed"
    return ""


def main(argv: Sequence[str]) -> int:
    args, cases = parse_args(argv)
    if problem := unavailable(args):
        print(f"pdkv bench sglang: {problem}", file=sys.stderr)
        return 1
    return _run(args, cases)


def _run(args: argparse.Namespace, cases: list[Case]) -> int:
    progress = Progress()
    systems = start_systems(args, cases, progress)
    progress.close()
    run = Run(cases=cases, systems=systems)
    try:
        measure(args, run)
    except RuntimeError as exc:  # a rank died or stopped answering: reported, the rest stopped
        run.failures.append(str(exc))
    finally:
        for system in systems:
            for rank in (system.prefill, system.decode):
                rank.stop()
                if rank.killed:
                    run.failures.append(f"{rank.name}: still running 30 s after its Stop; killed")
                if not system.is_pdkv:
                    run.stub_report(rank.name, None if rank.stopped is None else rank.stopped.stub_calls)
    if any(system.runs for system in systems):
        report(args, cases, {system.name: system.runs for system in systems})
    emit(
        {
            "bench": "sglang",
            "kind": "summary",
            "ok": run.passed(),
            "systems": [s.name for s in systems],
            "verified": run.verified,
            "controls_detected": run.controls,
            "stub_calls": run.stub_calls,
            "failures": run.failures + [f"{name}: no control found" for name in run.missing_controls()],
        }
    )
    table(
        "checks: requests whose every byte was verified on the decode (warm-up included), the planted "
        "wrong byte found, calls into GPU stubs after import (must be 0)",
        ["system", "verified", "control found", "stub calls (prefill, decode)"],
        [
            [
                s.name,
                run.verified.get(s.name, 0),
                run.controls.get(s.name, False),
                "-"
                if s.is_pdkv
                else f"{run.stub_calls.get(s.prefill.name, -1)}, {run.stub_calls.get(s.decode.name, -1)}",
            ]
            for s in systems
        ],
    )
    for failure in run.failures:
        print(f"  FAILED: {failure}", file=sys.stderr)
    return 0 if run.passed() else 1
