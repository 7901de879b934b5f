"""The dispatcher's flow simulated over a plan: checked against closed forms and served figures."""
from __future__ import annotations

import pytest

from dispatcher.adaptive import PlannedCapacity
from dispatcher.queueing import Server, spread, arrival_times, mean_latency_ms


@pytest.mark.parametrize("rho", [0.3, 0.5, 0.8])
def test_one_instance_of_one_request_is_md1(rho: float) -> None:
    """One instance, share 1, 10 ms a request: M/D/1, W = S + ρS / (2(1 − ρ))."""
    service = 10.0
    rate = rho / service * 1000.0
    expected = service + rho * service / (2 * (1 - rho))
    means = [mean_latency_ms([Server(1, lambda k: service)], rate, 50.0, count=20_000, seed=s) for s in range(3)]
    assert sum(means) / len(means) == pytest.approx(expected, rel=0.03)


def test_batches_cut_by_count_wait_for_their_last_request() -> None:
    """Four at a time, instant service, no timeout: the mean wait is (b − 1) / (2λ)."""
    rate = 100.0
    mean = mean_latency_ms([Server(4, lambda k: 0.0)], rate, 1e9, count=20_000)
    assert mean == pytest.approx(1.5 / rate * 1000.0, rel=0.03)


def test_the_timeout_cuts_a_batch_that_would_wait_longer() -> None:
    """At 1 request/s a batch of 8 never fills: every request waits the 50 ms timeout and its 5 ms."""
    mean = mean_latency_ms([Server(8, lambda k: 5.0)], 1.0, 50.0, count=2_000)
    assert mean == pytest.approx(55.0, rel=0.05)


def test_a_partial_batch_is_spread_over_the_instances_as_the_dispatcher_splits_it() -> None:
    """Two instances of share 2 and two requests: one each (the fastest next request first)."""
    def latency(k: int) -> float:
        return 10.0 * k

    assert spread(2, [Server(2, latency), Server(2, latency)]) == [1, 1]
    assert spread(3, [Server(2, latency), Server(2, latency)]) in ([2, 1], [1, 2])
    assert spread(1, [Server(2, lambda k: 30.0 * k), Server(2, latency)]) == [0, 1]


def test_a_rate_past_capacity_loses_to_a_plan_that_carries_it() -> None:
    fast_small = [Server(1, lambda k: 20.0)]  # 50/s
    slow_large = [Server(4, lambda k: 40.0 + 5.0 * k)]  # 4 in 60 ms: 67/s
    assert mean_latency_ms(fast_small, 60.0, 50.0) > mean_latency_ms(slow_large, 60.0, 50.0)
    assert mean_latency_ms(fast_small, 20.0, 50.0) < mean_latency_ms(slow_large, 20.0, 50.0)


def test_the_arrivals_are_one_sequence_scaled() -> None:
    """Common random numbers: every plan compared at a rate sees the same arrivals."""
    a, b = arrival_times(10.0, 50, seed=3), arrival_times(20.0, 50, seed=3)
    assert b == pytest.approx([t / 2 for t in a])


def test_rejects_what_cannot_be_simulated() -> None:
    with pytest.raises(ValueError):
        mean_latency_ms([], 10.0, 50.0)
    with pytest.raises(ValueError):
        mean_latency_ms([Server(1, lambda k: 1.0)], 0.0, 50.0)


#: What the adaptive benchmark served on 16 simulated cores (``profiled``, 2026-12-03, Zen 3 and Zen 4
#: hosts; benchmarks/results/adaptive-profiled-16sim-zen*.json): phase, rate, static B, mean ms.
SERVED_16 = [
    ("idle", 12.39, 32, 139.2), ("diurnal-1", 125.23, 8, 94.0), ("diurnal-1", 125.23, 32, 167.9),
    ("diurnal-2", 159.79, 32, 195.5), ("idle", 12.39, 8, 99.4), ("diurnal-1", 125.23, 8, 99.3),
    ("diurnal-1", 125.23, 32, 166.5), ("diurnal-2", 159.79, 32, 198.8),
]


@pytest.mark.parametrize(("phase", "rate", "batch", "served_ms"), SERVED_16)
def test_the_plans_predict_what_16_simulated_cores_served(phase: str, rate: float, batch: int,
                                                          served_ms: float) -> None:
    capacity = PlannedCapacity("profiled", "profiles/sim/resnet50-16core.json")
    capacity.budgets = {"node": 16}
    predicted = capacity.latency(batch, rate)
    assert predicted is not None
    assert predicted == pytest.approx(served_ms, rel=0.10), phase


def test_the_plans_order_the_batches_as_serving_did() -> None:
    """At 125 requests/s on 16 simulated cores B=8 answered soonest, then 16, then 32."""
    capacity = PlannedCapacity("profiled", "profiles/sim/resnet50-16core.json")
    capacity.budgets = {"node": 16}
    b8, b16, b32 = (capacity.latency(b, 125.2) for b in (8, 16, 32))
    assert b8 is not None and b16 is not None and b32 is not None
    assert b8 < 0.8 * b16 < 0.8 * b32
    # A node measured serving 1.5x slower than its profile: every batch 1.5x as long.
    capacity.ratios = {"node": 1.5}
    slower = capacity.latency(32, 50.0)
    capacity.ratios = {}
    assert slower is not None and slower > 1.3 * (capacity.latency(32, 50.0) or 0.0)


def test_no_profile_predicts_nothing() -> None:
    capacity = PlannedCapacity("profiled", None)
    capacity.budgets = {"node": 16}
    assert capacity.latency(8, 100.0) is None
