"""Adaptive batching against static choices, under one load trace (issue 9's benchmark).

Each setup is served by a real ``packrat-mq up`` process (its own prefix on one
private embedded Redis) and driven by the same open-loop trace (Poisson
arrivals at a rate that changes over time):

- ``idle``: a trickle (a quarter of what B=1 can serve);
- ``step``: a step up to saturation (90% of what B=32 can serve);
- ``ramp``: a ramp back down to the trickle;
- ``diurnal``: rates whose ideal batch sizes are 8, 16, 32, 16 and 8.

The setups: ``adaptive`` (``up`` without ``--batch``: the estimator chooses B
from B=1, spare instances loaded from the start), ``adaptive-no-prewarm``
(spares only once a change retires instances), ``static-1`` (``--batch 1``) and ``static-32`` (``--batch 32``)
(any ``static-B`` for ``--batch B``),
with the same batch wait (50 ms, as the peers benchmark). Rates come from the
model's profile: the capacity of batch B is ``B / L(B)``, with ``L(B)`` the
optimizer's predicted latency for (T, B), and the rate "whose ideal batch is
B" lies between the capacities of B/2 and B. ``--rate-scale`` scales them all,
for a host that serves slower (or faster) than its profile says.

Recorded: every request's send and reply time (so lost and duplicated
replies show), the dispatcher's B, Q̃ and the backlog every 100 ms, and the
model's reconfiguration history. Reported: p50/p99 per phase, the mean over
the whole trace, p50/p99 in the 5 s around each switch, each reconfiguration
with when and how long, and the issue's targets.

Run:
  python -m benchmarks.bench_adaptive --model resnet50 --graph
  python -m benchmarks.bench_adaptive --model profiled --simulate-cores 16 --profile profiles/sim/resnet50-16core.json
Writes ``benchmarks/results/adaptive-<name>.json`` and ``.png``; ``--report FILE`` prints a finished run's tables.
"""
from __future__ import annotations

import argparse
import json
import math
import queue
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

os.environ.setdefault("PACKRAT_LOG_LEVEL", "WARNING")

from optimizer.calibration import example_payloads  # noqa: E402
from optimizer.planning.profile import Profile, resolve_profile_path  # noqa: E402
from optimizer.planning.selection import choose  # noqa: E402
from packrat_mq import graph as graph_modes  # noqa: E402
from packrat_mq import protocol  # noqa: E402
from packrat_mq.connection import EmbeddedRedis, connect  # noqa: E402
from packrat_mq.keys import Keys  # noqa: E402
from packrat_mq.records import DispatcherState, SupervisorState  # noqa: E402
from packrat_mq.shared_payloads import SharedPayloads  # noqa: E402
from packrat_mq.topology import Topology  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BATCH_WAIT_MS = 50.0
#: Seconds into a phase after which a change counts as "under steady load".
SETTLE_S = 5.0


@dataclass
class Phase:
    name: str
    seconds: float
    rate_from: float
    rate_to: float

    def rate(self, t: float) -> float:
        """Requests per second ``t`` seconds into the phase (linear from ``rate_from`` to ``rate_to``)."""
        return self.rate_from + (self.rate_to - self.rate_from) * min(1.0, t / self.seconds)


def capacities(model: str, threads: int, profile: str | None, graph: str, scale: float,
               host: dict[int, float] | None = None) -> dict[int, float]:
    """Requests per second each power-of-two B can serve, from the optimizer's predicted latency.

    ``host``: this host's time over the profile's by instance thread count
    (:func:`host_ratio`); each B's predicted latency is stretched by that of
    its plan's largest instances.
    """
    caps = {}
    for b in (1, 2, 4, 8, 16, 32):
        choice = choose(model, threads, b, profile, mode=graph)
        loaded = Profile.load(choice.profile_path) if choice.profile_path else None
        predicted = choice.configuration.predicted_latency_ms
        path = (loaded.path_cost_ms(b) or 0.0) if loaded else 0.0
        if predicted is None:
            raise SystemExit(f"no profile for {model}: the trace's rates come from one")
        if host:
            t = max(i.threads for i in choice.configuration.instances)
            predicted *= host.get(t, statistics.median(host.values()))
        caps[b] = b / ((predicted * scale + path) / 1000.0)
    return caps


#: The batch sizes :func:`host_ratio` times at each thread count, where the profile has them.
PROBE_BATCHES = (1, 2, 4)


