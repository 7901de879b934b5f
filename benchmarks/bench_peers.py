"""packrat-mq side by side with TorchServe: the same model, batch settings, load and machine.

Both servers serve the same TorchScript ResNet-50 (torchvision, random weights,
traced and frozen by the zoo handler: ``benchmarks/peers/export.py``) to the
same load generator (``benchmarks/peers/load.py``): N closed-loop clients, one
process each, sending a 602 KB float32 ``.npy`` image (3x224x224), a warm-up,
then a measured period, then an idle probe (one client, one request at a time).

Setups, with T the CPUs this process may run on (``os.sched_getaffinity``):

- ``torchserve``: TorchServe, 1 worker x T threads, ``batch_size`` B, ``max_batch_delay`` W;
- ``packrat-layout``: ``packrat-mq up --graph torchscript --instances TxB`` (the same layout), batch timeout W;
- ``packrat-auto``: ``packrat-mq up --graph torchscript --threads T --batch B`` (the optimizer's choice), W;
- ``packrat-adaptive``: ``packrat-mq up --graph torchscript --threads T`` (no ``--batch``: the estimator
  chooses B from the load, starting at 1), W;
- ``packrat-auto-shm``: ``packrat-auto`` with the clients' images in shared memory
  (``Client(shared_memory=True)``: producers on the serving host; a ``/dev/shm`` directory per run);
- ``packrat-auto-sealed``: ``packrat-auto`` with the clients' images in sealed memfds that the
  workers map (``Client(shared_memory="sealed")``: producers on the serving host, no directory);
- ``torchserve-b1``: TorchServe, 1 worker x T threads, B=1;
- ``packrat-b1``: ``packrat-mq up --graph torchscript --instances Tx1``, no batch wait;
- ``packrat-b1-shm``: ``packrat-b1`` with the images in shared memory;
- ``packrat-b1-sealed``: ``packrat-b1`` with the images in sealed memfds;
- ``packrat-b1-glibc``: ``packrat-b1`` with glibc's own malloc policy in the instances
  (``PACKRAT_MALLOC_RETAIN_MB=0``), the A/B of that setting;
- ``packrat-reserved`` (T ≥ 2): ``packrat-mq up --graph torchscript --threads T-1 --batch B``: the
  optimizer's choice on one core fewer, that core left to Redis, the dispatcher and the clients.

Setups run one after the other, in interleaved rounds, the order rotated one
place per round (A, B, C; B, C, A; ...), each server started before its turn
and stopped after it, so drift of a shared machine hits them alike. Ratios packrat-mq / TorchServe are taken within
a round. TorchServe runs from its own virtual environment (``.venv-peers``,
pinned in ``benchmarks/peers/constraints.txt``, with the project's torch), never
the project's.

Run: ``make bench-peers`` (installs the peers environment first), or
``python -m benchmarks.bench_peers [--quick] [--rounds 2] [--markdown]``;
``--report benchmarks/results/peers.json --markdown`` prints the tables of a
finished run for the README. Writes ``benchmarks/results/peers.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import psutil

from benchmarks.peers.archive import build_store
from benchmarks.peers.load import closed_loop, npy_image
from benchmarks.peers.servers import PackratUp, TorchServe
from optimizer.planning.profile import MachineInfo

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PEERS_VENV = ROOT / ".venv-peers"
MODEL = "resnet50"


@dataclass(frozen=True)
class Setup:
    """One server configuration; ``peer`` is the TorchServe setup a packrat-mq one is compared with."""

    key: str
    server: str
    threads: int
    batch: int
    wait_ms: float
    args: tuple[str, ...] = ()
    peer: str | None = None
    note: str = ""
    #: Clients put the images in shared memory instead of Redis, producers on the serving host: True, in
    #: payload files (``payload_shm``); ``"sealed"``, in sealed memfds the workers map (``payload_fd``).
    shm: bool | Literal["sealed"] = False
    #: Settings of the packrat-mq processes, as environment variables (``PACKRAT_...``): an A/B of one setting.
    env: tuple[tuple[str, str], ...] = ()

    def label(self, markdown: bool = False) -> str:
        wait = f"{self.wait_ms:g} ms wait" if self.wait_ms else "no wait"
        if self.server == "torchserve":
            return f"TorchServe, 1 worker x {self.threads} threads, B={self.batch}, {wait}"
        command = " ".join(("up", "--graph torchscript", *self.args))
        return (f"packrat-mq {f'`{command}`' if markdown else command}"
                + (f" ({self.note})" if self.note else "") + f", {wait}")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "label": self.label(), "markdown_label": self.label(markdown=True)}


def make_setups(threads: int, batch: int, wait_ms: float) -> list[Setup]:
    t, b = threads, batch
    return [
        Setup("torchserve", "torchserve", t, b, wait_ms),
        Setup("packrat-layout", "packrat", t, b, wait_ms, ("--instances", f"{t}x{b}"), "torchserve", "same layout"),
        Setup("packrat-auto", "packrat", t, b, wait_ms, ("--threads", str(t), "--batch", str(b)), "torchserve",
              "optimizer's choice"),
        # No --batch: the estimator chooses B from the load, from B=1 (the default of `up`).
        Setup("packrat-adaptive", "packrat", t, b, wait_ms, ("--threads", str(t)), "torchserve", "adaptive B"),
        # The same choice with the clients' images in shared memory, not in Redis (the same host).
        Setup("packrat-auto-shm", "packrat", t, b, wait_ms, ("--threads", str(t), "--batch", str(b)), "torchserve",
              "optimizer's choice, images in shared memory", shm=True),
        # The same with sealed memfds, which the workers map instead of reading (Client(shared_memory="sealed")).
        Setup("packrat-auto-sealed", "packrat", t, b, wait_ms, ("--threads", str(t), "--batch", str(b)), "torchserve",
              "optimizer's choice, images in sealed memfds", shm="sealed"),
        Setup("torchserve-b1", "torchserve", t, 1, 0.0),
        Setup("packrat-b1", "packrat", t, 1, 0.0, ("--instances", f"{t}x1"), "torchserve-b1"),
        Setup("packrat-b1-shm", "packrat", t, 1, 0.0, ("--instances", f"{t}x1"), "torchserve-b1",
              "images in shared memory", shm=True),
        Setup("packrat-b1-sealed", "packrat", t, 1, 0.0, ("--instances", f"{t}x1"), "torchserve-b1",
              "images in sealed memfds", shm="sealed"),
        # packrat-b1 with glibc's own malloc policy in the instances (malloc_retain_mb 0): the setting's A/B.
        Setup("packrat-b1-glibc", "packrat", t, 1, 0.0, ("--instances", f"{t}x1"), "torchserve-b1",
              "PACKRAT_MALLOC_RETAIN_MB=0", env=(("PACKRAT_MALLOC_RETAIN_MB", "0"),)),
    ] + ([
        # Issue 8's question for small machines: does a core kept from the instances, for Redis, the
        # dispatcher and the clients (unpinned, so the scheduler puts them there), pay?
        Setup("packrat-reserved", "packrat", t, b, wait_ms, ("--threads", str(t - 1), "--batch", str(b)),
              "torchserve", "one core kept for Redis and the dispatcher"),
    ] if t >= 2 else [])


# --- machine and versions ---------------------------------------------------
def machine_info(venv: Path) -> dict[str, Any]:
    peers = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import json; from importlib import metadata as m; "
         "print(json.dumps({p: m.version(p) for p in ('torch', 'torchserve', 'torch-model-archiver', 'numpy')}))"],
        capture_output=True, text=True, check=True)
    java = subprocess.run(["java", "-version"], capture_output=True, text=True)
    here = MachineInfo.current()
    return {
        # The same reading a profile records, so a run and a profile can be matched by CPU design.
        "cpu": here.cpu_model or platform.processor() or "unknown",
        "cpu_id": here.cpu_id,
        "cpu_isa": list(here.cpu_isa) if here.cpu_isa is not None else None,
        "usable_cpus": len(os.sched_getaffinity(0)),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "project": {p: metadata.version(p) for p in ("torch", "torchvision", "numpy", "redis")},
        "peers_venv": json.loads(peers.stdout),
        "java": (java.stderr or java.stdout).splitlines()[0] if (java.stderr or java.stdout) else "unknown",
        "packrat_env": {k: v for k, v in os.environ.items() if k.startswith("PACKRAT_")},
    }


# --- running ----------------------------------------------------------------
def run_setup(setup: Setup, round_no: int, args: argparse.Namespace, workdir: Path, payload: bytes,
              stores: dict[tuple[int, float], Path]) -> dict[str, Any]:
    rundir = workdir / f"round{round_no}-{setup.key}"
    server: TorchServe | PackratUp
    if setup.server == "torchserve":
        server = TorchServe(args.peers_venv, stores[(setup.batch, setup.wait_ms)], rundir, model=MODEL,
                            threads=setup.threads)
    else:
        server = PackratUp(rundir, model=MODEL, args=list(setup.args), batch_timeout_ms=setup.wait_ms, shm=setup.shm,
                           extra_env=dict(setup.env))
    row: dict[str, Any] = {"round": round_no, "setup": setup.key, "label": setup.label()}
    started = time.monotonic()
    with server as target:
        row["ready_s"] = time.monotonic() - started
        if isinstance(server, PackratUp):
            row["configuration"] = server.configuration
        load = closed_loop(target, payload, clients=args.clients, warmup_s=args.warmup, measure_s=args.measure)
        if isinstance(server, PackratUp):
            row["changes_under_load"] = _changes(server.reconfigurations())
        idle = closed_loop(target, payload, clients=1, warmup_s=args.idle_warmup, measure_s=args.idle_measure)
        if isinstance(server, PackratUp):
            row["changes"] = _changes(server.reconfigurations())
    row["load"] = load.summary()
    row["idle"] = idle.summary()
    row["killed_at_stop"] = server.killed
    return row


def _changes(history: list[dict[str, Any]]) -> list[str]:
    """Each reconfiguration as ``from -> to (reason)``: an adaptive setup's B under load and at idle."""
    return [f"{e.get('from')} -> {e.get('to')} ({e.get('reason') or e.get('origin')}; "
            f"{e.get('kind', '?')}, {e.get('reused', 0)} from spares, {_took(e)})" for e in history]


