"""Config and environment mistakes are pdkv errors that name the field (seams issue, item 12).

Each row used to be accepted (``tp_size=1.5``, ``instance=123``, ``layout=None``, a registry that is not
an address, an empty Mooncake host giving the engine session ":16243") or to raise a builtin/attrs
error with no field in it. Every row now raises a ``PdkvError`` whose message names the field (or the
variable), at construction, with nothing started.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from pdkv.engine.loopback import LoopbackBackend, LoopbackFabric
from pdkv.engine.mooncake import MooncakeConfig
from pdkv.errors import ConfigError, PdkvError
from pdkv.protocol.config import Timeouts
from pdkv.protocol.ids import InstanceId
from pdkv.protocol.messages import RankCoord
from pdkv.runtime.decode import DecodeConfig
from pdkv.runtime.executor import ExecutorConfig
from pdkv.runtime.per_layer import PerLayerConfig
from pdkv.runtime.prefill import PrefillConfig, PrefillTransport
from tests.protocol.helpers import layout

GOOD: dict[str, Any] = {
    "instance": InstanceId("p"),
    "rank": RankCoord(tp=0),
    "tp_size": 1,
    "layout": layout(),
    "registry": "tcp://127.0.0.1:8998",
}

PREFILL_ROWS = [
    ("tp_size", 1.5),
    ("tp_size", 0),
    ("tp_size", True),
    ("cp_size", "2"),
    ("instance", 123),
    ("instance", ""),
    ("rank", (0, 0)),
    ("layout", None),
    ("registry", 8998),
    ("registry", ""),
    ("host", ""),
    ("timeouts", 5),
    ("executor", None),
    ("per_layer", {}),
    ("workers", 0),
    ("queue_size", 2.0),
    ("shared_chunks", -1),
    ("register_memory", "yes"),
    ("wait_receives", 1),
    ("ownership", 2),
    ("epoch", "1"),
]


@pytest.mark.parametrize(("field", "value"), PREFILL_ROWS)
def test_a_bad_prefill_config_field_is_a_config_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        PrefillConfig(**{**GOOD, field: value})


DECODE_GOOD = {k: v for k, v in GOOD.items() if k != "registry"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        (f, v)
        for f, v in PREFILL_ROWS
        if f in ("tp_size", "instance", "rank", "layout", "host", "timeouts", "epoch", "wait_receives")
    ],
)
def test_a_bad_decode_config_field_is_a_config_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        DecodeConfig(**{**DECODE_GOOD, field: value})


@pytest.mark.parametrize("registry", ["not a url", "tcp://host", "tcp://:80", "tcp://h:99999", "zmq://h:1"])
def test_a_registry_the_zmq_announcement_cannot_dial_is_refused_when_the_transport_is_built(
    registry: str,
) -> None:
    backend = LoopbackBackend(fabric=LoopbackFabric("bad-config"))
    try:
        with pytest.raises(ConfigError, match="registry must be tcp://host:port"):
            PrefillTransport(PrefillConfig(**{**GOOD, "registry": registry}), backend)
    finally:
        backend.close()


ENV_ROWS: list[tuple[Callable[[dict[str, str]], object], str, str]] = [
    (lambda env: MooncakeConfig.from_env(env), "PDKV_MOONCAKE_HOSTNAME", ""),
    (lambda env: MooncakeConfig.from_env(env), "PDKV_MOONCAKE_HOSTNAME", " 10.0.0.1"),
    (lambda env: Timeouts.from_env(env), "PDKV_BOOTSTRAP_TIMEOUT", "nan"),
    (lambda env: Timeouts.from_env(env), "PDKV_ABORT_ACK_TIMEOUT", "inf"),
    (lambda env: Timeouts.from_env(env), "PDKV_QUARANTINE_SETTLE", "-5"),
    (lambda env: Timeouts.from_env(env), "PDKV_HEARTBEAT_INTERVAL", "often"),
    (lambda env: ExecutorConfig.from_env(env), "PDKV_EXECUTOR_TIMEOUT", "nan"),
    (lambda env: ExecutorConfig.from_env(env), "PDKV_EXECUTOR_MAX_ENTRIES", "0"),
    (lambda env: PerLayerConfig.from_env(env), "PDKV_PER_LAYER_FINISH_TIMEOUT", "-inf"),
    (lambda env: PrefillConfig.from_env(env, **GOOD), "PDKV_WAIT_RECEIVES", "maybe"),
    (lambda env: DecodeConfig.from_env(env, **DECODE_GOOD), "PDKV_WAIT_RECEIVES", "2"),
]


@pytest.mark.parametrize(("build", "variable", "raw"), ENV_ROWS)
def test_a_bad_environment_variable_is_a_config_error_naming_it(
    build: Callable[[dict[str, str]], object], variable: str, raw: str
) -> None:
    with pytest.raises(ConfigError, match=variable) as info:
        build({variable: raw})
    assert isinstance(info.value, PdkvError)


def test_an_empty_mooncake_host_is_refused_rather_than_making_a_portless_session() -> None:
    with pytest.raises(ConfigError, match="local_hostname must be a non-empty str"):
        MooncakeConfig(local_hostname="")
    assert math.isfinite(Timeouts().bootstrap)  # the defaults stay valid
