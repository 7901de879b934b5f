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


class SlowOnOneCpu(EchoHandler):
    """Sleeps ``slow_ms`` in the copy pinned to cpu ``slow_cpu``, ``fast_ms`` elsewhere; records where it runs.

    A stand-in for a model whose copies do not run equally fast, so a test can
    see which copy's time a co-located point takes. With ``record_dir``, each
    process writes ``<pid>.json``: its instance id, its context's cores and
    the CPUs it is really allowed to run on (after pinning).
    """

    def load_model(self, context: Context) -> Any:
        import json
        import os
        from pathlib import Path

        options = context.options
        slow = int(options.get("slow_cpu", -1)) in context.cores
        self.sleep_s = float(options.get("slow_ms" if slow else "fast_ms", 1.0)) / 1000.0
        if options.get("record_dir"):
            record = {"instance": context.instance_id, "cores": list(context.cores),
                      "affinity": sorted(os.sched_getaffinity(0))}
            Path(options["record_dir"], f"{os.getpid()}.json").write_text(json.dumps(record))
        return None

    def inference(self, batch: Any) -> Any:
        import time

        time.sleep(self.sleep_s)
        return batch


class SleepReadAtLoad(EchoHandler):
    """Sleeps the milliseconds written in the file ``options["path"]`` when its process loaded.

    A stand-in for a host whose speed moves between a profile's passes: a test
    rewrites the file between passes, and only a pass in fresh processes sees it.
    """

    def load_model(self, context: Context) -> Any:
        from pathlib import Path

        self.sleep_s = float(Path(context.options["path"]).read_text()) / 1000.0
        return None

    def inference(self, batch: Any) -> Any:
        import time

        time.sleep(self.sleep_s)
        return batch