def _took(entry: dict[str, Any]) -> str:
    """How long a change took (its history entry's ``total_s``: decision to old instances stopped)."""
    total = entry.get("total_s")
    return f"{total:.1f} s" if isinstance(total, (int, float)) else str(entry.get("status", "?"))


def ratios(rows: list[dict[str, Any]], setups: list[Setup]) -> list[dict[str, Any]]:
    """packrat-mq / TorchServe per round, for every packrat-mq setup whose peer ran in that round."""
    by = {(r["round"], r["setup"]): r for r in rows if "load" in r}
    out = []
    for s in setups:
        for rnd in sorted({r["round"] for r in rows}):
            mine, theirs = by.get((rnd, s.key)), by.get((rnd, s.peer))
            if s.peer is None or mine is None or theirs is None:
                continue
            out.append({"round": rnd, "setup": s.key, "peer": s.peer,
                        **{name: _ratio(mine, theirs, section, figure) for name, (section, figure) in RATIOS.items()}})
    return out


#: Ratio name -> (section, figure) of a run.
RATIOS = {"p50": ("load", "p50_ms"), "p90": ("load", "p90_ms"), "p99": ("load", "p99_ms"),
          "requests_per_s": ("load", "requests_per_s"), "idle_p50": ("idle", "p50_ms")}


