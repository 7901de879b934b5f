"""The profiler: measure ``L[t, b]`` of one model the way it is served.

Every measurement runs in a fresh child process (``python -m
optimizer.profiling.scheduler child SPEC``) started with :func:`workers.allocation.thread_env`
in its environment, so OpenMP/MKL size their pools before torch is imported,
and pinned to ``t`` physical cores of one socket by
:func:`workers.allocation.allocate` on a one-instance configuration. The child
loads the handler exactly as a worker does (``load_handler``, then
``initialize(Context(...))``) and times ``handler.handle(items)`` on
``example_batch(b)``: preprocess + inference + postprocess, the serving path.

**One child per thread count, not per (t, b).** What must be fresh for each
``t`` is the process: thread pools and affinity are fixed when torch starts.
Within one ``t`` a new batch size only changes input shapes, and warm-up
iterations at that size absorb the new shapes' one-off costs (oneDNN
primitives, allocator growth). Loading a model (torch import, weights, and in
graph mode a trace) costs 1-10 s, often more than measuring one (t, b), so a
child per (t, b) would multiply the load cost by the number of batch sizes for
nothing. In graph mode the child re-traces at each ``b`` from weights loaded
once, because a served instance is traced at its own batch size. The parent
drives the child over stdin/stdout (one JSON request, one JSON result line),
so every scheduling decision stays in the parent.

**Adaptive stopping.** After ``warmup`` untimed iterations, a (t, b) is timed
until its mean is known within ``rel_ci`` at ``confidence`` (Student t on the
sample standard deviation; exact t quantiles from the closed-form CDF for
integer degrees of freedom, no scipy), bounded by ``min_iters``/``max_iters``
and a per-(t, b) time budget.

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
output file skips the points already there (same model and mode).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from statistics import NormalDist
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from optimizer.planning.profile import Profile, ProfileEntry
    from packrat_mq.topology import Topology

#: The reference schedule the adaptive one is compared with.
FIXED_WARMUP, FIXED_ITERS = 10, 100
_REPO_ROOT = Path(__file__).resolve().parent.parent


class ProfilingError(RuntimeError):
    """The profiler could not run (bad options, a child that would not start)."""


# ---------------------------------------------------------------------------
# statistics


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
        import numpy as np

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
    clock: Callable[[], float] = time.perf_counter,
) -> Measurement:
    """Warm up, then time ``run()`` until the mean is known well enough.

    Stops (never before ``min_iters``) when the confidence interval's half
    width is within ``rel_ci`` of the mean (``converged``), when the lower
    bound exceeds ``dominated_above_ms`` (``dominated``: the optimizer will
    not use this point, see the module docstring), when ``budget_s`` since
    the start of warm-up is spent (``budget``), or at ``max_iters``.
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
        run()
        ms = (clock() - t0) * 1000.0
        samples.append(ms)
        n = len(samples)
        delta = ms - mean
        mean += delta / n
        m2 += delta * (ms - mean)
        if n < min_iters:
            continue
        hw = half_width(math.sqrt(m2 / (n - 1)), n, confidence) if n > 1 else math.inf
        if hw <= rel_ci * mean:
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


# ---------------------------------------------------------------------------
# options


def power_of_two_batches(max_batch: int) -> list[int]:
    """``1, 2, 4, ...`` up to ``max_batch`` (included even if not a power of two)."""
    if max_batch < 1:
        raise ValueError(f"max batch must be >= 1, got {max_batch}")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return out


