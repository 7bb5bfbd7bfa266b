"""The staged path through real transports (zmq on 127.0.0.1, loopback bytes): MHA/GQA heads from the one
prefill TP rank (all heads) to decode TP ranks holding a share each, gathered into each prefill rank's
staging pool, land byte for byte (the content rule of ``pdkv.testing.synthetic``), monolithic and per
layer, with CP shared KV; GQA replicas (whole pages) go unstaged; every lease is back afterwards.
A control corrupts the gather and must be caught by the same check."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import pytest

from pdkv.engine.loopback import LoopbackFaults
from pdkv.mapping import AttentionKind
from pdkv.mapping.staging import StagedPiece
from pdkv.protocol.poll import KVPoll
from pdkv.runtime.decode import KVReceiver
from pdkv.runtime.per_layer import PerLayerMode
from pdkv.runtime.staging import StagingConfig
from pdkv.testing.synthetic import ModelSpec
from tests.runtime.rig import PREFILL_PAGES, Rig, wait_for
from tests.runtime.test_per_layer import Room, expected_bytes, run_request, started

# 4 KV heads of 8 bytes: the prefill TP rank holds all 4, decode rank d of TP 2 heads 2d, 2d + 1, so a
# prefill page is 16 token slices of 16 bytes for each decode rank (strided here, whole pages there).
HEADS4 = ModelSpec(
    attention=AttentionKind.MHA,
    layers=2,
    page_size=16,
    kv_bytes_per_token=4 * 8,
    kv_heads=4,
    state_layers=(0,),
    draft_layers=1,
)
# 1 KV head held by every rank (GQA replicas): whole pages on both sides, nothing to stage.
HEADS1 = attrs.evolve(HEADS4, kv_bytes_per_token=8, kv_heads=1)
# Small pieces: a chunk of a few pages is several pieces; a pool of 4 pieces makes pieces wait.
STAGING = StagingConfig(capacity_bytes=16 << 10, piece_bytes=4 << 10)


def request(rig: Rig, room: int, *, per_layer: bool) -> Room:
    rng = np.random.default_rng(room)
    cp = len(rig.prefills)
    scattered = rng.choice(np.arange(8, PREFILL_PAGES * cp), size=10, replace=False)
    logical = np.concatenate([np.arange(8), scattered]).astype(np.int64)
    dst = rng.choice(np.arange(40, 200), size=18, replace=False).astype(np.int64)
    dst[2:9] = np.arange(20, 27)  # a run of destination pages: staged pages merge into one block
    handle = Room(rig, room, logical, dst, slots=room % 4, aux=room % 8, prefix_pages=2)
    modes = run_request(rig, handle, [5, 6, 5], prefix_pages=2, resident_pages=1, per_layer=per_layer)
    if per_layer:
        assert all(m is PerLayerMode.PER_LAYER for chunk in modes for m in chunk)
    return handle


@pytest.mark.parametrize(
    ("cp", "per_layer"), [(1, False), (2, False), (2, True)], ids=["cp1", "cp2", "cp2-per-layer"]
)
def test_staged_head_slices_land_byte_for_byte(
    rig_factory: Callable[..., Rig], cp: int, per_layer: bool
) -> None:
    rig = started(rig_factory, spec=HEADS4, cp=cp, decode_tp=2, staging=STAGING, fan_out_min_layer_bytes=1)
    for room in (1, 2):
        request(rig, room, per_layer=per_layer).verify(prefix_pages=2)
    stats = [pool.statistics() for pool in rig.staging]
    assert all(s.staged_writes > 0 and s.entries_saved > 0 for s in stats)
    assert all(s.in_use_bytes == 0 and s.quarantined_bytes == 0 for s in stats)
    assert all(s.released_unproven == 0 for s in stats)
    # Exactly the bytes of the content rule, each once: KV of 16 pages to each of 2 decode ranks,
    # which hold half the heads (half the item) each, plus the extras to each.
    per_rank = expected_bytes(HEADS4, 16, 2) - 16 * HEADS4.kv_item_bytes * 2 * 3 // 2
    assert rig.bytes_sent() == 2 * 2 * per_rank  # 2 rooms x 2 decode ranks


def test_gqa_replicas_move_whole_pages_unstaged(rig_factory: Callable[..., Rig]) -> None:
    rig = started(rig_factory, spec=HEADS1, decode_tp=2, staging=STAGING)
    request(rig, 3, per_layer=False).verify(prefix_pages=2)
    (stats,) = [pool.statistics() for pool in rig.staging]
    assert stats.staged_writes == 0 and stats.direct_writes > 0


def test_a_wrong_gather_is_caught_by_the_byte_check(
    rig_factory: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The control: every gather group copies its first two elements swapped (right bytes, wrong place).
    from pdkv.mapping.staging import plan_piece as planned

    def shifted(*args: object, **kwargs: object) -> StagedPiece:
        piece = planned(*args, **kwargs)  # type: ignore[arg-type]  # passed through unchanged
        index = piece.gather.index.copy()
        for first, count in zip(piece.gather.first.tolist(), piece.gather.count.tolist(), strict=True):
            if count > 1:
                index[[first, first + 1]] = index[[first + 1, first]]
        gather = attrs.evolve(piece.gather, index=index)
        return attrs.evolve(piece, gather=gather)

    monkeypatch.setattr("pdkv.runtime.staging.plan_piece", shifted)
    rig = started(rig_factory, spec=HEADS4, decode_tp=2, staging=STAGING)
    handle = request(rig, 4, per_layer=False)
    with pytest.raises(AssertionError):
        handle.verify(prefix_pages=2)


def failed_and_released(receivers: list[KVReceiver]) -> None:
    wait_for(lambda: all(r.poll() is KVPoll.Failed for r in receivers), timeout=30)
    wait_for(lambda: all(r.release_ready() for r in receivers), timeout=30)


def test_staging_comes_back_after_an_abort_and_after_a_failed_write(rig_factory: Callable[..., Rig]) -> None:
    """Every room returns its staging: one aborted while its staged writes are in flight (they end, then
    their leases come back), one whose staged write failed (its lease stays quarantined until the fence
    the AbortAck waits for completes to the same decode rank: the peer's drain point)."""
    rig = started(
        rig_factory,
        spec=HEADS4,
        decode_tp=2,
        staging=STAGING,
        faults=LoopbackFaults(delay_seconds=0.3),
    )
    pool = rig.staging[0]
    backend = rig.prefill_backends[0]
    for room in (5, 6):
        rng = np.random.default_rng(room)
        logical = rng.choice(PREFILL_PAGES, size=12, replace=False).astype(np.int64)
        handle = Room(rig, room, logical, np.arange(12, dtype=np.int64) + 20 * room, slots=0, aux=room)
        if room == 6:  # the room's first batch fails
            failing = backend.statistics().batches_submitted + 1
            backend.set_faults(LoopbackFaults(delay_seconds=0.3, fail_batches={failing}))
        handle.send(logical, 0, last=True)
        if room == 5:
            wait_for(lambda: rig.batches_in_flight() > 0)
            handle.senders[0].abort("scheduler gave up")
        failed_and_released(handle.receivers)
        wait_for(lambda: pool.statistics().in_use_bytes == 0, timeout=30)
    stats = pool.statistics()
    assert stats.staged_writes >= 2 and stats.quarantined >= 1
    assert (stats.quarantined_bytes, stats.released_unproven) == (0, 0)
    assert stats.released_proven == stats.quarantined
