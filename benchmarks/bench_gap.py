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

``--served MODEL`` asks the same of the service, in one worker process: one
2-thread instance at B=1 (TorchScript), served in alternating phases of
``--phase-s`` seconds one request at a time (``lone``: a pause between
batches, with the client, Redis and the dispatcher running in it) and by
three closed-loop clients (``busy``: batches back to back, as the profiler
runs them), comparing the replies' ``inference_ms``. One process, so a
difference between modes is the modes', not two processes' speeds.
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


def served(model: str, phase_s: float, rounds: int) -> dict[str, list[float]]:
    """``inference_ms`` of one served 2-thread B=1 instance, by mode, in alternating phases (see the module)."""
    import os
    import threading

    os.environ.setdefault("PACKRAT_LOG_LEVEL", "WARNING")
    from optimizer.calibration import example_payloads
    from packrat_mq.client import Client
    from packrat_mq.connection import EmbeddedRedis, connect
    from packrat_mq.instances import Configuration
    from packrat_mq.settings import Settings
    from workers.supervisor import Supervisor

    times: dict[str, list[float]] = {"lone": [], "busy": []}
    with EmbeddedRedis(announce=False) as server:
        url = server.url
        settings = Settings(redis_url=url, batch_timeout_ms=0.0, prefix="bench-gap", graph_mode="torchscript")
        with Supervisor(connect(url), settings, url, model, Configuration.uniform(1, 2, 1)):
            payload, ctype = example_payloads(model, 1)[0]

            def run(clients: int, seconds: float) -> list[float]:
                out: list[float] = []
                stop = time.time() + seconds

                def one() -> None:
                    client = Client(connect(url), prefix=settings.prefix)
                    while time.time() < stop:
                        _, replies = client.time_batch(model, [payload], content_type=ctype, timeout=60)
                        out.append(replies[0].inference_ms)
                    client.close()

                threads = [threading.Thread(target=one) for _ in range(clients)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                return out[2:]  # the first after a mode change meet the other mode's last

            run(1, 3.0)  # warm
            for k in range(rounds):
                for mode, clients in (("lone", 1), ("busy", 3)):
                    got = run(clients, phase_s)
                    times[mode].append(statistics.median(got))
                    print(f"round {k + 1} {mode}: {len(got)} batches, inference_ms p50 {times[mode][-1]:.1f}",
                          flush=True)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--served", default=None, metavar="MODEL", help="time one served instance instead (see above)")
    ap.add_argument("--phase-s", type=float, default=10.0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gap.json"))
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one_process(args.threads, args.rounds)))
        return 0
    if args.served:
        medians = served(args.served, args.phase_s, args.rounds)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"served": args.served, "phase_s": args.phase_s,
                                              "phase_medians_ms": medians,
                                              "at": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
        print(f"written to {args.out}")
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
