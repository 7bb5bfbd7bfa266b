"""The ``sglang.srt.plugins`` entry point against the real SGLang 0.5.23 (CPU closure, GPU stubs).

Proves: SGLang's own ``load_plugins()`` finds pdkv's entry point; ``TransferBackend("pdkv")`` exists; the CLI
accepts ``--disaggregation-transfer-backend pdkv`` (only once the plugin loaded) and the README's exact
launch command lines parse to what they say; ``get_kv_class`` as imported by prefill.py, decode.py and
disagg_service.py answers pdkv's classes while other backends keep theirs; unsupported features, given
as command-line flags to SGLang's parser, are refused by name at manager init; pdkv's deadlines follow
SGLang's variables; and no GPU stub was called outside module import.
"""

from __future__ import annotations

import shlex
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tests.adapters.helpers import REPO, Child, children, requires_sglang

pytestmark = [requires_sglang, pytest.mark.slow]


SGLANG_TIMEOUTS = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "123",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "77",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2.5",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "3",
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "11",
}


def test_entry_point_is_declared() -> None:
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "pdkv"]
    assert [ep.value for ep in eps] == ["pdkv.adapters.sglang.plugin:register"]


def readme_commands() -> list[list[str]]:
    """The ``sglang serve`` command lines of the README's "Using pdkv from SGLang", as argv lists."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Using pdkv from SGLang", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    joined = block.replace("\\\n", " ")
    commands = [shlex.split(line) for line in joined.splitlines() if line.startswith("sglang serve ")]
    return [argv[2:] for argv in commands]


def test_readme_shows_one_prefill_and_one_decode_command() -> None:
    commands = readme_commands()
    assert len(commands) == 2
    assert [argv[argv.index("--disaggregation-mode") + 1] for argv in commands] == ["prefill", "decode"]


def test_plugin_registers_pdkv_with_sglang(tmp_path: Path) -> None:
    plan = {
        "bootstrap_port": 18998,
        "result": str(tmp_path / "plugin.json"),
        "readme_commands": readme_commands(),
    }
    with children() as started:
        child = Child("plugin", plan, tmp_path, env={**SGLANG_TIMEOUTS, "PDKV_KV_CHECKSUM": "0"})
        started.append(child)
        assert child.wait(240) == 0, child.log_tail()
        result = child.result()
    assert result["member"] == "<TransferBackend.PDKV: 'pdkv'>"
    assert result["members"].count("pdkv") == 1
    assert result["in_choices"] == 1
    assert result["server_args_backend"] == "pdkv"
    assert result["cli_backend"] == "pdkv"
    assert "invalid choice: 'pdkv'" in result["before_plugins"], result["before_plugins"]
    # the README's command lines, parsed by SGLang's own parser once the plugin loaded
    prefill, decode = result["launch"]
    assert prefill == {
        "mode": "prefill",
        "backend": "pdkv",
        "host": "10.0.0.1",
        "port": 30000,
        "bootstrap_port": 8998,
        "ib_device": "mlx5_0",
        "decode_radix_cache": False,
        "verdict": "served",
    }
    assert decode == {
        "mode": "decode",
        "backend": "pdkv",
        "host": "10.0.0.2",
        "port": 30001,
        "bootstrap_port": 8998,
        "ib_device": "mlx5_0",
        "decode_radix_cache": True,
        "verdict": "served",
    }
    assert result["hooked"] is True
    ours = {
        "kvargs": "sglang.srt.disaggregation.base.conn.KVArgs",
        "manager": "pdkv.adapters.sglang.conn.PdkvKVManager",
        "sender": "pdkv.adapters.sglang.conn.PdkvKVSender",
        "receiver": "pdkv.adapters.sglang.conn.PdkvKVReceiver",
        "bootstrap_server": "pdkv.adapters.sglang.conn.PdkvKVBootstrapServer",
    }
    assert result["classes"] == {"prefill": ours, "decode": ours, "disagg_service": ours}
    assert result["mooncake_sender"] == "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender"
    refusals = result["refusals"]
    # the decode radix cache is served (the prefill skips the decode's prefix): a manager is built
    assert refusals.pop("decode_radix") == "accepted"
    assert all(text.startswith("ConfigError: ") for text in refusals.values()), refusals
    assert "pipeline parallelism" in refusals["pp"]
    assert "DP attention" in refusals["dp_attention"]
    assert "--attn-dp-size" in refusals["attn_dp"]
    assert "role switch" in refusals["role_switch"]
    assert "attention context parallelism" in refusals["attn_cp"]
    assert "decode context parallelism" in refusals["dcp"]
    assert "several nodes" in refusals["nnodes"]
    assert "mark_prefill_complete" in refusals["allocation_policy"]
    assert "state type 'mamba' is not supported by pdkv" in refusals["mamba_state"]
    # SGLang's own checksum switch turns pdkv's on (PDKV_KV_CHECKSUM=0 in this child)
    assert result["kv_checksum"] == {"flag": True, "default": False, "device": "cpu"}
    assert result["timeouts"] == {
        "bootstrap": 123.0,
        "waiting": 77.0,
        "heartbeat_interval": 2.5,
        "heartbeat_timeout": 10.0,
        "abort_ack": 11.0,
    }
    assert result["stub_calls_outside_import"] == []
