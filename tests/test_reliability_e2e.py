"""Reliability end to end: real `packrat-mq up` processes, faults injected from outside.

Each test reproduces one defect of the reliability issue as a user found it,
speaking the wire format with plain redis-py.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests import helpers
from tests.helpers import alive, interrupt
from tests.redis_process import RedisProcess

pytestmark = [pytest.mark.timeout(180)]


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """:func:`tests.helpers.wait_for` through Redis restarts: a refused connection counts as not yet."""
    helpers.wait_for(predicate, timeout, what, ignore=(redis.ConnectionError,))


class Up:
    """A running `packrat-mq up` and the plain client a producer would have."""

    def __init__(self, url: str, prefix: str, model: str, instances: str, *options: str,
                 env: dict[str, str] | None = None, parent: bool = False) -> None:
        self.prefix, self.model = prefix, model
        self.r = redis.Redis.from_url(url)
        cmd = [sys.executable, "-m", "packrat_mq", "up", "--model", model, "--instances", instances,
               "--prefix", prefix, "--batch-timeout-ms", "2", "--exit-with-parent"]
        for opt in options:
            cmd += ["--option", opt]
        full_env = dict(os.environ, PACKRAT_LOG_LEVEL="WARNING", PACKRAT_HEARTBEAT_S="0.2")
        full_env.update(env or {})
        if "PACKRAT_REDIS_URL" not in full_env:
            cmd += ["--redis-url", url]
        self.proc = subprocess.Popen(cmd, env=full_env)
        self.n = len(instances.split(","))
        wait_for(self.ready, 60, "instances and dispatcher ready")

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def instances(self) -> dict[str, dict[bytes, bytes]]:
        ids = [i.decode() for i in self.r.smembers(self.key("index", "instances", self.model))]
        return {i: self.r.hgetall(self.key("instance", self.model, i)) for i in ids}

    def dispatcher(self) -> dict[bytes, bytes]:
        return self.r.hgetall(self.key("dispatcher", self.model))

    def ready(self) -> bool:
        states = [h.get(b"state") for h in self.instances().values()]
        return states.count(b"ready") == self.n and self.dispatcher().get(b"state") == b"ready"

    def send(self, reply_to: str, payload: bytes, content_type: str = "application/json") -> str:
        rid = uuid.uuid4().hex
        self.r.xadd(self.key("requests", self.model),
                    {"id": rid, "reply_to": reply_to, "payload": payload, "content_type": content_type})
        return rid

    def replies(self, reply_to: str, n: int, timeout: float = 60.0, grace_s: float = 0.5) -> dict[str, dict[bytes, bytes]]:
        """Exactly ``n`` replies, each to a different id, and no more within ``grace_s``."""
        wait_for(lambda: self.r.xlen(reply_to) >= n, timeout, f"{n} replies on {reply_to}")
        time.sleep(grace_s)
        entries = [f for _, f in self.r.xrange(reply_to)]
        ids = [f[b"id"].decode() for f in entries]
        assert len(ids) == n and len(set(ids)) == n, f"{len(ids)} replies for {len(set(ids))} ids (expected {n})"
        return dict(zip(ids, entries))

    def stop(self) -> None:
        interrupt(self.proc)


@pytest.fixture
def up(redis_url: str, prefix: str, r: redis.Redis) -> Iterator[Any]:
    started: list[Up] = []

    def start(*args: Any, **kw: Any) -> Up:
        kw.setdefault("url", redis_url)
        u = Up(kw.pop("url"), prefix, *args, **kw)
        started.append(u)
        return u

    yield start
    for u in started:
        u.stop()


def test_poison_requests_fail_alone_and_never_restart_a_worker(up: Any, prefix: str) -> None:
    """Deep JSON (RecursionError) and a .npy claiming 2**40 elements (MemoryError) once killed workers."""
    from tests.test_reliability import huge_npy_header

    svc = up("echo", "1x2,1x2")
    reply_to = f"{prefix}:replies:c"
    poison = [svc.send(reply_to, b"[" * 100_000), svc.send(reply_to, huge_npy_header(), "application/x-npy"),
              svc.send(reply_to, b"[" * 100_000)]
    good = [svc.send(reply_to, b'{"i": %d}' % i) for i in range(20)]
    got = svc.replies(reply_to, len(poison) + len(good))
    assert all(got[i][b"status"] == b"error" for i in poison)
    assert all(got[i][b"status"] == b"ok" for i in good)
    assert all(int(h.get(b"restarts") or 0) == 0 for h in svc.instances().values()), "a worker died"


def test_non_utf8_request_stream_does_not_stop_the_dispatcher(up: Any, prefix: str) -> None:
    svc = up("echo", "1x1")
    reply_to = f"{prefix}:replies:c"
    svc.r.xadd(f"{prefix}:requests:bad\xffname".encode("latin-1"), {"id": "x", "reply_to": reply_to, "payload": b"{}"})
    ids = [svc.send(reply_to, b"1") for _ in range(5)]
    got = svc.replies(reply_to, 6, timeout=15)
    assert got["x"][b"status"] == b"error" and b"unknown model" in got["x"][b"error"]
    assert all(got[i][b"status"] == b"ok" for i in ids)
    assert int(svc.dispatcher().get(b"restarts") or 0) == 0


def test_reply_to_naming_the_config_or_a_queue_changes_nothing(up: Any, prefix: str) -> None:
    svc = up("echo", "1x1")
    (iid,) = svc.instances()
    config, queue = svc.key("config", "echo"), svc.key("queue", "echo", iid)
    svc.send(config, b"1")
    svc.send(queue, b"1")
    reply_to = f"{prefix}:replies:c"
    ids = [svc.send(reply_to, b"1") for _ in range(3)]
    svc.replies(reply_to, len(ids))
    assert svc.r.ttl(config) == -1 and svc.r.ttl(queue) == -1
    assert int(svc.r.hget(svc.key("stats", "echo"), "unanswerable")) == 2
    assert svc.r.xinfo_groups(queue), "the instance queue kept its consumer group"


def test_password_is_on_no_command_line(tmp_path: Path, up: Any, prefix: str) -> None:
    """The workers' and dispatcher's specs carry the URL: it must not be in /proc/PID/cmdline."""
    password = "s3cret-" + uuid.uuid4().hex[:8]
    with RedisProcess(tmp_path / "redis", password=password, appendonly=False) as server:
        svc = up("echo", "1x1,1x1", url=server.url, env={"PACKRAT_REDIS_URL": server.url})
        pids = [int(h[b"pid"]) for h in svc.instances().values()] + [int(svc.dispatcher()[b"pid"]), svc.proc.pid]
        for pid in pids:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert password.encode() not in cmdline, f"password on the command line of pid {pid}"
        reply_to = f"{prefix}:replies:c"
        rid = svc.send(reply_to, b"1")
        assert svc.replies(reply_to, 1)[rid][b"status"] == b"ok"
        svc.stop()


def test_up_rides_out_an_instance_death_while_redis_is_down(tmp_path: Path, up: Any, prefix: str) -> None:
    """`up` exited when an instance died while Redis was unreachable, leaving requests unanswered."""
    with RedisProcess(tmp_path / "redis") as server:
        svc = up("sleep", "1x1,1x1", "base_ms=20", url=server.url)
        reply_to = f"{prefix}:replies:c"
        ids = [svc.send(reply_to, b"{}") for _ in range(200)]
        wait_for(lambda: svc.r.xlen(reply_to) >= 10, 30, "some replies")
        victim = int(next(iter(svc.instances().values()))[b"pid"])
        server.stop()
        os.kill(victim, signal.SIGKILL)
        time.sleep(2.0)  # the supervisor notices the death and cannot write to Redis
        assert svc.proc.poll() is None, "up exited while Redis was down"
        server.start()
        got = svc.replies(reply_to, len(ids), timeout=90)
        assert set(got) == set(ids)
        wait_for(svc.ready, 30, "every process ready again")
        assert svc.proc.poll() is None


def test_service_recovers_from_a_flushall(up: Any, prefix: str, r: redis.Redis) -> None:
    """After FLUSHALL (or a Redis restart without persistence) groups, records and the deployment come back."""
    svc = up("echo", "1x1,1x1")
    # FLUSHALL would destroy the shared test server; deleting this prefix's keys is the same for the service.
    from tests.conftest import delete_prefixed

    delete_prefixed(r, prefix)
    reply_to = f"{prefix}:replies:c"
    ids = [svc.send(reply_to, b"1") for _ in range(10)]
    got = svc.replies(reply_to, len(ids), timeout=30)
    assert all(f[b"status"] == b"ok" for f in got.values())
    wait_for(svc.ready, 10, "records restored by heartbeats")
    assert int(svc.dispatcher().get(b"restarts") or 0) == 0
    assert all(int(h.get(b"restarts") or 0) == 0 for h in svc.instances().values()), "no crash loop"


def test_a_worker_that_keeps_dying_does_not_stall_the_others(up: Any, prefix: str) -> None:
    """A dead instance's queue counts as full only while it is gone; the other instance serves on."""
    svc = up("sleep", "1x1,1x1", "base_ms=5")
    reply_to = f"{prefix}:replies:c"
    victim_id, victim = next(iter(svc.instances().items()))
    killed = 0
    deadline = time.monotonic() + 8
    ids = []
    while time.monotonic() < deadline:
        pid = int(svc.r.hget(svc.key("instance", "sleep", victim_id), "pid") or 0)
        if pid and alive(pid):
            os.kill(pid, signal.SIGKILL)
            killed += 1
        ids += [svc.send(reply_to, b"{}") for _ in range(20)]
        time.sleep(0.4)
    got = svc.replies(reply_to, len(ids), timeout=60, grace_s=1.0)
    assert set(got) == set(ids)
    others = [i for i in svc.instances() if i != victim_id]
    served_by_others = sum(f.get(b"instance", b"").decode() in others for f in got.values())
    assert killed >= 3 and served_by_others >= len(ids) // 2


