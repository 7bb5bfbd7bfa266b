"""This process's TCP sockets, read and cut through Linux ``sock_diag`` (netlink): a proven release's cut.

Owns: listing this process's listening ports (``listening_ports``), listing the connections a given remote
host holds to given local ports (``connections_from``), and destroying them (``cut_connections``,
``SOCK_DESTROY``, what ``ss -K`` does). Must not know about engines, rooms or pages: the Mooncake backend
says which ports are its engine's, the decode transport says which host and when.

Why this exists (``specs/mooncake-tcp-late-writes.md``, section 5): bytes of a write the engine reported
FAILED can still land in the decode's memory for as long as a decode-side connection that carried it is
open; Mooncake's server sessions have no read deadline, so only destroying the socket ends them. After
``cut_connections`` returned, none of the connections it saw is in the kernel's table any more, so none of
their bytes can reach this process's memory (a segment for a 4-tuple without a socket is answered with
RST and dropped).

Needs ``CAP_NET_ADMIN`` in the socket's network namespace and a kernel with ``CONFIG_INET_DIAG_DESTROY``;
without them ``cut_connections`` raises ``ConnectionCutUnavailableError`` (callers fall back to a time
bound) and changes nothing. Linux only; elsewhere every call raises that error too.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import sys
import time
from collections.abc import Collection, Iterator
from typing import Final

import attrs

from pdkv.errors import TransferError
from pdkv.errors.engine import ConnectionCutUnavailableError as ConnectionCutUnavailableError

_NETLINK_SOCK_DIAG: Final = 4
_SOCK_DIAG_BY_FAMILY: Final = 20
_SOCK_DESTROY: Final = 21
_NLMSG_ERROR: Final = 2
_NLMSG_DONE: Final = 3
_NLM_F_REQUEST: Final = 0x1
_NLM_F_ACK: Final = 0x4
_NLM_F_DUMP: Final = 0x300
_ALL_STATES: Final = 0xFFFFFFFF
_TCP_LISTEN: Final = 10

_NLMSGHDR: Final = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_REQ_HEAD: Final = struct.Struct("=BBBBI")  # family, protocol, ext, pad, states
_SOCKID: Final = struct.Struct(">HH16s16s")  # sport, dport, src, dst (network order)
_SOCKID_TAIL: Final = struct.Struct("=I8s")  # interface, cookie (host order, opaque)
_MSG_HEAD: Final = struct.Struct("=BBBB")  # family, state, timer, retrans
_MSG_TAIL: Final = struct.Struct("=IIIII")  # expires, rqueue, wqueue, uid, inode
_SOCKID_LEN: Final = _SOCKID.size + _SOCKID_TAIL.size  # 48


@attrs.frozen
class TcpConnection:
    """One TCP socket as the kernel's table names it (``cookie`` identifies it exactly for a destroy)."""

    family: int
    state: int
    local_ip: str
    local_port: int
    remote_ip: str
    remote_port: int
    interface: int
    cookie: bytes
    inode: int

    def describe(self) -> str:
        return f"{self.remote_ip}:{self.remote_port}->{self.local_ip}:{self.local_port}"


@attrs.frozen
class CutReport:
    """What ``cut_connections`` did: the connections it destroyed (their 4-tuples, for the log)."""

    cut: tuple[TcpConnection, ...]
    seconds: float


def _unavailable(why: str) -> ConnectionCutUnavailableError:
    return ConnectionCutUnavailableError(f"cannot destroy TCP connections here: {why}")


def _netlink() -> socket.socket:
    if not sys.platform.startswith("linux"):
        raise _unavailable(f"sock_diag is Linux only (this is {sys.platform})")
    try:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
    except OSError as exc:
        raise _unavailable(f"no sock_diag netlink socket ({exc})") from exc


def _request(msg_type: int, flags: int, seq: int, family: int, sockid: bytes) -> bytes:
    body = _REQ_HEAD.pack(family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES) + sockid
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), msg_type, flags, seq, 0) + body


