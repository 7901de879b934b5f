"""Splitting a batch among instances: shares, water-filling and profiles."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher.partitioning import LatencyFn, profile_latency, split, threads_latency

MIXED = [(4, 8), (2, 4), (2, 4)]


def max_latency(counts: list[int], instances: list[tuple[int, int]], latency: LatencyFn) -> float:
    return max((latency(t, n) for (t, _), n in zip(instances, counts) if n > 0), default=0.0)


def brute_force_optimum(n: int, instances: list[tuple[int, int]], latency: LatencyFn) -> float:
    best = float("inf")
    for counts in itertools.product(*(range(b + 1) for _, b in instances)):
        if sum(counts) == n:
            best = min(best, max_latency(list(counts), instances, latency))
    return best


# --- full and empty batches -------------------------------------------------
@pytest.mark.parametrize(
    "instances",
    [MIXED, [(1, 1)], [(2, 3), (8, 16), (1, 1)], [(4, 2)] * 5],
)
def test_full_batch_is_configured_shares(instances: list[tuple[int, int]]) -> None:
    n = sum(b for _, b in instances)
    assert split(n, instances) == [b for _, b in instances]
    # A latency estimate does not change a full batch.
    assert split(n, instances, lambda t, b: 1000.0 / t) == [b for _, b in instances]


def test_zero_requests() -> None:
    assert split(0, MIXED) == [0, 0, 0]


def test_more_than_capacity_raises() -> None:
    with pytest.raises(ValueError, match="exceeds the configuration's capacity 16"):
        split(17, MIXED)


def test_negative_batch_raises() -> None:
    with pytest.raises(ValueError):
        split(-1, MIXED)


# --- partial batches by threads ---------------------------------------------
def test_partial_batch_by_threads_favours_the_bigger_instance() -> None:
    counts = split(6, MIXED)
    assert sum(counts) == 6
    assert counts[0] > counts[1] and counts[0] > counts[2]
    assert counts == [4, 1, 1]
    # Max of batch/threads is as low as any split of 6 can make it.
    assert max_latency(counts, MIXED, threads_latency) == brute_force_optimum(6, MIXED, threads_latency)


def test_partial_batch_spreads_over_equal_instances() -> None:
    counts = split(4, [(2, 4)] * 4)
    assert counts == [1, 1, 1, 1]


def test_single_request_goes_to_fastest_instance() -> None:
    assert split(1, [(1, 4), (8, 4), (2, 4)]) == [0, 1, 0]


def test_share_is_a_hard_cap() -> None:
    # The 16-thread instance is far faster but takes at most its share of 2.
    counts = split(5, [(16, 2), (1, 8)])
    assert counts == [2, 3]


# --- partial batches by a profile -------------------------------------------
def test_profile_latency_interpolates() -> None:
    lat = profile_latency({(2, 1): 10.0, (2, 4): 22.0, (2, 8): 50.0, (4, 2): 8.0})
    assert lat(2, 1) == 10.0
    assert lat(2, 4) == 22.0
    assert lat(2, 2) == pytest.approx(14.0)  # 10 + (22 - 10) * 1/3
    assert lat(2, 6) == pytest.approx(36.0)  # halfway between 4 and 8
    assert lat(2, 16) == pytest.approx(100.0)  # beyond the last point: proportional
    assert lat(4, 1) == pytest.approx(4.0)  # below the first point: proportional
    assert lat(4, 2) == 8.0


def test_profile_latency_unprofiled_threads_on_profile_scale() -> None:
    # All profiled entries cost 10 ms per request-per-thread; an unprofiled
    # thread count must be estimated in the same units, not in bare batch/threads.
    lat = profile_latency({(2, 2): 10.0, (2, 4): 20.0, (4, 4): 10.0})
    assert lat(8, 8) == pytest.approx(10.0)
    assert lat(1, 1) == pytest.approx(10.0)
    assert split(4, [(2, 4), (8, 4)], lat) == [1, 3]


def test_unprofiled_slow_instance_is_not_mistaken_for_fast() -> None:
    # Only 4 threads were profiled (tens of ms). A 1-thread instance must not
    # look like it takes 1 ms per request because its estimate is unscaled.
    lat = profile_latency({(4, 1): 10.0, (4, 4): 25.0})
    assert lat(1, 1) > lat(4, 4)
    assert split(4, [(4, 4), (1, 4)], lat) == [4, 0]


def test_partial_batch_by_profile_follows_measurements() -> None:
    # Measured: the 2-thread instances are nearly as fast as the 4-thread one
    # for small batches (threads do not help much), so a partial batch is
    # spread out instead of piled onto the 4-thread instance.
    table = {
        (4, 1): 10.0, (4, 2): 12.0, (4, 4): 30.0, (4, 8): 60.0,
        (2, 1): 11.0, (2, 2): 14.0, (2, 4): 40.0,
    }
    lat = profile_latency(table)
    counts = split(6, MIXED, lat)
    assert counts == [2, 2, 2]
    assert split(6, MIXED) == [4, 1, 1]  # what threads alone would have said
    assert max_latency(counts, MIXED, lat) == brute_force_optimum(6, MIXED, lat)


def test_profile_can_send_everything_to_one_instance() -> None:
    # A slow 2-thread profile: the 4-thread instance takes all 3.
    lat = profile_latency({(4, 1): 5.0, (4, 8): 12.0, (2, 1): 50.0, (2, 4): 100.0})
    assert split(3, MIXED, lat) == [3, 0, 0]


# --- properties -------------------------------------------------------------
instances_st = st.lists(
    st.tuples(st.sampled_from([1, 2, 4, 8]), st.integers(min_value=1, max_value=4)),
    min_size=1,
    max_size=4,
)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), instances=instances_st)
def test_split_properties_threads(data: st.DataObject, instances: list[tuple[int, int]]) -> None:
    capacity = sum(b for _, b in instances)
    n = data.draw(st.integers(min_value=0, max_value=capacity))
    counts = split(n, instances)
    assert len(counts) == len(instances)
    assert sum(counts) == n
    assert all(0 <= c <= b for c, (_, b) in zip(counts, instances))
    assert max_latency(counts, instances, threads_latency) == pytest.approx(
        brute_force_optimum(n, instances, threads_latency)
    )


@st.composite
def monotone_profile(draw: st.DrawFn, threads: list[int]) -> dict[tuple[int, int], float]:
    """Latency tables that grow with the batch, as the greedy split assumes."""
    table = {}
    for t in sorted(set(threads)):
        ms = draw(st.floats(min_value=0.5, max_value=50.0))
        for b in sorted(draw(st.sets(st.integers(1, 6), min_size=1, max_size=4))):
            table[(t, b)] = ms
            ms += draw(st.floats(min_value=0.0, max_value=30.0))
    return table


@settings(max_examples=150, deadline=None)
@given(data=st.data(), instances=instances_st)
def test_split_properties_profile(data: st.DataObject, instances: list[tuple[int, int]]) -> None:
    table = data.draw(monotone_profile([t for t, _ in instances]))
    lat = profile_latency(table)
    capacity = sum(b for _, b in instances)
    n = data.draw(st.integers(min_value=0, max_value=capacity))
    counts = split(n, instances, lat)
    assert sum(counts) == n
    assert all(0 <= c <= b for c, (_, b) in zip(counts, instances))
    assert max_latency(counts, instances, lat) == pytest.approx(brute_force_optimum(n, instances, lat))
