"""End to end: the real `packrat-mq up` processes, spoken to with plain redis-py only.

Nothing from packrat_mq is used to talk to the service: requests are XADDed
and replies read exactly as a producer in another language would.
"""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import redis

PREFIX = "e2e"


def _wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Stack:
    def __init__(self, proc: subprocess.Popen[bytes], r: redis.Redis, model: str) -> None:
        self.proc, self.r, self.model = proc, r, model

    def instances(self) -> dict[str, dict[bytes, bytes]]:
        ids = [i.decode() for i in self.r.smembers(f"{PREFIX}:index:instances:{self.model}")]
        return {i: self.r.hgetall(f"{PREFIX}:instance:{self.model}:{i}") for i in ids}

    def send(self, reply_to: str, payload: bytes, content_type: str = "application/json", **extra: str) -> str:
        rid = uuid.uuid4().hex
        fields = {"id": rid, "reply_to": reply_to, "payload": payload, "content_type": content_type, **extra}
        self.r.xadd(f"{PREFIX}:requests:{self.model}", fields)
        return rid

    def replies(self, reply_to: str, n: int, timeout: float = 30.0) -> list[dict[bytes, bytes]]:
        _wait(lambda: self.r.xlen(reply_to) >= n, timeout, f"{n} replies on {reply_to}")
        return [fields for _, fields in self.r.xrange(reply_to)]


@pytest.fixture
def stack(request: pytest.FixtureRequest, redis_url: str, r: redis.Redis) -> Iterator[Stack]:
    model, instances, *options = request.param
    cmd = [sys.executable, "-m", "packrat_mq", "up", "--model", model, "--instances", instances,
           "--redis-url", redis_url, "--prefix", PREFIX, "--batch-timeout-ms", "3"]
    for opt in options:
        cmd += ["--option", opt]
    env = dict(os.environ, PACKRAT_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(cmd, env=env)
    s = Stack(proc, r, model)
    try:
        n = len(instances.split(","))
        _wait(lambda: r.exists(f"{PREFIX}:config:{model}") and
              sum(h.get(b"state") == b"ready" for h in s.instances().values()) == n and
              r.hget(f"{PREFIX}:dispatcher:{model}", "state") == b"ready", 60, "instances and dispatcher ready")
        yield s
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


@pytest.mark.parametrize("stack", [("echo", "1x4,1x4")], indirect=True)
def test_every_request_answered_exactly_once_with_bad_input_isolated(stack: Stack) -> None:
    reply_to = f"client:{uuid.uuid4().hex}"
    good: dict[str, object] = {}
    for i in range(150):
        good[stack.send(reply_to, json.dumps({"i": i}).encode())] = {"i": i}
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    npy_id = stack.send(reply_to, _npy(arr), "application/x-npy")
    text_id = stack.send(reply_to, "héllo".encode(), "text/plain")
    bad = {
        stack.send(reply_to, b"{not json"): "not valid application/json",
        stack.send(reply_to, b"1", "image/png"): "unknown content_type",
        stack.send(reply_to, b"\x93NUMPY garbage", "application/x-npy"): "not valid application/x-npy",
        stack.send(reply_to, b"1", deadline_ms="1000"): "deadline exceeded",
    }
    stack.r.xadd(f"{PREFIX}:requests:echo", {"id": "no-reply-to", "payload": b"1"})
    total = len(good) + 2 + len(bad)
    replies = stack.replies(reply_to, total)
    time.sleep(0.3)  # anything extra would be a duplicate
    assert stack.r.xlen(reply_to) == total
    by_id = {f[b"id"].decode(): f for f in replies}
    assert Counter(f[b"id"] for f in replies).most_common(1)[0][1] == 1
    for rid, value in good.items():
        f = by_id[rid]
        assert f[b"status"] == b"ok", f
        assert json.loads(f[b"payload"]) == value
        assert float(f[b"queue_ms"]) >= 0 and float(f[b"inference_ms"]) >= 0
    assert by_id[npy_id][b"content_type"] == b"application/x-npy"
    np.testing.assert_array_equal(np.load(io.BytesIO(by_id[npy_id][b"payload"]), allow_pickle=False), arr)
    assert by_id[text_id][b"payload"].decode() == "héllo"
    for rid, message in bad.items():
        assert by_id[rid][b"status"] == b"error"
        assert message in by_id[rid][b"error"].decode()
    assert stack.r.xlen(f"{PREFIX}:requests:echo") == 0
    assert int(stack.r.hget(f"{PREFIX}:stats:echo", "unanswerable") or 0) == 1


@pytest.mark.parametrize("stack", [("sleep", "1x1,1x1", "base_ms=400")], indirect=True)
def test_worker_killed_mid_batch_is_replaced_and_work_delivered_once(stack: Stack) -> None:
    reply_to = f"client:{uuid.uuid4().hex}"
    ids = [stack.send(reply_to, b"{}") for _ in range(4)]
    # Wait until an instance holds a sub-batch it has read but not finished.
    victim: dict[str, object] = {}

    def busy() -> bool:
        for iid, h in stack.instances().items():
            if stack.r.xpending(f"{PREFIX}:queue:sleep:{iid}", "workers")["pending"] > 0:
                victim.update(id=iid, pid=int(h[b"pid"]))
                return True
        return False

    _wait(busy, 10, "a busy instance")
    os.kill(int(victim["pid"]), signal.SIGKILL)  # type: ignore[arg-type]
    replies = stack.replies(reply_to, len(ids), timeout=30)
    time.sleep(1.0)
    assert stack.r.xlen(reply_to) == len(ids), "a request was answered twice"
    assert sorted(f[b"id"].decode() for f in replies) == sorted(ids)
    assert all(f[b"status"] == b"ok" for f in replies)
    h = stack.r.hgetall(f"{PREFIX}:instance:sleep:{victim['id']}")
    assert int(h[b"restarts"]) == 1 and int(h[b"pid"]) != victim["pid"]


@pytest.mark.parametrize("stack", [("echo", "1x2")], indirect=True)
def test_unknown_model_gets_error_and_ctrl_c_stops_cleanly(stack: Stack) -> None:
    reply_to = f"client:{uuid.uuid4().hex}"
    stack.r.xadd(f"{PREFIX}:requests:nosuch", {"id": "u1", "reply_to": reply_to, "payload": b"1"})
    (reply,) = stack.replies(reply_to, 1, timeout=10)
    assert reply[b"status"] == b"error" and b"unknown model 'nosuch'" in reply[b"error"]
    assert b"echo" in reply[b"error"]
    stack.proc.send_signal(signal.SIGINT)
    assert stack.proc.wait(30) == 0
    assert not stack.r.exists(f"{PREFIX}:config:echo")
    assert all(h.get(b"state") in (None, b"stopped") for h in stack.instances().values())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("stack", [("echo", "1x1,1x1")], indirect=True)
def test_killed_supervisor_leaves_no_orphans(stack: Stack) -> None:
    pids = [int(h[b"pid"]) for h in stack.instances().values()]
    pids.append(int(stack.r.hget(f"{PREFIX}:dispatcher:echo", "pid")))
    assert all(_alive(p) for p in pids)
    stack.proc.kill()  # SIGKILL: no chance to stop its children in order
    stack.proc.wait()
    _wait(lambda: not any(_alive(p) for p in pids), 15, "instances and dispatcher to notice and stop")
    assert all(h.get(b"state") == b"stopped" for h in stack.instances().values())
