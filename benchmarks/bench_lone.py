"""One request at a time, through Redis and in shared memory: what the path adds to a lone image.

One ``up``-style deployment of a real model (ResNet-50 in TorchScript by
default) with one instance of T threads at B=1 and no batch wait; two
clients, one sending its 602 KB ``.npy`` image in the request entry
(``redis``), one keeping it in a file in shared memory that the entry names
(``shm``, ``Client(shared_memory=True)``). They alternate request by
request (the order alternates too), with a pause between requests, so
both meet the same host. Reported per mode: the p50 (and p25-p75) of each
request's latency beyond its own ``inference_ms``, and of the latency.

Run: ``python -m benchmarks.bench_lone [--requests 40] [--model resnet50] [--threads 2]``.
Writes ``benchmarks/results/lone.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("PACKRAT_LOG_LEVEL", "WARNING")

from benchmarks.peers.load import npy_image  # noqa: E402
from packrat_mq import protocol  # noqa: E402
from packrat_mq.client import Client  # noqa: E402
from packrat_mq.connection import EmbeddedRedis, connect  # noqa: E402
from packrat_mq.instances import Configuration  # noqa: E402
from packrat_mq.settings import Settings  # noqa: E402
from workers.supervisor import Supervisor  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("redis", "shm")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40, help="timed requests per mode (after 6 of warm-up)")
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--graph", default="torchscript", help="the backend (eager for none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pause-s", type=float, default=0.2, help="between requests: each one meets an idle service")
    ap.add_argument("--json-out", default=str(RESULTS / "lone.json"))
    args = ap.parse_args(argv)
    shm_dir = tempfile.mkdtemp(prefix="packrat-lone-", dir="/dev/shm")
    payload = npy_image()
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    warmup = 6
    with EmbeddedRedis(announce=False) as server:
        url = server.url
        r = connect(url)
        r.flushdb()
        settings = Settings(redis_url=url, batch_timeout_ms=0.0, shm_dir=shm_dir, graph_mode=args.graph)
        with Supervisor(r, settings, url, args.model, Configuration.parse(f"{args.threads}x1")):
            clients = {"redis": Client(connect(url)),
                       "shm": Client(connect(url), shared_memory=True, shm_dir=shm_dir)}
            for k in range(warmup + args.requests):
                for mode in (MODES if k % 2 == 0 else MODES[::-1]):
                    rep = clients[mode].submit(args.model, payload, content_type=protocol.NPY, timeout=120)
                    if not rep.ok:
                        raise SystemExit(f"{mode}: {rep.error}")
                    if k >= warmup and rep.latency_ms is not None:
                        rows[mode].append({"beyond_inference_ms": rep.latency_ms - rep.inference_ms,
                                           "inference_ms": rep.inference_ms, "latency_ms": rep.latency_ms})
                    time.sleep(args.pause_s)
            for c in clients.values():
                c.close()
    shutil.rmtree(shm_dir, ignore_errors=True)
    figures = {}
    for mode, got in rows.items():
        beyond = [x["beyond_inference_ms"] for x in got]
        figures[mode] = {
            "beyond_inference_p50_ms": statistics.median(beyond),
            "beyond_inference_p25_ms": float(np.percentile(beyond, 25)),
            "beyond_inference_p75_ms": float(np.percentile(beyond, 75)),
            "inference_p50_ms": statistics.median(x["inference_ms"] for x in got),
            "latency_p50_ms": statistics.median(x["latency_ms"] for x in got),
            "requests": len(got),
        }
        f = figures[mode]
        print(f"{mode:<6} beyond inference_ms p50 {f['beyond_inference_p50_ms']:.2f} ms "
              f"(p25 {f['beyond_inference_p25_ms']:.2f}, p75 {f['beyond_inference_p75_ms']:.2f}), "
              f"inference p50 {f['inference_p50_ms']:.1f}, latency p50 {f['latency_p50_ms']:.1f}, n={f['requests']}")
    result = {"benchmark": "lone requests through Redis and in shared memory", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "model": args.model, "graph": args.graph, "threads": args.threads, "payload_bytes": len(payload),
              "figures": figures, "raw": rows}
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(result, indent=2))
    print(f"written to {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
