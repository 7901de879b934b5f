"""Handlers for the tests that start real workers, loaded by them as ``tests.supervisor_handlers:<Class>``."""
from __future__ import annotations

import time
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


class SlowLoad(EchoHandler):
    """An echo model that takes ``load_s`` seconds (option, default 60) to load: a start that can be interrupted."""

    def load_model(self, context: Context) -> Any:
        time.sleep(float(context.options.get("load_s", 60)))
        return None
