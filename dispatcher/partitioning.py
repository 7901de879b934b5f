"""Splitting an aggregated batch among the instances of a configuration.

A full batch of B gives every instance its configured share ``b_j``. A
partial batch (the timeout fired with n < B requests) is split so that the
slowest instance finishes as early as possible, not first-come: requests go
one at a time to the instance whose estimated latency after taking it is
lowest (water-filling). For latencies that grow with the batch, this greedy
choice minimises the maximum (an exchange argument: any request moved from
the greedy choice lands on an instance that would finish later).
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from optimizer.planning.profile import Profile

#: ``latency(threads, batch) -> ms`` estimate for one instance.
LatencyFn = Callable[[int, int], float]


def threads_latency(threads: int, batch: int) -> float:
    """Estimate without a profile: work proportional to the batch, spread over the threads."""
    return batch / threads


def split(n: int, instances: Sequence[tuple[int, int]], latency: LatencyFn | None = None) -> list[int]:
    """Requests per instance for a batch of ``n``; ``instances`` are ``(threads, batch)``.

    No instance gets more than its configured share, so the sum of shares
    bounds ``n``.
    """
    capacity = sum(b for _, b in instances)
    if n < 0:
        raise ValueError(f"batch size must be >= 0, not {n}")
    if n > capacity:
        raise ValueError(f"batch of {n} exceeds the configuration's capacity {capacity}")
    if n == capacity:
        return [b for _, b in instances]
    estimate = latency or threads_latency
    counts = [0] * len(instances)
    heap = [(estimate(t, 1), j) for j, (t, b) in enumerate(instances) if b > 0]
    heapq.heapify(heap)
    for _ in range(n):
        _, j = heapq.heappop(heap)
        counts[j] += 1
        t, b = instances[j]
        if counts[j] < b:
            heapq.heappush(heap, (estimate(t, counts[j] + 1), j))
    return counts


def profile_latency(table: dict[tuple[int, int], float]) -> LatencyFn:
    """A latency estimate from measured ``{(threads, batch): ms}``.

    Batch sizes between profiled ones are interpolated linearly; threads not
    profiled fall back to the per-thread estimate scaled to the profile.
    """
    by_threads: dict[int, list[tuple[int, float]]] = {}
    for (t, b), ms in table.items():
        by_threads.setdefault(t, []).append((b, ms))
    for points in by_threads.values():
        points.sort()
    # Mean ms per request-per-thread of the profile: puts the fallback for
    # unprofiled thread counts in the profile's units, so it competes fairly.
    ratios = [ms * t / b for (t, b), ms in table.items() if b > 0]
    scale = sum(ratios) / len(ratios) if ratios else 1.0

    def latency(threads: int, batch: int) -> float:
        points = by_threads.get(threads)
        if not points:
            return scale * threads_latency(threads, batch)
        if batch <= points[0][0]:
            return points[0][1] * batch / points[0][0] if batch < points[0][0] else points[0][1]
        for (b0, l0), (b1, l1) in zip(points, points[1:]):
            if batch <= b1:
                return l0 + (l1 - l0) * (batch - b0) / (b1 - b0)
        b_last, l_last = points[-1]
        return l_last * batch / b_last

    return latency


def latency_from_profile(path: str) -> LatencyFn:
    """The latency estimate of a profile file (see ``optimizer.planning.profile``)."""
    profile = Profile.load(path)
    return profile_latency({(e.threads, e.batch): e.mean_ms for e in profile.entries})
