"""Fixtures of the runtime tests (the rig itself lives in ``tests.runtime.rig``)."""

from tests.runtime.rig import rig_factory

__all__ = ["rig_factory"]
