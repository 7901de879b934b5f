"""The solver against brute force, its edge cases, and the ``optimize`` command."""
from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from optimizer.planning.profile import MachineInfo, Profile, ProfileEntry, ProfileError
from optimizer.planning.solving import InfeasibleError, clear_cache, solve
from packrat_mq.cli.optimize_cmd import optimize
from packrat_mq.instances import Configuration
from tests.reference_solver import solve_reference


def brute_force(threads, batches, lat, T, B):
    """Every multiset of measured instances with sum b == B, sum t <= T; best (latency, threads, count)."""
    cands = [
        (int(t), int(b), float(lat[i, j]))
        for i, t in enumerate(threads)
        for j, b in enumerate(batches)
        if np.isfinite(lat[i, j])
    ]
    best = None

    def walk(start, t_left, b_left, worst, used, count):
        nonlocal best
        if b_left == 0:
            key = (worst, used, count)
            if best is None or key < best:
                best = key
            return
        for k in range(start, len(cands)):
            t, b, lt = cands[k]
            if t <= t_left and b <= b_left:
                walk(k, t_left - t, b_left - b, max(worst, lt), used + t, count + 1)

    walk(0, T, B, 0.0, 0, 0)
    return best


def check_configuration(config, threads, batches, lat, T, B):
    lookup = {
        (int(t), int(b)): float(lat[i, j])
        for i, t in enumerate(threads)
        for j, b in enumerate(batches)
        if np.isfinite(lat[i, j])
    }
    assert config.batch == B
    assert config.threads <= T
    assert all((i.threads, i.batch) in lookup for i in config.instances)
    assert max(lookup[(i.threads, i.batch)] for i in config.instances) == config.predicted_latency_ms


@st.composite
def small_problems(draw):
    threads = sorted(draw(st.sets(st.integers(1, 6), min_size=1, max_size=4)))
    batches = sorted(draw(st.sets(st.integers(1, 6), min_size=1, max_size=4)))
    # Few distinct values, so that ties (and tie-breaking) are common.
    value = st.one_of(st.sampled_from([1.0, 2.0, 3.0, 5.0, 8.0, 13.0]), st.just(math.nan))
    lat = np.array(
        draw(st.lists(st.lists(value, min_size=len(batches), max_size=len(batches)),
                      min_size=len(threads), max_size=len(threads)))
    )
    if not np.isfinite(lat).any():
        lat[0, 0] = 4.0
    T = draw(st.integers(1, 8))
    B = draw(st.integers(1, 10))
    return np.array(threads), np.array(batches), lat, T, B


@settings(max_examples=400, deadline=None)
@given(small_problems())
def test_matches_brute_force(problem):
    threads, batches, lat, T, B = problem
    expected = brute_force(threads, batches, lat, T, B)
    if expected is None:
        with pytest.raises(InfeasibleError):
            solve((threads, batches, lat), T, B)
        with pytest.raises(InfeasibleError):
            solve_reference((threads, batches, lat), T, B)
        return
    config = solve((threads, batches, lat), T, B)
    check_configuration(config, threads, batches, lat, T, B)
    assert (config.predicted_latency_ms, config.threads, len(config.instances)) == expected
    ref = solve_reference((threads, batches, lat), T, B)
    check_configuration(ref, threads, batches, lat, T, B)
    assert ref.predicted_latency_ms == expected[0]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    T=st.integers(1, 24),
    B=st.integers(1, 96),
)
def test_matches_reference_on_realistic_profiles(seed, T, B):
    """Bigger than brute force can reach: Amdahl-like profiles with holes, against the recursion."""
    rng = np.random.default_rng(seed)
    threads = np.arange(1, 17)
    batches = np.array([1, 2, 3, 4, 8, 16, 32])
    p = rng.uniform(0.5, 0.99)
    lat = (0.2 + batches[None, :]) * ((1 - p) + p / threads[:, None]) * rng.lognormal(0, 0.1, (16, 7))
    lat[rng.random(lat.shape) < 0.2] = np.nan
    try:
        ref = solve_reference((threads, batches, lat), T, B)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            solve((threads, batches, lat), T, B)
        return
    config = solve((threads, batches, lat), T, B)
    check_configuration(config, threads, batches, lat, T, B)
    assert config.predicted_latency_ms == ref.predicted_latency_ms
    assert config.threads <= ref.threads


def table(rows: dict[tuple[int, int], float]):
    threads = sorted({t for t, _ in rows})
    batches = sorted({b for _, b in rows})
    lat = np.full((len(threads), len(batches)), np.nan)
    for (t, b), v in rows.items():
        lat[threads.index(t), batches.index(b)] = v
    return np.array(threads), np.array(batches), lat


