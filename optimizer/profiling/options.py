"""What a profiling run measures and how precisely, and where its profile is written.

:class:`ProfilingOptions` is plain JSON-able data: the CLI builds it, the
profiling child receives it in its spec, and RQ jobs carry it as JSON.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from optimizer.planning.profile import DEFAULT_MAX_BATCH, Mode, Placement, ProfileError, machine_profile_path
from packrat_mq import graph as graph_modes
from packrat_mq.topology import Topology


class ProfilingError(RuntimeError):
    """The profiler could not run (bad options, a child that would not start)."""


#: ``profile run --quick``: the schedule of a fast profile (options given on the
#: command line still win). One warm-up after the contract check (which already
#: ran the batch once), three timed rounds at least, 5% at 95%, at least 1.5 s and at most 5 s per
#: point: resnet50 at T=2, B <= 32 took 64 s on the idle 2-core machine (docs/decisions.md)
#: before the 1.5 s, which adds at most 18 s to its 12 points.
QUICK_SCHEDULE: dict[str, Any] = {"warmup": 1, "min_iters": 3, "max_iters": 20, "rel_ci": 0.05, "budget_s": 5.0,
                                  "min_timed_s": 1.5}


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

    #: Zoo name or ``module:Class``; also the handler the child loads.
    model: str
    #: Thread counts; None means ``1..threads_max``.
    threads: list[int] | None = None
    #: None means the allowed physical cores of the largest socket.
    threads_max: int | None = Field(default=None, ge=1)
    batches: list[int] = Field(default_factory=lambda: power_of_two_batches(DEFAULT_MAX_BATCH))
    #: The mode measured: ``eager`` or a graph backend. ``graph`` (or true, as jobs queued before
    #: the backends had names say) is the model's default backend.
    graph: Mode = "eager"
    #: ``co-located``: ``T // t`` copies of ``(t, b)`` run together, the slowest
    #: is the sample; ``isolated``: one instance alone.
    placement: Placement = "co-located"
    options: dict[str, Any] = Field(default_factory=dict)
    rel_ci: float = Field(default=0.02, gt=0, lt=1)
    confidence: float = Field(default=0.95, gt=0, lt=1)
    min_iters: int = Field(default=5, ge=2)
    max_iters: int = Field(default=100, ge=2)
    warmup: int = Field(default=3, ge=0)
    budget_s: float = Field(default=30.0, gt=0)
    #: A point is not converged before its timed iterations have lasted this long (seconds): a
    #: shared host's speed moves in spells of seconds, and a few tight samples of one quiet spell
    #: are no mean of the host (:func:`~optimizer.profiling.statistics.measure`).
    min_timed_s: float = Field(default=3.0, ge=0)
    max_latency_ms: float | None = Field(default=None, gt=0)
    dominance_margin: float = Field(default=0.05, ge=0)
    #: Times the whole grid is measured, each pass in fresh processes, the thread counts in turn
    #: forwards and backwards; a point's mean is the mean of its passes' means. One pass, as
    #: before, unless asked: see :mod:`optimizer.profiling.scheduler`, "Passes".
    passes: int = Field(default=1, ge=1, le=10)
    #: A child that says nothing for this long is killed.
    child_timeout_s: float = Field(default=1800.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _resolve_graph(cls, data: Any) -> Any:
        if isinstance(data, dict) and "graph" in data:
            try:
                data = {**data, "graph": graph_modes.resolve(data["graph"], data.get("model"))}
            except graph_modes.GraphModeError as exc:
                raise ValueError(str(exc)) from None
        return data

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

    def pass_schedule(self) -> dict[str, Any]:
        """The stopping rule of one pass (:func:`~optimizer.profiling.statistics.measure`'s arguments).

        ``passes`` passes share one point's schedule: each gets ``1/passes``
        of the budget, of ``max_iters`` and of ``min_timed_s``, at least 2 and ``min_iters / passes``
        iterations, and stops once its own mean is within ``rel_ci x sqrt(passes)``,
        which makes the mean of the passes' means known within about ``rel_ci``
        (where the passes agree). One pass: the options as they are.
        """
        p = self.passes
        min_iters = max(2, math.ceil(self.min_iters / p))
        return {"warmup": self.warmup, "min_iters": min_iters,
                "max_iters": max(min_iters, math.ceil(self.max_iters / p)),
                "rel_ci": min(0.99, self.rel_ci * math.sqrt(p)), "confidence": self.confidence,
                "budget_s": self.budget_s / p, "min_timed_s": self.min_timed_s / p}

    @property
    def mode(self) -> Mode:
        return self.graph

    def cores(self, topology: Topology) -> int:
        """T: the cores profiled, ``threads_max`` or the allowed physical cores of the largest socket."""
        return self.threads_max or topology.max_cores_per_socket

    def thread_counts(self, topology: Topology) -> list[int]:
        if self.threads is not None:
            return list(self.threads)
        return list(range(1, self.cores(topology) + 1))

    def copies(self, threads: int, topology: Topology) -> int:
        """How many instances of ``threads`` threads run together: ``T // t`` co-located, else 1."""
        if self.placement == "isolated":
            return 1
        return max(1, self.cores(topology) // threads)


def profile_name(model: str) -> str:
    """The profile's model name: a zoo name as is, ``module:Class`` as ``module.Class``."""
    return model.replace(":", ".")


def default_output(model: str, mode: str = "eager", directory: str | os.PathLike[str] = "profiles") -> Path:
    """``profiles/<model>.json`` (eager) or ``profiles/<model>.<backend>.json``, named as every profile is.

    Unless that file holds another machine's profile: then this machine's own
    slot, ``profiles/machines/<key>/<model>.json`` (``machine_profile_path``),
    which lookups on this machine take and which leaves the other one's alone.
    """
    try:
        return machine_profile_path(profile_name(model), mode, directory)
    except ProfileError as exc:
        raise ProfilingError(f"cannot name the profile of {model!r}: {exc}") from None


def run_log_path(profile_path: Path) -> Path:
    """Where each run's schedule and time saved are appended (not ``*.json``: not a profile)."""
    return profile_path.with_name(profile_path.name.removesuffix(".json") + ".runs.jsonl")
