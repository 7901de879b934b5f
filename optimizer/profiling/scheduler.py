"""The profiling scheduler: which (t, b) points to measure, in what order, and when to stop.

:func:`profile_model` measures ``L[t, b]`` of one model over a grid of thread
counts and batch sizes, with one :class:`~optimizer.profiling.child.ProfilingGroup`
of processes per thread count.

**Placement: co-located by default.** Serving runs instances side by side,
sharing caches, memory bandwidth and the CPU time of everything else on the
machine; one instance alone on an idle machine is faster than any instance of
a packed one, and a profile measured that way promised gains that serving did
not deliver. So each point ``(t, b)`` is measured as ``k = T // t`` copies of
the instance ``(t, b)`` (``T``: ``threads_max``, else the allowed physical
cores of the largest socket), placed by :func:`workers.allocation.allocate`
for the configuration ``k x (t, b)`` exactly as the worker would place it and
started exactly as a worker starts (:mod:`optimizer.profiling.child`). The
copies run in lockstep rounds: the parent tells all of them to run the batch
once, each times itself, and the round's sample is the slowest copy, the
batch latency of that configuration; :func:`~optimizer.profiling.statistics.measure`
runs the rounds with the adaptive stopping rule below. ``placement="isolated"``
is the same protocol with ``k = 1``. The profile records its placement and
each entry its ``copies``; a resumed run keeps only points measured with the
copies it would use itself, and refuses a file of the other placement.

**What may be skipped, and why that is safe for the optimizer.** The
optimizer picks instances ``(t_j, b_j)`` with ``sum t_j <= T`` and
``sum b_j = B`` minimising ``max_j L[t_j, b_j]``. Two rules follow:

- *Dominated entries stop early, but are still recorded.* If two instances
  ``(t1, b1) + (t2, b2)`` with ``t1 + t2 = t`` and ``b1 + b2 = b`` are
  predicted faster than ``(t, b)`` is at its lower confidence bound (by
  ``dominance_margin``), any plan using ``(t, b)`` does at least as well with
  the split on the same cores, so the optimizer will never need ``L[t, b]``
  precisely: its timing stops at ``min_iters``. This needs no assumption
  about the model, and the profile stays a full grid (no holes for a solver
  to trip over).
- *Beyond a latency SLO, larger batches are skipped* (``max_latency_ms``,
  off by default). Once the lower confidence bound of ``L[t, b]`` exceeds
  the SLO, no plan meeting the SLO can use ``(t, b)``, nor any ``(t, b')``
  with ``b' > b`` *if latency does not fall as the batch grows at fixed t*,
  which holds for real models (more work on the same cores) but is an
  assumption. Skipped points are missing from the profile (NaN in
  ``Profile.table``), so a profile made with an SLO only plans under it.

Skipping a batch size outright without an SLO is *not* done: a split is
faster than ``(t, b)`` only if it beats a value not yet measured, and the only
safe lower bound on it (``L[t, b/2]``, by monotonicity) is nearly always
below ``L[t/2, b/2]``, so such a rule would almost never fire, and when it
did it would rest on the same assumption.

**Time saved** is reported against a fixed schedule of 10 warm-up + 100
timed iterations per (t, b): ``110 x mean`` per measured point (for an
SLO-skipped point, ``110 x`` the lower bound it was skipped at), plus the
same model-load costs; it is printed and appended to the run log
``<profile>.runs.jsonl`` next to the profile.

**Resuming.** The profile is saved after every point; a rerun with the same
output file skips the points already there (same model, mode and placement;
a co-located point measured with another number of copies, because ``T``
changed, is measured again).

**Passes** (``passes``, ``profile run --passes N``; one by default). A shared
host's speed moves by the minute, and a process's by the luck of its start
(on the 2-vCPU Zen 4 host, 2026-12-05: one served ResNet-50 instance ran its
B=1 batch in 52 ms in one 10 s phase and 67 ms in the next, and 3 of 13
processes ran 25-28% slower than the other 10). A point measured once, in one
process and one stretch of minutes, draws one of those states, and the next
point may draw another: the profile's shape then bends by the host, and its
level is whatever the host was doing then. With ``N`` passes the grid is
measured ``N`` times, each pass in fresh processes, the thread counts in turn
forwards and backwards; a point's mean is the mean of its pass means (each
pass one draw of the host, however many iterations it took), its confidence
interval the wider of the samples' and the pass means' (:func:`_entry_half_width`),
and the entry keeps the pass means (``pass_means_ms``), so their spread says
how much the host moved; the run's summary prints it. Each pass gets
``1/N`` of a point's budget and iterations, and converges at ``rel_ci x
sqrt(N)`` (:meth:`ProfilingOptions.pass_schedule`), so the timed iterations
cost about what one pass did; the model loads and per-batch preparation are
paid ``N`` times. An interrupted run resumes at the first point a pass lacks.
"""
from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.planning.profile import MachineInfo, Profile, ProfileEntry, ProfileError
from optimizer.profiling.child import PointError, ProfilingGroup
from optimizer.profiling.options import (
    ProfilingError,
    ProfilingOptions,
    default_output,
    profile_name,
    run_log_path,
)
from optimizer.profiling.statistics import half_width, measure
from packrat_mq.instances import Configuration
from packrat_mq.topology import Topology
from workers.allocation import AllocationError, CoreAssignment, allocate