def test_batch_that_is_not_a_power_of_two():
    t = np.arange(1, 5)
    b = np.array([1, 2, 4, 8])
    lat = (b[None, :] + 1.0) / np.sqrt(t[:, None])
    config = solve((t, b, lat), 4, 13)
    assert config.batch == 13
    check_configuration(config, t, b, lat, 4, 13)
    assert config.predicted_latency_ms == brute_force(t, b, lat, 4, 13)[0]


def test_infeasible_batch_names_the_sizes():
    with pytest.raises(InfeasibleError, match=r"batch 3 cannot be covered by profiled batch sizes \{2,4\} within 16 threads"):
        solve(table({(1, 2): 1.0, (1, 4): 2.0, (2, 4): 1.5}), 16, 3)


def test_infeasible_for_lack_of_threads():
    with pytest.raises(InfeasibleError, match="needs at least 4 threads"):
        solve(table({(1, 1): 1.0}), 2, 4)
    with pytest.raises(InfeasibleError, match="no measurement with 1 or fewer threads"):
        solve(table({(2, 1): 1.0}), 1, 1)


@pytest.mark.parametrize("T, B, message", [(0, 4, "at least 1 thread"), (4, 0, "at least 1 request"),
                                           (-1, 4, "threads=-1")])
def test_bad_budget(T, B, message):
    with pytest.raises(InfeasibleError, match=message):
        solve(table({(1, 1): 1.0}), T, B)


def test_empty_and_malformed_profiles():
    with pytest.raises(ProfileError, match="no entries"):
        solve(Profile(model="empty"), 4, 4)
    with pytest.raises(ProfileError, match="shape"):
        solve((np.array([1, 2]), np.array([1]), np.array([[1.0, 2.0]])), 4, 4)
    with pytest.raises(ProfileError, match="positive"):
        solve((np.array([1]), np.array([1]), np.array([[-1.0]])), 4, 4)
    with pytest.raises(ProfileError, match="no measured point"):
        solve((np.array([1]), np.array([1]), np.array([[np.nan]])), 4, 4)
    with pytest.raises(ProfileError, match="expected a Profile"):
        solve(42, 4, 4)  # type: ignore[arg-type]


def test_idle_threads_when_more_would_be_slower():
    # Beyond two threads the instance slows down (contention): leave two cores idle.
    config = solve(table({(1, 4): 10.0, (2, 4): 5.0, (3, 4): 7.0, (4, 4): 8.0}), 4, 4)
    assert [(i.threads, i.batch) for i in config.instances] == [(2, 4)]
    assert config.predicted_latency_ms == 5.0


def test_ties_prefer_fewer_threads_then_fewer_instances():
    config = solve(table({(2, 4): 5.0, (4, 4): 5.0}), 4, 4)
    assert [(i.threads, i.batch) for i in config.instances] == [(2, 4)]
    config = solve(table({(1, 1): 5.0, (2, 2): 5.0}), 2, 2)
    assert [(i.threads, i.batch) for i in config.instances] == [(2, 2)]


def test_fewest_threads_is_not_the_best_remainder():
    # Batch 4 only runs at 10 ms. A max-DP that keeps the fastest remainder for the
    # last request picks (2 threads, 1 ms); (1 thread, 9 ms) hides under the 10 ms
    # instance and saves a thread.
    rows = {(1, 4): 10.0, (1, 1): 9.0, (2, 1): 1.0}
    config = solve(table(rows), 4, 5)
    assert config.predicted_latency_ms == 10.0
    assert sorted((i.threads, i.batch) for i in config.instances) == [(1, 1), (1, 4)]


