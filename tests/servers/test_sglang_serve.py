"""A real ``sglang serve`` prefill/decode pair over pdkv, through SGLang's PD router (sglang-router), on CPU.

The README's command lines (block ``sglang-serve``) start the prefill, the decode and the router; a plain
``sglang serve`` of the same tiny Llama (seeded N(0, s^2) weights, ``tests.servers.tiny_model``) gives the
reference tokens. Each server is started once for the module and stopped by process group at the end.
What is shown: the decode's greedy tokens equal the plain server's; three corruptions of the decode's
received KV change them (the KV the decode uses is the KV pdkv moved); a client that disconnects
mid-transfer leaves nothing behind on either server (pdkv's transports, the adapter, SGLang's own queues
and KV pool).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import harness
from tests.servers.harness import Stats, get_json, post_json
from tests.servers.prompts import CONTROL_PROMPTS, DISCONNECT_PROMPT, PROMPTS
from tests.servers.tiny_model import write_llama

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None or importlib.util.find_spec("sglang_router") is None,
        reason="SGLang's serving closure is not installed (make sglang installs it)",
    ),
]

MAX_NEW_TOKENS = 8
BIN = Path(sys.executable).parent
ENV = {"SGLANG_USE_CPU_ENGINE": "1", "PDKV_TEST_GPU_STUBS": "1", "SGLANG_PLUGINS": "pdkv"}


class Cluster:
    def __init__(self, workdir: Path, ports: dict[str, int], stats: Stats) -> None:
        self.workdir = workdir
        self.ports = ports
        self.stats = stats

    def generate(self, port: int, tokens: list[int]) -> list[int]:
        body = {
            "input_ids": tokens,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        }
        out = post_json(port, "/generate", body)
        return [int(t) for t in out["output_ids"]]

    def routed(self, tokens: list[int]) -> list[int]:
        return self.generate(self.ports["router"], tokens)

    def plain(self, tokens: list[int]) -> list[int]:
        return self.generate(self.ports["plain"], tokens)

    def loads(self, name: str) -> dict[str, Any]:
        load: dict[str, Any] = get_json(self.ports[name], "/v1/loads")["loads"][0]
        return load


def _argv(argv: list[str]) -> list[str]:
    """``sglang`` and ``python`` of the README are this venv's."""
    head = {"sglang": str(BIN / "sglang"), "python": sys.executable}
    return [head.get(argv[0], argv[0]), *argv[1:]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("sglang-serve")
    model = write_llama(workdir / "tiny-llama")
    # the plain server: the decode's line without disaggregation
    ports, commands = harness.readme_pair(
        "sglang-serve", model, side_port="bootstrap", plain_from="--disaggregation-mode"
    )
    env = harness.hook_env(workdir, ENV)
    with harness.start_pair(workdir, ports, commands, argv=_argv, env=lambda _: env) as started:
        started[-1].wait_http(ports["router"], "/readiness", timeout_s=60)
        cluster = Cluster(workdir, ports, Stats(workdir))
        harness.wait_for(lambda: _routed_once(cluster), 60, "the router's first answer", interval_s=0.5)
        yield cluster


def _routed_once(cluster: Cluster) -> bool:
    try:
        cluster.routed([5, 6, 7])
    except (AssertionError, OSError):
        return False
    return True


def _settled(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """Both servers' reports once neither holds an open room and the counts are steady."""
    return harness.settled(
        lambda: {name: cluster.stats.one(f"sglang-{name}") for name in ("prefill", "decode")},
        lambda r: r["prefill"]["rooms_open"] == 0 and r["decode"]["rooms_open"] == 0,
    )


def test_decode_tokens_equal_a_plain_server_and_the_kv_is_what_the_decode_uses(cluster: Cluster) -> None:
    before = _settled(cluster)["decode"]["rooms_succeeded"]
    harness.check_tokens_and_controls(
        cluster.workdir,
        cluster.stats,
        "sglang-decode",
        routed=cluster.routed,
        plain=cluster.plain,
        prompts=PROMPTS,
        control_prompts=CONTROL_PROMPTS,
    )
    after = _settled(cluster)
    prefill, decode = after["prefill"], after["decode"]
    # every prompt's KV came through pdkv, none failed
    assert decode["rooms_succeeded"] - before == len(PROMPTS) + len(CONTROL_PROMPTS)
    assert decode["rooms_failed"] == 0 and prefill["rooms_failed"] == 0


def test_a_client_disconnecting_mid_transfer_leaves_nothing_behind(cluster: Cluster) -> None:
    harness.write_control(cluster.workdir, None)
    before = _settled(cluster)
    # 0.2 s per prefill forward: the 16 chunks of the prompt take seconds to compute and send
    post_json(cluster.ports["prefill"], "/slow_down", {"forward_sleep_time": 0.2})
    try:
        body = {
            "input_ids": DISCONNECT_PROMPT,
            "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
        client = harness.open_stream(cluster.ports["router"], "/generate", body)
        try:
            harness.wait_for(
                lambda: (
                    cluster.stats.one("sglang-decode")["rooms_open"] == 1
                    and cluster.stats.one("sglang-prefill")["rooms_open"] == 1
                    and cluster.loads("decode")["disaggregation"]["decode_transfer_queue_reqs"] == 1
                ),
                30,
                "the room open on both servers",
            )
        finally:
            harness.disconnect(client)
    finally:
        post_json(cluster.ports["prefill"], "/slow_down", {"forward_sleep_time": None})

    def settled() -> bool:
        prefill, decode = cluster.stats.one("sglang-prefill"), cluster.stats.one("sglang-decode")
        pdkv_clear = all(
            r["rooms_open"] == 0 and r["deferred_aborts"] == 0 and r["to_clear"] == 0
            for r in (prefill, decode)
        )
        engines_clear = all(_idle(cluster.loads(name)) for name in ("prefill", "decode"))
        return pdkv_clear and engines_clear

    harness.wait_for(settled, 60, "both servers to drop the disconnected request", interval_s=0.25)
    after = {name: cluster.stats.one(f"sglang-{name}") for name in ("prefill", "decode")}
    # it ended as an abort on both sides (the disconnect reached them), not as a finished transfer
    for name in ("prefill", "decode"):
        assert after[name]["rooms_failed"] == before[name]["rooms_failed"] + 1, (name, before, after)
        assert after[name]["rooms_succeeded"] == before[name]["rooms_succeeded"], (name, before, after)
    # and both serve the next request as before
    assert cluster.routed(PROMPTS[1]) == cluster.plain(PROMPTS[1])


def _idle(load: dict[str, Any]) -> bool:
    queues = load["disaggregation"]
    return (
        load["num_used_tokens"] == 0
        and load["num_running_reqs"] == 0
        and load["num_waiting_reqs"] == 0
        and all(v == 0 for k, v in queues.items() if k.endswith("_reqs"))
    )