def test_status_shows_a_killed_dispatcher_restarted_and_never_a_dead_one_ready(up: Any, redis_url: str,
                                                                                prefix: str) -> None:
    svc = up("echo", "1x1")
    old = int(svc.dispatcher()[b"pid"])
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: int(svc.dispatcher().get(b"pid", b"0")) not in (0, old) and svc.ready(), 30,
             "a new dispatcher")
    out = subprocess.run([sys.executable, "-m", "packrat_mq", "status", "--json", "--redis-url", redis_url,
                          "--prefix", prefix], capture_output=True, text=True, timeout=30)
    import json

    (m,) = json.loads(out.stdout)["models"]
    assert m["dispatcher"]["restarts"] == 1 and m["dispatcher"]["state"] == "ready"


def test_up_stops_when_its_parent_is_sigkilled(redis_url: str, prefix: str, r: redis.Redis) -> None:
    """A SIGKILLed parent (a test runner) used to leave `up`, its workers and its dispatcher running."""
    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'packrat_mq', 'up', '--model', 'echo', '-i', '1x1',"
        f" '--redis-url', {redis_url!r}, '--prefix', {prefix!r}, '--exit-with-parent'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PACKRAT_LOG_LEVEL="WARNING"))
    try:
        up_pid = int(parent.stdout.readline())  # type: ignore[union-attr]
        key = f"{prefix}:dispatcher:echo"
        wait_for(lambda: r.hget(key, "state") == b"ready", 60, "the service")
        pids = [up_pid, int(r.hget(key, "pid"))]
        pids += [int(r.hget(f"{prefix}:instance:echo:{i.decode()}", "pid"))
                 for i in r.smembers(f"{prefix}:index:instances:echo")]
        parent.kill()
        parent.wait()
        wait_for(lambda: not any(alive(p) for p in pids), 30, "up and its children to stop")
    finally:
        if parent.poll() is None:
            parent.kill()
