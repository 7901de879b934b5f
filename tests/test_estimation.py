"""The batch-size estimator and the reconfiguration policy, driven with a fake clock (no Redis)."""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import pytest

import fakeredis

from dispatcher.adaptive import SPARES_RISING_S, Adaptive, PlannedCapacity
from dispatcher.estimation import Decision, Estimator, EstimatorSettings, Policy, floor_pow2
from packrat_mq.settings import Settings


def test_floor_pow2() -> None:
    assert [floor_pow2(x) for x in (0, 0.5, 1, 1.9, 2, 3, 4, 7.99, 8, 31, 32, 33)] == [1, 1, 1, 1, 2, 2, 4, 4, 8, 16, 32, 32]


def test_ewma_and_mode_follow_the_original_defaults() -> None:
    est = Estimator()
    est.observe(10)
    assert est.q_tilde == 10.0  # the first sample starts the average
    est.observe(0)
    assert est.q_tilde == pytest.approx(9.0)  # 0.1 * 0 + 0.9 * 10
    for _ in range(200):
        est.observe(20)
    assert est.q_tilde == pytest.approx(20.0, rel=1e-6)
    assert est.b_tilde == 16


def test_b_tilde_is_the_mode_of_the_last_window_ties_to_the_newest() -> None:
    est = Estimator(EstimatorSettings(alpha=1.0, window=4))
    for q in (8, 8, 2, 2):
        est.observe(q)
    assert est.b_tilde == 2  # 8 and 2 tie: the most recent wins
    est.observe(8)  # window is now 8, 2, 2, 8
    assert est.b_tilde == 8
    est.observe(2)  # 2, 2, 8, 2
    assert est.b_tilde == 2


def test_clamped_to_min_and_max_batch() -> None:
    est = Estimator(EstimatorSettings(alpha=1.0, min_batch=2, max_batch=16))
    est.observe(0)
    assert est.b_tilde == 2
    for _ in range(20):
        est.observe(1000)
    assert est.b_tilde == 16


def test_hysteresis_below_the_current_batch() -> None:
    est = Estimator(EstimatorSettings(alpha=1.0, hysteresis=0.25))
    assert est.b_hat(7.0, current=8) == 8  # 7 >= 0.75 * 8: stays
    assert est.b_hat(6.0, current=8) == 8
    assert est.b_hat(5.9, current=8) == 4
    assert est.b_hat(7.0, current=None) == 4
    assert est.b_hat(7.6, current=None) == 8  # the nearest integer first
    assert est.b_hat(16.0, current=8) == 16  # going up needs no margin: 2B is the boundary itself


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def first_decision(policy: Policy, est: Estimator, clock: Clock, length: int, current: int,
                   capacity: dict[int, float], samples: int = 200) -> Decision | None:
    """Sample a constant stream length every 5 ms until the policy decides (None if it never does)."""
    for _ in range(samples):
        clock.t += 0.005
        est.observe(length, current)
        d = policy.decide(clock.t, current, est.b_tilde, est.q_tilde, capacity=capacity.get)
        if d is not None:
            return d
    return None


def sample_and_apply(policy: Policy, est: Estimator, clock: Clock, length: float, current: int,
                     capacity: dict[int, float] | None = None) -> tuple[int, Decision | None]:
    """One sample at ``clock.t``; its decision, if any, applied at once (a reconfiguration that takes no time)."""
    est.observe(length, current)
    d = policy.decide(clock.t, current, est.b_tilde, est.q_tilde,
                      capacity=capacity.get if capacity is not None else None)
    if d is not None:
        policy.changed(clock.t, current, d.batch)
        current = d.batch
    return current, d


def drive(policy: Policy, est: Estimator, clock: Clock, lengths: list[float], current: int,
          sample_s: float = 0.005) -> tuple[int, list[tuple[float, int, int, str]]]:
    """Feed samples; apply each decision at once (as a reconfiguration that takes no time)."""
    changes: list[tuple[float, int, int, str]] = []
    for q in lengths:
        clock.t += sample_s
        old = current
        current, d = sample_and_apply(policy, est, clock, q, current)
        if d is not None:
            changes.append((clock.t, old, d.batch, d.reason))
    return current, changes


def test_steady_load_never_reconfigures() -> None:
    rng = random.Random(7)
    clock, est, policy = Clock(), Estimator(), Policy()
    # 60 s of a closed loop of 8 clients: the stream holds 6-8 requests (some answered, resent).
    lengths = [rng.choice((6, 7, 8, 8, 8)) for _ in range(12_000)]
    current, changes = drive(policy, est, clock, lengths, current=8)
    assert changes == []
    assert current == 8


def test_a_step_up_is_followed_once_after_the_timeout() -> None:
    clock, est, policy = Clock(), Estimator(), Policy()
    current, changes = drive(policy, est, clock, [1.0] * 400 + [16.0] * 1000, current=1)
    assert [(old, new) for _, old, new, _ in changes] == [(1, 16)]
    t_step = 1000.0 + 400 * 0.005
    # Q̃ crosses 16 within a few samples; the change comes one up-timeout (0.25 s) later, not sooner.
    assert 0.25 <= changes[0][0] - t_step <= 0.5
    assert changes[0][3] == "estimate"


def test_idle_goes_down_to_one() -> None:
    clock, est, policy = Clock(), Estimator(), Policy()
    current, changes = drive(policy, est, clock, [0.0] * 1000, current=32)
    assert current == 1
    assert len(changes) == 1


def test_a_load_oscillating_around_a_boundary_causes_no_storm() -> None:
    """Q wanders across the 8 boundary (5..11) with a 2 s period for 120 s: at most a few changes."""
    clock, est, policy = Clock(), Estimator(), Policy()
    lengths = [8 + 3 * math.sin(2 * math.pi * k * 0.005 / 2.0) for k in range(24_000)]
    _, changes = drive(policy, est, clock, lengths, current=8)
    assert len(changes) <= 2, changes


def test_flapping_between_two_sizes_is_damped() -> None:
    """Phases of 3 s alternating between 4 and 16 requests for 10 minutes: the timeout doubles after
    each reversal, so far fewer changes than phases (200), and never two within a second."""
    clock, est, policy = Clock(), Estimator(), Policy()
    lengths: list[float] = []
    for phase in range(200):
        lengths += [4.0 if phase % 2 else 16.0] * 600
    _, changes = drive(policy, est, clock, lengths, current=16)
    assert len(changes) <= 20, len(changes)
    times = [t for t, *_ in changes]
    assert all(b - a >= 1.0 for a, b in zip(times, times[1:]))
    assert policy.timeout_s > policy.settings.reconfigure_timeout_s


def test_damping_is_forgotten_after_a_steady_period() -> None:
    s = EstimatorSettings(max_timeout_s=8.0, flap_window_s=30.0)
    policy = Policy(s)
    policy.changed(0.0, 8, 4)
    policy.changed(2.0, 4, 8)  # undoes the previous change
    assert policy.timeout_s == 2.0
    policy.decide(3.0, 8, 8)  # the estimate agrees from here on
    policy.decide(3.0 + 7.5, 8, 8)
    assert policy.timeout_s == 2.0  # not yet max_timeout_s of agreement
    policy.decide(3.0 + 8.5, 8, 8)
    assert policy.timeout_s == 1.0


def test_timeouts_move_to_a_smaller_estimate_before_the_dwell_is_over() -> None:
    policy = Policy()
    policy.changed(0.0, 4, 32)
    t = 5.0
    for k in range(20):  # batches of 3-5 cut by the timeout, 20 in the last second
        t += 0.05
        policy.record_batch(t, 3 + k % 3, True, 5.0)
    assert policy.decide(t, 32, 32) is None  # the estimate still says 32: no reason to go
    assert policy.decide(t + 0.01, 32, 4) is None  # B̃ just fell to 4: held for the up timeout, not the 1 s dwell
    d = policy.decide(t + 0.3, 32, 4)
    assert d is not None and d.reason == "timeouts" and d.batch == 4


def test_batches_cut_short_without_a_smaller_estimate_do_not_trigger() -> None:
    """A closed loop of 8 at B=8: clients resend a little late, so batches are cut by the timeout."""
    policy = Policy()
    policy.changed(0.0, 1, 8)
    t = 5.0
    for k in range(20):
        t += 0.05
        policy.record_batch(t, 3 + k % 4, True, 5.0)
    assert policy.decide(t, 8, 8) is None


def test_queue_delay_moves_to_a_larger_estimate_early() -> None:
    policy = Policy()
    policy.changed(0.0, 4, 2)
    t = 5.0
    for _ in range(10):
        t += 0.05
        policy.record_batch(t, 2, False, 400.0)
    assert policy.decide(t, 2, 8, predicted_ms=None) is None  # no prediction: no yardstick
    d = policy.decide(t + 0.01, 2, 8, predicted_ms=100.0)
    assert d is not None and d.reason == "queue delay" and d.batch == 8


def test_nothing_within_a_timeout_of_the_last_change() -> None:
    policy = Policy()
    policy.changed(10.0, 1, 8)
    assert policy.decide(10.5, 8, 1) is None
    assert policy.decide(10.9, 8, 1) is None
    d = policy.decide(11.6, 8, 1)
    assert d is not None and d.batch == 1


# --- the capacity guard ----------------------------------------------------------
CAPACITY = {1: 50.0, 2: 80.0, 4: 114.0, 8: 145.0, 16: 168.0, 32: 184.0}  # the 16-core model's, req/s


def dispatch_at(policy: Policy, t0: float, seconds: float, rate: float, size: int, timed_out: bool) -> float:
    """Batches of ``size`` at ``rate`` requests/s for ``seconds``; returns the time at the end."""
    t, every = t0, size / rate
    while t < t0 + seconds:
        t += every
        policy.record_batch(t, size, timed_out, 5.0)
    return t


def test_a_smaller_batch_that_cannot_carry_the_load_is_refused() -> None:
    """At 165 req/s B=32's partial batches are cut by the timeout and B̃ says 16, but B=16 serves 168/s."""
    policy = Policy()
    policy.changed(0.0, 16, 32)
    t = dispatch_at(policy, 5.0, 2.0, 165.0, 8, True)
    assert policy.rate(t) == pytest.approx(165.0, rel=0.05)
    assert policy.decide(t, 32, 16, capacity=CAPACITY.get) is None  # neither the trigger nor, later, the dwell
    t = dispatch_at(policy, t, 1.5, 165.0, 8, True)
    assert policy.decide(t, 32, 16, capacity=CAPACITY.get) is None
    # When the load falls, B goes down (once the 5 s rate has).
    t = dispatch_at(policy, t, 6.0, 60.0, 4, True)
    policy.decide(t, 32, 16, capacity=CAPACITY.get)
    d = policy.decide(t + 0.3, 32, 16, capacity=CAPACITY.get)
    assert d is not None and d.batch == 16
    # Without the capacity known the timeouts trigger moves within the up timeout.
    d = Policy(); d.changed(0.0, 16, 32)
    t2 = dispatch_at(d, 5.0, 2.0, 165.0, 8, True)
    d.decide(t2, 32, 16)
    assert d.decide(t2 + 0.3, 32, 16).reason == "timeouts"  # type: ignore[union-attr]


def test_a_smaller_batch_with_room_to_spare_is_taken() -> None:
    policy = Policy()
    policy.changed(0.0, 16, 32)
    # B=16 serves 168/s: 110 leaves 35% spare, and its high bound (2 s counted: 121/s) 28% (> 20%).
    t = dispatch_at(policy, 5.0, 2.0, 110.0, 8, True)
    policy.decide(t, 32, 16, capacity=CAPACITY.get)
    d = policy.decide(t + 0.3, 32, 16, capacity=CAPACITY.get)
    assert d is not None and d.batch == 16
    # An unknown capacity refuses nothing.
    p2 = Policy(); p2.changed(0.0, 16, 32)
    t2 = dispatch_at(p2, 5.0, 2.0, 165.0, 8, True)
    p2.decide(t2, 32, 16, capacity=lambda b: None)
    assert p2.decide(t2 + 0.3, 32, 16, capacity=lambda b: None) is not None


