"""Fault-injection soak: a real `packrat-mq up` under steady load while its parts are killed.

About 10,000 requests are XADDed with plain redis-py over a minute, while a
random worker instance is SIGKILLed every few seconds, the dispatcher is
SIGKILLed once and Redis (append-only file, fsync every second) is restarted
once. Afterwards every request must have exactly one reply, and every
process must be back without anyone's help.

The producer never resends: an XADD that raised ``ConnectionError`` after
it was sent may or may not have been applied, so its id is counted as
*uncertain* (answered once or not at all, never twice); a resend would be a
second request by design. One that failed to connect was certainly not sent
(counted apart, and must get no reply). The producer's and the reader's
clients have redis-py's own retries turned off for the same reason: a
retried XADD is a resend.

The only error reply a fault may cause is "worker instance died N times": a
sub-batch whose instance was killed under it more than ``MAX_DELIVERIES``
times. With a kill every few seconds and 4 ms sub-batches it should not
happen; when it does, N must not exceed the kills of that instance (plus
the Redis restart, whose outage also makes an instance re-read its pending
sub-batch). Any other error reply fails the test.

Recovery of a fault is the time from the fault to the first reply the
affected part produced afterwards, taken from the reply's stream entry id
(Redis's clock, the same host's as ours):

- worker kill: the first reply from that instance id after the kill;
- dispatcher kill: the first reply to a request XADDed after the kill;
- Redis restart: the first reply written after Redis is back, counted from
  the SIGTERM (the time Redis was down is reported beside it).

At this load a lone request always goes to the first instance (the split
breaks ties by order), so a worker's first reply also depends on traffic:
the time until its record shows a new pid ``ready`` (sampled every 50 ms) is
reported beside it, with the restart backoff the pool chose (from its log).
The pool forgets failures only after 30 s without one, so an instance
killed every few seconds waits 1, 2, 4, 8 s before it starts again; a kill
may hit the only instance up, and requests then wait in the request stream.

The table goes to stdout; with ``PACKRAT_SOAK_REPORT=path`` also as JSON
(with the faults, the slowest requests and the final status).
``PACKRAT_SOAK_SEED`` replays a fault schedule (the seed is in the table;
which instance is killed also depends on which are up at the time);
``PACKRAT_SOAK_REQUESTS`` and ``PACKRAT_SOAK_RATE`` make a longer or heavier soak.
Marked ``slow`` (``make test-fast`` skips it) and ``soak``; ``make test`` runs it.
"""
from __future__ import annotations

import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.helpers import eventually, interrupt
from tests.redis_process import RedisProcess

pytestmark = [pytest.mark.soak, pytest.mark.slow, pytest.mark.timeout(240)]

PREFIX = "soak"
MODEL = "sleep"
INSTANCES = "1x2,1x2"
# Two 1-core instances taking 2 requests each (B=4). A sub-batch sleeps
# base_ms + per_item_ms * 2 = 4 ms: one instance alone still serves several
# times the offered rate, so a backlog left by a fault drains in seconds.
SLEEP_OPTIONS = ("base_ms=2", "per_item_ms=1")
REQUESTS = int(os.environ.get("PACKRAT_SOAK_REQUESTS", "10500"))
RATE = float(os.environ.get("PACKRAT_SOAK_RATE", "175"))  # requests/s: 10,500 take 60 s
REPLY_STREAMS = [f"{PREFIX}:replies:c{k}" for k in range(4)]
#: Seconds between worker kills (uniform), and the quiet gap kept around the other faults.
KILL_EVERY = (3.0, 6.0)
QUIET_AROUND = 2.5
#: The worker's rule: a sub-batch delivered more than this many times is answered with an error.
MAX_DELIVERIES = 3
DIED = re.compile(r"worker instance died (\d+) times")
#: The pool's log line for a dead instance, with the restart backoff it chose.
EXITED = re.compile(r"instance (\S+) \(pid (\d+)\) exited with code (-?\d+); restarting in (\d+) s")


def _client(rp: RedisProcess) -> redis.Redis:
    """A client that never retries a command on its own (a retried XADD would be a resend)."""
    return redis.Redis(unix_socket_path=str(rp.socket), password=rp.password, retry=Retry(NoBackoff(), 0),
                       socket_timeout=5, socket_connect_timeout=1)


def _ms(entry_id: bytes | str) -> int:
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-", 1)[0])


