"""``make bench``: every benchmark, one after the other (they must not share the cores).

Results land in ``benchmarks/results/`` (JSON, plus PNG plots where they help),
or in ``--out DIR``. ``--quick`` runs shorter versions for a smoke check; give
it another ``--out`` so the full results are not overwritten.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import bench_configs, bench_decode, bench_lone, bench_optimizer, bench_overhead, bench_payload

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    print("== optimizer", flush=True)
    bench_optimizer.main(["--json-out", str(out / "optimizer.json")] + (["--repeats", "5"] if args.quick else []))
    print("\n== serving overhead (echo)", flush=True)
    bench_overhead.main(["--json-out", str(out / "overhead.json")]
                        + (["--runs", "1", "--quick"] if args.quick else ["--runs", "3"]))
    print("\n== 600 KB payloads at B=8: through Redis, in shared memory, and the small-request floor", flush=True)
    bench_payload.main(["--json-out", str(out / "payload.json"), "--modes", "redis,shm,small"]
                       + (["--runs", "1", "--rounds", "20"] if args.quick else ["--runs", "3", "--rounds", "60"]))
    print("\n== lone 600 KB requests to ResNet-50: through Redis and in shared memory", flush=True)
    bench_lone.main(["--json-out", str(out / "lone.json")] + (["--requests", "5"] if args.quick else []))
    print("\n== decoding images (Pillow vs torchvision, per image)", flush=True)
    bench_decode.main(["--json-out", str(out / "decode.json")]
                      + (["--runs", "1", "--rounds", "2", "--iters", "10"] if args.quick else ["--serve"]))
    print("\n== configurations (chosen vs all-thread vs single-thread)", flush=True)
    bench_configs.main(["--json-out", str(out / "configs.json")]
                       + (["--models", "minilm", "--batches", "1,8", "--rounds", "3"] if args.quick else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
