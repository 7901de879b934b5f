"""Adaptive stopping: time a function until its mean latency is known well enough.

After ``warmup`` untimed iterations, :func:`measure` times ``run()`` (or
takes the latency that ``run()`` reports itself: the profiler's rounds are
timed by the processes that ran them, and a round's sample is the slowest
one) until the mean is known within ``rel_ci`` at ``confidence``: Student t on the
sample standard deviation, with exact t quantiles from the closed-form CDF
for integer degrees of freedom (no scipy), bounded by ``min_iters`` /
``max_iters`` and a time budget. A caller that knows a point will not be
needed precisely (the scheduler's dominance rule) passes a threshold above
which timing stops at ``min_iters``.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist
from typing import Any

import numpy as np


@lru_cache(maxsize=4096)
def t_quantile(confidence: float, df: int) -> float:
    """Two-sided Student-t critical value: ``P(|T_df| <= x) = confidence``.

    >>> round(t_quantile(0.95, 4), 3), round(t_quantile(0.95, 30), 3)
    (2.776, 2.042)
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df > 1000:
        return NormalDist().inv_cdf((1.0 + confidence) / 2.0)
    lo, hi = 0.0, 1.0
    while _t_two_sided_cdf(hi, df) < confidence:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if _t_two_sided_cdf(mid, df) < confidence:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10 * hi:
            break
    return (lo + hi) / 2.0


def _t_two_sided_cdf(x: float, df: int) -> float:
    """``P(|T| <= x)`` for integer ``df`` (closed form, Abramowitz & Stegun 26.7.3/4)."""
    theta = math.atan(x / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    s = math.sin(theta)
    if df % 2 == 1:
        if df == 1:
            return 2.0 * theta / math.pi
        term, total = 1.0, 1.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return 2.0 / math.pi * (theta + s * math.cos(theta) * total)
    term, total = 1.0, 1.0
    for k in range(1, df // 2):
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return s * total


def half_width(std: float, n: int, confidence: float) -> float:
    """Half width of the confidence interval of a mean of ``n`` samples."""
    if n < 2:
        return math.inf
    return t_quantile(confidence, n - 1) * std / math.sqrt(n)


@dataclass
class Measurement:
    """Timed iterations of one (t, b) and why timing stopped."""

    samples_ms: list[float]
    stop: str
    warmup_s: float
    timed_s: float
    confidence: float

    @property
    def n(self) -> int:
        return len(self.samples_ms)

    def stats(self) -> dict[str, Any]:
        x = np.asarray(self.samples_ms, dtype=np.float64)
        std = float(x.std(ddof=1)) if x.size > 1 else 0.0
        return {
            "mean_ms": float(x.mean()),
            "p50_ms": float(np.percentile(x, 50)),
            "p99_ms": float(np.percentile(x, 99)),
            "min_ms": float(x.min()),
            "max_ms": float(x.max()),
            "std_ms": std,
            "iterations": int(x.size),
            "half_width_ms": half_width(std, int(x.size), self.confidence) if x.size > 1 else None,
            "stop": self.stop,
            "warmup_s": self.warmup_s,
            "timed_s": self.timed_s,
        }


def measure(
    run: Callable[[], object],
    *,
    warmup: int,
    min_iters: int,
    max_iters: int,
    rel_ci: float,
    confidence: float,
    budget_s: float,
    dominated_above_ms: float | None = None,
    min_timed_s: float = 0.0,
    self_timed: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> Measurement:
    """Warm up, then time ``run()`` until the mean is known well enough.

    With ``self_timed``, ``run()`` returns the iteration's latency in
    milliseconds, and that is the sample (the wall time around the call, which
    includes talking to the processes that ran it, is not); ``clock`` still
    keeps the budget.

    Stops (never before ``min_iters``) when the confidence interval's half
    width is within ``rel_ci`` of the mean and the timed iterations have
    lasted ``min_timed_s`` (``converged``), when the lower
    bound exceeds ``dominated_above_ms`` (``dominated``: the optimizer will
    not use this point, see :mod:`optimizer.profiling.scheduler`), when
    ``budget_s`` since the start of warm-up is spent (``budget``), or at
    ``max_iters``.

    Why ``min_timed_s``: the interval assumes independent samples, and a
    shared host's are not: its speed moves in spells of seconds. On the Zen 3
    host (2026-12-07) BERT's point (2, 2) converged in its 5 iterations, 1.75 s
    with a spread of 4 ms, where its neighbours' spreads were 26-245 ms: one
    quiet spell, and the profile put it at 350 ms where serving took 517 (the
    same point's miss, +46%, as on 12-06). Five tight samples of one spell say
    nothing of the next; a point must cover a few seconds of the host.
    """
    start = clock()
    for _ in range(warmup):
        run()
    timed_start = clock()
    samples: list[float] = []
    mean = m2 = 0.0  # Welford's running mean and sum of squares
    stop = "max_iters"
    while len(samples) < max_iters:
        t0 = clock()
        reported = run()
        ms = float(reported) if self_timed else (clock() - t0) * 1000.0  # type: ignore[arg-type]
        samples.append(ms)
        n = len(samples)
        delta = ms - mean
        mean += delta / n
        m2 += delta * (ms - mean)
        if n < min_iters:
            continue
        hw = half_width(math.sqrt(m2 / (n - 1)), n, confidence) if n > 1 else math.inf
        if hw <= rel_ci * mean and clock() - timed_start >= min_timed_s:
            stop = "converged"
            break
        if dominated_above_ms is not None and mean - hw > dominated_above_ms:
            stop = "dominated"
            break
        if clock() - start >= budget_s:
            stop = "budget"
            break
    end = clock()
    return Measurement(samples, stop, timed_start - start, end - timed_start, confidence)
