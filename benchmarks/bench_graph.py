"""Graph backends against eager and each other: warm-up and steady latency per zoo model and B.

For each model, one child per mode (``eager``, ``torchscript``, ``compile``,
``export``; more with ``--modes``) is started as an instance is: the thread
environment of ``workers.launch.instance_env``, then ``workers.runtime.start``
pinned to the same ``--threads`` cores, loaded eager. For each B in turn:

- **warm-up**: every child in turn makes itself serve B
  (``workers.runtime.resize``: the graph built at B from the eager weights)
  and runs one example batch through ``run_batch``, timed in the child. That
  is what an instance's start costs beyond loading the model, and what every
  active-passive reconfiguration waits for. The first B of a child is the one
  a fresh process pays (one-off imports and initialisation included);
- **outputs**: each mode's model output on the example batch, against eager's
  (largest absolute difference);
- **steady latency**: ``--rounds`` rounds, the modes in a rotated order each
  round, each timing ``handler.handle`` (preprocess, inference, postprocess)
  for about ``--round-s`` seconds (``--min-iters`` to ``--max-iters``
  iterations) after one untimed call; a round's median is one sample, and the
  table gives the median of the rounds' medians (min-max). Modes are
  interleaved so that a shared machine's drift hits them alike.

The inductor cache (``TORCHINDUCTOR_CACHE_DIR``) is a fresh directory per run,
so each model's first compile is cold; after a model's grid a fresh ``compile``
(and ``aoti``) child starts again at ``--restart-batches``: the warm-up of a
restart with the cache warm, as a reconfiguration on the same node sees it.
The load average is recorded at every round.

Run: ``python -m benchmarks.bench_graph [--models resnet50,...] [--batches 1,2,4,8,16,32]
[--modes eager,torchscript,compile,export] [--rounds 3]``; ``--report FILE`` prints a
finished run's table again, ``--plot FILE`` draws it. Raw results:
``benchmarks/results/graph.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("resnet50", "inception_v3", "bert", "gpt2", "minilm")
BATCHES = (1, 2, 4, 8, 16, 32)
MODES = ("eager", "torchscript", "compile", "export")
#: Measurement-only variants: (graph mode, handler options).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "compile-nofreeze": ("compile", {"compile_freezing": False}),
}
#: Modes whose warm-up a warm inductor cache may shorten (measured again in a fresh child).
CACHED = ("compile", "compile-nofreeze", "aoti")
#: Handler options per model, the same in every mode: minilm pads to 128 tokens in eager mode too.
MODEL_OPTIONS: dict[str, dict[str, Any]] = {"minilm": {"seq_len": 128}}


# ---------------------------------------------------------------------------
# the child


def child_main() -> int:
    """One instance, loaded eager; answers prepare/run/save requests, one JSON line each."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    spec = json.loads(sys.stdin.readline())

    def send(message: dict[str, Any]) -> None:
        proto.write(json.dumps(message) + "\n")

    import torch

    from packrat_mq.handler import run_batch
    from workers import runtime

    mode, options = spec["mode"], spec["options"]
    torch.manual_seed(0)  # the same random weights in every mode's child, so outputs compare
    try:
        handler = runtime.start(runtime.RuntimeSpec(
            model=spec["model"], handler=spec["model"], instance_id=f"bench-{spec['label']}",
            threads=spec["threads"], batch=1, cpus=spec["cpus"], options=options), warm_up=False)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        send({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    eager = handler.model
    send({"event": "ready", "pid": os.getpid()})
    items: list[Any] = []
    fresh = False
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "prepare":
                import gc

                b = int(request["batch"])
                items = []
                gc.collect()
                t0 = time.perf_counter()
                runtime.resize(handler, eager, b, mode)
                t1 = time.perf_counter()
                items = handler.example_batch(b)
                check = run_batch(handler, items)
                t2 = time.perf_counter()
                errors = [o.error for o in check.outcomes if not o.ok]
                if errors:
                    raise RuntimeError(f"{len(errors)} of {b} example requests failed: {errors[0]}")
                fresh = True
                send({"event": "prepared", "build_s": t1 - t0, "first_s": t2 - t1, "warmup_s": t2 - t0,
                      "rss_mb": _rss_mb(), "load": os.getloadavg()[0]})
            elif request["op"] == "run":
                times = []
                if fresh:
                    handler.handle(items)  # untimed: the second call after the build
                    fresh = False
                for _ in range(int(request["iters"])):
                    t0 = time.perf_counter()
                    handler.handle(items)
                    times.append((time.perf_counter() - t0) * 1000.0)
                send({"event": "ran", "ms": times})
            elif request["op"] == "save":
                import numpy as np

                output = handler.inference(handler.preprocess(items))
                np.save(request["path"], output.float().numpy())
                send({"event": "saved"})
            else:
                raise ValueError(f"unknown op {request['op']!r}")
        except Exception as exc:  # noqa: BLE001 - one failing point is data
            send({"event": "error", "message": f"{type(exc).__name__}: {str(exc)[:2000]}"})
    return 0


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


# ---------------------------------------------------------------------------
# the parent


class Child:
    """One measuring process for one (model, mode)."""

    def __init__(self, model: str, label: str, threads: int, cpus: list[int], cache_dir: str,
                 timeout_s: float) -> None:
        from workers.launch import instance_env

        mode, extra = VARIANTS.get(label, (label, {}))
        self.model, self.label, self.timeout_s = model, label, timeout_s
        env = instance_env(threads)
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        spec = {"model": model, "label": label, "mode": mode, "threads": threads, "cpus": cpus,
                "options": {**MODEL_OPTIONS.get(model, {}), **extra}}
        self.stderr = tempfile.TemporaryFile()
        started = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_graph", "--child"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     start_new_session=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        self.proc.stdin.flush()
        self._buf = b""
        ready = self.read()
        if ready.get("event") != "ready":
            raise RuntimeError(f"{model} {label} did not start: {ready.get('message')}\n{self.tail()}")
        self.load_s = time.perf_counter() - started

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        return self.read()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + self.timeout_s
        while b"\n" not in self._buf:
            if time.monotonic() > deadline:
                self.proc.kill()
                return {"event": "error", "message": f"no answer within {self.timeout_s:g} s"}
            if select.select([fd], [], [], 1.0)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return {"event": "error", "message": f"child exited with {self.proc.wait()}\n{self.tail()}"}
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def tail(self, limit: int = 3000) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-limit:]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def load() -> float:
    return os.getloadavg()[0]


def bench_model(model: str, args: argparse.Namespace, cpus: list[int], cache_dir: str,
                out: dict[str, Any], save: Any) -> None:
    modes = [m for m in args.modes]
    res: dict[str, Any] = {"load_s": {}, "errors": {}, "points": {}, "restarts": {}}
    out["models"][model] = res
    children: dict[str, Child] = {}
    try:
        for label in modes:
            try:
                children[label] = Child(model, label, args.threads, cpus, cache_dir, args.timeout_s)
                res["load_s"][label] = children[label].load_s
                log(f"{model} {label}: loaded in {children[label].load_s:.1f} s")
            except RuntimeError as exc:
                res["errors"][label] = str(exc)
                log(f"{model} {label}: FAILED to start: {str(exc)[:300]}")
        for b in args.batches:
            point: dict[str, Any] = {"warmup": {}, "max_abs_diff": {}, "rounds_ms": {}, "load_avg": [load()],
                                     "errors": {}}
            res["points"][str(b)] = point
            live = {}
            for label, child in children.items():
                answer = child.ask({"op": "prepare", "batch": b})
                if answer.get("event") != "prepared":
                    point["errors"][label] = answer.get("message")
                    log(f"{model} B={b} {label}: FAILED: {str(answer.get('message'))[:300]}")
                    if answer.get("message", "").startswith("no answer") or child.proc.poll() is not None:
                        continue
                    continue
                point["warmup"][label] = {k: answer[k] for k in ("build_s", "first_s", "warmup_s", "rss_mb", "load")}
                live[label] = child
                log(f"{model} B={b} {label}: warm-up {answer['warmup_s']:.1f} s "
                    f"(build {answer['build_s']:.1f}, first batch {answer['first_s']:.1f}), rss {answer['rss_mb']:.0f} MB")
            _compare(model, b, live, point)
            first = min((w["first_s"] for w in point["warmup"].values()), default=1.0)
            iters = max(args.min_iters, min(args.max_iters, round(args.round_s / max(first, 1e-3))))
            point["iters_per_round"] = iters
            labels = list(live)
            for r in range(args.rounds):
                order = labels[r % len(labels):] + labels[:r % len(labels)] if labels else []
                point["load_avg"].append(load())
                for label in order:
                    answer = live[label].ask({"op": "run", "iters": iters})
                    if answer.get("event") != "ran":
                        point["errors"][label] = answer.get("message")
                        continue
                    point["rounds_ms"].setdefault(label, []).append(answer["ms"])
                log(f"{model} B={b} round {r + 1}/{args.rounds} (load {point['load_avg'][-1]:.2f}): " + "  ".join(
                    f"{label} {statistics.median(point['rounds_ms'][label][-1]):.1f}" for label in order
                    if label in point["rounds_ms"]))
            save()
        for label in [m for m in modes if m in CACHED and m in children]:
            children.pop(label).close()
            for b in args.restart_batches:
                try:
                    child = Child(model, label, args.threads, cpus, cache_dir, args.timeout_s)
                except RuntimeError as exc:
                    res["restarts"][f"{label}@{b}"] = {"error": str(exc)}
                    continue
                answer = child.ask({"op": "prepare", "batch": b})
                child.close()
                if answer.get("event") == "prepared":
                    res["restarts"][f"{label}@{b}"] = {"load_s": child.load_s, **{
                        k: answer[k] for k in ("build_s", "first_s", "warmup_s", "rss_mb", "load")}}
                    log(f"{model} {label} restart at B={b} with a warm cache: warm-up {answer['warmup_s']:.1f} s")
                else:
                    res["restarts"][f"{label}@{b}"] = {"error": answer.get("message")}
            save()
    finally:
        for child in children.values():
            child.close()


def _compare(model: str, b: int, live: dict[str, Child], point: dict[str, Any]) -> None:
    import numpy as np

    with tempfile.TemporaryDirectory() as d:
        outputs = {}
        for label, child in live.items():
            path = os.path.join(d, f"{label}.npy")
            if child.ask({"op": "save", "path": path}).get("event") == "saved":
                outputs[label] = np.load(path)
        ref = outputs.get("eager")
        if ref is None:
            return
        scale = float(np.abs(ref).max()) or 1.0
        for label, value in outputs.items():
            if label != "eager":
                point["max_abs_diff"][label] = {"abs": float(np.abs(value - ref).max()), "ref_max": scale}


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """Per model, B and mode: steady median of round medians (min-max), warm-up, and ratios to eager."""
    summary: dict[str, Any] = {}
    for model, res in result["models"].items():
        rows = summary.setdefault(model, {})
        for b, point in res["points"].items():
            row = rows.setdefault(b, {})
            medians = {label: [statistics.median(r) for r in rounds] for label, rounds in point["rounds_ms"].items()}
            best = {label: min(min(r) for r in rounds) for label, rounds in point["rounds_ms"].items()}
            for label, ms in medians.items():
                row[label] = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms),
                              "best_ms": best[label], "samples": sum(map(len, point["rounds_ms"][label])),
                              "warmup_s": point["warmup"].get(label, {}).get("warmup_s")}
                if "eager" in best:
                    row[label]["best_ratio"] = best[label] / best["eager"]
                if "eager" in medians and len(medians["eager"]) == len(ms):
                    ratios = [m / e for m, e in zip(ms, medians["eager"])]
                    row[label].update(ratio_median=statistics.median(ratios), ratio_min=min(ratios),
                                      ratio_max=max(ratios))
    return summary