def host_ratio(model: str, threads: int, profile: str | None, graph: str, rounds: int = 7,
               batches: tuple[int, ...] = PROBE_BATCHES) -> dict[int, float]:
    """This host's time over the profile's by thread count, timed now: (T, b) alone and (1, b) filling
    the cores, the median ratio over ``batches``.

    The trace's rates come from the profile; a host that serves 1.6x slower
    than when it was profiled (this shared VM, within hours) runs every phase
    past saturation, and the comparison then says only how each setup
    carries a backlog it never drains. ``--rate-scale auto`` stretches each
    B's predicted latency by the ratio of its plan's thread count (the two
    differ: 1.26x for one 2-thread instance and 1.61x for two 1-thread ones,
    in one run here), timed the way the profiler times a point (the same
    child processes, copies started together, the slowest copy's median of
    ``rounds`` after two warm-up rounds).

    Several batch sizes, not one: a ratio read from one point is as noisy as
    that point of the profile. The probe timed (T, 1) and (1, 2) alone until
    2026-12-07; on the Zen 3 host the 1-thread ratio read 0.99-1.41x over
    four runs within 45 minutes, and the profile's own (1, 2) was an outlier (142
    ms an image against 120-125 for its neighbours), so every rate of the
    trace moved with one point.
    """
    from optimizer.profiling.child import ProfilingGroup
    from optimizer.profiling.options import ProfilingOptions
    from packrat_mq.instances import Configuration
    from workers.allocation import allocate

    loaded = Profile.load(resolve_profile_path(profile or model, mode=graph))
    topology = Topology.detect()
    options = ProfilingOptions(model=model, graph=graph)
    ratios: dict[int, float] = {}
    for t in sorted({threads, 1}, reverse=True):
        copies = threads // t
        points = [(b, entry) for b in batches if (entry := loaded.entry(t, b)) is not None]
        if not points:
            continue
        group = ProfilingGroup(options, allocate(topology, Configuration.uniform(copies, t, points[0][0])))
        by_batch: dict[int, float] = {}
        try:
            group.start()
            for b, profiled in points:
                group.prepare(b)
                times = [group.run() for _ in range(rounds + 2)][2:]
                by_batch[b] = statistics.median(times) / profiled.mean_ms
        finally:
            group.kill()
            group.close()
        ratios[t] = statistics.median(by_batch.values())
        print(f"host / profile, {copies} x {t}-thread: "
              + ", ".join(f"b={b} {r:.2f}x" for b, r in by_batch.items()) + f"; median {ratios[t]:.2f}x", flush=True)
    return ratios


