"""A real prefill/decode cluster on 127.0.0.1: one process per rank, real transports, real engine.

Owns: ``ClusterSpec`` / ``RequestPlan`` (what to run), ``Cluster`` (starts the bootstrap registry in
this process and one process per prefill rank (TP x CP) and per decode rank, feeds them requests,
collects per-room outcomes, stops everything it started, by pid, with timeouts, even on failure),
and the rank processes' simple schedulers. The integration tests and ``pdkv demo`` both run on it.

Each rank builds its buffers with ``pdkv.testing.synthetic``; prefill ranks fill them from the
content rule, run a simulated forward per chunk (``simulate_forward``: a configurable compute time
per layer; with ``forward_writes_kv`` the chunk's pages are zeroed first and each layer's KV is
written as its layer ends), and send each chunk either whole after the forward or layer by layer
during it (``per_layer``: registered with the transport's ``PerLayerTransferManager`` before the
forward, ``on_layer_end`` after each layer); decode ranks verify every successful room byte for
byte against the same rule, keep the prefix positions (already on the decode side) untouched, and
after an aborted room's safe release write a canary into its pages, checked at shutdown: a late
write would break it.

Rank consensus (``ClusterSpec.consensus``, on by default): the prefill ranks of the instance (all
TP x CP) form a gloo group; each scheduler iteration agrees on how many rooms every rank has received
and MIN-reduces the polls of those rooms in one collective, so one Failed rank fails the room on every
rank (the others abort it), and a room leaves every rank's list in the same iteration. A collective
that fails (a dead rank; gloo's timeout is ``consensus_timeout_s``) fails every room of the rank, which
then goes on alone. Decode TP ranks do not run consensus: each decode rank's room already waits for
every prefill status it needs. Faults (``pdkv.testing.faults``) are applied per rank from
``ClusterSpec.faults``; ``Cluster.kill`` and ``Cluster.restart`` stop a rank process (SIGKILL) and
start it again behind the same control address (``stable_addresses``).
"""

from pdkv.testing.cluster.process import Cluster, TimedAction
from pdkv.testing.cluster.spec import (
    AbortPlan,
    ClusterError,
    ClusterSpec,
    RankReport,
    RequestPlan,
    RoomOutcome,
    free_port,
    plan_requests,
)

__all__ = [
    "AbortPlan",
    "Cluster",
    "ClusterError",
    "ClusterSpec",
    "RankReport",
    "RequestPlan",
    "RoomOutcome",
    "TimedAction",
    "free_port",
    "plan_requests",
]