def test_heterogeneous_optimum():
    rows = {(1, 2): 10.0, (2, 2): 6.0, (1, 4): 20.0, (2, 4): 7.0, (3, 4): 5.5}
    config = solve(table(rows), 4, 6)
    assert sorted((i.threads, i.batch) for i in config.instances) == [(2, 2), (2, 4)]
    assert config.predicted_latency_ms == 7.0
    homogeneous = min(
        v * 1.0 for (t, b), v in rows.items() if 6 % b == 0 and (6 // b) * t <= 4
    )
    assert config.predicted_latency_ms < homogeneous


def test_profile_and_table_agree_and_cache_is_used():
    rng = np.random.default_rng(7)
    entries = [
        ProfileEntry(threads=t, batch=b, mean_ms=float(b / (0.2 + 0.8 / t) * rng.uniform(0.9, 1.1)))
        for t in range(1, 17) for b in (1, 2, 4, 8, 16, 32, 64)
    ]
    prof = Profile(model="synthetic", entries=entries)
    first = solve(prof, 16, 100)
    assert solve(prof.table(), 16, 100) == first
    assert solve_reference(prof, 16, 100).predicted_latency_ms == first.predicted_latency_ms
    # Served from the cache (lookup speed is measured by benchmarks/bench_optimizer.py).
    for _ in range(3):
        assert solve(prof, 16, 100) is first
    # New entries, new answer: the cache is keyed by the contents.
    prof.upsert([ProfileEntry(threads=1, batch=b, mean_ms=1e-3) for b in (4, 8)])
    assert solve(prof, 16, 100).predicted_latency_ms == 1e-3


def test_cold_solve_at_t16_b1024_is_a_valid_plan():
    # Its time (target 20 ms) is measured by benchmarks/bench_optimizer.py, not here.
    t = np.arange(1, 17)
    b = 2 ** np.arange(11)
    lat = (0.5 + b[None, :]) / (1 / (0.1 + 0.9 / t[:, None])) + 0.01 * t[:, None]
    clear_cache()
    config = solve((t, b, lat), 16, 1024)
    check_configuration(config, t, b, lat, 16, 1024)


# ----------------------------------------------------------------------- CLI


@pytest.fixture
def saved_profile(tmp_path):
    rows = {(1, 2): 10.0, (2, 2): 6.0, (1, 4): 20.0, (2, 4): 7.0, (3, 4): 5.5}
    prof = Profile(
        model="toy",
        machine=MachineInfo(physical_cores=4),
        entries=[ProfileEntry(threads=t, batch=b, mean_ms=v) for (t, b), v in rows.items()],
    )
    return prof.save(tmp_path / "profiles" / "toy.json")


def run(*args):
    group = click.Group("packrat-mq", commands=[optimize])
    return CliRunner().invoke(group, ["optimize", *args])


def test_optimize_json(saved_profile):
    result = run("--profile", str(saved_profile), "--threads", "4", "--batch", "6", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc == {
        "predicted_latency_ms": 7.0,
        "instances": [{"threads": 2, "batch": 4, "count": 1}, {"threads": 2, "batch": 2, "count": 1}],
    }


def test_optimize_text_by_model_name_and_default_threads(saved_profile, monkeypatch):
    monkeypatch.chdir(saved_profile.parent.parent)
    result = run("-p", "toy", "-b", "6")
    assert result.exit_code == 0, result.output
    assert "1 x (threads=2, batch=4)" in result.output
    assert "predicted latency: 7.000 ms" in result.output
    assert "on 4 threads" in result.output
    assert "configuration: 2x4,2x2" in result.output
    assert f"profile: {Path('profiles') / 'toy.json'}" in result.output.replace(str(saved_profile.parent.parent) + "/", "")


def test_configuration_compact_reads_back():
    config = Configuration.parse("2x4,4x8,2x4")
    assert config.compact() == "4x8,2*2x4"
    assert Configuration.parse(config.compact()).grouped() == config.grouped()
    assert Configuration.parse("1x1").compact() == "1x1"


def test_optimize_errors_are_clean(saved_profile, tmp_path):
    result = run("-p", str(saved_profile), "-t", "4", "-b", "3")
    assert result.exit_code == 1
    assert "batch 3 cannot be covered by profiled batch sizes {2,4} within 4 threads" in result.output
    assert isinstance(result.exception, SystemExit)  # a ClickException, not a traceback
    result = run("-p", str(saved_profile), "-t", "0", "-b", "4")
    assert result.exit_code == 2 and "--threads" in result.output
    result = run("-p", str(tmp_path / "missing.json"), "-b", "4")
    assert result.exit_code == 1 and "no profile file at" in result.output
    result = run("-p", "nosuchmodel", "-b", "4")
    assert result.exit_code == 1 and "no profile for model 'nosuchmodel'" in result.output


def test_optimize_help_examples_run(monkeypatch):
    """The examples in ``optimize --help`` work as printed, on the repository's profiles."""
    result = run("--help")
    assert result.exit_code == 0, result.output
    lines = [line.split("#")[0].strip() for line in result.output.splitlines()]
    examples = [shlex.split(line)[1:] for line in lines if line.startswith("packrat-mq optimize")]
    assert len(examples) >= 2, result.output
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    for argv in examples:
        if "--calibrate" in argv:
            continue  # serves the model for real; calibration has its own tests
        res = run(*argv[1:])
        assert res.exit_code == 0, (argv, res.output)
        batch = int(argv[argv.index("--batch" if "--batch" in argv else "-b") + 1])
        if "--json" in argv:
            assert sum(g["batch"] * g["count"] for g in json.loads(res.output)["instances"]) == batch
        else:
            assert f"batch {batch} on" in res.output and "configuration:" in res.output
