"""Batch aggregation: up to B requests, or fewer once the batch timeout passes.

The same small loop as Ray Serve's ``batching.py``: block for the first
arrival, start the timer then (monotonic clock), keep draining until the batch
is full or the deadline passes. Reads go through a callable so the loop is
tested without Redis.

The timer is kept here, not by Redis: a server wakes a blocked reader at its
deadline only on its next cron tick (``hz`` 10 means up to 100 ms late), so a
5 ms window is spent polling without blocking, and a blocking read is used
only for the part of a long window that ends a tick before the deadline;
unless reads end at their deadline (:mod:`dispatcher.waiting`: the
dispatcher then sets ``server_tick_ms=0`` and never polls). Polling costs CPU that instances on the same cores
would use: one read every 0.2 ms took 31-37% of a core (dispatcher and
Redis) for as long as a partial batch waited, every 1 ms (the dispatcher's
``batch_poll_ms`` where it must poll) 20%, and a batch is then complete at
most that much later than its last request.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: ``read(count, block_ms)`` returns up to ``count`` entries, waiting at most
#: ``block_ms`` for the first one (``None``: do not wait).
Reader = Callable[[int, "int | None"], list[T]]


class Aggregator:
    """Collects one batch at a time from ``read``."""

    def __init__(
        self,
        read: Reader[T],
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        poll_interval_ms: float = 0.2,
        server_tick_ms: float = 100.0,
    ) -> None:
        self.read = read
        self.clock = clock
        self.sleep = sleep
        self.poll_interval_ms = poll_interval_ms
        self.server_tick_ms = server_tick_ms

    def next_batch(self, size: int, timeout_ms: float, idle_block_ms: int = 500) -> list[T]:
        """Up to ``size`` entries; empty when nothing arrived within ``idle_block_ms``.

        ``idle_block_ms`` bounds the wait for the first entry so the caller's
        loop can notice shutdown and configuration changes.
        """
        entries = list(self.read(size, idle_block_ms))
        if not entries or len(entries) >= size:
            return entries
        start = self.clock()
        while len(entries) < size:
            remaining = timeout_ms - (self.clock() - start) * 1000.0
            if remaining <= 0:
                # One last non-blocking drain: what already arrived joins the batch.
                entries.extend(self.read(size - len(entries), None))
                break
            if remaining > 2 * self.server_tick_ms:
                more = self.read(size - len(entries), max(1, math.ceil(remaining - self.server_tick_ms)))
            else:
                more = self.read(size - len(entries), None)
                if not more:
                    self.sleep(min(self.poll_interval_ms, remaining) / 1000.0)
            entries.extend(more)
        return entries