class ProfilingOptions(BaseModel):
    """What to profile and how precisely; JSON-able for the child and for RQ jobs."""

    model_config = ConfigDict(extra="forbid")

    model: str
    #: Thread counts; None means ``1..threads_max``.
    threads: list[int] | None = None
    #: None means the allowed physical cores of the largest socket.
    threads_max: int | None = Field(default=None, ge=1)
    batches: list[int] = Field(default_factory=lambda: power_of_two_batches(32))
    graph: bool = False
    options: dict[str, Any] = Field(default_factory=dict)
    rel_ci: float = Field(default=0.02, gt=0, lt=1)
    confidence: float = Field(default=0.95, gt=0, lt=1)
    min_iters: int = Field(default=5, ge=2)
    max_iters: int = Field(default=100, ge=2)
    warmup: int = Field(default=3, ge=0)
    budget_s: float = Field(default=30.0, gt=0)
    max_latency_ms: float | None = Field(default=None, gt=0)
    dominance_margin: float = Field(default=0.05, ge=0)
    #: A child that says nothing for this long is killed.
    child_timeout_s: float = Field(default=1800.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> ProfilingOptions:
        if self.max_iters < self.min_iters:
            raise ValueError(f"max_iters ({self.max_iters}) must be >= min_iters ({self.min_iters})")
        for name, values in (("batches", self.batches), ("threads", self.threads or [1])):
            if not values or any(v < 1 for v in values):
                raise ValueError(f"{name} must be positive integers, got {values}")
        self.batches = sorted(set(self.batches))
        if self.threads is not None:
            self.threads = sorted(set(self.threads))
        return self

    @property
    def mode(self) -> Literal["eager", "graph"]:
        return "graph" if self.graph else "eager"

    def thread_counts(self, topology: Topology) -> list[int]:
        if self.threads is not None:
            return list(self.threads)
        top = self.threads_max or topology.max_cores_per_socket
        return list(range(1, top + 1))


def profile_name(model: str) -> str:
    """The profile's model name: a zoo name as is, ``module:Class`` as ``module.Class``."""
    return model.replace(":", ".")


def default_output(model: str, graph: bool = False, directory: str | os.PathLike[str] = "profiles") -> Path:
    """``profiles/<model>.json`` (eager) or ``profiles/<model>.graph.json``."""
    name = profile_name(model)
    return Path(directory) / (f"{name}.graph.json" if graph else f"{name}.json")


def run_log_path(profile_path: Path) -> Path:
    """Where each run's schedule and time saved are appended (not ``*.json``: not a profile)."""
    return profile_path.with_name(profile_path.name.removesuffix(".json") + ".runs.jsonl")


# ---------------------------------------------------------------------------
# the parent: schedule, children, resume


@dataclass
class ProfilingReport:
    """What one run did; ``profile`` holds every point, old and new."""

    profile: Profile
    path: Path
    measured: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    resumed: int = 0
    load_s: float = 0.0
    measure_s: float = 0.0
    #: Warm-up + timed seconds the fixed schedule would spend on the same points.
    fixed_iterations_s: float = 0.0
    wall_s: float = 0.0
    interrupted: bool = False

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
            f"{self.profile.model} ({self.profile.mode}): measured {len(self.measured)} points"
            + (f", {self.resumed} already in {self.path}" if self.resumed else "")
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
        for f in self.failed:
            lines.append(f"FAILED t={f['threads']} b={f['batch']}: {f['error']}")
        if self.interrupted:
            lines.append("interrupted: what was measured is saved; rerun the same command to resume")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.profile.model,
            "mode": self.profile.mode,
            "path": str(self.path),
            "measured": self.measured,
            "skipped": self.skipped,
            "failed": self.failed,
            "resumed": self.resumed,
            "load_s": round(self.load_s, 3),
            "adaptive_s": round(self.adaptive_s, 3),
            "fixed_estimate_s": round(self.fixed_estimate_s, 3),
            "saved_s": round(self.saved_s, 3),
            "wall_s": round(self.wall_s, 3),
            "interrupted": self.interrupted,
        }


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
    """
    from optimizer.planning.profile import ProfileEntry
    from packrat_mq.instances import Configuration
    from workers.allocation import AllocationError, allocate
    from packrat_mq.topology import Topology

    topology = topology or Topology.detect()
    path = Path(output) if output is not None else default_output(options.model, options.graph)
    profile = _load_for_resume(path, options, fresh)
    threads = options.thread_counts(topology)
    placements: dict[int, tuple[int, ...]] = {}
    for t in threads:
        try:
            (assignment,) = allocate(topology, Configuration.uniform(1, t, 1))
        except AllocationError as exc:
            raise ProfilingError(f"cannot profile {t} threads: {exc}") from None
        placements[t] = assignment.cpus

    report = ProfilingReport(profile=profile, path=path)
    grid = [(t, b) for t in threads for b in options.batches]
    pending = sum(1 for t, b in grid if profile.entry(t, b) is None)
    report.resumed = len(grid) - pending
    upper: dict[tuple[int, int], float] = {}  # best achievable latency bound per (t, b)
    started = time.monotonic()
    bar = _progress_bar(pending, options.model, progress)
    child: _Child | None = None
    try:
        for t in threads:
            lower_bound = 0.0  # lower bound of L[t, b] for the batches measured so far
            stop_reason: str | None = None
            try:
                for b in options.batches:
                    existing = profile.entry(t, b)
                    alternative = _best_split(t, b, upper, options.batches)
                    if existing is not None:
                        hw = _entry_half_width(existing, options.confidence)
                        upper[(t, b)] = min(existing.mean_ms + hw, alternative)
                        lower_bound = max(lower_bound, existing.mean_ms - hw)
                        if stop_reason is None:
                            stop_reason = _slo_exceeded(options, lower_bound)
                        continue
                    if stop_reason is not None:
                        report.skipped.append({"threads": t, "batch": b, "reason": stop_reason})
                        report.fixed_iterations_s += (FIXED_WARMUP + FIXED_ITERS) * lower_bound / 1000.0
                        upper[(t, b)] = alternative
                        bar.update(1)
                        continue
                    bar.set_postfix_str(f"t={t} b={b}", refresh=True)
                    if child is None:
                        child = _Child(options, t, placements[t])
                        report.load_s += child.start()
                    dominated_above = (
                        alternative * (1.0 + options.dominance_margin) if math.isfinite(alternative) else None
                    )
                    result = child.measure(b, dominated_above)
                    bar.update(1)
                    report.load_s += result.get("setup_s", 0.0)
                    if result.get("event") != "result":
                        report.failed.append({"threads": t, "batch": b, "error": result.get("message", "?")})
                        stop_reason = f"failed at batch {b}"
                        continue
                    entry = ProfileEntry(**{k: result[k] for k in ProfileEntry.model_fields if k in result})
                    profile.upsert(entry)
                    profile.save(path)
                    report.measure_s += result["warmup_s"] + result["timed_s"]
                    report.fixed_iterations_s += (FIXED_WARMUP + FIXED_ITERS) * entry.mean_ms / 1000.0
                    hw = result["half_width_ms"] or 0.0
                    upper[(t, b)] = min(entry.mean_ms + hw, alternative)
                    lower_bound = max(lower_bound, entry.mean_ms - hw)
                    stop_reason = _slo_exceeded(options, lower_bound)
                    point = {k: result[k] for k in ("threads", "batch", "mean_ms", "iterations", "stop")}
                    point["cpus"] = list(placements[t])
                    report.measured.append(point)
                    if on_point is not None:
                        on_point(point)
            except BaseException:
                if child is not None:
                    child.kill()  # mid-measurement: do not wait for it to finish
                raise
            finally:
                if child is not None:
                    child.close()
                    child = None
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        bar.close()
        report.wall_s = time.monotonic() - started
        _append_run_log(report, options)
    return report


def _load_for_resume(path: Path, options: ProfilingOptions, fresh: bool) -> Profile:
    from optimizer.planning.profile import MachineInfo, Profile, ProfileError

    machine = MachineInfo.current()
    if fresh or not path.exists():
        return Profile(model=profile_name(options.model), mode=options.mode, machine=machine)
    try:
        profile = Profile.load(path)
    except ProfileError as exc:
        raise ProfilingError(f"cannot resume from {path}: {exc}; pass --fresh to start over") from None
    if (profile.model, profile.mode) != (profile_name(options.model), options.mode):
        raise ProfilingError(
            f"{path} holds the {profile.mode} profile of {profile.model!r}, not the {options.mode} "
            f"profile of {options.model!r}; choose another -o, or --fresh to overwrite it"
        )
    old = profile.machine
    if old is not None and profile.entries:
        for name in ("hostname", "cpu_model"):
            a, b = getattr(old, name), getattr(machine, name)
            if a and b and a != b:
                raise ProfilingError(
                    f"{path} was measured on {name} {a!r}, this is {b!r}; points from two machines "
                    f"would not make one profile: choose another -o, or --fresh to overwrite it"
                )
    if profile.machine is None:
        profile.machine = machine
    return profile


def _entry_half_width(entry: ProfileEntry, confidence: float) -> float:
    if entry.std_ms is None or not entry.iterations or entry.iterations < 2:
        return 0.0
    return half_width(entry.std_ms, entry.iterations, confidence)


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


class _Child:
    """One measuring process for one thread count, driven over stdin/stdout."""

    def __init__(self, options: ProfilingOptions, threads: int, cpus: tuple[int, ...]) -> None:
        from workers.allocation import thread_env

        self.options, self.threads, self.cpus = options, threads, cpus
        env = dict(os.environ)
        env.update(thread_env(threads))
        # The child must import this code base even when it is not installed.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH")) if p)
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr = tempfile.TemporaryFile()
        self._buf = b""

    def start(self) -> float:
        """Start the child and wait until its model is loaded; returns seconds taken.

        Timed from the parent, so interpreter start and imports count as load cost.
        """
        started = time.perf_counter()
        spec = {"threads": self.threads, "cpus": list(self.cpus), "options": self.options.model_dump()}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "optimizer.profiling.scheduler", "child", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=self.env,
            # Its own session: Ctrl-C reaches the parent only, which then
            # stops the child; the profile is saved by the parent.
            start_new_session=True,
        )
        ready = self._read()
        if ready.get("event") != "ready":
            message = (
                f"profiling child for {self.options.model} at {self.threads} threads did not start: "
                f"{ready.get('message', '')}\n{self._stderr_tail()}"
            )
            self.close()
            raise ProfilingError(message.rstrip())
        return time.perf_counter() - started

    def measure(self, batch: int, dominated_above_ms: float | None) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        request = {"batch": batch, "dominated_above_ms": dominated_above_ms}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            return {"event": "error", "message": f"child exited\n{self._stderr_tail()}"}
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + self.options.child_timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                return {"event": "error", "message": f"no answer within {self.options.child_timeout_s:g} s"}
            readable, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not readable:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.wait()
                return {"event": "error", "message": f"child exited with {code}\n{self._stderr_tail()}"}
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def _stderr_tail(self, limit: int = 2000) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-limit:]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                if proc.stdin:
                    proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.stderr.close()


# ---------------------------------------------------------------------------
# the child


def _child_main(spec_json: str) -> int:
    """Pin, load the model once, then answer one JSON line per requested batch."""
    # The protocol gets the real stdout; anything a library prints goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

    def send(message: dict[str, Any]) -> None:
        proto.write(json.dumps(message) + "\n")

    try:
        spec = json.loads(spec_json)
        threads, cpus = int(spec["threads"]), [int(c) for c in spec["cpus"]]
        options = ProfilingOptions(**spec["options"])
        handler, context, eager, load_s = _load(options, threads, cpus)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which shows it
        send({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    send({"event": "ready", "load_s": load_s, "pid": os.getpid(), "cpus": cpus})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        b = int(request["batch"])
        try:
            send(_measure_batch(handler, context, eager, options, threads, b, request.get("dominated_above_ms")))
        except Exception as exc:  # noqa: BLE001 - one batch size failing is data, not a crash
            send({"event": "error", "threads": threads, "batch": b, "message": f"{type(exc).__name__}: {exc}"})
    return 0


def _load(options: ProfilingOptions, threads: int, cpus: list[int]) -> tuple[Any, Any, Any, float]:
    """Load the handler as ``workers.worker`` does: pin, import, size torch, initialize."""
    from packrat_mq.handler import Context, load_handler
    from workers.allocation import pin_current_process

    start = time.perf_counter()
    pin_current_process(cpus, threads, configure_torch=False)
    handler = load_handler(options.model)
    if "torch" in sys.modules:
        pin_current_process(cpus, threads, configure_torch=True)
    context = Context(
        model_name=options.model,
        instance_id=f"profile-t{threads}",
        threads=threads,
        cores=tuple(cpus),
        batch_size=options.batches[0],
        graph_mode=False,
        options=dict(options.options),
    )
    # Graph mode traces per batch size later, from these eager weights.
    handler.initialize(context)
    if "torch" in sys.modules:
        pin_current_process(cpus, threads, configure_torch=True)
    eager = handler.model
    return handler, context, eager, time.perf_counter() - start


def _measure_batch(
    handler: Any, context: Any, eager: Any, options: ProfilingOptions, threads: int, b: int,
    dominated_above_ms: float | None,
) -> dict[str, Any]:
    import gc

    from packrat_mq.handler import run_batch

    setup = time.perf_counter()
    context = dataclasses.replace(context, batch_size=b, graph_mode=options.graph)
    if options.graph and getattr(handler, "traceable", False):
        # initialize() is what a served instance runs; reuse the loaded weights
        # instead of reading them again for every batch size.
        handler.load_model = lambda _ctx: eager
        try:
            handler.initialize(context)
        finally:
            del handler.load_model
    else:
        handler.context = context
    items = handler.example_batch(b)
    # Once through the framework's contract check: a model that fails or
    # answers the wrong number of results must not be timed as if it worked.
    check = run_batch(handler, items)
    errors = [o.error for o in check.outcomes if not o.ok]
    if errors:
        raise RuntimeError(f"{len(errors)} of {b} example requests failed: {errors[0]}")
    setup_s = time.perf_counter() - setup
    gc.collect()
    m = measure(
        lambda: handler.handle(items),
        warmup=options.warmup,
        min_iters=options.min_iters,
        max_iters=options.max_iters,
        rel_ci=options.rel_ci,
        confidence=options.confidence,
        budget_s=options.budget_s,
        dominated_above_ms=dominated_above_ms,
    )
    return {"event": "result", "threads": threads, "batch": b, "setup_s": setup_s, **m.stats()}


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "child":
        return _child_main(argv[1])
    print("usage: python -m optimizer.profiling.scheduler child SPEC_JSON (started by `packrat-mq profile run`)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