def _not_sent(exc: Exception) -> bool:
    """Whether redis-py failed to connect, so the command never left this process."""
    return "connecting to" in str(exc)


def _cmdline(pid: int) -> bytes:
    """The process's command line; empty for a zombie or a pid that is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return b""


@dataclass
class Reply:
    id: str
    status: str
    error: str
    instance: str
    ms: int  # the reply's stream entry id: when Redis wrote it
    entry: str


class Producer(threading.Thread):
    """XADDs ``n`` requests at ``rate`` per second, keeping its own record of what it sent."""

    def __init__(self, rp: RedisProcess, n: int, rate: float) -> None:
        super().__init__(name="soak-producer", daemon=True)
        self.rp, self.n, self.rate = rp, n, rate
        self.sent: dict[str, int] = {}  # id -> ms of its request stream entry
        self.uncertain: dict[str, float] = {}  # id -> when its XADD failed (may or may not be applied)
        self.not_sent: set[str] = set()  # no connection, or Redis answered "loading": certainly not applied
        self.reconnects = 0
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def _run(self) -> None:
        r = _client(self.rp)
        stream = f"{PREFIX}:requests:{MODEL}"
        t0 = time.monotonic()
        for i in range(self.n):
            if self.stopping.is_set():
                return
            delay = t0 + i / self.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            rid = f"soak-{i:06d}"
            fields = {"id": rid, "reply_to": REPLY_STREAMS[i % len(REPLY_STREAMS)], "payload": b"{}",
                      "content_type": "application/json"}
            try:
                self.sent[rid] = _ms(r.xadd(stream, fields))
            except redis.BusyLoadingError:
                self.not_sent.add(rid)
                self._wait_for_redis(r)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if _not_sent(exc):
                    self.not_sent.add(rid)
                else:
                    self.uncertain[rid] = time.time()
                self._wait_for_redis(r)

    def _wait_for_redis(self, r: redis.Redis) -> None:
        self.reconnects += 1
        while not self.stopping.is_set():
            try:
                if r.ping():
                    return
            except redis.RedisError:
                pass
            time.sleep(0.02)


class Reader(threading.Thread):
    """XREADs every reply stream, recording each reply (with its entry id) as it comes."""

    def __init__(self, rp: RedisProcess) -> None:
        super().__init__(name="soak-reader", daemon=True)
        self.rp = rp
        self.replies: list[Reply] = []
        self.last: dict[str, bytes | str] = {s: "0-0" for s in REPLY_STREAMS}
        self.stopping = threading.Event()

    def run(self) -> None:
        r = _client(self.rp)
        while not self.stopping.is_set():
            try:
                resp = r.xread(self.last, count=1000, block=100)
            except redis.RedisError:
                time.sleep(0.02)  # Redis restarting: read on from the same ids when it is back
                continue
            for stream, entries in resp:
                for entry_id, f in entries:
                    self.last[stream.decode()] = entry_id
                    self.replies.append(_reply(entry_id, f))

    def answered(self) -> set[str]:
        return {rep.id for rep in list(self.replies)}


class Monitor(threading.Thread):
    """Samples every instance's and the dispatcher's (pid, state) every 50 ms, to see when each is back."""

    def __init__(self, rp: RedisProcess) -> None:
        super().__init__(name="soak-monitor", daemon=True)
        self.rp = rp
        self.samples: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
        self.stopping = threading.Event()

    def run(self) -> None:
        r = _client(self.rp)
        while not self.stopping.wait(0.05):
            try:
                records = _instances(r)
                records["dispatcher"] = r.hgetall(f"{PREFIX}:dispatcher:{MODEL}")
            except redis.RedisError:
                continue
            now = time.time() * 1000
            for target, h in records.items():
                self.samples[target].append((now, int(h.get(b"pid") or 0), h.get(b"state", b"").decode()))

    def ready_again(self, f: Fault) -> float | None:
        """Seconds from a kill until the target's record shows a new pid in state ``ready``."""
        for at, pid, state in list(self.samples[f.target]):
            if at > f.at_ms and pid != f.pid and state == "ready":
                return (at - f.at_ms) / 1000
        return None


def _reply(entry_id: bytes, f: dict[bytes, bytes]) -> Reply:
    return Reply(id=f[b"id"].decode(), status=f.get(b"status", b"").decode(), error=f.get(b"error", b"").decode(),
                 instance=f.get(b"instance", b"").decode(), ms=_ms(entry_id), entry=entry_id.decode())


