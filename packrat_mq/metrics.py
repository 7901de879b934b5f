"""Counting for the metrics: what each process tallies, and how an exporter adds tallies up.

Every process that serves (the dispatcher, each worker instance, the
supervisor) keeps a :class:`Tally` in memory while metrics are on
(``PACKRAT_METRICS_PORT``): counters and fixed-bucket histograms, updated
where the work is done with no Redis command of their own. A process that
does not export them itself publishes its tally as JSON in its live record at
every heartbeat (``metrics`` of :class:`packrat_mq.records.LiveRecord`), and
the exporter of its supervisor adds the tallies of all its processes up with
:class:`Totals`, which keeps the sum monotonic across restarts. So the
request path pays a few list increments per batch, and a process that dies
loses at most the last heartbeat's counts from the metrics (never a reply).

The names here are the families' names without the ``packrat_`` prefix and
unit suffix; :mod:`packrat_mq.exposition` turns them into Prometheus
families. A counter key is the family and its label values joined by ``|``.
"""
from __future__ import annotations

import json
import threading
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from typing import Any

from packrat_mq.protocol import ERROR, error_kind

#: Upper bounds (seconds) of the latency histograms.
LATENCY_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
                                      1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
#: Upper bounds of the batch-size histograms (B is a power of two when planned by the estimator).
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
#: Upper bounds (seconds) of how long a reconfiguration took, decision to old instances stopped.
RECONFIGURATION_BUCKETS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
                                              120.0, 300.0, 600.0)

#: Every histogram a tally may hold, and its bounds.
HISTOGRAMS: dict[str, tuple[float, ...]] = {
    # dispatcher: size of each aggregated batch; each request's wait from its XADD to its fan-out
    "batch_size": BATCH_BUCKETS,
    "dispatch_wait": LATENCY_BUCKETS,
    # worker instances: each sub-batch's size and handler time; each request's queue_ms and end to end
    "sub_batch_size": BATCH_BUCKETS,
    "inference": LATENCY_BUCKETS,
    "queue": LATENCY_BUCKETS,
    "end_to_end": LATENCY_BUCKETS,
    # supervisor: each reconfiguration's total_s
    "reconfiguration": RECONFIGURATION_BUCKETS,
}
DISPATCHER_HISTOGRAMS = ("batch_size", "dispatch_wait")
WORKER_HISTOGRAMS = ("sub_batch_size", "inference", "queue", "end_to_end")
SUPERVISOR_HISTOGRAMS = ("reconfiguration",)


