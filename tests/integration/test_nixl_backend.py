"""The conformance suite against real NIXL: this process sends, a spawned process receives, over both
UCX transports this machine has (the default, which writes with cma and notifies over tcp, and tcp
alone). One child serves every case of a transport; it is stopped with time limits when its module
scope ends, pass or fail.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdkv.engine import NixlConfig
from pdkv.testing.backend_conformance import CASES, BackendPair, ConformanceCase, nixl_pair, run_case

pytestmark = pytest.mark.slow

# "all" is UCX's own default; it is written out so that a module that ran with tcp leaves no trace.
TRANSPORTS = {"default": "all", "tcp": "tcp"}


@pytest.fixture(scope="module", params=sorted(TRANSPORTS))
def pair(request: pytest.FixtureRequest) -> Iterator[BackendPair]:
    config = NixlConfig(ucx_tls=TRANSPORTS[request.param], ucx_net_devices="lo", log_level="ERROR")
    with nixl_pair(config) as backends:
        yield backends


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_nixl_conforms(pair: BackendPair, case: ConformanceCase) -> None:
    run_case(pair, case)
