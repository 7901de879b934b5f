"""A layout served under a saturating load against the same processes running back to back.

The adaptive benchmark's runs of 12-06 saw full 16-request sub-batches of
ResNet-50 served at 150 ms a request where partial ones took 99-124 ms and
the same layout in-process (``bench_corun``) about 100: was it the serving
(payload reads beside the other instance's compute, the path's processes,
loaded spares) or the minute? This serves one static layout (``--instances``,
``up --graph``) to ``--clients`` closed-loop clients, enough to keep every
sub-batch full, and reads the handler's time of each batch from the replies
(``inference_ms``, ``batch_size``), against the layout's processes running
the model back to back with nothing around them (``bench_corun``'s child,
pinned and threaded as a worker is). Setups, interleaved over ``--rounds``,
the order rotated:

- ``served``: ``up --instances L`` alone;
- ``served-spares``: the same with ``--spares`` loaded spare instances (what an
  adaptive deployment keeps: ``PACKRAT_SPARE_INSTANCES``, prewarmed);
- ``back-to-back``: the layout's processes running their full batch back to back.

Reported per setup and round: the handler's p50 at the full sub-batch, per
request, and replies per second (served setups). The ratio served /
back-to-back is read within a round.

Run: ``python -m benchmarks.bench_served [--instances 2*1x16] [--clients 48] [--seconds 50] [--rounds 2]``;
writes ``benchmarks/results/served-<name>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_adaptive import percentile, start_up, wait_for_spares  # noqa: E402
from benchmarks.bench_corun import run_together  # noqa: E402
from optimizer.calibration import example_payloads  # noqa: E402
from packrat_mq.client import Client  # noqa: E402
from packrat_mq.connection import EmbeddedRedis, connect  # noqa: E402
from packrat_mq.instances import Configuration  # noqa: E402
from packrat_mq.topology import Topology  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SETUPS = ("served", "served-spares", "back-to-back")


def cores_of(layout: Configuration) -> list[list[int]]:
    """The cores each instance of ``layout`` is pinned to, packed from core 0 as the pool packs them."""
    out, first = [], 0
    for spec in layout.instances:
        out.append(list(range(first, first + spec.threads)))
        first += spec.threads
    return out


def by_batch(replies: list[dict[str, str]]) -> dict[int, dict[str, float]]:
    """The handler's p50 by sub-batch size, each batch counted once (its k replies carry the same time)."""
    seen: set[tuple[str, str, str]] = set()
    batches: dict[int, list[float]] = {}
    for f in replies:
        key = (f.get("instance", ""), f.get("inference_ms", ""), f.get("batch_size", ""))
        k = int(f.get("batch_size") or 0)
        if k <= 0 or f.get("status") != "ok" or key in seen:
            continue
        seen.add(key)
        batches.setdefault(k, []).append(float(f["inference_ms"]))
    return {k: {"batches": len(v), "p50_ms": statistics.median(v), "per_request_ms": statistics.median(v) / k}
            for k, v in sorted(batches.items())}


def serve(args: argparse.Namespace, spares: int) -> dict[str, Any]:
    """One served setup: ``up`` on its own embedded Redis, closed-loop clients, the replies' fields."""
    with EmbeddedRedis(announce=False) as redis:
        prefix = f"bench-served-{uuid.uuid4().hex[:6]}"
        cmd = [sys.executable, "-m", "packrat_mq", "up", "--model", args.model, "--graph", args.graph,
               "--instances", args.instances, "--redis-url", redis.url, "--prefix", prefix,
               "--batch-timeout-ms", str(args.wait_ms), "--exit-with-parent"]
        env = dict(os.environ, PACKRAT_LOG_LEVEL="WARNING", PACKRAT_SPARE_INSTANCES=str(spares),
                   PACKRAT_PREWARM_SPARES="1" if spares else "0", PACKRAT_PREWARM_MAX_CPU="1")
        proc, lines = start_up("served", cmd, env)
        if spares:
            wait_for_spares(redis.url, prefix, args.model)
        payload, ctype = example_payloads(args.model, 1)[0]
        got: list[tuple[float, dict[str, str]]] = []
        lock, stop = threading.Lock(), threading.Event()

        def loop() -> None:
            client = Client(connect(redis.url), prefix=prefix)
            try:
                while not stop.is_set():
                    rid = f"sv-{uuid.uuid4().hex[:12]}"
                    client.send(args.model, payload, content_type=ctype, request_id=rid)
                    for rep in client.gather([rid], timeout=120):
                        with lock:
                            got.append((rep.received_at, dict(rep.fields)))
            finally:
                client.close()

        threads = [threading.Thread(target=loop, daemon=True) for _ in range(args.clients)]
        began = time.time()
        for t in threads:
            t.start()
        time.sleep(args.warmup + args.seconds)
        stop.set()
        for t in threads:
            t.join(180)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    measured = [f for at, f in got if at >= began + args.warmup]
    return {"replies": len(measured), "replies_per_s": len(measured) / args.seconds,
            "errors": sum(1 for f in measured if f.get("status") != "ok"), "by_batch": by_batch(measured)}


