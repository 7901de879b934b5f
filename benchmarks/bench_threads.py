"""OpenMP wait policy A/B: one instance's latency under each thread environment.

Each variant runs in a fresh child started as an instance is (thread
variables in its environment, ``workers.runtime.start``), TorchScript
ResNet-50 at ``--threads`` threads, timing ``handler.handle`` at B=1 and B=8.
Variants are interleaved round by round, so drift of a shared machine hits
them alike; the table gives the median of the per-round medians (min–max).

Run: ``python -m benchmarks.bench_threads [--rounds 3] [--iters 30]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from workers.launch import instance_env

RESULTS = Path(__file__).resolve().parent / "results"

#: Environment additions per variant (on top of the instance environment, with its policy removed).
VARIANTS: dict[str, dict[str, str]] = {
    "library default": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "OMP_WAIT_POLICY=ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
}

CHILD = """
import json, sys, time, statistics
from workers import runtime
threads, batches, iters, model = json.loads(sys.argv[1])
out = {}
for b in batches:
    spec = runtime.RuntimeSpec(model=model, handler=model, instance_id="bench", threads=threads, batch=b,
                               cpus=sorted(__import__("os").sched_getaffinity(0))[:threads], graph_mode="torchscript")
    h = runtime.start(spec)
    items = h.example_batch(b)
    for _ in range(5):
        h.handle(items)
    t = []
    for _ in range(iters):
        s = time.perf_counter(); h.handle(items); t.append((time.perf_counter() - s) * 1000)
    out[str(b)] = statistics.median(t)
print(json.dumps(out))
"""


def run_variant(extra: dict[str, str], threads: int, batches: list[int], iters: int, model: str) -> dict[str, float]:
    env = instance_env(threads)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        env.pop(name, None)
    env.update(extra)
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps([threads, batches, iters, model])],
                         env=env, capture_output=True, text=True, check=True, timeout=900)
    return {k: float(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=min(2, len(os.sched_getaffinity(0))))
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--json-out", default=str(RESULTS / "threads.json"))
    args = ap.parse_args(argv)
    batches = [1, 8]
    raw: dict[str, dict[str, list[float]]] = {v: {str(b): [] for b in batches} for v in VARIANTS}
    for k in range(args.rounds):
        for name, extra in VARIANTS.items():
            res = run_variant(extra, args.threads, batches, args.iters, args.model)
            for b, ms in res.items():
                raw[name][b].append(ms)
            print(f"round {k + 1}: {name:<26} " + "  ".join(f"B={b} {ms:7.1f} ms" for b, ms in res.items()),
                  file=sys.stderr, flush=True)
    summary = {name: {b: {"median": statistics.median(v), "min": min(v), "max": max(v)} for b, v in per.items()}
               for name, per in raw.items()}
    result = {"benchmark": f"OpenMP wait policy, {args.model} TorchScript, {args.threads} threads",
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": args.rounds, "iters": args.iters,
              "summary_ms": summary, "raw_ms": raw}
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(result, indent=2))
    print("| variant | " + " | ".join(f"B={b} ms" for b in batches) + " |")
    for name, per in summary.items():
        print(f"| {name} | " + " | ".join(f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f})" for s in per.values()) + " |")
    print(f"written to {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
