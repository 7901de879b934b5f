"""Serving overhead for large payloads: a batch of 600 KB images, as a vision model gets them.

Overhead = client-measured end-to-end latency minus the handler's own time
(``inference_ms`` in the reply): the Redis hops, the dispatcher, the copies
and decoding of the payload, the reply. The model is ``sleep`` (it copies the
batch's arrays into one, as a vision model's preprocess does, sleeps
``--sleep-ms`` per batch and replies with a few bytes), so the figure is the
path's alone and the cores are free for it, as they are between batches of a
real model. End to end (``end_to_end_p50_ms``) is reported too: the copy is
in ``inference_ms``, and a payload read as a memory map pays its page faults
there.

Each round sends B requests at once (one pipelined XADD, as B producers
arriving together would), each a float32 ``1x3x224x224`` ``.npy`` array
(602 KB), to one instance of batch B, and waits for every reply. Reported:
per-request overhead p50/p99 over all rounds, and the batch's wall time.

Two ways to send the bytes (``--modes``), interleaved run by run (the
order alternates), so their ratio is measured on the same host minutes:
``redis``, the payload in the request entry; ``shm``, the payload in a file
in shared memory that the entry names (``Client(shared_memory=True)``, a
producer on the serving host). Each also as ``-array``: the producer hands
the client the array, which encodes it (into Redis as one ``.npy`` bytes;
into its payload file straight), rather than ready ``.npy`` bytes.
``sealed``: the payload in a sealed memfd (``Client(shared_memory="sealed")``),
which the worker maps instead of reading. ``-empty`` (``shm-empty``,
``sealed-empty``): the producer writes each image into an array the client
lent it in shared memory (``Client.empty``), before the batch is timed, as a
producer that decodes its image there would, and sends it with no copy.

Run: ``python -m benchmarks.bench_payload [--batch 8] [--rounds 200] [--modes redis,shm]``.
"""
from __future__ import annotations

import argparse
import io
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
from packrat_mq.settings import Settings  # noqa: E402
from workers.supervisor import Supervisor  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def image_npy(seed: int = 0, size: int = 224) -> bytes:
    """One ImageNet-sized float32 image as ``.npy`` bytes (602,240 bytes; ``size`` 8: 896 bytes)."""
    arr = np.random.default_rng(seed).standard_normal((1, 3, size, size), dtype=np.float32)
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


#: ``small``: an 896-byte ``.npy`` through Redis, the same path's floor without the large payload.
#: ``-array``: the producer sends the float32 array, and the client encodes it (into Redis as one
#: ``.npy`` bytes; in shared memory, straight into its payload file); otherwise the ``.npy`` bytes.
MODES = ("redis", "shm", "small", "redis-array", "shm-array", "sealed", "sealed-array", "shm-empty",
         "sealed-empty")


def image_array(seed: int = 0, size: int = 224) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 3, size, size), dtype=np.float32)


