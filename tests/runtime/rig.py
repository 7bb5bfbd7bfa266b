"""One in-process rig for runtime tests: prefill CP ranks and decode TP ranks as real transports,
real control channels (the transports' default kind) and registry on 127.0.0.1, one loopback fabric
for the bytes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest

from pdkv.control.bootstrap import RegistryService
from pdkv.engine.loopback import LoopbackConfig, LoopbackFaults
from pdkv.mapping import DEFAULT_LAYOUT_POLICY, LayoutPolicy
from pdkv.protocol.config import Timeouts
from pdkv.protocol.ids import InstanceId
from pdkv.protocol.messages import Message
from pdkv.runtime import ExecutorConfig, PerLayerConfig
from pdkv.runtime.landing import LandingConfig
from pdkv.runtime.staging import StagingConfig
from pdkv.testing.faults import ChannelFaults
from pdkv.testing.synthetic import Capacity, ModelSpec
from pdkv.testing.transport_pair import TransportPair

TIMEOUTS = Timeouts(
    bootstrap=20, waiting=20, inflight=20, transfer=20, abort_ack=5, register_retry=0.2, quarantine_settle=0.5
)
SPEC = ModelSpec(layers=3, page_size=16, state_layers=(1,), draft_layers=1)
PREFILL_PAGES = 64
DECODE_PAGES = 256


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


class Rig(TransportPair):
    """A ``TransportPair`` on real sockets (127.0.0.1, a registry thread), built stopped:
    ``start()`` starts every transport and connects the decode ranks, ``start_registered()`` also
    waits for their registration."""

    def __init__(
        self,
        *,
        spec: ModelSpec = SPEC,
        decode_spec: ModelSpec | None = None,
        cp: int = 1,
        decode_tp: int = 1,
        prefill_tp: int = 1,
        landing: LandingConfig | None = None,
        finish_timeout_s: float = 20.0,
        faults: LoopbackFaults | None = None,
        executor: ExecutorConfig | None = None,
        loopback_workers: int = 4,
        fan_out_min_layer_bytes: int | None = None,
        staging: StagingConfig | None = None,
        prefill_policy: LayoutPolicy = DEFAULT_LAYOUT_POLICY,
        decode_policy: LayoutPolicy = DEFAULT_LAYOUT_POLICY,
        kv_checksum: bool = False,
        decode_channel_faults: ChannelFaults | None = None,
        timeouts: Timeouts = TIMEOUTS,
    ) -> None:
        per_layer = PerLayerConfig(finish_timeout_s=finish_timeout_s)
        if fan_out_min_layer_bytes is not None:
            per_layer = attrs.evolve(per_layer, fan_out_min_layer_bytes=fan_out_min_layer_bytes)
        super().__init__(
            model=spec,
            decode_model=decode_spec,
            cp=cp,
            decode_tp=decode_tp,
            prefill_tp=prefill_tp,
            landing=landing,
            prefill_capacity=Capacity(kv_pages=PREFILL_PAGES, state_slots=8, aux_rows=8),
            decode_capacity=Capacity(kv_pages=DECODE_PAGES, state_slots=8, aux_rows=8),
            timeouts=timeouts,
            executor=executor if executor is not None else ExecutorConfig.from_env(),
            per_layer=per_layer,
            loopback=LoopbackConfig(
                faults=faults or LoopbackFaults(), worker_threads=loopback_workers, announced_regions=True
            ),
            prefill_instance="p",
            decode_instance="d",
            sockets=True,
            fabric="rig",
            staging=staging,
            prefill_policy=prefill_policy,
            decode_policy=decode_policy,
            kv_checksum=kv_checksum,
            decode_channel_faults=decode_channel_faults,
        )
        self.spec = spec

    @property
    def registry(self) -> RegistryService[Message]:
        """The bootstrap registry thread (its ``address``, its ``statistics()``)."""
        assert self._registry_service is not None  # sockets=True
        return self._registry_service

    def start(self, *, timeout_s: float = 20.0, wait_registered: bool = False) -> InstanceId:
        return super().start(timeout_s=timeout_s, wait_registered=wait_registered)

    def start_registered(self) -> InstanceId:
        return super().start(wait_registered=True)

    def bytes_sent(self) -> int:
        return sum(b.statistics().bytes_completed for b in self.prefill_backends)

    def batches_in_flight(self) -> int:
        return sum(b.statistics().batches_in_flight for b in self.prefill_backends)

    def batches_submitted(self) -> int:
        return sum(b.statistics().batches_submitted for b in self.prefill_backends)


@pytest.fixture
def rig_factory() -> Iterator[Callable[..., Rig]]:
    """``rig_factory(**kw)`` builds a Rig; every rig made is closed after the test, even on failure."""
    made: list[Rig] = []

    def make(**kw: Any) -> Rig:
        rig = Rig(**kw)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()
