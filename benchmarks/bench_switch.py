"""One active-passive change at a time, under a steady closed-loop load: what a switch that shares cores costs.

On a machine without free cores, an active-passive change starts (or
rebinds) its new instances on the cores of the ones they replace. Those
still answer what they hold after the switch. This benchmark makes the same
changes by hand, back and forth (``--a`` and ``--b``, the same B, other
thread counts), with ``N`` closed-loop clients keeping the service busy,
and measures each switch against the seconds before it:

- throughput and p50/p99 latency of the requests answered in the
  ``--window`` seconds after the change was asked for, and in the same
  window before it;
- the change's own timings from the model's history (decision to passive
  ready, ready to switch, switch to drained) and how long the handover held
  the new instances' first sub-batch (``held_s``).

Setups, interleaved ``A B B A`` over ``--rounds`` pairs: ``handover`` (the
default: a new instance on shared cores waits until the leaving ones have
drained) and ``side-by-side`` (``PACKRAT_HANDOVER_TIMEOUT_S=0``: they run
together, as before 2026-12-05). Spares are kept and pre-loaded, as in an
adaptive deployment, so a change rebinds loaded processes instead of
starting new ones.

Run: ``python -m benchmarks.bench_switch [--model resnet50] [--graph torchscript] [--a 2x16] [--b 2*1x8]
[--clients 24] [--switches 4] [--every 12] [--rounds 1]``; writes
``benchmarks/results/switch.json`` (or ``--name``).
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

os.environ.setdefault("PACKRAT_LOG_LEVEL", "WARNING")

from benchmarks.bench_adaptive import Monitor, percentile, start_up, wait_for_spares  # noqa: E402
from optimizer.calibration import example_payloads  # noqa: E402
from packrat_mq import control  # noqa: E402
from packrat_mq import graph as graph_modes  # noqa: E402
from packrat_mq.client import Client  # noqa: E402
from packrat_mq.connection import EmbeddedRedis, connect  # noqa: E402
from packrat_mq.keys import Keys  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SETUPS = {"handover": {}, "side-by-side": {"PACKRAT_HANDOVER_TIMEOUT_S": "0"}}


class ClosedLoop:
    """``clients`` threads, each sending one request and waiting for its reply, until stopped."""

    def __init__(self, url: str, prefix: str, model: str, payload: bytes, content_type: str, clients: int) -> None:
        self.url, self.prefix, self.model = url, prefix, model
        self.payload, self.content_type = payload, content_type
        #: (sent, received, instance, ok) of every reply, epoch seconds.
        self.done: list[tuple[float, float, str, bool]] = []
        self.sent = 0
        self.duplicated = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        client = Client(connect(self.url), prefix=self.prefix)
        try:
            while not self._stop.is_set():
                rid = f"s-{uuid.uuid4().hex[:12]}"
                sent = time.time()
                client.send(self.model, self.payload, content_type=self.content_type, request_id=rid)
                with self._lock:
                    self.sent += 1
                replies = client.gather([rid], timeout=120)
                with self._lock:
                    self.duplicated += max(0, len(replies) - 1)
                    for rep in replies:
                        self.done.append((sent, rep.received_at, rep.fields.get("instance", ""), rep.ok))
        finally:
            client.close()

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)


def window(done: list[tuple[float, float, str, bool]], start: float, end: float) -> dict[str, Any]:
    """Replies received within [start, end): how many a second, and the latency of those requests."""
    got = [(s, e) for s, e, _, ok in done if start <= e < end and ok]
    ms = [(e - s) * 1000.0 for s, e in got]
    return {"replies_per_s": len(got) / (end - start), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
            "n": len(got)}


def run_setup(name: str, args: argparse.Namespace, url: str) -> dict[str, Any]:
    prefix = f"bench-switch-{uuid.uuid4().hex[:6]}"
    cmd = [sys.executable, "-m", "packrat_mq", "up", "--model", args.model, "--instances", args.a,
           "--redis-url", url, "--prefix", prefix]
    if args.graph != "eager":
        cmd += ["--graph", args.graph]
    env = dict(os.environ, PACKRAT_LOG_LEVEL="WARNING", PACKRAT_SPARE_INSTANCES=str(args.spares),
               PACKRAT_PREWARM_SPARES="1", PACKRAT_PREWARM_MAX_CPU="1", **SETUPS[name])
    proc, lines = start_up(name, cmd, env)
    spares_s = wait_for_spares(url, prefix, args.model)
    print(f"[{name}] serving {args.a}; spares loaded after {spares_s or 0:.1f} s", flush=True)
    payload, ctype = example_payloads(args.model, 1)[0]
    load = ClosedLoop(url, prefix, args.model, payload, ctype, args.clients)
    monitor = Monitor(url, prefix, args.model)
    r = connect(url)
    keys = Keys(prefix)
    asked: list[tuple[float, str]] = []
    began = time.time()
    try:
        monitor.start()
        load.start()
        time.sleep(args.warmup)
        for k in range(args.switches):
            target = args.b if k % 2 == 0 else args.a
            asked.append((time.time(), target))
            control.send(r, keys, control.ControlMessage(id=control.new_id(), model=args.model, instances=target,
                                                         reason=f"bench: switch {k + 1}", origin="bench"))
            time.sleep(args.every)
    finally:
        load.stop()
        monitor.stop_event.set()
        monitor.join(5)
        monitor.collect_history()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        r.close()
    history = [monitor.history[k] for k in sorted(monitor.history)]
    switches = []
    for (at, target), entry in zip(asked, history):
        switches.append({
            "to": target, "asked_s": round(at - began, 2), "kind": entry.get("kind"),
            "handover": entry.get("handover"), "held_s": entry.get("held_s"),
            "decision_to_ready_s": entry.get("decision_to_ready_s"), "ready_to_switch_s": entry.get("ready_to_switch_s"),
            "switch_to_drained_s": entry.get("switch_to_drained_s"), "total_s": entry.get("total_s"),
            "oversubscribed_s": entry.get("oversubscribed_s"), "reused": entry.get("reused"),
            "before": window(load.done, at - args.window, at), "after": window(load.done, at, at + args.window),
        })
    answered = len({(s, e) for s, e, _, _ in load.done})
    result = {"setup": name, "sent": load.sent, "answered": len(load.done), "duplicated": load.duplicated,
              "errors": sum(1 for *_, ok in load.done if not ok), "unanswered": load.sent - answered,
              "switches": switches, "spares_loaded_s": spares_s, "log_tail": lines[-20:]}
    for sw in switches:
        b, a = sw["before"], sw["after"]
        print(f"[{name}] -> {sw['to']:<8} {sw['kind']}: drained {sw['switch_to_drained_s']} s, held {'-' if sw['held_s'] is None else sw['held_s']} s; "
              f"replies/s {b['replies_per_s']:.1f} -> {a['replies_per_s']:.1f}, "
              f"p50 {b['p50_ms'] or 0:.0f} -> {a['p50_ms'] or 0:.0f} ms, p99 {b['p99_ms'] or 0:.0f} -> {a['p99_ms'] or 0:.0f} ms",
              flush=True)
    return result


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setup, over every switch of every run: the after-window's throughput and latency, as medians."""
    out: dict[str, Any] = {}
    for name in SETUPS:
        sw = [s for run in runs if run["setup"] == name for s in run["switches"]]
        if not sw:
            continue

        def med(key: str, side: str) -> float | None:
            vals = [s[side][key] for s in sw if s[side][key] is not None]
            return round(statistics.median(vals), 2) if vals else None

        drained = [s["switch_to_drained_s"] for s in sw if s["switch_to_drained_s"] is not None]
        out[name] = {"switches": len(sw),
                     "after_replies_per_s": med("replies_per_s", "after"),
                     "before_replies_per_s": med("replies_per_s", "before"),
                     "after_p50_ms": med("p50_ms", "after"), "after_p99_ms": med("p99_ms", "after"),
                     "before_p50_ms": med("p50_ms", "before"), "before_p99_ms": med("p99_ms", "before"),
                     "switch_to_drained_s": round(statistics.median(drained), 2) if drained else None}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--graph", nargs="?", const="graph", default="torchscript")
    p.add_argument("--a", default="2x16", help="the configuration served first (and after every second switch)")
    p.add_argument("--b", default="2*1x8", help="the configuration switched to")
    p.add_argument("--clients", type=int, default=24, help="closed-loop clients: enough to keep a batch waiting")
    p.add_argument("--spares", type=int, default=2, help="spare instances kept loaded (PACKRAT_SPARE_INSTANCES)")
    p.add_argument("--warmup", type=float, default=12.0, help="seconds of load before the first switch")
    p.add_argument("--switches", type=int, default=4)
    p.add_argument("--every", type=float, default=12.0, help="seconds between switches")
    p.add_argument("--window", type=float, default=5.0, help="seconds before and after each switch that are compared")
    p.add_argument("--rounds", type=int, default=1, help="pairs of runs, A B B A ...")
    p.add_argument("--setups", default="handover,side-by-side")
    p.add_argument("--name", default="switch")
    args = p.parse_args(argv)
    args.graph = graph_modes.resolve(args.graph, args.model)
    names = args.setups.split(",")
    order: list[str] = []
    for k in range(args.rounds):
        order += names if k % 2 == 0 else list(reversed(names))
    runs = []
    with EmbeddedRedis(announce=False) as server:
        for name in order:
            runs.append(run_setup(name, args, server.url))
    results = {"benchmark": "switch", "model": args.model, "graph": args.graph, "a": args.a, "b": args.b,
               "clients": args.clients, "every_s": args.every, "window_s": args.window, "order": order,
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": runs, "summary": summarise(runs)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.name}.json"
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results["summary"], indent=1))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
