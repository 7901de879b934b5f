"""Reconfiguration: how a node goes from one configuration to another without losing a request.

:func:`packrat_mq.instances.plan_change` matches the instances served now with those of the target
by thread count: an instance whose thread count the target still has is kept
(its process, cores and queue stay; only its share ``b_j`` may change), the
target's other instances are started, the old ones left over are stopped.
That gives the three kinds of change:

- **reshare**: nothing started or stopped, only shares change. Instant: the
  next deployment generation reaches the dispatcher at its next batch.
- **scale**: instances only added, or only removed (every kept instance keeps
  its thread count). Added ones start on free cores; removed ones finish
  what they hold and release theirs.
- **active-passive**: thread counts change, so instances are both started and
  stopped. The new (passive) instances start and warm up while the old
  (active) ones serve, on free cores where there are enough, else on the
  cores of the instances they replace (over-subscribed until those stop).

Whatever the kind, the supervisor carries it out in phases
(:class:`Reconfiguration`), one step per supervision check, never blocking:
``warming`` (passive instances start and warm up) → ``switching`` (the new
generation is published; the dispatcher adopts it at a batch boundary and
says so in its record) → ``draining`` (the instances leaving answer what
their queues hold) → ``stopping`` (they exit and their cores are free).
Only once the dispatcher has adopted the new generation are old instances
drained, so no sub-batch can reach an instance after its queue was found
empty. Timings of each phase are kept (:meth:`Reconfiguration.summary`) for
``status`` and the benchmark.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from packrat_mq.control import ControlMessage
from packrat_mq.instances import Configuration

#: Phases in order; ``done`` and ``failed`` end a reconfiguration.
PHASES = ("warming", "switching", "draining", "stopping")
#: How many reconfigurations the history list keeps per model.
HISTORY = 10


@dataclass
class Reconfiguration:
    """One reconfiguration in progress: what, why, and when each phase ended (epoch seconds)."""

    source: Configuration
    target: Configuration
    kind: str
    generation: int
    reason: str
    origin: str
    adaptive: bool
    message: ControlMessage | None = None
    decided: float = field(default_factory=time.time)
    began: float = field(default_factory=time.time)
    phase: str = "warming"
    #: Whether passive instances share cores with the ones they replace.
    oversubscribed: bool = False
    passive_ready: float | None = None
    switched: float | None = None
    drained: float | None = None
    stopped: float | None = None
    #: When the phase began (monotonic), for its timeout.
    phase_since: float = field(default_factory=time.monotonic)
    error: str | None = None
    #: How many of the new instances were spares rebound in place instead of processes started.
    reused: int = 0
    #: New instances that wait for the leaving ones on their cores before their first sub-batch (a
    #: handover, ``handover_timeout_s``), and the longest any of them waited.
    handing_over: list[str] = field(default_factory=list)
    held_s: float | None = None

    def enter(self, phase: str) -> None:
        now = time.time()
        if self.phase == "warming" and phase != "warming":
            self.passive_ready = now
        elif self.phase == "switching" and phase != "switching":
            self.switched = now
        elif self.phase == "draining" and phase != "draining":
            self.drained = now
        elif self.phase == "stopping":
            self.stopped = now
        self.phase = phase
        self.phase_since = time.monotonic()

    def summary(self) -> dict[str, Any]:
        """The history entry: reason, from -> to, and how long each phase took (seconds)."""
        end = self.stopped or self.drained or self.switched or time.time()

        def span(a: float | None, b: float | None) -> float | None:
            return round(b - a, 3) if a is not None and b is not None else None

        return {
            "reason": self.reason,
            "origin": self.origin,
            "kind": self.kind,
            "from": self.source.compact(),
            "to": self.target.compact(),
            "from_batch": self.source.batch,
            "to_batch": self.target.batch,
            "generation": self.generation,
            "adaptive": self.adaptive,
            "status": "failed" if self.error else ("done" if self.phase == "done" else self.phase),
            "error": self.error,
            "decided": self.decided,
            "began": self.began,
            "passive_ready": self.passive_ready,
            "switched": self.switched,
            "drained": self.drained,
            "stopped": self.stopped,
            "decision_to_ready_s": span(self.decided, self.passive_ready),
            "ready_to_switch_s": span(self.passive_ready, self.switched),
            "switch_to_drained_s": span(self.switched, self.drained),
            "total_s": span(self.decided, end),
            # Cores are shared from the passive instances' start until the old ones stopped.
            "reused": self.reused,
            "oversubscribed_s": span(self.began, self.stopped) if self.oversubscribed else 0.0,
            # With a handover the cores are shared only while the new instances warm up: they wait
            # for the old ones to drain (this long at most) before serving.
            "handover": bool(self.handing_over),
            "held_s": self.held_s,
        }
