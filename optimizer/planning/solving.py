"""Choose the instances that serve a batch fastest: ``min max_j L[t_j, b_j]``.

Given a profile ``L[t, b]``, a core budget ``T`` and an aggregated batch ``B``,
find instances ``(t_j, b_j)`` with ``sum b_j = B`` and ``sum t_j <= T`` that
minimise the slowest instance. Instances may differ, batch sizes are any
profiled sizes (``B`` need not be a power of two, only a sum of profiled
sizes), and threads may stay idle when using them would not help.

Why not the textbook table ``opt[t, b] = min over (t', b') of max(L[t', b'],
opt[t - t', b - b'])``? It costs ``O(T^2 * |sizes| * B)``, about 10^9 steps at
T=128, B=8192, and it cannot break ties well: under ``max`` the best
*remainder* is not always part of the best whole (a remainder that is slower
but uses fewer threads can hide under a slow instance), so "fewest threads
among the fastest" does not decompose. Instead we split the problem in two
exact phases:

1. **Latency.** ``V`` is achievable iff the batch can be covered by instances
   that each take ``<= V``, using ``<= T`` threads. For a fixed ``V`` each
   size ``s`` is best run on the fewest threads ``c_V(s)`` with ``L <= V``,
   so the question is an unbounded knapsack over ``b`` only: fewest threads
   whose sizes sum to exactly ``B``. Feasibility is monotone in ``V``, so a
   binary search over the measured latencies finds the optimum ``V*``.
2. **Ties.** At ``V*``, the same knapsack with the lexicographic cost
   (threads, then instances), packed into one int64, picks the configuration
   with the fewest threads, then the fewest instances. Remaining ties go to
   a fixed, deterministic choice.

Both run in ``O(log K * |sizes| * B)`` with each knapsack stage vectorised
over ``b`` (a running minimum per residue class, see ``_cover``), independent
of ``T``. The textbook recursion, kept to check this solver against, is
``tests/reference_solver.py`` (used by the tests and ``benchmarks/bench_optimizer``).
"""
from __future__ import annotations

import math
import operator
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from optimizer.planning.profile import LatencyTable, Profile, ProfileError, as_table, table_fingerprint
from packrat_mq.instances import Configuration, InstanceSpec

__all__ = ["InfeasibleError", "ProfileError", "clear_cache", "solve"]

#: Unreachable marker for the int64 knapsack; sums stay far below it (see ``_cover``).
_INF = np.int64(2**62)
_UNREACHABLE = np.int64(2**61)

_CACHE_SIZE = 1024
_cache: OrderedDict[tuple[bytes, int, int], Configuration] = OrderedDict()
_cache_lock = threading.Lock()

ProfileLike = Profile | LatencyTable | tuple[Sequence[int], Sequence[int], Sequence[Sequence[float]]]


class InfeasibleError(ValueError):
    """No configuration serves this batch within this core budget."""


def solve(profile_or_table: ProfileLike, threads: int, batch: int) -> Configuration:
    """The fastest configuration for ``batch`` requests on at most ``threads`` cores.

    ``profile_or_table`` is a ``Profile`` or a ``(threads, batches, L)`` table
    (NaN where not measured). Among equally fast configurations the one with
    the fewest threads wins, then the one with the fewest instances. The
    result's ``predicted_latency_ms`` is the profiled latency of its slowest
    instance. Results are cached per (profile contents, threads, batch), so a
    repeated call costs microseconds.

    Raises ``ProfileError`` for an empty or malformed profile and
    ``InfeasibleError`` when ``threads < 1``, ``batch < 1``, or no combination
    of profiled sizes covers ``batch`` within ``threads``.
    """
    T, B = _check_budget(threads, batch)
    if isinstance(profile_or_table, Profile):
        table, digest = profile_or_table.table(), profile_or_table.fingerprint()
    else:
        table = _table_of(profile_or_table)
        digest = table_fingerprint(table)
    key = (digest, T, B)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    config = _solve(table, T, B)
    with _cache_lock:
        _cache[key] = config
        if len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return config


def clear_cache() -> None:
    """Forget cached solutions (benchmarks use it to time cold solves)."""
    with _cache_lock:
        _cache.clear()


def _table_of(profile_or_table: ProfileLike) -> LatencyTable:
    if isinstance(profile_or_table, Profile):
        return profile_or_table.table()
    try:
        threads, batches, latency = profile_or_table
    except (TypeError, ValueError):
        raise ProfileError(
            f"expected a Profile or a (threads, batches, latency_ms) table, "
            f"got {type(profile_or_table).__name__}"
        ) from None
    return as_table(threads, batches, latency)


def _check_budget(threads: int, batch: int) -> tuple[int, int]:
    T, B = operator.index(threads), operator.index(batch)
    if T < 1:
        raise InfeasibleError(f"need at least 1 thread, got threads={T}")
    if B < 1:
        raise InfeasibleError(f"need a batch of at least 1 request, got batch={B}")
    return T, B


