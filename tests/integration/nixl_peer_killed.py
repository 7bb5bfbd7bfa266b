"""A NIXL peer killed in the middle of a write, then the sender torn down: run as its own process by
tests/integration/test_nixl_faults.py, which reads its exit status (UCX aborts a process with SIGABRT,
exit 134, when teardown meets the wrong state; that must never come from NixlBackend).

    python -m tests.integration.nixl_peer_killed backend <UCX_TLS>   NixlBackend: prints one JSON line
    python -m tests.integration.nixl_peer_killed raw-notify           the control: the raw agent sequence
                                                                      that aborts (a standalone
                                                                      notification to the dead peer),
                                                                      up to 4 times
"""

from __future__ import annotations

import functools
import gc
import json
import os
import signal
import sys
import time

import numpy as np

from pdkv.engine import NixlBackend, NixlConfig
from pdkv.engine.nixl import decode_peer_metadata, load_nixl
from pdkv.mapping import TransferBlocks
from pdkv.testing.backend_conformance import HostBuffer, MetadataSyncedPeer, SpawnedPeer

BLOCKS, BLOCK_BYTES = 4096, 64 << 10  # 256 MiB: tens of ms over cma, a few hundred over UCX tcp


def _batch(source: HostBuffer, base: int, count: int, seed: int) -> TransferBlocks:
    slots = np.random.default_rng(seed).permutation(BLOCKS)[:count]
    return TransferBlocks(
        src=source.data_ptr() + np.arange(count, dtype=np.int64) * BLOCK_BYTES,
        dst=base + slots.astype(np.int64) * BLOCK_BYTES,
        length=np.full(count, BLOCK_BYTES, dtype=np.int64),
        buffer=np.zeros(count, dtype=np.int64),
    )


def backend_case(tls: str) -> None:
    config = NixlConfig(ucx_tls=tls, ucx_net_devices="lo", log_level="FATAL", transfer_timeout_s=20.0)
    with SpawnedPeer(functools.partial(NixlBackend, config)) as spawned:
        peer = MetadataSyncedPeer(spawned)
        sender = NixlBackend(config)
        peer.attach(sender)
        region = peer.allocate(BLOCKS * BLOCK_BYTES)
        source = HostBuffer(BLOCKS * BLOCK_BYTES, fill=7)
        sender.register(source)
        sender.write(peer.session_id, _batch(source, region.address, 1, 0), timeout=30)  # connected
        handle = sender.submit_write(peer.session_id, _batch(source, region.address, BLOCKS, 1))
        time.sleep(0.005)
        assert spawned.pid is not None
        os.kill(spawned.pid, signal.SIGKILL)
        started = time.monotonic()
        first = sender.wait([handle], 60).outcomes[0]
        first_s = time.monotonic() - started
        second = sender.wait([sender.submit_write(peer.session_id, _batch(source, region.address, 8, 2))], 60)
        sender.close()  # the teardown UCX must survive
        print(
            json.dumps(
                {
                    "first": first.status.value,
                    "first_reason": first.reason,
                    "first_s": round(first_s, 4),
                    "second": second.outcomes[0].status.value,
                    "second_reason": second.outcomes[0].reason,
                }
            ),
            flush=True,
        )


def raw_notify_control(attempts: int = 10) -> None:
    """The sequence pdkv avoids: a standalone notification to a peer that died before UCX noticed, a
    post that finds it dead, then teardown: UCX aborts the process (arbiter.c, SIGABRT). Whether the
    notification is still queued at the teardown is a race (UCX's async thread may fail it first), so
    the sequence runs up to ``attempts`` times, each agent torn down at once; the first abort ends it
    (alone, with UCX's default transports, the first attempt aborts)."""
    api = load_nixl()
    config = NixlConfig(ucx_net_devices="lo", log_level="FATAL")
    for attempt in range(attempts):
        with SpawnedPeer(functools.partial(NixlBackend, config)) as spawned:
            region = spawned.allocate(1 << 20)
            metadata = decode_peer_metadata(spawned.engine_metadata())
            agent = api.nixl_agent(
                f"raw-control-{attempt}", api.nixl_agent_config(enable_prog_thread=False, backends=[])
            )
            agent.create_backend("UCX", {"num_workers": "1"})
            source = np.ones(1 << 20, dtype=np.uint8)
            agent.register_memory([(int(source.ctypes.data), source.nbytes, 0, "")], "DRAM")
            name = agent.add_remote_agent(metadata.nixl)
            name = name.decode() if isinstance(name, bytes) else name
            local = agent.get_xfer_descs(np.array([[source.ctypes.data, 4096, 0]], dtype=np.uint64), "DRAM")
            remote = agent.get_xfer_descs(np.array([[region.address, 4096, 0]], dtype=np.uint64), "DRAM")
            warm = agent.initialize_xfer("WRITE", local, remote, name)
            state = agent.transfer(warm)
            while state == "PROC":
                state = agent.check_xfer_state(warm)
            warm.release()
            assert spawned.pid is not None
            os.kill(spawned.pid, signal.SIGKILL)
            time.sleep(0.2)
            agent.send_notif(name, b"x")
            try:
                agent.transfer(agent.initialize_xfer("WRITE", local, remote, name))
            except Exception as exc:
                print(f"attempt {attempt}: post failed: {type(exc).__name__}", flush=True)
            del agent, local, remote, warm  # the agent's destructor: with the notification queued, UCX aborts
            gc.collect()
    print(f"no abort in {attempts} attempts", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "backend":
        backend_case(sys.argv[2])
    else:
        raw_notify_control()
