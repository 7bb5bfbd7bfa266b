"""MIN consensus across two real processes over gloo on 127.0.0.1."""

from __future__ import annotations

import multiprocessing as mp
import socket
from multiprocessing.connection import Connection

import pytest

from pdkv.protocol.poll import KVPoll


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, port: int, polls: list[int], out: Connection) -> None:
    import torch.distributed as dist

    from pdkv.runtime.consensus import ConsensusError, all_reduce_polls

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        result = all_reduce_polls([KVPoll(p) for p in polls])
        try:
            all_reduce_polls([KVPoll.Success] * (rank + 1))
            mismatch = "no error"
        except ConsensusError as exc:
            mismatch = str(exc)
        out.send(([int(p) for p in result], mismatch))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_one_failed_rank_fails_the_room_on_every_rank() -> None:
    ctx = mp.get_context("spawn")
    port = _free_port()
    a = [KVPoll.Success, KVPoll.Transferring, KVPoll.Success, KVPoll.WaitingForInput]
    b = [KVPoll.Success, KVPoll.Success, KVPoll.Failed, KVPoll.Bootstrapping]
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [
        ctx.Process(target=_rank_main, args=(rank, port, [int(p) for p in polls], pipes[rank][1]))
        for rank, polls in enumerate((a, b))
    ]
    for p in procs:
        p.start()
    try:
        results = []
        for recv, _ in pipes:
            assert recv.poll(120), "rank did not answer"
            results.append(recv.recv())
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    expected = [int(KVPoll.Success), int(KVPoll.Transferring), int(KVPoll.Failed), int(KVPoll.Bootstrapping)]
    for polls, mismatch in results:
        assert polls == expected
        assert "different numbers of rooms: between 1 and 2" in mismatch
