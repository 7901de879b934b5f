"""Speed of the optimizer (``optimizer.planning.solving.solve``) on synthetic, realistic profiles.

Profiles follow ``L[t, b] = (overhead + work * b^0.92) * ((1 - p_b) + p_b / t)
* (1 + contention * (t - 1)) * noise``: Amdahl-like speed-up whose parallel
fraction ``p_b`` grows with the batch, a little slowdown from contention as
threads are added, and 3 % log-normal noise (seeded), with ``t`` in 1..T and
``b`` in powers of two up to B. Per case it reports, as median with min and
max over repeats:

- cold solve: solution cache cleared, profile table already built;
- table build: ``Profile.table()`` from fresh entries (the one-off cost a
  newly loaded profile adds);
- cached lookup: a repeated ``solve`` with the same profile, T and B;
- the memoised textbook recursion (``solve_reference``, kept in
  ``tests/reference_solver.py``) on the same problem, where it finishes in
  reasonable time, and the speed-up over it measured in the same run. At
  T=128, B=8192 it takes minutes, so a smaller case (T=32, B=256) stands in
  unless ``--large-reference`` is given.

Targets: cold solve <= 20 ms at T=16, B=1024 and <= 5 s at T=128, B=8192;
cached lookups in microseconds.

Run: ``python -m benchmarks.bench_optimizer [--json-out benchmarks/results/optimizer.json]``.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.planning.profile import MachineInfo, Profile, ProfileEntry
from optimizer.planning.solving import clear_cache, solve
from packrat_mq.instances import Configuration
from tests.reference_solver import solve_reference

RESULTS = Path(__file__).resolve().parent / "results"

#: (name, T, B, run the reference, cold-solve target in ms or None)
CASES = [
    ("T16_B1024", 16, 1024, True, 20.0),
    ("T32_B256", 32, 256, True, None),
    ("T128_B8192", 128, 8192, False, 5000.0),
]


def synthetic_profile(threads: int, max_batch: int, seed: int) -> Profile:
    """A profile shaped like a CNN on a many-core CPU (see the module docstring)."""
    rng = np.random.default_rng(seed)
    t = np.arange(1, threads + 1, dtype=np.float64)[:, None]
    b = 2.0 ** np.arange(int(np.log2(max_batch)) + 1)[None, :]
    parallel = 0.75 + 0.23 * b / (b + 16.0)
    lat = (2.0 + 25.0 * b**0.92) * ((1 - parallel) + parallel / t) * (1 + 0.004 * (t - 1))
    lat *= rng.lognormal(0.0, 0.03, lat.shape)
    entries = [
        ProfileEntry(threads=int(t[i, 0]), batch=int(b[0, j]), mean_ms=float(lat[i, j]))
        for i in range(lat.shape[0])
        for j in range(lat.shape[1])
    ]
    return Profile(model=f"synthetic-T{threads}-B{max_batch}", entries=entries)


def _summary(values: list[float]) -> dict[str, float | int]:
    return {
        "median": float(np.median(values)),
        "min": float(np.min(values)),
        "max": float(np.max(values)),
        "repeats": len(values),
    }


def bench_case(name: str, T: int, B: int, reference: bool, target_ms: float | None,
               repeats: int, reference_repeats: int, seed: int) -> dict[str, Any]:
    prof = synthetic_profile(T, B, seed)
    build = []
    for _ in range(repeats):
        fresh = prof.model_copy(update={"entries": tuple(prof.entries)})  # new tuple: no cached table
        start = time.perf_counter()
        fresh.table()
        build.append((time.perf_counter() - start) * 1e3)

    solve(prof, T, B)  # warm imports and numpy
    cold = []
    for _ in range(repeats):
        clear_cache()
        start = time.perf_counter()
        config = solve(prof, T, B)
        cold.append((time.perf_counter() - start) * 1e3)

    cached = []
    for _ in range(2000):
        start = time.perf_counter_ns()
        solve(prof, T, B)
        cached.append((time.perf_counter_ns() - start) / 1e3)

    result: dict[str, Any] = {
        "name": name,
        "threads": T,
        "batch": B,
        "entries": len(prof.entries),
        "batch_sizes": prof.batch_sizes,
        "configuration": str(config),
        "instances": config.grouped(),
        "predicted_latency_ms": config.predicted_latency_ms,
        "cold_solve_ms": _summary(cold),
        "table_build_ms": _summary(build),
        "cached_lookup_us": _summary(cached),
        "target_cold_ms": target_ms,
        "meets_target": None if target_ms is None else bool(np.median(cold) <= target_ms),
    }
    if reference:
        ref_s = []
        for _ in range(reference_repeats):
            start = time.perf_counter()
            ref = solve_reference(prof, T, B)
            ref_s.append(time.perf_counter() - start)
        if ref.predicted_latency_ms != config.predicted_latency_ms:
            raise SystemExit(
                f"{name}: reference found {ref.predicted_latency_ms} ms, solve {config.predicted_latency_ms} ms"
            )
        result["reference_s"] = _summary(ref_s)
        result["speedup_vs_reference"] = float(np.median(ref_s) * 1e3 / np.median(cold))
    return result


def _row(case: dict[str, Any]) -> str:
    cold, build, cached = case["cold_solve_ms"], case["table_build_ms"], case["cached_lookup_us"]
    ref = case.get("reference_s")
    ref_text = (
        f"{ref['median']:8.2f} s  x{case['speedup_vs_reference']:>9,.0f}" if ref else f"{'-':>10}  {'-':>10}"
    )
    target = case["target_cold_ms"]
    verdict = "" if target is None else ("  ok" if case["meets_target"] else "  MISSED") + f" (<= {target:g} ms)"
    return (
        f"{case['name']:<12} {cold['median']:8.2f} [{cold['min']:.2f}-{cold['max']:.2f}]"
        f" {build['median']:8.2f} {cached['median']:8.1f} [{cached['min']:.1f}-{cached['max']:.1f}]"
        f"  {ref_text}{verdict}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", type=Path, default=RESULTS / "optimizer.json")
    parser.add_argument("--repeats", type=int, default=11, help="cold solves per case")
    parser.add_argument("--reference-repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=20240601)
    parser.add_argument("--large-reference", action="store_true",
                        help="also time the reference once at T=128, B=8192 (about 5 minutes)")
    args = parser.parse_args(argv)

    cases = []
    for name, T, B, reference, target in CASES:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        large = args.large_reference and not reference
        cases.append(bench_case(name, T, B, reference or large, target, args.repeats,
                                1 if large else args.reference_repeats, args.seed))

    print(f"\n{'case':<12} {'cold solve ms':>24} {'table ms':>8} {'cached us':>22}  {'reference':>10}  {'speed-up':>10}")
    print(f"{'':<12} {'median [min-max]':>24} {'median':>8} {'median [min-max]':>22}")
    for case in cases:
        print(_row(case))
    for case in cases:
        compact = Configuration.parse(case["configuration"]).compact()
        print(f"  {case['name']}: {compact} -> {case['predicted_latency_ms']:.2f} ms")

    doc = {
        "benchmark": "optimizer (solve) on synthetic profiles",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {
            **MachineInfo.current().model_dump(exclude={"torch_version", "date"}),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "platform": platform.platform(),
        },
        "seed": args.seed,
        "cases": cases,
        "meets_targets": all(c["meets_target"] is not False for c in cases),
    }
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {args.json_out}", file=sys.stderr)
    return 0 if doc["meets_targets"] else 1


if __name__ == "__main__":
    sys.exit(main())
