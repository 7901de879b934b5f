"""Models for testing the serving path without torch: ``echo`` and ``sleep``."""
from __future__ import annotations

import base64
import time
from typing import Any

from packrat_mq.handler import BadRequest, BaseHandler, Context, Input
from packrat_mq.protocol import decode_payload


class EchoHandler(BaseHandler):
    """Returns each request's payload unchanged (decoded, then re-encoded)."""

    traceable = False

    def load_model(self, context: Context) -> Any:
        return None

    def example_batch(self, n: int) -> list[Input]:
        return [Input(id=str(i), data={"echo": i}, content_type="application/json") for i in range(n)]

    def inference(self, batch: Any) -> Any:
        return batch


class SleepHandler(BaseHandler):
    """Sleeps per batch, for testing scheduling and flow control.

    The batch sleeps ``base_ms + per_item_ms * len(batch)`` (context options,
    defaults 10 ms and 0 ms), or the largest ``{"sleep_ms": x}`` found in its
    requests. Replies with ``{"slept_ms": ..., "batch": n}``.

    Any other payload (an ``.npy`` array, text, bytes) is accepted and only
    sleeps: a stand-in for a real model's input when measuring the serving
    path (``benchmarks/bench_payload.py`` sends it 600 KB images). With the
    option ``copy_inputs`` (true) it first copies each array into one batch,
    as a vision model's ``preprocess`` does, so that the copy a real model
    makes of its inputs is in the measured batch as it would be. With the
    options ``reply`` (a payload, base64) and ``reply_content_type`` it
    answers every request with that payload's value instead, so the worker
    encodes what the model it stands in for would send
    (:func:`optimizer.calibration.measure_path`).
    """

    traceable = False

    def load_model(self, context: Context) -> Any:
        self.base_ms = float(context.options.get("base_ms", 10.0))
        self.per_item_ms = float(context.options.get("per_item_ms", 0.0))
        self.copy_inputs = str(context.options.get("copy_inputs", "")).lower() in ("1", "true", "yes")
        self.reply: Any = None
        if context.options.get("reply") is not None:
            content_type = str(context.options.get("reply_content_type", "application/json"))
            self.reply = decode_payload(content_type, base64.b64decode(context.options["reply"]))
        return None

    def example_batch(self, n: int) -> list[Input]:
        return [Input(id=str(i), data={}, content_type="application/json") for i in range(n)]

    def validate(self, item: Input) -> None:
        data = item.data
        if not isinstance(data, dict):
            return  # any other input is a stand-in payload: it only sleeps
        ms = data.get("sleep_ms", 0)
        if not isinstance(ms, (int, float)) or isinstance(ms, bool) or not 0 <= ms <= 60_000:
            raise BadRequest("sleep_ms must be a number of milliseconds between 0 and 60000")

    def preprocess(self, items: list[Input]) -> Any:
        batch = [item.data for item in items]
        if self.copy_inputs:
            import numpy as np

            arrays = [d for d in batch if isinstance(d, np.ndarray)]
            if arrays and len({a.shape for a in arrays}) == 1:
                np.stack(arrays)  # the copy a vision model's batch tensor makes, then dropped
        return batch

    def inference(self, batch: Any) -> Any:
        asked = [d.get("sleep_ms", 0) for d in batch if isinstance(d, dict)]
        ms = max(asked) if asked and max(asked) > 0 else self.base_ms + self.per_item_ms * len(batch)
        time.sleep(ms / 1000.0)
        if self.reply is not None:
            return [self.reply for _ in batch]
        return [{"slept_ms": ms, "batch": len(batch)} for _ in batch]
