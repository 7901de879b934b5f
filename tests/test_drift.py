"""Served batch times held against the profile (optimizer.planning.drift): pure, no processes."""
from __future__ import annotations

import pytest

from optimizer.planning.drift import Served, check_profile
from optimizer.planning.profile import Profile, ProfileEntry

PROFILE = Profile(model="m", entries=(ProfileEntry(threads=1, batch=1, mean_ms=50.0),
                                      ProfileEntry(threads=2, batch=1, mean_ms=30.0),
                                      ProfileEntry(threads=1, batch=4, mean_ms=180.0)))


def test_the_ratio_is_the_median_over_instances_at_their_own_points() -> None:
    check = check_profile(PROFILE, [Served("a", 1, 1, 100.0, 9), Served("b", 2, 1, 57.0, 9),
                                    Served("c", 1, 4, 190.0, 9)])
    assert check.ratio == pytest.approx(1.9)  # 2.0, 1.9, 1.06
    assert check.off
    assert "a (1x1) 100.0 ms against 50.0 ms" in check.describe()


def test_the_ratio_by_thread_count_is_each_counts_median() -> None:
    check = check_profile(PROFILE, [Served("a", 1, 1, 100.0, 9), Served("b", 2, 1, 57.0, 9),
                                    Served("c", 1, 4, 190.0, 9)])
    assert check.by_threads() == {1: pytest.approx((2.0 + 190.0 / 180.0) / 2), 2: pytest.approx(1.9)}
    assert check_profile(PROFILE, []).by_threads() == {}


def test_within_the_tolerance_is_not_off_either_way() -> None:
    assert not check_profile(PROFILE, [Served("a", 1, 1, 60.0, 9)]).off  # 1.2x
    assert check_profile(PROFILE, [Served("a", 1, 1, 35.0, 9)]).off  # 0.7x: faster than profiled is drift too
    assert check_profile(PROFILE, [Served("a", 1, 1, 60.0, 9)], tolerance=1.1).off


def test_too_few_batches_or_points_the_profile_lacks_say_nothing() -> None:
    check = check_profile(PROFILE, [Served("a", 1, 1, 500.0, 2), Served("b", 4, 1, 500.0, 50)])
    assert check.ratio is None and not check.off and check.describe() == "not measured yet"
