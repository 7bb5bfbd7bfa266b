"""The CUDA paths, run where a GPU is: skipped on a machine without one (CI has none).

- Per-layer ready events: each layer's KV reaches the prefill's pages by an asynchronous GPU copy
  that starts only after a GPU sleep; the forward reports the layer with the copy's CUDA event at
  once. Sent before the event completed, the layer would land as the zeros the pages held: the
  decode's byte check says whether pdkv waited.
- CUDA tensors as KV on both sides of a real Mooncake engine (its CUDA build), TCP on 127.0.0.1
  between two processes: registration of device memory, a monolithic room and a per-layer room
  with CUDA ready events, compared byte for byte on the host.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
import torch

from pdkv.engine.mooncake import MooncakeBackend, MooncakeConfig
from pdkv.mapping.layout import AttentionKind, BufferKind, BufferLayout, ModelRole
from pdkv.protocol.ids import InstanceId, RoomId
from pdkv.protocol.messages import RankCoord
from pdkv.protocol.poll import KVPoll
from pdkv.runtime import PerLayerConfig
from pdkv.runtime.channels import Registry
from pdkv.runtime.decode import DecodeConfig, DecodeTransport
from pdkv.runtime.per_layer import PerLayerMode
from pdkv.runtime.prefill import PrefillConfig, PrefillTransport
from pdkv.testing import TransportPair
from pdkv.testing.synthetic import Capacity, ModelSpec, forward_layers
from tests.runtime.rig import wait_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# About 0.2 s of GPU time at the H200's ~2 GHz: long enough that a layer reported at once is
# certainly not written yet when pdkv first looks at it.
SLEEP_CYCLES = 400_000_000


@contextlib.contextmanager
def host_registered(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Page-lock CPU tensors in place (cudaHostRegister), so GPU copies into them are asynchronous."""
    cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    for tensor in tensors:
        rc = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
        assert int(rc) == 0, f"cudaHostRegister returned {rc}"
    try:
        yield
    finally:
        torch.cuda.synchronize()
        for tensor in tensors:
            cudart.cudaHostUnregister(tensor.data_ptr())


