"""The transports' JSON log: real transports write it, ``pdkv trace`` reads one room out of it."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from pdkv.diagrams.trace import read_logs, render
from pdkv.errors import ConfigError
from pdkv.protocol.ids import RoomId
from pdkv.protocol.poll import KVPoll
from pdkv.runtime import json_log
from tests.runtime.rig import Rig, wait_for


def test_off_unless_installed() -> None:
    assert not logging.getLogger(json_log.TRACE_LOGGER).isEnabledFor(logging.DEBUG)


def test_env_variable_turns_it_on_for_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(json_log.ENV, str(tmp_path))
    handler = json_log.install_from_env()
    assert handler is not None
    try:
        assert json_log.install_from_env() is handler  # once per path
        logging.getLogger("pdkv.test").warning("room %s: something odd", 42)
        logging.getLogger("pdkv.test").info("below the file's level")  # root at WARNING in tests
    finally:
        json_log.uninstall(handler)
    assert not logging.getLogger(json_log.TRACE_LOGGER).isEnabledFor(logging.DEBUG)
    records = [json.loads(x) for x in (tmp_path / f"pdkv-{os.getpid()}.jsonl").read_text().splitlines()]
    assert [(r["level"], r["text"]) for r in records] == [("WARNING", "room 42: something odd")]


def test_an_unwritable_path_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(json_log.ENV, str(tmp_path / "no such folder" / "x.jsonl"))
    with pytest.raises(ConfigError, match=r"PDKV_LOG_JSON=.*no such folder.*cannot write the JSON log"):
        json_log.install_from_env()


def test_a_room_aborted_by_decode_traced_across_real_transports(
    rig_factory: Callable[..., Rig], tmp_path: Path
) -> None:
    path = tmp_path / "trace.jsonl"
    handler = json_log.install(str(path), process="test process")
    try:
        s = rig_factory(cp=2)
        prefill = s.start_registered()
        room = RoomId(77)
        receiver = s.decode.receiver(room, prefill)
        receiver.init(np.arange(4, dtype=np.int64), 1)
        senders = [p.sender(room) for p in s.prefills]
        for sender in senders:
            sender.init(4, 2)
        wait_for(lambda: all(x.poll() is KVPoll.WaitingForInput for x in senders))
        receiver.abort("the client went away")
        wait_for(receiver.release_ready)
        wait_for(lambda: all(x.poll() is KVPoll.Failed for x in senders))
    finally:
        json_log.uninstall(handler)
    lines = render(77, read_logs([path])).splitlines()
    lanes = {line.split(" as ")[1]: line.split()[1] for line in lines if line.startswith("  participant")}
    assert set(lanes) == {"d tp0 cp0", "p tp0 cp0", "p tp0 cp1"}
    d, p0, p1 = lanes["d tp0 cp0"], lanes["p tp0 cp0"], lanes["p tp0 cp1"]

    def at(pattern: str, start: int = 0) -> int:
        return next(i for i in range(start, len(lines)) if pattern in lines[i])

    assert "WaitingForInput" in lines[at(f"Note over {d}: ")]  # after init, before any receipt
    for p in (p0, p1):
        request = at(f"{d}->>{p}: ")
        assert "TransferRequest(4 pages)" in lines[request] and "(sent " in lines[request]
        at(f"Note over {p}: ", request)
        abort = at(f"{d}->>{p}: ", request + 1)
        assert "Abort (sent" in lines[abort]
        ack = at(f"{p}->>{d}: ", abort)
        assert "AbortAck" in lines[ack]
    assert "Failed" in lines[at(f"Note over {d}: ", at(f"Note over {d}: ") + 1)]
    assert "pages released (acked)" in lines[-1] and lines[-1].startswith(f"  Note over {d}: ")
    assert not any("-x" in line for line in lines)  # every message sent was received and logged


def test_a_register_ack_that_leaves_buffers_out_says_how_many() -> None:
    from pdkv.mapping import BufferKey, BufferKind, ModelRole
    from pdkv.protocol.ids import Epoch, InstanceId
    from pdkv.protocol.messages import Origin, RankCoord, RegisterAck

    origin = Origin(instance=InstanceId("p"), epoch=Epoch(1), rank=RankCoord(tp=0))
    key = BufferKey(model=ModelRole.DRAFT, kind=BufferKind.INDEX_K, layer_id=0)
    assert json_log.describe(RegisterAck(origin=origin)) == "RegisterAck"  # diagrams of matching pairs stay
    degraded = RegisterAck(origin=origin, prefill_left_out=[key])
    assert json_log.describe(degraded) == "RegisterAck(leaves out 1 prefill + 0 decode buffers)"
