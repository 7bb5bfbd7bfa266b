"""The staging gather and the landing scatter on CUDA tensors, where a GPU is (skipped without one; CI has
none): the same plans as on the CPU, the copies on the device, compared byte for byte with the CPU
result. The engine is not involved (the loopback backend only registers the staging tensor)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdkv.engine import LoopbackBackend
from pdkv.mapping import AttentionKind, BufferKind, BufferLayout, BufferSpec, ModelRole, TransferBlocks
from pdkv.mapping.landing import ScatterPlan
from pdkv.runtime.staging import LandingRegions, StagingConfig, StagingPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SLICE, STRIDE, COUNT = 512, 1024, 4096  # a head slice of every token: strided by 2 at the source


def layout_of(tensor: torch.Tensor) -> BufferLayout:
    return BufferLayout.build(
        attention=AttentionKind.MHA,
        page_size=1,
        buffers=[
            BufferSpec(
                kind=BufferKind.K,
                model=ModelRole.TARGET,
                layer_id=0,
                base_ptr=tensor.data_ptr(),
                length=tensor.numel() * tensor.element_size(),
                item_bytes=STRIDE,
            )
        ],
    )


def test_the_gather_runs_on_the_device_and_matches_the_cpu() -> None:
    host = torch.randint(0, 256, (COUNT * STRIDE,), dtype=torch.uint8)
    device = host.cuda()
    backend = LoopbackBackend()
    try:
        results = []
        for source in (host, device):
            pool = StagingPool(
                backend,
                layout_of(source),
                [source],
                StagingConfig(capacity_bytes=COUNT * SLICE, piece_bytes=COUNT * SLICE),
            )
            assert pool.device == source.device
            i = np.arange(COUNT, dtype=np.int64)
            blocks = TransferBlocks(  # to contiguous peer bytes: one staged block
                src=source.data_ptr() + i * STRIDE,
                dst=(1 << 40) + i * SLICE,
                length=np.full(COUNT, SLICE),
                buffer=np.zeros(COUNT, dtype=np.int64),
            )
            pieces = pool.plan(blocks)
            assert pieces is not None
            (piece,) = list(pieces)
            lease = pool.acquire_nowait("peer", piece.nbytes)
            assert lease is not None
            staged = pool.gather(piece, lease)  # synchronised before it returns
            assert len(staged) == 1
            results.append(pool._tensor[: piece.nbytes].cpu().clone())
            pool.seal(lease)
            pool.close()
        expected = host.view(COUNT, STRIDE)[:, :SLICE].reshape(-1)
        assert torch.equal(results[0], expected) and torch.equal(results[1], expected)
    finally:
        backend.close()


def test_the_scatter_runs_on_the_device_and_matches_the_cpu() -> None:
    rows = COUNT
    landing_host = torch.randint(0, 256, (rows * SLICE,), dtype=torch.uint8)
    outputs = []
    for device in ("cpu", "cuda"):
        pages = torch.zeros(rows * STRIDE, dtype=torch.uint8, device=device)
        landing = landing_host.to(device)
        targets = LandingRegions(layout_of(pages), [pages])
        plan = ScatterPlan(
            region=[0],
            element_bytes=[SLICE],
            first=[0],
            count=[rows],
            landing_address=[landing.data_ptr()],
            index=np.arange(rows, dtype=np.int64) * (STRIDE // SLICE) + 1,  # the second half of each row
        )
        targets.scatter(plan, landing)
        outputs.append(pages.cpu())
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(outputs[0].view(rows, STRIDE)[:, SLICE:].reshape(-1), landing_host)
