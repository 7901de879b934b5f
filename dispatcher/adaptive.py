"""The estimator at work in the dispatcher: sample, decide, ask the supervisor.

A thread of the dispatcher process samples the request stream's length every
``estimator_sample_ms`` (one ``XLEN``, its own connection from the pool) into
the :class:`~dispatcher.estimation.Estimator`, and asks the
:class:`~dispatcher.estimation.Policy` whether to change B. A decision
becomes a control message (:mod:`packrat_mq.control`, ``origin estimator``)
to the model's supervisors, which plan the new configuration with the
optimizer and carry it out; the dispatcher learns that it happened from the
next deployment it reads, at a batch boundary. While one request is
outstanding no other is sent (for ``outstanding_s`` at most, in case the
supervisor is gone).

The thread never touches the dispatch loop's state: the loop reports batches
(:meth:`Adaptive.record_batch`) and deployments (:meth:`Adaptive.serving`)
under a lock, and reads a snapshot for its heartbeat.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from dispatcher.estimation import Decision, Estimator, EstimatorSettings, Policy
from dispatcher.partitioning import LatencyFn, profile_latency
from dispatcher.queueing import Server, mean_latency_ms
from optimizer.planning.profile import Profile
from optimizer.planning.selection import choose, find_profile
from packrat_mq import control
from packrat_mq.deployment import node_share
from packrat_mq.instances import ChangePlan, Configuration, plan_change
from packrat_mq.settings import Settings

log = logging.getLogger("packrat_mq.dispatcher.adaptive")

#: How much less often a pinned deployment's backlog is sampled (its estimate is only displayed).
PINNED_SLOWDOWN = 20
#: How much less often a quiet adaptive deployment's backlog is sampled (see :meth:`Adaptive.quiet`).
QUIET_SLOWDOWN = 10
#: How much less often a steady one's is (see :meth:`Adaptive.steady`).
STEADY_SLOWDOWN = 8
#: A steady sampler is woken at once by a dispatched batch whose oldest request waited more than this many
#: times B's predicted latency (see :meth:`Adaptive.record_batch`).
WAKE_WAIT_FACTOR = 2.0
#: The rates :meth:`PlannedCapacity.latency` simulates are powers of this (steps of 2.5%).
RATE_STEP = 1.025
#: A node whose loaded spares rose within this many seconds is loading them (``PlannedCapacity.awaiting_spares``):
#: its supervisor loads one at a time, about a second each on simulated cores, a few seconds for a real model
#: (and not while the machine is busy); a count that has not risen for longer is not waited for.
SPARES_RISING_S = 15.0
#: How many simulated latencies :class:`PlannedCapacity` keeps before it starts again.
LATENCIES_KEPT = 4096


def estimator_settings(settings: Settings) -> EstimatorSettings:
    """The estimator's parameters from the process settings (``PACKRAT_ESTIMATOR_*`` and friends)."""
    return EstimatorSettings(
        alpha=settings.estimator_alpha, window=settings.estimator_window, sample_ms=settings.estimator_sample_ms,
        min_batch=settings.adaptive_min_batch, max_batch=max(settings.adaptive_min_batch, settings.adaptive_max_batch),
        reconfigure_timeout_s=settings.reconfigure_timeout_s, up_timeout_s=settings.reconfigure_up_timeout_s,
        trigger_period_s=settings.trigger_period_s, up_utilisation=settings.reconfigure_up_utilisation,
        knee=settings.estimator_knee, switch_factor=settings.estimator_switch_factor,
        switch_gain=settings.estimator_switch_gain, switch_payback=settings.estimator_switch_payback,
        switch_keep=settings.estimator_switch_keep,
    )


