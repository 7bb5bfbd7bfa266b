"""One configuration story: shared validators, ``PDKV_*`` variables read only by ``from_env``, and a
README table that lists exactly the variables the code reads."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path
from typing import Any

import attrs
import pytest

import pdkv
from pdkv.config import ENVIRONMENT, from_env, int_var, positive_int, positive_seconds, seconds_var
from pdkv.errors import ConfigError
from pdkv.mapping import LayoutPolicy
from pdkv.protocol.config import Timeouts
from pdkv.runtime.decode import DecodeConfig
from pdkv.runtime.executor import ExecutorConfig
from pdkv.runtime.prefill import PrefillConfig
from pdkv.testing.synthetic import Capacity, ModelSpec, RankMemory

ROOT = Path(__file__).resolve().parents[1]
# Modules that import a scheduler (SGLang, vLLM) when imported, and the CLI entry point.
_SKIP = re.compile(r"pdkv\.(__main__|adapters\.\w+\.(plugin|conn|connector|worker|scheduler))")


def _import_all() -> None:
    for info in pkgutil.walk_packages(pdkv.__path__, "pdkv."):
        if not _SKIP.fullmatch(info.name):
            importlib.import_module(info.name)


def _variables_in_source() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "src" / "pdkv").rglob("*.py"):
        found |= set(re.findall(r"\bPDKV_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return found


def test_readme_table_lists_exactly_the_variables_the_code_reads() -> None:
    _import_all()
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- environment -->")[1].split("<!-- /environment -->")[0]
    table = set(re.findall(r"^\| `(PDKV_[A-Z0-9_]+)` \|", block, flags=re.M))
    assert table == set(ENVIRONMENT)
    # Nothing is read behind the registry's back: every PDKV_ name in the source is declared.
    assert _variables_in_source() <= set(ENVIRONMENT)


def test_plain_constructors_read_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDKV_ABORT_ACK_TIMEOUT", "7")
    monkeypatch.setenv("PDKV_EXECUTOR_MAX_ENTRIES", "64")
    layout = RankMemory(ModelSpec(layers=1), Capacity(kv_pages=4, state_slots=1, aux_rows=1)).layout
    fields: dict[str, Any] = dict(
        instance=pdkv.InstanceId("p"),
        rank=pdkv.RankCoord(tp=0),
        tp_size=1,
        layout=layout,
        registry="tcp://x:1",
    )
    plain = PrefillConfig(**fields)
    assert plain.timeouts.abort_ack == 30.0 and plain.executor.max_entries == ExecutorConfig().max_entries
    read = PrefillConfig.from_env(**fields)
    assert read.timeouts.abort_ack == 7.0 and read.executor.max_entries == 64
    # Given fields win over the environment.
    assert PrefillConfig.from_env(**fields, timeouts=Timeouts(abort_ack=3)).timeouts.abort_ack == 3
    decode: dict[str, Any] = dict(
        instance=pdkv.InstanceId("d"), rank=pdkv.RankCoord(tp=0), tp_size=1, layout=layout
    )
    assert DecodeConfig(**decode).timeouts.abort_ack == 30.0
    assert DecodeConfig.from_env(**decode).timeouts.abort_ack == 7.0
    assert DecodeConfig.from_env({}, **decode).timeouts.abort_ack == 30.0


def test_from_env_parses_names_the_variable_and_lets_the_class_validate() -> None:
    @attrs.frozen(kw_only=True)
    class _Example:
        wait: float = attrs.field(
            default=1.0, validator=positive_seconds, metadata=seconds_var("PDKV_TEST_ONLY_WAIT", "test")
        )
        count: int = attrs.field(
            default=2, validator=positive_int, metadata=int_var("PDKV_TEST_ONLY_COUNT", "test")
        )

    try:
        assert from_env(_Example, {}) == _Example()
        assert from_env(_Example, {"PDKV_TEST_ONLY_WAIT": "0.5", "PDKV_TEST_ONLY_COUNT": "9"}) == _Example(
            wait=0.5, count=9
        )
        assert from_env(_Example, {"PDKV_TEST_ONLY_COUNT": "9"}, count=4).count == 4
        with pytest.raises(ConfigError, match=r"PDKV_TEST_ONLY_COUNT='many' is not a whole number"):
            from_env(_Example, {"PDKV_TEST_ONLY_COUNT": "many"})
        with pytest.raises(ConfigError, match="wait must be a positive number of seconds"):
            from_env(_Example, {"PDKV_TEST_ONLY_WAIT": "-1"})
        with pytest.raises(ConfigError, match="count must be a positive int"):
            _Example(count=True)
    finally:  # test-only variables stay out of the registry the README test reads
        ENVIRONMENT.pop("PDKV_TEST_ONLY_WAIT", None)
        ENVIRONMENT.pop("PDKV_TEST_ONLY_COUNT", None)


def test_layout_policy_comes_from_pdkv_layout_policy_on_both_sides() -> None:
    layout = RankMemory(ModelSpec(layers=1), Capacity(kv_pages=4, state_slots=1, aux_rows=1)).layout
    decode: dict[str, Any] = dict(
        instance=pdkv.InstanceId("d"), rank=pdkv.RankCoord(tp=0), tp_size=1, layout=layout
    )
    prefill: dict[str, Any] = dict(decode, instance=pdkv.InstanceId("p"), registry="tcp://x:1")
    for cls, fields in ((DecodeConfig, decode), (PrefillConfig, prefill)):
        assert cls(**fields).layout_policy is LayoutPolicy.DEGRADE_DRAFT  # the default
        assert cls.from_env({}, **fields).layout_policy is LayoutPolicy.DEGRADE_DRAFT
        strict = cls.from_env({"PDKV_LAYOUT_POLICY": "strict"}, **fields)
        assert strict.layout_policy is LayoutPolicy.STRICT
        env = {"PDKV_LAYOUT_POLICY": "strict"}
        given = cls.from_env(env, **fields, layout_policy=LayoutPolicy.DEGRADE_DRAFT)
        assert given.layout_policy is LayoutPolicy.DEGRADE_DRAFT  # a given field wins
        with pytest.raises(ConfigError, match=r"PDKV_LAYOUT_POLICY='lenient' is not valid: .*choose from"):
            cls.from_env({"PDKV_LAYOUT_POLICY": "lenient"}, **fields)
        with pytest.raises(ConfigError, match="layout_policy"):
            cls(**fields, layout_policy="strict")  # type: ignore[arg-type]  # the wrong type on purpose


def test_layout_policy_from_env_for_configs_built_field_by_field() -> None:
    from pdkv.runtime import layout_policy_from_env

    assert layout_policy_from_env({}) is LayoutPolicy.DEGRADE_DRAFT
    assert layout_policy_from_env({"PDKV_LAYOUT_POLICY": "STRICT"}) is LayoutPolicy.STRICT
    with pytest.raises(ConfigError, match=r"PDKV_LAYOUT_POLICY='x' is not valid: 'x' is not a layout policy"):
        layout_policy_from_env({"PDKV_LAYOUT_POLICY": "x"})
