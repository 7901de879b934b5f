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
from dispatcher.queueing import Server, spread

#: How often the supervisors' drift check measures the host against the profile (s; ``--motion``).
DRIFT_S = 10.0
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
    stepped = rate_after is None
    while t < warm_s + seconds:
        step += 1
        t = step * STEP_S
        now_rate = rate if rate_after is None or t < warm_s else rate_after
        if not stepped and t >= warm_s:
            # The arrival drawn at the old rate would hold the step back by up to a gap of the old rate
            # (at 12/s, 0.2 s of 523/s lost): the arrivals are memoryless, so draw the next one again.
            stepped = True
            if next_arrival > warm_s:
                next_arrival = warm_s + rng.expovariate(now_rate)
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


@dataclass
class TraceRun:
    """One seed of a trace: each request's (arrival s, latency ms), the changes (s, from, to, kind, reason)."""

    setup: str
    seed: int
    requests: list[tuple[float, float]] = field(default_factory=list)
    changes: list[tuple[float, int, int, str, str]] = field(default_factory=list)

    def mean_ms(self, since: float = 0.0, until: float = float("inf")) -> float | None:
        picked = [ms for at, ms in self.requests if since <= at < until]
        return statistics.fmean(picked) if picked else None


def true_servers(plans: PlannedCapacity, batch: int, host: dict[int, float] | None) -> list[Server]:
    """B's instances as the host serves them: the profile's latency times ``host[threads]`` (the host's time
    over the profile's by instance thread count, as ``bench_adaptive --rate-scale auto`` measures it)."""
    seen = plans.ratios, plans.thread_ratios
    if host:  # the plans with the host's own ratios, whatever the policy has measured of them
        plans.ratios, plans.thread_ratios = {}, {node: dict(host) for node in plans.budgets}
    try:
        servers = plans.servers(batch)
    finally:
        plans.ratios, plans.thread_ratios = seen
    if servers is None:
        raise ValueError(f"no plan for B={batch}")
    return servers


