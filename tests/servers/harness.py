"""Real server processes for the server tests: started from the README's command lines, stopped by pid.

Owns: ``readme_commands`` (the fenced command block of one README section, by marker, with ``$NAME``
placeholders filled in: the tests run exactly what the README shows), ``Server`` (one process group,
its log, readiness by HTTP, SIGTERM then SIGKILL of the whole group on stop, whatever happened), the
small HTTP helpers the tests talk to servers and routers with, and ``Stats`` (what the test hooks in each
server process dump: pdkv transports, the adapters' per-request state, the engines' own pools).
Must not import SGLang or vLLM (the pytest process never does) and binds nothing but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shlex
import signal
import socket
import string
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
SITE = Path(__file__).resolve().parent / "site"


def readme_commands(marker: str, values: Mapping[str, str]) -> dict[str, list[str]]:
    """The commands between ``<!-- marker -->`` and ``<!-- /marker -->`` in README.md, by name.

    Each command follows a ``# name: ...`` comment line; backslash continuations are joined and
    ``$NAME`` placeholders are filled from ``values`` (a missing value is an error: nothing the README
    names is left unset). Returns argv lists.
    """
    text = README.read_text()
    match = re.search(rf"<!-- {re.escape(marker)} -->(.*?)<!-- /{re.escape(marker)} -->", text, re.S)
    if match is None:
        raise AssertionError(f"README.md has no <!-- {marker} --> block")
    block = re.search(r"```[a-z]*\n(.*?)```", match.group(1), re.S)
    if block is None:
        raise AssertionError(f"the <!-- {marker} --> block of README.md has no fenced code")
    commands: dict[str, list[str]] = {}
    name: str | None = None
    for line in block.group(1).replace("\\\n", " ").splitlines():
        line = line.strip()
        if line.startswith("#"):
            head = line.lstrip("# ").split(":", 1)[0].strip()
            name = head or None
            continue
        if not line:
            continue
        if name is None:
            raise AssertionError(f"README.md <!-- {marker} -->: a command without a '# name:' line: {line}")
        filled = string.Template(line).substitute(values)
        commands[name] = shlex.split(filled)
        name = None
    return commands


def hook_env(workdir: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A server's environment: the test hooks on (``tests.servers.hooks``), their files in ``workdir``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SITE), str(REPO)]),
        "PDKV_TEST_HOOKS": "1",
        "PDKV_TEST_DIR": str(workdir),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(workdir / "hf-home"),
    }
    env.pop("VIRTUAL_ENV", None)
    env.update(extra or {})
    return env


class Server:
    """One server (or router) process in its own process group, output in ``<workdir>/<name>.log``."""

    def __init__(self, name: str, argv: list[str], workdir: Path, env: Mapping[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            argv, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_http(
        self, port: int, path: str, timeout_s: float, *, ok: Callable[[int, bytes], bool] | None = None
    ) -> None:
        """Until GET ``path`` answers (status 200, or ``ok``); the process dying or the deadline fails."""
        check = ok or (lambda status, _: status == 200)
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                status, body = request("GET", port, path, timeout_s=5)
                if check(status, body):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: {path} not ready in {timeout_s:g} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def terminate(self) -> None:
        """SIGTERM to the whole group, if the leader still runs (``stop`` waits for it)."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout_s: float = 5) -> None:
        """SIGTERM to the whole group, SIGKILL to what is left after ``timeout_s``; idempotent."""
        if self.proc.poll() is None:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=max(0.0, timeout_s))
        _signal_group(self.proc.pid, signal.SIGKILL)  # children that outlived the leader, too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if not self._log.closed:
            self._log.close()

    def log_tail(self, chars: int = 5000) -> str:
        if not self._log.closed:
            self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        kept = [line for line in lines if "server_args=" not in line]  # SGLang's 30 KB settings line
        return "\n".join(kept)[-chars:]


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@contextmanager
def servers() -> Iterator[list[Server]]:
    """Every Server appended to the yielded list is stopped on exit: all are sent SIGTERM at once, the
    last started first, and then given one shared grace of 5 s (one server at a time, a server that
    ignores SIGTERM for its grace cost the teardown 5 s each: 21 s of ``make test``); a SIGTERM
    to pytest meanwhile exits through here too (Python's default would leave the servers running)."""
    started: list[Server] = []

    def terminated(signum: int, frame: object) -> None:
        raise SystemExit(f"signal {signum}: stopping the servers")

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield started
    finally:
        for server in reversed(started):
            server.terminate()
        deadline = time.monotonic() + 5
        for server in reversed(started):
            server.stop(timeout_s=deadline - time.monotonic())
        signal.signal(signal.SIGTERM, previous)


def readme_pair(
    marker: str, model: Path, *, side_port: str, plain_from: str
) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Free ports and the README block's ``prefill``, ``decode`` and ``router`` lines filled with them,
    plus ``plain``: the decode's line cut before ``plain_from`` (its first disaggregation flag), on
    its own port. ``side_port``: the name of the prefill's second port (``$<NAME>_PORT``)."""
    names = ("plain", "prefill", side_port, "decode", "router", "metrics")  # metrics: the router's
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    values = {f"{name.upper()}_PORT": str(port) for name, port in ports.items() if name != "plain"}
    commands = readme_commands(marker, {"MODEL": str(model), **values})
    assert set(commands) == {"prefill", "decode", "router"}, commands
    decode = commands["decode"]
    plain = decode[: decode.index(plain_from)]
    plain[plain.index(str(ports["decode"]))] = str(ports["plain"])
    return ports, {**commands, "plain": plain}


