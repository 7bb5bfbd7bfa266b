"""The shipped conformance suite, run against the loopback backend (in process): reaching a peer by
its session id alone, and reaching it only inside the regions its engine metadata announced (the mode
the transports' tests run in, as NIXL's rule)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdkv.engine.loopback import LoopbackConfig
from pdkv.testing.backend_conformance import CASES, BackendPair, ConformanceCase, loopback_pair, run_case


@pytest.fixture(scope="module", params=[False, True], ids=["by-session", "announced-regions"])
def pair(request: pytest.FixtureRequest) -> Iterator[BackendPair]:
    with loopback_pair(LoopbackConfig(announced_regions=request.param)) as backends:
        yield backends


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_loopback_conforms(pair: BackendPair, case: ConformanceCase) -> None:
    run_case(pair, case)
