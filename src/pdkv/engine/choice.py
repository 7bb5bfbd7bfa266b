"""Choosing the transfer engine by name: the one factory every entry point uses (``PDKV_BACKEND``).

Owns: ``BackendKind`` (mooncake, nixl, loopback), ``backend_kind`` (a name, else ``PDKV_BACKEND``, else
Mooncake) and ``make_backend`` (a backend of that kind, its config from the environment unless one is
given, bound to ``host``). The command line, the demo, the benchmarks, the cluster harness and both
adapters build their backends here, so a deployment switches engines in one place. Must not import an
engine's library: each backend module imports its own when a backend is built.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping

import attrs

from pdkv import config
from pdkv.engine.backend import TransferBackend
from pdkv.engine.loopback import LoopbackBackend, LoopbackConfig
from pdkv.engine.mooncake import MooncakeBackend, MooncakeConfig
from pdkv.engine.nixl import NixlBackend, NixlConfig
from pdkv.errors import ConfigError


class BackendKind(enum.StrEnum):
    """A transfer engine pdkv can drive (the value is its name on the command line and in the env)."""

    MOONCAKE = "mooncake"  # Mooncake's transfer engine: TCP or RDMA (the default)
    NIXL = "nixl"  # NVIDIA NIXL over UCX: cma, shared memory, TCP, RDMA, cuda_ipc
    LOOPBACK = "loopback"  # memcpy inside one process (tests, single-process demos)


BACKEND_VAR = config.declare(
    "PDKV_BACKEND", "Transfer engine: mooncake (default), nixl or loopback (one process only)"
)
DEFAULT_BACKEND = BackendKind.MOONCAKE
CHOICES = tuple(kind.value for kind in BackendKind)


def backend_kind(value: BackendKind | str | None = None, env: Mapping[str, str] | None = None) -> BackendKind:
    """``value`` when given, else ``PDKV_BACKEND`` when set (and not empty), else Mooncake."""
    source = os.environ if env is None else env
    chosen: object = value if value is not None else (source.get(BACKEND_VAR.name) or DEFAULT_BACKEND)
    try:
        return BackendKind(str(chosen).strip().lower())
    except ValueError:
        where = "backend" if value is not None else BACKEND_VAR.name
        raise ConfigError(f"{where} must be one of {', '.join(CHOICES)}, got {chosen!r}") from None


def make_backend(
    kind: BackendKind | str | None = None,
    *,
    host: str | None = None,
    mooncake: MooncakeConfig | None = None,
    nixl: NixlConfig | None = None,
    loopback: LoopbackConfig | None = None,
    env: Mapping[str, str] | None = None,
) -> TransferBackend:
    """A backend of ``kind`` (see ``backend_kind``). Its config is the one given, else its class's
    ``from_env(env)``; ``host`` (the address peers reach it at) replaces the config's own."""
    chosen = backend_kind(kind, env)
    if chosen is BackendKind.NIXL:
        nixl_config = nixl if nixl is not None else NixlConfig.from_env(env)
        if host is not None:
            nixl_config = attrs.evolve(nixl_config, hostname=host)
        return NixlBackend(nixl_config)
    if chosen is BackendKind.LOOPBACK:
        return LoopbackBackend(loopback)
    mooncake_config = mooncake if mooncake is not None else MooncakeConfig.from_env(env)
    if host is not None:
        mooncake_config = attrs.evolve(mooncake_config, local_hostname=host)
    return MooncakeBackend(mooncake_config)


__all__ = ["BACKEND_VAR", "CHOICES", "DEFAULT_BACKEND", "BackendKind", "backend_kind", "make_backend"]
