"""One in-process rig for runtime tests: prefill CP ranks and decode TP ranks as real transports,
real zmq channels and registry on 127.0.0.1, one loopback fabric for the bytes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pdkv.engine.loopback import LoopbackBackend, LoopbackConfig, LoopbackFabric, LoopbackFaults
from pdkv.mapping import PageInterleaved
from pdkv.protocol.config import Timeouts
from pdkv.protocol.ids import InstanceId
from pdkv.protocol.messages import RankCoord
from pdkv.runtime import ExecutorConfig, PerLayerConfig
from pdkv.runtime.channels import start_registry
from pdkv.runtime.decode import DecodeConfig, DecodeTransport
from pdkv.runtime.prefill import PrefillConfig, PrefillTransport
from pdkv.testing.synthetic import Capacity, ModelSpec, RankMemory

TIMEOUTS = Timeouts(bootstrap=20, waiting=20, inflight=20, transfer=20, abort_ack=5, register_retry=0.2)
SPEC = ModelSpec(layers=3, page_size=16, state_layers=(1,), draft_layers=1)
PREFILL_PAGES = 64
DECODE_PAGES = 256


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


class Rig:
    """Built stopped; ``start()`` starts every transport and connects the decode ranks."""

    def __init__(
        self,
        *,
        spec: ModelSpec = SPEC,
        decode_spec: ModelSpec | None = None,
        cp: int = 1,
        decode_tp: int = 1,
        finish_timeout_s: float = 20.0,
        faults: LoopbackFaults | None = None,
        executor: ExecutorConfig | None = None,
        loopback_workers: int = 4,
    ) -> None:
        self.spec = spec
        self.fabric = LoopbackFabric("rig")
        self.policy = PageInterleaved(cp_size=cp)
        self.prefill_instance = InstanceId("p")
        self.registry = start_registry(instance=self.prefill_instance, tp_size=1, cp_size=cp)
        self.prefill_memory: list[RankMemory] = []
        self.prefill_backends: list[LoopbackBackend] = []
        self.prefills: list[PrefillTransport] = []
        loopback = LoopbackConfig(faults=faults or LoopbackFaults(), worker_threads=loopback_workers)
        for rank in range(cp):
            memory = RankMemory(spec, Capacity(kv_pages=PREFILL_PAGES, state_slots=8, aux_rows=8))
            memory.fill_prefill(cp_rank=rank, policy=self.policy)
            backend = LoopbackBackend(loopback, fabric=self.fabric)
            config = PrefillConfig(
                instance=self.prefill_instance,
                rank=RankCoord(tp=0, cp=rank),
                tp_size=1,
                cp_size=cp,
                layout=memory.layout,
                registry=self.registry.address,
                timeouts=TIMEOUTS,
                per_layer=PerLayerConfig(finish_timeout_s=finish_timeout_s),
                executor=executor if executor is not None else ExecutorConfig.from_env(),
            )
            self.prefill_memory.append(memory)
            self.prefill_backends.append(backend)
            self.prefills.append(PrefillTransport(config, backend))
        self.decode_memory: list[RankMemory] = []
        self.decode_backends: list[LoopbackBackend] = []
        self.decodes: list[DecodeTransport] = []
        for tp in range(decode_tp):
            memory = RankMemory(
                decode_spec or spec, Capacity(kv_pages=DECODE_PAGES, state_slots=8, aux_rows=8)
            )
            backend = LoopbackBackend(fabric=self.fabric)
            config_d = DecodeConfig(
                instance=InstanceId("d"),
                rank=RankCoord(tp=tp),
                tp_size=decode_tp,
                layout=memory.layout,
                timeouts=TIMEOUTS,
            )
            self.decode_memory.append(memory)
            self.decode_backends.append(backend)
            self.decodes.append(DecodeTransport(config_d, backend))

    @property
    def decode(self) -> DecodeTransport:
        return self.decodes[0]

    def start(self) -> InstanceId:
        for p in self.prefills:
            p.start()
        for d in self.decodes:
            d.start()
            assert d.connect(self.registry.address, timeout_s=20) == self.prefill_instance
        return self.prefill_instance

    def start_registered(self) -> InstanceId:
        instance = self.start()
        for d in self.decodes:
            assert d.wait_registered(instance, timeout_s=20)
        return instance

    def bytes_sent(self) -> int:
        return sum(b.statistics().bytes_completed for b in self.prefill_backends)

    def batches_in_flight(self) -> int:
        return sum(b.statistics().batches_in_flight for b in self.prefill_backends)

    def batches_submitted(self) -> int:
        return sum(b.statistics().batches_submitted for b in self.prefill_backends)

    def close(self) -> None:
        # Decode ranks first: their open rooms are aborted and acknowledged by live prefill ranks
        # (the other order would leave each waiting out the abort-ack timeout).
        for d in self.decodes:
            d.close()
        for p in self.prefills:
            p.close()
        for b in [*self.prefill_backends, *self.decode_backends]:
            b.close()
        self.registry.stop()


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
