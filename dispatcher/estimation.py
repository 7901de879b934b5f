"""Batch-size estimation: what B the load asks for, and when to change to it.

Packrat's estimator, as its design describes it, with two guards of our own
against reconfiguration storms:

- **Sample** the model's request stream length every ``sample_ms`` (5 ms).
  Payloads stay in the request stream until their instance answers them, so
  ``XLEN`` counts every request not yet answered, waiting or running: the
  load's concurrency. (The waiting part alone would read about zero right
  after every dispatch and about B just before, whatever B is; the estimate
  would chase its own batches.) In a closed loop of C clients it reads C; in
  an open loop it reads arrival rate × time in the system (Little's law).
- **Smooth** it: ``Q̃ ← α·Q̂ + (1−α)·Q̃`` (α = 0.1).
- **Round** to the next lower power of two of the nearest integer (a stream
  length is one; an EWMA of a constant 16 only approaches 16 from below),
  clamped to ``[min_batch, max_batch]``: ``B̂``. Guard 1, hysteresis: below the current B, ``B̂``
  stays at B until ``Q̃`` is below ``(1 − hysteresis)·B``; a load that sits on
  a boundary (Q̃ wandering between 7 and 9 around B = 8) does not flip B̂.
- **Vote**: ``B̃`` is the mode of the last ``window`` (10) values of ``B̂``
  (ties go to the most recent).
- **Decide** (:class:`Policy`): when ``B̃ ≠ B`` has held for the whole
  reconfiguration timeout (1 s; 0.25 s for a larger B: up is quick, down is
  slow), change to ``B̃``. Guard 2, damping: a change
  that undoes the previous one within ``flap_window_s`` doubles the timeout
  (up to ``max_timeout_s``); only ``max_timeout_s`` of the estimate agreeing
  with B throughout restores it (a load alternating faster than the damped
  timeout never does, and is served with one configuration). Two more triggers, as the design has them, act on what
  the dispatcher sees over ``trigger_period_s``: batch-aggregation timeouts
  firing on most batches (B is larger than what arrives: go to the size that
  does arrive) and a large queueing delay (requests wait longer than
  ``queue_delay_factor`` × the predicted latency: B is too small).

A third guard, against going down to a B that cannot carry the load: a
smaller B is only taken when what it can serve (its planned capacity,
``B / L(B)`` from the profile) exceeds the arrivals of the last
``rate_window_s`` (5 s) by ``capacity_margin`` (20%: at a higher
utilisation the queueing delay of the smaller B grows fast), the arrivals
counted exactly (the stream's length plus the answered count) and taken at
their high bound (:meth:`Policy.rate_bound`: a count is a Poisson count). Near saturation the
stream's length (and the batches cut by the timeout while a large B's
partial batches are served) says "smaller" in the quiet moments between
bursts; the smaller B then falls behind, the backlog grows, and B goes back
up: a limit cycle under a steady load, which the first benchmark showed
(32 → 16 → 32 five times in 19 s at 95% of B=16's capacity).

A fourth, against going up for nothing: the estimate alone moves B up only
while the current B is busy: the arrivals of the rate window at least
``up_utilisation`` (60%) of its planned capacity, or those of the last second
its whole capacity (see :meth:`Policy.busy`). In steady state a stream
length of 2 at B=1 needs about 77% utilisation (M/D/1), so this keeps every
move up a load asks for; what it stops is a short Poisson burst at low load
(Q̃, smoothed over 50 ms, rises within one 90 ms ResNet-50 batch) and the
feedback it starts where batching buys little: on two cores, ResNet-50 at
B=2 is two 1-thread instances, a lone request there waits the batch timeout
and runs on one core, it stays longer in the stream, Q̃ reads higher, and
B climbed 1 → 2 → 4 → 8 at a quarter of the load B=1 carries (seven changes
in a 20 s idle phase, docs/figures.md). A queue that really builds still
moves B at once through the queue-delay trigger, whatever the profile says, and so does an
estimate four times B or more (Q̃ ≥ 4 at B=1 is no burst: the second ResNet-50 run read 4 within
1.5 s of a step to saturation, on a host slower than even the measured ratio said, and the
queue-delay trigger alone took 5 s).

A fifth, against a larger B that buys nothing (:meth:`Policy.worth`): B̃ is
lowered to the smallest B up to it whose planned capacity is within ``knee``
(5%) of the best capacity up to B̃. Packrat's estimator assumes that a larger
batch serves more requests a second (true of ResNet-50 on 16 cores: 50 → 184
requests/s from B=1 to 32). Where the profile is flat, the estimate feeds
itself: the stream's length is arrival rate × time in the system (Little's
law), a larger B makes every batch slower, the length grows with it, and the
larger B confirms itself. On two cores a traced ResNet-50 plans 17.9
requests/s at B=4 and 14.6 at B=32; the 2026-12-01 runs climbed to B=32 at
the step and held it at 90% load, each 16-image sub-batch taking seconds,
against a static B=32 whose 50 ms timeout cut batches of one or two (mean
1,559 against 521 ms). For a backlog of Q served in batches of B the mean
completion time is (Q + B) / (2 · capacity(B)): past the knee a larger B only
loses.

A sixth, the target (:meth:`Policy.carrying`): B̃ is raised to the smallest B
whose planned capacity carries the measured arrivals with the capacity
margin, so a step goes there in one change and a lull under load does not
take B below it. And a seventh, the switch: a change of thread counts
(active-passive, :meth:`Policy.switch_wait`) must be worth what it costs. A
move down that takes new processes waits twice the seconds its switch is
expected to over-subscribe the cores (:meth:`Policy.switch_cost_s`: the last
such change's, or what the current B's instances hold, if longer) beyond its
timeout; a move up that takes them needs
the rate window's arrivals, not one second's burst; for a rate window after
a move down, the backlog of the switch itself moves nothing up unless the
arrivals do.

And one exception to the up dwell, the surge (:meth:`Policy.surge`): when the
stream has held more than the current B serves in ``up_timeout_s`` (by its
planned capacity) for a tenth of a second, and grew meanwhile, the change is
made at once, to the B that carries the arrivals that growth measures (the
current B's capacity plus the growth per second). A step from idle to 90% of
B=32's capacity on 64 simulated cores went 1 -> 32 0.47 s in, with 160
requests queued behind a B=1 that serves 50 a second, and B=32's 10% to spare
took 4 s to drain them; with the surge, 0.32 s in, with 66.

Then the latency (:meth:`Policy.quickest`): where the plans predict each B's
mean latency at a rate (the dispatcher's flow simulated over the plan,
:mod:`dispatcher.queueing`), a smaller B predicted ``faster_gain`` (10%) sooner
at the count's high bound is taken, and a move up is not made while the
current B is predicted no later at the arrivals of the rate window. The margin
above says whether a smaller B may carry the load, not whether it is better:
at 86% of B=8's capacity on 16 simulated cores it held B=16 (141 ms against
94-99 for B=8), where the estimate confirms whichever of the two B serves.

Last, the plans yield to what was served (:meth:`Policy.learn`): when the
stream has held at least two of B's batches for a whole rate window, what
was dispatched is what B serves, and that rate stands in for B's planned
capacity in every rule above (for five minutes, renewed whenever B serves a
backlog again). An estimate above B under a load that nothing carries then
moves B to the B that serves the most, even where the knee said B: on two
cores a ResNet-50 held B=8, its plan's best, while it fell seconds behind.
"The most" under a load nothing carries is a tie of every B within ``knee``
of the best plan (:meth:`Policy.most`), plans that close being within a
profile's noise: the current B if tied, else one a reshare reaches, then
the fewest threads and the largest B. And a B not yet served is not
compared by its plan alone with one served: a loss measured at B' discounts
the plans of B with as many threads or more (:meth:`Policy.effective`).

Everything here is pure (a clock is passed in), so the rules are tested
without Redis or processes; :mod:`dispatcher.adaptive` runs them in the
dispatcher.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, Field


class EstimatorSettings(BaseModel):
    """The estimator's and the policy's parameters (the original's defaults)."""

    alpha: float = Field(default=0.1, gt=0, le=1, description="EWMA weight of a new sample.")
    window: int = Field(default=10, ge=1, description="B̃ is the mode of this many recent B̂.")
    sample_ms: float = Field(default=5.0, gt=0, description="How often the request stream's length is read.")
    min_batch: int = Field(default=1, ge=1)
    max_batch: int = Field(default=32, ge=1)
    hysteresis: float = Field(default=0.25, ge=0, lt=1,
                              description="Below B, B̂ stays B until Q̃ < (1 - hysteresis)·B.")
    reconfigure_timeout_s: float = Field(default=1.0, gt=0,
                                         description="B̃ must differ from B this long before a change.")
    up_timeout_s: float = Field(default=0.25, gt=0,
                                description="The dwell of a change to a larger B (and the gap after a change up "
                                            "before another one up): load that arrives is served at once.")
    max_timeout_s: float = Field(default=30.0, gt=0, description="Cap of the damped timeout.")
    flap_window_s: float = Field(default=30.0, ge=0,
                                 description="A change undoing the previous one within this doubles the timeout.")
    trigger_period_s: float = Field(default=1.0, gt=0, description="Window of the timeout and queue-delay triggers.")
    timeout_fraction: float = Field(default=0.5, gt=0, le=1,
                                    description="Trigger when this share of the period's batches were cut by the timeout.")
    queue_delay_factor: float = Field(default=2.0, gt=0,
                                      description="Trigger when median queueing delay > factor × predicted latency.")
    min_trigger_batches: int = Field(default=5, ge=1, description="Batches a trigger needs in its period.")
    capacity_margin: float = Field(default=0.2, ge=0, lt=1,
                                   description="A smaller B is taken only if its capacity exceeds the recent "
                                               "dispatch rate by this fraction.")
    rate_window_s: float = Field(default=5.0, gt=0, description="Window of the dispatch rate the guard reads.")
    up_utilisation: float = Field(default=0.6, ge=0, le=1,
                                  description="A larger B is taken on the estimate only while the recent dispatch "
                                              "rate is at least this share of the current B's capacity (the "
                                              "queue-delay trigger excepted).")
    switch_factor: float = Field(default=2.0, ge=0,
                                 description="A move down that needs an active-passive change waits this many "
                                             "times its switch's expected over-subscribed seconds beyond its "
                                             "timeout (Policy.switch_cost_s).")
    down_confidence: float = Field(default=1.5, ge=0,
                                   description="A smaller B must carry the arrival rate's high bound: the count "
                                               "of the window plus this many standard deviations of a Poisson "
                                               "count, over the window since the last move up at most.")
    faster_gain: float = Field(default=0.1, ge=0, lt=1,
                               description="A smaller B than the target is taken when its plans predict that "
                                           "requests arriving at the rate's high bound are answered at least "
                                           "this fraction sooner (Policy.quickest).")
    switch_gain: float = Field(default=0.1, ge=0,
                               description="Under a load no B carries, a move down that needs new processes "
                                           "(active-passive) is made only to a B that serves at least this "
                                           "fraction more than the current one (Policy.carrying).")
    switch_payback: bool = Field(default=True,
                                 description="A move down that needs new processes (active-passive) waits until the "
                                             "latency it is predicted to save at the arrivals' rate has paid for "
                                             "the backlog its switch is predicted to build (Policy.payback_s).")
    switch_keep: float = Field(default=0.5, ge=0, le=1,
                               description="The share of the current B's capacity still served while an "
                                           "active-passive switch over-subscribes the cores (Policy.payback_s).")
    knee: float = Field(default=0.05, ge=0, lt=1,
                        description="B̃ is lowered to the smallest B up to it whose planned capacity is within "
                                    "this fraction of the best of them: a larger B that serves no more only "
                                    "makes each batch slower.")


#: An estimate this many times the current B moves it up whether or not the current B looks busy.
FAR_ABOVE = 4
#: The stream-length samples the rates read are kept this far apart (seconds; see ``Policy.record_length``).
LENGTH_RESOLUTION_S = 0.02
#: How long the stream must overrun the current B before its growth is read as the arrivals (seconds;
#: see ``Policy.surge``): five samples of the full rate, and a step's growth measured on the step alone.
SURGE_WINDOW_S = 0.1
#: A smaller B is predicted against the target only where it serves the rate's high bound with this to spare
#: (the simulation gives a rate past capacity a large but finite mean; this keeps such a B out).
FASTER_SPARE = 0.05
#: ... and with this to spare where it is the B that the last change moved up from (see ``Policy._left_up``).
UNDO_SPARE = 0.10
#: How long a B's served capacity, measured under a backlog, stands in for its plan's (seconds;
#: see ``Policy.learn``): a host's speed drifts, and a measurement is renewed whenever B serves a backlog.
SERVED_TTL_S = 300.0


def floor_pow2(x: float) -> int:
    """The largest power of two ≤ ``x`` (1 for anything below 2)."""
    if x < 2:
        return 1
    return 1 << (int(x).bit_length() - 1)


class Estimator:
    """Q̃ (EWMA of the sampled stream length), B̂ and B̃ (mode of the recent B̂)."""

    def __init__(self, settings: EstimatorSettings | None = None) -> None:
        self.settings = settings or EstimatorSettings()
        self.q_tilde: float | None = None
        self._recent: deque[int] = deque(maxlen=self.settings.window)

    def b_hat(self, q: float, current: int | None = None) -> int:
        """B̂ for a smoothed length ``q`` while serving ``current`` (hysteresis below it)."""
        s = self.settings
        b = min(max(floor_pow2(math.floor(q + 0.5)), s.min_batch), s.max_batch)
        if current is not None and b < current and q >= (1 - s.hysteresis) * current:
            b = min(current, s.max_batch)
        return b

    def observe(self, length: int, current: int | None = None) -> int:
        """Take one sample of the stream length; returns B̂."""
        a = self.settings.alpha
        self.q_tilde = float(length) if self.q_tilde is None else a * length + (1 - a) * self.q_tilde
        b = self.b_hat(self.q_tilde, current)
        self._recent.append(b)
        return b

    @property
    def last(self) -> int | None:
        """The latest B̂ (None before a sample)."""
        return self._recent[-1] if self._recent else None

    @property
    def b_tilde(self) -> int | None:
        """The mode of the last ``window`` B̂; ties go to the most recent value. None before a sample."""
        if not self._recent:
            return None
        counts = Counter(self._recent)
        top = max(counts.values())
        for b in reversed(self._recent):
            if counts[b] == top:
                return b
        return None  # pragma: no cover - unreachable


def _keep(samples: deque[tuple[float, int]], now: float, value: int, window_s: float) -> None:
    """Add a sample, within ``LENGTH_RESOLUTION_S`` of the last two replacing the last; keep ``window_s``."""
    if len(samples) > 1 and now - samples[-1][0] < LENGTH_RESOLUTION_S and now - samples[-2][0] < LENGTH_RESOLUTION_S:
        samples[-1] = (now, value)
    else:
        samples.append((now, value))
    horizon = now - window_s
    while len(samples) > 1 and samples[1][0] <= horizon:
        samples.popleft()


@dataclass(frozen=True)
class Decision:
    """Change the model's aggregated batch to ``batch``, and why."""

    batch: int
    reason: str
    current: int
    q_tilde: float | None = None
    #: The arrival rate the decision read (requests/s, :meth:`Policy.rate`), and what the current and the
    #: new B serve (requests/s: the plan, or what serving measured): the evidence, for the history.
    rate: float | None = None
    serves: tuple[float | None, float | None] | None = None


@dataclass
class _Batch:
    at: float
    size: int
    timed_out: bool
    queue_ms: float


@dataclass
class Policy:
    """When the estimate becomes a reconfiguration (see the module docstring)."""

    settings: EstimatorSettings = field(default_factory=EstimatorSettings)
    #: Time since when B̃ has differed from the current B (None: it does not).
    disagree_since: float | None = None
    #: Time since when B̃ has agreed with B throughout (None: it does not now).
    agree_since: float | None = None
    timeout_s: float = 0.0
    last_change_at: float | None = None
    last_change: tuple[int, int] | None = None
    _batches: deque[_Batch] = field(default_factory=deque)
    #: The last ``min_trigger_batches`` batches, however old (up to ``rate_window_s``): the queue-delay
    #: trigger's evidence when batches are slow (two ResNet-50 batches a second never make five in one).
    _last_batches: deque[_Batch] = field(default_factory=deque)
    #: (time, size) of the batches of the last ``rate_window_s``, kept across changes: the load's rate.
    _flow: deque[tuple[float, int]] = field(default_factory=deque)
    _flow_since: float | None = None
    #: (time, stream length) samples of the last ``rate_window_s``: what the stream grew by.
    _lengths: deque[tuple[float, int]] = field(default_factory=deque)
    #: (time, requests ever arrived) samples, kept as ``_lengths`` are, where the sampler reads the model's
    #: answered count with the length: the arrivals, exactly (:meth:`arrived`).
    _totals: deque[tuple[float, int]] = field(default_factory=deque)
    #: Whether going from one B to another takes new processes (an active-passive change), by the plans;
    #: None: unknown, every change counts as cheap.
    needs_processes: Callable[[int, int], bool] | None = None
    #: The most threads of any instance in a B's plans (None where unknown); None: unknown for every B,
    #: and a loss measured at one B discounts no other B's plan (:meth:`effective`).
    threads: Callable[[int], int | None] | None = None
    #: How long the last active-passive change over-subscribed the cores (seconds, as its history says).
    switch_s: float = 0.0
    #: Seconds B's instances are expected to take, under load, to serve what they hold (half the sub-batch
    #: running and those queued behind it), by its plans; None where unknown. A switch away from B lasts at
    #: least that (:meth:`switch_cost_s`); None: unknown for every B, the last switch's length stands.
    drain_s: Callable[[int], float | None] | None = None
    #: The mean ms from arrival to answer of a B's plans at a rate (requests/s), None where unknown
    #: (:meth:`quickest`); None: no prediction, the capacity margin alone decides.
    latency: Callable[[int, float], float | None] | None = None
    #: Whether going from one B to another would start more processes than the nodes have spares loaded,
    #: while they are loading more (``PlannedCapacity.awaiting_spares``); None: never waited for.
    awaiting_spares: Callable[[int, int, float], bool] | None = None
    #: Seconds the processes going from one B to another starts beyond the loaded spares take to load
    #: (``PlannedCapacity.cold_start_s``; None where unknown); None: never priced (:meth:`switch_cost_s`).
    cold_start_s: Callable[[int, int], float | None] | None = None
    #: The last lowering :meth:`quickest` made: (from B, its ms, to B, its ms, the rate), for the reason.
    _faster: tuple[int, float, int, float, float] | None = None
    #: The payback time (s) of the move down last looked at, where it, not ``switch_factor``, set the wait.
    _payback: float | None = None
    #: Since when the stream has overrun the current B (:meth:`surge`; None: it does not).
    _overrun_since: float | None = None
    #: Per B, (requests/s it served under a backlog, when measured): :meth:`learn`, :meth:`effective`.
    served: dict[int, tuple[float, float]] = field(default_factory=dict)
    _learned_at: float | None = None
    #: Since when every length sample has held at least two of the current B's batches (None: the last did not).
    _backlog_since: float | None = None

    def __post_init__(self) -> None:
        self.timeout_s = self.settings.reconfigure_timeout_s
        self._last_batches = deque(maxlen=self.settings.min_trigger_batches)

    # --- what the dispatcher sees ---------------------------------------
    def record_batch(self, now: float, size: int, timed_out: bool, queue_ms: float) -> None:
        """One dispatched batch: its size, whether the timeout cut it short, its oldest request's wait."""
        self._batches.append(_Batch(now, size, timed_out, queue_ms))
        self._last_batches.append(self._batches[-1])
        self._flow.append((now, size))
        if self._flow_since is None:
            self._flow_since = now
        self._forget(now)

    def record_length(self, now: float, length: int, answered: int | None = None) -> None:
        """One sample of the request stream's length (the estimator's): the rate adds what it grew by.

        ``answered``: the model's count of requests ever answered, read with
        the length. Every request is in the stream until the transaction
        that answers it deletes it and adds to that count, so length plus
        answered is every request that ever arrived, and the rates read the
        arrivals from it exactly (:meth:`arrived`).

        Kept at most every ``LENGTH_RESOLUTION_S`` (a newer sample within it replaces the last): the
        rates look at 1 s and 5 s windows, and each decision scans what is kept (a thousand samples
        in 5 s took a third of the sampler's CPU).
        """
        _keep(self._lengths, now, length, self.settings.rate_window_s)
        if answered is None:
            self._totals.clear()  # no count (Redis Cluster, a test): the dispatched batches and the length
        else:
            if self._totals and length + answered < self._totals[-1][1]:
                # Fewer than ever arrived: requests deleted unanswered (a reply_to that is no stream), or a
                # Redis that restarted empty. Counted from here.
                self._totals.clear()
            _keep(self._totals, now, length + answered, self.settings.rate_window_s)

    def _length_change(self, since: float) -> int:
        """How much the stream's length changed since ``since`` (by the samples; negative if it shrank)."""
        if not self._lengths:
            return 0
        # From the newest back (the 1 s window is the short end of the 5 s kept): the oldest sample at or
        # after ``since``, or the newest if none is.
        then = self._lengths[-1][1]
        for at, length in reversed(self._lengths):
            if at < since:
                break
            then = length
        return self._lengths[-1][1] - then

    def arrived(self, since: float) -> float | None:
        """Requests per second that arrived since ``since``, exactly, by the sampled counts; None without them.

        Why not the batches dispatched plus what the stream grew by (the
        fallback): dispatches come in lumps of a sub-batch each time an
        instance frees up, and the stream's length counts the requests being
        served too, so that sum lags a step and follows each batch's answer.
        On the Zen 3 host's ResNet-50 (12-03, 16.1 requests/s arriving) it
        read 12.0, 13.8 and 14.6 at three moves from B=16 down to B=2, which
        a 20% margin then let through, and 18-24 at the moves back up,
        0.3-10 s later.
        """
        if len(self._totals) < 2:
            return None
        at, total = self._totals[-1]
        then_at, then = at, total
        for sample_at, sample in reversed(self._totals):
            if sample_at < since:
                break
            then_at, then = sample_at, sample
        if then_at == at or then_at - since > LENGTH_RESOLUTION_S + (at - since) / 2:
            return None  # the counts begin within the window: too little of it seen
        return (total - then) / (at - then_at)

    def _growth(self, since: float) -> int:
        """How much the stream grew since ``since``, never less than 0."""
        return max(0, self._length_change(since))

    def _forget(self, now: float) -> None:
        horizon = now - self.settings.trigger_period_s
        while self._batches and self._batches[0].at < horizon:
            self._batches.popleft()
        horizon = now - self.settings.rate_window_s
        while self._flow and self._flow[0][0] < horizon:
            self._flow.popleft()

    def changed(self, now: float, old: int, new: int) -> None:
        """A reconfiguration from ``old`` to ``new`` took effect (whoever asked for it)."""
        s = self.settings
        # The exact undo only. Damping every reversal of direction (tried: 1 -> 2 -> 4 -> 1 -> 2 at idle
        # is no exact undo) held a ResNet-50 trace at B=2 for 8 s after its load came back (a ramp
        # down, then a step, is two reversals in 20 s); the up guard's arrivals stop that storm instead.
        if (self.last_change is not None and self.last_change_at is not None
                and self.last_change == (new, old) and now - self.last_change_at <= s.flap_window_s):
            self.timeout_s = min(self.timeout_s * 2, s.max_timeout_s)
        self.last_change = (old, new)
        self.last_change_at = now
        self.disagree_since = None
        self.agree_since = None
        self._overrun_since = None
        self._backlog_since = None
        self._batches.clear()
        self._last_batches.clear()

    # --- deciding --------------------------------------------------------
    def rate(self, now: float) -> float | None:
        """Requests arriving per second: the larger of the last ``rate_window_s`` and the last trigger period.

        Counted exactly where the sampler reads the answered count
        (:meth:`arrived`); otherwise the batches dispatched, plus what the
        stream grew by.

        The long window keeps a rate wandering near a boundary from letting a
        smaller B through; the short one sees a step up at once (a backlog
        draining right after a change up is the load a smaller B would face).
        None before one trigger period has been watched.
        """
        self._forget(now)
        span = self._span(now)
        if span is None:
            return None
        # Arrivals, not only what was dispatched: a dispatcher or instances that cannot keep up
        # dispatch less than arrives, and the difference stays in the stream (the second 16-core
        # run, on a slowed host, went 32 -> 16 -> 32 five times under a steady load for it).
        short_s = self.settings.trigger_period_s
        long, short = self.arrived(now - span), self.arrived(now - short_s)
        if long is not None and short is not None:
            return max(long, short)
        return max(self._inferred(now, now - span), self._inferred(now, now - short_s))

    def rate_bound(self, now: float) -> float | None:
        """A high bound of the arrival rate, which a smaller B must carry (with the margin) to be taken.

        The count of the rate window plus ``down_confidence`` standard
        deviations of a Poisson count, per second; the window reaches back no
        further than the last move up (at least a trigger period): a step
        that moved B up is the load now, and the quiet before it is not.
        Never below :meth:`rate`. Why: a rate window holds a count of
        arrivals, and at 16 a second a second's count is 16 ± 4. The
        timeouts trigger looks 200 times a second, and sooner or later finds
        a window whose count lets a smaller B through: on the Zen 3 host's
        ResNet-50 (12-03), at 16.1-16.3 requests/s on a flat profile (B=2
        16.3/s, B=16 17.7/s), the rate read 12.0 and 12.6 at moves from B=16
        to 2, counted exactly, 1.3 s after a step had moved B up (and 5 s of
        window half idle); each was undone 0.4-1.4 s later.
        """
        rate = self.rate(now)
        bound = self._count_bound(now)
        if rate is None or bound is None:
            return rate
        return max(rate, bound)

    def _count_bound(self, now: float) -> float | None:
        """The count part of :meth:`rate_bound`: the window's count plus ``down_confidence`` deviations, per
        second, the window reaching back no further than the last move up (at least a trigger period)."""
        span = self._span(now)
        if span is None:
            return None
        s = self.settings
        since = now - span
        if (self.last_change is not None and self.last_change[1] > self.last_change[0]
                and self.last_change_at is not None):
            since = max(since, min(self.last_change_at, now - s.trigger_period_s))
        window = now - since
        per_s = self.arrived(since)
        count = (per_s if per_s is not None else self._inferred(now, since)) * window
        return (count + s.down_confidence * math.sqrt(max(count, 1.0))) / window

    def _long_rate(self, now: float) -> float | None:
        """The arrivals of the whole rate window (or as much of it as was watched), per second."""
        span = self._span(now)
        if span is None:
            return None
        exact = self.arrived(now - span)
        return exact if exact is not None else self._inferred(now, now - span)

    def _inferred(self, now: float, since: float) -> float:
        """Requests per second since ``since`` without the answered count: dispatched, plus what the stream grew by."""
        return (self._dispatched(since) + self._growth(since)) / (now - since)

    def _span(self, now: float) -> float | None:
        """The rate window as watched so far (at most ``rate_window_s``); None before one trigger period."""
        s = self.settings
        if self._flow_since is None or now - self._flow_since < s.trigger_period_s:
            return None
        return min(s.rate_window_s, now - self._flow_since)

    def _dispatched(self, since: float) -> int:
        """Requests dispatched since ``since`` (within the rate window kept)."""
        total = 0
        for at, size in reversed(self._flow):  # newest first: the batches are in time order
            if at < since:
                break
            total += size
        return total

    def arrivals(self, now: float, window: float) -> float:
        """Requests that arrived per second over the last ``window``: counted (:meth:`arrived`), or else
        dispatched plus the stream's change in length.

        Unlike :meth:`rate`'s fallback a shrinking stream counts against the dispatches:
        ``XLEN`` holds every request not yet answered, so a backlog drained
        right after a stall (a reconfiguration's over-subscribed seconds)
        is dispatched fast while the stream shrinks by as much; what is left
        is what arrived. The up guard reads this, where an over-estimate
        moves B for nothing.
        """
        since = now - window
        exact = self.arrived(since)
        if exact is not None:
            return exact
        return max(0.0, (self._dispatched(since) + self._length_change(since)) / window)

    def short_of_capacity(self, now: float, batch: int, capacity: Callable[[int], float | None] | None,
                          current: int | None = None) -> bool:
        """Whether ``batch`` could not serve the recent dispatch rate with the margin to spare.

        Never when it serves more than ``current`` (past the knee a smaller B
        is the one that carries more: staying would not help).
        """
        if capacity is None:
            return False
        cap = capacity(batch)
        if cap is None:
            return False
        now_cap = capacity(current) if current is not None else None
        if now_cap is not None and cap > now_cap:
            return False
        rate = self.rate(now)
        # Not yet a period of batches seen (a dispatcher just started): no smaller B blind.
        return rate is None or rate > (1 - self.settings.capacity_margin) * cap

    def busy(self, now: float, batch: int, capacity: Callable[[int], float | None] | None,
             sustained: bool = False) -> bool:
        """Whether ``batch`` is loaded enough that a larger B may pay.

        Busy: the arrivals of the rate window (5 s) are at least
        ``up_utilisation`` × its capacity, or those of the last trigger period
        (1 s) reach its whole capacity. A second's arrivals against the 60%
        bar would be no guard: a Poisson burst that lifts the estimate is the
        same burst that lifts that second's count (at 2.7 requests/s against
        B=1's 8.4, a second holds 6 or more 6% of the time, and such seconds
        are the ones with Q̃ high: an idle ResNet-50 on two cores went
        1 → 2 → 4 → 1 → 2 → 16 → 2 in 15 s, docs/decisions.md). A real step
        up reaches the whole capacity within the second.

        Unknown (no capacity, or less than one trigger period watched) counts
        as busy: the estimate alone decides, as before.

        ``sustained``: the rate window's arrivals only. A move up that takes new
        processes costs an active-passive switch (2.7 s over-subscribed for
        ResNet-50 on two cores), longer than a burst takes to drain at the
        current B: at 2.2 requests/s eight arrived within a second, B went
        1 -> 4, and the burst's requests waited for the switch, up to 3 s.
        A real step fills the 5 s window within about a second more.
        """
        cap = capacity(batch) if capacity is not None else None
        span = self._span(now)
        if cap is None or span is None:
            return True
        s = self.settings
        return (self.arrivals(now, span) >= s.up_utilisation * cap
                or (not sustained and self.arrivals(now, s.trigger_period_s) >= cap))

    def _candidates(self, upto: int) -> list[int]:
        """The values B̂ takes up to ``upto``: ``min_batch``, the powers of two above it, and ``upto``."""
        s = self.settings
        return sorted({s.min_batch, upto} | {1 << k for k in range(upto.bit_length()) if s.min_batch < 1 << k < upto})

    def carrying(self, now: float, b_tilde: int, current: int,
                 capacity: Callable[[int], float | None] | None, rate: float | None = None,
                 estimated: int | None = None) -> int:
        """``b_tilde`` raised to the smallest B that carries the arrivals with ``capacity_margin`` to spare.

        The estimate reads the stream's length, which says how much waits,
        not how fast it comes: a step to 90% of B=4's capacity reads Q̃ ≈ 2
        first, and B went 1 -> 2 -> 4 through two changes while the backlog
        grew (ResNet-50 on two cores, 2026-12-01). And below the current B
        a moment's lull says "smaller" under a load the smaller B cannot
        carry. So the target is the smallest B at or above the estimate
        whose planned capacity exceeds the measured rate (:meth:`rate`) by
        the margin; if none does, the B that serves the most (of those within
        the knee of the best, as :meth:`most` breaks the tie). Below the current B it never goes to a B that
        serves less than the current one without carrying the load, and an
        estimate at or below B never moves it up: only a queue that builds
        does, through the estimate. Capacity unknown: the estimate alone.
        Before one trigger period is watched (no rate): no smaller B, blind.
        ``rate``: a rate measured otherwise (:meth:`surge`), taken where it is higher.
        ``estimated``: the estimate before the knee lowered it to ``b_tilde``;
        above B, with a load nothing carries, it moves B up to the B that
        serves the most even where the knee said B (a B that serves less than
        planned, :meth:`learn`, gives way). Below B, with a load nothing carries, a B that needs new
        processes must serve ``switch_gain`` more than the current one.
        """
        if capacity is None:
            return b_tilde
        down = max(b_tilde, estimated or 0) <= current
        measured = self.rate_bound(now) if down else self.rate(now)  # down: carry the rate's high bound
        rate = measured if rate is None else rate if measured is None else max(measured, rate)
        if rate is None:
            return b_tilde if b_tilde > current else current
        s = self.settings
        need = rate / (1 - s.capacity_margin)
        target = None
        for b in self._candidates(s.max_batch):
            if b < b_tilde:
                continue
            cap = capacity(b)
            if cap is None:
                return b_tilde  # a plan unknown: the estimate decides
            if cap >= need:
                target = b
                break
        if target is None:  # nothing carries it: the B that serves the most (not the knee: the load needs it all)
            # With the estimate above B, only as far up as that: a B that serves less than its plan
            # (:meth:`learn`) gives way to a larger one, never to a smaller plan not yet served, which
            # the 12-03 ResNet-50 trace tried (8 -> 4 under its steady step) and took back by the
            # queue-delay trigger 6 s later.
            up = estimated is not None and estimated > current
            target = max(self.most(capacity, at_least=current if up else None, current=current), b_tilde)
            now_cap, cap = capacity(current), capacity(target)
            # Down to a B that needs new processes: only for ``switch_gain`` more. The switch over-subscribes the
            # cores for seconds while the load already outruns both, and a few percent is within the noise of a
            # served measure: on the Zen 4 host (12-04 19:05, 20.5/s arriving) B=32, measured at 15.3/s, went
            # to B=8's 16.0, with 7.5 s over-subscribed, and back to 32 by the queue delay 13 s later; every
            # loaded phase's p50 was then 5-12 s, against 1.2-4.6 s for static B=32.
            gain = self.settings.switch_gain if self.needs_switch(current, target) else 0.0
            if target < current and (cap is None or now_cap is None or cap <= (1 + gain) * now_cap):
                target = current
        return target if max(b_tilde, estimated or 0) > current else min(target, current)

    def quickest(self, now: float, target: int, current: int, capacity: Callable[[int], float | None] | None,
                 planned: Callable[[int], float | None] | None = None, *, stay: bool = True,
                 estimated: int | None = None) -> int:
        """``target`` lowered to a smaller B that the plans predict answers sooner at the arrivals' rate.

        The capacity margin (:meth:`carrying`) keeps a smaller B out unless
        it serves 20% more than arrives; it says nothing about latency. At
        86% of B=8's capacity on 16 simulated cores, B=8 answered in a mean
        of 94-99 ms, the B=16 the margin held in 141 ms and B=32 in 167 ms
        (docs/figures.md), and the estimate does not move B off 16 there: a
        slower B holds more in the stream, so the stream's length, which is
        the estimate, reads 16. So where the plans predict the mean latency
        at a rate (``latency``, the dispatcher's flow simulated over the
        plan, :mod:`dispatcher.queueing`), a B below the target is taken
        when it is predicted at least ``faster_gain`` (10%) sooner than the
        target, and serves the rate read with ``FASTER_SPARE`` (5%) to spare;
        of such B, the one predicted soonest. Below the current B (through a
        move down's dwell, the caller's) the rate read is the count's high
        bound (:meth:`rate_bound` without the last second's rate: a second's
        count at 125/s is 125 ± 11, and a second read at 149 took B=8 back
        to 16 in the benchmark's diurnal-5). A move up goes no lower than
        the current B, and not at all while the current B serves the rate
        window's arrivals and is predicted no later than the target there
        (at B=8 under that load, a moment's Q̃ of 16 would move B up to what
        the prediction then takes back; the two rules' gains, 10% down and
        none to stay, are the hysteresis). A queue that builds still moves B up
        (the queue-delay trigger and the surge look past this), and a B measured
        serving less than the arrivals is never kept by it. Where B was measured serving less
        than its plan (:meth:`learn`), its predicted latency is stretched by
        as much, at the load it then carries. No prediction, no rate: ``target``.
        ``capacity``: as served where measured (:meth:`effective`); ``planned``: the plans' alone.
        ``stay=False``: a move up that is made anyway (a queue that builds), lowered only. A move up
        whose estimate (``estimated``, before the knee) is ``FAR_ABOVE`` times B is left alone: a
        step from idle on 64 simulated cores read 4x B=1 within 0.3 s, while the rates, mostly
        idle, still said a small B answers sooner; the change came 0.3 s later than before, with
        twice as much in the stream (324 against 150), and the step's mean was 187-200 ms against
        118-121.
        """
        self._faster = None
        if self.latency is None or capacity is None:
            return target
        s = self.settings
        up = target > current
        if up and estimated is not None and estimated >= FAR_ABOVE * current:
            return target  # no moment's estimate: the step is the load, whatever the rate window says yet
        if up and stay:
            # Stay: the current B predicted no later than the target at the rate window's arrivals.
            rate = self._long_rate(now)
            cap = capacity(current)
            if rate and cap and rate < cap:
                ms, target_ms = (self._predicted(b, rate, capacity, planned) for b in (current, target))
                if ms is not None and target_ms is not None and ms <= target_ms:
                    self._faster = (target, target_ms, current, ms, rate)
                    return current
        if up:
            rate = self.rate(now)  # a smaller move up: the rate an up move reads (the last second's too)
            low = current + 1
        else:
            rate = self._count_bound(now)
            low = s.min_batch
        if not rate:
            return target
        # The B that serve the rate with the spare first: a simulation holds the dispatcher's GIL for
        # 10-30 ms, and near saturation (a step at 90% of B=32's capacity) none does, and every
        # millisecond the dispatch loop waits is a backlog that drains at the 10% to spare.
        undone = None if up else self._left_up(now, current)
        candidates = [b for b in self._candidates(target) if low <= b < target
                      and (cap := capacity(b)) is not None
                      and rate <= (1 - (UNDO_SPARE if b == undone else FASTER_SPARE)) * cap]
        if not candidates:
            return target
        base = self._predicted(target, rate, capacity, planned)
        if base is None:
            return target
        best, best_ms = target, (1 - s.faster_gain) * base
        for b in candidates:
            ms = self._predicted(b, rate, capacity, planned)
            if ms is not None and ms < best_ms:
                best, best_ms = b, ms
        if best != target:
            self._faster = (target, base, best, best_ms, rate)
        return best

    def _left_up(self, now: float, current: int) -> int | None:
        """The B the last change moved up from to ``current``, within ``flap_window_s``; else None.

        The prediction takes that B back only with ``UNDO_SPARE`` (10%) to spare
        (:meth:`quickest`), not ``FASTER_SPARE``: a queue that built there is what moved B up,
        and a prediction near saturation is optimistic (12% at 90% of B=32's capacity,
        docs/figures.md). At 95% of B=16's capacity on 16 simulated cores, the 12-07 runs went
        32 -> 16 by the prediction 7 s after the queue had moved B up from 16, and back 1.6-5 s
        later, in every run, for nothing: the phase's mean was within 1% of static B=32's.
        """
        change, at = self.last_change, self.last_change_at
        if change is None or at is None or change[1] != current or change[0] >= current:
            return None
        return change[0] if now - at <= self.settings.flap_window_s else None

    def _predicted(self, batch: int, rate: float, capacity: Callable[[int], float | None],
                   planned: Callable[[int], float | None] | None) -> float | None:
        """``latency(batch, rate)``, stretched by plan / served where ``batch`` was measured serving less.

        A B measured serving its plan's capacity divided by k answers as its
        plan would with every batch k times as long: at k times the rate, k
        times the time.
        """
        assert self.latency is not None
        served, plan = capacity(batch), planned(batch) if planned is not None else None
        stretch = plan / served if served and plan and served < plan else 1.0
        ms = self.latency(batch, rate * stretch)
        return None if ms is None else ms * stretch

    def most(self, capacity: Callable[[int], float | None], at_least: int | None = None,
             current: int | None = None) -> int:
        """Of the B up to ``max_batch`` (and from ``at_least``) that serve within ``knee`` of the most: the
        ``current`` one; else those reached without new processes; of those the one whose instances have the
        fewest threads, and of those the largest; ``max_batch`` if any is unknown.

        Used where nothing carries the load, so every B falls behind and what
        counts is what it serves. Plans within the knee (5%) of each other
        are a tie: a profile's passes spread by a median of 8.6% on the Zen 4
        host (docs/figures.md). Of tied plans the one of fewest threads loses
        least to what the plan does not see, the path's processes taking
        time slices (an instance of several threads stalls at every barrier
        for a preempted thread; :meth:`learn`), and of those the largest B
        (thread counts unknown: the largest). A tie reached by a reshare is
        taken over one that needs an active-passive switch: on 12-06 12:58-13:15
        the tie-break alone took B=1 (one 2-thread instance) to B=32 (two
        1-thread ones) at the step where B=8 was a reshare, and the later
        moves back to the 2-thread layout were switches of 1-4 s; the
        adaptive mean was 1.51x and 2.22x static B=32's, against 1.42x and
        1.36x with the exact maximum interleaved. A ``current`` B among the tied
        is kept: a tie is no reason to move, and without this the
        timeouts took B=32 down to a B=8 tied with it, whose plan then fell
        short of a burst, and "the most" took it back up, four times in 31 s
        (12-06 13:00). Measured with ResNet-50 on two cores
        (12-06 01:47 and 01:50): the plans gave B=8 (one 2-thread instance)
        17.83/s and B=32 (two 1-thread ones) 17.76/s; the exact maximum took
        B=8, which served 19.2-20.8/s under the step while static B=32 served
        26.5-26.9/s, and the step's p50 was 1086-1184 ms against 431-501.
        """
        candidates = [b for b in self._candidates(self.settings.max_batch) if at_least is None or b >= at_least]
        caps = [capacity(b) for b in candidates]
        if any(c is None for c in caps):
            return self.settings.max_batch
        best = max(c for c in caps if c is not None)
        tied = [b for b, c in zip(candidates, caps) if c is not None and c >= (1 - self.settings.knee) * best]
        if current in tied:
            return current
        if current is not None:  # a tie buys nothing a switch's seconds over-subscribed would pay for
            tied = [b for b in tied if not self.needs_switch(current, b)] or tied
        threads = self.threads

        def fewest_then_largest(b: int) -> tuple[int, int]:
            t = threads(b) if threads is not None else None
            return (-(t or 0), b)

        return max(tied, key=fewest_then_largest)

    def worth(self, b_tilde: int, capacity: Callable[[int], float | None] | None) -> int:
        """The smallest B up to ``b_tilde`` that serves within ``knee`` of the best of them (``b_tilde`` if unknown).

        Candidates are ``min_batch``, the powers of two above it and
        ``b_tilde`` itself, the values B̂ takes. Any capacity unknown: the
        estimate alone decides.
        """
        if capacity is None:
            return b_tilde
        s = self.settings
        candidates = self._candidates(b_tilde)
        caps = [capacity(b) for b in candidates]
        if any(c is None for c in caps):
            return b_tilde
        best = max(caps)
        return next(b for b, c in zip(candidates, caps) if c >= (1 - s.knee) * best)

    def learn(self, now: float, current: int) -> float | None:
        """What ``current`` served while the stream held a backlog for a whole rate window; None if it did not.

        The plan's capacity is the profile's batch latency of full batches
        with instances that own their cores; served, the path's processes
        share them, and instances of several threads lose most (each stolen
        slice stalls every thread at the next barrier). ResNet-50 on two
        cores (2026-12-03): the plan gave one 2-thread instance at B=8 28.1
        requests/s, the best of every B, and two 1-thread ones at B=32 25.6;
        under 25.3 a second, B=8 fell behind by seconds for 15 s while the
        knee held it there (nothing carried the load, and B=8 served "the
        most"), and static B=32 served the same phases at a p50 of 270-460
        ms. While at least one batch waits beyond one being served
        throughout the window (every length sample at least 2B), the
        instances never wait for work, and what was dispatched is what B
        serves. Looked at once a second; not within a rate window (and the
        switch) after a change, whose batches are not all the new B's.
        """
        s = self.settings
        # Every sample is looked at (the kept length samples merge those within 20 ms, a dip among them).
        if not self._lengths or self._lengths[-1][1] < 2 * current:
            self._backlog_since = None
        elif self._backlog_since is None:
            self._backlog_since = self._lengths[-1][0]
        if self._learned_at is not None and now - self._learned_at < s.trigger_period_s:
            return None
        self._learned_at = now
        since = now - s.rate_window_s
        settled = self.last_change_at is None or now - self.last_change_at >= s.rate_window_s + self.switch_s
        if (not settled or self._flow_since is None or self._flow_since > since
                or self._backlog_since is None or self._backlog_since > since):
            return None
        rate = self._dispatched(since) / s.rate_window_s
        if rate > 0:
            self.served[current] = (rate, now)
            return rate
        return None

    def measured(self, now: float) -> dict[int, float]:
        """What each B was measured to serve (:meth:`learn`), where that was within ``SERVED_TTL_S``."""
        return {b: rate for b, (rate, at) in self.served.items() if now - at <= SERVED_TTL_S}

    def effective(self, capacity: Callable[[int], float | None] | None,
                  now: float) -> Callable[[int], float | None] | None:
        """``capacity``, with what each B was measured to serve (:meth:`measured`) in place of its plan,
        and the plans of B not measured discounted by the loss measured at B of no more threads.

        A measure is served through the path, a plan is not: comparing one
        with the other favours whichever B has not been measured yet. What
        a plan loses when served is the path's processes taking time slices
        from the instances, and an instance of more threads loses at least
        as much (a stolen slice stalls every thread at the next barrier;
        :meth:`learn`). So where B' was measured serving ``r`` < 1 of its
        plan, the plan of a B not measured whose instances have at least
        as many threads as B''s is taken at ``r`` of itself (the least loss
        of such measures: no more discount than one shows). A B of fewer
        threads keeps its plan: on two cores (12-03) a 2-thread B=8 served
        0.82 of its plan while two 1-thread instances at B=32 served theirs.
        Why: on the Zen 4 host (12-06 12:44), B=32 (two 1-thread instances)
        was measured at 16.0/s under a backlog of 87 requests, B=8 (one
        2-thread instance) was planned at 18.8, 17% more; B went 32 -> 8
        with the switch over-subscribing the cores 6.6 s, and B=8 then
        served 16.0/s too (the queue delay took it to 16, then 32); the
        trace's mean was 9x static B=32's. With thread counts unknown, no
        plan is discounted.
        """
        served = self.measured(now) if capacity is not None else {}
        if not served:
            return capacity
        assert capacity is not None
        threads = self.threads
        losses: list[tuple[int, float]] = []  # (threads of the B measured, served / plan) where it served less
        if threads is not None:
            for b, rate in served.items():
                plan, t = capacity(b), threads(b)
                if plan and t is not None and rate < plan:
                    losses.append((t, rate / plan))

        def with_served(batch: int) -> float | None:
            if batch in served:
                return served[batch]
            plan = capacity(batch)
            if plan is None or not losses or threads is None:
                return plan
            t = threads(batch)
            ratios = [r for tb, r in losses if t is not None and tb <= t]
            return plan * max(ratios) if ratios else plan

        return with_served

    def decide(self, now: float, current: int, b_tilde: int | None, q_tilde: float | None = None,
               predicted_ms: float | None = None,
               capacity: Callable[[int], float | None] | None = None) -> Decision | None:
        """The change to ask for now, if any, with the rate and capacities it read.

        ``capacity(B)`` is what B can serve (requests/s, from the profile's
        plan), or None where unknown; without it no smaller B is refused.
        Where a B was measured serving a backlog, that measure stands in for
        its plan (:meth:`learn`).
        """
        decision = self._decide(now, current, b_tilde, q_tilde, predicted_ms, capacity)
        if decision is not None:
            # Why a change was made is read afterwards, in the history: an operator asking why B moved,
            # or a benchmark's flip (16 -> 2 by timeouts, 2 -> 16 by the estimate 0.36 s later) whose
            # rate was not recorded anywhere.
            served = self.effective(capacity, now)
            reason = decision.reason
            if decision.batch < current and self._payback is not None and math.isfinite(self._payback):
                reason += f" (its switch paid back in {self._payback:.1f} s)"
            decision = dataclasses.replace(
                decision, reason=reason, rate=self.rate(now),
                serves=(served(current), served(decision.batch)) if served is not None else None)
        return decision

    def _decide(self, now: float, current: int, b_tilde: int | None, q_tilde: float | None,
                predicted_ms: float | None,
                capacity: Callable[[int], float | None] | None) -> Decision | None:
        s = self.settings
        self._forget(now)
        if self._flow_since is None:
            self._flow_since = now  # the rate is measured from the first look on
        planned = capacity
        if capacity is not None:
            self.learn(now, current)
            capacity = self.effective(capacity, now)
        if b_tilde is None:
            return None
        estimated = b_tilde
        worth = self.worth(b_tilde, capacity)
        carried = self.carrying(now, worth, current, capacity, estimated=estimated)
        surge = self.surge(now, current, capacity)  # looked at on every sample: it tracks since when
        settling = (self.last_change is not None and self.last_change[1] < self.last_change[0]
                    and self.last_change_at is not None and now - self.last_change_at < s.rate_window_s)
        # Right after a move down the stream grows by what arrived while the switch stalled the cores: a
        # surge, or an estimate 4x B, is then no step unless the last second's arrivals outgrow the
        # smaller B; until they do, the prediction (which reads the arrivals) says whether it carries them.
        # On 16 simulated cores (12-07 11:07-11:32) all four runs' diurnal-5 went 16 -> 8 at 86% of B=8's
        # capacity, the switch shared the cores for 1.1-1.5 s, the stream grew from about 15 to 40 (more
        # than B=8 serves in the up dwell; Q̃ 32-36), and B went to 32 1.0-1.4 s later.
        stalled = settling and not self.outgrown(now, current, capacity)
        # A surge is past any prediction: the rate bound it reads has hardly seen the step yet.
        b_tilde = carried if surge is not None and carried > current and not stalled else self.quickest(
            now, carried, current, capacity, planned, estimated=None if stalled else estimated)
        # Kept by the prediction against a move up (:meth:`quickest`): no agreement, and the up dwell
        # counts on, so that when the rates catch up with a step the move is not 0.25 s later still (a
        # step from idle on 64 simulated cores moved 70-80 ms later, and its mean was 129-140 ms
        # against 115-120, in an interleaved A/B).
        kept = b_tilde == current < carried
        if kept:
            self.agree_since = None
            if self.disagree_since is None:
                self.disagree_since = now
        elif b_tilde == current:
            self.disagree_since = None
            if self.agree_since is None:
                self.agree_since = now
            elif self.timeout_s > s.reconfigure_timeout_s and now - self.agree_since >= s.max_timeout_s:
                self.timeout_s = s.reconfigure_timeout_s  # steady for long: forget past flapping
        else:
            self.agree_since = None
            if self.disagree_since is None:
                self.disagree_since = now
        # Up is quick, down is slow (as autoscalers do): a backlog building at a B too small costs
        # every request behind it, one a B too large serves costs a batch wait. An up move waits
        # ``up_timeout_s``, and may follow an earlier up move as soon; anything else waits one
        # (damped) timeout after the last change, so a reversal never comes quick.
        # A move up after a move down waits the (damped) timeout too, unless the current B cannot carry
        # the arrivals: then the move down was the mistake, and holding it is what builds the backlog
        # (a ResNet-50 on two cores held B=2 under a load only B=4 carries for 26 s, by a timeout damped to
        # 16 s). Damping still doubles each undo, so the next move down waits longer.
        up = b_tilde > current
        climbing = up and (self.last_change is not None and self.last_change[1] > self.last_change[0]
                           or (capacity is not None and self.short_of_capacity(now, current, capacity)))
        switch_wait = 0.0 if up else self.switch_wait(current, b_tilde, now, capacity, planned)
        if not up and b_tilde < current and self.spares_due(now, current, b_tilde, capacity):
            return None  # the spares it would rebind are loading: no cold starts beside the instances serving
        # Right after a move down, the stream holds what arrived while the change was carried out (an
        # active-passive change over-subscribes the cores for a second or two): a large estimate or a
        # long queueing delay then says how long the change took, not what the load needs. Up moves
        # then need the arrivals to say so (the up guard), for one rate window. A move down the load
        # outgrows is still undone at once: its arrivals are busy for the smaller B. (ResNet-50 on two
        # cores, at 40% of B=1's capacity, went 4 -> 1 -> 4 within 2.5 s: Q̃ read 3.6 after the switch.)
        dwell = min(self.timeout_s, s.up_timeout_s) if up else self.timeout_s + switch_wait
        if surge is not None and up and not settling and worth >= FAR_ABOVE * current:
            # A queue the current B cannot clear within the dwell, and growing: no burst to wait out. Go
            # now, and to what carries the arrivals as the stream's growth measures them (the rate
            # windows of a second or more have hardly seen the step yet).
            dwell = 0.0
            b_tilde = max(b_tilde, self.carrying(now, worth, current, capacity, rate=surge))
        gap = dwell if climbing else self.timeout_s
        if self.last_change_at is not None and now - self.last_change_at < gap:
            return None
        if not kept and self.disagree_since is not None and now - self.disagree_since >= dwell:
            # Two powers of two above B is no burst (a lone Poisson burst at low load reads 2-3 at B=1):
            # the queue builds whatever the planned capacity says (a machine slower than its profile).
            if (not up or (worth >= FAR_ABOVE * current and not settling)
                    or self.busy(now, current, capacity, sustained=self.needs_switch(current, b_tilde))):
                if up and surge is None and worth >= FAR_ABOVE * current and not settling:
                    # A step the estimate saw before the surge's window was over: its target still carries
                    # what the stream's growth says arrives, not the rate windows' average of the step with
                    # the quiet before it. On 16 simulated cores (12-07) a step to 165/s went 1 -> 8 at
                    # 49/s "arriving" in two runs of four, and 8 -> 32 2.9 s later, cold-starting 6-7
                    # instances: the step's mean 297-308 ms against 216-220 where it went 1 -> 32 at once.
                    grown = self.grown(current, capacity, high=True)
                    if grown is not None:
                        b_tilde = max(b_tilde, self.carrying(now, worth, current, capacity, rate=grown))
                return Decision(b_tilde, self._reason(estimated, worth, b_tilde, self._faster), current, q_tilde)
            # A burst, or the feedback of a larger B's slower lone requests, not a load that B cannot
            # carry: stay (a queue that really builds still moves B, through the queue-delay trigger).
        if up and settling and not self.busy(now, current, capacity):
            return None
        if switch_wait and (self.disagree_since is None or now - self.disagree_since < switch_wait):
            return None  # a move down that needs new processes waits for what it costs, trigger or not
        # A queue that builds at a B the prediction keeps proves it wrong: the queue-delay trigger then moves
        # up anyway, to the smallest B up to the target predicted sooner. Not right after a move down: the
        # stream then holds what arrived during the switch (1.2 s over-subscribed at 64 simulated cores,
        # where B=16 went back to 32 1.3 s after the rule chose it, twice in a run).
        lifted = (self.quickest(now, carried, current, capacity, planned, stay=False)
                  if b_tilde == current < carried and not settling else None)
        return self._triggered(now, current, b_tilde, q_tilde, predicted_ms, lifted)

    def outgrown(self, now: float, current: int, capacity: Callable[[int], float | None] | None) -> bool:
        """Whether the last trigger period's arrivals exceed what ``current`` serves by more than a Poisson
        count's ``down_confidence`` deviations (capacity unknown: True, nothing is held back blind).

        At 86% of B=8's capacity (125/s against 145) the rate read 139-146/s at the moves up of the
        16-core runs of 12-07; a load that outgrows the smaller B by a step (64 simulated cores'
        diurnal-1: 254/s at B=4's 198) is past the bound within the second.
        """
        cap = capacity(current) if capacity is not None else None
        if not cap:
            return True
        period = self.settings.trigger_period_s
        count = cap * period
        return self.arrivals(now, period) * period > count + self.settings.down_confidence * math.sqrt(count)

    def surge(self, now: float, current: int, capacity: Callable[[int], float | None] | None) -> float | None:
        """The arrival rate while the stream overruns ``current``; None when it does not.

        Overrun: the stream has held more than ``current`` serves within the
        up dwell (by its planned capacity) for ``SURGE_WINDOW_S``, and grew
        over the last ``SURGE_WINDOW_S``. Such a backlog is no burst to wait out: every request
        behind it waits whatever B does next, and the wait grows as long as B
        stays. On 64 simulated cores a step to 523 requests/s at B=1 (50 a
        second) had 37 in the stream 60 ms in and the vote said B=8; the
        dwell of 0.25 s let the backlog reach 160 before the change, and B=32
        then drained it with 10% to spare, in about 4 s.

        The rate is what ``current`` serves plus what the stream grew by per
        second over that window, all of it within the overrun: the rate
        windows (1 and 5 s) average a step with the quiet before it. It is
        taken at its count's high bound (:meth:`grown`), as a move down takes
        the rate window's: a step's first tenth of a second is a small count.
        Capacity unknown: None.
        """
        if self._overrun(current, capacity) is None:
            self._overrun_since = None
            return None
        at = self._lengths[-1][0]
        if self._overrun_since is None:
            self._overrun_since = at
        if at - self._overrun_since < SURGE_WINDOW_S:
            return None
        return self.grown(current, capacity, high=True)

    def grown(self, current: int, capacity: Callable[[int], float | None] | None,
              high: bool = False) -> float | None:
        """The arrival rate the stream's growth says while it overruns ``current`` now: what ``current``
        serves plus what the stream grew by per second over the last ``SURGE_WINDOW_S``; None when it
        holds no more than ``current`` serves within the up dwell, or did not grow.

        :meth:`surge` takes it once the overrun has held for that window. A
        move up the estimate makes sooner carries it too (:meth:`_decide`),
        at its ``high`` bound: the count of a tenth of a second is a small
        Poisson count (16 ± 4 at 165/s), and the margin on the count itself
        took a step to 165/s to B=16 or to 32 by chance (5 of 20 seeds to
        16, in a replay of the estimator), where 16 carries 168.5.
        """
        cap = self._overrun(current, capacity)
        if cap is None:
            return None
        at, length = self._lengths[-1]
        then_at, then = at, length
        for sample_at, sample in reversed(self._lengths):  # a few samples: the window is 0.1 s
            if sample_at < at - SURGE_WINDOW_S:
                break
            then_at, then = sample_at, sample
        if at - then_at <= 0 or length <= then:
            return None
        span = at - then_at
        arrived = length - then + cap * span
        if high:
            arrived += self.settings.down_confidence * math.sqrt(arrived)
        return arrived / span

    def _overrun(self, current: int, capacity: Callable[[int], float | None] | None) -> float | None:
        """``current``'s planned capacity where the stream's last length is more than it serves within the up
        dwell (it overruns B now); None where it is not, or the capacity is unknown."""
        cap = capacity(current) if capacity is not None else None
        if not cap or not self._lengths or self._lengths[-1][1] < cap * self.settings.up_timeout_s:
            return None
        return cap

    def switch_cost_s(self, current: int, target: int | None = None) -> float:
        """How long a switch away from ``current`` (to ``target``, where given) is expected to over-subscribe
        the cores (seconds; 0: no switch measured yet and no start time known, nothing is delayed on a guess).

        The new instances warm up while the old ones serve, and the cores
        stay shared until the old ones have served what they hold, so a
        switch lasts at least what ``current``'s instances hold
        (:attr:`drain_s`), whatever the last switch took. The policy read
        the last one alone. On the Zen 4 host (the ResNet-50 trace's 80
        switches of 12-05 and 12-06) the 28 moves from B=32 (two 1-thread
        instances, 1.9 s a sub-batch) over-subscribed 0.2-6.6 s, a median
        of 2.6 s, and the 13 moves up from idle 0.1-0.3 s; a move down
        right after that move up was priced at a tenth of its length, and
        its payback (:meth:`payback_s`) at a hundredth of a second. Over the
        29 moves down that followed another switch, the last switch's
        seconds were a median 0.36x the move's own (median error a factor
        of 3.0), the larger of it and the drain 0.96x (a factor of 1.7).
        Where what B holds is unknown: the last switch's seconds.

        A switch that starts processes beyond the loaded spares lasts their
        load as well, before the drain (:attr:`cold_start_s`, from the start
        time the supervisors measure): the last switch, which rebound
        spares, says nothing of that. On 64 simulated cores (12-07) moves
        from B=32 down to 16 that found 0-4 spares loaded started 12-15
        processes and over-subscribed 6.5-6.9 s, priced at the last switch's
        0.2 s (a payback of 0.4-1.9 s); their backlog took B back to 32
        within 0.5 s. Known before any switch is measured: it is measured.
        """
        cold = self.cold_start_s(current, target) if self.cold_start_s is not None and target is not None else None
        if not self.switch_s and not cold:
            return 0.0
        drain = self.drain_s(current) if self.drain_s is not None else None
        return max(self.switch_s, (drain or 0.0) + (cold or 0.0))

    def spares_due(self, now: float, current: int, target: int,
                   capacity: Callable[[int], float | None] | None) -> bool:
        """Whether a move down from ``current`` to ``target`` waits for the spares being loaded.

        It would start processes where spares are still loading
        (:attr:`awaiting_spares`), and ``current`` carries the arrivals with
        the margin to spare: a move down is for latency, never urgent, and a
        process started loads its model beside the instances serving (3.7 s
        over-subscribed, against 0.1 s for spares rebound, on 64 simulated
        cores). Where ``current`` is short of capacity the move is not held
        back (staying builds a backlog too).
        """
        if self.awaiting_spares is None or not self.needs_switch(current, target):
            return False
        if self.short_of_capacity(now, current, capacity):
            return False
        return self.awaiting_spares(current, target, now)

    def needs_switch(self, current: int, target: int) -> bool:
        """Whether the plans say going from ``current`` to ``target`` takes new processes (False: unknown)."""
        return self.needs_processes is not None and self.needs_processes(current, target)

    def switch_wait(self, current: int, target: int, now: float | None = None,
                    capacity: Callable[[int], float | None] | None = None,
                    planned: Callable[[int], float | None] | None = None) -> float:
        """What a move down waits beyond its timeout for the switch it takes: ``switch_factor`` × the
        over-subscribed seconds expected of a switch away from ``current`` (:meth:`switch_cost_s`), when
        the plans say it needs new processes.

        A change of thread counts over-subscribes the cores while the new
        instances warm up and the old ones drain: 2.4 s for ResNet-50 on two
        cores (one 2-thread instance to two 1-thread ones), 0.1-0.3 s for the
        sleeping model at 16 simulated cores. A lower B pays for that only
        if the load stays low: at 40% of B=1's capacity the ResNet-50 trace
        went 4 -> 1 and, 2.5 s later, 1 -> 4 (two switches, 3.4 s
        over-subscribed, for the lone requests of 2.5 s). Waiting twice the
        switch's length keeps such a round trip to at most a third of the
        time; a reshare (same instances, other shares) costs nothing and
        waits nothing more. Moves up never wait for it: the load must be served.

        Under load, twice the switch is not enough: the switch's backlog
        drains at what the smaller B serves beyond the arrivals, and near its
        capacity that takes the rest of the phase. With ``now`` and
        ``capacity`` given (and ``switch_payback``), the wait is at least
        :meth:`payback_s`.
        """
        cost = self.switch_cost_s(current, target) if self.needs_switch(current, target) else 0.0
        if not cost:
            self._payback = None
            return 0.0
        wait = self.settings.switch_factor * cost
        if self.settings.switch_payback and now is not None and capacity is not None:
            payback = self.payback_s(now, current, target, capacity, planned)
            self._payback = payback if payback > wait else None
            wait = max(wait, payback)
        return wait

    def payback_s(self, now: float, current: int, target: int, capacity: Callable[[int], float | None],
                  planned: Callable[[int], float | None] | None = None) -> float:
        """How long a move from ``current`` to ``target`` that needs an active-passive switch must be asked
        for before the latency it saves has paid for the backlog its switch builds (seconds; 0: nothing
        known, or nothing to pay; ``math.inf``: it never pays).

        A rent-or-buy rule (the ski-rental problem): staying at ``current``
        costs, each second, ``rate`` × (its predicted latency − the
        target's) in request-seconds; switching costs once what its
        over-subscribed seconds add to the wait of the requests around it.
        Waiting until the first has added up to the second never pays more
        than twice what knowing the future would (the deterministic
        ski-rental bound), without guessing how long the load will stay.

        The switch's cost: for its over-subscribed seconds (:meth:`switch_cost_s`)
        only ``switch_keep`` of the current B's capacity serves, so a
        backlog of (rate − keep × capacity) × those seconds builds; the target
        then drains it at its capacity less the rate. Every request in it
        waits, on average, half of the switch plus half of the drain. Read at
        the arrivals' high bound (:meth:`rate_bound`), as every move down is.
        A current B that does not carry the arrivals: nothing to wait for
        (staying builds a backlog too) if the target serves ``switch_gain``
        more, else never. A target that does not carry them: never. Why: on the Zen 4 host (12-05 08:47) B=32 moved to B=4 at 23.3
        requests/s arriving, 97% of what B=4 was thought to serve; the switch
        over-subscribed the cores 2.6 s and its backlog lasted the rest of the
        phase (p50 1,271 ms against 370 for static B=32), after 2 x 1.2 s of
        the flat wait.
        """
        d = self.switch_cost_s(current, target)
        if self.latency is None or not d:
            return 0.0
        rate = self.rate_bound(now)
        cap, cap_new = capacity(current), capacity(target)
        if not rate or cap is None or cap_new is None:
            return 0.0
        if rate >= cap:
            # Staying builds a backlog too: the switch is worth it only for capacity (``switch_gain`` more, as in
            # :meth:`carrying`). The Zen 4 host (12-05 13:09): at 24.5/s arriving, B=32 (22.8/s) went to
            # B=4 (22.3/s) by the timeouts, whose rate window read less, and back 2 s later.
            return 0.0 if cap_new > (1 + self.settings.switch_gain) * cap else math.inf
        if rate >= cap_new:
            return math.inf
        backlog = max(0.0, rate - self.settings.switch_keep * cap) * d
        if backlog <= 0:
            return 0.0
        cost = backlog * (d + backlog / (cap_new - rate)) / 2.0  # request-seconds
        ms, target_ms = (self._predicted(b, rate, capacity, planned) for b in (current, target))
        if ms is None or target_ms is None:
            return 0.0
        saved = rate * (ms - target_ms) / 1000.0  # request-seconds a second
        return math.inf if saved <= 0 else cost / saved

    @staticmethod
    def _reason(estimated: int, worth: int, target: int,
                faster: tuple[int, float, int, float, float] | None = None) -> str:
        """Why ``target``: the estimate, lowered to the knee, raised to what carries the load, or lowered to
        the B predicted to answer sooner (``faster``, :meth:`quickest`)."""
        if faster is not None and faster[2] == target:
            was, was_ms, _, ms, rate = faster
            return (f"sooner (B̃={estimated}; B={target} predicted {ms:.0f} ms against B={was}'s {was_ms:.0f} ms "
                    f"at {rate:.1f}/s)")
        if target == estimated:
            return "estimate"
        if target == worth:
            return f"estimate (B̃={estimated} serves no more)"
        return f"estimate (B̃={estimated}; the arrivals need B={target})"

    def _triggered(self, now: float, current: int, b_tilde: int, q_tilde: float | None,
                   predicted_ms: float | None, carried: int | None = None) -> Decision | None:
        """The design's other triggers: they move to B̃ before the dwell is over, never elsewhere.

        Each needs the estimate on its side: batch-aggregation timeouts on most
        batches say B is too large only when B̃ < B too (a closed loop whose
        clients resend a little late cuts batches short at any B), and a large
        queueing delay says B is too small only when B̃ > B. ``carried``: where
        a queue that builds moves B when the prediction kept it (:meth:`quickest`).
        """
        s = self.settings
        if b_tilde == current and (carried is None or carried <= current):
            return None
        batches = list(self._batches)
        if b_tilde < current:
            # The target below B for a moment is no evidence: the guard's rate dips with the arrivals'
            # noise, and a trigger looked at 200 times a second would take the first dip (the 23:31
            # ResNet-50 run went 4 -> 2 at 90% load, and back 1.2 s later). It must hold for the up timeout.
            if self.disagree_since is None or now - self.disagree_since < s.up_timeout_s:
                return None
            if len(batches) < s.min_trigger_batches:
                return None
            timed_out = sum(b.timed_out for b in batches)
            if timed_out >= s.timeout_fraction * len(batches):
                return Decision(b_tilde, "timeouts", current, q_tilde)
        elif predicted_ms:
            # The period's batches, or when batches are slow the last few of the rate window: a queue
            # building behind 500 ms batches must not wait for five of them to fit in one second.
            if len(batches) < s.min_trigger_batches:
                horizon = self._last_batches[-1].at - s.rate_window_s if self._last_batches else 0.0
                batches = [b for b in self._last_batches if b.at >= horizon]
            if len(batches) < s.min_trigger_batches:
                return None
            delay = statistics.median(b.queue_ms for b in batches)
            if delay > s.queue_delay_factor * predicted_ms:
                return Decision(b_tilde if b_tilde > current else carried or b_tilde, "queue delay", current,
                                q_tilde)
        return None