def _ip(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    text = socket.inet_ntop(socket.AF_INET6, raw)
    return text[7:] if text.startswith("::ffff:") and "." in text else text  # v4-mapped: the v4 address


def _messages(sock: socket.socket) -> Iterator[tuple[int, bytes]]:
    """Netlink messages (type, payload) of one reply, up to NLMSG_DONE or an error/ack."""
    while True:
        data = sock.recv(1 << 16)
        offset = 0
        while offset + _NLMSGHDR.size <= len(data):
            length, msg_type, _, _, _ = _NLMSGHDR.unpack_from(data, offset)
            if length < _NLMSGHDR.size:
                return
            payload = data[offset + _NLMSGHDR.size : offset + length]
            offset += (length + 3) & ~3
            if msg_type == _NLMSG_DONE:
                return
            yield msg_type, payload
            if msg_type == _NLMSG_ERROR:
                return


def _dump(sock: socket.socket, family: int) -> list[TcpConnection]:
    sock.send(_request(_SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, family, bytes(_SOCKID_LEN)))
    found: list[TcpConnection] = []
    for msg_type, payload in _messages(sock):
        if msg_type == _NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", payload)
            if code:
                raise _unavailable(f"sock_diag dump failed: {os.strerror(-code)}")
            break
        fam, state, _, _ = _MSG_HEAD.unpack_from(payload)
        sport, dport, src, dst = _SOCKID.unpack_from(payload, _MSG_HEAD.size)
        interface, cookie = _SOCKID_TAIL.unpack_from(payload, _MSG_HEAD.size + _SOCKID.size)
        inode = _MSG_TAIL.unpack_from(payload, _MSG_HEAD.size + _SOCKID_LEN)[4]
        found.append(
            TcpConnection(
                family=fam,
                state=state,
                local_ip=_ip(fam, src),
                local_port=sport,
                remote_ip=_ip(fam, dst),
                remote_port=dport,
                interface=interface,
                cookie=cookie,
                inode=inode,
            )
        )
    return found


def _table() -> list[TcpConnection]:
    with _netlink() as sock:
        return _dump(sock, socket.AF_INET) + _dump(sock, socket.AF_INET6)


def _own_inodes() -> set[int]:
    inodes: set[int] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def listening_ports() -> frozenset[int]:
    """The TCP ports this process listens on now (any address, v4 or v6)."""
    own = _own_inodes()
    return frozenset(c.local_port for c in _table() if c.state == _TCP_LISTEN and c.inode in own)


def resolve_host(host: str) -> frozenset[str]:
    """The addresses ``host`` (a name or an IP literal) stands for, as ``TcpConnection`` writes them."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return frozenset({host})
    return frozenset(_ip(fam, socket.inet_pton(fam, str(addr[0]).split("%")[0])) for fam, *_, addr in infos)


def connections_from(remote: Collection[str], local_ports: Collection[int]) -> list[TcpConnection]:
    """Connections (not listeners) from any of the addresses ``remote`` to one of ``local_ports``."""
    return [
        c
        for c in _table()
        if c.state != _TCP_LISTEN and c.local_port in local_ports and c.remote_ip in remote
    ]


def _destroy(sock: socket.socket, conn: TcpConnection, seq: int) -> None:
    sockid = _SOCKID.pack(
        conn.local_port, conn.remote_port, _raw(conn.family, conn.local_ip), _raw(conn.family, conn.remote_ip)
    ) + _SOCKID_TAIL.pack(conn.interface, conn.cookie)
    sock.send(_request(_SOCK_DESTROY, _NLM_F_REQUEST | _NLM_F_ACK, seq, conn.family, sockid))
    for msg_type, payload in _messages(sock):
        if msg_type != _NLMSG_ERROR:
            continue
        (code,) = struct.unpack_from("=i", payload)
        if code in (-errno.EPERM, -errno.EACCES, -errno.EOPNOTSUPP):
            raise _unavailable(f"SOCK_DESTROY refused: {os.strerror(-code)}")
        if code and code != -errno.ENOENT:  # ENOENT: it closed by itself meanwhile
            raise TransferError(f"SOCK_DESTROY of {conn.describe()} failed: {os.strerror(-code)}")


def _raw(family: int, ip: str) -> bytes:
    if family == socket.AF_INET:
        return socket.inet_pton(socket.AF_INET, ip) + bytes(12)
    if "." in ip and ":" not in ip:
        ip = "::ffff:" + ip  # the v4-mapped form _ip() shortened
    return socket.inet_pton(socket.AF_INET6, ip)


def cut_connections(
    remote: Collection[str], local_ports: Collection[int], *, timeout_s: float = 5.0
) -> CutReport:
    """Destroy every connection from ``remote`` to ``local_ports`` and wait until this process closed every
    one of them (their owners saw ECONNABORTED and closed the descriptors): only then can no byte already
    queued in them be copied into memory any more.

    Raises ``ConnectionCutUnavailableError`` when destroying is not possible here (nothing was cut), or
    ``TransferError`` when a destroyed socket is still open in this process after ``timeout_s`` (its owner
    may still read bytes queued in it: the cut proves nothing)."""
    started = time.monotonic()
    victims = connections_from(remote, local_ports)
    with _netlink() as sock:
        for seq, conn in enumerate(victims, start=2):
            _destroy(sock, conn, seq)
    inodes = {c.inode for c in victims if c.inode}  # 0: no descriptor (an orphan): nothing to read it
    deadline = started + timeout_s
    while True:
        left = [c for c in victims if c.inode in inodes & _own_inodes()]
        if not left:
            return CutReport(cut=tuple(victims), seconds=time.monotonic() - started)
        if time.monotonic() >= deadline:
            raise TransferError(
                f"{len(left)} destroyed connection(s) still open in this process after {timeout_s:g} s "
                "(bytes queued in them may still be read into memory): "
                + ", ".join(c.describe() for c in left[:4])
            )
        time.sleep(0.005)


def can_cut_connections() -> str | None:
    """None when ``cut_connections`` works here, else why not. A cheap probe: it destroys the accepted
    end of a loopback connection this process makes for the purpose."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            port = listener.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                accepted, _ = listener.accept()
                with accepted:
                    victims = connections_from({"127.0.0.1"}, {port})
                    if not victims:
                        return "sock_diag lists no socket of this process"
                    with _netlink() as sock:
                        _destroy(sock, victims[0], 1)
    except ConnectionCutUnavailableError as exc:
        return str(exc)
    except OSError as exc:
        return f"probe failed: {exc}"
    return None