def simulate_trace(phases: list[Any], *, plans: PlannedCapacity, setup: str, seed: int = 0,
                   timeout_ms: float = 50.0, switch_s: float = 1.5, keep: float = 0.5,
                   payback: bool = True, host: dict[int, float] | None = None,
                   by_threads: bool = True, drain: bool = False, by_hold: bool = True,
                   motion: tuple[float, float] | None = None) -> TraceRun:
    """One trace (``bench_adaptive``'s phases) served by ``setup``: ``adaptive`` (B from 1, the policy
    deciding, ``payback`` on or off) or ``static-B``; each request's latency kept.

    An active-passive change (new thread counts, :meth:`PlannedCapacity.needs_processes`) takes
    ``switch_s``: the old instances serve on throughout, each sub-batch ``1 / keep`` times as long,
    and the new ones take over at its end (the policy then reads ``switch_s`` as the sampler reads the
    history). A reshare takes effect at the next batch. What instances hold when replaced is answered
    as they finish it.

    ``drain``: a switch lasts ``switch_s`` (the new instances' warm-up) plus what the old instances hold
    when it is decided, served at ``keep`` of their speed, as on the Zen 4 host, where a switch from
    B=32 (two 1-thread instances, 1.9 s a sub-batch) over-subscribed the cores 0.2-6.6 s and the move
    up from idle 0.1-0.3 s (docs/figures.md). ``by_hold``: the policy prices the next switch by what
    the B it leaves holds as well (``Policy.switch_cost_s`` with ``PlannedCapacity.drain_s``); without
    it, by the last switch's seconds alone, as before 12-06.

    ``motion`` (factor, mean dwell in s): the host moves between two speeds, every sub-batch taking 1x
    or ``factor`` x its time, each state lasting an exponential time of that mean (the Zen 4 host's
    minutes: about 52 or 67 ms for the same 2-thread b=1 call, from seconds to minutes;
    docs/figures.md, "Why B=1 misses"). The policy learns it as the supervisors' drift check does:
    every ``DRIFT_S`` the serving thread count's ratio takes the mean factor of the last ``DRIFT_S``.

    ``host``: the instances serve at the profile's latency times ``host[threads]``, and the policy's plans
    are divided by the ratio of the thread count serving (as a supervisor measures it from the
    instances it has: on two cores, one thread count at a time); with ``by_threads`` each thread count
    seen keeps its own ratio after (the supervisor's ``thread_ratios``), without it the last one
    measured stands for every layout.
    """
    from dispatcher.estimation import EstimatorSettings

    rng = random.Random(seed)
    adaptive = setup == "adaptive"
    current = 1 if adaptive else int(setup.split("-")[1])
    policy, est = Policy(EstimatorSettings(switch_payback=payback)), Estimator()
    policy.latency = plans.latency
    policy.needs_processes = plans.needs_processes
    if by_hold:
        policy.drain_s = plans.drain_s

    seen: dict[int, float] = {}
    drift = 1.0  # the policy's measure of the host's motion (1 without it)

    def serving(batch: int) -> list[Server]:
        if host or motion:
            layout = plans.layout(batch) or {}
            threads = max((t for ts in layout.values() for t in ts), default=1)
            ratio = (host or {}).get(threads, 1.0) * drift
            plans.ratios = {"node": ratio}
            if by_threads:  # as the supervisor keeps each thread count's last measure
                seen[threads] = ratio
                plans.thread_ratios = {"node": dict(seen)}
        return true_servers(plans, batch, host)

    states: list[tuple[float, float]] = []  # (until, factor) of the host's motion
    if motion:
        moving, until, factor = random.Random(seed + 7919), 0.0, 1.0
        while until < 3600.0:
            until += moving.expovariate(1.0 / motion[1])
            states.append((until, factor))
            factor = motion[0] if factor == 1.0 else 1.0

    def speed(at: float) -> float:
        for until, factor in states:
            if at < until:
                return factor
        return 1.0

    servers = serving(current)
    run = TraceRun(setup, seed)
    ends = []
    total = 0.0
    for phase in phases:
        total += phase.seconds
        ends.append((total, phase))

    def rate_at(t: float) -> float:
        start = 0.0
        for end, phase in ends:
            if t < end:
                return phase.rate(t - start)
            start = end
        return ends[-1][1].rate_to

    holds: list[list[tuple[float, list[float]]]] = [[] for _ in servers]
    retired: list[tuple[float, list[float]]] = []
    waiting: deque[float] = deque()
    pending: tuple[float, int] | None = None  # an active-passive change: (when it takes over, to B)
    switched = 0.0  # when the last one was decided
    slow = 1.0
    t, step, arrived, answered = 0.0, 0, 0, 0
    next_arrival = rng.expovariate(rate_at(0.0))
    while t < total or waiting or any(holds) or retired:
        step += 1
        t = step * STEP_S
        while next_arrival <= t and next_arrival < total:
            waiting.append(next_arrival)
            arrived += 1
            next_arrival += rng.expovariate(max(rate_at(next_arrival), 0.1))

        def finish(entries: list[tuple[float, list[float]]]) -> int:
            n = 0
            while entries and entries[0][0] <= t:
                done, arrivals = entries.pop(0)
                run.requests.extend((a, (done - a) * 1000.0) for a in arrivals)
                n += len(arrivals)
            return n

        for held in holds:
            answered += finish(held)
        retired.sort()
        answered += finish(retired)
        if pending is not None and t >= pending[0]:
            for held in holds:
                retired.extend(held)
            current, pending, slow = pending[1], None, 1.0
            servers = serving(current)
            holds = [[] for _ in servers]
            policy.switch_s = t - switched
        idle = [j for j, held in enumerate(holds) if not held]
        serve = idle or [j for j, held in enumerate(holds) if len(held) <= 1]
        if serve and waiting:
            size = sum(servers[j].share for j in serve)
            if len(waiting) >= size or (t - waiting[0]) * 1000.0 >= timeout_ms:
                take = min(size, len(waiting))
                batch = [waiting.popleft() for _ in range(take)]
                oldest = batch[0]
                at = 0
                for j, k in zip(serve, spread(take, [servers[j] for j in serve])):
                    if k:
                        held = holds[j]
                        begin = max(t, held[-1][0] if held else t)
                        took = slow * speed(begin) * servers[j].latency_ms(k) / 1000.0
                        held.append((begin + took, batch[at:at + k]))
                        at += k
                policy.record_batch(t, take, take < size, (t - oldest) * 1000.0)
        if motion and adaptive and step % round(DRIFT_S / STEP_S) == 0:
            drift = statistics.fmean(speed(t - DRIFT_S * i / 100) for i in range(100))
            serving(current)  # the plans' ratios only: the instances serving are those held
        if not adaptive or step % round(SAMPLE_S / STEP_S) or t >= total:
            continue
        length = arrived - answered
        policy.record_length(t, length, answered)
        est.observe(length, current)
        if pending is not None:
            continue  # one change at a time, as the dispatcher keeps one request outstanding
        predicted = max(s.latency_ms(s.share) for s in servers)
        decision = policy.decide(t, current, est.b_tilde, est.q_tilde, predicted_ms=predicted, capacity=plans)
        if decision is None:
            continue
        kind = "active-passive" if plans.needs_processes(current, decision.batch) else "reshare"
        run.changes.append((round(t, 2), current, decision.batch, kind, decision.reason))
        policy.changed(t, current, decision.batch)
        if kind == "reshare":
            current = decision.batch
            servers = serving(current)
            for j, held in enumerate(holds):  # kept instances keep what they hold
                if j >= len(servers):
                    retired.extend(held)
            holds = [holds[j] if j < len(holds) else [] for j in range(len(servers))]
        else:
            took = switch_s
            if drain:
                last = max((held[-1][0] for held in holds if held), default=t)
                took += max(0.0, last - t) / keep
            pending, slow, switched = (t + took, decision.batch), 1.0 / keep, t
    return run