class Histogram:
    """Counts per bucket (not cumulative; the last is +Inf) and the sum of what was observed."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_many(self, values: Iterable[float]) -> None:
        bounds, counts = self.bounds, self.counts
        total = 0.0
        for value in values:
            counts[bisect_left(bounds, value)] += 1
            total += value
        self.sum += total

    @property
    def count(self) -> int:
        return sum(self.counts)


class Tally:
    """Counters and histograms of one process (or the sum of several)."""

    def __init__(self, histograms: Iterable[str] = ()) -> None:
        self.counters: dict[str, float] = {}
        # Created here, never later: a reader in another thread (an exporter) iterates over them.
        self.histograms: dict[str, Histogram] = {name: Histogram(HISTOGRAMS[name]) for name in histograms}

    def count(self, family: str, *labels: str, n: float = 1) -> None:
        key = "|".join((family, *labels)) if labels else family
        self.counters[key] = self.counters.get(key, 0) + n

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def observe_many(self, name: str, values: Iterable[float]) -> None:
        self.histograms[name].observe_many(values)

    # --- copies, sums and JSON ------------------------------------------------
    def copy(self) -> Tally:
        """A copy safe to read while the owner goes on counting in another thread.

        ``dict()`` and ``list()`` copy in one step under the GIL; the sum of a
        histogram may be one batch ahead of or behind its counts, no more.
        """
        out = Tally()
        out.counters = dict(self.counters)
        for name, h in self.histograms.items():
            c = Histogram(h.bounds)
            c.counts, c.sum = list(h.counts), h.sum
            out.histograms[name] = c
        return out

    def add(self, other: Tally) -> None:
        for key, value in other.counters.items():
            self.counters[key] = self.counters.get(key, 0) + value
        for name, h in other.histograms.items():
            mine = self.histograms.get(name)
            if mine is None:
                mine = self.histograms[name] = Histogram(h.bounds)
            if mine.bounds != h.bounds:
                continue  # written with other buckets (another version): not addable
            mine.counts = [a + b for a, b in zip(mine.counts, h.counts)]
            mine.sum += h.sum

    def behind(self, other: Tally) -> bool:
        """Whether some counter of this tally is below ``other``'s (it was reset)."""
        return any(self.counters.get(k, 0) < v for k, v in other.counters.items()) or any(
            name in self.histograms and self.histograms[name].count < h.count
            for name, h in other.histograms.items()
        )

    def dump(self) -> str:
        """JSON, for a live record: ``{"c": {key: n}, "h": {name: [counts, sum]}}``."""
        snap = self.copy()
        return json.dumps({"c": snap.counters,
                           "h": {n: [h.counts, round(h.sum, 6)] for n, h in snap.histograms.items()}},
                          separators=(",", ":"))

    @classmethod
    def load(cls, text: str | bytes | None) -> Tally | None:
        """What :meth:`dump` wrote; ``None`` for nothing or anything unreadable."""
        if not text:
            return None
        try:
            data: Any = json.loads(text)
            out = cls()
            out.counters = {str(k): float(v) for k, v in data.get("c", {}).items()}
            for name, (counts, total) in data.get("h", {}).items():
                bounds = HISTOGRAMS.get(name)
                if bounds is None or len(counts) != len(bounds) + 1:
                    continue  # unknown here, or other buckets
                h = Histogram(bounds)
                h.counts, h.sum = [int(c) for c in counts], float(total)
                out.histograms[name] = h
            return out
        except (ValueError, TypeError, AttributeError):
            return None


def count_replies(tally: Tally, grouped: Mapping[str, list[Mapping[str, Any]]], results: list[Any]) -> None:
    """Count what a reply transaction delivered (:func:`packrat_mq.replies.queue` and ``execute``).

    ``replies`` by status counts replies written; each error reply written counts once in
    ``errors`` by its kind; replies to a ``reply_to`` that is not a stream were not written
    and count as ``errors`` of kind ``undeliverable`` whatever their status.
    """
    # The delivery scripts are queued first: their results come first.
    for group, res in zip(grouped.values(), results):
        if isinstance(res, Exception):
            continue  # the script failed: nothing written, the failure is logged
        if res == -1:
            tally.count("errors", "undeliverable", n=len(group))
            continue
        if res == -2:
            continue  # its guard was set: nothing written
        errors = [fields for fields in group if fields.get("status") == ERROR]
        if len(errors) < len(group):
            tally.count("replies", "ok", n=len(group) - len(errors))
        if errors:
            tally.count("replies", "error", n=len(errors))
            for fields in errors:
                tally.count("errors", error_kind(str(fields.get("error") or "")))


class Totals:
    """The sum of the tallies of several processes, monotonic across their restarts.

    Each source (``dispatcher``, ``instance:<id>``) reports its whole tally,
    since its process started, with its pid. A new pid (the process was
    started again, its tally from zero) or a tally behind the last one
    folds the last one into the base first, so the sum never goes down. An
    exporter reads the sources from several threads (scrapes, the supervisor
    forgetting retired instances): a lock keeps the bookkeeping whole.
    """

    def __init__(self) -> None:
        self._base = Tally()
        self._last: dict[str, tuple[int | None, Tally]] = {}
        self._lock = threading.Lock()

    def update(self, source: str, pid: int | None, tally: Tally) -> None:
        with self._lock:
            prev = self._last.get(source)
            if prev is not None and (prev[0] != pid or tally.behind(prev[1])):
                self._base.add(prev[1])
            self._last[source] = (pid, tally)

    def total(self) -> Tally:
        with self._lock:
            out = Tally()
            out.add(self._base)
            for _, tally in self._last.values():
                out.add(tally)
            return out
