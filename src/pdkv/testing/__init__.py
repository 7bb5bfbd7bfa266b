"""pdkv.testing: fakes shipped with the library so embedders test against the same harness.

- ``endpoint_pair``: ``FakeClock``, ``FaultyLink`` (drop, duplicate, delay, reorder) and
  ``EndpointPair`` (prefill endpoints and a decode endpoint wired through it, with abort-safety checks);
- ``backend_conformance``: the suite every ``TransferBackend`` must pass.

Must not be imported by library code below it (runtime, protocol, ...).
"""

from pdkv.testing.endpoint_pair import (
    ClosedRoom,
    EndpointPair,
    FakeClock,
    FaultyLink,
    LinkFaults,
    LinkStatistics,
    RoomPlan,
    SafetyViolation,
    default_layout,
)

__all__ = [
    "ClosedRoom",
    "EndpointPair",
    "FakeClock",
    "FaultyLink",
    "LinkFaults",
    "LinkStatistics",
    "RoomPlan",
    "SafetyViolation",
    "default_layout",
]