@dataclass
class Fault:
    kind: str  # worker_kill, dispatcher_kill, redis_restart
    at_ms: float  # wall clock, ms
    target: str = ""
    pid: int = 0
    back_ms: float = 0.0  # redis_restart: when it answered again
    recovery_s: float | None = None
    ready_s: float | None = None  # kills: until the record shows a new process ready (50 ms samples)
    backoff_s: float | None = None  # worker_kill: the restart delay the pool chose (from its log)


@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    log: Path
    faults: list[Fault] = field(default_factory=list)
    skipped_kills: int = 0


def _instances(ctl: redis.Redis) -> dict[str, dict[bytes, bytes]]:
    ids = sorted(i.decode() for i in ctl.smembers(f"{PREFIX}:index:instances:{MODEL}"))
    return {i: ctl.hgetall(f"{PREFIX}:instance:{MODEL}:{i}") for i in ids}


def _fresh(h: dict[bytes, bytes], now: float) -> bool:
    """State ``ready`` with a heartbeat younger than three intervals (the service's own rule)."""
    if h.get(b"state") != b"ready" or b"heartbeat" not in h:
        return False
    return now - float(h[b"heartbeat"]) <= 3 * float(h.get(b"interval") or 1.0)


def _all_ready(ctl: redis.Redis, n: int) -> bool:
    try:
        now = time.time()
        hashes = list(_instances(ctl).values())
        d = ctl.hgetall(f"{PREFIX}:dispatcher:{MODEL}")
        return len(hashes) == n and all(_fresh(h, now) for h in hashes) and _fresh(d, now)
    except redis.RedisError:
        return False


