"""Handlers the profiler tests load by import path in child processes."""
from __future__ import annotations

from typing import Any

from packrat_mq.handler import Context, Input
from packrat_mq.zoo.testing import EchoHandler


class FailAboveOne(EchoHandler):
    """Echo for a batch of one; raises for anything larger (an out-of-memory stand-in)."""

    def load_model(self, context: Context) -> Any:
        return None

    def inference(self, batch: Any) -> Any:
        if len(batch) > 1:
            raise MemoryError(f"cannot allocate a batch of {len(batch)}")
        return batch

    def example_batch(self, n: int) -> list[Input]:
        return super().example_batch(n)


class TinyLinear(EchoHandler):
    """A traceable torch model small enough to profile in a test (graph mode path)."""

    traceable = True

    def load_model(self, context: Context) -> Any:
        import torch

        self.traced_batches: list[int] = []
        torch.manual_seed(0)
        return torch.nn.Linear(16, 4)

    def example_batch(self, n: int) -> list[Input]:
        return [Input(id=str(i), data=[float(i)] * 16, content_type="application/json") for i in range(n)]

    def preprocess(self, items: list[Input]) -> Any:
        import torch

        return torch.tensor([item.data for item in items], dtype=torch.float32)

    def inference(self, batch: Any) -> Any:
        import torch

        with torch.inference_mode():
            return self.model(batch)

    def postprocess(self, output: Any) -> list[Any]:
        if self.context is not None and self.context.graph_mode:
            # A traced module is a ScriptModule, not the eager Linear.
            assert type(self.model).__name__ != "Linear", "graph mode did not trace"
        return output.tolist()
