"""How well the policy's estimate of a switch's length predicted each switch of finished adaptive runs.

An active-passive switch over-subscribes the cores until the old instances
have served what they hold, and a move down waits for what its switch is
expected to cost (``Policy.switch_cost_s``). This reads the reconfiguration
histories of ``bench_adaptive`` results and, for every move down that
followed another switch in the same run, compares its own over-subscribed
seconds with what each estimate would have said just before it:

- ``last``: the last switch's seconds (the policy before 12-06);
- ``drain``: what the B being left holds under load (``PlannedCapacity.drain_s``,
  with the run's host ratios by thread count);
- ``now``: the longer of the two (the policy since 12-06).

Run: ``python -m benchmarks.switch_costs benchmarks/results/adaptive-zen4-120[56]*.json [--json]``
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from dispatcher.adaptive import PlannedCapacity
from optimizer.planning.profile import Profile

ESTIMATES = ("last", "drain", "now")


def estimates(result: dict[str, Any], root: Path = Path(".")) -> list[dict[str, Any]]:
    """Per move down that followed another active-passive switch in its run: its length and each estimate."""
    profile = result.get("profile")
    if not profile or result.get("simulate_cores"):
        return []
    path = Path(profile)
    if not path.exists():  # a result written on another checkout: the same profile under this one
        parts = path.parts
        path = root / Path(*parts[parts.index("profiles"):]) if "profiles" in parts else path
    plans = PlannedCapacity(result["model"], str(path), Profile.load(path).mode, timeout_ms=50.0)
    plans.budgets = {"node": int(result.get("threads") or 1)}
    plans.thread_ratios = {"node": {int(t): float(r) for t, r in (result.get("host_over_profile") or {}).items()}}
    rows = []
    for setup in result.get("setups", {}).values():
        last: float | None = None
        first = True
        for change in setup.get("reconfigurations", []):
            if change.get("kind") != "active-passive":
                continue
            # The history's B on the node (one node here: the model's B).
            left, to = change.get("from_batch"), change.get("to_batch")
            took = float(change.get("oversubscribed_s") or 0.0)
            if not isinstance(left, int) or not isinstance(to, int):
                continue
            if last is not None and to < left and took > 0:
                drain = plans.drain_s(left) or 0.0
                rows.append({"from": left, "to": to, "took_s": took, "first": first,
                             "last": last, "drain": drain, "now": max(last, drain)})
                first = False
            last = took
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per estimate: the median of estimate / real, the median error as a factor, and both for each run's first."""
    out = {}
    for name in ESTIMATES:
        logs = [math.log(r[name] / r["took_s"]) for r in rows if r[name] > 0]
        firsts = [math.log(r[name] / r["took_s"]) for r in rows if r[name] > 0 and r["first"]]
        if not logs:
            continue
        out[name] = {"switches": len(logs), "median_ratio": math.exp(statistics.median(logs)),
                     "median_error_factor": math.exp(statistics.median(abs(x) for x in logs)),
                     "first_moves": len(firsts),
                     "first_median_ratio": math.exp(statistics.median(firsts)) if firsts else math.nan}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="bench_adaptive result JSON files")
    ap.add_argument("--json", action="store_true", help="print the rows and the summary as JSON")
    args = ap.parse_args(argv)
    rows = []
    for name in args.results:
        rows.extend(estimates(json.loads(Path(name).read_text())))
    table = summary(rows)
    if args.json:
        json.dump({"rows": rows, "summary": table}, sys.stdout, indent=1)
        print()
        return 0
    if not table:
        print("no move down followed another active-passive switch in these runs")
        return 0
    print("| estimate | moves down | median estimate / real | median error (factor) | first of a run: median |")
    print("|---|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['switches']} | {row['median_ratio']:.2f}x | {row['median_error_factor']:.1f} | "
              f"{row['first_median_ratio']:.2f}x ({row['first_moves']}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