def test_the_guard_keeps_a_steady_near_saturation_load_on_one_batch() -> None:
    """Q̃ wandering between 12 and 40 at a steady 160 req/s (what B=32's partial batches look like)."""
    rng = random.Random(3)
    clock, est, policy = Clock(), Estimator(), Policy()
    current, changes, waiting = 32, [], 0
    for k in range(12_000):  # 60 s of Poisson arrivals, a partial batch cut every 50 ms
        clock.t += 0.005
        waiting += sum(rng.random() < 0.16 for _ in range(5))  # 0.8 per 5 ms: 160/s
        if k % 10 == 9 and waiting:
            policy.record_batch(clock.t, waiting, True, 5.0)
            waiting = 0
        current, d = sample_and_apply(policy, est, clock, rng.uniform(12, 40), current, CAPACITY)
        if d is not None:
            changes.append(d)
    assert changes == [] and current == 32


def test_an_idle_deployment_started_large_still_comes_down() -> None:
    """No batch at all: the rate is 0 once a period has been watched, so B=32 goes down to 1."""
    clock, est, policy = Clock(), Estimator(), Policy()
    current = 32
    for _ in range(1000):
        clock.t += 0.005
        current, _ = sample_and_apply(policy, est, clock, 0, current, CAPACITY)
    assert current == 1