def trace_main(args: argparse.Namespace) -> int:
    """``--trace``: the adaptive benchmark's trace, simulated over many seeds, adaptive (payback on and off)
    against static B."""
    from benchmarks.bench_adaptive import capacities, trace

    host = ({int(k): float(v) for k, v in (item.split("=") for item in args.host.split(","))}
            if args.host else None)
    caps = capacities(args.model, args.cores, args.profile, args.graph, 1.0, host)
    phases, notes = trace(caps, args.unit)
    plans = PlannedCapacity(args.model, args.profile, args.graph, timeout_ms=50.0)
    plans.budgets = {"node": args.cores}
    setups = [s.strip() for s in args.setups.split(",")]
    print(f"capacities {', '.join(f'B={b} {c:.1f}/s' for b, c in caps.items())}; "
          f"switch {args.switch_s} s at {args.keep:.0%} of the capacity")
    bounds, start = [], 0.0
    for phase in phases:
        bounds.append((phase.name, start, start + phase.seconds))
        start += phase.seconds
    results: dict[str, Any] = {"args": vars(args), "capacities": caps, "notes": notes, "setups": {}}
    for setup in setups:
        name, *flags = setup.split("+")
        unknown = set(flags) - {"nopayback", "oneratio", "lastswitch"}
        if unknown:
            raise SystemExit(f"unknown setup flags {sorted(unknown)} (nopayback, oneratio, lastswitch)")
        plans.thread_ratios, plans.ratios = {}, {}
        runs = [simulate_trace(phases, plans=plans, setup=name, seed=seed, switch_s=args.switch_s, keep=args.keep,
                               payback="nopayback" not in flags, host=host, by_threads="oneratio" not in flags,
                               drain=args.drain, by_hold="lastswitch" not in flags,
                               motion=tuple(float(x) for x in args.motion.split(",")) if args.motion else None)
                for seed in range(args.seeds)]
        means = [r.mean_ms() or 0.0 for r in runs]
        per_phase = {ph: statistics.median([r.mean_ms(a, b) or 0.0 for r in runs]) for ph, a, b in bounds}
        changes = [len(r.changes) for r in runs]
        ap = [sum(1 for c in r.changes if c[3] == "active-passive") for r in runs]
        results["setups"][setup] = {"means_ms": means, "phase_median_ms": per_phase, "changes": changes,
                                    "active_passive": ap, "runs": [r.changes for r in runs]}
        print(f"{setup:20s} mean {statistics.median(means):7.0f} ms (seeds {min(means):.0f}-{max(means):.0f}); "
              f"changes {statistics.median(changes):.0f} ({statistics.median(ap):.0f} active-passive); "
              + ", ".join(f"{ph.split(' ')[0]} {ms:.0f}" for ph, ms in per_phase.items()))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(results, indent=1))
        print(f"written to {args.json_out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=None, help="arrivals per second (required without --trace)")
    ap.add_argument("--trace", action="store_true",
                    help="the adaptive benchmark's trace instead of one rate, with switch costs (--setups)")
    ap.add_argument("--setups", default="adaptive,adaptive+nopayback+oneratio,static-32",
                    help="with --trace: adaptive or static-B; adaptive+nopayback: the payback rule off; "
                         "+oneratio: one served/profiled ratio for every thread count (as before 12-05); "
                         "+lastswitch: a switch priced by the last one's seconds (as before 12-06)")
    ap.add_argument("--unit", type=float, default=5.0, help="with --trace: one diurnal step (s)")
    ap.add_argument("--graph", default="eager", help="the profile's mode (eager, torchscript, ...)")
    ap.add_argument("--switch-s", type=float, default=1.5, help="with --trace: an active-passive switch's length "
                                                                   "(with --drain: its warm-up)")
    ap.add_argument("--motion", default=None,
                    help="with --trace: FACTOR,DWELL: the host moves between 1x and FACTOR x the time, each "
                         "speed lasting DWELL s on average, e.g. 1.25,20")
    ap.add_argument("--drain", action="store_true",
                    help="with --trace: a switch also lasts until the old instances have served what they held "
                         "when it was decided, at --keep of their speed")
    ap.add_argument("--host", default=None,
                    help="with --trace: the host's time over the profile's by thread count, e.g. 2=0.855,1=0.72 "
                         "(what bench_adaptive --rate-scale auto measured)")
    ap.add_argument("--keep", type=float, default=0.5,
                    help="with --trace: the share of capacity the old instances keep during a switch")
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
    if args.trace:
        return trace_main(args)
    if args.rate is None:
        ap.error("--rate is required without --trace")
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
