"""The conformance suite against real Mooncake: this process sends, a spawned process receives (TCP).

One child process serves every case (starting an engine costs about a second); it is stopped with
time limits when the module ends, pass or fail.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdkv.engine import MooncakeConfig
from pdkv.testing.backend_conformance import CASES, BackendPair, ConformanceCase, mooncake_pair, run_case

pytestmark = pytest.mark.slow

# Errors are worth seeing in a failing test's captured stderr; the engine's warnings are not.
CONFIG = MooncakeConfig(log_level="ERROR")


@pytest.fixture(scope="module")
def pair() -> Iterator[BackendPair]:
    with mooncake_pair(CONFIG) as backends:
        yield backends


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_mooncake_conforms(pair: BackendPair, case: ConformanceCase) -> None:
    run_case(pair, case)
