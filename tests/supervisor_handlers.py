"""Handlers for the tests that start real workers, loaded by them as ``tests.supervisor_handlers:<Class>``."""
from __future__ import annotations

import time
from typing import Any

from packrat_mq.handler import BaseHandler, Context, Input
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


class TinyTorch(BaseHandler):
    """A two-layer torch model on 8 features: small enough to trace in a test, real enough to run threads."""

    def load_model(self, context: Context) -> Any:
        import torch

        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def example_batch(self, n: int) -> list[Input]:
        return [Input(id=str(i), data=[float(i)] * 8, content_type="application/json") for i in range(n)]

    def preprocess(self, items: list[Input]) -> Any:
        import torch

        return torch.tensor([item.data for item in items], dtype=torch.float32)

    def postprocess(self, output: Any) -> list[Any]:
        return output.tolist()