#: The reference schedule the adaptive one is compared with.
FIXED_WARMUP, FIXED_ITERS = 10, 100


@dataclass
class ProfilingReport:
    """What one run did; ``profile`` holds every point, old and new."""

    profile: Profile
    path: Path
    measured: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    resumed: int = 0
    #: Points in the file measured with another number of copies, measured again.
    remeasured: int = 0
    load_s: float = 0.0
    measure_s: float = 0.0
    #: Warm-up + timed seconds the fixed schedule would spend on the same points.
    fixed_iterations_s: float = 0.0
    wall_s: float = 0.0
    interrupted: bool = False
    #: Passes over the grid asked for (``ProfilingOptions.passes``).
    passes: int = 1

    def spreads(self) -> list[tuple[float, int, int]]:
        """(spread, t, b) of every point of the profile with several pass means, largest first."""
        found = [(e.pass_spread, e.threads, e.batch) for e in self.profile.entries if e.pass_spread is not None]
        return sorted(((s, t, b) for s, t, b in found if s is not None), reverse=True)

    @property
    def adaptive_s(self) -> float:
        """Model loads plus warm-up and timed iterations of this run."""
        return self.load_s + self.measure_s

    @property
    def fixed_estimate_s(self) -> float:
        """The fixed schedule's time: the same model loads plus 110 iterations per point."""
        return self.load_s + self.fixed_iterations_s

    @property
    def saved_s(self) -> float:
        return self.fixed_estimate_s - self.adaptive_s

    def summary(self) -> str:
        lines = [
            f"{self.profile.model} ({self.profile.mode}, {self.profile.placement}): "
            f"measured {len(self.measured)} points"
            + (f", {self.resumed} already in {self.path}" if self.resumed else "")
            + (f" ({self.remeasured} measured again with another number of copies)" if self.remeasured else "")
            + (f", skipped {len(self.skipped)}" if self.skipped else "")
            + (f", {len(self.failed)} FAILED" if self.failed else "")
            + f" in {self.wall_s:.1f} s; saved to {self.path}"
        ]
        if self.measured:
            iters = sum(m["iterations"] for m in self.measured)
            stops: dict[str, int] = {}
            for m in self.measured:
                stops[m["stop"]] = stops.get(m["stop"], 0) + 1
            saved = max(self.saved_s, 0.0)  # timer overhead can make tiny models "cost" a little
            share = 100.0 * saved / self.fixed_estimate_s if self.fixed_estimate_s > 0 else 0.0
            lines.append(
                f"adaptive schedule: {self.adaptive_s:.1f} s (model loads {self.load_s:.1f} s, "
                f"{iters} timed iterations; stops: "
                + ", ".join(f"{k} {v}" for k, v in sorted(stops.items()))
                + f"); fixed {FIXED_WARMUP}+{FIXED_ITERS} schedule: ~{self.fixed_estimate_s:.1f} s; "
                f"saved ~{saved:.1f} s ({share:.0f}%)"
            )
        spread = self._spread_summary()
        if self.passes > 1 and spread is not None:
            at = spread["max_at"]
            lines.append(
                f"{self.passes} passes: the pass means of a point spread by a median {100 * spread['median']:.1f}% "
                f"and at most {100 * spread['max']:.1f}% (t={at['threads']} b={at['batch']}) of its mean"
                + ("; the host moved between passes: predictions from this profile are good to about as much"
                   if spread["max"] > 0.10 else ""))
        for f in self.failed:
            lines.append(f"FAILED t={f['threads']} b={f['batch']}: {f['error']}")
        if self.interrupted:
            lines.append("interrupted: what was measured is saved; rerun the same command to resume")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.profile.model,
            "mode": self.profile.mode,
            "placement": self.profile.placement,
            "path": str(self.path),
            "measured": self.measured,
            "skipped": self.skipped,
            "failed": self.failed,
            "resumed": self.resumed,
            "remeasured": self.remeasured,
            "load_s": round(self.load_s, 3),
            "adaptive_s": round(self.adaptive_s, 3),
            "fixed_estimate_s": round(self.fixed_estimate_s, 3),
            "saved_s": round(self.saved_s, 3),
            "wall_s": round(self.wall_s, 3),
            "interrupted": self.interrupted,
            "passes": self.passes,
            "pass_spread": self._spread_summary(),
        }

    def _spread_summary(self) -> dict[str, Any] | None:
        spreads = self.spreads()
        if not spreads:
            return None
        worst, t, b = spreads[0]
        median = sorted(s for s, _, _ in spreads)[len(spreads) // 2]
        return {"median": round(median, 4), "max": round(worst, 4), "max_at": {"threads": t, "batch": b}}


def profile_model(
    options: ProfilingOptions,
    output: str | os.PathLike[str] | None = None,
    *,
    topology: Topology | None = None,
    fresh: bool = False,
    progress: bool = True,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> ProfilingReport:
    """Profile ``options.model`` into ``output`` (default ``profiles/<model>.json``).

    Points already in ``output`` are kept and not measured again unless
    ``fresh``. The file is saved after each point, so a ``KeyboardInterrupt``
    loses only the point in progress; the report then has ``interrupted``.
    ``on_point`` is called with each new point (tests use it to interrupt).
    With ``options.passes`` above 1 the grid is measured that many times
    (see the module's "Passes"); a point is kept once it has that many.
    """
    topology = topology or Topology.detect()
    path = Path(output) if output is not None else default_output(options.model, options.graph)
    profile = _load_for_resume(path, options, fresh)
    threads = options.thread_counts(topology)
    placements: dict[int, list[CoreAssignment]] = {}
    for t in threads:
        copies = options.copies(t, topology)
        try:
            placements[t] = allocate(topology, Configuration.uniform(copies, t, options.batches[0]))
        except AllocationError as exc:
            what = f"{copies} copies of {t} threads" if copies > 1 else f"{t} threads"
            raise ProfilingError(f"cannot profile {what}: {exc}") from None

    report = ProfilingReport(profile=profile, path=path, passes=options.passes)
    grid = [(t, b) for t in threads for b in options.batches]
    passes = options.passes

    # The pass means each point already has from the file (measured with this run's copies), and
    # the samples of each pass this run measures: a point's entry is rebuilt from both after each pass.
    before: dict[tuple[int, int], list[float]] = {}
    for t, b in grid:
        entry = profile.entry(t, b)
        if entry is not None and (entry.copies or 1) == len(placements[t]):
            before[(t, b)] = list(entry.pass_means_ms or [entry.mean_ms])
    taken: dict[tuple[int, int], list[list[float]]] = {}

    def known(t: int, b: int) -> int:
        """How many passes of (t, b) are measured, from the file and this run."""
        return len(before.get((t, b), [])) + len(taken.get((t, b), []))

    def kept(t: int, b: int, p: int) -> ProfileEntry | None:
        """The point as it stands, if it already has pass ``p`` (0-based) measured as this run would."""
        entry = profile.entry(t, b)
        return entry if entry is not None and known(t, b) > p else None

    pending = sum(max(0, passes - known(t, b)) for t, b in grid)
    report.resumed = sum(1 for t, b in grid if known(t, b) >= passes)
    report.remeasured = sum(1 for t, b in grid if (t, b) not in before and profile.entry(t, b) is not None)
    upper: dict[tuple[int, int], float] = {}  # best achievable latency bound per (t, b)
    left_out: set[tuple[int, int]] = set()  # skipped or failed in an earlier pass: not measured again
    started = time.monotonic()
    bar = _progress_bar(pending, options.model, progress)
    group: ProfilingGroup | None = None
    try:
        for p in range(passes):
            # Every other pass runs the thread counts the other way round, so that no thread count
            # is always measured at the same point of the run (and of the host's minutes).
            for t in (threads if p % 2 == 0 else threads[::-1]):
                lower_bound = 0.0  # lower bound of L[t, b] for the batches measured so far
                stop_reason: str | None = None
                try:
                    for b in options.batches:
                        existing = kept(t, b, p)
                        alternative = _best_split(t, b, upper, options.batches)
                        if existing is not None:
                            hw = _entry_half_width(existing, options.confidence)
                            upper[(t, b)] = min(existing.mean_ms + hw, alternative)
                            lower_bound = max(lower_bound, existing.mean_ms - hw)
                            if stop_reason is None:
                                stop_reason = _slo_exceeded(options, lower_bound)
                            continue
                        if (t, b) in left_out:
                            bar.update(1)
                            continue
                        if stop_reason is not None:
                            report.skipped.append({"threads": t, "batch": b, "reason": stop_reason})
                            report.fixed_iterations_s += (FIXED_WARMUP + FIXED_ITERS) * lower_bound / 1000.0
                            upper[(t, b)] = alternative
                            left_out.add((t, b))
                            bar.update(1)
                            continue
                        copies = len(placements[t])
                        bar.set_postfix_str(f"t={t} b={b}" + (f" x{copies}" if copies > 1 else "")
                                            + (f" pass {p + 1}/{passes}" if passes > 1 else ""), refresh=True)
                        if group is None:
                            group = ProfilingGroup(options, placements[t])
                            report.load_s += group.start()
                        dominated_above = (
                            alternative * (1.0 + options.dominance_margin) if math.isfinite(alternative) else None
                        )
                        try:
                            report.load_s += group.prepare(b)
                            m = measure(group.run, dominated_above_ms=dominated_above, self_timed=True,
                                        **options.pass_schedule())
                        except PointError as exc:
                            bar.update(1)
                            report.failed.append({"threads": t, "batch": b, "error": str(exc)})
                            left_out.add((t, b))
                            stop_reason = f"failed at batch {b}"
                            continue
                        bar.update(1)
                        stats = m.stats()
                        taken.setdefault((t, b), []).append(m.samples_ms)
                        entry = _entry(t, b, copies, before.get((t, b), []), taken[(t, b)], options.confidence)
                        profile.upsert(entry)
                        profile.save(path)
                        report.measure_s += stats["warmup_s"] + stats["timed_s"]
                        report.fixed_iterations_s += (FIXED_WARMUP + FIXED_ITERS) * stats["mean_ms"] / 1000.0 / passes
                        hw = _entry_half_width(entry, options.confidence)
                        upper[(t, b)] = min(entry.mean_ms + hw, alternative)
                        lower_bound = max(lower_bound, entry.mean_ms - hw)
                        stop_reason = _slo_exceeded(options, lower_bound)
                        point = {"threads": t, "batch": b, "mean_ms": stats["mean_ms"],
                                 "iterations": stats["iterations"], "stop": stats["stop"],
                                 "copies": copies, "cpus": group.cpus}
                        if passes > 1:
                            point.update({"pass": p + 1, "point_mean_ms": entry.mean_ms})
                        report.measured.append(point)
                        if on_point is not None:
                            on_point(point)
                except BaseException:
                    if group is not None:
                        group.kill()  # mid-measurement: do not wait for it to finish
                    raise
                finally:
                    if group is not None:
                        group.close()
                        group = None
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        bar.close()
        report.wall_s = time.monotonic() - started
        _append_run_log(report, options)
    return report


def _entry(t: int, b: int, copies: int, before: list[float], taken: list[list[float]],
           confidence: float) -> ProfileEntry:
    """A point's entry from the pass means it had (``before``, from the file) and this run's passes' samples.

    The mean is the mean of the pass means, each pass weighing the same however many iterations it
    took: a pass is one draw of the host's state (its minute, its processes), and the iterations
    within a pass are not independent draws of that. The distribution fields are of this run's samples.
    """
    pooled = [ms for samples in taken for ms in samples]
    means = before + [sum(samples) / len(samples) for samples in taken]
    x = np.asarray(pooled, dtype=np.float64)
    std = float(x.std(ddof=1)) if x.size > 1 else 0.0
    return ProfileEntry(
        threads=t, batch=b, copies=copies, mean_ms=float(np.mean(means)),
        p50_ms=float(np.percentile(x, 50)), p99_ms=float(np.percentile(x, 99)),
        min_ms=float(x.min()), max_ms=float(x.max()), std_ms=std, iterations=int(x.size),
        pass_means_ms=[round(m, 4) for m in means] if len(means) > 1 else None,
    )


def _load_for_resume(path: Path, options: ProfilingOptions, fresh: bool) -> Profile:
    machine = MachineInfo.current()
    if fresh or not path.exists():
        return Profile(model=profile_name(options.model), mode=options.mode, placement=options.placement,
                       machine=machine)
    try:
        profile = Profile.load(path)
    except ProfileError as exc:
        raise ProfilingError(f"cannot resume from {path}: {exc}; pass --fresh to start over") from None
    if (profile.model, profile.mode) != (profile_name(options.model), options.mode):
        raise ProfilingError(
            f"{path} holds the {profile.mode} profile of {profile.model!r}, not the {options.mode} "
            f"profile of {options.model!r}; choose another -o, or --fresh to overwrite it"
        )
    if profile.placement != options.placement:
        flag = "--co-located" if profile.placement == "co-located" else "--isolated"
        raise ProfilingError(
            f"{path} holds a profile measured {profile.placement}, and this run measures {options.placement}: "
            f"points of both would not make one profile; pass {flag} to resume it, choose another -o, "
            f"or --fresh to overwrite it"
        )
    old = profile.machine
    if old is not None and profile.entries:
        # The host name, and then everything `up` compares (the CPU's name, design and vector
        # extensions, the cores per socket): a VM that hides AVX-512 behind the same family and
        # model runs other kernels, and its points would not be the profile's.
        found = [f"hostname {old.hostname!r}, this is {machine.hostname!r}"] if (
            old.hostname and machine.hostname and old.hostname != machine.hostname) else []
        found += old.differences(machine)
        if found:
            own = default_output(options.model, options.graph)
            beside = (f" (without -o, this machine's profile goes beside it: {own})"
                      if own.resolve() != path.resolve() else "")
            raise ProfilingError(
                f"{path} was measured on another machine ({'; '.join(found)}); points from two machines "
                f"would not make one profile: choose another -o, or --fresh to overwrite it{beside}"
            )
    if profile.machine is None:
        profile.machine = machine
    return profile


def _entry_half_width(entry: ProfileEntry, confidence: float) -> float:
    """The confidence half width of a point's mean: of its samples, or of its pass means where wider.

    The iterations of one pass share the host's minute and processes; on a host whose speed moves
    between passes the pass means are the independent draws, and they spread wider than the
    samples' own interval says.
    """
    within = 0.0
    if entry.std_ms is not None and entry.iterations and entry.iterations >= 2:
        within = half_width(entry.std_ms, entry.iterations, confidence)
    means = entry.pass_means_ms or []
    if len(means) < 2:
        return within
    return max(within, half_width(float(np.std(means, ddof=1)), len(means), confidence))


def _best_split(t: int, b: int, upper: dict[tuple[int, int], float], batches: list[int]) -> float:
    """Best predicted latency of two instances on the same ``t`` cores serving ``b``.

    Uses the bounds in ``upper`` (each already the best of a point and its own
    splits), so deeper splits are covered recursively. ``inf`` if none is known.
    """
    best = math.inf
    sizes = set(batches)
    for t1 in range(1, t // 2 + 1):
        t2 = t - t1
        for b1 in batches:
            b2 = b - b1
            if b1 >= b or b2 not in sizes:
                continue
            u1, u2 = upper.get((t1, b1)), upper.get((t2, b2))
            if u1 is not None and u2 is not None:
                best = min(best, max(u1, u2))
    return best


def _slo_exceeded(options: ProfilingOptions, lower_bound: float) -> str | None:
    if options.max_latency_ms is not None and lower_bound > options.max_latency_ms:
        return f"slower than --max-latency-ms {options.max_latency_ms:g} at a smaller batch"
    return None


def _append_run_log(report: ProfilingReport, options: ProfilingOptions) -> None:
    if not report.measured and not report.skipped and not report.failed:
        return
    record = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "options": options.model_dump(),
        **report.as_dict(),
    }
    record.pop("path", None)
    try:
        log = run_log_path(report.path)
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError:
        pass  # the log is advice; the profile is what matters


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_postfix_str(self, s: str, refresh: bool = True) -> None: ...
    def close(self) -> None: ...


def _progress_bar(total: int, model: str, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=f"profile {model}", unit="point", file=sys.stderr, dynamic_ncols=True)