def _solve(table: LatencyTable, T: int, B: int) -> Configuration:
    t_ok = table.threads <= T
    s_ok = table.batches <= B
    threads = table.threads[t_ok]
    sizes = table.batches[s_ok]
    lat = table.latency_ms[np.ix_(t_ok, s_ok)]
    values = np.unique(lat[np.isfinite(lat)])  # sorted candidate optima

    if values.size == 0 or _min_threads(threads, sizes, lat, values[-1], B) > T:
        raise InfeasibleError(_infeasible_message(table, T, B))

    lo, hi = 0, values.size - 1  # invariant: values[hi] is feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if _min_threads(threads, sizes, lat, values[mid], B) <= T:
            hi = mid
        else:
            lo = mid + 1
    best = values[lo]

    # Phase 2: at the optimal latency, fewest threads, then fewest instances.
    cheapest, usable = _cheapest_threads(threads, lat, best)
    sizes_u, cost_u = sizes[usable], cheapest[usable]
    key = cost_u * np.int64(B + 1) + 1
    value, copies = _cover(sizes_u, key, B, with_pointers=True)
    assert value[B] < _UNREACHABLE and value[B] // (B + 1) <= T

    instances: list[InstanceSpec] = []
    b = B
    for k in range(sizes_u.size - 1, -1, -1):  # backtrack, last stage first
        n = int(copies[k, b])
        instances += [InstanceSpec(threads=int(cost_u[k]), batch=int(sizes_u[k]))] * n
        b -= n * int(sizes_u[k])
    assert b == 0
    instances.sort(key=lambda i: (-i.threads, -i.batch))
    return Configuration(instances=tuple(instances), predicted_latency_ms=float(best))


def _cheapest_threads(
    threads: np.ndarray, lat: np.ndarray, bound: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per size, the fewest profiled threads with ``L <= bound``, and whether any exists."""
    fast = lat <= bound  # NaN compares False: unmeasured points never qualify
    usable = fast.any(axis=0)
    cheapest = threads[fast.argmax(axis=0)].astype(np.int64)
    return cheapest, usable


def _min_threads(
    threads: np.ndarray, sizes: np.ndarray, lat: np.ndarray, bound: float, B: int
) -> int:
    """Fewest threads covering exactly ``B`` with instances no slower than ``bound`` (huge if none)."""
    cheapest, usable = _cheapest_threads(threads, lat, bound)
    value, _ = _cover(sizes[usable], cheapest[usable], B, with_pointers=False)
    return int(value[B])


def _cover(
    sizes: np.ndarray, cost: np.ndarray, batch: int, *, with_pointers: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """Unbounded knapsack: ``value[b]`` = least total cost of sizes summing exactly to ``b``.

    One stage per size ``s`` (cost ``c``) turns the previous ``value`` into
    ``new[i*s + r] = min_{j <= i} value[j*s + r] + (i - j) * c``: laid out as a
    ``(rows, s)`` grid, that is a running minimum down each column of
    ``value - row * c``, so each stage is a handful of vectorised passes.
    ``copies[k, b]`` (int32) is how many instances of size ``k`` the best cover
    of ``b`` uses, for backtracking. Costs are int64; with at most ``batch``
    instances of cost ``<= T * (batch + 1) + 1`` every real sum stays below
    ``_UNREACHABLE``, and anything above it is reset to ``_INF``.
    """
    n = batch + 1
    value = np.full(n, _INF, dtype=np.int64)
    value[0] = 0
    copies = np.zeros((sizes.size, n), dtype=np.int32) if with_pointers else None
    for k in range(sizes.size):
        s, c = int(sizes[k]), np.int64(cost[k])
        rows = -(-n // s)
        grid = np.full(rows * s, _INF, dtype=np.int64)
        grid[:n] = value
        grid = grid.reshape(rows, s)
        offset = np.arange(rows, dtype=np.int64)[:, None] * c
        shifted = grid - offset
        running = np.minimum.accumulate(shifted, axis=0)
        new = running + offset
        new[new >= _UNREACHABLE] = _INF
        value = new.reshape(-1)[:n].copy()
        if copies is not None:
            row = np.arange(rows, dtype=np.int32)[:, None]
            # Latest row attaining the running minimum (fewest copies of this size).
            source = np.maximum.accumulate(np.where(shifted == running, row, 0), axis=0)
            copies[k] = (row - source).reshape(-1)[:n]
    return value, copies


def _infeasible_message(table: LatencyTable, T: int, B: int) -> str:
    within = table.latency_ms[table.threads <= T]
    measured = np.isfinite(within).any(axis=0) if within.size else np.zeros(0, bool)
    sizes = table.batches[measured] if within.size else table.batches[:0]
    shown = "{" + ",".join(str(int(s)) for s in sizes) + "}"
    head = f"batch {B} cannot be covered by profiled batch sizes {shown} within {T} threads"
    if sizes.size == 0:
        return (
            f"{head}: the profile has no measurement with {T} or fewer threads "
            f"(fewest profiled: {int(table.threads[0])})"
        )
    lat = table.latency_ms[np.ix_(table.threads <= T, table.batches <= B)]
    if not np.isfinite(lat).any():
        return f"{head}: every profiled batch size is larger than {B}"
    need = _min_threads(
        table.threads[table.threads <= T], table.batches[table.batches <= B], lat, math.inf, B
    )
    if need >= _UNREACHABLE:
        return f"{head}: no sum of those sizes equals {B}"
    return f"{head}: it needs at least {need} threads"
