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