def test_planned_capacity_follows_the_optimizers_plan_per_node(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dispatcher.adaptive import PlannedCapacity
    from optimizer.planning.profile import Profile, ProfileEntry

    points = {(1, 1): 10.0, (1, 2): 18.0, (1, 4): 34.0, (1, 8): 66.0,
              (8, 1): 5.0, (8, 2): 6.0, (8, 4): 8.0, (8, 8): 14.0}
    path = Profile(model="tiny", entries=tuple(ProfileEntry(threads=t, batch=b, mean_ms=ms)
                                               for (t, b), ms in points.items())).save(tmp_path / "p.json")
    cap = PlannedCapacity("tiny", str(path))
    assert cap(8) is None  # no deployment seen yet: no budgets, nothing known
    cap.budgets = {"n1": 16}
    assert cap(8) == pytest.approx(8 / 0.008)  # two instances of 8 threads taking 4 each in 8 ms
    cap.budgets = {"n1": 8, "n2": 8}  # two nodes of 8 threads: 4 each, one 8-thread instance each
    assert cap(8) == pytest.approx(2 * 4 / 0.008)
    assert PlannedCapacity("tiny", None)(8) is None


def test_up_is_quick_and_down_is_slow() -> None:
    """A backlog growing by 115 requests/s from idle: B climbs within a second; a reversal waits a timeout."""
    clock, est, policy = Clock(), Estimator(), Policy()
    lengths = [0.0] * 400 + [min(200.0, 0.575 * k) for k in range(400)]  # 2 s of a growing backlog
    current, changes = drive(policy, est, clock, lengths, current=1)
    t_step = 1000.0 + 400 * 0.005
    assert current == 32 and changes[0][0] - t_step <= 0.5
    assert changes[-1][0] - t_step <= 1.5  # every step up was quick
    # The load vanishes: down only after the whole (1 s) timeout.
    _, down = drive(policy, est, clock, [0.0] * 600, current=current)
    assert down and down[0][0] - (t_step + 2.0) >= 1.0


def test_the_guard_sees_a_step_in_the_last_second() -> None:
    """4 s at 50/s then 1 s draining at 184/s: the 5 s mean (77/s) would let B=16 through; the last second does not."""
    policy = Policy()
    policy.decide(0.0, 1, 1)
    t = dispatch_at(policy, 0.0, 4.0, 50.0, 1, False)
    t = dispatch_at(policy, t, 1.0, 184.0, 8, True)
    assert policy.rate(t) == pytest.approx(184.0, rel=0.1)
    assert policy.short_of_capacity(t, 16, CAPACITY.get)


# --- the up guard -------------------------------------------------------------------
def test_a_burst_at_low_load_does_not_move_b_up() -> None:
    """12 req/s against B=1's 50/s (24%): a stream length of 3 for a moment does not move B; saturation does."""
    clock, est, policy = Clock(), Estimator(), Policy()
    policy.decide(clock.t, 1, 1)
    t = dispatch_at(policy, clock.t, 3.0, 12.0, 1, False)
    clock.t = t
    for _ in range(200):  # 1 s of a backlog of 3 (what a Poisson burst looks like to Q̃)
        clock.t += 0.005
        est.observe(3, 1)
        assert policy.decide(clock.t, 1, est.b_tilde, est.q_tilde, capacity=CAPACITY.get) is None
    assert est.b_tilde == 2
    # The same estimate at 45 req/s (90% of B=1's capacity): up, once the 5 s window is 60% busy.
    t = dispatch_at(policy, clock.t, 1.0, 45.0, 1, False)
    clock.t = t
    est.observe(3, 1)
    assert policy.decide(clock.t, 1, est.b_tilde, est.q_tilde, capacity=CAPACITY.get) is None  # 32% of 5 s
    clock.t = dispatch_at(policy, clock.t, 2.5, 45.0, 1, False)
    est.observe(3, 1)
    d = policy.decide(clock.t, 1, est.b_tilde, est.q_tilde, capacity=CAPACITY.get)
    assert d is not None and d.batch == 2 and d.reason == "estimate"
    # Without the capacity known, the estimate alone decides (as before).
    p2, e2, c2 = Policy(), Estimator(), Clock()
    p2.decide(c2.t, 1, 1)
    c2.t = dispatch_at(p2, c2.t, 3.0, 12.0, 1, False)
    e2.observe(3, 1)
    assert p2.decide(c2.t, 1, e2.b_tilde, e2.q_tilde) is None  # the dwell starts
    c2.t += 0.3
    assert p2.decide(c2.t, 1, e2.b_tilde, e2.q_tilde) is not None


def test_a_queue_that_builds_moves_b_up_however_low_the_planned_utilisation() -> None:
    """A machine slower than its profile: the rate B=1 manages is 20/s (40% of planned), the queue grows."""
    policy = Policy()
    policy.decide(0.0, 1, 1)
    t = 0.0
    for k in range(40):  # 2 s of single batches whose oldest request waited longer and longer
        t += 0.05
        policy.record_batch(t, 1, False, 50.0 + 20.0 * k)
    d = policy.decide(t, 1, 8, 9.0, predicted_ms=20.0, capacity=CAPACITY.get)
    assert d is not None and d.batch == 8 and d.reason == "queue delay"


def test_the_queue_delay_trigger_sees_slow_batches_too() -> None:
    """Two 500 ms batches a second, each request waiting longer: five of them within the rate window suffice."""
    policy = Policy()
    policy.decide(0.0, 1, 1)
    t = 0.0
    decided = None
    for k in range(10):
        t += 0.5
        policy.record_batch(t, 1, False, 300.0 + 400.0 * k)
        decided = policy.decide(t, 1, 2, 2.5, predicted_ms=90.0, capacity=CAPACITY.get)  # B̃=2: only the trigger
        if decided is not None:
            break
    assert decided is not None and decided.reason == "queue delay"
    assert t <= 3.0  # the fifth batch, not never


def test_planned_capacity_follows_what_serving_measures(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dispatcher.adaptive import PlannedCapacity
    from optimizer.planning.profile import Profile, ProfileEntry

    path = Profile(model="tiny", entries=(ProfileEntry(threads=8, batch=8, mean_ms=8.0),)).save(tmp_path / "p.json")
    cap = PlannedCapacity("tiny", str(path))
    cap.budgets = {"n1": 8, "n2": 8}
    planned = cap(16)
    assert planned == pytest.approx(16 / 0.008)
    cap.ratios = {"n1": 2.0}  # n1 serves twice as slow as profiled, n2 not measured (1)
    assert cap(16) == pytest.approx(planned / 2 / 2 + planned / 2)  # each node plans half of B


def test_each_thread_count_is_planned_by_its_own_served_ratio(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The Zen 4 host (12-05): one 2-thread instance served 0.86x the profile's time, two 1-thread ones 0.72x.

    Read off the 1-thread instances alone, B=4 (one 2-thread instance) was planned at 23.9 requests/s
    against the 19.9 it served, and B=32 moved to it at 23.3/s arriving.
    """
    from dispatcher.adaptive import PlannedCapacity
    from optimizer.planning.profile import Profile, ProfileEntry

    entries = (ProfileEntry(threads=2, batch=4, mean_ms=100.0), ProfileEntry(threads=1, batch=4, mean_ms=400.0),
               ProfileEntry(threads=1, batch=16, mean_ms=1000.0), ProfileEntry(threads=2, batch=32, mean_ms=2000.0),
               ProfileEntry(threads=1, batch=2, mean_ms=200.0), ProfileEntry(threads=2, batch=2, mean_ms=60.0),
               ProfileEntry(threads=1, batch=8, mean_ms=800.0), ProfileEntry(threads=2, batch=8, mean_ms=200.0),
               ProfileEntry(threads=1, batch=1, mean_ms=100.0), ProfileEntry(threads=2, batch=1, mean_ms=30.0),
               ProfileEntry(threads=2, batch=16, mean_ms=1000.0))
    path = Profile(model="tiny", entries=entries).save(tmp_path / "p.json")
    cap = PlannedCapacity("tiny", str(path))
    cap.budgets = {"n": 2}
    assert cap.layout(4) == {"n": frozenset({2})} and cap.layout(32) == {"n": frozenset({1})}
    four, thirty_two = cap(4), cap(32)
    cap.ratios = {"n": 0.72}  # the node's ratio, measured on 1-thread instances: every plan divided by it
    assert cap(4) == pytest.approx(four / 0.72) and cap(32) == pytest.approx(thirty_two / 0.72)
    cap.thread_ratios = {"n": {1: 0.72, 2: 0.86}}
    assert cap(4) == pytest.approx(four / 0.86) and cap(32) == pytest.approx(thirty_two / 0.72)
    assert cap.ratio("n", 2) == 0.86 and cap.ratio("n", 4) == 0.72 and cap.ratio("m", 1) == 1.0
    slow = cap.servers(4)
    assert slow is not None and slow[0].latency_ms(4) == pytest.approx(100.0 * 0.86)


def test_an_estimate_four_times_b_moves_it_up_however_idle_the_rate_looks() -> None:
    """A host slower than its profile: B=1 serves 3/s against a planned 50/s, and the stream holds 5."""
    clock, est, policy = Clock(), Estimator(), Policy()
    policy.decide(clock.t, 1, 1)
    clock.t = dispatch_at(policy, clock.t, 3.0, 3.0, 1, False)
    decided = first_decision(policy, est, clock, 5, 1, CAPACITY)
    assert decided is not None and decided.batch == 4 and decided.reason == "estimate"


def test_the_rate_counts_what_the_stream_grew_by() -> None:
    """Dispatching 100/s while the stream grows by 60/s: 160 arrive, and B=16 (168/s) has no 20% to spare."""
    policy = Policy()
    policy.changed(0.0, 16, 32)
    t, length = 5.0, 0
    policy.record_length(t, length)
    end = t + 3.0
    while t < end:
        t += 0.08
        policy.record_batch(t, 8, True, 5.0)  # 100/s dispatched
        length += 5  # 62.5/s left in the stream
        policy.record_length(t, length)
    assert policy.rate(t) == pytest.approx(162.5, rel=0.05)
    assert policy.short_of_capacity(t, 16, CAPACITY.get)


def test_a_second_at_full_capacity_moves_b_up_at_once() -> None:
    """After 4 s at 12 req/s, one second of 55/s (over B=1's 50/s) is a step, not a burst: up."""
    clock, est, policy = Clock(), Estimator(), Policy()
    policy.decide(clock.t, 1, 1)
    clock.t = dispatch_at(policy, clock.t, 4.0, 12.0, 1, False)
    clock.t = dispatch_at(policy, clock.t, 1.0, 55.0, 1, False)
    assert policy.busy(clock.t, 1, CAPACITY.get)
    for k in range(60):  # the load goes on (60/s) while the estimate dwells
        clock.t += 0.005
        if k % 3 == 0:
            policy.record_batch(clock.t, 1, False, 5.0)
        est.observe(3, 1)
        d = policy.decide(clock.t, 1, est.b_tilde, est.q_tilde, capacity=CAPACITY.get)
        if d is not None:
            break
    assert d is not None and d.batch == 2


def test_a_backlog_drained_after_a_stall_is_not_read_as_load() -> None:
    """12 req/s, a 2 s stall (a reconfiguration) and the 24 requests it held drained in 0.2 s: still 12/s."""
    policy = Policy()
    policy.decide(0.0, 1, 1)
    t, length = 0.0, 0
    while t < 3.0:  # 12/s, each answered before the next arrives
        t += 1 / 12
        policy.record_batch(t, 1, False, 5.0)
        policy.record_length(t, 1)
    while t < 5.0:  # the stall: nothing dispatched, the stream grows
        t += 1 / 12
        length += 1
        policy.record_length(t, length)
    for _ in range(length):  # the drain: 24 dispatched in 0.2 s as the stream empties
        t += 0.2 / 24
        length -= 1
        policy.record_batch(t, 1, False, 2000.0)
        policy.record_length(t, length)
    assert policy.arrivals(t, 1.0) == pytest.approx(12.0, abs=3.0)
    assert not policy.busy(t, 1, CAPACITY.get)  # 12/s against B=1's 50/s
    assert policy.rate(t) > 20.0  # the down guard's rate stays cautious: a drain is load for a smaller B


def test_only_the_exact_undo_is_damped() -> None:
    """1 -> 2 -> 4 -> 1 -> 2: no change undoes its predecessor, so none doubles the timeout (a ramp down and a
    step back up must not wait a damped timeout); 2 -> 1 right after 1 -> 2 does."""
    policy = Policy()
    for at, (old, new) in enumerate([(1, 2), (2, 4), (4, 1), (1, 2)]):
        policy.changed(float(at), old, new)
    assert policy.timeout_s == 1.0
    policy.changed(5.0, 2, 1)
    assert policy.timeout_s == 2.0


# --- the knee: a larger B that serves no more ---------------------------------------
#: A traced ResNet-50 on two cores, as planned from its profile (req/s): batching past B=4 buys nothing.
FLAT = {1: 11.1, 2: 13.9, 4: 17.9, 8: 16.6, 16: 13.7, 32: 14.6}


def test_worth_keeps_every_b_that_serves_more() -> None:
    policy = Policy()
    assert [policy.worth(b, CAPACITY.get) for b in (1, 2, 4, 8, 16, 32)] == [1, 2, 4, 8, 16, 32]
    assert policy.worth(32, None) == 32
    assert policy.worth(32, {1: 11.1, 2: None, 4: 17.9}.get) == 32  # any unknown: the estimate decides


def test_worth_lowers_b_to_the_knee_of_a_flat_profile() -> None:
    policy = Policy()
    assert [policy.worth(b, FLAT.get) for b in (1, 2, 4, 8, 16, 32)] == [1, 2, 4, 4, 4, 4]
    # Within the knee (5%) of the best, the smaller B: 25.3 is 99% of 25.6.
    assert policy.worth(16, {1: 19.2, 2: 21.1, 4: 23.0, 8: 25.6, 16: 25.3}.get) == 8
    assert Policy(EstimatorSettings(knee=0.0)).worth(16, {1: 19.2, 2: 21.1, 4: 23.0, 8: 25.3, 16: 25.6}.get) == 16
    # min_batch and a max_batch that is no power of two are candidates too.
    odd = Policy(EstimatorSettings(min_batch=3, max_batch=24))
    assert odd.worth(24, {3: 10.0, 4: 12.0, 8: 20.0, 16: 15.0, 24: 21.0}.get) == 8


def test_a_backlog_on_a_flat_profile_climbs_to_the_knee_only() -> None:
    """A step on two cores: Q̃ reads 35 at B=1; the climb stops at B=4, whatever Q̃ says after."""
    clock, est, policy = Clock(), Estimator(), Policy()
    policy.decide(clock.t, 1, 1)
    clock.t = dispatch_at(policy, clock.t, 2.0, 12.0, 1, False)  # 12/s against B=1's 11.1: busy
    d = first_decision(policy, est, clock, 35, 1, FLAT)
    assert d is not None and d.batch == 4 and "B̃=32" in d.reason
    policy.changed(clock.t, 1, 4)
    for _ in range(400):  # the estimate stays at 32: nothing more to ask for
        clock.t += 0.005
        policy.record_batch(clock.t, 4, False, 5.0)
        est.observe(35, 4)
        assert policy.decide(clock.t, 4, est.b_tilde, est.q_tilde, capacity=FLAT.get) is None


def test_past_the_knee_a_smaller_b_is_taken_under_a_load_it_serves_better() -> None:
    """At B=32 (14.6/s) with 14/s arriving, B=4 (17.9/s) is not 20% above the load, but above B=32: down."""
    policy = Policy()
    policy.decide(0.0, 32, 32)
    t = dispatch_at(policy, 0.0, 6.0, 14.0, 4, False)
    assert policy.short_of_capacity(t, 4, FLAT.get)  # against the load alone it would be refused
    assert not policy.short_of_capacity(t, 4, FLAT.get, current=32)
    d = None
    while d is None and t < 10.0:
        t += 0.005
        d = policy.decide(t, 32, 32, 35.0, capacity=FLAT.get)
    assert d is not None and d.batch == 4



# --- how often the sampler looks ----------------------------------------------------
def _adaptive_on(length: int, batch: int) -> tuple[Adaptive, Clock, fakeredis.FakeRedis]:
    fake = fakeredis.FakeRedis()
    clock = Clock()
    a = Adaptive(fake, Settings(), "m", clock=lambda: clock.t)
    a.serving(batch, 1, True, 20.0)
    for i in range(length):
        fake.xadd(a.stream, {"i": str(i)})
    return a, clock, fake


def test_the_sampler_slows_once_the_estimate_has_agreed_for_a_timeout() -> None:
    a, clock, fake = _adaptive_on(5, 4)  # Q̃ -> 5 at B=4: B̂ = 4
    for _ in range(100):  # 0.5 s
        clock.t += 0.005
        a.sample()
    assert not a.steady() and not a.quiet()
    for _ in range(200):  # past the 1 s timeout
        clock.t += 0.005
        a.sample()
    assert a.steady()
    for i in range(30):  # a step: the first B̂ that asks for more ends the slow sampling
        fake.xadd(a.stream, {"more": str(i)})
    a.sample()
    assert a.estimator.last == 8 and not a.steady()


def test_a_steady_sampler_is_woken_by_a_batch_that_waited_long_behind_the_instances() -> None:
    """Sampled every 40 ms while steady, a step would be seen late: a batch whose oldest request waited over
    twice B's predicted latency (20 ms here) wakes it; one that waited less, or any batch while not steady,
    does not (a sampler at full pace needs no nudge)."""
    a, clock, fake = _adaptive_on(5, 4)
    a.record_batch(4, False, 500.0)
    assert not a._wake.is_set()  # not steady yet
    a._steady = True
    a.record_batch(4, False, 39.0)
    assert not a._wake.is_set()
    a.record_batch(4, False, 41.0)
    assert a._wake.is_set()
    a._wake.clear()
    a.serving(4, 1, True, None)  # no prediction: no threshold to wake by
    a.record_batch(4, False, 500.0)
    assert not a._wake.is_set()


def test_the_sampler_reads_the_length_and_the_answered_count_together() -> None:
    a, clock, fake = _adaptive_on(5, 4)
    assert a._read_counts() == (5, 0)  # nothing answered yet: no counter
    fake.hincrby(a.keys.stats("m"), "replies", 7)
    assert a._read_counts() == (5, 7)
    clock.t += 0.005
    a.sample()
    assert a.policy._totals[-1][1] == 12  # every request that ever arrived


def test_the_sampler_is_quiet_at_the_smallest_b_with_nothing_waiting() -> None:
    a, clock, fake = _adaptive_on(1, 1)  # one request in service at B=1
    for _ in range(50):
        clock.t += 0.005
        a.sample()
    assert a.quiet()
    fake.xadd(a.stream, {"second": "1"})  # one waits behind it
    a.sample()
    assert not a.quiet()


# --- the target: the smallest B that carries the arrivals ----------------------------
def test_a_step_goes_at_once_to_the_b_that_carries_it() -> None:
    """12/s arrive at B=1 (11.1/s): Q̃ reads 2 first, but B=2 (13.9/s) has no 20% to spare: straight to 4."""
    def step(rate: float, capacity: dict[int, float]) -> Decision | None:
        clock, est, policy = Clock(), Estimator(), Policy()
        policy.decide(clock.t, 1, 1)
        clock.t = dispatch_at(policy, clock.t, 2.0, rate, 1, False)
        for _ in range(200):  # the load goes on while the estimate dwells
            clock.t = dispatch_at(policy, clock.t, 0.005, rate, 1, False)
            est.observe(2, 1)
            d = policy.decide(clock.t, 1, est.b_tilde, est.q_tilde, capacity=capacity.get)
            if d is not None:
                return d
        return None

    d = step(12.0, FLAT)
    assert d is not None and d.batch == 4
    assert d.reason == "estimate (B̃=2; the arrivals need B=4)"
    # On the 16-core model the same rule picks the B whose capacity has the margin: 100/s needs 125.
    d2 = step(100.0, CAPACITY)
    assert d2 is not None and d2.batch == 8  # 145/s; B=4's 114 is short of the margin


def test_a_decision_carries_the_rate_and_capacities_it_read_into_the_history() -> None:
    """Why B moved is read afterwards (status, the benchmarks' reconfigurations): the rate and what both
    Bs serve go with the reason."""
    clock, est, policy = Clock(), Estimator(), Policy()
    policy.decide(clock.t, 1, 1)
    clock.t = dispatch_at(policy, clock.t, 2.0, 12.0, 1, False)
    d = None
    for _ in range(200):
        clock.t = dispatch_at(policy, clock.t, 0.005, 12.0, 1, False)
        est.observe(2, 1)
        d = policy.decide(clock.t, 1, est.b_tilde, est.q_tilde, capacity=FLAT.get)
        if d is not None:
            break
    assert d is not None and d.batch == 4
    assert d.rate is not None and 11.0 <= d.rate <= 13.0
    assert d.serves == (FLAT[1], FLAT[4])
    fake = fakeredis.FakeRedis()
    a = Adaptive(fake, Settings(), "m", clock=lambda: clock.t)
    a._ask(d)
    [(_, [(_, fields)])] = fake.xread({a.keys.control(): "0-0"})
    text = fields[b"reason"].decode()
    assert f"{d.rate:.1f}/s arriving (B=1 serves {FLAT[1]:.1f}/s, B=4 {FLAT[4]:.1f}/s), B 1 -> 4" in text, text


def _step_under_lumpy_dispatch(with_counts: bool) -> list[tuple[float, float]]:
    """3.1 requests/s, then 16.1 from 5 s in; B=1 (12.8/s) falls behind for 2 s, then B=16 takes the
    backlog in sub-batches of up to 8 as one of its two 1-thread instances frees up (about 0.45 s
    apart). The sampler reads the stream's length, and with ``with_counts`` the answered count.
    Returns (seconds since the step, rate read) every half second."""
    policy = Policy()
    t, dt = 100.0, 0.005
    arrived, dispatched, answered = 0.0, 0, 0
    in_service: list[tuple[float, int]] = []
    current, next_free, step_at = 1, t, t + 5.0
    policy.decide(t, 1, 1)
    rates = []
    for k in range(int(11.0 / dt)):
        t = 100.0 + (k + 1) * dt
        arrived += (3.1 if t < step_at else 16.1) * dt
        for item in [x for x in in_service if x[0] <= t]:
            answered += item[1]
            in_service.remove(item)
        if current == 1 and t >= step_at + 2.0:
            policy.changed(t, 1, 16)
            current = 16
        unread = int(arrived) - dispatched
        if t >= next_free and unread > 0:
            n = 1 if current == 1 else min(8, unread)
            took = 1 / 12.8 if current == 1 else 0.9 * (n / 8) ** 0.7
            dispatched += n
            policy.record_batch(t, n, False, 50.0)
            in_service.append((t + took, n))
            next_free = t + (took if current == 1 else took / 2)
        policy.record_length(t, int(arrived) - answered, answered if with_counts else None)
        if (k + 1) % 100 == 0 and t >= step_at + 1.0:
            rates.append((t - step_at, policy.rate(t) or 0.0))
    return rates


def test_the_rate_reads_the_arrivals_exactly_from_the_answered_count() -> None:
    """Dispatched batches plus the stream's growth wander with each sub-batch and answer (14.8 to 30
    here, and 12.0-14.6 read at 16.1/s on the Zen 3 host let B=16 down to B=2, undone within
    0.3-10 s); the answered count with the length gives every request that arrived."""
    exact = _step_under_lumpy_dispatch(with_counts=True)
    assert all(16.1 * 0.97 <= rate <= 16.1 * 1.1 for _, rate in exact), exact
    rough = _step_under_lumpy_dispatch(with_counts=False)
    assert any(abs(rate - 16.1) > 0.1 * 16.1 for _, rate in rough), rough


def test_a_smaller_batch_must_carry_the_rates_high_bound_counted_since_the_last_move_up() -> None:
    """The Zen 3 ResNet-50's flat profile: 3.1/s, a step to 16.1/s, B 1 -> 16 2 s into it; 1.3 s later the
    estimate says 2. The 5 s window is half quiet and a second's count is 16 ± 4: B=2 (16.3/s) must
    carry the count since the move up, plus 1.5 standard deviations, with the margin. It does not."""
    zen3 = {1: 12.8, 2: 16.3, 4: 16.7, 8: 17.5, 16: 17.7, 32: 16.4}
    policy = Policy()
    t, total = 100.0, 0.0
    policy.decide(t, 1, 1)
    for k in range(int(8.3 / 0.005)):
        t = 100.0 + (k + 1) * 0.005
        total += (3.1 if t < 105.0 else 16.1) * 0.005
        policy.record_length(t, 3, int(total) - 3)
        if abs(t - 107.0) < 1e-9:
            policy.changed(t, 1, 16)
    assert policy.rate(t) == pytest.approx(16.1, rel=0.1)
    bound = policy.rate_bound(t)
    assert bound is not None and bound == pytest.approx(16.1 * (1 + 1.5 / math.sqrt(16.1 * 1.3)), rel=0.1)
    assert policy.carrying(t, 2, 16, zen3.get, estimated=2) == 16
    # A quiet load goes down as before: 3/s for a whole window is far below B=1's 12.8.
    quiet = Policy()
    quiet.decide(100.0, 16, 16)
    quiet.changed(99.0, 1, 16)
    for k in range(int(7.0 / 0.005)):
        quiet.record_length(100.0 + (k + 1) * 0.005, 1, int(3.0 * (k + 1) * 0.005))
    assert quiet.carrying(107.0, 1, 16, zen3.get, estimated=1) == 1


def test_the_answered_count_going_back_starts_the_count_again() -> None:
    policy = Policy()
    for k in range(300):  # 10/s for 1.5 s
        policy.record_length(100.0 + k * 0.005, 2, k // 20)
    assert policy.arrived(100.5) == pytest.approx(10.0, rel=0.1)
    policy.record_length(101.5, 2, 0)  # a Redis that restarted empty
    assert policy.arrived(100.5) is None
    policy.record_length(101.6, 3, None)  # no count at all: the dispatched batches and the length
    assert policy.arrived(100.5) is None


def test_a_lull_at_90_percent_load_does_not_take_b_below_what_carries_it() -> None:
    """B=4 on two cores at 90% of its capacity, batches cut by the timeout, the estimate saying 2 or 1
    between bursts: B=2 (13.9/s) never carries 16/s with the margin, so 60 s bring no change."""
    rng = random.Random(11)
    clock, est, policy = Clock(), Estimator(), Policy()
    policy.changed(clock.t, 2, 4)
    current, changes = 4, []
    end = clock.t + 60.0
    next_arrival = clock.t
    while clock.t < end:
        clock.t += 0.005
        while next_arrival <= clock.t:
            policy.record_batch(next_arrival, 1, True, 5.0)
            next_arrival += rng.expovariate(16.0)
        current, d = sample_and_apply(policy, est, clock, rng.choice((0, 1, 1, 2, 3)), current, FLAT)
        if d is not None:
            changes.append(d)
    assert changes == [] and current == 4


def test_a_move_down_the_load_outgrows_is_undone_within_the_up_timeout_however_damped() -> None:
    policy = Policy()
    policy.timeout_s = 16.0  # damped by earlier undos
    policy.decide(0.0, 4, 4)
    t = dispatch_at(policy, 0.0, 6.0, 12.0, 2, False)
    policy.changed(t, 4, 2)  # a move down B=2 (13.9/s) cannot carry with the margin
    assert policy.decide(t + 0.01, 2, 4, 4.2, capacity=FLAT.get) is None  # the dwell starts
    d = policy.decide(t + 0.3, 2, 4, 4.2, capacity=FLAT.get)
    assert d is not None and d.batch == 4
    assert policy.timeout_s == 16.0  # the undo doubles it only when it takes effect
    # A B that carries the load keeps the damped gap: a move up after a move down waits it.
    calm = Policy()
    calm.timeout_s = 16.0
    calm.decide(0.0, 4, 4)
    t = dispatch_at(calm, 0.0, 6.0, 5.0, 1, False)
    calm.changed(t, 4, 2)
    calm.decide(t + 0.01, 2, 4, 4.2, capacity=FLAT.get)
    assert calm.decide(t + 0.3, 2, 4, 4.2, capacity=FLAT.get) is None
    assert calm.decide(t + 15.0, 2, 4, 4.2, capacity=FLAT.get) is None


def test_a_move_down_stops_at_the_b_that_carries_the_load() -> None:
    """At B=32, 120/s, the estimate saying 4: B=16 (168/s) carries it with the margin, B=8 (145/s) not."""
    policy = Policy()
    policy.decide(0.0, 32, 32)
    t = dispatch_at(policy, 0.0, 6.0, 120.0, 8, True)
    d = None
    while d is None and t < 9.0:
        t = dispatch_at(policy, t, 0.005, 120.0, 8, True)  # the load goes on
        d = policy.decide(t, 32, 4, 4.0, capacity=CAPACITY.get)
    assert d is not None and d.batch == 16
    assert d.reason.startswith("timeouts") or "need B=16" in d.reason


def test_the_backlog_of_a_move_down_does_not_move_b_back_up() -> None:
    """4 -> 1 at 4 req/s (B=1 carries 11.1/s): the switch held requests, Q̃ reads 4 and their waits are
    long, but what arrives is 40% of B=1's capacity. No move for the rate window; a real load still moves."""
    policy = Policy()
    policy.decide(0.0, 4, 4)
    t = dispatch_at(policy, 0.0, 6.0, 4.0, 1, True)
    policy.changed(t, 4, 1)
    for k in range(6):  # the held requests, dispatched one by one after the switch, each waited long
        t += 0.15
        policy.record_batch(t, 1, False, 900.0 - 100.0 * k)
    end = t + 3.0
    while t < end:
        t += 0.005
        assert policy.decide(t, 1, 4, 4.0, predicted_ms=90.0, capacity=FLAT.get) is None
    # The same estimate with a load B=1 cannot carry: up within the up timeout.
    busy = Policy()
    busy.decide(0.0, 4, 4)
    t = dispatch_at(busy, 0.0, 6.0, 12.0, 2, False)
    busy.changed(t, 4, 1)
    changed_at = t
    t = dispatch_at(busy, t, 0.5, 12.0, 1, False)
    d = None
    while d is None and t < changed_at + 1.0:
        t += 0.005
        d = busy.decide(t, 1, 4, 4.0, capacity=FLAT.get)
    assert d is not None and d.batch == 4


# --- a move down must be worth its switch ---------------------------------------------
def test_a_move_down_that_takes_new_processes_waits_for_what_the_switch_costs() -> None:
    """The last active-passive change over-subscribed the cores 2.4 s: 4 -> 1 (one 2-thread instance for two
    1-thread ones) waits 1 + 2 x 2.4 s; 4 -> 2 (a reshare of the same two instances) waits the 1 s timeout."""
    def first_down(target: int) -> float:
        policy = Policy(needs_processes=lambda a, b: (a == 1) != (b == 1))
        policy.switch_s = 2.4
        policy.decide(0.0, 4, 4)
        t = dispatch_at(policy, 0.0, 6.0, 2.0, 1, True)
        policy.changed(t, 1, 4)
        start = t
        for k in range(6000):  # 30 s of 5 ms samples, 2 req/s
            t += 0.005
            if k % 100 == 0:
                policy.record_batch(t, 1, True, 5.0)
            d = policy.decide(t, 4, target, 0.5, capacity=FLAT.get)
            if d is not None:
                assert d.batch == target
                return t - start
        raise AssertionError("no move down")

    assert 5.8 <= first_down(1) <= 5.8 + 0.1
    assert 1.0 <= first_down(2) <= 1.0 + 0.1
    # The timeouts trigger moves a reshare before the dwell is over, but not a switch before its cost.
    for target, earliest in ((2, 0.0), (1, 4.8)):
        policy = Policy(needs_processes=lambda a, b: (a == 1) != (b == 1))
        policy.switch_s = 2.4
        policy.changed(0.0, 1, 4)
        t = 5.0
        policy.decide(t, 4, 4)
        for k in range(20):  # 20 batches cut by the timeout in the last second
            t += 0.05
            policy.record_batch(t, 1, True, 5.0)
        decided_at = None
        for k in range(2000):
            t += 0.005
            d = policy.decide(t, 4, target, 0.5)  # no capacity known: the trigger's own evidence
            if d is not None:
                decided_at = t
                break
        assert d is not None and (d.reason == "timeouts") == (target == 2)
        assert decided_at is not None and decided_at - 6.0 >= earliest
    # Unknown switch cost or layout: the timeout alone.
    assert Policy().switch_wait(4, 1) == 0.0
    assert Policy(needs_processes=lambda a, b: True).switch_wait(4, 1) == 0.0


def test_planned_layouts_say_which_changes_take_new_processes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dispatcher.adaptive import PlannedCapacity
    from optimizer.planning.profile import Profile, ProfileEntry

    # Two cores: one 2-thread instance is best for a lone request, two 1-thread ones for anything more.
    points = {(1, 1): 100.0, (1, 2): 190.0, (1, 4): 380.0, (2, 1): 60.0, (2, 2): 120.0, (2, 4): 240.0,
              (2, 8): 480.0, (1, 8): 760.0}
    path = Profile(model="tiny", entries=tuple(ProfileEntry(threads=t, batch=b, mean_ms=ms)
                                               for (t, b), ms in points.items())).save(tmp_path / "p.json")
    cap = PlannedCapacity("tiny", str(path))
    assert not cap.needs_processes(4, 1)  # no budgets yet: unknown, never delayed
    cap.budgets = {"n1": 2}
    assert cap.layout(1) == {"n1": frozenset({2})}
    assert cap.layout(4) == {"n1": frozenset({1})}
    assert cap.needs_processes(4, 1) and not cap.needs_processes(4, 2)
    assert cap.most_threads(1) == 2 and cap.most_threads(4) == 1  # what Policy.effective discounts by


def test_only_an_active_passive_change_counts_as_a_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``needs_processes`` matches instances as the supervisor does: differing sets of thread counts
    are no switch where the change only stops instances, or only adds them on free cores."""
    from dispatcher.adaptive import PlannedCapacity
    from packrat_mq.instances import Configuration

    plans = {1: "1x2,2x2", 2: "2x4", 4: "2x4,1x4", 8: "4*1x2", 16: "2x8,2x8"}
    cap = PlannedCapacity("tiny", None)
    monkeypatch.setattr(cap, "_plans", lambda b: {"n1": (b, Configuration.parse(plans[b]))})
    assert not cap.needs_processes(1, 2)  # the 1-thread instance stops: a scale
    assert not cap.needs_processes(2, 4)  # a 1-thread instance is added: a scale
    assert cap.needs_processes(2, 8)      # the 2-thread one stops, four 1-thread ones start
    assert not cap.needs_processes(2, 16)  # same thread count, one more instance
    assert cap.needs_processes(8, 16)


def test_the_sampler_reads_the_switch_cost_from_the_history() -> None:
    import json

    a, clock, fake = _adaptive_on(0, 4)
    a.serving(1, 2, True, 20.0)  # a change took effect
    fake.lpush(a.keys.reconfigurations("m"), json.dumps({"decided": 5.0, "kind": "active-passive",
                                                          "status": "done", "oversubscribed_s": 2.35}))
    a.read_switch()
    assert a.policy.switch_s == pytest.approx(2.35)
    # A reshare after it changes nothing; it is read once.
    a.serving(2, 3, True, 20.0)
    fake.lpush(a.keys.reconfigurations("m"), json.dumps({"decided": 9.0, "kind": "reshare",
                                                          "status": "done", "oversubscribed_s": 0.0}))
    a.read_switch()
    assert a.policy.switch_s == pytest.approx(2.35) and a._history_due is None


def test_a_burst_does_not_start_a_switch_but_a_step_does() -> None:
    """At B=1 (one 2-thread instance; every larger B two 1-thread ones) 2.2 req/s against 7.5/s: eight requests
    a second for a moment reach B=1's capacity, but a switch costs more than they take to drain. A step moves."""
    switch = lambda a, b: (a == 1) != (b == 1)  # noqa: E731
    cap = {1: 7.5, 2: 8.8, 4: 11.4, 8: 10.6, 16: 8.8, 32: 9.4}

    def burst(policy: Policy) -> Decision | None:
        policy.decide(0.0, 1, 1)
        t = dispatch_at(policy, 0.0, 8.0, 2.2, 1, False)
        t = dispatch_at(policy, t, 1.0, 8.0, 1, False)
        assert policy.busy(t, 1, cap.get) and not policy.busy(t, 1, cap.get, sustained=True)
        d = None
        for k in range(100):  # half a second more of it, sampled every 5 ms
            t += 0.005
            if k % 25 == 0:
                policy.record_batch(t, 1, False, 5.0)
            d = d or policy.decide(t, 1, 2, 3.2, capacity=cap.get)
        return d

    assert burst(Policy(needs_processes=switch)) is None
    # Without a switch to pay for (a reshare), the same burst moves B.
    assert burst(Policy(needs_processes=lambda a, b: False)) is not None
    # A step to 10.3/s fills the 5 s window: up within two seconds.
    step = Policy(needs_processes=switch)
    step.decide(0.0, 1, 1)
    t = dispatch_at(step, 0.0, 8.0, 2.2, 1, False)
    start, d = t, None
    while d is None and t < start + 4.0:
        t = dispatch_at(step, t, 0.05, 10.3, 1, False)
        d = step.decide(t, 1, 2, 3.2, capacity=cap.get)
    assert d is not None and d.batch == 4 and t - start <= 2.0


def test_the_sampler_stops_looking_for_a_history_entry_after_a_minute() -> None:
    a, clock, fake = _adaptive_on(0, 4)
    a.serving(1, 2, True, 20.0)
    for _ in range(70):  # no entry is ever written (a supervisor gone mid-change)
        clock.t += 1.0
        a.read_switch()
    assert a._history_due is None and a.policy.switch_s == 0.0


def step_from_idle(policy: Policy, est: Estimator, rate: float, capacity: dict[int, float],
                   seconds: float = 1.0) -> tuple[float, list[Decision]]:
    """Idle at B=1 for 6 s, then arrivals at ``rate``/s that B=1 serves at its capacity: the stream grows.

    Samples every 5 ms as the dispatcher's sampler does (length and batches
    recorded); decisions are collected, not applied. Returns the step's time.
    """
    t, backlog, served = 0.0, 0.0, 0.0
    decisions: list[Decision] = []
    while t < 6.0:  # idle: one request every 0.4 s, served at once
        t += 0.005
        if int(t / 0.4) != int((t - 0.005) / 0.4):
            policy.record_batch(t, 1, False, 1.0)
        length = 1 if int(t / 0.4) != int((t - 0.005) / 0.4) else 0
        est.observe(length, 1)
        policy.record_length(t, length)
        policy.decide(t, 1, est.b_tilde, est.q_tilde, capacity=capacity.get)
    step = t
    while t < step + seconds:
        t += 0.005
        backlog += rate * 0.005
        served += capacity[1] * 0.005
        while served >= 1 and backlog >= 1:
            served -= 1
            backlog -= 1
            policy.record_batch(t, 1, False, (t - step) * 500)
        est.observe(int(backlog), 1)
        policy.record_length(t, int(backlog))
        d = policy.decide(t, 1, est.b_tilde, est.q_tilde, predicted_ms=20.0, capacity=capacity.get)
        if d is not None:
            decisions.append(d)
            break
    return step, decisions


def test_a_queue_the_current_batch_cannot_clear_moves_at_once_to_what_carries_it() -> None:
    """A step to 523 requests/s at B=1 on 64 simulated cores: one change, within a fifth of a second, to B=32.

    Without the surge the estimate waited its dwell (0.25 s) after the vote
    and the change came 0.3 s in, with 160 requests waiting.
    """
    caps = {1: 49.6, 2: 99.1, 4: 198.2, 8: 317.9, 16: 455.4, 32: 581.0}
    est, policy = Estimator(), Policy()
    step, decisions = step_from_idle(policy, est, 523.0, caps)
    assert len(decisions) == 1
    assert decisions[0].batch == 32
    assert policy._lengths[-1][0] - step <= 0.16  # 0.205 s with the dwell on this ideal sampler


def test_a_stream_that_overruns_but_shrinks_is_no_surge() -> None:
    """A backlog left by a stall, drained by the current B: its arrivals are not measured as a surge."""
    def surges(growth: float, capacity: dict[int, float], current: int = 1) -> list[float | None]:
        policy, seen = Policy(), []
        for k in range(40):  # 200 ms of samples, the policy looking at each
            policy.record_length(k * 0.005, int(60 + growth * k * 0.005))
            seen.append(policy.surge(k * 0.005, current, capacity.get))
        return seen

    assert set(surges(-40.0, {1: 50.0})) == {None}  # draining
    growing = surges(100.0, {1: 50.0})  # B=1 serves 50 a second, the stream grows by 100: 150 arrive
    assert growing[:19] == [None] * 19  # not before the stream has overrun B for 0.1 s
    # At the count's high bound: 15 arrivals in the tenth of a second, plus 1.5 standard deviations.
    assert growing[-1] == pytest.approx(150.0 + 1.5 * math.sqrt(15.0) / 0.1, rel=0.1)
    assert set(surges(100.0, {2: 1000.0}, current=2)) == {None}  # 60-80 waiting is no quarter second for B=2


@pytest.mark.parametrize("four", [26.6, 28.0])
@pytest.mark.parametrize("sixteen, expected", [
    (27.8, 16),  # within the knee of B=8's 28.1: a tie, and B=8, the current B, is kept until it is measured
    (26.0, 32),  # 7.5% under B=8's plan; measured, 16's 26.0 and 32's 25.6 tie, and the larger B is taken
])
def test_a_batch_that_serves_less_than_planned_under_a_backlog_gives_way(
        four: float, sixteen: float, expected: int) -> None:
    """ResNet-50 on two cores (12-03): the plan's best B=8 served 23/s under 25.3 arriving, and the knee held it.

    Nothing carries the load, and B=8's plan is the best or tied with it:
    B=8 holds until it is served for a rate window with a backlog
    throughout. Then its measured rate replaces its plan, and the B that
    serves the most from B up (the largest within the knee where 16's 26.0
    and 32's 25.6 tie) is moved to; never down to a smaller B whose plan,
    not yet served, says more (``four`` = 28.0).
    """
    caps = {1: 21.4, 2: 25.0, 4: four, 8: 28.1, 16: sixteen, 32: 25.6}
    est, policy = Estimator(), Policy()
    policy.changed(0.0, 1, 8)
    t, backlog, served, dispatched_at = 0.0, 20.0, 0.0, 0.0
    decisions: list[Decision] = []
    while t < 12.0:
        t += 0.005
        backlog += 25.3 * 0.005
        served += 23.0 * 0.005
        if served >= 8 and backlog >= 8:  # a batch of 8 done: the next one dispatched
            served -= 8
            backlog -= 8
            policy.record_batch(t, 8, False, 400.0)
        est.observe(int(backlog) + 8, 8)
        policy.record_length(t, int(backlog) + 8)
        d = policy.decide(t, 8, est.b_tilde, est.q_tilde, predicted_ms=300.0, capacity=caps.get)
        if d is not None:
            decisions.append(d)
            break
    assert decisions and decisions[0].batch == expected
    assert policy.served[8][0] == pytest.approx(23.0, rel=0.1)
    assert 5.0 <= t <= 7.0  # a rate window after the change, and the dwell


def test_no_backlog_throughout_the_window_teaches_nothing() -> None:
    """A stream that empties once in the window: the instances waited for work, the dispatch rate is the arrivals'."""
    policy = Policy()
    for k in range(1200):  # 6 s: 20 waiting, except one sample at 3 s; the policy looks at each
        t = k * 0.005
        policy.record_length(t, 0 if k == 600 else 20)
        if k % 40 == 0:
            policy.record_batch(t, 8, False, 10.0)
        policy.learn(t, 8)
    assert policy.served == {}
    assert policy.effective(CAPACITY.get, 6.0) == CAPACITY.get


def test_status_shows_what_each_batch_served_under_a_backlog() -> None:
    """The dispatcher's record carries the served capacities; ``status`` shows them, in JSON and in text."""
    from packrat_mq.cli.status import collect_status, render
    from packrat_mq.keys import Keys
    from packrat_mq.records import DispatcherState

    r = fakeredis.FakeRedis()
    keys = Keys("t")
    r.sadd(keys.models(), "resnet50")
    DispatcherState(state="ready", adaptive=True, batch=16, q_tilde=30.0, b_tilde=32,
                    served=["8=23.0", "16=25.5"]).save(r, keys.dispatcher("resnet50"))
    assert DispatcherState.load(r, keys.dispatcher("resnet50")).served == ["8=23.0", "16=25.5"]
    doc = collect_status(r, keys)
    (model,) = doc["models"]
    assert model["estimate"]["served"] == {"8": 23.0, "16": 25.5}
    assert "served under a backlog: B=8 23.0/s, B=16 25.5/s" in render(doc, "t")


def test_the_dispatchers_snapshot_carries_the_served_capacities() -> None:
    clock = Clock()
    adaptive = Adaptive(fakeredis.FakeRedis(), Settings(), "m", clock=clock)
    adaptive.policy.served[8] = (23.0, clock.t)
    adaptive.policy.served[4] = (20.0, clock.t - 400.0)  # measured too long ago: the plan again
    assert adaptive.snapshot().served == {8: 23.0}


def _at_rate(policy: Policy, est: Estimator, current: int, rate: float, length: int, seconds: float,
             latency_ms: Callable[[int, float], float | None] | None, *, queue_ms: float = 5.0,
             predicted_ms: float | None = None, warm_s: float = 2.0) -> list[Decision]:
    """``seconds`` of ``rate`` arrivals counted exactly, B=``current`` dispatching full batches, the stream
    holding ``length`` after ``warm_s`` at B; the decisions (none applied)."""
    policy.latency = latency_ms
    decisions: list[Decision] = []
    t = 100.0
    policy.decide(t, current, current)
    arrived, dispatched = float(max(current, length)), 0.0  # what the stream holds arrived before
    while t < 100.0 + warm_s + seconds:
        t += 0.005
        arrived += rate * 0.005
        if arrived - dispatched >= current:
            dispatched += current
            policy.record_batch(t, current, False, queue_ms)
        warm = t < 100.0 + warm_s
        held = current if warm else length
        policy.record_length(t, held, max(0, int(arrived) - held))
        if warm:  # the service ran at B for a while before the stream read ``length``
            policy.decide(t, current, current, float(current), capacity=CAPACITY.get)
            continue
        est.observe(length, current)
        d = policy.decide(t, current, est.b_tilde, est.q_tilde, predicted_ms=predicted_ms, capacity=CAPACITY.get)
        if d is not None:
            decisions.append(d)
    return decisions


def _sixteen_cores() -> Callable[[int, float], float | None]:
    capacity = PlannedCapacity("profiled", "profiles/sim/resnet50-16core.json")
    capacity.budgets = {"node": 16}
    return capacity.latency


def test_a_smaller_batch_predicted_to_answer_sooner_is_taken_within_the_margin() -> None:
    """16 simulated cores at 125/s (86% of B=8's 145/s): B=16 holds 16 in the stream (Little's law), so the
    estimate says 16; B=8 fails the 20% margin, but its plan answers in about 90 ms against B=16's 127."""
    decisions = _at_rate(Policy(), Estimator(), 16, 125.0, 16, 6.0, _sixteen_cores())
    assert decisions, "no move"
    assert decisions[0].batch == 8
    assert decisions[0].reason.startswith("sooner (B̃=16; B=8 predicted")
    # Without a prediction, the margin holds B at 16.
    assert _at_rate(Policy(), Estimator(), 16, 125.0, 16, 6.0, None) == []


def test_nothing_is_taken_that_is_not_predicted_sooner_by_the_gain() -> None:
    """At 160/s only B=16 and B=32 serve; B=32 is predicted slower: B stays at 16."""
    assert _at_rate(Policy(), Estimator(), 16, 160.0, 16, 6.0, _sixteen_cores()) == []
    # And at 125/s, a B=8 only 5% sooner (a prediction that says so) is no reason to move.
    def close(batch: int, rate: float) -> float:
        return 100.0 if batch == 8 else 105.0

    assert _at_rate(Policy(), Estimator(), 16, 125.0, 16, 6.0, close) == []


def test_a_moments_estimate_above_a_batch_predicted_sooner_does_not_move_it_up() -> None:
    """At B=8 and 125/s the stream reads 16 for a while: B=16 would answer later, so B stays. (For a whole
    rate window it would be a backlog that B=8 serves less than arrives: :meth:`Policy.learn`.)"""
    assert _at_rate(Policy(), Estimator(), 8, 125.0, 16, 4.0, _sixteen_cores()) == []
    up = _at_rate(Policy(), Estimator(), 8, 125.0, 16, 6.0, None)
    assert up and up[0].batch == 16  # the estimate alone moves it


def test_a_queue_that_builds_at_a_batch_predicted_sooner_still_moves_b_up() -> None:
    """The prediction is no proof: requests waiting twice the batch's predicted latency move B up anyway."""
    decisions = _at_rate(Policy(), Estimator(), 8, 125.0, 16, 3.0, _sixteen_cores(), queue_ms=400.0,
                         predicted_ms=55.0)
    assert decisions and decisions[0].batch == 16 and decisions[0].reason == "queue delay"


def test_at_95_percent_of_b_16_neither_16_nor_32_gives_way_to_the_other() -> None:
    """160/s on 16 simulated cores (the benchmark's diurnal-2): B=16 is predicted sooner than B=32 there,
    so an estimate of 32 does not move it up; and from B=32, B=16 is not 10% sooner at the count's high
    bound, so nothing moves down either. The two rules' gains are the hysteresis between them."""
    assert _at_rate(Policy(), Estimator(), 16, 160.0, 32, 4.0, _sixteen_cores()) == []
    assert _at_rate(Policy(), Estimator(), 32, 160.0, 32, 6.0, _sixteen_cores()) == []
    # Past what B=16 serves well (168/s at 98% of it), the estimate moves it up as before.
    up = _at_rate(Policy(), Estimator(), 16, 166.0, 32, 4.0, _sixteen_cores())
    assert up and up[0].batch == 32


def test_the_b_a_queue_moved_up_from_is_taken_back_only_with_more_to_spare() -> None:
    """At 145/s from B=32 on 16 simulated cores, B=16 is predicted sooner and serves the count's high bound
    (153/s) with 9% to spare: the prediction takes it. Right after a move up from 16, the same prediction
    needs 10% to spare (``UNDO_SPARE``): B stays at 32, as the benchmark's diurnal-2 should have (32 -> 16
    7 s after its move up, and back 1.6-5 s later). A move up from another B, or one past the flap window,
    changes nothing."""
    fresh = _at_rate(Policy(), Estimator(), 32, 145.0, 16, 6.0, _sixteen_cores())
    assert fresh and fresh[0].batch == 16 and fresh[0].reason.startswith("sooner")
    undone = Policy()
    undone.changed(99.0, 16, 32)
    assert _at_rate(undone, Estimator(), 32, 145.0, 16, 6.0, _sixteen_cores()) == []
    # At a rate B=16 serves with the 10% too, the undo is taken.
    low = Policy()
    low.changed(99.0, 16, 32)
    lower = _at_rate(low, Estimator(), 32, 130.0, 16, 6.0, _sixteen_cores())
    assert lower and lower[0].batch <= 16
    for other in ((8, 32, 99.0), (16, 32, 100.0 - Policy().settings.flap_window_s - 1.0)):
        policy = Policy()
        policy.changed(other[2], other[0], other[1])
        moved = _at_rate(policy, Estimator(), 32, 145.0, 16, 6.0, _sixteen_cores())
        assert moved and moved[0].batch == 16, other


def _after_a_move_down(policy: Policy, rising_to: int, rate: float = 125.0) -> list[Decision]:
    """B=8 at ``rate`` (125/s) on 16 simulated cores, counted exactly, 2 s after warming at B=8: the stream rises from 15
    to ``rising_to`` over 1 s (what a switch's stall leaves), then holds; the decisions over 2 s (none applied)."""
    policy.latency = _sixteen_cores()
    est = Estimator()
    decisions: list[Decision] = []
    t, arrived, dispatched = 100.0, 8.0, 0.0
    policy.decide(t, 8, 8)
    while t < 104.0:
        t += 0.005
        arrived += rate * 0.005
        if arrived - dispatched >= 8:
            dispatched += 8
            policy.record_batch(t, 8, False, 5.0)
        if t < 102.0:
            held = 15
            policy.record_length(t, held, max(0, int(arrived) - held))
            policy.decide(t, 8, 8, 8.0, capacity=CAPACITY.get)
            continue
        held = int(15 + (rising_to - 15) * min(1.0, t - 102.0))
        policy.record_length(t, held, max(0, int(arrived) - held))
        est.observe(held, 8)
        d = policy.decide(t, 8, est.b_tilde, est.q_tilde, capacity=CAPACITY.get)
        if d is not None:
            decisions.append(d)
    return decisions


def test_the_stall_of_a_switch_down_is_no_surge() -> None:
    """Right after a move 16 -> 8 at 125/s (86% of B=8's capacity), the switch's stall lets the stream grow to
    40, more than B=8 serves in the up dwell: the surge would move B at once, past the prediction. The
    arrivals say B=8 carries the load, and B=8 is predicted sooner: nothing moves. Without the move down just
    before, the same stream is a surge, and B goes up."""
    settling = Policy()
    settling.changed(101.5, 16, 8)
    assert _after_a_move_down(settling, 40) == []
    fresh = _after_a_move_down(Policy(), 40)
    assert fresh and fresh[0].batch > 8
    # A load that outgrows B=8 right after the move down (200/s against its 145) is a step: B goes up at once.
    outgrown = Policy()
    outgrown.changed(101.5, 16, 8)
    stepped = _after_a_move_down(outgrown, 40, rate=200.0)
    assert stepped and stepped[0].batch > 8


def test_the_backlog_of_a_switch_down_does_not_undo_what_the_prediction_chose() -> None:
    """Right after a move down to B=16 the stream holds what arrived during the switch, and requests wait
    long: at 160/s B=16 is still predicted sooner than 32, so nothing moves for the rate window. Later, the
    same queue proves the prediction wrong and moves B up."""
    settling = Policy()
    settling.changed(100.0, 32, 16)
    assert _at_rate(settling, Estimator(), 16, 160.0, 32, 2.5, _sixteen_cores(), queue_ms=400.0,
                    predicted_ms=95.0) == []
    later = _at_rate(Policy(), Estimator(), 16, 160.0, 32, 2.5, _sixteen_cores(), queue_ms=400.0,
                     predicted_ms=95.0)
    assert later and later[0].batch == 32 and later[0].reason == "queue delay"


def test_an_estimate_four_times_b_is_no_moment_the_prediction_waits_out() -> None:
    """A step from idle: B=1 still looks sooner by a rate window mostly idle, but Q̃ at 4x B moves B at once."""
    decisions = _at_rate(Policy(), Estimator(), 1, 12.0, 0, 0.0, _sixteen_cores())
    assert decisions == []
    policy, est = Policy(), Estimator()
    policy.latency = _sixteen_cores()
    policy.surge = lambda *args: None  # type: ignore[method-assign]  # a sampler too slow to see it
    t = 100.0
    policy.decide(t, 1, 1)
    for k in range(int(5.0 / 0.005)):  # 5 s idle at 12/s
        t += 0.005
        policy.record_length(t, 0, int(12.0 * (t - 100.0)))
        policy.decide(t, 1, 1, 0.5, capacity=CAPACITY.get)
    step_at, d = t, None
    while d is None and t < step_at + 1.0:  # then 500/s: the stream grows by 450 a second
        t += 0.005
        length = int(450.0 * (t - step_at))
        policy.record_length(t, length, int(12.0 * (step_at - 100.0) + 50.0 * (t - step_at)))
        est.observe(length, 1)
        d = policy.decide(t, 1, est.b_tilde, est.q_tilde, capacity=CAPACITY.get)
    assert d is not None and d.batch == 32
    assert t - step_at <= 0.27  # the up dwell (0.25 s) from the first sample that asked for more


@pytest.mark.parametrize("switch, eight, expected", [
    (True, 16.0, 32),   # 4.6% more: not worth an active-passive switch under a load both fall behind
    (True, 17.2, 8),    # 12% more: worth it
    (False, 17.2, 8),   # a reshare costs nothing: the B that serves the most
    (False, 16.0, 32),  # B=32's 15.3 is within the knee (5%) of 16.0: a tie, and the larger B is kept
])
def test_under_a_load_nothing_carries_a_move_down_that_switches_must_serve_switch_gain_more(
        switch: bool, eight: float, expected: int) -> None:
    """The Zen 4 host (12-04 19:05): at 20.5/s arriving, B=32 measured 15.3/s and B=8 16.0/s.

    B went 32 -> 8 with 7.5 s over-subscribed and back by the queue delay
    13 s later; the backlog of each switch was never drained. Below B, under
    a load no B carries, a change that takes new processes needs
    ``switch_gain`` (10%) more capacity; a reshare needs none.
    """
    caps = {1: 13.9, 2: 15.0, 4: 15.5, 8: eight, 16: 15.0, 32: 15.3}
    policy = Policy(needs_processes=lambda a, b: switch and (a == 32) != (b == 32))
    assert policy.carrying(0.0, 8, 32, caps.get, rate=20.5, estimated=32) == expected


def test_the_switch_gain_is_a_setting() -> None:
    from dispatcher.adaptive import estimator_settings

    assert estimator_settings(Settings(estimator_switch_gain=0.25)).switch_gain == 0.25
    assert EstimatorSettings().switch_gain == 0.1


# --- a switch must pay for itself ----------------------------------------------------------
ZEN4 = {1: 15.4, 2: 17.8, 4: 20.4, 8: 20.4, 16: 22.5, 32: 24.3}  # 12-05, each by its thread count's ratio
#: A full batch's ms: B=4 one 2-thread instance, B=16 and 32 two 1-thread ones (batches cut by the wait).
SERVICE = {1: 65.0, 2: 112.0, 4: 196.0, 8: 392.0, 16: 700.0, 32: 700.0}


def _zen4_policy(rate: float, **settings: Any) -> Policy:
    """B=32 is two 1-thread instances, B <= 8 one 2-thread one; the last switch over-subscribed 1.2 s."""
    policy = Policy(EstimatorSettings(**settings), needs_processes=lambda a, b: (a >= 16) != (b >= 16))
    policy.switch_s = 1.2

    def latency(batch: int, r: float) -> float | None:  # M/D/1's wait on a batch's time
        rho = r / ZEN4[batch]
        return None if rho >= 1 else SERVICE[batch] * (1 + rho / (2 * (1 - rho)))
    policy.latency = latency
    policy.rate_bound = lambda now: rate  # type: ignore[method-assign]  # the arrivals' high bound, known
    policy._count_bound = lambda now: rate  # type: ignore[method-assign]
    return policy


def test_the_payback_of_a_switch_grows_with_the_load() -> None:
    """Below half the capacity the switch builds no backlog; near the target's capacity its backlog takes
    long to drain, and the move must be asked for long; where the target is no sooner, or does not carry
    the load, never."""
    def payback(rate: float, target: int = 4) -> float:
        return _zen4_policy(rate).payback_s(0.0, 32, target, ZEN4.get)

    assert payback(10.0) == 0.0
    assert 0.0 < payback(15.0) < 1.0
    assert payback(19.0) > 10 * payback(15.0)
    assert payback(19.4) == math.inf, "B=4 is predicted no sooner there"
    assert payback(21.0) == math.inf, "B=4 does not carry 21/s"
    assert payback(25.0) == math.inf, "B=32 does not carry it either, and B=4 serves less"
    assert payback(25.0, target=2) == math.inf
    faster = _zen4_policy(25.0)
    assert faster.payback_s(0.0, 4, 32, ZEN4.get) == 0.0, "B=32 serves 19% more: staying builds a backlog"
    policy = _zen4_policy(19.0)
    assert policy.switch_wait(32, 16, 0.0, ZEN4.get) == 0.0, "a reshare waits for nothing"
    assert policy.switch_wait(32, 4, 0.0, ZEN4.get) == pytest.approx(payback(19.0))
    assert _zen4_policy(15.0).switch_wait(32, 4, 0.0, ZEN4.get) == pytest.approx(2 * 1.2), "at least twice the switch"
    policy.switch_s = 0.0
    assert policy.payback_s(0.0, 32, 4, ZEN4.get) == 0.0, "no switch measured yet: nothing delayed on a guess"
    off = _zen4_policy(19.0, switch_payback=False)
    assert off.switch_wait(32, 4, 0.0, ZEN4.get) == pytest.approx(2 * 1.2), "off: twice the switch, as before"


@pytest.mark.parametrize("payback", [True, False])
def test_a_move_down_near_the_targets_capacity_waits_for_its_payback(payback: bool) -> None:
    """The Zen 4 trace's diurnal-5 (12-05 08:47): near B=4's capacity, B=32 went to B=4 by the timeouts after
    the timeout and twice the last switch (1 + 2 x 1.2 s), and the switch's backlog lasted the rest of the
    phase. At 19.2/s its payback is 7 s: the move waits that long."""
    policy = _zen4_policy(19.2, switch_payback=payback)
    expected = policy.payback_s(0.0, 32, 4, ZEN4.get) if payback else 2 * 1.2
    assert 6.5 < policy.payback_s(0.0, 32, 4, ZEN4.get) < 7.5
    t = 100.0
    policy.decide(t, 32, 32)
    decision = None
    while t < 130.0 and decision is None:
        t += 0.005
        policy.record_length(t, 20, int(19.2 * (t - 100.0)))
        if round(t * 200) % 10 == 0:
            policy.record_batch(t, 2, True, 5.0)
        decision = policy.decide(t, 32, 4, 4.0, capacity=ZEN4.get)
    assert decision is not None and decision.batch == 4
    assert expected <= t - 100.0 <= expected + 1.1  # asked for from the start, the timeouts trigger's dwell
    assert ("paid back" in decision.reason) == payback


#: What each B's instances are expected to take to serve what they hold under load, in seconds (half the running
#: sub-batch and one queued, of the slowest, as PlannedCapacity.drain_s): B=32 two 1-thread instances of 16 (1.9 s
#: each), B <= 8 one 2-thread instance.
DRAIN = {1: 0.1, 2: 0.17, 4: 0.29, 8: 0.59, 16: 1.43, 32: 2.85}


def test_a_switch_is_priced_at_least_at_what_the_b_it_leaves_holds() -> None:
    """The Zen 4 trace (12-06): the move up from idle over-subscribed 0.12 s; the moves down from B=32 that
    followed it 0.8-6.6 s. A switch away from B lasts at least what B's instances hold."""
    policy = Policy(needs_processes=lambda a, b: (a >= 16) != (b >= 16))
    policy.drain_s = DRAIN.get
    assert policy.switch_cost_s(32) == 0.0, "no switch measured: nothing delayed on a guess"
    policy.switch_s = 0.12
    assert policy.switch_cost_s(32) == 2.85
    assert policy.switch_cost_s(1) == 0.12, "the last switch where it is longer"
    assert policy.switch_cost_s(99) == 0.12, "a B with no plan: the last switch"
    policy.drain_s = None
    assert policy.switch_cost_s(32) == 0.12, "what B holds unknown: the last switch's seconds"


def test_a_move_down_after_a_quick_move_up_pays_for_the_switch_it_takes() -> None:
    """The Zen 4 trace (12-06 13:20, cpu1): B went 1 -> 32 from idle (0.12 s over-subscribed), then at 17-20/s
    32 -> 8 "sooner", priced by that switch: a payback of a hundredth of a second. The switch took 3.2 s, and
    the trace's mean was 1.9x static B=32's. Priced by what B=32 holds, the move waits for seconds of the same
    evidence; a lighter load, whose switch builds less backlog, waits less."""
    def payback(drain: bool, rate: float = 18.0) -> float:
        policy = _zen4_policy(rate)
        if drain:
            policy.drain_s = DRAIN.get
        policy.switch_s = 0.12
        return policy.payback_s(0.0, 32, 4, ZEN4.get)

    assert payback(False) < 0.1
    assert payback(True) > 4.0
    assert payback(True, rate=15.0) < payback(True) / 3
    assert payback(True, rate=10.0) == 0.0, "below what half of B=32 serves: no backlog, nothing to pay"
    policy = _zen4_policy(10.0)
    policy.drain_s = DRAIN.get
    policy.switch_s = 0.12
    assert policy.switch_wait(32, 4, 0.0, ZEN4.get) == pytest.approx(2 * 2.85), "twice the switch"
    assert policy.switch_wait(32, 16, 0.0, ZEN4.get) == 0.0, "a reshare waits for nothing"


def test_planned_drain_is_half_the_running_sub_batch_and_those_queued(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from optimizer.planning.profile import Profile, ProfileEntry

    points = {(1, 1): 100.0, (1, 2): 190.0, (1, 4): 380.0, (2, 1): 60.0, (2, 2): 120.0, (2, 4): 240.0,
              (2, 8): 480.0, (1, 8): 760.0}
    path = Profile(model="tiny", entries=tuple(ProfileEntry(threads=t, batch=b, mean_ms=ms)
                                               for (t, b), ms in points.items())).save(tmp_path / "p.json")
    cap = PlannedCapacity("tiny", str(path), max_waiting=1)
    assert cap.drain_s(4) is None  # no budgets: no plan
    cap.budgets = {"n1": 2}
    assert cap.layout(4) == {"n1": frozenset({1})}  # two 1-thread instances of 2
    assert cap.drain_s(4) == pytest.approx(1.5 * 190.0 / 1000.0)
    assert cap.drain_s(1) == pytest.approx(1.5 * 60.0 / 1000.0)  # one 2-thread instance of 1
    cap.ratios = {"n1": 1.5}  # served 1.5x slower than profiled: drains 1.5x as long
    assert cap.drain_s(4) == pytest.approx(1.5 * 1.5 * 190.0 / 1000.0)
    deeper = PlannedCapacity("tiny", str(path), max_waiting=2)
    deeper.budgets = {"n1": 2}
    assert deeper.drain_s(4) == pytest.approx(2.5 * 190.0 / 1000.0)


def test_the_sampler_gives_the_policy_what_each_b_drains() -> None:
    cap = PlannedCapacity("m", None)
    a = Adaptive(fakeredis.FakeRedis(), Settings(), "m", capacity=cap)
    assert a.policy.drain_s == cap.drain_s


def test_under_a_load_nothing_carries_tied_plans_take_the_largest_batch() -> None:
    """ResNet-50 on the Zen 4 host (12-06 01:47, 01:50): plans within 0.4%, and B=8 taken served 27-40% less.

    The dispatcher's plans gave B=8 17.83/s and B=32 17.76/s; under the
    step's 22/s the exact maximum moved B from 1 to 8, which served
    19.2-20.8/s, while static B=32 served 26.5-26.9/s. Plans within the
    knee are a tie, and of tied plans the largest B is taken; one clearly
    ahead (more than the knee) still wins.
    """
    caps = {1: 13.87, 2: 15.88, 4: 17.41, 8: 17.83, 16: 16.51, 32: 17.76}
    policy = Policy()
    assert policy.most(caps.get) == 32
    assert policy.carrying(0.0, 1, 1, caps.get, rate=22.0, estimated=16) == 32
    ahead = {**caps, 8: 19.0}  # 7% over B=32: beyond the knee
    assert policy.most(ahead.get) == 8
    assert policy.most(caps.get, at_least=16) == 32
    assert policy.most(caps.get, current=8) == 8  # the current B among the tied: no move
    # 12-06 13:00: B=8 (21.5/s planned) under a burst of 26.4/s stays; B=32's 21.4 is a tie, not a gain.
    flat = {1: 16.7, 2: 19.1, 4: 20.0, 8: 21.5, 16: 20.1, 32: 21.4}
    assert policy.carrying(0.0, 8, 8, flat.get, rate=26.4, estimated=32) == 8
    assert Policy(EstimatorSettings(knee=0.0)).most(caps.get) == 8  # no knee: the exact maximum
    # B <= 8 one 2-thread instance, B >= 16 two 1-thread ones: from B=1, B=8 is a reshare, B=32 a switch.
    switching = Policy(needs_processes=lambda a, b: (a >= 16) != (b >= 16))
    assert switching.most(caps.get, current=1) == 8
    assert switching.most(caps.get, current=16) == 32


def test_tied_plans_take_the_fewest_threads_then_the_largest_batch() -> None:
    """B=4 and B=8 one 2-thread instance, B=16 two 1-thread ones: of the three tied, B=16."""
    caps = {1: 13.0, 2: 15.0, 4: 17.6, 8: 17.8, 16: 17.2, 32: 15.0}
    policy = Policy()
    policy.threads = {1: 2, 2: 2, 4: 2, 8: 2, 16: 1, 32: 1}.get
    assert policy.most(caps.get) == 16
    policy.threads = lambda b: None  # unknown: the largest of the tied
    assert policy.most(caps.get) == 16


def test_a_loss_measured_discounts_the_plans_of_as_many_threads_or_more() -> None:
    """The Zen 4 host (12-06 12:44): B=32 (1-thread instances) served 16.0/s of its 22.5 planned.

    B=8's plan of 18.8 (one 2-thread instance) read 17% over B=32's measure
    and took B down through a 6.6 s switch, to serve 16.0/s too. A plan of
    as many threads or more is discounted by the loss measured; a plan of
    fewer threads is not (a 2-thread B measured short says nothing of
    1-thread ones, which lose less).
    """
    plans = {1: 14.6, 2: 16.7, 4: 18.3, 8: 18.8, 16: 17.4, 32: 17.8}  # the dispatcher's, that run
    threads = {1: 2, 2: 2, 4: 2, 8: 2, 16: 1, 32: 1}

    def policy_serving_32() -> Policy:
        policy = Policy(needs_processes=lambda a, b: (threads[a] == 1) != (threads[b] == 1))
        policy.served[32] = (16.0, 0.0)
        return policy

    blind = policy_serving_32()  # thread counts unknown: B=8's plan as it is, 17.5% over B=32's measure
    served = blind.effective(plans.get, 1.0)
    assert served is not None and served(8) == 18.8
    assert blind.carrying(1.0, blind.worth(32, served), 32, served, rate=15.9, estimated=32) == 8
    policy = policy_serving_32()
    policy.threads = threads.get
    served = policy.effective(plans.get, 1.0)
    assert served is not None
    assert served(32) == 16.0
    assert served(8) == pytest.approx(18.8 * 16.0 / 17.8)
    assert served(16) == pytest.approx(17.4 * 16.0 / 17.8)  # the same thread count
    # Nothing carries 15.9/s; B=8 (16.9) is no longer switch_gain (10%) more than B=32's 16.0.
    assert policy.carrying(1.0, policy.worth(32, served), 32, served, rate=15.9, estimated=32) == 32

    policy = Policy()
    policy.threads = {1: 2, 2: 2, 4: 2, 8: 2, 16: 1, 32: 1}.get
    policy.served[8] = (23.0, 0.0)  # a 2-thread B measured short (12-03): 1-thread plans stand
    served = policy.effective({**plans, 8: 28.1}.get, 1.0)
    assert served is not None
    assert served(16) == 17.4 and served(32) == 17.8
    assert served(4) == pytest.approx(18.3 * 23.0 / 28.1)



# --- a move down waits for the spares being loaded --------------------------------------
def test_planned_starts_count_the_processes_a_change_starts_and_spares_loading_are_waited_for(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """64 simulated cores (12-07): B 4 -> 32 took all 32 spares; 32 -> 16 five seconds later found 5 of the 16
    it needed loaded, started 11 and over-subscribed 3.7 s. A move that would start more processes than are
    loaded waits while the node is loading more; where none is coming, nothing is waited for."""
    from optimizer.planning.profile import Profile, ProfileEntry

    points = {(1, 1): 100.0, (1, 2): 190.0, (1, 4): 380.0, (2, 1): 60.0, (2, 2): 120.0, (2, 4): 240.0,
              (2, 8): 480.0, (1, 8): 760.0}
    path = Profile(model="tiny", entries=tuple(ProfileEntry(threads=t, batch=b, mean_ms=ms)
                                               for (t, b), ms in points.items())).save(tmp_path / "p.json")
    cap = PlannedCapacity("tiny", str(path))
    assert cap.starts(4, 1) is None and not cap.awaiting_spares(4, 1, 0.0)  # no budgets: unknown
    cap.budgets = {"n1": 2}
    assert cap.starts(4, 1) == {"n1": 1}  # one 2-thread instance for two 1-thread ones
    assert cap.starts(1, 4) == {"n1": 2}
    assert cap.starts(4, 2) == {"n1": 0}  # a reshare of the same two instances
    cap.observe_spares({"n1": (0, 2)}, 0.0)
    assert not cap.awaiting_spares(4, 1, 1.0), "none loaded, none seen loading: nothing is coming"
    cap.observe_spares({"n1": (1, 2)}, 2.0)  # one loaded since: loading
    assert not cap.awaiting_spares(4, 1, 3.0), "the one it needs is loaded"
    assert cap.awaiting_spares(1, 4, 3.0), "two needed, one loaded, more coming"
    assert not cap.awaiting_spares(1, 4, 2.0 + SPARES_RISING_S + 0.1), "no more for long: not waited for"
    cap.observe_spares({"n1": (2, 2)}, 4.0)
    assert not cap.awaiting_spares(1, 4, 5.0), "as many as it keeps"
    cap.observe_spares({"n1": (0, 2)}, 6.0)  # taken by a change: loaded again from there on
    assert cap.awaiting_spares(1, 4, 6.5)
    assert not cap.awaiting_spares(1, 4, 4.0 + SPARES_RISING_S + 0.1), "none since: not waited for"


def test_the_processes_a_change_starts_beyond_the_loaded_spares_are_priced_at_their_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """64 simulated cores (12-07): moves from B=32 to 16 that found 0-4 spares loaded started 12-15 processes on
    two real CPUs and were ready in 6.2-6.6 s. The processes beyond the spares load in rounds of as many as the
    node's CPUs, each round what one takes alone."""
    from optimizer.planning.profile import Profile, ProfileEntry

    points = {(1, 1): 100.0, (1, 2): 190.0, (1, 4): 380.0, (2, 1): 60.0, (2, 2): 120.0, (2, 4): 240.0,
              (2, 8): 480.0, (1, 8): 760.0}
    path = Profile(model="tiny", entries=tuple(ProfileEntry(threads=t, batch=b, mean_ms=ms)
                                               for (t, b), ms in points.items())).save(tmp_path / "p.json")
    cap = PlannedCapacity("tiny", str(path))
    assert cap.cold_start_s(1, 4) is None, "no plans: unknown"
    cap.budgets = {"n1": 2}
    assert cap.starts(1, 4) == {"n1": 2} and cap.starts(4, 2) == {"n1": 0}
    cap.observe_spares({"n1": (0, 2)}, 0.0)
    assert cap.cold_start_s(1, 4) is None, "processes to start, no start time measured: unknown"
    assert cap.cold_start_s(4, 2) == 0.0, "a reshare starts nothing"
    cap.observe_spares({"n1": (0, 2)}, 1.0, {"n1": (1.5, 1)})
    assert cap.cold_start_s(1, 4) == 3.0, "two processes, one CPU: two rounds of 1.5 s"
    cap.observe_spares({"n1": (1, 2)}, 2.0)  # the start time is kept while a read says nothing new of it
    assert cap.cold_start_s(1, 4) == 1.5, "one of the two is a loaded spare"
    cap.observe_spares({"n1": (0, 2)}, 3.0, {"n1": (1.5, 2)})
    assert cap.cold_start_s(1, 4) == 1.5, "two CPUs: the two load side by side"
    cap.observe_spares({"n1": (2, 2)}, 4.0)
    assert cap.cold_start_s(1, 4) == 0.0, "both rebound from spares"


def test_a_switch_that_starts_processes_is_priced_at_their_load_before_the_drain() -> None:
    """The last switch (a move up that rebound spares, 0.2 s) says nothing of a move down that starts 12
    processes; their load adds to what the B it leaves holds. Known before any switch: it is measured."""
    policy = Policy(needs_processes=lambda a, b: (a >= 16) != (b >= 16))
    policy.drain_s = DRAIN.get
    cold = {(32, 8): 6.0, (32, 4): 0.0}
    policy.cold_start_s = lambda a, b: cold.get((a, b))
    assert policy.switch_cost_s(32, 8) == 2.85 + 6.0, "no switch measured yet, but the start time is"
    assert policy.switch_cost_s(32, 4) == 0.0, "nothing started, nothing measured: nothing delayed on a guess"
    assert policy.switch_cost_s(32) == 0.0, "no target: the last switch and the drain alone"
    policy.switch_s = 0.2
    assert policy.switch_cost_s(32, 8) == 2.85 + 6.0
    assert policy.switch_cost_s(32, 4) == 2.85, "all rebound from spares: the drain"
    assert policy.switch_cost_s(32, 2) == 2.85, "unknown start: the drain"
    policy.switch_s = 12.0
    assert policy.switch_cost_s(32, 8) == 12.0, "the last switch where it is longer"
    caps = {16: 430.0, 32: 548.0}
    latency = {16: 66.0, 32: 81.0}
    policy.switch_s = 0.2
    policy.drain_s = {32: 0.05, 16: 0.07}.get  # the sleeping model's tenth-scale batches
    policy.latency = lambda b, rate: latency.get(b)
    t = dispatch_at(policy, 0.0, 6.0, 350.0, 32, False)
    cold[(32, 16)] = 0.0
    rebound = policy.payback_s(t, 32, 16, caps.get)
    cold[(32, 16)] = 6.0
    started = policy.payback_s(t, 32, 16, caps.get)
    assert 0.0 < rebound < 60.0 and started > 10 * rebound, "the move that starts 12 processes pays back later"


def test_a_move_down_that_would_start_processes_waits_while_spares_load_unless_b_is_short() -> None:
    spares_loading = {"value": True}
    policy = Policy(needs_processes=lambda a, b: (a == 32) != (b == 32))
    policy.awaiting_spares = lambda a, b, now: spares_loading["value"]
    caps = {8: 300.0, 16: 450.0, 32: 540.0}
    t = dispatch_at(policy, 0.0, 6.0, 250.0, 32, False)
    assert policy.spares_due(t, 32, 16, caps.get), "B=32 carries 250/s: the move waits"
    assert not policy.spares_due(t, 16, 8, caps.get), "a reshare starts nothing"
    spares_loading["value"] = False
    assert not policy.spares_due(t, 32, 16, caps.get)
    spares_loading["value"] = True
    short = Policy(needs_processes=policy.needs_processes)
    short.awaiting_spares = policy.awaiting_spares
    t = dispatch_at(short, 0.0, 6.0, 500.0, 32, False)
    assert not short.spares_due(t, 32, 16, caps.get), "B=32 near its capacity: staying builds a backlog too"
    assert not Policy().spares_due(t, 32, 16, caps.get), "unknown: never waited for"


def test_the_decision_to_move_down_comes_once_the_spares_have_loaded() -> None:
    loading_until = 3.0
    policy = Policy(needs_processes=lambda a, b: (a == 32) != (b == 32))
    policy.awaiting_spares = lambda a, b, now: now < loading_until
    caps = {8: 300.0, 16: 450.0, 32: 540.0}
    t = dispatch_at(policy, 0.0, 6.0, 250.0, 32, False)
    policy.changed(t - 5.0, 8, 32)
    decided = None
    start = t
    loading_until = start + 3.0
    for _ in range(2000):
        t += 0.005
        d = policy.decide(t, 32, 16, 20.0, capacity=caps.get)
        if d is not None:
            decided = t
            break
    assert decided is not None and decided >= loading_until
    assert decided - loading_until < 0.05, "the estimate held meanwhile: the move comes as soon as they have"


def test_the_sampler_gives_the_policy_the_spares_check() -> None:
    cap = PlannedCapacity("m", None)
    a = Adaptive(fakeredis.FakeRedis(), Settings(), "m", capacity=cap)
    assert a.policy.awaiting_spares == cap.awaiting_spares
    assert a.policy.cold_start_s == cap.cold_start_s


def _first_move_of_a_step(cores: int, rate: float, seed: int) -> int:
    """The B the first change takes when an idle B=1 (a quarter of what it serves) meets ``rate`` (Poisson), by
    the 16-core ResNet-50 plans on ``cores`` simulated cores; the service is B's plan, one batch at a time."""
    capacity = PlannedCapacity("profiled", "profiles/sim/resnet50-16core.json")
    capacity.budgets = {"node": cores}
    est, policy = Estimator(), Policy()
    policy.needs_processes, policy.threads = capacity.needs_processes, capacity.most_threads
    policy.latency, policy.drain_s = capacity.latency, capacity.drain_s
    rng = random.Random(seed)
    t, current, queued, running, answered, busy_until = 0.0, 1, 0, 0, 0, 0.0
    while t < 22.0:
        t += 0.005
        queued += _poisson(rng, (0.25 * capacity(1) if t < 20.0 else rate) * 0.005)
        if t >= busy_until:
            answered, running = answered + running, 0
            if queued:
                running = min(current, queued)
                queued -= running
                busy_until = t + running / capacity(current)
                policy.record_batch(t, running, False, 5.0)
        est.observe(queued + running, current)
        policy.record_length(t, queued + running, answered)
        d = policy.decide(t, current, est.b_tilde, est.q_tilde, None, capacity)
        if d is not None:
            policy.changed(t, current, d.batch)
            if t >= 20.0:
                return d.batch
            current = d.batch
    raise AssertionError("no move in the step")


def _poisson(rng: random.Random, mean: float) -> int:
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product >= limit:
        k += 1
        product *= rng.random()
    return k


def test_a_step_from_idle_goes_at_once_to_what_carries_its_growth_at_the_counts_high_bound() -> None:
    """16 simulated cores (12-07): a step to 165/s went 1 -> 8 in two runs of four and 8 -> 32 3 s later, cold-
    starting 6-7 instances (the step's mean 297-308 ms against 216-220). The surge's rate, the stream's growth
    over a tenth of a second, is a count of about 16: taken as it is, it put 5 of 20 seeds at B=16 (168.5/s,
    short of the margin); at its high bound every seed goes to 32."""
    assert {_first_move_of_a_step(16, 165.0, seed) for seed in range(6)} == {32}
    # A step that B=4 carries (60/s: B=4 serves 113.8) is not sent past B=8 on most seeds.
    moves = [_first_move_of_a_step(16, 60.0, seed) for seed in range(6)]
    assert sum(b <= 8 for b in moves) >= 5, moves
