"""Handlers for tests/test_supervisor.py, loaded by worker processes as ``tests.supervisor_handlers:<Class>``."""
from __future__ import annotations

from typing import Any

from packrat_mq.handler import Context
from packrat_mq.zoo.testing import EchoHandler


class FailingLoad(EchoHandler):
    """Every instance fails to load its model (a missing weights file, say)."""

    def load_model(self, context: Context) -> Any:
        raise RuntimeError(f"cannot load the model of {context.instance_id}: weights not found")


class FailingSecondInstance(EchoHandler):
    """Instance 0 loads (an echo model); every other instance fails to load."""

    def load_model(self, context: Context) -> Any:
        if not context.instance_id.endswith("-0"):
            raise RuntimeError(f"cannot load the model of {context.instance_id}")
        return None