def trace(caps: dict[int, float], unit_s: float) -> tuple[list[Phase], list[str]]:
    """The issue's trace, with rates from the capacities (``unit_s``: length of one diurnal step).

    The rate "whose ideal batch is B" lies between what B/2 and B can serve.
    Where doubling the batch buys less than 10% more throughput (ResNet-50 on
    two cores peaks at B=4-8), no rate makes B ideal: the phase gets 90% of the
    best capacity up to B, and the returned notes say so.
    """
    notes: list[str] = []
    peak = max(caps.values())

    def ideal(b: int) -> float:
        low = caps.get(b // 2, 0.0)
        if caps[b] < 1.1 * low:
            best = max(c for k, c in caps.items() if k <= b)
            notes.append(f"B={b}: capacity {caps[b]:.1f}/s is not 10% above B={b // 2}'s {low:.1f}/s; "
                         f"its phase runs at 90% of the best capacity up to it ({best:.1f}/s)")
            return 0.9 * best
        # Past what B/2 can take, with room below what B can.
        return max(low * 1.1, min(0.8 * caps[b], (low + caps[b]) / 2))

    trickle = 0.25 * caps[1]
    saturation = 0.9 * peak
    phases = [Phase("idle", 2 * unit_s, trickle, trickle), Phase("step", 2 * unit_s, saturation, saturation),
              Phase("ramp", 2 * unit_s, saturation, trickle)]
    for k, b in enumerate((8, 16, 32, 16, 8)):
        phases.append(Phase(f"diurnal-{k + 1} (B={b})", unit_s, ideal(b), ideal(b)))
    return phases, sorted(set(notes))


class Driver:
    """Open-loop Poisson producer and a reply reader for one setup."""

    def __init__(self, url: str, prefix: str, model: str, payloads: list[tuple[bytes, str]], seed: int,
                 shm_dir: str | None = None, shm_keep: bool = False) -> None:
        self.r = connect(url)
        #: ``--shm``: each request's payload is written to a file in this shared-memory directory,
        #: which the request names, as a producer on the serving host would: a new file per request
        #: (the service deletes it), or with ``shm_keep`` one of the driver's own files, written again
        #: once its request is answered (``payload_shm_keep``, what ``Client(shared_memory=True)`` does).
        self.payload_files = SharedPayloads(shm_dir) if shm_dir else None
        self.shm_keep = shm_keep
        self._free_files: queue.SimpleQueue[str] = queue.SimpleQueue()  # answered: written again
        self._file_of: dict[str, str] = {}
        self._files_made = 0
        self.reader_r = connect(url)
        self.keys = Keys(prefix)
        self.model = model
        self.payloads = payloads
        self.reply_to = self.keys.replies(f"bench-{uuid.uuid4().hex[:8]}")
        self.rng = random.Random(seed)
        self.sent: dict[str, tuple[float, str]] = {}
        self.replies: dict[str, list[dict[str, Any]]] = {}
        self._stop = threading.Event()

    def read_replies(self) -> None:
        last = "0"
        while not self._stop.is_set() or len(self.replies) < len(self.sent):
            if self._stop.is_set() and time.monotonic() - self._trace_end > self.drain_max_s:
                return  # a setup that cannot keep up, still answering: what it holds is unanswered
            resp = self.reader_r.xread({self.reply_to: last}, count=1000, block=200)
            if not resp:
                if self._stop.is_set() and self._drained():
                    return
                continue
            self._progress = time.monotonic()
            now = time.time()
            entries = resp[0][1]
            for eid, f in entries:
                rid = f[b"id"].decode()
                name = self._file_of.pop(rid, None)
                if name is not None:
                    self._free_files.put(name)
                self.replies.setdefault(rid, []).append({
                    "at": now, "ok": f[b"status"] == b"ok",
                    "inference_ms": float(f.get(b"inference_ms") or 0), "batch_size": int(f.get(b"batch_size") or 0),
                    "queue_ms": float(f.get(b"queue_ms") or 0)})
            last = entries[-1][0]
            self.reader_r.xdel(self.reply_to, *(e for e, _ in entries))

    def _drained(self) -> bool:
        """After the trace: whether to stop waiting for replies (none came for ``drain_quiet_s``
        while the service holds nothing: what is missing then is lost, not late)."""
        if time.monotonic() - self._trace_end > self.drain_max_s:
            return True  # a setup that cannot keep up: what it still holds is counted unanswered, not lost
        if time.monotonic() - self._progress < self.drain_quiet_s:
            return False
        self.held_at_end = self.reader_r.xlen(self.keys.requests(self.model))
        return self.held_at_end == 0 or time.monotonic() - self._progress > 120

    drain_quiet_s = 5.0
    #: The longest wait for replies after the trace (static B=1 at 64 simulated cores would need 15 min).
    drain_max_s = 90.0
    held_at_end = 0
    _trace_end = math.inf

    def run(self, phases: list[Phase]) -> None:
        self._progress = time.monotonic()
        reader = threading.Thread(target=self.read_replies, daemon=True)
        reader.start()
        start = time.monotonic()
        t0 = time.time()
        k = 0
        began = start
        for phase in phases:
            # Each phase starts at its place on the trace's clock: the report reads the timeline and the
            # reconfigurations against those boundaries. (The driver used to sleep until the first
            # arrival past a phase's end before starting the next: each phase began late by that
            # overshoot, 0.3 s on average at an idle phase's rate, and the lateness added up.)
            nxt = began
            while True:
                elapsed = nxt - began
                if elapsed >= phase.seconds:
                    break
                rate = max(phase.rate(elapsed), 0.05)
                nxt += self.rng.expovariate(rate)
                if nxt - began >= phase.seconds:
                    break  # the next arrival is the next phase's to draw (Poisson arrivals have no memory)
                delay = nxt - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                payload, ctype = self.payloads[k % len(self.payloads)]
                rid = f"r{k}"
                k += 1
                self.sent[rid] = (time.time(), phase.name)
                if self.payload_files is not None and self.shm_keep:  # the write is in the request's latency
                    try:
                        name = self._free_files.get_nowait()
                    except queue.Empty:
                        self._files_made += 1
                        name = f"driver-{self._files_made}"
                    self.payload_files.rewrite(name, payload)
                    self._file_of[rid] = name
                    fields = protocol.request_fields(rid, self.reply_to, None, ctype, payload_shm=name, keep=True)
                elif self.payload_files is not None:
                    fields = protocol.request_fields(rid, self.reply_to, None, ctype,
                                                     payload_shm=self.payload_files.write(payload))
                else:
                    fields = protocol.request_fields(rid, self.reply_to, payload, ctype)
                self.r.xadd(self.keys.requests(self.model), fields)
            began += phase.seconds
            delay = began - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # the phase's quiet end
        self._trace_end = time.monotonic()
        self._stop.set()
        reader.join()
        self.held_at_end = self.reader_r.xlen(self.keys.requests(self.model))
        self.elapsed_s = time.monotonic() - start
        self.t0 = t0


class CpuMeter(threading.Thread):
    """CPU seconds of each role over the trace: ``up`` (dispatcher, estimator, supervisor), instances, Redis, client.

    On a host whose every core runs an instance, whatever the path's
    processes use is taken from the instances, so a setup that serves the
    same layout slower should show where the time went. Sampled every
    0.5 s (instances come and go with reconfigurations); a process's CPU
    before the trace starts is not counted.
    """

    def __init__(self, up_pid: int) -> None:
        super().__init__(daemon=True)
        self.up = psutil.Process(up_pid)
        self.me = psutil.Process()
        # The benchmark's Redis runs from before the trace to after it: looked up once, not on every sample.
        self.redis = [p for p in psutil.process_iter(["name"]) if "redis" in (p.info.get("name") or "")]
        self.stop_event = threading.Event()
        self.first: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self.t0 = self.t1 = time.monotonic()
        self._sample()
        self.first = {pid: cpu for pid, (_, cpu) in self.last.items()}

    def _processes(self) -> list[tuple[str, psutil.Process]]:
        out = [("up", self.up), ("client", self.me)]
        try:
            out += [("instances", c) for c in self.up.children(recursive=True)]
        except psutil.Error:
            pass
        return out + [("redis", proc) for proc in self.redis]

    def _sample(self) -> None:
        for role, proc in self._processes():
            try:
                t = proc.cpu_times()
            except psutil.Error:
                continue
            self.last[proc.pid] = (role, t.user + t.system)
        self.t1 = time.monotonic()

    def run(self) -> None:
        while not self.stop_event.wait(0.5):
            self._sample()

    def stop(self) -> dict[str, float]:
        """Cores used by each role over the trace (CPU seconds / wall seconds)."""
        self.stop_event.set()
        self.join(2)
        self._sample()
        wall = max(self.t1 - self.t0, 1e-9)
        used: dict[str, float] = {}
        for pid, (role, cpu) in self.last.items():
            used[role] = used.get(role, 0.0) + cpu - self.first.get(pid, 0.0)
        return {role: round(v / wall, 3) for role, v in sorted(used.items())}


class Monitor(threading.Thread):
    """B, Q̃, B̃ and the backlog every 100 ms."""

    def __init__(self, url: str, prefix: str, model: str) -> None:
        super().__init__(daemon=True)
        self.r = connect(url)
        self.keys = Keys(prefix)
        self.model = model
        self.samples: list[dict[str, Any]] = []
        #: Every reconfiguration seen (the model's own history keeps only the last 10), by decision time.
        self.history: dict[float, dict[str, Any]] = {}
        self.stop_event = threading.Event()
        self.ratio: float | None = None
        self.spares: int | None = None

    def node_record(self, d: DispatcherState | None) -> SupervisorState | None:
        """The first node's supervisor record: its served / profiled latency (drift check) and spares loaded."""
        if d is None or not d.nodes:
            return None
        node = d.nodes[0].split("=", 1)[0]
        return SupervisorState.load(self.r, self.keys.supervisor(self.model, node))

    def collect_history(self) -> None:
        for raw in self.r.lrange(self.keys.reconfigurations(self.model), 0, -1):
            entry = json.loads(raw)
            self.history[entry["decided"]] = entry

    def run(self) -> None:
        k = 0
        while not self.stop_event.wait(0.1):
            try:
                d = DispatcherState.load(self.r, self.keys.dispatcher(self.model))
                length = self.r.xlen(self.keys.requests(self.model))
                k += 1
                if k % 10 == 0:
                    self.collect_history()
                    # What the estimator's capacities are corrected by (served / profiled), and the spares
                    # loaded (a spare loading takes a core from the path), once a second.
                    rec = self.node_record(d)
                    self.ratio = rec.profile_ratio if rec is not None else None
                    self.spares = rec.spares if rec is not None else None
            except Exception:  # noqa: BLE001 - a missed sample is a gap in the plot
                continue
            self.samples.append({"at": time.time(), "batch": d.batch if d else None,
                                 "q_tilde": d.q_tilde if d else None, "b_tilde": d.b_tilde if d else None,
                                 "length": length, "profile_ratio": self.ratio, "spares": self.spares})


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def wait_for_spares(url: str, prefix: str, model: str, timeout_s: float = 600.0) -> float | None:
    """Wait until every supervisor of the model has loaded the spares it keeps; seconds waited (None: none kept).

    The trace measures the service settled: spares are loaded once, after
    start-up (the start-up itself is timed and reported, not mixed into the
    idle phase's latencies).
    """
    r = connect(url)
    keys = Keys(prefix)
    began = time.monotonic()
    try:
        while time.monotonic() - began < timeout_s:
            nodes = [n.decode() for n in r.smembers(keys.supervisors(model))]
            recs = [SupervisorState.load(r, keys.supervisor(model, n)) for n in nodes]
            if recs and all(rec is not None for rec in recs):
                if not any(rec.spares_wanted for rec in recs):  # type: ignore[union-attr]
                    return None
                if all(rec.spares >= rec.spares_wanted for rec in recs):  # type: ignore[union-attr]
                    return time.monotonic() - began
            time.sleep(0.2)
        raise SystemExit(f"spares of {model} not loaded after {timeout_s:.0f} s")
    finally:
        r.close()


def process_starts(url: str, prefix: str, model: str) -> dict[str, float]:
    """Per node, the seconds its supervisor measured a process to take from start to loaded (the median of the
    spares it loaded alone; ``Supervisor.process_start_s``), as the estimator reads it; nodes without one left out."""
    r = connect(url)
    keys = Keys(prefix)
    try:
        out = {}
        for raw in r.smembers(keys.supervisors(model)):
            rec = SupervisorState.load(r, keys.supervisor(model, raw.decode()))
            if rec is not None and rec.process_start_s is not None:
                out[raw.decode()] = rec.process_start_s
        return out
    finally:
        r.close()


def start_up(name: str, cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], list[str]]:
    """Start ``packrat-mq up`` and wait for its ``ready:`` line; its output so far, and on, in the list returned."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())
        if line.startswith("ready:"):
            break
    else:
        raise SystemExit(f"{name}: up did not start:\n" + "\n".join(lines))
    threading.Thread(target=lambda: [lines.append(x.rstrip()) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    return proc, lines


def run_setup(name: str, args: argparse.Namespace, url: str, phases: list[Phase],
              payloads: list[tuple[bytes, str]]) -> dict[str, Any]:
    prefix = f"bench-{name}-{uuid.uuid4().hex[:6]}"
    cmd = [sys.executable, "-m", "packrat_mq", "up", "--model", args.model, "--redis-url", url, "--prefix", prefix,
           "--batch-timeout-ms", str(BATCH_WAIT_MS), "--threads", str(args.threads), "--exit-with-parent"]
    if args.graph != "eager":
        cmd += ["--graph", args.graph]
    if args.profile:
        cmd += ["--profile", args.profile]
    if args.simulate_cores:
        cmd += ["--simulate-cores", str(args.simulate_cores)]
    for opt in args.option:
        cmd += ["-o", opt]
    if name.startswith("static-"):
        cmd += ["--batch", name.removeprefix("static-")]  # static-1, static-32, any static-B
    elif name == "adaptive-no-prewarm":
        cmd += ["--no-prewarm"]  # spares only once a change retires instances
    env = dict(os.environ, PACKRAT_LOG_LEVEL="WARNING")
    shm_dir = tempfile.mkdtemp(prefix="packrat-bench-", dir="/dev/shm") if args.shm else None
    if shm_dir:
        env["PACKRAT_SHM_DIR"] = shm_dir
    proc, lines = start_up(name, cmd, env)
    print(f"[{name}] serving: {lines[-2] if len(lines) > 1 else ''}", flush=True)
    # Without prewarm a supervisor keeps spares only once a change retires instances: nothing to wait for.
    spares_s = None if name == "adaptive-no-prewarm" else wait_for_spares(url, prefix, args.model)
    starts = process_starts(url, prefix, args.model)
    if spares_s is not None:
        print(f"[{name}] spares loaded {spares_s:.1f} s after ready; the trace starts now", flush=True)
    monitor = Monitor(url, prefix, args.model)
    monitor.start()
    cpu = CpuMeter(proc.pid)
    cpu.start()
    driver = Driver(url, prefix, args.model, payloads, seed=args.seed, shm_dir=shm_dir, shm_keep=args.shm == "keep")
    try:
        driver.run(phases)
    finally:
        cores = cpu.stop()
        monitor.stop_event.set()
        monitor.join(5)
        monitor.collect_history()
        history = [monitor.history[k] for k in sorted(monitor.history)]
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        if shm_dir:
            left = len(os.listdir(shm_dir))  # files no worker answered (and deleted)
            shutil.rmtree(shm_dir, ignore_errors=True)
    result = analyse(name, driver, monitor.samples, history, phases, lines)
    result["spares_loaded_s"] = spares_s
    result["process_start_s"] = starts
    result["cores_used"] = cores  # CPU seconds per wall second over the trace, by role
    print(f"[{name}] cores used over the trace: " + ", ".join(f"{k} {v:.2f}" for k, v in cores.items()), flush=True)
    if shm_dir:
        result["shm_files_left"] = left
    return result


def analyse(name: str, driver: Driver, samples: list[dict[str, Any]], history: list[dict[str, Any]],
            phases: list[Phase], log: list[str]) -> dict[str, Any]:
    latencies: list[tuple[float, float, str, dict[str, Any]]] = []  # (sent, ms, phase, reply)
    duplicated = 0
    failed = 0
    for rid, (sent, phase) in driver.sent.items():
        got = driver.replies.get(rid)
        if not got:
            continue
        duplicated += len(got) - 1
        failed += not got[0]["ok"]
        latencies.append((sent, (got[0]["at"] - sent) * 1000.0, phase, got[0]))
    missing = sum(1 for rid in driver.sent if rid not in driver.replies)
    # Still in the request stream when the wait ended: not lost (the next start serves them), unanswered.
    unanswered = min(missing, driver.held_at_end)
    lost = missing - unanswered
    # Requests that found the service empty: every request sent before them already answered. Their
    # latency beyond their own inference_ms is the service's own wait (batch wait, path), none of it
    # spent behind another request, which is the "needless" wait issue 9's idle target is about.
    alone: set[int] = set()
    answered_by = float("-inf")
    for k, x in sorted(enumerate(latencies), key=lambda kx: kx[1][0]):
        if answered_by <= x[0]:
            alone.add(k)
        answered_by = max(answered_by, x[0] + x[1] / 1000.0)
    by_phase: dict[str, dict[str, Any]] = {}
    for phase in phases:
        ms = [x[1] for x in latencies if x[2] == phase.name]
        inf = [x[3]["inference_ms"] for x in latencies if x[2] == phase.name and x[3]["batch_size"] == 1]
        # Where a request's time went: until its instance began (queue_ms: the stream, the batch wait, the
        # dispatcher, the instance queue), the handler (inference_ms), and the rest (reply, client).
        queued = [x[3]["queue_ms"] for x in latencies if x[2] == phase.name]
        rest = [x[1] - x[3]["queue_ms"] - x[3]["inference_ms"] for x in latencies if x[2] == phase.name]
        # Each request's latency beyond its own batch's handler time (paired, at B=1): the p50 of the
        # difference, not the difference of the p50s, which a varying handler time and the Poisson
        # arrivals that wait behind another request lift by the spread of the handler's time.
        beyond = [x[1] - x[3]["inference_ms"] for x in latencies if x[2] == phase.name and x[3]["batch_size"] == 1]
        beyond_alone = [x[1] - x[3]["inference_ms"] for k, x in enumerate(latencies)
                        if k in alone and x[2] == phase.name and x[3]["batch_size"] == 1]
        by_phase[phase.name] = {"requests": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
                                "mean_ms": statistics.fmean(ms) if ms else None,
                                "inference_ms_b1_p50": percentile(inf, 50),
                                "queue_ms_p50": percentile(queued, 50), "beyond_inference_ms_b1_p50": percentile(beyond, 50), "after_inference_ms_p50": percentile(rest, 50),
                                "alone_b1": len(beyond_alone), "beyond_inference_alone_ms_b1_p50": percentile(beyond_alone, 50),
                                "rate_per_s": round((phase.rate_from + phase.rate_to) / 2, 2)}
    switches = []
    for e in history:
        at = e.get("switched") or e.get("decided")
        window = [x[1] for x in latencies if at is not None and abs(x[0] - at) <= 2.5]
        switches.append({**{k: e.get(k) for k in ("reason", "kind", "from", "to", "from_batch", "to_batch",
                                                   "decision_to_ready_s", "ready_to_switch_s", "switch_to_drained_s",
                                                   "total_s", "oversubscribed_s", "status", "reused", "handover", "held_s")},
                         "at_s": round(at - driver.t0, 2) if at else None,
                         "p50_ms_5s": percentile(window, 50), "p99_ms_5s": percentile(window, 99)})
    all_ms = [x[1] for x in latencies]
    # The handler's time by the batch it ran in: the same layout served slower in one setup than in
    # another shows here (a batch of k requests answers k replies, each carrying its batch's inference_ms).
    by_batch: dict[int, list[float]] = {}
    for x in latencies:
        by_batch.setdefault(int(x[3]["batch_size"]), []).append(float(x[3]["inference_ms"]))
    return {
        "setup": name,
        "sent": len(driver.sent), "received": len(latencies), "lost": lost, "duplicated": duplicated,
        "unanswered_at_end": unanswered,
        "errors": failed,
        "mean_ms": statistics.fmean(all_ms) if all_ms else None,
        "p50_ms": percentile(all_ms, 50), "p99_ms": percentile(all_ms, 99),
        "phases": by_phase, "reconfigurations": switches,
        "timeline": [{"t": round(s["at"] - driver.t0, 2), **{k: s.get(k) for k in ("batch", "q_tilde", "length", "profile_ratio", "spares")}}
                     for s in samples],
        "latencies": [(round(x[0] - driver.t0, 3), round(x[1], 2)) for x in latencies],
        "inference_ms_by_batch": {k: {"replies": len(v), "p50_ms": percentile(v, 50)} for k, v in sorted(by_batch.items())},
        "up_log_tail": log[-15:],
    }


def targets(results: dict[str, Any]) -> list[str]:
    """The issue's targets, checked on one run."""
    out = []
    setups = results["setups"]
    a = setups.get("adaptive")
    statics = {k: v for k, v in setups.items() if k.startswith("static")}
    if not a:
        return out
    out.append(f"lost {sum(s['lost'] for s in setups.values())}, duplicated {sum(s['duplicated'] for s in setups.values())} "
               "(target 0 and 0)")
    best_static = min((s["mean_ms"] for s in statics.values() if s["mean_ms"]), default=None)
    if best_static:
        out.append(f"whole-trace mean: adaptive {a['mean_ms']:.1f} ms vs best static {best_static:.1f} ms "
                   f"({a['mean_ms'] / best_static:.2f}x; target below every static)")
    for phase, row in a["phases"].items():
        best = min((s["phases"][phase]["p50_ms"] for s in statics.values() if s["phases"][phase]["p50_ms"]), default=None)
        if best and row["p50_ms"]:
            out.append(f"{phase}: adaptive p50 {row['p50_ms']:.1f} ms, best static {best:.1f} ms "
                       f"({row['p50_ms'] / best:.2f}x; target <= 1.10x)")
    idle = a["phases"].get("idle")
    if idle and idle["p50_ms"] and idle["inference_ms_b1_p50"]:
        out.append(f"idle: p50 {idle['p50_ms']:.1f} ms vs inference_ms at B=1 {idle['inference_ms_b1_p50']:.1f} ms "
                   f"(+{idle['p50_ms'] - idle['inference_ms_b1_p50']:.1f} ms; target <= 3 ms)"
                   + (f"; per request, p50 of latency minus its own inference_ms "
                      f"{idle['beyond_inference_ms_b1_p50']:.1f} ms (until the instance began "
                      f"{idle['queue_ms_p50']:.1f} ms, after the handler {idle['after_inference_ms_p50']:.1f} ms)"
                      if idle.get("beyond_inference_ms_b1_p50") is not None else ""))
    if idle and idle.get("beyond_inference_alone_ms_b1_p50") is not None:
        out.append(f"idle, the {idle['alone_b1']} requests that found the service empty (every earlier one answered): "
                   f"p50 of latency minus its own inference_ms {idle['beyond_inference_alone_ms_b1_p50']:.1f} ms "
                   "(no wait behind another request; target <= 3 ms)")
    out.append(f"adaptive reconfigurations: {len(a['reconfigurations'])} over the trace")
    # Under steady load: a change decided more than SETTLE_S into a phase of constant rate
    # (the first changes of a phase answer its step).
    starts, t = [], 0.0
    for ph in results["phases"]:
        starts.append((t, t + ph["seconds"], ph["name"], ph["rate_from"] == ph["rate_to"]))
        t += ph["seconds"]

    def phase_at(at: float | None) -> tuple[float, float, str, bool] | None:
        return next((x for x in starts if at is not None and x[0] <= at < x[1]), None)

    steady = [e for e in a["reconfigurations"] if (ph := phase_at(e["at_s"])) and ph[3] and e["at_s"] - ph[0] > SETTLE_S]
    listed = ", ".join(f"{e['at_s']} s {e['from_batch']}->{e['to_batch']}" for e in steady) or "none"
    out.append(f"changes under steady load (more than {SETTLE_S:g} s into a constant-rate phase): {len(steady)} "
               f"({listed}; target 0)")
    for e in a["reconfigurations"]:
        ph = phase_at(e["at_s"])
        if e["kind"] != "active-passive" or ph is None or e["p99_ms_5s"] is None:
            continue
        ref = [s["phases"][ph[2]]["p99_ms"] for s in statics.values() if s["phases"][ph[2]]["p99_ms"]]
        if ref:
            out.append(f"switch at {e['at_s']} s ({e['from_batch']}->{e['to_batch']}, {ph[2]}): p99 in 5 s "
                       f"{e['p99_ms_5s']:.0f} ms vs 2x the best static's p99 in that phase {2 * min(ref):.0f} ms")
    return out


