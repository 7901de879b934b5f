"""Whether a profile still says what this machine serves: served batch times against the profile's.

The machine check of :func:`optimizer.planning.selection.machine_warning`
compares what a profile records of its machine (CPU model, cores per socket)
with this one. That misses the commonest drift on shared and cloud machines:
the same CPU model string, a slower host. On the development VM a
ResNet-50 profiled at 47 ms (TorchScript, 2 threads, B=1) served 90 ms two
days later, under the same "Intel(R) Xeon(R) Processor"; every figure planned
from it (the estimator's capacities, a benchmark's rates) was 1.9x off and
nothing said so.

So the instances measure what they serve: each keeps the median
``inference_ms`` of its recent sub-batches run back to back, of the size most
of them had (at its own t), in its live record, and the supervisor compares them with the
profile's latency at the same (t, b), here. The check is a ratio (served / profiled, the median
over the instances measured) and a verdict against a tolerance, nothing
more: it does not re-plan (the optimizer's choice moves little under a
uniform slow-down, and a warning is what an operator can act on).
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from optimizer.planning.profile import Profile

#: Served over profiled beyond this factor either way is worth a warning: co-located profiles
#: predicted serving within about 10% on a quiet machine (docs/figures.md), the rest is noise.
DEFAULT_TOLERANCE = 1.25
#: Full-size sub-batches an instance must have served before its median counts.
MIN_BATCHES = 5


@dataclass(frozen=True)
class Served:
    """What one instance measured: the median time of its last full-size sub-batches."""

    instance: str
    threads: int
    batch: int
    served_ms: float
    batches: int


@dataclass(frozen=True)
class Point:
    """One instance's served time next to the profile's at its (t, b)."""

    instance: str
    threads: int
    batch: int
    served_ms: float
    profiled_ms: float

    @property
    def ratio(self) -> float:
        return self.served_ms / self.profiled_ms


@dataclass(frozen=True)
class ProfileCheck:
    """The comparison: ``ratio`` is None until an instance has served enough full batches."""

    points: tuple[Point, ...]
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def ratio(self) -> float | None:
        return statistics.median(p.ratio for p in self.points) if self.points else None

    def by_threads(self) -> dict[int, float]:
        """The ratio per instance thread count measured (the median over that count's instances).

        One ratio for the node is wrong for the layouts it is not measured
        on: instances of several threads lose most when the path's processes
        take a time slice (every thread stalls at the next barrier). On the
        Zen 4 host (12-05) one 2-thread instance served 0.86x the profile's
        time and two 1-thread ones 0.72x; read off the 1-thread instances, B=4
        (one 2-thread instance) was planned at 23.9 requests/s against the
        19.9 it served.
        """
        counts: dict[int, list[float]] = {}
        for p in self.points:
            counts.setdefault(p.threads, []).append(p.ratio)
        return {t: statistics.median(r) for t, r in counts.items()}

    @property
    def off(self) -> bool:
        """Whether serving is slower or faster than the profile by more than the tolerance."""
        r = self.ratio
        return r is not None and (r > self.tolerance or r < 1 / self.tolerance)

    def describe(self) -> str:
        r = self.ratio
        if r is None:
            return "not measured yet"
        worst = max(self.points, key=lambda p: abs(p.ratio - 1))
        return (f"served {r:.2f}x the profile's latencies over {len(self.points)} instance(s); e.g. "
                f"{worst.instance} ({worst.threads}x{worst.batch}) {worst.served_ms:.1f} ms against "
                f"{worst.profiled_ms:.1f} ms")


def check_profile(profile: Profile, served: Iterable[Served], *, tolerance: float = DEFAULT_TOLERANCE,
                  min_batches: int = MIN_BATCHES) -> ProfileCheck:
    """Compare each instance's served time with the profile's at its (t, b); points the profile lacks are left out."""
    points = []
    for s in served:
        if s.batches < min_batches or s.served_ms <= 0:
            continue
        entry = profile.entry(s.threads, s.batch)
        if entry is None or entry.mean_ms <= 0:
            continue
        points.append(Point(s.instance, s.threads, s.batch, s.served_ms, entry.mean_ms))
    return ProfileCheck(tuple(points), tolerance)
