"""Configuration shared by every pdkv component: field validators and environment overrides.

Owns: the attrs validators config classes use (``positive_seconds``, ``positive_int``), the ``env``
field metadata that names a field's ``PDKV_*`` variable, ``from_env`` (a config class's defaults,
then the variables its fields name that are set, then keyword overrides), and ``ENVIRONMENT``: every
``PDKV_*`` variable pdkv reads, with what it does (the README's table is checked against it).
Variables read outside a config class (the auth key, debug switches) are declared with ``declare``.

Must not import any other pdkv module but ``pdkv.errors`` (it sits at the bottom of the layers) and
must not read the environment at import: only ``from_env`` reads, and only the mapping it is given
(``os.environ`` by default), so a plain constructor never depends on the process's environment.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

import attrs

from pdkv.errors import ConfigError

_ENV_KEY: Final = "pdkv_env"  # attrs metadata key of a field's EnvVar

C = TypeVar("C")


@attrs.frozen
class EnvVar:
    """One ``PDKV_*`` variable: its name, what it sets, and how its text becomes the field's value."""

    name: str
    meaning: str
    parse: Callable[[str], object] = attrs.field(default=str, eq=False, repr=False)
    unit: str = ""  # for error messages: "a number of seconds", "a whole number", ...


ENVIRONMENT: dict[str, EnvVar] = {}
"""Every ``PDKV_*`` variable pdkv reads (filled as modules define their config classes)."""


def declare(name: str, meaning: str, parse: Callable[[str], object] = str, unit: str = "") -> EnvVar:
    """Register a variable read outside a config class (e.g. ``PDKV_AUTH_KEY``); returns it."""
    var = EnvVar(name=name, meaning=meaning, parse=parse, unit=unit)
    known = ENVIRONMENT.get(name)
    if known is not None and known.meaning != meaning:
        raise ValueError(f"{name} declared twice with different meanings")
    ENVIRONMENT[name] = var
    return var


def seconds_var(name: str, meaning: str) -> dict[str, EnvVar]:
    """Field metadata: ``name`` overrides this field, read as a number of seconds."""
    return {_ENV_KEY: declare(name, meaning, float, "a number of seconds")}


def int_var(name: str, meaning: str) -> dict[str, EnvVar]:
    """Field metadata: ``name`` overrides this field, read as a whole number."""
    return {_ENV_KEY: declare(name, meaning, int, "a whole number")}


def text_var(name: str, meaning: str, parse: Callable[[str], object] = str) -> dict[str, EnvVar]:
    """Field metadata: ``name`` overrides this field, read as text (``parse`` converts it)."""
    return {_ENV_KEY: declare(name, meaning, parse)}


def parse_flag(text: str) -> bool:
    """A ``PDKV_*`` switch's text: 1/true/yes/on or 0/false/no/off (any case; empty: off)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(text)


def flag_var(name: str, meaning: str) -> dict[str, EnvVar]:
    """Field metadata: ``name`` overrides this field, read as a switch (``parse_flag``)."""
    return {_ENV_KEY: declare(name, meaning, parse_flag, "0 or 1")}


def env_var_of(field: attrs.Attribute[Any]) -> EnvVar | None:
    var = field.metadata.get(_ENV_KEY)
    return var if isinstance(var, EnvVar) else None


def from_env(cls: type[C], env: Mapping[str, str] | None = None, **overrides: object) -> C:
    """``cls`` built from its defaults, then every variable its fields name that is set in ``env``
    (``os.environ`` by default), then ``overrides``. A value that does not parse is a
    ``ConfigError`` naming the variable, and so is a value the field's own validator refuses."""
    source = os.environ if env is None else env
    values: dict[str, object] = {}
    for field in attrs.fields(cls):  # type: ignore[arg-type]  # C is an attrs class by contract
        var = env_var_of(field)
        if var is None or var.name not in source:
            continue
        raw = source[var.name]
        try:
            value = var.parse(raw)
        except (ValueError, ConfigError) as exc:
            what = var.unit or "valid"
            detail = f": {exc}" if isinstance(exc, ConfigError) else ""
            raise ConfigError(f"{var.name}={raw!r} is not {what}{detail}") from None
        try:  # the field's own rule, here, so that the error names the variable that broke it
            if field.converter is not None and callable(field.converter):
                value = field.converter(value)
            if field.validator is not None:
                field.validator(None, field, value)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{var.name}={raw!r}: {exc}") from None
        values[field.alias] = value
    values.update(overrides)
    return cls(**values)


def env_vars(cls: type[object]) -> Mapping[str, str]:
    """Field name -> the variable that overrides it, for the fields of ``cls`` that have one."""
    return {
        f.name: var.name
        for f in attrs.fields(cls)  # type: ignore[arg-type]  # an attrs class by contract
        if (var := env_var_of(f)) is not None
    }


# ------------------------------------------------------------------------------------- validators


def positive_seconds(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    """A finite number > 0 (not a bool)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{attribute.name} must be a positive number of seconds, got {value!r}")


def positive_int(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    """An int > 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive int, got {value!r}")


def non_negative_int(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    """An int >= 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{attribute.name} must be an int >= 0, got {value!r}")


def instance_of(*types: type) -> Callable[[object, attrs.Attribute[Any], object], None]:
    """A validator: the value is one of ``types`` (a bool is never an int), else ``ConfigError``
    naming the field, the types and the value."""
    names = " or ".join(t.__name__ for t in types)

    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        ok = not (isinstance(value, bool) and bool not in types) and isinstance(value, types)
        if not ok:
            raise ConfigError(f"{attribute.name} must be {names}, got {type(value).__name__} {value!r:.60}")

    return check


def non_empty_text(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A non-empty str without surrounding whitespace (names, hosts)."""
    if not isinstance(value, str) or not value or value != value.strip():
        raise ConfigError(f"{attribute.name} must be a non-empty str, got {value!r:.60}")


def tcp_address(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """``tcp://host:port`` with a port in 1..65535 (a registry, a control endpoint)."""
    problem = tcp_address_problem(value)
    if problem is not None:
        raise ConfigError(f"{attribute.name} {problem}")


def cli_int(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number >= ``minimum`` (``--rooms -1`` is an error, not a no-op)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below the least allowed value {minimum}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def cli_fraction(text: str) -> float:
    """An argparse ``type``: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1]")
    return value


def tcp_address_problem(value: object) -> str | None:
    """Why ``value`` is not ``tcp://host:port`` (None when it is)."""
    if not isinstance(value, str):
        return f"must be a str tcp://host:port, got {type(value).__name__} {value!r:.60}"
    rest = value.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    if rest == value or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"must be tcp://host:port (port 1..65535), got {value!r:.80}"
    return None


__all__ = [
    "ENVIRONMENT",
    "EnvVar",
    "cli_fraction",
    "cli_int",
    "declare",
    "env_var_of",
    "env_vars",
    "from_env",
    "instance_of",
    "int_var",
    "non_empty_text",
    "positive_int",
    "positive_seconds",
    "seconds_var",
    "tcp_address",
    "tcp_address_problem",
    "text_var",
]