class PlannedCapacity:
    """What a model-wide B can serve (requests/s), by the plan the supervisors would make for it.

    Each node serving the model plans its share of B (in proportion to its
    thread budget, :func:`packrat_mq.deployment.node_share`) from the
    dispatcher's profile, as a supervisor plans it; a share's capacity is
    ``share / L`` with ``L`` the plan's predicted latency. None where no
    profile or no plan says (the policy then refuses nothing). Cached: the
    budgets change only with the nodes.
    """

    def __init__(self, model: str, profile: str | None, mode: str = "eager", *,
                 timeout_ms: float = 50.0, max_waiting: int = 1) -> None:
        #: The graph mode served (``eager`` or a backend): the profile's plans are that mode's.
        self.model, self.profile, self.mode = model, profile, mode
        #: The dispatcher's batch timeout and flow control, which :meth:`latency` simulates.
        self.timeout_ms, self.max_waiting = timeout_ms, max_waiting
        #: Per mode, the profile's latency estimate and path cost (loaded once; None: no profile).
        self._estimates: dict[str, tuple[LatencyFn, Callable[[int], float]] | None] = {}
        #: Per (B, rate step, budgets, ratios, mode): the mean latency :meth:`latency` simulated.
        self._latencies: dict[tuple[Any, ...], float | None] = {}
        self.budgets: dict[str, int] = {}
        #: Per node, served / profiled latency as its supervisor measures it (``optimizer.planning.drift``):
        #: a node serving 1.9x slower than its profile carries 1/1.9 of the planned load. 1 where unknown.
        self.ratios: dict[str, float] = {}
        #: Per node, the same by instance thread count where measured (``SupervisorState.profile_ratios``): a
        #: plan's instances take their own count's ratio, the node's where their count was not measured.
        self.thread_ratios: dict[str, dict[int, float]] = {}
        #: Per (B, budgets, mode): each node's share and plan (:meth:`_plans`), None where no plan says.
        #: The ratios are applied at each call: they move every few seconds, the plans do not.
        self._cache: dict[tuple[Any, ...], dict[str, tuple[int, Configuration]] | None] = {}
        #: What each B's capacity was the last time, for the budgets, ratios and mode of ``_values_for``.
        self._values: dict[int, float | None] = {}
        #: What each B's instances drain in (:meth:`drain_s`), kept as ``_values`` are.
        self._drains: dict[int, float | None] = {}
        self._values_for: tuple[Any, ...] = ()
        #: Per node, (spares loaded, spares it keeps) as its supervisor last said (:meth:`observe_spares`).
        self.spares: dict[str, tuple[int, int]] = {}
        #: Per node, when its loaded count last rose (the caller's clock): it is loading spares.
        self._spares_rose_at: dict[str, float] = {}
        #: Per node, (seconds one process takes to load alone, CPUs processes load on side by side), as its
        #: supervisor measured it (:meth:`observe_spares`); a node missing: not measured yet.
        self.start_s: dict[str, tuple[float, int]] = {}

    def _current(self) -> None:
        """Forget the kept answers once the budgets, ratios or mode are other objects.

        The estimator asks several times per sample, 200 samples a second: the
        answers are kept while they are the same objects (each is replaced,
        never changed in place, when it changes).
        """
        seen = self._values_for
        if (not seen or seen[0] is not self.budgets or seen[1] is not self.ratios or seen[2] != self.mode
                or seen[3] is not self.thread_ratios):
            # The objects themselves are kept (not their ids, which a new dict may reuse).
            self._values, self._drains = {}, {}
            self._values_for = (self.budgets, self.ratios, self.mode, self.thread_ratios)

    def __call__(self, batch: int) -> float | None:
        self._current()
        if batch not in self._values:
            self._values[batch] = self._capacity(batch)
        return self._values[batch]

    def _capacity(self, batch: int) -> float | None:
        """The sum over nodes of ``share / L`` by their plans, each divided by its ratio (:meth:`ratio`)."""
        plans = self._plans(batch)
        if plans is None:
            return None
        total = 0.0
        for node, (share, configuration) in plans.items():
            latency = configuration.predicted_latency_ms
            if not latency:
                return None
            ratio = max(self.ratio(node, inst.threads) for inst in configuration.instances)
            total += share / (latency / 1000.0) / ratio
        return total or None

    def ratio(self, node: str, threads: int) -> float:
        """Served / profiled latency for ``threads``-thread instances on ``node``: that count's own where
        measured, else the node's, else 1."""
        own = self.thread_ratios.get(node, {}).get(threads)
        return own if own is not None else self.ratios.get(node, 1.0)

    def latency(self, batch: int, rate: float) -> float | None:
        """The mean ms from arrival to answer at ``rate`` requests/s with B's plans; None where unknown.

        Simulated (:func:`dispatcher.queueing.mean_latency_ms`) over every
        node's instances, each sub-batch taking the profile's latency plus its
        serving path, times its ratio (:meth:`ratio`: by its thread count
        where measured). The rate is taken to the nearest step of 2.5% and
        each answer kept (a simulation is about
        15 ms, and the policy asks on every sample); the steps differ by
        less than a plan's prediction errs.
        """
        if rate <= 0:
            return None
        step = round(math.log(rate) / math.log(RATE_STEP))
        key = (batch, step, tuple(sorted(self.budgets.items())), tuple(sorted(self.ratios.items())), self.mode,
               tuple(sorted((n, tuple(sorted(r.items()))) for n, r in self.thread_ratios.items())))
        if key not in self._latencies:
            if len(self._latencies) > LATENCIES_KEPT:
                self._latencies.clear()
            servers = self.servers(batch)
            self._latencies[key] = (None if servers is None else
                                    mean_latency_ms(servers, RATE_STEP ** step, self.timeout_ms,
                                                    max_waiting=self.max_waiting))
        return self._latencies[key]

    def servers(self, batch: int) -> list[Server] | None:
        """B's instances on every node, as the simulation takes them; None where no plan or profile says."""
        plans = self._plans(batch)
        estimate = self._estimate()
        if plans is None or estimate is None:
            return None
        latency, path = estimate
        servers = []
        for node, (_, configuration) in plans.items():
            for inst in configuration.instances:
                def took(k: int, threads: int = inst.threads, ratio: float = self.ratio(node, inst.threads)) -> float:
                    return (latency(threads, k) + path(k)) * ratio
                servers.append(Server(inst.batch, took))
        return servers or None

    def drain_s(self, batch: int) -> float | None:
        """Seconds B's instances are expected to take, under load, to serve what they hold: half the sub-batch
        running and the ``max_waiting`` queued behind it, full, of the slowest (None where unknown). An
        active-passive switch away from B lasts at least that (``Policy.switch_cost_s``). Kept as the
        capacities are: the policy asks on every sample that looks at a move down."""
        self._current()
        if batch not in self._drains:
            servers = self.servers(batch)
            self._drains[batch] = ((0.5 + self.max_waiting) * max(s.latency_ms(s.share) for s in servers) / 1000.0
                                   if servers else None)
        return self._drains[batch]

    def _estimate(self) -> tuple[LatencyFn, Callable[[int], float]] | None:
        """The profile's latency of (threads, k) and its serving path's cost of k (ms), for the mode served."""
        if self.mode not in self._estimates:
            try:
                path = find_profile(self.model, self.profile, mode=self.mode)
                loaded = Profile.load(path) if path is not None else None
            except Exception as exc:  # noqa: BLE001 - no profile: nothing predicted, nothing changed on it
                log.debug("no profile for %s (%s): %s", self.model, self.mode, exc)
                loaded = None
            if loaded is None or not loaded.entries:
                self._estimates[self.mode] = None
            else:
                profile = loaded
                self._estimates[self.mode] = (
                    profile_latency({(e.threads, e.batch): e.mean_ms for e in profile.entries}),
                    lambda k: profile.path_cost_ms(k) or 0.0)
        return self._estimates[self.mode]

    def layout(self, batch: int) -> dict[str, frozenset[int]] | None:
        """Per node, the thread counts of the instances its plan for B=``batch`` has (None where unknown)."""
        plans = self._plans(batch)
        if plans is None:
            return None
        return {node: frozenset(i.threads for i in configuration.instances)
                for node, (_, configuration) in plans.items()}

    def most_threads(self, batch: int) -> int | None:
        """The most threads any instance of B=``batch``'s plans has, on any node (None where unknown)."""
        layout = self.layout(batch)
        counts = [t for threads in (layout or {}).values() for t in threads]
        return max(counts) if counts else None

    def needs_processes(self, a: int, b: int) -> bool:
        """Whether going from B=``a`` to B=``b`` is active-passive on some node: it both starts and stops
        instances there (their thread counts change), matched as the supervisor matches them
        (:func:`packrat_mq.instances.plan_change`).

        Not a comparison of the two plans' sets of thread counts: from
        ``1x2,2x2`` to ``2x4`` those differ, but the supervisor only stops the
        1-thread instance (a scale, nothing over-subscribed), and a change that
        only adds instances of a new thread count starts them on free cores.
        Only an active-passive change over-subscribes cores, which is what
        :meth:`Policy.switch_cost_s` prices. Unknown plans count as no: nothing is delayed on a guess.
        """
        changes = self._changes(a, b)
        return changes is not None and any(c.kind == "active-passive" for c in changes.values())

    def observe_spares(self, spares: dict[str, tuple[int, int]], now: float,
                       starts: dict[str, tuple[float, int]] | None = None) -> None:
        """What each node's supervisor says of its spares, ``node -> (loaded, kept)``, read at ``now``, and of
        its processes' start, ``node -> (seconds one takes to load alone, CPUs they load on)`` where measured."""
        for node, (loaded, _) in spares.items():
            before = self.spares.get(node)
            if before is not None and loaded > before[0]:
                self._spares_rose_at[node] = now
        self.spares = spares
        if starts is not None:
            self.start_s = starts

    def cold_start_s(self, a: int, b: int) -> float | None:
        """Seconds the processes that going from B=``a`` to B=``b`` starts beyond the loaded spares take to
        load, on the node where that is longest; 0 where it starts none; None where unknown (no plans, or
        a node that starts some without a measured start time).

        Per node: the processes started beyond the spares loaded there, in
        rounds of as many as its CPUs, each round the time one process takes
        alone (``Supervisor.process_start_s``). Loading is CPU work, so n
        processes on c CPUs take about n/c such times. On 64 simulated cores
        (two real ones, 12-07) a spare loaded alone in about 1 s; moves from
        B=32 down to 16 started 12 and 15 processes and were ready in
        6.2 and 6.6 s (this says 6 and 8), moves down to 8 started 2 and 3
        in 1.0-1.5 s (1 and 2). The policy priced those moves by the last
        switch, a tenth of a second (``Policy.switch_cost_s``).
        """
        starts = self.starts(a, b)
        if starts is None:
            return None
        longest = 0.0
        for node, needed in starts.items():
            cold = needed - self.spares.get(node, (0, 0))[0]
            if cold <= 0:
                continue
            if node not in self.start_s:
                return None
            seconds, cpus = self.start_s[node]
            longest = max(longest, seconds * math.ceil(cold / cpus))
        return longest

    def starts(self, a: int, b: int) -> dict[str, int] | None:
        """Per node, how many processes going from B=``a``'s plan to B=``b``'s starts (None where unknown),
        matched as the supervisor matches them (:func:`packrat_mq.instances.plan_change`)."""
        changes = self._changes(a, b)
        return None if changes is None else {node: len(c.start) for node, c in changes.items()}

    def _changes(self, a: int, b: int) -> dict[str, ChangePlan] | None:
        """Per node of B=``b``'s plans, the supervisor's change from B=``a``'s plan there
        (:func:`packrat_mq.instances.plan_change`; from nothing on a node ``a`` leaves out, which only
        starts: a scale); None where either plan is unknown. A node ``b`` leaves out only stops: no
        processes, no switch."""
        before, after = self._plans(a), self._plans(b)
        if before is None or after is None:
            return None
        return {node: plan_change([(i.threads, i.batch) for i in before[node][1].instances] if node in before else [],
                                  configuration)
                for node, (_, configuration) in after.items()}

    def awaiting_spares(self, a: int, b: int, now: float) -> bool:
        """Whether going from B=``a`` to B=``b`` would start more processes on some node than it has spares
        loaded, while it is loading more (its count rose within ``SPARES_RISING_S`` of ``now``).

        A spare is rebound in a tenth of a second; a process started loads
        its model beside the instances that serve. On 64 simulated cores (two
        real ones, 12-07) a move up from B=4 to B=32 took all 32 spares, the
        supervisor loads them again one at a time (about 0.9 s each), and the
        move down to B=16 five seconds later found 5 of the 16 it needed: the
        other 11 started together, the change took 3.7 s instead of 0.1, and
        the backlog it left took B back up. Where no spare is coming (the
        memory or the machine's CPU use holds them back, or the node keeps
        as many as it will), nothing is waited for: the switch is priced as
        before (``Policy.switch_cost_s``).
        """
        starts = self.starts(a, b)
        if not starts:
            return False
        for node, needed in starts.items():
            loaded, kept = self.spares.get(node, (0, 0))
            rose = self._spares_rose_at.get(node)
            if needed > loaded and loaded < kept and rose is not None and now - rose <= SPARES_RISING_S:
                return True
        return False

    def _plans(self, batch: int) -> dict[str, tuple[int, Configuration]] | None:
        """Each node's share of B=``batch`` and the plan its supervisor would make for it; None if any has none.

        Planned once per (B, budgets, mode): the capacities and the layouts both read them.
        """
        if not self.profile or not self.budgets:
            return None
        key = (batch, tuple(sorted(self.budgets.items())), self.mode)
        if key not in self._cache:
            self._cache[key] = self._plan(batch)
        return self._cache[key]

    def _plan(self, batch: int) -> dict[str, tuple[int, Configuration]] | None:
        plans = {}
        for node, threads in self.budgets.items():
            share = node_share(batch, self.budgets, node)
            if share <= 0:
                continue
            try:
                plans[node] = (share, choose(self.model, threads, share, self.profile, mode=self.mode).configuration)
            except Exception as exc:  # noqa: BLE001 - no plan: nothing known, nothing refused or delayed
                log.debug("no plan for %s at B=%d: %s", self.model, batch, exc)
                return None
        return plans


