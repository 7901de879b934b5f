"""What a plan's requests take, waiting included, at a given arrival rate.

The policy chose a smaller B only when its capacity exceeded the arrivals by
a fixed margin (20%). A margin says nothing about latency, and latency is
what B is for: on 16 simulated cores, at 125 requests/s (86% of B=8's
capacity), B=8 served a mean of 94-99 ms, B=16 141 ms and B=32 167 ms
(docs/figures.md), yet B=8 failed the margin and the service sat at B=16,
where the estimate confirms itself (Little's law: a slower B holds more in
the stream, and the stream's length is the estimate). Queueing theory has no
closed form for this dispatcher (batches cut by count or timeout, fed to the
idle instances first, one sub-batch queued behind the one running), so the
rules are simulated as :mod:`dispatcher.dispatcher` applies them:

- Poisson arrivals at ``rate``;
- when some instance is idle, the next batch is the sum of the idle ones'
  shares and goes to them alone; otherwise to those with room (at most
  ``max_waiting`` sub-batches queued behind the running one); when none has
  room, the dispatcher waits for the next instance to finish;
- a batch is cut when it is full or ``timeout_ms`` after the dispatcher
  took its first request;
- a batch is split as :func:`dispatcher.partitioning.split` splits it (the
  fastest next request first), and an instance runs a sub-batch of k in its
  ``latency_ms(k)``, after whatever it holds.

The mean is over a fixed, seeded sequence of arrivals (the same for every
plan compared: common random numbers, so two plans' difference is not the
sequences' noise), the first tenth discarded as warm-up from an empty system.
Checked against closed forms in the tests (M/D/1, batches cut by count) and
against the served means of the adaptive benchmark's static runs
(docs/figures.md). About 5 µs a request: a call of 3,000 arrivals takes
15 ms, so callers keep what they computed (:class:`dispatcher.adaptive.PlannedCapacity`).
"""
from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Arrivals simulated per call: the mean of B=8 at 86% of its capacity on 16 simulated cores varies
#: about 3% from one seed to another at this length.
ARRIVALS = 3000
#: The fraction of the arrivals discarded as the warm-up from an empty system.
WARM_UP = 0.1


@dataclass(frozen=True)
class Server:
    """One instance of a plan: the most it takes at once, and how long a sub-batch of k takes (ms)."""

    share: int
    latency_ms: Callable[[int], float]


def spread(n: int, servers: Sequence[Server]) -> list[int]:
    """Requests per server for a batch of ``n``: the one that serves its next request soonest first."""
    counts = [0] * len(servers)
    heap = [(s.latency_ms(1), j) for j, s in enumerate(servers) if s.share > 0]
    heapq.heapify(heap)
    for _ in range(n):
        _, j = heapq.heappop(heap)
        counts[j] += 1
        if counts[j] < servers[j].share:
            heapq.heappush(heap, (servers[j].latency_ms(counts[j] + 1), j))
    return counts


def arrival_times(rate: float, count: int = ARRIVALS, seed: int = 0) -> list[float]:
    """``count`` Poisson arrival times (ms) at ``rate`` a second; the same seed gives the same gaps, scaled."""
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(count):
        t += rng.expovariate(1.0) * 1000.0 / rate
        times.append(t)
    return times


def mean_latency_ms(servers: Sequence[Server], rate: float, timeout_ms: float, *,
                    count: int = ARRIVALS, seed: int = 0, max_waiting: int = 1) -> float:
    """The mean time from arrival to answer (ms) of requests arriving at ``rate`` a second.

    ``servers``: the plan's instances. Raises ``ValueError`` for no server
    or a rate that is not positive. A rate beyond what the plan serves gives
    a large, finite mean (the queue grows over the arrivals simulated):
    callers compare plans, and such a plan loses.
    """
    if not servers or sum(s.share for s in servers) <= 0:
        raise ValueError("a plan needs at least one instance with a share")
    if rate <= 0:
        raise ValueError(f"the arrival rate must be positive, not {rate}")
    arrivals = arrival_times(rate, count, seed)
    n = len(arrivals)
    done = [0.0] * n
    # Per server, the finish times of what it holds (the running sub-batch and those queued behind it).
    holds: list[list[float]] = [[] for _ in servers]
    now, i = 0.0, 0
    while i < n:
        for held in holds:
            while held and held[0] <= now:
                held.pop(0)
        idle = [j for j, held in enumerate(holds) if not held]
        serve = idle or [j for j, held in enumerate(holds) if len(held) <= max_waiting]
        if not serve:
            now = min(held[0] for held in holds if held)  # a worker's wake-up: the next to finish
            continue
        size = sum(servers[j].share for j in serve)
        now = max(now, arrivals[i])  # the dispatcher blocks for the first request
        last = i + size - 1
        if last < n and arrivals[last] <= now + timeout_ms:
            take, now = size, max(now, arrivals[last])  # full: cut at once, or when the last arrives
        else:
            deadline = now + timeout_ms
            take = 0
            while i + take < n and take < size and arrivals[i + take] <= deadline:
                take += 1
            now = deadline
        at = i
        for j, k in zip(serve, spread(take, [servers[j] for j in serve])):
            if not k:
                continue
            held = holds[j]
            finish = max(now, held[-1] if held else now) + servers[j].latency_ms(k)
            held.append(finish)
            for r in range(at, at + k):
                done[r] = finish - arrivals[r]
            at += k
        i += take
    kept = done[int(n * WARM_UP):]
    return sum(kept) / len(kept)
