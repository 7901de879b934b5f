"""Our choice against the usual alternatives, measured side by side as served.

For each model and aggregated batch B, on this machine's T cores:

- **chosen**: the optimizer's configuration from ``profiles/<model>.json``
  (with its predicted latency);
- **all-thread**: one instance with T threads taking the whole batch, what
  PyTorch and TorchServe do by default;
- **single-thread**: T one-thread instances sharing the batch (B of them when
  B < T);
- **best measured**: the fastest of every configuration measured for that B.

Each configuration is served for real (embedded Redis, dispatcher, pinned
worker processes) and timed over aggregated batches sent at once: batch
latency is from the first request sent to the last reply received. Instances
with the same thread counts are started once per model and given new batch
shares per B (``Supervisor.reshare``), as a live re-split would do, so a model's
weights load three times, not once per configuration.

Run: ``python -m benchmarks.bench_configs [--models resnet50,bert] [--batches 1,2,4] [--rounds 10]``.
Writes ``benchmarks/results/configs.json`` and ``configs.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("PACKRAT_LOG_LEVEL", "WARNING")

from optimizer.calibration import WARMUP_S, Measured, example_payloads, time_batches  # noqa: E402
from optimizer.planning.profile import Profile, resolve_profile_path  # noqa: E402
from optimizer.planning.solving import solve  # noqa: E402
from packrat_mq.client import Client  # noqa: E402
from packrat_mq.connection import EmbeddedRedis, connect  # noqa: E402
from packrat_mq.instances import Configuration, InstanceSpec  # noqa: E402
from packrat_mq.settings import Settings  # noqa: E402
from packrat_mq.topology import Topology  # noqa: E402
from workers.supervisor import Supervisor  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: Issue 8's target: a profile's prediction within 10% of what the service delivers.
PREDICTION_TARGET = 0.10


def profiles_used(models: list[str], paths: dict[str, Path] | None = None) -> dict[str, dict[str, Any]]:
    """Which profile each model was planned from: placement, mode, machine and when, so a figure says what it tested."""
    out = {}
    for model in models:
        path = (paths or {}).get(model) or resolve_profile_path(model)
        prof = Profile.load(path)
        out[model] = {"path": str(path), "placement": prof.placement, "mode": prof.mode,
                      "cpu": prof.machine.cpu_model if prof.machine else None,
                      "profiled": prof.machine.date if prof.machine else None}
    return out


def strategies(profile: Profile, threads: int, batch: int) -> dict[str, Configuration]:
    chosen = solve(profile, threads, batch)
    singles = min(threads, batch)
    base, extra = divmod(batch, singles)
    single = Configuration(instances=tuple(
        InstanceSpec(threads=1, batch=base + (1 if j < extra else 0)) for j in range(singles)))
    return {"chosen": chosen, "all-thread": Configuration.uniform(1, threads, batch), "single-thread": single}


def _ordered(config: Configuration) -> Configuration:
    """Instances by threads, descending: the order a shared pool is started in."""
    return Configuration(instances=tuple(sorted(config.instances, key=lambda i: (-i.threads, -i.batch))),
                         predicted_latency_ms=config.predicted_latency_ms)


def profile_now(url: str, model: str, directory: Path, batches: list[int], extra: list[str] | None = None) -> Path:
    """Profile ``model`` here and now, and its serving path, as a user would (``profile run --fresh``, then
    ``profile path``), into ``directory``; returns the profile's path.

    The prediction is what a profile says of serving, and a shared host
    drifts: on 2026-12-03 the same MiniLM profiled 5-22% slower at 12:57
    than at 06:36, and a profile taken before all four models are served
    is 13 minutes old by the fourth. Profiled right before its model is
    served, the comparison holds the profile to its own minutes. ``extra``:
    more ``profile run`` arguments (``--profile-args="--passes 3"``).
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{model}.json"
    exe = [sys.executable, "-m", "packrat_mq"]
    started = time.monotonic()
    subprocess.run(exe + ["profile", "run", "--model", model, "--fresh", "--batches", ",".join(map(str, batches)),
                          "-o", str(path), *(extra or [])], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(exe + ["profile", "path", "--model", model, "--profile", str(path), "--max-batch",
                          str(max(batches)), "--redis-url", url, "--prefix", f"bench-path-{model}"],
                   check=True, stdout=subprocess.DEVNULL)
    print(f"[{model}] profiled now in {time.monotonic() - started:.0f} s: {path}", file=sys.stderr, flush=True)
    return path


def bench_model(url: str, model: str, threads: int, batches: list[int], rounds: int, warmup: int,
                warmup_s: float = WARMUP_S, measure_s: float = 0.0,
                profile_path: Path | None = None) -> list[dict[str, Any]]:
    profile = Profile.load(profile_path or resolve_profile_path(model))
    plans: dict[tuple[int, ...], list[tuple[int, str, Configuration]]] = defaultdict(list)
    for b in batches:
        for name, config in strategies(profile, threads, b).items():
            config = _ordered(config)
            plans[tuple(i.threads for i in config.instances)].append((b, name, config))
    payloads = {b: example_payloads(model, b) for b in batches}
    measured: dict[tuple[int, str], Measured] = {}
    settings = Settings(redis_url=url, batch_timeout_ms=50.0, prefix=f"bench-{model}")
    r = connect(url)
    for thread_counts, runs in plans.items():
        first = runs[0][2]
        print(f"[{model}] starting instances with threads {list(thread_counts)}", file=sys.stderr, flush=True)
        with Supervisor(r, settings, url, model, first) as service:
            client = Client(connect(url), prefix=settings.prefix)
            done: dict[tuple[int, str], Measured] = {}
            for b, name, config in runs:
                same = next((m for (bb, _), m in done.items() if bb == b and str(m.configuration) == str(config)), None)
                if same is not None:  # e.g. chosen == single-thread: one measurement serves both
                    measured[(b, name)] = same
                    continue
                service.reshare(config)
                m = Measured(configuration=config, predicted_ms=config.predicted_latency_ms)
                time_batches(client, model, payloads[b], m, rounds=rounds, warmup=warmup, warmup_s=warmup_s,
                             measure_s=measure_s)
                measured[(b, name)] = done[(b, name)] = m
                print(f"[{model}] B={b:<3} {name:<14} {str(config):<14} p50 {m.p50_ms:8.2f} ms", file=sys.stderr, flush=True)
            client.close()
    rows = []
    for b in batches:
        row: dict[str, Any] = {"model": model, "threads": threads, "batch": b}
        for name in ("chosen", "all-thread", "single-thread"):
            m = measured[(b, name)]
            row[name] = m.as_dict()
        best_name = min(("chosen", "all-thread", "single-thread"), key=lambda n: measured[(b, n)].p50_ms)
        row["best_measured"] = best_name
        row["speedup_vs_all_thread"] = measured[(b, "all-thread")].p50_ms / measured[(b, "chosen")].p50_ms
        predicted = measured[(b, "chosen")].predicted_ms
        # What the profile is worth: the chosen plan's predicted latency against the served one,
        # with the serving path the profile measured (`profile path`) when it has one.
        serving = profile.service_latency_ms(predicted, b)
        row["path_ms"] = profile.path_cost_ms(b)
        row["predicted_serving_ms"] = serving
        row["prediction_error_handler_only"] = measured[(b, "chosen")].p50_ms / predicted - 1.0 if predicted else None
        row["prediction_error"] = measured[(b, "chosen")].p50_ms / serving - 1.0 if serving else None
        row.update(split_miss(measured[(b, "chosen")], predicted))
        rows.append(row)
    return rows


def split_miss(m: Measured, predicted_ms: float | None) -> dict[str, float | None]:
    """Where a miss is: the served handler against its profile, and the rest of the batch against the path's cost.

    ``handler_error`` is the slowest instance's served ``inference_ms``
    (p50 over batches) against the profile's prediction for it; ``served_path_ms``
    is the served p50 less that handler p50, to hold against ``path_ms`` (what
    ``profile path`` measured). A miss in the first is the handler running
    slower or faster served than profiled (the host, co-location with the
    path's processes, a gap before each batch); in the second, the path.
    """
    handler = m.handler_p50_ms
    if handler is None or not m.latencies_ms:
        return {"handler_p50_ms": None, "handler_error": None, "served_path_ms": None}
    return {"handler_p50_ms": handler,
            "handler_error": handler / predicted_ms - 1.0 if predicted_ms else None,
            "served_path_ms": m.p50_ms - handler}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return
    models = sorted({r["model"] for r in rows})
    fig = Figure(figsize=(4.2 * len(models), 3.6))
    for k, model in enumerate(models):
        ax = fig.add_subplot(1, len(models), k + 1)
        mine = [r for r in rows if r["model"] == model]
        xs = [r["batch"] for r in mine]
        for name, style in (("chosen", "o-"), ("all-thread", "s--"), ("single-thread", "^:")):
            ax.plot(xs, [r[name]["measured_p50_ms"] for r in mine], style, label=name)
        predicted = [(r["batch"], r.get("predicted_serving_ms")) for r in mine]
        if any(ms is not None for _, ms in predicted):
            ax.plot([b for b, ms in predicted if ms is not None], [ms for _, ms in predicted if ms is not None],
                    "x", color="black", label="chosen, predicted")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{model} (T={mine[0]['threads']})")
        ax.set_xlabel("aggregated batch B")
        if k == 0:
            ax.set_ylabel("batch latency p50 (ms)")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as the Markdown table of docs/figures.md."""
    def p50(m: dict[str, Any]) -> str:
        return f"{m['measured_p50_ms']:.1f} ({m['measured_p10_ms']:.1f}–{m['measured_p90_ms']:.1f})"

    lines = ["| model | B | chosen | predicted ms (slowest instance + path) | chosen p50 (p10–p90) | prediction error "
             "| all-thread p50 (p10–p90) | T one-thread p50 | all-thread / chosen |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, a, s = r["chosen"], r["all-thread"], r["single-thread"]
        err = f"{r['prediction_error']:+.1%}" if r.get("prediction_error") is not None else "-"
        path = f" + {r['path_ms']:.1f}" if r.get("path_ms") is not None else ""
        lines.append(f"| {r['model']} | {r['batch']} | `{c['configuration']}` | {c['predicted_ms'] or float('nan'):.1f}{path} "
                     f"| {p50(c)} | {err} | {p50(a)} | {s['measured_p50_ms']:.1f} (`{s['configuration']}`) "
                     f"| {r['speedup_vs_all_thread']:.2f}× |")
    if any(r.get("handler_error") is not None for r in rows):
        lines += ["", "| model | B | chosen | profiled slowest instance ms | served handler p50 ms | handler error "
                  "| path ms (`profile path`) | served p50 less handler p50 ms |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r.get("handler_error") is None:
                continue
            c = r["chosen"]
            path = f"{r['path_ms']:.1f}" if r.get("path_ms") is not None else "-"
            lines.append(f"| {r['model']} | {r['batch']} | `{c['configuration']}` | {c['predicted_ms']:.1f} "
                         f"| {r['handler_p50_ms']:.1f} | {r['handler_error']:+.1%} | {path} | {r['served_path_ms']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert,gpt2,minilm")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--threads", type=int, default=None, help="T (default: cores of one socket)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="warm-up batches per configuration (at least --warmup-s)")
    ap.add_argument("--warmup-s", type=float, default=WARMUP_S, help="seconds of warm-up at least (default %(default)s)")
    ap.add_argument("--measure-s", type=float, default=2.0,
                    help="seconds of timed batches at least, past --rounds (default %(default)s: a small model's "
                         "ten batches are tens of milliseconds)")
    ap.add_argument("--json-out", default=str(RESULTS / "configs.json"))
    ap.add_argument("--profile-now", type=Path, default=None, metavar="DIR",
                    help="profile each model (and its path) into DIR right before serving it, and plan and predict "
                         "from that profile instead of the committed one")
    ap.add_argument("--profile-args", default="", metavar="ARGS",
                    help="with --profile-now: more `profile run` arguments, written with = since they begin with a dash: "
                         "--profile-args=\"--quick --passes 3\"")
    ap.add_argument("--report", type=Path, default=None,
                    help="print the Markdown table of a finished run's JSON and exit (measures nothing)")
    ap.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                    help="with --report: draw that run's plot to FILE.png too")
    args = ap.parse_args(argv)
    if args.report:
        rows = json.loads(args.report.read_text())["rows"]
        print(markdown(rows))
        if args.plot:
            plot(rows, args.plot)
        return 0
    threads = args.threads or Topology.detect().max_cores_per_socket
    batches = [int(x) for x in args.batches.split(",")]
    rows: list[dict[str, Any]] = []
    started = time.time()
    fresh: dict[str, Path] = {}
    with EmbeddedRedis(announce=False) as server:
        for model in args.models.split(","):
            if args.profile_now is not None:
                fresh[model] = profile_now(server.url, model, args.profile_now, batches,
                                           shlex.split(args.profile_args))
            rows.extend(bench_model(server.url, model, threads, batches, args.rounds, args.warmup, args.warmup_s,
                                    args.measure_s, profile_path=fresh.get(model)))
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = [abs(r["prediction_error"]) for r in rows if r["prediction_error"] is not None]
    within = sum(e <= PREDICTION_TARGET for e in errors)
    out.write_text(json.dumps({"benchmark": "configurations", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "cpus": os.cpu_count(), "threads": threads, "rounds": args.rounds, "warmup": args.warmup,
                               "warmup_s": args.warmup_s, "measure_s": args.measure_s,
                               "profiles": profiles_used(args.models.split(","), fresh),
                               "profiled_now": args.profile_now is not None,
                               "profile_args": args.profile_args,
                               "prediction_within_10pct": f"{within} of {len(errors)}",
                               "elapsed_s": time.time() - started, "rows": rows}, indent=2))
    plot(rows, out.with_suffix(".png"))
    print(f"{'model':<9} {'B':>3} {'chosen':<14} {'pred ms':>8} {'chosen p50':>11} {'pred err':>8} "
          f"{'all-thread':>11} {'1-thread x T':>12} {'speed-up':>8}  best")
    for r in rows:
        c, a, s = r["chosen"], r["all-thread"], r["single-thread"]
        err = f"{r['prediction_error']:+.1%}" if r["prediction_error"] is not None else "-"
        print(f"{r['model']:<9} {r['batch']:>3} {c['configuration']:<14} {c['predicted_ms'] or float('nan'):>8.2f} "
              f"{c['measured_p50_ms']:>11.2f} {err:>8} {a['measured_p50_ms']:>11.2f} {s['measured_p50_ms']:>12.2f} "
              f"{r['speedup_vs_all_thread']:>7.2f}x  {r['best_measured']}")
    print(f"chosen configuration's predicted latency within {PREDICTION_TARGET:.0%} of the served p50: "
          f"{within} of {len(errors)}")
    print(f"written to {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
