"""Does the pause between batches slow the next one? ResNet-50 (TorchScript), T threads, b=1, in process.

Issue 8: every B=1 prediction of 12-05 (one 2-thread instance) was short by
12-23%, the handler serving 12-31% slower than the profile's (t=2, b=1).
The profiler times batches back to back; served one request at a time, an
instance waits a few milliseconds for the next. Each process here times
four modes interleaved in rounds of five calls: back to back, after a 3 ms
and a 20 ms sleep, and after a 3 ms busy spin (a core kept awake). Several
processes, since a host's phase can last longer than one.

Run: ``python -m benchmarks.bench_gap [--processes 5] [--threads 2]``; writes
``benchmarks/results/gap.json`` (or ``--out``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("back-to-back", "sleep-3ms", "spin-3ms", "sleep-20ms")


def one_process(threads: int, rounds: int) -> dict[str, list[float]]:
    import torch
    import torchvision

    torch.set_num_threads(threads)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        model = torch.jit.freeze(torch.jit.trace(torchvision.models.resnet50(weights=None).eval(), x))
        for _ in range(10):
            model(x)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(rounds):
            for mode in MODES:
                for _ in range(5):
                    if mode == "sleep-3ms":
                        time.sleep(0.003)
                    elif mode == "sleep-20ms":
                        time.sleep(0.02)
                    elif mode == "spin-3ms":
                        end = time.perf_counter() + 0.003
                        while time.perf_counter() < end:
                            pass
                    start = time.perf_counter()
                    model(x)
                    times[mode].append((time.perf_counter() - start) * 1000.0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gap.json"))
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one_process(args.threads, args.rounds)))
        return 0
    runs = []
    for k in range(args.processes):
        out = subprocess.run([sys.executable, "-m", "benchmarks.bench_gap", "--child", "--threads", str(args.threads),
                              "--rounds", str(args.rounds)], capture_output=True, text=True, check=True).stdout
        times = json.loads(out.strip().splitlines()[-1])
        runs.append(times)
        print(f"process {k + 1}: " + ", ".join(f"{m} {statistics.median(times[m]):.1f}" for m in MODES)
              + f" ms (min {min(min(v) for v in times.values()):.1f})", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": args.threads, "modes": MODES, "runs": runs,
                                          "at": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
