"""``make bench``: every benchmark, one after the other (they must not share the cores).

Results land in ``benchmarks/results/`` (JSON, plus PNG plots where they help).
``--quick`` runs shorter versions for a smoke check.
"""
from __future__ import annotations

import argparse
import sys

from benchmarks import bench_configs, bench_optimizer, bench_overhead


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    print("== optimizer", flush=True)
    bench_optimizer.main(["--repeats", "5"] if args.quick else [])
    print("\n== serving overhead (echo)", flush=True)
    bench_overhead.main(["--runs", "1", "--quick"] if args.quick else ["--runs", "3"])
    print("\n== configurations (chosen vs all-thread vs single-thread)", flush=True)
    bench_configs.main(["--models", "minilm", "--batches", "1,8", "--rounds", "3"] if args.quick else [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
