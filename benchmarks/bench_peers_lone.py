"""A lone request, TorchServe against packrat-mq, alternating request by request on one host.

``bench_peers``'s idle probe runs each server in its own turn, 15 s each; on
a shared host the two turns meet different neighbours, and its idle ratio
moved between 0.84 and 1.25 from run to run (docs/figures.md). Here both
servers run at once, idle but for the one request in flight, and requests
alternate between them (the order alternates too: A B, B A, ...), so every
pair meets the same minute of the host:

- TorchServe, 1 worker x T threads, B=1 (``batch_size`` 1, no batch delay);
- ``packrat-mq up --graph torchscript --instances Tx1``, no batch wait.

Both serve the same TorchScript ResNet-50 the peers benchmark uses, to the
same 602 KB float32 ``.npy`` image. For packrat-mq the reply's own
``inference_ms`` (the handler: preprocess, model, postprocess) is kept too,
so the difference splits into the model's time and the path's.

Run: ``python -m benchmarks.bench_peers_lone [--requests 60] [--pause-s 0.05]`` (needs ``.venv-peers``:
``make .venv-peers/.installed-stamp``). Writes ``benchmarks/results/peers-lone.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PACKRAT_LOG_LEVEL", "WARNING")

from benchmarks.bench_peers import MODEL, machine_info  # noqa: E402
from benchmarks.peers.archive import build_store  # noqa: E402
from benchmarks.peers.load import REQUEST_TIMEOUT_S, npy_image, sender  # noqa: E402
from benchmarks.peers.servers import PackratUp, TorchServe  # noqa: E402
from packrat_mq import protocol  # noqa: E402
from packrat_mq.client import Client  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def quantiles(values: list[float]) -> dict[str, float]:
    """p25, p50 and p75 of ``values`` (ms)."""
    q = statistics.quantiles(values, n=4, method="inclusive")
    return {"p25_ms": q[0], "p50_ms": statistics.median(values), "p75_ms": q[2]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=60, help="timed requests per server (after --warmup each)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--pause-s", type=float, default=0.05,
                    help="between one request's reply and the next request (default %(default)s s)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--peers-venv", type=Path, default=ROOT / ".venv-peers")
    ap.add_argument("--json-out", type=Path, default=RESULTS / "peers-lone.json")
    args = ap.parse_args(argv)
    if not (args.peers_venv / "bin" / "torchserve").exists():
        print(f"no TorchServe in {args.peers_venv}: make .venv-peers/.installed-stamp", file=sys.stderr)
        return 2
    payload = npy_image()
    latencies: dict[str, list[float]] = {"torchserve": [], "packrat": []}
    inference: list[float] = []
    beyond: list[float] = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="peers-lone-") as tmp:
        workdir = Path(tmp)
        store = build_store(args.peers_venv, workdir / "build", model=MODEL, batch=1, wait_ms=0.0)
        with TorchServe(args.peers_venv, store, workdir / "torchserve", model=MODEL, threads=args.threads) as ts, \
                PackratUp(workdir / "packrat", model=MODEL, args=["--instances", f"{args.threads}x1"],
                          batch_timeout_ms=0.0) as up:
            send_ts, close_ts = sender(ts)
            client = Client(up.url, prefix=up.prefix)

            def one(kind: str, record: bool) -> None:
                t0 = time.perf_counter()
                if kind == "torchserve":
                    error = send_ts(payload)
                    if error:
                        raise RuntimeError(f"TorchServe: {error}")
                    ms = (time.perf_counter() - t0) * 1000.0
                else:
                    reply = client.submit(MODEL, payload, content_type=protocol.NPY, timeout=REQUEST_TIMEOUT_S)
                    ms = (time.perf_counter() - t0) * 1000.0
                    if not reply.ok:
                        raise RuntimeError(f"packrat-mq: {reply.error}")
                    if record:
                        inference.append(reply.inference_ms)
                        beyond.append(ms - reply.inference_ms)
                if record:
                    latencies[kind].append(ms)
                time.sleep(args.pause_s)

            for k in range(args.warmup + args.requests):
                order = ("torchserve", "packrat") if k % 2 == 0 else ("packrat", "torchserve")
                for kind in order:
                    one(kind, record=k >= args.warmup)
            close_ts()
            client.close()
    pairs = [p / t for p, t in zip(latencies["packrat"], latencies["torchserve"])]
    result: dict[str, Any] = {
        "benchmark": "peers-lone", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(args.peers_venv),
        "options": vars(args) | {"peers_venv": str(args.peers_venv), "json_out": str(args.json_out)},
        "torchserve": quantiles(latencies["torchserve"]), "packrat": quantiles(latencies["packrat"]),
        "packrat_inference": quantiles(inference), "packrat_beyond_inference": quantiles(beyond),
        "ratio_of_p50": statistics.median(latencies["packrat"]) / statistics.median(latencies["torchserve"]),
        "pair_ratio": quantiles(pairs), "latencies_ms": latencies, "inference_ms": inference,
        "elapsed_s": time.time() - started,
    }
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(result, indent=2))
    for name in ("torchserve", "packrat", "packrat_inference", "packrat_beyond_inference", "pair_ratio"):
        q = result[name]
        print(f"{name:<26} p50 {q['p50_ms']:8.2f}  (p25-p75 {q['p25_ms']:.2f}-{q['p75_ms']:.2f})")
    print(f"packrat-mq / TorchServe, p50: {result['ratio_of_p50']:.2f}; written to {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
