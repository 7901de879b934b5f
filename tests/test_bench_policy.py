"""The closed-loop policy simulation (benchmarks/bench_policy.py): the real estimator and policy, simulated arrivals."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks import bench_policy

PROFILE = "profiles/sim/resnet50-16core.json"


def test_at_86_percent_of_b8_the_policy_settles_at_b8_from_b16() -> None:
    """The diurnal-1 load of the adaptive benchmark (125/s on 16 simulated cores): B=8 is predicted sooner."""
    for seed in range(2):
        run = bench_policy.simulate(125.0, 16, profile=PROFILE, cores=16, seconds=10.0, warm_s=10.0, seed=seed)
        assert run.end == 8, run
        assert run.changes == [], "settled within the warm-up, and no change after it"


def test_a_step_past_what_b16_serves_moves_b_up_within_seconds() -> None:
    run = bench_policy.simulate(150.0, 16, profile=PROFILE, cores=16, seconds=5.0, warm_s=8.0, seed=0,
                                rate_after=200.0)
    up = run.first_up()
    assert up is not None and up < 3.0, run.changes
    assert run.end == 32


def test_the_command_reports_and_writes_its_runs(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "policy.json"
    assert bench_policy.main(["--rate", "12", "--start", "4", "--seeds", "1", "--seconds", "3", "--warm-s", "3",
                              "--json-out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "seed 0: ends at B=" in printed and "changes in 1 x 3 s at 12.0/s" in printed
    result = json.loads(out.read_text())
    assert result["args"]["rate"] == 12.0 and len(result["runs"]) == 1
    assert result["changes"] == len(result["runs"][0]["changes"])


def test_the_trace_mode_answers_every_request_once_and_counts_the_switches(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``--trace``: the adaptive benchmark's phases, each setup over the same seeds; static B never changes."""
    from benchmarks.bench_adaptive import capacities, trace
    from dispatcher.adaptive import PlannedCapacity

    phases, _ = trace(capacities("profiled", 16, PROFILE, "eager", 1.0), 1.0)
    plans = PlannedCapacity("profiled", PROFILE, timeout_ms=50.0)
    plans.budgets = {"node": 16}
    adaptive = bench_policy.simulate_trace(phases, plans=plans, setup="adaptive", seed=0, switch_s=0.5)
    static = bench_policy.simulate_trace(phases, plans=plans, setup="static-32", seed=0, switch_s=0.5)
    assert len(adaptive.requests) == len(static.requests) > 100, "the same arrivals, each answered once"
    assert all(ms > 0 for _, ms in adaptive.requests + static.requests)
    assert static.changes == [] and adaptive.changes
    assert {kind for _, _, _, kind, _ in adaptive.changes} <= {"reshare", "active-passive"}
    assert adaptive.mean_ms(0.0, phases[0].seconds) < static.mean_ms(0.0, phases[0].seconds)  # type: ignore[operator]
    out = tmp_path / "trace.json"
    assert bench_policy.main(["--trace", "--model", "profiled", "--profile", PROFILE, "--cores", "16", "--unit", "1",
                              "--seeds", "1", "--setups", "adaptive,adaptive+nopayback+oneratio,static-32",
                              "--json-out", str(out)]) == 0
    assert "static-32" in capsys.readouterr().out
    assert set(json.loads(out.read_text())["setups"]) == {"adaptive", "adaptive+nopayback+oneratio", "static-32"}


def test_a_drained_switch_lasts_what_the_old_instances_held_and_a_moving_host_slows_static_b() -> None:
    """``drain``: a switch lasts its warm-up plus what the old instances held, slowed to ``keep``; the policy
    reads each switch's own length. ``motion``: the host's slow spells make every batch longer."""
    from benchmarks.bench_adaptive import capacities, trace
    from dispatcher.adaptive import PlannedCapacity

    phases, _ = trace(capacities("profiled", 16, PROFILE, "eager", 1.0), 1.0)
    plans = PlannedCapacity("profiled", PROFILE, timeout_ms=50.0)
    plans.budgets = {"node": 16}
    fixed = bench_policy.simulate_trace(phases, plans=plans, setup="adaptive", seed=0, switch_s=0.1)
    drained = bench_policy.simulate_trace(phases, plans=plans, setup="adaptive", seed=0, switch_s=0.1, drain=True)
    assert len(drained.requests) == len(fixed.requests), "every request answered once either way"
    assert any(kind == "active-passive" for _, _, _, kind, _ in drained.changes)
    steady = bench_policy.simulate_trace(phases, plans=plans, setup="static-32", seed=0)
    slowed = bench_policy.simulate_trace(phases, plans=plans, setup="static-32", seed=0, motion=(1.5, 2.0))
    assert len(slowed.requests) == len(steady.requests)
    assert slowed.mean_ms() > steady.mean_ms()  # type: ignore[operator]


def test_switch_costs_reads_the_moves_down_that_followed_a_switch(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """benchmarks/switch_costs.py: each move down after another switch, its length against each estimate."""
    from benchmarks import switch_costs
    from optimizer.planning.profile import Profile, ProfileEntry

    points = {(1, 1): 100.0, (1, 2): 190.0, (1, 4): 380.0, (2, 1): 60.0, (2, 2): 120.0, (2, 4): 240.0,
              (2, 8): 480.0, (1, 8): 760.0}
    profile = Profile(model="tiny", entries=tuple(ProfileEntry(threads=t, batch=b, mean_ms=ms)
                                                  for (t, b), ms in points.items())).save(tmp_path / "tiny.json")
    changes = [{"kind": "active-passive", "from_batch": 1, "to_batch": 4, "oversubscribed_s": 0.1},
               {"kind": "reshare", "from_batch": 4, "to_batch": 2, "oversubscribed_s": 0.0},
               {"kind": "active-passive", "from_batch": 4, "to_batch": 1, "oversubscribed_s": 0.5},
               {"kind": "active-passive", "oversubscribed_s": 9.0}]  # no B recorded: not read
    result = {"model": "tiny", "profile": str(profile), "threads": 2, "host_over_profile": {"1": 1.0},
              "setups": {"adaptive": {"reconfigurations": changes}}}
    rows = switch_costs.estimates(result)
    assert len(rows) == 1 and rows[0]["from"] == 4 and rows[0]["to"] == 1 and rows[0]["first"]
    assert rows[0]["last"] == 0.1 and rows[0]["drain"] > 0.1 and rows[0]["now"] == rows[0]["drain"]
    table = switch_costs.summary(rows)
    assert table["last"]["median_ratio"] == 0.1 / 0.5
    out = tmp_path / "r.json"
    out.write_text(json.dumps(result))
    assert switch_costs.main([str(out)]) == 0
    assert "| now | 1 |" in capsys.readouterr().out