def run(url: str, batch: int, rounds: int, sleep_ms: float, warmup: int = 20, mode: str = "redis",
        shm_dir: str | None = None) -> dict[str, Any]:
    r = connect(url)
    r.flushdb()
    settings = Settings(redis_url=url, batch_timeout_ms=50.0, **({"shm_dir": shm_dir} if shm_dir else {}))
    npy = image_npy(size=8 if mode == "small" else 224)
    payload: bytes | np.ndarray = image_array() if mode.endswith("-array") else npy
    threads = 1
    config = Configuration.parse(f"{threads}x{batch}")
    overhead: list[float] = []
    wall: list[float] = []
    end_to_end: list[float] = []
    # Where the overhead goes: up to the batch's start on the worker (the reply's queue_ms: the
    # dispatcher, the queue, the payload fetch), and the rest (the client's XADD until Redis stamps
    # it, the replies' transaction, the client's read). queue_ms counts from the stream id, whose
    # clock has millisecond steps: it reads about 0.5 ms long on average, the rest as much short.
    before: list[float] = []
    after: list[float] = []
    # The stand-in copies the eight arrays into one batch, as a vision model's preprocess does: a
    # payload read as a memory map pays its page faults there (in inference_ms), so the end-to-end
    # figure is what compares the modes in full.
    with Supervisor(r, settings, url, "sleep", config, options={"base_ms": sleep_ms, "copy_inputs": True}):
        shared = "sealed" if mode.startswith("sealed") else mode.startswith("shm")
        client = Client(connect(url), shared_memory=shared, shm_dir=settings.shm_dir)
        image = image_array()
        for k in range(warmup + rounds):
            items: list[Any] = [payload] * batch
            if mode.endswith("-empty"):
                items = [client.empty(image.shape, image.dtype) for _ in range(batch)]
                for item in items:
                    item[...] = image  # the producer's own work: its image made where it is sent from
            ms, reps = client.time_batch("sleep", items, content_type=protocol.NPY)
            bad = [x.error for x in reps if not x.ok]
            if bad:
                raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
            if k >= warmup:
                wall.append(ms - reps[0].inference_ms)
                overhead.extend((x.latency_ms or 0.0) - x.inference_ms for x in reps)
                end_to_end.extend(x.latency_ms or 0.0 for x in reps)
                before.extend(x.queue_ms for x in reps)
                after.extend((x.latency_ms or 0.0) - x.queue_ms - x.inference_ms for x in reps)
        client.close()
    return {
        "overhead_p50_ms": float(np.percentile(overhead, 50)),
        "overhead_p99_ms": float(np.percentile(overhead, 99)),
        "batch_overhead_p50_ms": float(np.percentile(wall, 50)),
        "end_to_end_p50_ms": float(np.percentile(end_to_end, 50)),
        "before_handler_p50_ms": float(np.percentile(before, 50)),
        "after_handler_p50_ms": float(np.percentile(after, 50)),
        "payload_bytes": len(npy),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=200, help="batches timed per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sleep-ms", type=float, default=20.0, help="the stand-in model's time per batch")
    ap.add_argument("--url", default=None, help="a Redis URL (default: an embedded redis-server)")
    ap.add_argument("--modes", default="redis", help="comma-separated: redis (payload in the entry), "
                    "shm (payload in a shared-memory file the entry names), small (an 896-byte .npy "
                    "through Redis: the path's floor), redis-array and shm-array (the producer hands the "
                    "client arrays to encode); several are interleaved")
    ap.add_argument("--shm-dir", default=None, help="payload directory for shm (default: PACKRAT_SHM_DIR or "
                    "/dev/shm/packrat)")
    ap.add_argument("--json-out", default=str(RESULTS / "payload.json"))
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown or not modes:
        ap.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    runs: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    payload_bytes: dict[str, int] = {}

    def measure(url: str) -> None:
        nonlocal payload_bytes
        for k in range(args.runs):
            order = modes if k % 2 == 0 else modes[::-1]
            for mode in order:
                res = run(url, args.batch, args.rounds, args.sleep_ms, mode=mode, shm_dir=args.shm_dir)
                payload_bytes[mode] = res.pop("payload_bytes")
                for name, value in res.items():
                    runs[mode].setdefault(name, []).append(value)
                print(f"run {k + 1}/{args.runs} {mode}: " + ", ".join(f"{n} {v:.2f}" for n, v in res.items()),
                      file=sys.stderr)

    if args.url:
        measure(args.url)
    else:
        with EmbeddedRedis(announce=False) as server:
            measure(server.url)
    figures = {mode: {name: {"median": float(np.median(v)), "min": float(np.min(v)), "max": float(np.max(v))}
                      for name, v in per.items()} for mode, per in runs.items()}
    result: dict[str, Any] = {
        "benchmark": f"large-payload overhead (sleep model, B={args.batch}, .npy per request)",
        "payload_bytes": payload_bytes,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "batch": args.batch, "rounds": args.rounds, "runs": args.runs, "sleep_ms": args.sleep_ms, "modes": modes,
        "figures": figures, "raw": runs,
    }
    if len(modes) > 1:
        result["ratios_p50"] = {
            f"{figure} {m}/{modes[0]}": [round(a / b, 3) for a, b in zip(runs[m][figure], runs[modes[0]][figure])]
            for m in modes[1:] for figure in ("overhead_p50_ms", "end_to_end_p50_ms")}
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(result, indent=2))
    print(f"{'mode':<6} {'figure':<28} {'median':>8} {'min':>8} {'max':>8}")
    for mode, per in figures.items():
        for name, st in per.items():
            print(f"{mode:<6} {name:<28} {st['median']:>8.2f} {st['min']:>8.2f} {st['max']:>8.2f}")
    for name, ratios in result.get("ratios_p50", {}).items():
        print(f"{name}, run by run: {', '.join(f'{x:.2f}' for x in ratios)}")
    print(f"written to {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