@dataclass(frozen=True)
class Snapshot:
    """What the dispatcher's record says about the estimate."""

    adaptive: bool
    q_tilde: float | None
    b_tilde: int | None
    requested: int | None
    #: Per B, what it was measured to serve under a backlog (requests/s; ``Policy.learn``), still in use.
    served: dict[int, float] = field(default_factory=dict)


class Adaptive:
    """Samples the request stream and asks for reconfigurations while the deployment is adaptive."""

    def __init__(self, r: redis.Redis, settings: Settings, model: str, *,
                 clock: Callable[[], float] | None = None, outstanding_s: float = 60.0,
                 capacity: Callable[[int], float | None] | None = None) -> None:
        self.r = r
        self.settings = settings
        self.keys = settings.keys
        self.model = model
        self.stream = self.keys.requests(model)
        self._stats = self.keys.stats(model)
        self.config = estimator_settings(settings)
        self.estimator = Estimator(self.config)
        self.policy = Policy(self.config)
        self.clock = clock or time.monotonic
        self.outstanding_s = outstanding_s
        #: What each B can serve (requests/s), for the policy's capacity guard; None: no guard.
        self.capacity = capacity
        self._lock = threading.Lock()
        self._stop = threading.Event()
        #: Set by the dispatch loop to wake a quiet sampler (see :meth:`quiet`).
        self._wake = threading.Event()
        self._quiet = False
        #: The sampler is in its steady pace (see :meth:`steady`).
        self._steady = False
        self._thread: threading.Thread | None = None
        self.adaptive = False
        self.batch: int | None = None
        self.generation: int | None = None
        self.predicted_ms: float | None = None
        #: The B asked for and when (monotonic), until a deployment with it (or the timeout).
        self._requested: tuple[int, float] | None = None
        #: The stream's length at the last sample (see :meth:`idle`).
        self._last_length: int | None = None
        # Which changes take new processes, by the plans, and how long the last one took: a move down
        # waits for what its switch costs (``Policy.switch_wait``).
        self.policy.needs_processes = getattr(capacity, "needs_processes", None)
        # How many threads each B's instances have: a loss measured serving one B discounts the plans of
        # B with as many threads or more (``Policy.effective``).
        self.policy.threads = getattr(capacity, "most_threads", None)
        # What each B's requests take at a rate, by its plans: a smaller B that answers sooner is taken.
        self.policy.latency = getattr(capacity, "latency", None)
        # What each B's instances hold: a switch away from B lasts until they have served it.
        self.policy.drain_s = getattr(capacity, "drain_s", None)
        # Which moves would start processes while the spares they could rebind are loading: those wait.
        self.policy.awaiting_spares = getattr(capacity, "awaiting_spares", None)
        # What the processes a move starts beyond the loaded spares take to load: its switch lasts that.
        self.policy.cold_start_s = getattr(capacity, "cold_start_s", None)
        #: Since a change took effect, until its history entry is read (monotonic; None: nothing to read).
        self._history_due: float | None = None
        #: When that change took effect (the reads stop a minute after it).
        self._history_since: float | None = None
        self._history_seen: float | None = None
        #: The sampler's own connection (:meth:`_read_counts`).
        self._conn: Any = None

    # --- what the dispatch loop tells it --------------------------------
    def serving(self, batch: int, generation: int, adaptive: bool, predicted_ms: float | None) -> None:
        """The dispatcher now serves this deployment (called at the batch boundary where it switched)."""
        with self._lock:
            now = self.clock()
            if self.batch is not None and batch != self.batch:
                self.policy.changed(now, self.batch, batch)
                self._history_due = self._history_since = now
            self.batch, self.generation, self.adaptive, self.predicted_ms = batch, generation, adaptive, predicted_ms
            if self._requested is not None and (self._requested[0] == batch or not adaptive):
                self._requested = None

    def record_batch(self, size: int, timed_out: bool, queue_ms: float) -> None:
        """A batch the dispatch loop handed out: its size, whether the batch timeout cut it, and how long its
        oldest request waited in the stream.

        Where that wait is over twice what B's batch takes, requests are piling up behind the instances, and
        a steady sampler (every 40 ms) is woken to look now. On 64 simulated cores (two real ones, 12-07)
        the step from idle was first seen about 0.1 s in, the stream already at 65 where 12 starts the
        surge's clock; the loss of a step grows with the square of the time to the switch.
        """
        with self._lock:
            self.policy.record_batch(self.clock(), size, timed_out, queue_ms)
            predicted = self.predicted_ms
        if self._quiet:
            self._wake.set()  # a request came while the sampler slept: look at the stream now
        elif self._steady and predicted is not None and queue_ms > WAKE_WAIT_FACTOR * predicted:
            self._wake.set()

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(self.adaptive, self.estimator.q_tilde, self.estimator.b_tilde,
                            self._requested[0] if self._requested else None, self.policy.measured(self.clock()))

    # --- the sampler -----------------------------------------------------
    def quiet(self) -> bool:
        """At the smallest B, no more in the stream than that batch, and Q̃ asking for no more: nothing to decide.

        Until a request waits behind the one being served, the estimate
        cannot move; the sampler then looks 10x less often (and at once
        after each dispatched batch), so that 200 wake-ups a second of this
        process and of Redis do not take time slices from an instance that
        owns every core while it serves a lone request. A 2-thread
        ResNet-50 on a 2-core machine served B=1 in 101 ms with the sampler
        waking every 5 ms and 79 ms with it every 100 ms in one A/B round,
        within 4% in others (docs/figures.md).
        """
        with self._lock:
            q = self.estimator.q_tilde
            smallest = self.config.min_batch
            return (self._last_length is not None and self._last_length <= smallest and q is not None
                    and self.estimator.b_hat(q) <= smallest and (self.batch or 1) <= smallest)

    def steady(self) -> bool:
        """The estimate has agreed with B for a whole reconfiguration timeout, and its latest B̂ asks for B
        (lowered to the knee and raised to what carries the load, as the policy takes it).

        No decision is near: the sampler then looks 8x less
        often (every 40 ms), and at the full rate again from the first sample
        whose B̂ asks for another B, for the dwell and the decision. Each
        slow sample counts as one: the estimate is smoother while nothing is
        near a decision (weighing one sample as the eight it stands for made
        one noisy read of a closed loop's stream a majority of the vote, and
        changes under a steady load in the test). Every sample wakes
        this process and Redis, on cores the instances are meant to own: a
        static B=4 ResNet-50 on two cores, at 90% load, served the same trace
        with a mean of 647 ms sampled every 5 ms and 454 ms every 100 ms
        (one A/B pair, docs/figures.md).
        """
        with self._lock:
            since, last = self.policy.agree_since, self.estimator.last
            if since is None or last is None or self.clock() - since < self.config.reconfigure_timeout_s:
                return False
            # The latest B̂ is the mode the policy last found agreeing: the same target, nothing to compute
            # again (each look is CPU of the cores the instances own). Another B̂ may still agree, once
            # lowered to the knee or raised to what carries the load; that is looked at in full.
            if last == self.estimator.b_tilde:
                return True
            now = self.clock()
            capacity = self.policy.effective(self.capacity, now)  # as decide sees them (measured where served)
            target = self.policy.carrying(now, self.policy.worth(last, capacity), self.batch or 1, capacity,
                                          estimated=last)
            target = self.policy.quickest(now, target, self.batch or 1, capacity, self.capacity, estimated=last)
            return target == self.batch

    def _read_counts(self) -> tuple[int, int | None]:
        """``XLEN`` of the request stream, and the model's count of answered requests, in one round trip.

        On a connection of the sampler's own, sent and read raw: 200 times
        a second, through ``redis.Redis.xlen`` (pool checkout, callbacks) one
        read took 63-74 µs of CPU here, raw 22-36 µs. The answered count
        (the ``replies`` counter of the model's stats, which the transaction
        that answers requests adds to as it deletes them) makes the arrivals
        exact (``Policy.arrived``). Where the client has no connection pool
        to make one from (Redis Cluster, where the count is written apart
        from that transaction), the client's own ``xlen``, and no count.
        """
        pool = getattr(self.r, "connection_pool", None)
        if pool is None:
            return int(self.r.xlen(self.stream)), None
        if self._conn is None:
            self._conn = pool.make_connection()
        try:
            # In one transaction: a worker's answer (deletes from the stream, adds to the count) between
            # the two reads would make the sum a batch off for one sample, and a 1 s rate 8/s off.
            self._conn.send_packed_command(self._conn.pack_commands(
                [("MULTI",), ("XLEN", self.stream), ("HGET", self._stats, "replies"), ("EXEC",)]))
            for _ in range(3):
                self._conn.read_response()  # OK, QUEUED, QUEUED
            length, answered = self._conn.read_response()
            return int(length), int(answered or 0)
        except BaseException:
            self._conn.disconnect()
            self._conn = None
            raise

    def read_switch(self) -> None:
        """After a change took effect: its over-subscribed seconds, once its history entry is written.

        The entry is written when the old instances have drained; one
        ``LINDEX`` a second until then (for a minute at most), in this
        thread, off the request path.
        """
        due, since = self._history_due, self._history_since
        now = self.clock()
        if due is None or now < due:
            return
        self._history_due = now + 1.0 if since is not None and now - since < 60.0 else None
        raw = self.r.lindex(self.keys.reconfigurations(self.model), 0)
        if raw is None:
            return
        try:
            entry = json.loads(raw)
        except ValueError:
            return
        if entry.get("decided") == self._history_seen or entry.get("status") not in ("done", "failed"):
            return
        self._history_seen = entry.get("decided")
        self._history_due = None
        if entry.get("kind") == "active-passive" and entry.get("oversubscribed_s"):
            with self._lock:
                self.policy.switch_s = float(entry["oversubscribed_s"])

    def sample(self) -> Decision | None:
        """One sample and decision (the thread's body; tests call it directly)."""
        self.read_switch()
        length, answered = self._read_counts()
        self._last_length = length
        with self._lock:
            now = self.clock()
            self.estimator.observe(length, self.batch)
            self.policy.record_length(now, length, answered)
            if not self.adaptive or self.batch is None:
                return None
            if self._requested is not None:
                if now - self._requested[1] < self.outstanding_s:
                    return None
                log.warning("model %s: no reconfiguration to B=%d after %.0f s; asking again",
                            self.model, self._requested[0], self.outstanding_s)
                self._requested = None
            decision = self.policy.decide(now, self.batch, self.estimator.b_tilde, self.estimator.q_tilde,
                                          self.predicted_ms, self.capacity)
            if decision is None:
                return None
            self._requested = (decision.batch, now)
        self._ask(decision)
        return decision

    def _ask(self, decision: Decision) -> None:
        q = f"{decision.q_tilde:.1f}" if decision.q_tilde is not None else "-"
        reason = f"{decision.reason}: Q̃={q}"
        if decision.rate is not None:
            reason += f", {decision.rate:.1f}/s arriving"
        if decision.serves is not None and None not in decision.serves:
            reason += (f" (B={decision.current} serves {decision.serves[0]:.1f}/s, "
                       f"B={decision.batch} {decision.serves[1]:.1f}/s)")
        reason += f", B {decision.current} -> {decision.batch}"
        message = control.ControlMessage(id=control.new_id(), model=self.model, batch=decision.batch,
                                         reason=reason, origin="estimator", decided=time.time())
        control.send(self.r, self.keys, message)
        log.info("model %s: asking for B=%d (%s)", self.model, decision.batch, reason)

    def _run(self) -> None:
        base = self.config.sample_ms / 1000.0
        next_at = time.monotonic()
        while not self._stop.is_set():
            # A pinned deployment's estimate is only shown (status): sampled 20x less often.
            # Quiet at the smallest B (nothing waiting, nothing to decide): 10x less often,
            # and at once when the dispatch loop hands out a batch.
            # Steady (the estimate agreeing with B for a timeout): 8x less often.
            self._quiet = self.adaptive and self.quiet()
            self._steady = self.adaptive and not self._quiet and self.steady()
            period = base * (PINNED_SLOWDOWN if not self.adaptive else QUIET_SLOWDOWN if self._quiet
                             else STEADY_SLOWDOWN if self._steady else 1)
            try:
                self.sample()
            except redis.RedisError as exc:
                log.debug("estimator sample failed: %s", exc)
                self._stop.wait(0.5)  # the dispatch loop reports and recovers; do not spin
            except Exception:  # noqa: BLE001 - the estimator must not end the dispatcher
                log.exception("estimator sample failed")
                self._stop.wait(0.5)
            next_at += period
            delay = next_at - time.monotonic()
            if delay < 0:
                next_at = time.monotonic()  # fell behind (a slow Redis): no burst to catch up
                delay = 0
            if self._wake.wait(delay):
                self._wake.clear()
                next_at = time.monotonic()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="estimator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(1.0)
        if self._conn is not None and (self._thread is None or not self._thread.is_alive()):
            self._conn.disconnect()
            self._conn = None
