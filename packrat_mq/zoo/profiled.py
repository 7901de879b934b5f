"""``profiled``: a model that sleeps as long as a profile says its batch takes.

For simulating a machine this one is not (``up --simulate-cores N``): an
instance of ``t`` threads given a batch of ``b`` sleeps ``L[t, b] x
time_scale`` milliseconds, ``L`` read from a profile JSON (``-o
profile=PATH -o time_scale=0.1``). Sleeping costs no CPU, so 64 "cores" of
instances fit on 2 real ones, and the dispatcher, the planning and a
reconfiguration see the latencies a 16- or 64-core server would have.

``t`` is the instance's own thread count (``context.threads``); ``b`` is the
length of the batch it is handed, not ``context.batch_size``: a
reconfiguration may change an instance's share without restarting it.

The zoo sits on the core alone and may not import the optimizer, so the
profile's file is read here with :mod:`json`, and only its entries'
``threads``, ``batch`` and ``mean_ms`` (or ``latency_ms``) are used; a file
``optimizer.planning.profile.Profile.save`` writes is such a file.
"""
from __future__ import annotations

import bisect
import json
import math
import time
from pathlib import Path
from typing import Any

from packrat_mq.handler import BaseHandler, Context, Input


class ProfiledHandler(BaseHandler):
    """Sleeps ``L[t, b] x time_scale`` ms per batch; replies ``{"slept_ms", "batch", "threads"}``.

    Options: ``profile`` (a profile JSON, required) and ``time_scale``
    (default 1.0). Between profiled batch sizes the latency is linear in
    ``b``; below the smallest it is the smallest's; beyond the largest it
    grows in proportion, ``L[t, b_max] x b / b_max`` (several batches of
    ``b_max`` one after another). A thread count the profile lacks, or a
    missing or unreadable profile, fails ``initialize`` with a message that
    says which. Any payload is accepted; its content is not looked at.
    """

    traceable = False

    def load_model(self, context: Context) -> Any:
        path = context.options.get("profile")
        if not path or not isinstance(path, str):
            raise ValueError("the profiled model needs a profile: -o profile=PATH (a profile JSON)")
        scale = context.options.get("time_scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
            raise ValueError(f"time_scale must be a number >= 0, got {scale!r}")
        self.time_scale = float(scale)
        self.threads = context.threads
        self.sizes, self.latencies = _row(read_latencies(path), context.threads, path)
        return None

    def rethread(self, context: Context) -> None:
        """A re-threaded instance sleeps its new thread count's row."""
        super().rethread(context)
        self.load_model(context)

    def latency_ms(self, batch: int) -> float:
        """``L[t, batch]`` of this instance's ``t``, in profile milliseconds (before ``time_scale``)."""
        sizes, lat = self.sizes, self.latencies
        if batch <= sizes[0]:
            return lat[0]
        if batch >= sizes[-1]:
            return lat[-1] * batch / sizes[-1]
        hi = bisect.bisect_left(sizes, batch)
        if sizes[hi] == batch:
            return lat[hi]
        lo = hi - 1
        return lat[lo] + (lat[hi] - lat[lo]) * (batch - sizes[lo]) / (sizes[hi] - sizes[lo])

    def example_batch(self, n: int) -> list[Input]:
        return [Input(id=str(i), data={}, content_type="application/json") for i in range(n)]

    def inference(self, batch: Any) -> Any:
        ms = self.latency_ms(len(batch)) * self.time_scale
        time.sleep(ms / 1000.0)
        return [{"slept_ms": ms, "batch": len(batch), "threads": self.threads} for _ in batch]


def read_latencies(path: str | Path) -> dict[tuple[int, int], float]:
    """``{(threads, batch): ms}`` from a profile JSON's ``entries``; ``ValueError`` naming the file if it cannot."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"no profile at {path} (-o profile=PATH)") from None
    except OSError as exc:
        raise ValueError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"profile {path} is not valid JSON: {exc}") from None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"profile {path} has no entries (expected {{\"entries\": [{{\"threads\", \"batch\", "
                         f"\"mean_ms\"}}, ...]}})")
    table: dict[tuple[int, int], float] = {}
    for i, entry in enumerate(entries):
        try:
            t, b = entry["threads"], entry["batch"]
            ms = entry.get("mean_ms", entry.get("latency_ms"))
            ok = (all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (t, b))
                  and isinstance(ms, (int, float)) and not isinstance(ms, bool) and math.isfinite(ms) and ms > 0)
        except (TypeError, KeyError, AttributeError):
            ok = False
        if not ok:
            raise ValueError(f"profile {path}: entries[{i}] needs threads and batch (integers >= 1) and a "
                             f"positive mean_ms, got {entry!r}")
        table[(t, b)] = float(ms)
    return table


def _row(table: dict[tuple[int, int], float], threads: int, path: str | Path) -> tuple[list[int], list[float]]:
    """The profiled batch sizes and latencies of ``threads``, sorted by batch size."""
    row = sorted((b, ms) for (t, b), ms in table.items() if t == threads)
    if not row:
        have = sorted({t for t, _ in table})
        raise ValueError(f"profile {path} has no entries for {threads} threads (it has threads "
                         f"{', '.join(map(str, have))}); serve instances of those thread counts")
    return [b for b, _ in row], [ms for _, ms in row]
