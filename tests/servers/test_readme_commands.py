"""The README's server blocks as the server tests run them, checked without starting anything.

Two routers on one machine (two CI jobs, or a user's second pair) once collided on the router's default
Prometheus port, 29000: the second router exited with "Address already in use" and its test failed
after minutes of server start-up. Every port a README command binds is one the harness picked free.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.servers import harness

BLOCKS = [
    ("sglang-serve", "bootstrap", "--disaggregation-mode"),
    ("vllm-serve", "registry", "--kv-transfer-config"),
]
ROUTER_DEFAULT_METRICS_PORT = 29000


def _value(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize(("marker", "side_port", "plain_from"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_every_port_a_router_binds_is_a_free_one(marker: str, side_port: str, plain_from: str) -> None:
    ports, commands = harness.readme_pair(marker, Path("/model"), side_port=side_port, plain_from=plain_from)
    router = commands["router"]
    assert _value(router, "--port") == str(ports["router"])
    assert _value(router, "--prometheus-port") == str(ports["metrics"]) != str(ROUTER_DEFAULT_METRICS_PORT)
    assert _value(router, "--prometheus-host") == "127.0.0.1"
    assert len(set(ports.values())) == len(ports)  # no two of them share a port


@pytest.mark.parametrize(("marker", "side_port", "plain_from"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_the_servers_bind_their_own_ports_on_loopback(marker: str, side_port: str, plain_from: str) -> None:
    ports, commands = harness.readme_pair(marker, Path("/model"), side_port=side_port, plain_from=plain_from)
    for name in ("plain", "prefill", "decode"):
        argv = commands[name]
        assert _value(argv, "--host") == "127.0.0.1", name
        assert _value(argv, "--port") == str(ports[name]), name
