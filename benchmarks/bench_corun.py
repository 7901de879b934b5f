"""Two sets of instances on the same cores: each alone, then side by side (the over-subscribed switch).

During an active-passive change on a machine without free cores, the new
instances run on the cores of the ones they replace. This times TorchScript
ResNet-50 processes pinned as instances are (the thread environment a
worker gets, :func:`workers.launch.instance_env`), each running its batch
back to back:

- ``old``: one ``T``-thread instance at ``--old-batch`` on cores 0..T-1, alone;
- ``new``: ``T`` 1-thread instances at ``--new-batch``, one per core, alone;
- ``together``: both sets at once, as the switch runs them;
- ``together-passive``: the same with ``OMP_WAIT_POLICY=PASSIVE`` in every process.

It reports each process's median batch time and the images per second of
each set, so that "together" can be held against time-sharing the cores
(either set alone). ``--reps`` repeats the four, interleaved.

Run: ``python -m benchmarks.bench_corun [--reps 2] [--seconds 8]``; writes
``benchmarks/results/corun.json`` (or ``--name``).
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
from typing import Any

from packrat_mq.settings import Settings
from workers.launch import instance_env

RESULTS = Path(__file__).resolve().parent / "results"


def child(threads: int, batch: int, seconds: float, cpus: list[int]) -> None:
    """One instance: load, warm up, say ready, wait for go, run back to back for ``seconds``, print times."""
    os.sched_setaffinity(0, cpus)
    import torch
    import torchvision

    torch.set_num_threads(threads)
    x = torch.randn(batch, 3, 224, 224)
    with torch.no_grad():
        model = torch.jit.freeze(torch.jit.trace(torchvision.models.resnet50(weights=None).eval(), x[:1]))
        for _ in range(3):
            model(x)
        print("ready", flush=True)
        sys.stdin.readline()
        times = []
        end = time.time() + seconds
        while time.time() < end:
            t0 = time.perf_counter()
            model(x)
            times.append((time.perf_counter() - t0) * 1000.0)
    print(json.dumps(times), flush=True)


def run_together(specs: list[tuple[str, int, int, list[int]]], seconds: float,
                 extra_env: dict[str, str]) -> list[dict[str, Any]]:
    """Start every (role, threads, batch, cpus) process, start them at once, collect their batch times."""
    procs = []
    for role, threads, batch, cpus in specs:
        env = dict(instance_env(threads, Settings()), **extra_env)
        cmd = [sys.executable, "-m", "benchmarks.bench_corun", "--child", f"{threads},{batch},{seconds},"
               + ":".join(map(str, cpus))]
        procs.append((role, threads, batch, cpus,
                      subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)))
    for *_, p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    for *_, p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    out = []
    for role, threads, batch, cpus, p in procs:
        assert p.stdout is not None
        times = json.loads(p.stdout.readline())
        p.wait()
        kept = times[1:] if len(times) > 1 else times  # the first after the go meets the others' start
        median = statistics.median(kept)
        out.append({"role": role, "threads": threads, "batch": batch, "cpus": cpus, "batches": len(times),
                    "median_ms": round(median, 1), "images_per_s": round(batch / (median / 1000.0), 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="T: the old instance's threads and the new ones' count")
    ap.add_argument("--old-batch", type=int, default=8)
    ap.add_argument("--new-batch", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--name", default="corun")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        t, b, s, cpus = args.child.split(",")
        child(int(t), int(b), float(s), [int(c) for c in cpus.split(":")])
        return 0
    t = args.threads
    old = [("old", t, args.old_batch, list(range(t)))]
    new = [("new", 1, args.new_batch, [c]) for c in range(t)]
    setups = {"old": (old, {}), "new": (new, {}), "together": (old + new, {}),
              "together-passive": (old + new, {"OMP_WAIT_POLICY": "PASSIVE"})}
    runs = []
    for rep in range(args.reps):
        for name, (specs, env) in setups.items():
            procs = run_together(specs, args.seconds, env)
            by_role: dict[str, float] = {}
            for p in procs:
                by_role[p["role"]] = by_role.get(p["role"], 0.0) + p["images_per_s"]
            runs.append({"rep": rep, "setup": name, "processes": procs, "images_per_s": by_role,
                         "total_images_per_s": round(sum(by_role.values()), 2)})
            print(f"rep {rep + 1} {name:<17} " + ", ".join(
                f"{p['role']} {p['threads']}x{p['batch']} {p['median_ms']:.0f} ms" for p in procs)
                + f"; images/s {runs[-1]['total_images_per_s']:.1f}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.name}.json"
    out.write_text(json.dumps({"benchmark": "corun", "threads": t, "old_batch": args.old_batch,
                               "new_batch": args.new_batch, "seconds": args.seconds,
                               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": runs}, indent=1))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