def back_to_back(args: argparse.Namespace, layout: Configuration) -> dict[str, Any]:
    """The layout's processes, each running its full batch back to back, all at once."""
    specs = [("instance", spec.threads, spec.batch, cpus) for spec, cpus in zip(layout.instances, cores_of(layout))]
    procs = run_together(specs, args.seconds, {})
    return {"processes": procs, "images_per_s": round(sum(p["images_per_s"] for p in procs), 2)}


def full_batch_ms(result: dict[str, Any], batch: int) -> float | None:
    """A setup's handler p50 at the full sub-batch ``batch``."""
    if "processes" in result:
        return statistics.median(p["median_ms"] for p in result["processes"] if p["batch"] == batch)
    row = result["by_batch"].get(batch)
    return None if row is None else row["p50_ms"]


def write(args: argparse.Namespace, rounds: list[dict[str, Any]]) -> Path:
    """The run so far, as ``benchmarks/results/served-<name>.json``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"served-{args.name}.json"
    out.write_text(json.dumps({"benchmark": "served", "instances": args.instances, "clients": args.clients,
                               "model": args.model, "graph": args.graph, "seconds": args.seconds,
                               "machine": Topology.detect().summary(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "rounds": rounds}, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50", help="a zoo model (back-to-back runs ResNet-50 only)")
    ap.add_argument("--graph", default="torchscript")
    ap.add_argument("--instances", default="2*1x16", help="the layout, as `up --instances` (same sub-batch for all)")
    ap.add_argument("--clients", type=int, default=48, help="closed-loop clients: at least 1.5x B keeps batches full")
    ap.add_argument("--wait-ms", type=int, default=50, help="the batch wait")
    ap.add_argument("--spares", type=int, default=2, help="loaded spares of served-spares")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--name", default="served")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    layout = Configuration.parse(args.instances)
    batch = layout.instances[0].batch
    if any(spec.batch != batch for spec in layout.instances):
        ap.error("--instances: every instance needs the same sub-batch (the full batch compared)")
    setups = [s for s in args.setups.split(",") if s]
    unknown = set(setups) - set(SETUPS)
    if unknown:
        ap.error(f"--setups: unknown {sorted(unknown)}; known: {', '.join(SETUPS)}")
    rounds = []
    for r in range(args.rounds):
        order = setups[r % len(setups):] + setups[:r % len(setups)]
        row: dict[str, Any] = {"round": r + 1}
        for name in order:
            if name == "back-to-back":
                row[name] = back_to_back(args, layout)
            else:
                row[name] = serve(args, args.spares if name == "served-spares" else 0)
            ms = full_batch_ms(row[name], batch)
            extra = (f", {row[name]['replies_per_s']:.1f} replies/s" if "replies_per_s" in row[name]
                     else f", {row[name]['images_per_s']:.1f} images/s")
            print(f"round {r + 1} {name:<14} b={batch}: {'-' if ms is None else f'{ms:.0f}'} ms"
                  f" ({'-' if ms is None else f'{ms / batch:.1f}'} ms a request){extra}", flush=True)
        base = full_batch_ms(row["back-to-back"], batch) if "back-to-back" in row else None
        row["over_back_to_back"] = {n: round(ms / base, 3) for n in setups if n != "back-to-back"
                                    and base and (ms := full_batch_ms(row[n], batch)) is not None}
        print(f"round {r + 1} served / back-to-back at b={batch}: {row['over_back_to_back']}", flush=True)
        rounds.append(row)
        out = write(args, rounds)  # after every round: a run cut short keeps what it measured
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