def report(result: dict[str, Any]) -> str:
    summary = summarise(result)
    modes = result["modes"]
    loads = [x for res in result["models"].values() for p in res["points"].values() for x in p["load_avg"]]
    lines = []
    if loads:
        lines += [f"load average (1 min) at the rounds: median {statistics.median(loads):.2f} "
                  f"({min(loads):.2f}–{max(loads):.2f}); cells: median of round medians (min–max), "
                  f"warm-up seconds in brackets", ""]
    lines += [f"| model | B | " + " | ".join(f"{m} ms (warm-up s)" for m in modes) + " |",
             "|---|---|" + "---|" * len(modes)]
    for model, rows in summary.items():
        for b, row in rows.items():
            cells = []
            for m in modes:
                if m not in row:
                    err = result["models"][model]["points"][b]["errors"].get(m) or result["models"][model]["errors"].get(m)
                    cells.append("failed" if err else "–")
                    continue
                s = row[m]
                warm = f" ({s['warmup_s']:.1f})" if s.get("warmup_s") is not None else ""
                cells.append(f"{s['median_ms']:.1f} ({s['min_ms']:.1f}–{s['max_ms']:.1f}){warm}")
            lines.append(f"| {model} | {b} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| model | B | " + " | ".join(f"{m}/eager" for m in modes if m != "eager") + " |")
    lines.append("|---|---|" + "---|" * (len(modes) - 1))
    for model, rows in summary.items():
        for b, row in rows.items():
            cells = []
            for m in modes:
                if m == "eager":
                    continue
                s = row.get(m, {})
                cells.append(f"{s['ratio_median']:.2f} ({s['ratio_min']:.2f}–{s['ratio_max']:.2f})"
                             if "ratio_median" in s else "–")
            lines.append(f"| {model} | {b} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| model | B | " + " | ".join(f"{m} best ms" for m in modes) + " | "
                 + " | ".join(f"{m}/eager best" for m in modes if m != "eager") + " |")
    lines.append("|---|---|" + "---|" * (2 * len(modes) - 1))
    for model, rows in summary.items():
        for b, row in rows.items():
            cells = [f"{row[m]['best_ms']:.1f}" if m in row else "–" for m in modes]
            cells += [f"{row[m]['best_ratio']:.2f}" if "best_ratio" in row.get(m, {}) else "–"
                      for m in modes if m != "eager"]
            lines.append(f"| {model} | {b} | " + " | ".join(cells) + " |")
    restarts = [(model, key, r) for model, res in result["models"].items() for key, r in res.get("restarts", {}).items()]
    if restarts:
        lines += ["", "| model | restart (mode@B) | start to ready s | of which warm-up s | first warm-up (cold cache) s |",
                  "|---|---|---|---|---|"]
        for model, key, r in restarts:
            label, _, b = key.partition("@")
            cold = result["models"][model]["points"].get(b, {}).get("warmup", {}).get(label, {}).get("warmup_s")
            if "error" in r:
                lines.append(f"| {model} | {key} | failed | | |")
            else:
                lines.append(f"| {model} | {key} | {r['load_s'] + r['warmup_s']:.1f} | {r['warmup_s']:.1f} | "
                             + (f"{cold:.1f}" if cold is not None else "–") + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    summary = summarise(result)
    models = list(summary)
    colours = {mode: f"C{i}" for i, mode in enumerate(result["modes"])}
    fig, axes = plt.subplots(2, len(models), figsize=(3.4 * len(models), 6.4), squeeze=False)
    for j, model in enumerate(models):
        rows = summary[model]
        bs = sorted(int(b) for b in rows)
        for mode in result["modes"]:
            pts = [(b, rows[str(b)][mode]) for b in bs if mode in rows[str(b)]]
            if not pts:
                continue
            x = [b for b, _ in pts]
            if mode != "eager" and all("ratio_median" in s for _, s in pts):
                # Medians of the rounds' ratios (solid) and the best iterations' ratio (dotted); the
                # min-max of the rounds is in the tables: on a shared machine it spans whole factors.
                axes[0][j].plot(x, [s["ratio_median"] for _, s in pts], marker="o", label=f"{mode} median",
                                color=colours[mode])
                axes[0][j].plot(x, [s["best_ratio"] for _, s in pts], marker=".", ls=":", label=f"{mode} best",
                                color=colours[mode])
            w = [(b, s["warmup_s"]) for b, s in pts if s.get("warmup_s")]
            if w:
                axes[1][j].plot([b for b, _ in w], [v for _, v in w], marker="o", label=mode, color=colours[mode])
        axes[0][j].axhline(1.0, color="grey", lw=0.8, ls="--")
        axes[0][j].set_ylim(0.2, 2.0)
        axes[0][j].set_yscale("log")
        axes[0][j].set_yticks([0.25, 0.5, 0.75, 1.0, 1.5, 2.0], ["0.25", "0.5", "0.75", "1", "1.5", "2"])
        axes[0][j].yaxis.set_minor_formatter(NullFormatter())
        axes[0][j].set_title(model)
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.set_xticks(bs, [str(b) for b in bs])
            ax.set_xlabel("B")
        axes[1][j].set_yscale("log")
    axes[0][0].set_ylabel("steady latency / eager")
    axes[1][0].set_ylabel("warm-up s (build + first batch)")
    axes[0][-1].legend(fontsize=7, loc="lower right", ncol=2)
    axes[1][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"graph backends, {result['threads']} threads, {result['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--child"]:
        return child_main()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--modes", default=",".join(MODES),
                    help="eager, torchscript, compile, export, aoti, " + ", ".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--round-s", type=float, default=0.6,
                    help="time per mode per round (iterations from the fastest first call)")
    ap.add_argument("--min-iters", type=int, default=1)
    ap.add_argument("--max-iters", type=int, default=8)
    ap.add_argument("--restart-batches", default="1", help="B at which cached modes are started again (empty: none)")
    ap.add_argument("--threads", type=int, default=min(2, len(os.sched_getaffinity(0))))
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--json-out", default=str(RESULTS / "graph.json"))
    ap.add_argument("--report", default=None, help="print the tables of a finished run's JSON, measure nothing")
    ap.add_argument("--plot", default=None, help="write a plot (PNG) of the run")
    args = ap.parse_args(argv)
    if args.report:
        result = json.loads(Path(args.report).read_text())
        print(report(result))
        if args.plot:
            plot(result, args.plot)
        return 0
    args.models = [m for m in args.models.split(",") if m]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.modes = [m for m in args.modes.split(",") if m]
    args.restart_batches = [int(b) for b in args.restart_batches.split(",") if b]
    cpus = sorted(os.sched_getaffinity(0))[:args.threads]
    import torch

    from optimizer.planning.profile import MachineInfo

    cache_dir = tempfile.mkdtemp(prefix="bench-graph-inductor-")
    result: dict[str, Any] = {
        "benchmark": "graph backends: warm-up and steady latency", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__, "machine": MachineInfo.current().model_dump(), "threads": args.threads,
        "cpus": cpus, "models_asked": args.models, "batches": args.batches, "modes": args.modes,
        "rounds": args.rounds, "round_s": args.round_s, "min_iters": args.min_iters, "max_iters": args.max_iters,
        "model_options": MODEL_OPTIONS, "commit": _commit(), "models": {},
    }
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(result, indent=1))

    started = time.monotonic()
    try:
        for model in args.models:
            bench_model(model, args, cpus, cache_dir, result, save)
    finally:
        result["wall_s"] = time.monotonic() - started
        save()
        shutil.rmtree(cache_dir, ignore_errors=True)
    print(report(result))
    if args.plot:
        plot(result, args.plot)
    print(f"written to {out} ({result['wall_s'] / 60:.1f} min)")
    return 0


def _commit() -> str | None:
    with contextlib.suppress(Exception):
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    return None


if __name__ == "__main__":
    sys.exit(main())