@contextmanager
def start_pair(
    workdir: Path,
    ports: Mapping[str, int],
    commands: Mapping[str, list[str]],
    *,
    argv: Callable[[list[str]], list[str]],
    env: Callable[[str], Mapping[str, str]],
) -> Iterator[list[Server]]:
    """The plain, prefill and decode servers (waited for until ``/health`` answers), then the router
    (not waited for: its readiness is the caller's); all stopped on exit (see ``servers``)."""
    with servers() as started:
        for name in ("plain", "prefill", "decode"):
            started.append(Server(name, argv(commands[name]), workdir, env(name)))
        for server in started:
            server.wait_http(ports[server.name], "/health", timeout_s=240)
        started.append(Server("router", argv(commands["router"]), workdir, env("router")))
        yield started


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 (held together while chosen, so never the same)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


# --------------------------------------------------------------------------- HTTP


def request(
    method: str, port: int, path: str, body: Any = None, *, timeout_s: float = 60
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        conn.request(method, path, body=payload, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def post_json(port: int, path: str, body: Any, *, timeout_s: float = 300) -> Any:
    status, data = request("POST", port, path, body, timeout_s=timeout_s)
    if status != 200:
        raise AssertionError(f"POST :{port}{path} answered {status}: {data[:2000]!r}")
    return json.loads(data)


def get_json(port: int, path: str, *, timeout_s: float = 30) -> Any:
    status, data = request("GET", port, path, timeout_s=timeout_s)
    if status != 200:
        raise AssertionError(f"GET :{port}{path} answered {status}: {data[:2000]!r}")
    return json.loads(data)


def open_stream(port: int, path: str, body: Any) -> socket.socket:
    """A streaming POST whose response is never read: closing the socket is the client disconnecting."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


def disconnect(sock: socket.socket) -> None:
    """Close at once with a reset (SO_LINGER 0), as a client that goes away does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


# --------------------------------------------------------------------------- what the hooks dump


class Stats:
    """The hooks' dumps in one work folder: ``stats-<pid>.json`` per server process, refreshed every
    0.1 s; each holds a list of reports (``kind`` plus numbers)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir

    def reports(self, kind: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for path in sorted(self.workdir.glob("stats-*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # replaced while read: the next call sees it
            found.extend(r for r in data["reports"] if r["kind"] == kind)
        return found

    def one(self, kind: str) -> dict[str, Any]:
        found = self.reports(kind)
        if len(found) != 1:
            raise AssertionError(f"expected one {kind} report, found {len(found)}: {found}")
        return found[0]

    def total(self, kind: str, key: str) -> int:
        return sum(int(r[key]) for r in self.reports(kind))


def settled(
    read: Callable[[], dict[str, dict[str, Any]]], idle: Callable[[dict[str, dict[str, Any]]], bool]
) -> dict[str, dict[str, Any]]:
    """``read()`` once ``idle`` holds for it and two reads 0.3 s apart agree: counts read before or
    after a test's requests must not miss a room of a request still ending (the dumps refresh every
    0.1 s; a start-up request the fixture retried may end late)."""
    seen: list[dict[str, dict[str, Any]]] = []

    def quiet() -> bool:
        now = read()
        same = bool(seen) and seen[-1] == now
        seen.append(now)
        return idle(now) and same

    wait_for(quiet, 30, "no open room and steady counts on both sides", interval_s=0.3)
    return seen[-1]


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def write_control(workdir: Path, mode: str | None) -> None:
    """Tell the decode hooks what to do to the next received KV (``None``: nothing)."""
    path = workdir / "control.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"mode": mode}))
    tmp.replace(path)


# --------------------------------------------------------------------------- the checks both engines pass

Generate = Callable[[list[int]], list[int]]


def check_tokens_and_controls(
    workdir: Path,
    stats: Stats,
    decode_kind: str,
    *,
    routed: Generate,
    plain: Generate,
    prompts: list[list[int]],
    control_prompts: list[list[int]],
) -> None:
    """Routed greedy tokens equal the plain server's for every prompt, then each control (the decode's
    received KV corrupted by the hooks) changes them. The first control prompt is sent clean: its KV is
    what ``other`` writes into the next one."""
    write_control(workdir, None)
    expected = [plain(p) for p in prompts]
    assert [routed(p) for p in prompts] == expected
    base, *controlled = control_prompts
    assert routed(base) == plain(base)
    for mode, prompt in zip(("other", "zero_layer", "shift"), controlled, strict=True):
        applied = stats.one(decode_kind)["controls_applied"]
        write_control(workdir, mode)
        try:
            tokens = routed(prompt)
        finally:
            write_control(workdir, None)
        wait_for(
            lambda done=applied + 1: stats.one(decode_kind)["controls_applied"] == done,  # type: ignore[misc]
            5,
            f"the {mode} control applied on the decode",
        )
        assert tokens != plain(prompt), f"the {mode} control left the tokens unchanged"
