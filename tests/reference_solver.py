"""The textbook recursion for ``min max_j L[t_j, b_j]``: the yardstick ``solve`` is checked against.

Not production code: ``optimizer.planning.solving.solve`` is what plans. This
one is kept because it is easy to believe, so the tests
(``tests/test_solving.py``) and the benchmark (``benchmarks/bench_optimizer.py``)
compare ``solve``'s optimum with it. Import it as ``tests.reference_solver``
from the repository root (pytest puts the root on ``sys.path``; so does
``python -m benchmarks.bench_optimizer`` run there).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from optimizer.planning.solving import (
    InfeasibleError,
    ProfileLike,
    _check_budget,
    _infeasible_message,
    _table_of,
)
from packrat_mq.instances import Configuration, InstanceSpec

__all__ = ["solve_reference"]


def solve_reference(profile_or_table: ProfileLike, threads: int, batch: int) -> Configuration:
    """The textbook recursion, memoised: for tests and benchmarks, not for serving.

    ``best(t, b) = min over profiled (t', s) of max(L[t', s], best(t - t', b - s))``
    with ``best(t, 0) = 0`` (left-over threads idle). It returns an optimal
    latency but, unlike ``solve``, no particular one of several tied
    configurations. The cache is filled bottom-up so recursion stays shallow.
    """
    table = _table_of(profile_or_table)
    T, B = _check_budget(threads, batch)
    t_idx, s_idx = np.nonzero(np.isfinite(table.latency_ms))
    candidates = sorted(
        (float(table.latency_ms[i, j]), int(table.threads[i]), int(table.batches[j]))
        for i, j in zip(t_idx, s_idx)
        if table.threads[i] <= T and table.batches[j] <= B
    )

    @functools.lru_cache(maxsize=None)
    def best(t: int, b: int) -> tuple[float, tuple[int, int] | None]:
        if b == 0:
            return 0.0, None
        result: tuple[float, tuple[int, int] | None] = (math.inf, None)
        for lat, ct, cs in candidates:  # ascending latency: stop once none can improve
            if lat >= result[0]:
                break
            if ct <= t and cs <= b:
                value = max(lat, best(t - ct, b - cs)[0])
                if value < result[0]:
                    result = (value, (ct, cs))
        return result

    for b in range(B + 1):
        for t in range(T + 1):
            best(t, b)
    latency, _ = best(T, B)
    if math.isinf(latency):
        raise InfeasibleError(_infeasible_message(table, T, B))
    instances = []
    t, b = T, B
    while b:
        _, step = best(t, b)
        assert step is not None
        instances.append(InstanceSpec(threads=step[0], batch=step[1]))
        t, b = t - step[0], b - step[1]
    instances.sort(key=lambda i: (-i.threads, -i.batch))
    return Configuration(instances=tuple(instances), predicted_latency_ms=latency)