def late_copy(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> torch.cuda.Event:
    """Copy ``src`` (GPU) into ``dst`` after a GPU sleep, on ``stream``; the event completes the copy."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        event.record(stream)
    return event


def done(event: torch.cuda.Event) -> bool:
    return bool(event.query())  # type: ignore[no-untyped-call]  # torch leaves it unannotated


@pytest.mark.parametrize("planted", [False, True], ids=["pdkv", "planted-no-wait"])
def test_per_layer_waits_for_each_layers_cuda_event(planted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``planted``, the per-layer lane submits without waiting for the ready event (a planted
    bug): the room still succeeds, and the byte check must then see the zeros."""
    if planted:
        monkeypatch.setattr("pdkv.runtime.per_layer._wait_ready", lambda ready, timeout_s: True)
    spec = ModelSpec(layers=3, page_size=16, draft_layers=1)
    pages = np.arange(4, 12, dtype=np.int64)  # contiguous: one asynchronous copy per buffer
    with TransportPair(
        model=spec,
        prefill_capacity=Capacity(kv_pages=32, state_slots=8, aux_rows=8),
        per_layer=PerLayerConfig(finish_timeout_s=30.0),
    ) as pair:
        memory = pair.prefill_memory[0]
        prefill = pair.start()
        with host_registered(list(memory.tensors.values())):
            truth = {key: memory.tensors[key][4:12].cuda() for key in spec.kv_keys()}
            memory.clear_pages(pages)
            room = RoomId(7)
            receiver = pair.decode.receiver(room, prefill)
            receiver.init(np.arange(40, 48, dtype=np.int64), None)
            sender = pair.prefills[0].sender(room)
            sender.init(len(pages), None)
            wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
            transport = pair.prefills[0]
            assert transport.per_layer.register(room, pages, start_token=0) is PerLayerMode.PER_LAYER
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            events = []
            for model, layer in forward_layers(spec):
                key = next(k for k in spec.kv_keys() if k[0] is model and k[2] == layer)
                event = late_copy(memory.tensors[key][4:12], truth[key], stream)
                transport.per_layer.on_layer_end(layer, ready=event, model=model)
                events.append(event)
            # The scenario is real: no layer was written when the forward reported them all.
            assert not done(events[0])
            sender.send(pages, start_token=0, last=True)
            wait_for(lambda: receiver.poll() is KVPoll.Success)
            # Success came only after every layer's copy ended (unless the wait was planted away).
            assert all(done(event) for event in events) is not planted
            torch.cuda.synchronize()
            decoded = pair.decode_memory[0]
            equal = [torch.equal(decoded.tensors[key][40:48], want.cpu()) for key, want in truth.items()]
            assert equal == [not planted] * len(truth)


# ------------------------------------------------------------------- Mooncake with CUDA memory

LAYERS = 3
PAGE = 16
ITEM = 4096  # bytes per page and layer
PREFILL_PAGES = 32
DECODE_PAGES = 64


def _cuda_layout(pages: int) -> tuple[BufferLayout, list[torch.Tensor]]:
    kv = [torch.zeros((pages, ITEM), dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
    layout = BufferLayout.from_tensors(
        attention=AttentionKind.MLA,
        page_size=PAGE,
        tensors=[(BufferKind.KV, ModelRole.TARGET, i, kv[i], ITEM) for i in range(LAYERS)],
    )
    return layout, kv


def _decode_process(registry: str, conn: Connection) -> None:
    """The decode rank: CUDA KV, a real Mooncake engine; opens each room it is sent, answers its bytes."""
    layout, kv = _cuda_layout(DECODE_PAGES)
    decode = DecodeTransport(
        DecodeConfig(instance=InstanceId("decode-cuda"), rank=RankCoord(tp=0), tp_size=1, layout=layout),
        MooncakeBackend(MooncakeConfig(log_level="ERROR")),
    )
    try:
        decode.start()
        prefill = decode.connect(registry, timeout_s=60)
        assert decode.wait_registered(prefill, timeout_s=60)
        conn.send("ready")
        while (order := conn.recv()) is not None:
            room, dst = RoomId(order[0]), np.asarray(order[1], dtype=np.int64)
            receiver = decode.receiver(room, prefill)
            receiver.init(dst, None)
            deadline = time.monotonic() + 60
            while receiver.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
                time.sleep(0.005)
            got = [kv[i][torch.from_numpy(dst).cuda()].cpu().numpy() for i in range(LAYERS)]
            conn.send((receiver.poll().name, str(receiver.failure()), got))
    finally:
        decode.close()


@pytest.fixture
def cuda_mooncake() -> Iterator[tuple[PrefillTransport, list[torch.Tensor], Connection]]:
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("Mooncake is not installed")
    context = multiprocessing.get_context("spawn")
    with Registry(InstanceId("prefill-cuda")) as registry:
        layout, kv = _cuda_layout(PREFILL_PAGES)
        generator = torch.Generator(device="cuda").manual_seed(5)
        for tensor in kv:
            tensor.copy_(torch.randint(0, 256, tensor.shape, generator=generator, device="cuda"))
        prefill = PrefillTransport(
            PrefillConfig(
                instance=InstanceId("prefill-cuda"),
                rank=RankCoord(tp=0, cp=0),
                tp_size=1,
                cp_size=1,
                layout=layout,
                registry=registry.address,
                per_layer=PerLayerConfig(finish_timeout_s=30.0),
            ),
            MooncakeBackend(MooncakeConfig(log_level="ERROR")),
        )
        conn, child = context.Pipe()
        process = context.Process(target=_decode_process, args=(registry.address, child), daemon=True)
        try:
            prefill.start()
            process.start()
            assert conn.poll(120), "the decode process did not start"
            assert conn.recv() == "ready"
            yield prefill, kv, conn
        finally:
            with contextlib.suppress(OSError):
                conn.send(None)
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join(10)
            prefill.close()


def _landed(conn: Connection, room: int, dst: list[int]) -> list[np.ndarray[Any, np.dtype[np.uint8]]]:
    assert conn.poll(90), f"room {room}: no answer from the decode"
    poll, failure, got = conn.recv()
    assert poll == "Success", f"room {room}: {poll} ({failure})"
    return list(got)


def test_mooncake_moves_cuda_kv_monolithic_and_per_layer(
    cuda_mooncake: tuple[PrefillTransport, list[torch.Tensor], Connection],
) -> None:
    prefill, kv, conn = cuda_mooncake
    # A monolithic room: pages written before send().
    pages = np.array([3, 4, 5, 9, 10, 17, 30, 31], dtype=np.int64)
    dst = [40, 41, 42, 7, 8, 60, 12, 13]
    conn.send((1, dst))
    sender = prefill.sender(RoomId(1))
    sender.init(len(pages), None)
    wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    torch.cuda.synchronize()
    sender.send(pages, start_token=0, last=True)
    got = _landed(conn, 1, dst)
    for i in range(LAYERS):
        assert np.array_equal(got[i], kv[i][torch.from_numpy(pages).cuda()].cpu().numpy()), f"layer {i}"
    wait_for(lambda: sender.poll() is KVPoll.Success)

    # A per-layer room: each layer's pages written on the GPU after a sleep, reported at once.
    pages = np.arange(16, 24, dtype=np.int64)
    dst = list(range(20, 28))
    truth = [tensor[16:24].clone() for tensor in kv]
    for tensor in kv:
        tensor[16:24] = 0
    torch.cuda.synchronize()
    conn.send((2, dst))
    sender = prefill.sender(RoomId(2))
    sender.init(len(pages), None)
    wait_for(lambda: sender.poll() is KVPoll.WaitingForInput)
    assert prefill.per_layer.register(RoomId(2), pages, start_token=0) is PerLayerMode.PER_LAYER
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    events = [late_copy(kv[i][16:24], truth[i], stream) for i in range(LAYERS)]
    for i, event in enumerate(events):
        prefill.per_layer.on_layer_end(i, ready=event)
    assert not done(events[0])
    sender.send(pages, start_token=0, last=True)
    got = _landed(conn, 2, dst)
    for i in range(LAYERS):
        assert np.array_equal(got[i], truth[i].cpu().numpy()), f"per-layer room, layer {i}"
    wait_for(lambda: sender.poll() is KVPoll.Success)
    assert prefill.per_layer.statistics().layers_submitted >= LAYERS
