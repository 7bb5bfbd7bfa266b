"""pdkv.testing: fakes shipped with the library so embedders test against the same harness.

- ``endpoint_pair``: ``FakeClock``, ``FaultyLink`` (drop, duplicate, delay, reorder) and
  ``EndpointPair`` (prefill endpoints and a decode endpoint wired through it, with abort-safety checks);
- ``backend_conformance``: the suite every ``TransferBackend`` must pass;
- ``faults``: fault-injecting control channel and transfer backend wrappers (``FaultyChannel``,
  ``FaultyBackend``), frame-level attacks, and network namespaces joined by veth (``veth_namespaces``)
  for partitions, used by ``pdkv.testing.cluster`` rank processes;
- ``transport_pair``: ``TransportPair``, the real prefill and decode transports wired through in-memory
  channels, an in-memory registry and the loopback engine (no ports, no sleeps): what an embedder
  tests its scheduler against.

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
    NetnsLayout,
    RankFaults,
    veth_namespaces,
)
from pdkv.testing.transport_pair import MemoryHub, TransportPair

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
    "MemoryHub",
    "MessageRule",
    "NetnsLayout",
    "RankFaults",
    "RoomPlan",
    "SafetyViolation",
    "TransportPair",
    "default_layout",
    "veth_namespaces",
]
