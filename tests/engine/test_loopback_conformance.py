"""The shipped conformance suite, run against the loopback backend (in process)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdkv.testing.backend_conformance import CASES, BackendPair, ConformanceCase, loopback_pair, run_case


@pytest.fixture(scope="module")
def pair() -> Iterator[BackendPair]:
    with loopback_pair() as backends:
        yield backends


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_loopback_conforms(pair: BackendPair, case: ConformanceCase) -> None:
    run_case(pair, case)