def _ratio(mine: dict[str, Any], theirs: dict[str, Any], section: str, figure: str) -> float | None:
    a, b = mine[section].get(figure), theirs[section].get(figure)
    return a / b if a is not None and b else None


# --- reporting --------------------------------------------------------------
def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def text_tables(result: dict[str, Any]) -> str:
    lines = [f"{'rnd':>3}  {'setup':<15} {'config':<10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
             f"{'req/s':>6} {'idle p50':>8} {'errors':>6}"]
    for r in result["runs"]:
        if "load" not in r:
            lines.append(f"{r['round']:>3}  {r['setup']:<15} failed: {r.get('error', '?')}")
            continue
        ld, idle = r["load"], r["idle"]
        lines.append(f"{r['round']:>3}  {r['setup']:<15} {r.get('configuration') or '-':<10} "
                     f"{_f(ld['p50_ms']):>8} {_f(ld['p90_ms']):>8} {_f(ld['p99_ms']):>8} "
                     f"{_f(ld['requests_per_s']):>6} {_f(idle['p50_ms']):>8} {ld['errors'] + idle['errors']:>6}")
    if result["ratios"]:
        lines += ["", "packrat-mq / TorchServe, same round (below 1 is better for latency, above 1 for req/s)",
                  f"{'rnd':>3}  {'setup':<15} {'vs':<14} {'p50':>6} {'p90':>6} {'p99':>6} {'req/s':>6} {'idle p50':>8}"]
        for q in result["ratios"]:
            lines.append(f"{q['round']:>3}  {q['setup']:<15} {q['peer']:<14} {_f(q['p50'], 2):>6} "
                         f"{_f(q['p90'], 2):>6} {_f(q['p99'], 2):>6} {_f(q['requests_per_s'], 2):>6} "
                         f"{_f(q['idle_p50'], 2):>8}")
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    """Tables for the README: one cell per figure, rounds separated by ' / '."""
    runs = result["runs"]  # a failed run shows as "-" in its round's place
    opts, machine = result["options"], result["machine"]
    keys = list(dict.fromkeys(r["setup"] for r in runs))
    labels = {s["key"]: s["markdown_label"] for s in result["setups"]}

    def cells(key: str, section: str, figure: str, digits: int = 0) -> str:
        return " / ".join(_f(r[section][figure] if "load" in r else None, digits) for r in runs if r["setup"] == key)

    def errors(key: str) -> str:
        return " / ".join(str(r["load"]["errors"] + r["idle"]["errors"]) if "load" in r else "-"
                          for r in runs if r["setup"] == key)

    def label(key: str) -> str:
        configs = sorted({r["configuration"] for r in runs if r["setup"] == key and r.get("configuration")})
        chosen = f" → {', '.join(configs)}" if key in ("packrat-auto", "packrat-reserved") and configs else ""
        # An adaptive setup: the configurations it changed to under load (per round).
        moved = [" ".join(c.split(" (")[0].split(" -> ")[1]
                          + (" in " + c.rsplit(", ", 1)[-1].rstrip(")") if " from spares, " in c else "")
                          for c in r.get("changes_under_load") or [])
                 for r in runs if r["setup"] == key and "changes_under_load" in r]
        went = f" → under load {' / '.join(m or 'no change' for m in moved)}" if any(moved) else ""
        return labels.get(key, key) + chosen + went

    out = [
        f"{machine['cpu']}, {machine['usable_cpus']} CPUs; ResNet-50 TorchScript (traced, frozen), "
        f"{opts['clients']} closed-loop clients sending a 602 KB float32 .npy image; "
        f"{opts['rounds']} interleaved round(s) of {opts['warmup']:g} s warm-up + {opts['measure']:g} s measured; "
        f"idle: one request at a time for {opts['idle_measure']:g} s. TorchServe {machine['peers_venv']['torchserve']}, "
        f"torch {machine['peers_venv']['torch']} in both. Values per round, separated by ' / '.",
        "",
        "| setup | p50 ms | p90 ms | p99 ms | req/s | idle p50 ms | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in keys:
        out.append(f"| {label(key)} | {cells(key, 'load', 'p50_ms')} | {cells(key, 'load', 'p90_ms')} | "
                   f"{cells(key, 'load', 'p99_ms')} | {cells(key, 'load', 'requests_per_s', 1)} | "
                   f"{cells(key, 'idle', 'p50_ms')} | {errors(key)} |")
    if result["ratios"]:
        out += ["", "| packrat-mq / TorchServe (same round) | p50 | p90 | p99 | req/s | idle p50 |",
                "|---|---|---|---|---|---|"]
        for key in dict.fromkeys(q["setup"] for q in result["ratios"]):
            qs = [q for q in result["ratios"] if q["setup"] == key]
            cols = [" / ".join(_f(q[name], 2) for q in qs) for name in RATIOS]
            out.append(f"| {key} / {qs[0]['peer']} | " + " | ".join(cols) + " |")
    return "\n".join(out)


def left_behind() -> list[str]:
    """This process's descendants still running, but multiprocessing's own resource tracker."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "multiprocessing.resource_tracker" not in cmdline and p.status() != psutil.STATUS_ZOMBIE:
            found.append(f"{p.pid} {cmdline[:120]}")
    return found


def _on_signal(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8, help="closed-loop clients under load (default 8)")
    ap.add_argument("--batch", type=int, default=8, help="B of the batching setups (default 8)")
    ap.add_argument("--wait-ms", type=float, default=50.0,
                    help="batch wait: TorchServe max_batch_delay, packrat-mq --batch-timeout-ms (default 50)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="T: threads of TorchServe's worker and packrat-mq's budget (default: usable CPUs)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=8.0, help="seconds of load before measuring")
    ap.add_argument("--measure", type=float, default=25.0, help="seconds measured under load")
    ap.add_argument("--idle-warmup", type=float, default=3.0)
    ap.add_argument("--idle-measure", type=float, default=15.0, help="seconds of the idle probe")
    ap.add_argument("--setups", default=None, help="comma-separated subset of the setup keys (default: all)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 round, 3 s warm-up, 6 s measured, 3 + 4 s idle; JSON to the temp dir")
    ap.add_argument("--markdown", action="store_true", help="also print the tables as Markdown (for the README)")
    ap.add_argument("--report", type=Path, default=None, help="print the tables of an earlier run's JSON; run nothing")
    ap.add_argument("--json-out", type=Path, default=None, help="default benchmarks/results/peers.json")
    ap.add_argument("--peers-venv", type=Path, default=PEERS_VENV, help="TorchServe's virtual environment")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (servers' logs) after a success")
    args = ap.parse_args(argv)

    if args.report is not None:
        result = json.loads(args.report.read_text())
        print(markdown(result) if args.markdown else text_tables(result))
        return 0
    if args.quick:
        args.rounds, args.warmup, args.measure, args.idle_warmup, args.idle_measure = 1, 3.0, 6.0, 3.0, 4.0
    json_out: Path = args.json_out or (Path(tempfile.gettempdir()) / "packrat-peers-quick.json" if args.quick
                                       else RESULTS / "peers.json")
    if not (args.peers_venv / "bin" / "torchserve").exists():
        print(f"no TorchServe in {args.peers_venv}: `make bench-peers` installs it "
              f"(or: python3 -m venv {args.peers_venv} && {args.peers_venv}/bin/pip install "
              f"-c benchmarks/peers/constraints.txt torchserve torch-model-archiver pyyaml torch numpy)",
              file=sys.stderr)
        return 2
    all_setups = make_setups(args.threads, args.batch, args.wait_ms)
    if args.setups:
        wanted = args.setups.split(",")
        unknown = set(wanted) - {s.key for s in all_setups}
        if unknown:
            ap.error(f"unknown setups {sorted(unknown)}; known: {', '.join(s.key for s in all_setups)}")
        all_setups = [s for s in all_setups if s.key in wanted]

    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored (a background job)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    workdir = Path(tempfile.mkdtemp(prefix="packrat-peers-"))
    payload = npy_image()
    result: dict[str, Any] = {
        "benchmark": "peers: packrat-mq and TorchServe side by side",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine_info(args.peers_venv),
        "options": {"model": MODEL, "clients": args.clients, "batch": args.batch, "wait_ms": args.wait_ms,
                    "threads": args.threads, "rounds": args.rounds, "warmup": args.warmup, "measure": args.measure,
                    "idle_warmup": args.idle_warmup, "idle_measure": args.idle_measure, "quick": args.quick,
                    "payload_bytes": len(payload), "load_generator": "one process per client, closed loop"},
        "setups": [s.as_dict() for s in all_setups],
        "runs": [],
        "ratios": [],
    }
    started = time.monotonic()
    ok = interrupted = False
    try:
        print(f"building TorchServe's model stores in {workdir}", file=sys.stderr, flush=True)
        stores = {(s.batch, s.wait_ms): build_store(args.peers_venv, workdir / "build", model=MODEL, batch=s.batch,
                                                    wait_ms=s.wait_ms)
                  for s in all_setups if s.server == "torchserve"}
        for k in range(1, args.rounds + 1):
            for s in round_order(all_setups, k):
                result["runs"].append(run_reported(s, k, args, workdir, payload, stores))
                result["ratios"] = ratios(result["runs"], all_setups)
                result["elapsed_s"] = time.monotonic() - started
                json_out.parent.mkdir(parents=True, exist_ok=True)
                json_out.write_text(json.dumps(result, indent=2))
        ok = all("load" in r for r in result["runs"])
    except KeyboardInterrupt as exc:
        interrupted = True
        print(f"interrupted ({str(exc) or 'Ctrl-C'}); the servers are stopped", file=sys.stderr)
    finally:
        leftovers = left_behind()
        if leftovers:
            print(f"warning: processes left behind: {leftovers}", file=sys.stderr)
        if ok and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"servers' logs kept in {workdir}", file=sys.stderr)
    if result["runs"]:
        print(text_tables(result))
        if args.markdown:
            print()
            print(markdown(result))
        print(f"written to {json_out}")
    return 130 if interrupted else 0 if ok else 1


def round_order(setups: list[Setup], round_no: int) -> list[Setup]:
    """The setups of round ``round_no`` (1-based), rotated one place per round.

    A host that drifts within a round favours whichever setup runs at its
    quiet end; rotating spreads that over the setups instead of giving it to
    the same one every round (at 05:47 on 12-02 the third setup of three lost
    3-9% to the second in all three rounds, after winning by 6-11% as the
    third of three in another order an hour before).
    """
    shift = (round_no - 1) % len(setups) if setups else 0
    return setups[shift:] + setups[:shift]


def run_reported(setup: Setup, round_no: int, args: argparse.Namespace, workdir: Path, payload: bytes,
                 stores: dict[tuple[int, float], Path]) -> dict[str, Any]:
    """:func:`run_setup` with progress on stderr; a setup that fails is recorded, and the run goes on."""
    print(f"round {round_no}/{args.rounds}: {setup.label()}", file=sys.stderr, flush=True)
    try:
        row = run_setup(setup, round_no, args, workdir, payload, stores)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"  failed: {exc}", file=sys.stderr, flush=True)
        return {"round": round_no, "setup": setup.key, "label": setup.label(), "error": str(exc)[-2000:]}
    ld, idle = row["load"], row["idle"]
    print(f"  {row.get('configuration') or ''} p50 {_f(ld['p50_ms'])} ms, p99 {_f(ld['p99_ms'])} ms, "
          f"{_f(ld['requests_per_s'])} req/s, idle p50 {_f(idle['p50_ms'])} ms, "
          f"errors {ld['errors'] + idle['errors']}, requests per client {min(ld['per_client_requests'])}-"
          f"{max(ld['per_client_requests'])} (ready in {row['ready_s']:.1f} s)", file=sys.stderr, flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())
