"""The estimator and the reconfiguration policy in a closed loop, simulated: many seeds in seconds.

The adaptive benchmark (``bench_adaptive``) serves one trace with real
processes in minutes, and its flips come from the arrivals' noise: one run
says little about how often a rule flips. This replays the dispatcher's own
:class:`dispatcher.estimation.Estimator` and :class:`~dispatcher.estimation.Policy`
against Poisson arrivals served as :mod:`dispatcher.queueing` models the
dispatcher (batches cut by count or the batch wait, fed to the idle instances
of the current B's plan, each sub-batch taking the profile's latency plus its
path), sampling the stream's length and the answered count every 5 ms as the
sampler does, and applying each decision at once (no switch cost: a reshare).
Each seed is a different arrival sequence; the same seed is the same sequence
for every rule compared.

How close it is to serving: on 16 simulated cores at 159.8 requests/s (95% of
B=16's capacity), the 12-04 adaptive runs flipped 32 -> 16 by the timeouts
trigger reading 153.8/s and back by the estimate reading 186.7/s; this
simulation flips the same way, reading 146-155/s down and 170-188/s up
(docs/figures.md, "Holding B at 95% of its capacity").

Run: ``python -m benchmarks.bench_policy --rate 160 --start 32 --seeds 10``
(``--rate-after R``: the rate changes to R after the warm-up, and the report
says when B first moved up).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dispatcher.adaptive import PlannedCapacity
from dispatcher.estimation import Estimator, Policy
from dispatcher.queueing import spread

#: The dispatcher's sampler's period (s), and the simulation's step (s).
SAMPLE_S = 0.005
STEP_S = 0.001


@dataclass
class Run:
    """One seed: the B it ended at, and each change after the warm-up (s after it, from, to, reason, rate read)."""

    seed: int
    end: int
    changes: list[tuple[float, int, int, str, float]] = field(default_factory=list)

    def first_up(self) -> float | None:
        return next((at for at, old, new, _, _ in self.changes if new > old), None)


def simulate(rate: float, start: int, *, profile: str, cores: int, seconds: float = 60.0, warm_s: float = 10.0,
             seed: int = 0, timeout_ms: float = 50.0, rate_after: float | None = None,
             model: str = "profiled") -> Run:
    """``warm_s`` at ``rate`` from B=``start`` (changes applied, not reported), then ``seconds`` at
    ``rate_after`` (or ``rate``)."""
    rng = random.Random(seed)
    plans = PlannedCapacity(model, profile, timeout_ms=timeout_ms)
    plans.budgets = {"node": cores}
    policy, est = Policy(), Estimator()
    policy.latency = plans.latency
    current = start
    servers = plans.servers(current)
    if servers is None:
        raise ValueError(f"no plan for B={start} from {profile} at {cores} cores")
    holds: list[list[tuple[float, int]]] = [[] for _ in servers]  # per instance: (finish s, requests)
    retired: list[tuple[float, int]] = []  # what replaced instances still hold
    waiting: deque[float] = deque()
    run = Run(seed, start)
    t, step = 0.0, 0
    next_arrival = rng.expovariate(rate)
    arrived = answered = 0
    batch_start: float | None = None
    while t < warm_s + seconds:
        step += 1
        t = step * STEP_S
        now_rate = rate if rate_after is None or t < warm_s else rate_after
        while next_arrival <= t:
            waiting.append(next_arrival)
            arrived += 1
            next_arrival += rng.expovariate(now_rate)
        for held in holds:
            while held and held[0][0] <= t:
                answered += held.pop(0)[1]
        answered += sum(k for finish, k in retired if finish <= t)
        retired = [(finish, k) for finish, k in retired if finish > t]
        idle = [j for j, held in enumerate(holds) if not held]
        serve = idle or [j for j, held in enumerate(holds) if len(held) <= 1]
        if serve and waiting:
            batch_start = t if batch_start is None else batch_start
            size = sum(servers[j].share for j in serve)
            if len(waiting) >= size or (t - batch_start) * 1000.0 >= timeout_ms:
                take = min(size, len(waiting))
                oldest = waiting[0]
                for _ in range(take):
                    waiting.popleft()
                for j, k in zip(serve, spread(take, [servers[j] for j in serve])):
                    if k:
                        held = holds[j]
                        begin = max(t, held[-1][0] if held else t)
                        held.append((begin + servers[j].latency_ms(k) / 1000.0, k))
                policy.record_batch(t, take, take < size, (t - oldest) * 1000.0)
                batch_start = None
        if step % round(SAMPLE_S / STEP_S):
            continue
        length = arrived - answered
        policy.record_length(t, length, answered)
        est.observe(length, current)
        predicted = max(s.latency_ms(s.share) for s in servers)
        decision = policy.decide(t, current, est.b_tilde, est.q_tilde, predicted_ms=predicted, capacity=plans)
        if decision is None:
            continue
        policy.changed(t, current, decision.batch)
        if t >= warm_s:
            run.changes.append((round(t - warm_s, 3), current, decision.batch, decision.reason,
                                round(decision.rate or 0.0, 1)))
        for held in holds:
            retired.extend(held)
        current = decision.batch
        servers = plans.servers(current)
        if servers is None:
            raise ValueError(f"no plan for B={current}")
        holds = [[] for _ in servers]
        batch_start = None
    run.end = current
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, required=True, help="arrivals per second")
    ap.add_argument("--start", type=int, default=1, help="B at the start of the warm-up")
    ap.add_argument("--rate-after", type=float, default=None, help="the rate after the warm-up (a step)")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=60.0, help="simulated seconds after the warm-up")
    ap.add_argument("--warm-s", type=float, default=10.0)
    ap.add_argument("--profile", default="profiles/sim/resnet50-16core.json")
    ap.add_argument("--model", default="profiled")
    ap.add_argument("--cores", type=int, default=16)
    ap.add_argument("--json-out", default=None, help="write the runs here (default: print only)")
    args = ap.parse_args(argv)
    runs = [simulate(args.rate, args.start, profile=args.profile, cores=args.cores, seconds=args.seconds,
                     warm_s=args.warm_s, seed=seed, rate_after=args.rate_after, model=args.model)
            for seed in range(args.seeds)]
    for run in runs:
        moves = ", ".join(f"{at:.1f} s {old}->{new} ({reason.split(':')[0]}, {read}/s)"
                          for at, old, new, reason, read in run.changes)
        print(f"seed {run.seed}: ends at B={run.end}, {len(run.changes)} changes{': ' + moves if moves else ''}")
    total = sum(len(run.changes) for run in runs)
    print(f"{total} changes in {args.seeds} x {args.seconds:.0f} s at {args.rate_after or args.rate}/s")
    ups = [at for run in runs if (at := run.first_up()) is not None]
    if args.rate_after is not None:
        print(f"first move up after the step: {len(ups)} of {len(runs)} seeds"
              + (f", median {statistics.median(ups):.2f} s, at most {max(ups):.2f} s" if ups else ""))
    if args.json_out:
        result: dict[str, Any] = {"args": vars(args), "changes": total,
                                  "runs": [{"seed": r.seed, "end": r.end, "changes": r.changes} for r in runs]}
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2))
        print(f"written to {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
