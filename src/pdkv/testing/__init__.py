"""pdkv.testing: fakes shipped with the library so embedders test against the same harness.

- ``endpoint_pair``: ``FakeClock``, ``FaultyLink`` (drop, duplicate, delay, reorder) and
  ``EndpointPair`` (prefill endpoints and a decode endpoint wired through it, with abort-safety checks);
- ``backend_conformance``: the suite every ``TransferBackend`` must pass;
- ``faults``: fault-injecting control channel and transfer backend wrappers (``FaultyChannel``,
  ``FaultyBackend``) and frame-level attacks, used by ``pdkv.testing.cluster`` rank processes.

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
from pdkv.testing.faults import (
    BackendFaults,
    ChannelFaults,
    FaultyBackend,
    FaultyChannel,
    MessageRule,
    RankFaults,
)

__all__ = [
    "BackendFaults",
    "ChannelFaults",
    "ClosedRoom",
    "EndpointPair",
    "FakeClock",
    "FaultyBackend",
    "FaultyChannel",
    "FaultyLink",
    "LinkFaults",
    "LinkStatistics",
    "MessageRule",
    "RankFaults",
    "RoomPlan",
    "SafetyViolation",
    "default_layout",
]