def _wait(predicate: Any, timeout: float, what: str, up: Up | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if up is not None and up.proc.poll() is not None:
            raise AssertionError(f"`up` exited with {up.proc.returncode} while waiting for {what}:\n{_tail(up.log)}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}" + (f":\n{_tail(up.log)}" if up else ""))


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _kill_worker(ctl: redis.Redis, up: Up, rng: random.Random) -> None:
    """SIGKILL a random instance that is ready and whose pid is a live worker process."""
    try:
        candidates = [(iid, int(h[b"pid"])) for iid, h in _instances(ctl).items()
                      if h.get(b"state") == b"ready" and h.get(b"pid")]
    except redis.RedisError:
        candidates = []
    candidates = [(iid, pid) for iid, pid in candidates if b"workers.worker" in _cmdline(pid)]
    if not candidates:
        up.skipped_kills += 1  # every instance is restarting: nothing to kill now
        return
    iid, pid = rng.choice(candidates)
    at = time.time() * 1000
    os.kill(pid, signal.SIGKILL)
    up.faults.append(Fault("worker_kill", at, target=iid, pid=pid))


def _kill_dispatcher(ctl: redis.Redis, up: Up) -> None:
    pid = int(ctl.hget(f"{PREFIX}:dispatcher:{MODEL}", "pid") or 0)
    assert pid and b"dispatcher" in _cmdline(pid), f"no live dispatcher process at pid {pid}"
    at = time.time() * 1000
    os.kill(pid, signal.SIGKILL)
    up.faults.append(Fault("dispatcher_kill", at, target="dispatcher", pid=pid))


def _restart_redis(rp: RedisProcess, up: Up) -> None:
    at = time.time() * 1000
    rp.restart(down_s=1.0)  # SIGTERM: the append-only file is flushed on the way out
    up.faults.append(Fault("redis_restart", at, target="redis", back_ms=time.time() * 1000))


def _schedule(rng: random.Random, duration: float) -> list[tuple[float, str]]:
    """(seconds after the first request, fault kind): worker kills every few seconds, one of each other."""
    others = [(0.3 * duration, "dispatcher_kill"), (0.6 * duration, "redis_restart")]
    events = list(others)
    t = 3.0
    while t < duration - 8.0:
        if all(abs(t - at) > QUIET_AROUND for at, _ in others):
            events.append((t, "worker_kill"))
        t += rng.uniform(*KILL_EVERY)
    return sorted(events)


def _recoveries(up: Up, replies: list[Reply], requested_ms: dict[str, int]) -> None:
    by_instance: dict[str, list[int]] = defaultdict(list)
    for rep in replies:
        by_instance[rep.instance].append(rep.ms)
    for times in by_instance.values():
        times.sort()
    all_times = sorted(rep.ms for rep in replies)
    for f in up.faults:
        after: list[int]
        if f.kind == "worker_kill":
            after = [t for t in by_instance[f.target] if t > f.at_ms]
        elif f.kind == "dispatcher_kill":
            after = [rep.ms for rep in replies if requested_ms.get(rep.id, 0) > f.at_ms]
        else:
            after = [t for t in all_times if t >= f.back_ms]
        f.recovery_s = (min(after) - f.at_ms) / 1000 if after else None


def _restart_delays(log: Path) -> dict[int, float]:
    """pid of each dead instance -> the restart backoff the pool logged for it."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {}
    return {int(m.group(2)): float(m.group(4)) for m in EXITED.finditer(text)}


def _all_down_s(faults: list[Fault], n_instances: int) -> float:
    """Seconds during which every instance was between a kill and its first reply after it."""
    edges: list[tuple[float, int, str]] = []
    for f in faults:
        if f.kind == "worker_kill" and f.recovery_s is not None:
            edges += [(f.at_ms, 1, f.target), (f.at_ms + 1000 * f.recovery_s, -1, f.target)]
    down: Counter[str] = Counter()
    total, since = 0.0, None
    for at, step, target in sorted(edges, key=lambda e: (e[0], e[1])):
        down[target] += step
        everyone = sum(1 for v in down.values() if v > 0) == n_instances
        if everyone and since is None:
            since = at
        elif not everyone and since is not None:
            total += at - since
            since = None
    return round(total / 1000, 3)


def _summary(values: list[float]) -> dict[str, float | None]:
    return {"median_s": round(statistics.median(values), 3) if values else None,
            "max_s": round(max(values), 3) if values else None}


def _machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")
    except (OSError, subprocess.SubprocessError):
        model = ""
    return f"{model or platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"


def _table(report: dict[str, Any]) -> str:
    c = report["counts"]
    lines = [
        f"fault-injection soak (seed {report['seed']}): {MODEL} {' '.join(SLEEP_OPTIONS)}, {INSTANCES}, "
        f"{report['rate_per_s']:g} req/s offered",
        f"  {'sent':<22}{c['sent']}",
        f"  {'ok':<22}{c['ok']}",
        f"  {'error':<22}{c['error']}" + (f"  ({report['errors']})" if report["errors"] else ""),
        f"  {'lost':<22}{c['lost']}",
        f"  {'duplicated':<22}{c['duplicated']}",
        f"  {'uncertain':<22}{c['uncertain']} (answered {c['uncertain_answered']}; "
        f"{c['not_sent']} more certainly not sent: no connection)",
    ]
    for kind, r in report["recovery"].items():
        lines.append(f"  {kind + ' x' + str(r['count']):<22}to first reply median {r['median_s']} s, max {r['max_s']} s"
                     f" (measured for {r['measured']})" + (f", Redis down {r['down_s']} s" if "down_s" in r else ""))
        if kind != "redis_restart":
            lines.append(f"  {'':<22}to ready (new pid) median {r['ready_again']['median_s']} s,"
                         f" max {r['ready_again']['max_s']} s")
        if "backoff" in r:
            b, w = r["backoff"], r["ready_without_backoff"]
            lines.append(f"  {'':<22}restart backoff in it median {b['median_s']} s, max {b['max_s']} s;"
                         f" to ready less backoff median {w['median_s']} s, max {w['max_s']} s")
            lines.append(f"  {'':<22}no instance up for {r['all_instances_down_s']} s in all")
    lat = report["latency_ms"]
    if lat:
        lines.append(f"  {'latency (ms)':<22}p50 {lat['p50']}, p99 {lat['p99']}, max {lat['max']} (XADD to reply)")
    lines += [
        f"  {'wall time':<22}{report['wall_s']} s (first request to last reply {report['serving_s']} s)",
        f"  {'machine':<22}{report['machine']}",
    ]
    return "\n".join(lines)


def test_soak_every_request_answered_once_through_worker_dispatcher_and_redis_faults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    began = time.monotonic()
    seed = int(os.environ.get("PACKRAT_SOAK_SEED") or time.time())
    rng = random.Random(seed)
    rp = RedisProcess(tmp_path / "redis").start()
    log = tmp_path / "up.log"
    cmd = [sys.executable, "-m", "packrat_mq", "up", "--model", MODEL, "--instances", INSTANCES,
           "--redis-url", rp.url, "--prefix", PREFIX, "--batch-timeout-ms", "2", "--exit-with-parent"]
    for opt in SLEEP_OPTIONS:
        cmd += ["--option", opt]
    env = dict(os.environ, PACKRAT_LOG_LEVEL="WARNING")
    producer = Producer(rp, REQUESTS, RATE)
    reader = Reader(rp)
    monitor = Monitor(rp)
    with open(log, "wb") as out:
        up = Up(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL), log)
    ctl = _client(rp)
    n_instances = len(INSTANCES.split(","))
    try:
        _wait(lambda: _all_ready(ctl, n_instances), 60, "instances and dispatcher ready", up)
        reader.start()
        monitor.start()
        duration = REQUESTS / RATE
        events = _schedule(rng, duration)
        producer.start()
        t0 = time.monotonic()
        for at, kind in events:
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            if kind == "worker_kill":
                _kill_worker(ctl, up, rng)
            elif kind == "dispatcher_kill":
                _kill_dispatcher(ctl, up)
            else:
                _restart_redis(rp, up)
        producer.join(duration + 60)
        assert not producer.is_alive(), "the producer did not finish"
        assert producer.error is None, f"producer failed: {producer.error!r}"
        sent = set(producer.sent)
        # What is still missing then is counted as lost below.
        eventually(lambda: sent <= reader.answered() or up.proc.poll() is not None, 90)
        served_until = time.monotonic()
        time.sleep(2.0)  # a late duplicate would arrive now
        reader.stopping.set()
        monitor.stopping.set()
        reader.join(5)
        monitor.join(5)

        replies = [_reply(eid, f) for s in REPLY_STREAMS for eid, f in ctl.xrange(s)]
        per_id = Counter(r.id for r in replies)
        first: dict[str, Reply] = {}
        for rep in sorted(replies, key=lambda x: x.ms):
            first.setdefault(rep.id, rep)
        uncertain = set(producer.uncertain)
        lost = sorted(sent - set(per_id))
        duplicated = sorted(i for i, n in per_id.items() if n > 1)
        unexpected = sorted(set(per_id) - sent - uncertain)
        errors = Counter(first[i].error for i in sent if i in first and first[i].status != "ok")

        came_back = eventually(lambda: _all_ready(ctl, n_instances) or up.proc.poll() is not None, 45)
        shown = subprocess.run(
            [sys.executable, "-m", "packrat_mq", "status", "--json", "--redis-url", rp.url, "--prefix", PREFIX],
            capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        status = json.loads(shown.stdout)
        finished = time.monotonic()

        _recoveries(up, replies, producer.sent)
        delays = _restart_delays(log)
        for f in up.faults:
            if f.kind == "worker_kill":
                f.backoff_s = delays.get(f.pid)
            if f.kind != "redis_restart":
                f.ready_s = monitor.ready_again(f)
        recovery: dict[str, dict[str, Any]] = {}
        for kind in ("worker_kill", "dispatcher_kill", "redis_restart"):
            fs = [f for f in up.faults if f.kind == kind]
            measured = [f.recovery_s for f in fs if f.recovery_s is not None]
            recovery[kind] = {"count": len(fs), "measured": len(measured), **_summary(measured),
                              "ready_again": _summary([f.ready_s for f in fs if f.ready_s is not None]),
                              "each_s": [f.recovery_s for f in fs]}
            if kind == "redis_restart" and fs:
                recovery[kind]["down_s"] = round(max((f.back_ms - f.at_ms) / 1000 for f in fs), 3)
            if kind == "worker_kill":
                # Back ready = detection + the restart backoff the pool chose + a new process starting.
                recovery[kind]["backoff"] = _summary([f.backoff_s for f in fs if f.backoff_s is not None])
                recovery[kind]["ready_without_backoff"] = _summary(
                    [f.ready_s - f.backoff_s for f in fs if f.ready_s is not None and f.backoff_s is not None])
                recovery[kind]["all_instances_down_s"] = _all_down_s(up.faults, n_instances)
        kills_of = Counter(f.target for f in up.faults if f.kind == "worker_kill")
        # From XADD to reply, both on Redis's clock; a request behind a dead instance waits for its restart.
        latency = sorted(first[i].ms - producer.sent[i] for i in sent if i in first)
        model = status["models"][0]
        report: dict[str, Any] = {
            "seed": seed,
            "model": MODEL, "options": list(SLEEP_OPTIONS), "instances": INSTANCES,
            "requests": REQUESTS, "rate_per_s": RATE,
            "counts": {"sent": len(sent), "ok": sum(first[i].status == "ok" for i in sent if i in first),
                       "error": sum(errors.values()), "lost": len(lost), "duplicated": len(duplicated),
                       "uncertain": len(uncertain), "uncertain_answered": len(uncertain & set(per_id)),
                       "not_sent": len(producer.not_sent), "unexpected": len(unexpected)},
            "errors": dict(errors),
            "lost_ids": lost[:50], "duplicated_ids": duplicated[:50], "unexpected_ids": unexpected[:50],
            "duplicates": {i: [vars(r) for r in replies if r.id == i] for i in duplicated[:10]},
            "recovery": recovery,
            "latency_ms": {"p50": latency[len(latency) // 2], "p99": latency[int(len(latency) * 0.99)],
                           "max": latency[-1]} if latency else {},
            # The slowest requests with their instance, for telling what held them up.
            "slowest": [{"id": i, "requested_ms": producer.sent[i], "latency_ms": first[i].ms - producer.sent[i],
                         "instance": first[i].instance}
                        for i in sorted((i for i in sent if i in first),
                                        key=lambda i: producer.sent[i] - first[i].ms)[:300]],
            "kills_per_instance": dict(kills_of), "skipped_kills": up.skipped_kills,
            "faults": [vars(f) for f in up.faults],
            "status": {"dispatcher": model["dispatcher"], "instances": model["instances"], "stats": model["stats"],
                       "backlog": model["backlog"]},
            "wall_s": round(finished - began, 1),
            "serving_s": round(served_until - t0, 1),
            "machine": _machine(),
        }
        with capsys.disabled():
            print("\n" + _table(report))
        if os.environ.get("PACKRAT_SOAK_REPORT"):
            Path(os.environ["PACKRAT_SOAK_REPORT"]).write_text(json.dumps(report, indent=2) + "\n")

        def details() -> str:
            return json.dumps({k: report[k] for k in ("seed", "lost_ids", "duplicates", "unexpected_ids", "errors",
                                                      "faults")}, indent=1, default=str) + "\n" + _tail(log)

        assert len(sent) >= 10_000 or REQUESTS < 10_000, details()
        # Every reply ever written, read again from the streams: the reader saw all of it, live.
        assert sorted(r.entry for r in replies) == sorted(r.entry for r in reader.replies)
        assert not lost, f"{len(lost)} requests never answered\n{details()}"
        assert not duplicated, f"{len(duplicated)} requests answered more than once\n{details()}"
        assert not unexpected, f"replies to ids never (or certainly not) sent\n{details()}"
        # The only error a fault may legitimately cause: a sub-batch whose instance was killed
        # under it more than MAX_DELIVERIES times (rare with a kill every few seconds).
        # Its replacement counts a delivery for every kill, and for a re-read after a Redis outage.
        restarts = sum(1 for f in up.faults if f.kind == "redis_restart")
        for i in sent:
            rep = first.get(i)
            if rep is None or rep.status == "ok":
                continue
            m = DIED.search(rep.error)
            assert m and MAX_DELIVERIES <= int(m.group(1)) <= kills_of[rep.instance] + restarts, (
                f"unexpected error reply to {i} from {rep.instance}: {rep.error}\n{details()}")
        scheduled = sum(1 for _, kind in events if kind == "worker_kill")
        assert sum(1 for f in up.faults if f.kind == "worker_kill") >= min(5, scheduled), "too few worker kills"
        assert {"dispatcher_kill", "redis_restart"} <= {f.kind for f in up.faults}

        # Everything came back by itself: the same `up`, every part ready with a fresh heartbeat.
        assert up.proc.poll() is None, f"`up` exited with {up.proc.returncode}\n{_tail(log)}"
        assert came_back, f"not every part ready with a fresh heartbeat 45 s after the run: {report['status']}"
        assert model["dispatcher"]["state"] == "ready"
        assert model["dispatcher"]["pid"] not in {f.pid for f in up.faults}
        assert model["dispatcher"]["restarts"] >= 1
        assert len(model["instances"]) == n_instances
        for inst in model["instances"]:
            assert inst["state"] == "ready", inst
            assert inst["pid"] not in {f.pid for f in up.faults}, inst
            assert b"workers.worker" in _cmdline(inst["pid"]), inst
        assert model["backlog"] == 0 and all(i["queue"] == 0 for i in model["instances"])
    finally:
        producer.stopping.set()
        reader.stopping.set()
        monitor.stopping.set()
        interrupt(up.proc)
        rp.stop()
