"""What turning a user's image into a model input costs, per image: Pillow against torchvision.

For each image made here (photo-like JPEGs of 640x480, 1920x1080 and
4032x3024, a phone camera's 12 MP; a 640x480 PNG and WebP), each way of decoding it does the whole per-request
preparation the vision handlers need, the ImageNet way for ResNet-50: decode
to RGB, resize the short side to 256 (antialiased bilinear), center-crop
224x224, and normalise to a float32 ``(3, 224, 224)`` tensor.

- ``pillow``: ``PIL.Image.open`` (the header only), ``convert("RGB")``,
  ``resize`` (bilinear, which Pillow antialiases), ``crop``, then numpy/torch
  to normalise;
- ``pillow-draft``: the same, after ``Image.draft``, which lets the JPEG
  decoder produce a 1/2, 1/4 or 1/8 scale image directly (DCT scaling) that is
  still at least the resize's size (other formats decode as ``pillow``), and
  resampling only the region the crop keeps (``resize(box=...)``);
- ``pillow-torch``: Pillow decodes as ``pillow-draft``, torch resizes and
  crops as ``torchvision``;
- ``torchvision``: ``torchvision.io.decode_image`` (``mode=RGB``), then
  ``torchvision.transforms.v2.functional`` ``resize(antialias=True)`` and
  ``center_crop``, normalised the same way;
- ``handler``: what the zoo's ``resnet50`` does (``ImageClassifierHandler.decode``
  + its normalisation), to check the served path costs what was measured.

Timed with torch on one thread (as a 1-thread instance runs it; decoding is
single-threaded in both libraries anyway), interleaved: each round times every
method on every image ``--iters`` times and keeps the median; the report is
the median of the round medians with their min-max, in CPU time of the
calling thread (where all the work runs: on a shared machine it counts the
work, not the waits for a core) and in wall time. ``diff`` is each method's
mean absolute difference from ``pillow`` on the normalised tensor (in units of
the standard deviation), to show what DCT scaling changes.

Then a sub-batch of eight JPEGs is decoded as a 2-thread instance does it,
one file after the other (``decode_threads=1``) against two at a time (the
default), interleaved (``--no-parallel`` skips it).

``--serve`` then measures what decoding costs a served request, against
ResNet-50's own time: the zoo's ``resnet50`` behind the real dispatcher and
worker (embedded Redis), fed the same picture as a ready ``uint8`` 224x224
``.npy`` array (what a client that decodes itself sends) and as 640x480 and
1920x1080 JPEGs, interleaved. At B=1 (one 2-thread instance, one request at
a time): end-to-end latency and ``inference_ms`` (which includes decoding)
per request. At B=8 (one 2-thread instance, eight requests at once): the
batch's wall time, with the sub-batch's files decoded one after the other
(``decode_threads=1``) and two at a time (the default, the instance's
threads), A/B in alternating runs.

Several runs (``--runs``) are summarised as the median of their medians with
the runs' min-max.

Run: ``python -m benchmarks.bench_decode [--runs 3] [--rounds 5] [--iters 25] [--serve --serve-runs 4]``.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import torch
import torchvision
from PIL import Image

from packrat_mq import protocol
from packrat_mq.client import Client
from packrat_mq.connection import EmbeddedRedis, connect
from packrat_mq.handler import Context, Input
from packrat_mq.instances import Configuration
from packrat_mq.settings import Settings
from packrat_mq.zoo import vision
from workers.supervisor import Supervisor

RESULTS = Path(__file__).resolve().parent / "results"
RESIZE, CROP = 256, 224
MEAN = torch.tensor(vision.IMAGENET_MEAN).view(3, 1, 1)
STD = torch.tensor(vision.IMAGENET_STD).view(3, 1, 1)


def photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A photo-like RGB image: smooth shapes and gradients with fine grain, so JPEG sizes are a camera's."""
    rng = np.random.default_rng(seed)
    coarse = rng.random((max(2, height // 40), max(2, width // 40), 3)) * 255
    base = np.asarray(Image.fromarray(coarse.astype(np.uint8)).resize((width, height), Image.Resampling.BICUBIC),
                      dtype=np.float32)
    y, x = np.mgrid[0:height, 0:width]
    base += 40 * np.sin(x / 37.0)[..., None] * np.cos(y / 23.0)[..., None]
    base += rng.normal(0, 6, (height, width, 3))
    return np.clip(base, 0, 255).astype(np.uint8)


def encode(array: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    options: dict[str, Any] = {"quality": 90} if fmt in ("JPEG", "WEBP") else {}
    Image.fromarray(array).save(buf, format=fmt, **options)
    return buf.getvalue()


def _short_side(width: int, height: int, side: int) -> tuple[int, int]:
    if width <= height:
        return side, max(1, round(height * side / width))
    return max(1, round(width * side / height)), side


def _normalise(chw_uint8: torch.Tensor) -> torch.Tensor:
    return (chw_uint8.float().div_(255.0) - MEAN) / STD


def _pillow(payload: bytes, draft: bool) -> torch.Tensor:
    im = Image.open(io.BytesIO(payload))
    if draft and im.format == "JPEG":
        im.draft("RGB", _short_side(im.width, im.height, RESIZE))
    im = im.convert("RGB")
    if draft:  # resample only the region the crop keeps
        scale = min(im.width, im.height) / RESIZE
        half, cx, cy = CROP * scale / 2, im.width / 2, im.height / 2
        im = im.resize((CROP, CROP), Image.Resampling.BILINEAR, box=(cx - half, cy - half, cx + half, cy + half))
    else:
        im = im.resize(_short_side(im.width, im.height, RESIZE), Image.Resampling.BILINEAR)
        left, top = (im.width - CROP) // 2, (im.height - CROP) // 2
        im = im.crop((left, top, left + CROP, top + CROP))
    return _normalise(torch.from_numpy(np.array(im)).permute(2, 0, 1))


def pillow_torch(payload: bytes) -> torch.Tensor:
    """Pillow decodes (DCT-scaled for JPEG), torch resizes (its vectorised uint8 antialiased kernel)."""
    from torchvision.transforms.v2 import functional as TF

    im = Image.open(io.BytesIO(payload))
    if im.format == "JPEG":
        im.draft("RGB", _short_side(im.width, im.height, RESIZE))
    im = im.convert("RGB")
    image = torch.from_numpy(np.array(im)).permute(2, 0, 1)
    image = TF.resize(image, [RESIZE], antialias=True)
    return _normalise(TF.center_crop(image, [CROP, CROP]))


def pillow(payload: bytes) -> torch.Tensor:
    return _pillow(payload, draft=False)


def pillow_draft(payload: bytes) -> torch.Tensor:
    return _pillow(payload, draft=True)


def torchvision_io(payload: bytes) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2 import functional as TF

    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    image = decode_image(data, mode=ImageReadMode.RGB)
    image = TF.resize(image, [RESIZE], antialias=True)  # one int: the short side
    image = TF.center_crop(image, [CROP, CROP])
    return _normalise(image)


def handler_path(handler: vision.ImageClassifierHandler, content_type: str) -> Callable[[bytes], torch.Tensor]:
    def run(payload: bytes) -> torch.Tensor:
        item = Input(id="x", data=protocol.decode_payload(content_type, payload), content_type=content_type)
        handler.validate(item)
        return handler.preprocess([item])[0]
    return run


def time_once(fn: Callable[[bytes], Any], payload: bytes) -> tuple[float, float]:
    """Wall and CPU milliseconds of one call (CPU: this thread's, where all the work runs with torch on one thread)."""
    cpu, start = time.thread_time(), time.perf_counter()
    fn(payload)
    return (time.perf_counter() - start) * 1000.0, (time.thread_time() - cpu) * 1000.0


def run(rounds: int, iters: int, warmup: int = 3) -> dict[str, Any]:
    torch.set_num_threads(1)
    handler = vision.ResNet50Handler()
    images = {
        "jpeg-640x480": (encode(photo(640, 480), "JPEG"), protocol.JPEG),
        "jpeg-1920x1080": (encode(photo(1920, 1080), "JPEG"), protocol.JPEG),
        "jpeg-4032x3024": (encode(photo(4032, 3024), "JPEG"), protocol.JPEG),  # a phone's 12 MP photo
        "png-640x480": (encode(photo(640, 480), "PNG"), protocol.PNG),
        "webp-640x480": (encode(photo(640, 480), "WEBP"), protocol.WEBP),
    }
    methods: dict[str, Callable[[str], Callable[[bytes], torch.Tensor]]] = {
        "pillow": lambda ct: pillow,
        "pillow-draft": lambda ct: pillow_draft,
        "torchvision": lambda ct: torchvision_io,
        "pillow-torch": lambda ct: pillow_torch,
        "handler": lambda ct: handler_path(handler, ct),
    }
    medians: dict[tuple[str, str], list[float]] = {(m, i): [] for m in methods for i in images}
    cpu_medians: dict[tuple[str, str], list[float]] = {(m, i): [] for m in methods for i in images}
    for name, (payload, ct) in images.items():
        for method, make in methods.items():
            for _ in range(warmup):
                make(ct)(payload)
    for _ in range(rounds):
        for name, (payload, ct) in images.items():
            for method, make in methods.items():
                fn = make(ct)
                wall, cpu = zip(*(time_once(fn, payload) for _ in range(iters)))
                medians[(method, name)].append(statistics.median(wall))
                cpu_medians[(method, name)].append(statistics.median(cpu))
    results = []
    for name, (payload, ct) in images.items():
        reference = pillow(payload)
        for method, make in methods.items():
            out = make(ct)(payload)
            assert out.shape == (3, CROP, CROP), (method, name, out.shape)
            ms, cpu = medians[(method, name)], cpu_medians[(method, name)]
            results.append({
                "image": name, "bytes": len(payload), "method": method,
                "median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "round_medians_ms": ms,
                "cpu_median_ms": statistics.median(cpu), "cpu_min_ms": min(cpu), "cpu_max_ms": max(cpu),
                "cpu_round_medians_ms": cpu,
                "diff": float((out - reference).abs().mean()),
            })
    return {"rounds": rounds, "iters": iters, "results": results}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def serve_payloads() -> dict[str, tuple[bytes, str]]:
    """The same picture three ways: a ready 224x224 uint8 array, a 640x480 and a 1920x1080 JPEG."""
    big = photo(1920, 1080, seed=3)
    ready = np.asarray(Image.fromarray(big).resize((398, 224), Image.Resampling.BILINEAR))[:, 87:311]
    return {
        "npy-224-uint8": (protocol.encode_as(protocol.NPY, np.ascontiguousarray(ready)), protocol.NPY),
        "jpeg-640x480": (encode(np.asarray(Image.fromarray(big).resize((640, 480))), "JPEG"), protocol.JPEG),
        "jpeg-1920x1080": (encode(big, "JPEG"), protocol.JPEG),
    }


def serve_b1(url: str, rounds: int, warmup: int = 5) -> dict[str, Any]:
    """One 2-thread instance of B=1, one request at a time, payload kinds interleaved."""
    payloads = serve_payloads()
    r = connect(url)
    settings = Settings(redis_url=url, prefix="bench-decode-b1", batch_timeout_ms=1.0)
    latency: dict[str, list[float]] = {k: [] for k in payloads}
    handler_ms: dict[str, list[float]] = {k: [] for k in payloads}
    with Supervisor(r, settings, url, "resnet50", Configuration.parse("2x1")):
        client = Client(connect(url), prefix=settings.prefix)
        for k in range(warmup + rounds):
            for name, (payload, ct) in payloads.items():
                reply = client.submit("resnet50", payload, content_type=ct, timeout=60)
                if not reply.ok:
                    raise RuntimeError(f"{name}: {reply.error}")
                if k >= warmup:
                    latency[name].append(reply.latency_ms or 0.0)
                    handler_ms[name].append(reply.inference_ms)
        client.close()
    return {name: {"latency_p50_ms": statistics.median(latency[name]),
                   "inference_p50_ms": statistics.median(handler_ms[name]),
                   "bytes": len(payloads[name][0])} for name in payloads}


def serve_b8(url: str, rounds: int, decode_threads: int, warmup: int = 2) -> dict[str, Any]:
    """One 2-thread instance of B=8, eight requests at once, payload kinds interleaved."""
    payloads = serve_payloads()
    r = connect(url)
    settings = Settings(redis_url=url, prefix=f"bench-decode-b8-{decode_threads}", batch_timeout_ms=50.0)
    wall: dict[str, list[float]] = {k: [] for k in payloads}
    handler_ms: dict[str, list[float]] = {k: [] for k in payloads}
    with Supervisor(r, settings, url, "resnet50", Configuration.parse("2x8"),
                    options={"decode_threads": decode_threads}):
        client = Client(connect(url), prefix=settings.prefix)
        for k in range(warmup + rounds):
            for name, (payload, ct) in payloads.items():
                ms, replies = client.time_batch("resnet50", [payload] * 8, content_type=ct, timeout=120)
                bad = [x.error for x in replies if not x.ok]
                if bad:
                    raise RuntimeError(f"{name}: {bad[0]}")
                if {int(x.fields.get("batch_size", 0)) for x in replies} != {8}:
                    continue  # split by the batch timeout: not the batch being measured
                if k >= warmup:
                    wall[name].append(ms)
                    handler_ms[name].append(replies[0].inference_ms)
        client.close()
    return {name: {"batch_p50_ms": statistics.median(wall[name]) if wall[name] else None,
                   "inference_p50_ms": statistics.median(handler_ms[name]) if handler_ms[name] else None,
                   "batches": len(wall[name])} for name in payloads}


def serve(runs: int, rounds_b1: int, rounds_b8: int) -> dict[str, Any]:
    out: dict[str, Any] = {"b1": [], "b8": []}
    with EmbeddedRedis(announce=False) as server:
        for k in range(runs):
            out["b1"].append(serve_b1(server.url, rounds_b1))
            print(f"serve run {k + 1}/{runs}, B=1: {json.dumps(out['b1'][-1])}", file=sys.stderr)
            for threads in ((1, 2) if k % 2 == 0 else (2, 1)):
                res = serve_b8(server.url, rounds_b8, threads)
                out["b8"].append({"decode_threads": threads, **res})
                print(f"serve run {k + 1}/{runs}, B=8, decode_threads={threads}: {json.dumps(res)}", file=sys.stderr)
    return {"runs": runs, "rounds_b1": rounds_b1, "rounds_b8": rounds_b8, "summary": summarise(out), "raw": out}


def summarise(out: dict[str, Any]) -> dict[str, Any]:
    """Medians across runs with min-max; what a file costs over the ready array is paired within each run
    (the same instance, requests interleaved), which a shared machine's load changes far less than the
    absolute figures."""
    summary: dict[str, Any] = {"b1": {}, "b8": {}}
    for name in out["b1"][0]:
        summary["b1"][name] = {field: _spread([run[name][field] for run in out["b1"]])
                               for field in ("latency_p50_ms", "inference_p50_ms")}
        # What the file costs over the ready array, paired within each run.
        summary["b1"][name]["extra_latency_ms"] = _spread(
            [run[name]["latency_p50_ms"] - run["npy-224-uint8"]["latency_p50_ms"] for run in out["b1"]])
    for threads in (1, 2):
        rows = [run for run in out["b8"] if run["decode_threads"] == threads]
        summary["b8"][f"decode_threads={threads}"] = {
            name: {field: _spread([run[name][field] for run in rows if run[name][field] is not None])
                   for field in ("batch_p50_ms", "inference_p50_ms")}
            for name in rows[0] if name != "decode_threads"}
        for name, row in summary["b8"][f"decode_threads={threads}"].items():
            row["extra_batch_ms"] = _spread([run[name]["batch_p50_ms"] - run["npy-224-uint8"]["batch_p50_ms"]
                                             for run in rows if run[name]["batch_p50_ms"] is not None])
    return summary


def serve_table(summary: dict[str, Any]) -> str:
    def cell(x: dict[str, float]) -> str:
        return f"{x['median']:.1f} ({x['min']:.1f}-{x['max']:.1f})"

    lines = ["B=1, one 2-thread instance | latency p50 ms | inference_ms p50 | over the array ms",
             "---|---|---|---"]
    for name, row in summary["b1"].items():
        lines.append(f"{name} | {cell(row['latency_p50_ms'])} | {cell(row['inference_p50_ms'])} | "
                     f"{cell(row['extra_latency_ms'])}")
    lines += ["", "B=8, one 2-thread instance | batch p50 ms | inference_ms p50 | over the array ms", "---|---|---|---"]
    for threads, rows in summary["b8"].items():
        for name, row in rows.items():
            lines.append(f"{name}, {threads} | {cell(row['batch_p50_ms'])} | {cell(row['inference_p50_ms'])} | "
                         f"{cell(row['extra_batch_ms'])}")
    return "\n".join(lines)


def parallel(rounds: int, iters: int, batch: int = 8) -> dict[str, Any]:
    """A sub-batch of ``batch`` files validated (decoded) by an instance of 2 threads: one file after the
    other (``decode_threads=1``) against two at a time (the default), interleaved; wall ms per sub-batch."""
    torch.set_num_threads(2)
    handlers = {}
    for threads in (1, 2):
        h = vision.ResNet50Handler()
        h.initialize(Context(model_name="resnet50", threads=2, batch_size=batch, options={"decode_threads": threads}))
        handlers[threads] = h
    files = {"jpeg-640x480": encode(photo(640, 480), "JPEG"), "jpeg-1920x1080": encode(photo(1920, 1080), "JPEG")}
    medians: dict[tuple[str, int], list[float]] = {(name, t): [] for name in files for t in handlers}
    for k in range(rounds + 1):
        for name, payload in files.items():
            for threads, h in handlers.items():
                times = []
                for _ in range(iters):
                    items = [Input(id=str(i), data=payload, content_type=protocol.JPEG) for i in range(batch)]
                    start = time.perf_counter()
                    rejected = h.validate_all(items)
                    times.append((time.perf_counter() - start) * 1000.0)
                    assert not any(rejected), rejected
                if k > 0:  # the first round warms up
                    medians[(name, threads)].append(statistics.median(times))
    torch.set_num_threads(1)
    out: dict[str, Any] = {"batch": batch, "rounds": rounds, "iters": iters, "images": {}}
    for name in files:
        one, two = medians[(name, 1)], medians[(name, 2)]
        out["images"][name] = {"decode_threads=1_ms": _spread(one), "decode_threads=2_ms": _spread(two),
                               "ratio": _spread([b / a for a, b in zip(one, two)]),
                               "raw": {"decode_threads=1": one, "decode_threads=2": two}}
    return out


def across_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per image and method: the median of the runs' medians, with the runs' min-max."""
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for one in runs:
        for row in one["results"]:
            rows.setdefault((row["image"], row["method"]), []).append(row)
    out = []
    for (image, method), got in rows.items():
        cpu, wall = [r["cpu_median_ms"] for r in got], [r["median_ms"] for r in got]
        out.append({"image": image, "bytes": got[0]["bytes"], "method": method, "runs": len(got),
                    "cpu_ms": _spread(cpu), "wall_ms": _spread(wall), "diff": got[0]["diff"]})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| image | bytes | method | CPU ms | min-max | wall ms | min-max | diff |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cpu, wall = row["cpu_ms"], row["wall_ms"]
        lines.append(f"| {row['image']} | {row['bytes']:,} | {row['method']} | {cpu['median']:.2f} | "
                     f"{cpu['min']:.2f}-{cpu['max']:.2f} | {wall['median']:.2f} | "
                     f"{wall['min']:.2f}-{wall['max']:.2f} | {row['diff']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs of the per-image measurement (0: none)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per run")
    ap.add_argument("--iters", type=int, default=25, help="calls per method, image and round")
    ap.add_argument("--no-parallel", dest="parallel", action="store_false",
                    help="skip decoding a sub-batch of 8 files one at a time against two at a time")
    ap.add_argument("--serve", action="store_true", help="also measure served requests (resnet50, B=1 and B=8)")
    ap.add_argument("--serve-runs", type=int, default=2)
    ap.add_argument("--serve-rounds", type=int, default=20, help="requests per payload kind per run at B=1")
    ap.add_argument("--serve-batches", type=int, default=8, help="batches per payload kind per run at B=8")
    ap.add_argument("--json-out", type=Path, default=RESULTS / "decode.json")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    runs = [run(args.rounds, args.iters) for _ in range(args.runs)]
    result: dict[str, Any] = {
        "benchmark": "decode", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "torchvision": torchvision.__version__, "pillow": PIL.__version__},
        "runs": args.runs, "rounds": args.rounds, "iters": args.iters, "torch_threads": 1,
        "summary": across_runs(runs), "raw": [r["results"] for r in runs],
    }
    if runs:  # --runs 0 measures only what follows
        print(table(result["summary"]), flush=True)
    if args.parallel:
        result["parallel"] = parallel(args.rounds, args.iters)
        for name, row in result["parallel"]["images"].items():
            one, two, ratio = row["decode_threads=1_ms"], row["decode_threads=2_ms"], row["ratio"]
            print(f"8 x {name}, 2-thread instance: one at a time {one['median']:.1f} ms ({one['min']:.1f}-{one['max']:.1f}), "
                  f"two at a time {two['median']:.1f} ms ({two['min']:.1f}-{two['max']:.1f}), "
                  f"ratio {ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})", flush=True)
    if args.serve:
        os.environ.setdefault("PACKRAT_LOG_LEVEL", "WARNING")
        result["serve"] = serve(args.serve_runs, args.serve_rounds, args.serve_batches)
        print(serve_table(result["serve"]["summary"]))
    # The machine may be shared: what else ran is part of the figures.
    result["load_average_1min"] = {"before": load_before[0], "after": os.getloadavg()[0]}
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
