"""Serving overhead of packrat-mq with the ``echo`` model.

Overhead = client-measured end-to-end latency minus the handler's own time
(``inference_ms`` in the reply): everything packrat-mq adds (Redis hops,
aggregation, encoding, the reply). Three measurements, each repeated and
reported as the median over runs with min and max:

- low load: one request at a time, B=1 (what the estimator chooses when the
  backlog is empty), and B=8 with a 2 ms batch timeout to show what
  aggregation costs a lone request;
- saturation: a closed loop keeping 512 requests outstanding, B=256;
- throughput: 100,000 requests queued, then drained through one dispatcher.

Run: ``python -m benchmarks.bench_overhead [--runs 3] [--quick]``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("PACKRAT_LOG_LEVEL", "WARNING")

from packrat_mq import protocol  # noqa: E402
from packrat_mq.client import Client  # noqa: E402
from packrat_mq.connection import EmbeddedRedis, connect  # noqa: E402
from packrat_mq.instances import Configuration  # noqa: E402
from dispatcher.spec import DispatcherSpec  # noqa: E402
from packrat_mq.settings import Settings  # noqa: E402
from workers.launch import spawn  # noqa: E402
from workers.supervisor import Supervisor  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": float(np.median(values)), "min": float(np.min(values)), "max": float(np.max(values))}


def low_load(url: str, config: str, timeout_ms: float, n: int) -> dict[str, float]:
    r = connect(url)
    r.flushdb()
    settings = Settings(redis_url=url, batch_timeout_ms=timeout_ms)
    with Supervisor(r, settings, url, "echo", Configuration.parse(config)):
        client = Client(connect(url))
        for _ in range(50):  # warm-up
            client.submit("echo", b"{}", content_type=protocol.JSON)
        over = []
        for _ in range(n):
            rep = client.submit("echo", b'{"x": 1}', content_type=protocol.JSON)
            over.append((rep.latency_ms or 0.0) - rep.inference_ms)
        client.close()
    return {"p50_ms": float(np.percentile(over, 50)), "p99_ms": float(np.percentile(over, 99))}


def saturation(url: str, window: int, total: int) -> dict[str, float]:
    r = connect(url)
    r.flushdb()
    settings = Settings(redis_url=url, batch_timeout_ms=2.0)
    with Supervisor(r, settings, url, "echo", Configuration.parse("1x128,1x128")):
        client = Client(connect(url))
        half = window // 2
        inflight = [client.send_many("echo", [b"{}"] * half, content_type=protocol.JSON) for _ in range(2)]
        over: list[float] = []
        sent = window
        start = time.perf_counter()
        done = 0
        while inflight:
            ids = inflight.pop(0)
            reps = client.gather(ids, timeout=60)
            done += len(reps)
            over.extend((x.latency_ms or 0.0) - x.inference_ms for x in reps)
            if sent < total:
                inflight.append(client.send_many("echo", [b"{}"] * half, content_type=protocol.JSON))
                sent += half
        elapsed = time.perf_counter() - start
        client.close()
    return {"p50_ms": float(np.percentile(over, 50)), "p99_ms": float(np.percentile(over, 99)),
            "requests_per_s": done / elapsed}


def throughput(url: str, n: int, config: str = "1x128,1x128") -> float:
    """Requests/s of one dispatcher draining ``n`` queued requests (first to last reply)."""
    r = connect(url)
    r.flushdb()
    settings = Settings(redis_url=url, batch_timeout_ms=2.0)
    pool = Supervisor(r, settings, url, "echo", Configuration.parse(config), with_dispatcher=False)
    pool.start(ready_timeout=60)
    reply_to = "bench:replies"
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(settings.keys.requests("echo"), protocol.request_fields(str(i), reply_to, b"{}", protocol.JSON))
        if i % 2000 == 1999:
            pipe.execute()
    pipe.execute()
    spec = DispatcherSpec(url=url, settings=settings, model="echo")
    proc = spawn("dispatcher", spec.model_dump_json())
    try:
        while r.xlen(reply_to) == 0:
            time.sleep(0.0005)
        start = time.perf_counter()
        first = r.xlen(reply_to)
        while r.xlen(reply_to) < n:
            time.sleep(0.005)
        rate = (n - first) / (time.perf_counter() - start)
    finally:
        proc.terminate()
        proc.wait()
        pool.stop()
    return rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer requests per run")
    ap.add_argument("--json-out", default=str(RESULTS / "overhead.json"))
    args = ap.parse_args(argv)
    n_low = 300 if args.quick else 1500
    n_sat = 20_000 if args.quick else 60_000
    n_thr = 30_000 if args.quick else 100_000
    runs: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        runs.setdefault(name, []).append(value)

    with EmbeddedRedis(announce=False) as server:
        for k in range(args.runs):
            for label, config, timeout in (("low_load_B1", "1x1", 0.0), ("low_load_B8_2ms", "2*1x4", 2.0)):
                res = low_load(server.url, config, timeout, n_low)
                add(f"{label}.p50_ms", res["p50_ms"])
                add(f"{label}.p99_ms", res["p99_ms"])
            res = saturation(server.url, 512, n_sat)
            add("saturation_B256.p50_ms", res["p50_ms"])
            add("saturation_B256.p99_ms", res["p99_ms"])
            add("saturation_B256.requests_per_s", res["requests_per_s"])
            add("throughput_B256.requests_per_s", throughput(server.url, n_thr))
            print(f"run {k + 1}/{args.runs} done", file=sys.stderr)
    result: dict[str, Any] = {
        "benchmark": "overhead (echo model)",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "runs": args.runs,
        "requests_per_run": {"low_load": n_low, "saturation": n_sat, "throughput": n_thr},
        "figures": {name: _summary(values) for name, values in runs.items()},
        "raw": runs,
    }
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(result, indent=2))
    print(f"{'figure':<36} {'median':>10} {'min':>10} {'max':>10}")
    for name, s in result["figures"].items():
        print(f"{name:<36} {s['median']:>10.3f} {s['min']:>10.3f} {s['max']:>10.3f}")
    print(f"written to {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