def markdown(results: dict[str, Any]) -> str:
    setups = results["setups"]
    phases = list(next(iter(setups.values()))["phases"])
    lines = ["| phase | rate (req/s) | " + " | ".join(f"{s} p50 / p99 ms" for s in setups) + " |",
             "|---|---|" + "---|" * len(setups)]
    for phase in phases:
        rate = next(iter(setups.values()))["phases"][phase]["rate_per_s"]
        cells = []
        for s in setups.values():
            row = s["phases"][phase]
            cells.append(f"{row['p50_ms']:.0f} / {row['p99_ms']:.0f}" if row["p50_ms"] is not None else "-")
        lines.append(f"| {phase} | {rate} | " + " | ".join(cells) + " |")
    lines.append("| whole trace (mean) | | " + " | ".join(
        (f"{s['mean_ms']:.0f} ms mean" + (" (answered only: a lower bound)" if s.get("unanswered_at_end") else ""))
        if s["mean_ms"] else "-" for s in setups.values()) + " |")
    lines.append("| sent / received / lost / duplicated / still queued at the end | | " + " | ".join(
        f"{s['sent']} / {s['received']} / {s['lost']} / {s['duplicated']} / {s.get('unanswered_at_end', 0)}"
        for s in setups.values()) + " |")
    if any(s.get("cores_used") for s in setups.values()):  # runs before 12-06 did not measure it
        lines.append("| cores used: up (dispatcher, supervisor) / instances / Redis / client | | " + " | ".join(
            " / ".join(f"{(s.get('cores_used') or {}).get(k, 0.0):.2f}" for k in ("up", "instances", "redis", "client"))
            if s.get("cores_used") else "-" for s in setups.values()) + " |")
    a = setups.get("adaptive")
    if a and a["reconfigurations"]:
        lines += ["", "| at (s) | reason | B | kind | from spares | decision→ready | →switch | →drained | total | "
                  "p50 / p99 in 5 s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for e in a["reconfigurations"]:
            def s_(k: str) -> str:
                v = e.get(k)
                return f"{v:.2f} s" if isinstance(v, (int, float)) else "-"
            lines.append(f"| {e['at_s']} | {e['reason']} | {e['from_batch']}→{e['to_batch']} | {e['kind']} | "
                         f"{e.get('reused') if e.get('reused') is not None else '-'} | "
                         f"{s_('decision_to_ready_s')} | {s_('ready_to_switch_s')} | {s_('switch_to_drained_s')} | "
                         f"{s_('total_s')} | {e['p50_ms_5s'] or 0:.0f} / {e['p99_ms_5s'] or 0:.0f} ms |")
    lines += [""] + [f"- {t}" for t in targets(results)] + [f"- note: {n}" for n in results.get("trace_notes", [])]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    setups = results["setups"]
    fig = Figure(figsize=(11, 8))
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(3, 1, sharex=True)
    for name, s in setups.items():
        pts = s["latencies"]
        if pts:
            ax1.scatter([p[0] for p in pts], [p[1] for p in pts], s=2, alpha=0.35, label=name)
    ax1.set_yscale("log")
    ax1.set_ylabel("latency (ms)")
    ax1.legend(loc="upper right", markerscale=5)
    a = setups.get("adaptive")
    if a:
        tl = a["timeline"]
        ax2.step([x["t"] for x in tl], [x["batch"] or 0 for x in tl], where="post", label="B (adaptive)")
        ax2.plot([x["t"] for x in tl], [x["q_tilde"] or 0 for x in tl], lw=0.8, label="Q̃")
        if any(x.get("spares") is not None for x in tl):  # runs before 12-07 did not record them
            ax2.step([x["t"] for x in tl], [x.get("spares") or 0 for x in tl], where="post", lw=0.6, ls=":",
                     label="spares loaded")
        ax2.set_yscale("symlog", linthresh=1, base=2)
        top = max([x["batch"] or 0 for x in tl] + [x["q_tilde"] or 0 for x in tl] + [1])
        ticks = [0] + [1 << k for k in range(int(top).bit_length() + 1)]
        ax2.set_yticks(ticks, [str(v) for v in ticks])
        ax2.set_ylabel("batch")
        ax2.legend(loc="upper right")
        ax3.plot([x["t"] for x in tl], [x["length"] for x in tl], lw=0.8, label="adaptive")
        for e in a["reconfigurations"]:
            if e["at_s"] is not None:
                for ax in (ax1, ax2, ax3):
                    ax.axvline(e["at_s"], color="grey", lw=0.6, ls="--")
    for name, s in setups.items():
        if name != "adaptive":
            tl = s["timeline"]
            ax3.plot([x["t"] for x in tl], [x["length"] for x in tl], lw=0.6, label=name)
    ax3.set_yscale("symlog")
    ax3.set_ylabel("request stream length")
    ax3.set_xlabel("time (s); dashed: adaptive reconfigurations")
    ax3.legend(loc="upper right")
    t = 0.0
    for phase in results["phases"]:
        t += phase["seconds"]
        for ax in (ax1, ax2, ax3):
            ax.axvline(t, color="black", lw=0.4)
    fig.suptitle(results["title"])
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--graph", nargs="?", const="graph", default="eager",
                   help="graph mode: alone the model's default backend, or a backend (as `up --graph`)")
    p.add_argument("--profile", default=None)
    p.add_argument("--simulate-cores", type=int, default=None)
    p.add_argument("--option", "-o", action="append", default=[])
    p.add_argument("--threads", type=int, default=None, help="T (default: one socket, or the simulated cores)")
    p.add_argument("--unit", type=float, default=15.0, help="seconds of one diurnal step; other phases take 2 units")
    p.add_argument("--time-scale", type=float, default=1.0, help="the profiled model's time_scale (for the rates)")
    p.add_argument("--rate-scale", default="1.0",
                   help="multiply the profile's capacities (and so every rate of the trace) by this: on a host "
                        "slower than its profile (`status` says \"served 1.3x the profile\"), 1/1.3 keeps the "
                        "trace's phases at the loads they are meant to be instead of past saturation; `auto` "
                        "measures the ratio first (a real model only: about 30 s); `2=0.86,1=0.72` takes "
                        "those ratios by instance thread count as measured (the same trace for both sides of "
                        "an A/B)")
    p.add_argument("--setups", default="adaptive,static-1,static-32")
    p.add_argument("--shm", nargs="?", const="new", default=None, choices=("new", "keep"),
                   help="payloads in shared memory (payload_shm, a /dev/shm directory per setup), not in Redis: "
                        "a new file per request, deleted by the service (new, the default), or the driver's own "
                        "files written again once answered (keep, as Client(shared_memory=True) does)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--name", default=None)
    p.add_argument("--report", default=None, help="print the tables of a finished run's JSON")
    args = p.parse_args(argv)
    if args.report:
        print(markdown(json.loads(Path(args.report).read_text())))
        return 0
    args.graph = graph_modes.resolve(args.graph, args.model)
    args.threads = args.threads or args.simulate_cores or Topology.detect().max_cores_per_socket
    profile = args.profile
    if args.model == "profiled" and profile and not any(o.startswith("profile=") for o in args.option):
        args.option.append(f"profile={profile}")
    if args.model == "profiled" and not any(o.startswith("time_scale=") for o in args.option):
        args.option.append(f"time_scale={args.time_scale}")
    caps = capacities(args.model, args.threads, profile, args.graph,
                      args.time_scale if args.model == "profiled" else 1.0)
    measured: dict[int, float] = {}
    if args.rate_scale == "auto":
        if args.model == "profiled":
            raise SystemExit("--rate-scale auto times a real model; the profiled model sleeps as its profile says")
        measured = host_ratio(args.model, args.threads, profile, args.graph)
        if not measured:
            raise SystemExit(f"--rate-scale auto: the profile has no (T, b) or (1, b) for b in {PROBE_BATCHES}")
        print("host / profile: " + ", ".join(f"{t}-thread instances {v:.2f}x" for t, v in measured.items()),
              flush=True)
        args.rate_scale = 1.0
        caps = capacities(args.model, args.threads, profile, args.graph, 1.0, host=measured)
    elif "=" in args.rate_scale:
        measured = {int(k): float(v) for k, v in (item.split("=") for item in args.rate_scale.split(","))}
        args.rate_scale = 1.0
        caps = capacities(args.model, args.threads, profile, args.graph, 1.0, host=measured)
    else:
        args.rate_scale = float(args.rate_scale)
    caps = {b: c * args.rate_scale for b, c in caps.items()}
    phases, notes = trace(caps, args.unit)
    for note in notes:
        print(f"note: {note}", flush=True)
    payloads = example_payloads("sleep" if args.model == "profiled" else args.model, 8)
    name = args.name or (f"{args.model}-{args.simulate_cores}sim" if args.simulate_cores else args.model)
    print(f"capacities (req/s): {', '.join(f'B={b}: {c:.1f}' for b, c in caps.items())}", flush=True)
    print("trace: " + "; ".join(f"{ph.name} {ph.seconds:g} s {ph.rate_from:.1f}->{ph.rate_to:.1f}/s" for ph in phases),
          flush=True)
    results: dict[str, Any] = {
        "title": f"{name}: T={args.threads}, batch wait {BATCH_WAIT_MS:g} ms",
        "model": args.model, "threads": args.threads, "simulate_cores": args.simulate_cores,
        "profile": str(resolve_profile_path(profile or args.model, mode=args.graph)) if (profile or args.model) else None,
        "capacities": caps, "rate_scale": args.rate_scale, "host_over_profile": measured, "phases": [ph.__dict__ for ph in phases], "trace_notes": notes, "setups": {},
        "machine": Topology.detect().summary(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    with EmbeddedRedis(announce=False) as server:
        for setup in args.setups.split(","):
            results["setups"][setup] = run_setup(setup, args, server.url, phases, payloads)
            s = results["setups"][setup]
            print(f"[{setup}] sent {s['sent']}, received {s['received']}, lost {s['lost']}, duplicated "
                  f"{s['duplicated']}, mean {s['mean_ms']:.1f} ms, reconfigurations {len(s['reconfigurations'])}",
                  flush=True)
            # After every setup: a long run cut short keeps what it measured.
            RESULTS.mkdir(exist_ok=True)
            out = RESULTS / f"adaptive-{name}.json"
            out.write_text(json.dumps(results, indent=1))
    plot(results, RESULTS / f"adaptive-{name}.png")
    print(markdown(results))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
