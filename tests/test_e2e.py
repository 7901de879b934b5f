"""End to end: the real `packrat-mq up` processes, spoken to with plain redis-py only.

Nothing from packrat_mq is used to talk to the service: requests are XADDed
and replies read exactly as a producer in another language would. Each test
serves under its own key prefix.
"""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

# Only to read what a killed instance held; requests and replies go through redis-py alone.
from packrat_mq import shared_payloads
from packrat_mq.client import Client
from packrat_mq.protocol import decode_subbatch
from tests.helpers import alive, interrupt, wait_for


def _ms(stream_id: bytes) -> int:
    """Redis' clock (ms) when a stream entry was added: the first part of its id."""
    return int(stream_id.split(b"-")[0])


class Stack:
    def __init__(self, proc: subprocess.Popen[bytes], r: redis.Redis, model: str, prefix: str) -> None:
        self.proc, self.r, self.model, self.prefix = proc, r, model, prefix
        self.url = ""  # the Redis URL the stack serves on
        #: request id -> the entry id XADD gave it (its enqueue time on Redis' clock)
        self.sent: dict[str, bytes] = {}

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def reply_stream(self) -> str:
        return self.key("replies", uuid.uuid4().hex)

    def instances(self) -> dict[str, dict[bytes, bytes]]:
        ids = [i.decode() for i in self.r.smembers(self.key("index", "instances", self.model))]
        return {i: self.r.hgetall(self.key("instance", self.model, i)) for i in ids}

    def send(self, reply_to: str, payload: bytes, content_type: str = "application/json", **extra: str) -> str:
        rid = uuid.uuid4().hex
        fields = {"id": rid, "reply_to": reply_to, "payload": payload, "content_type": content_type, **extra}
        self.sent[rid] = self.r.xadd(self.key("requests", self.model), fields)
        return rid

    def replies(
        self, reply_to: str, n: int, timeout: float = 30.0, grace_s: float = 1.0
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Exactly ``n`` replies as (entry id, fields): wait for n, then watch ``grace_s`` more for a late duplicate."""
        wait_for(lambda: self.r.xlen(reply_to) >= n, timeout, f"{n} replies on {reply_to}")
        got = self.r.xrange(reply_to)
        assert len(got) == n, f"{len(got) - n} replies more than the {n} requests"
        late = self.r.xread({reply_to: got[-1][0]}, block=int(grace_s * 1000))
        assert not late, f"a reply arrived after all {n} were in: {late}"
        return got


@pytest.fixture
def stack(request: pytest.FixtureRequest, redis_url: str, r: redis.Redis, prefix: str) -> Iterator[Stack]:
    model, instances, *options = request.param
    cmd = [sys.executable, "-m", "packrat_mq", "up", "--model", model, "--instances", instances,
           "--redis-url", redis_url, "--prefix", prefix, "--batch-timeout-ms", "3"]
    for opt in options:
        cmd += ["--option", opt]
    env = dict(os.environ, PACKRAT_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(cmd, env=env)
    s = Stack(proc, r, model, prefix)
    s.url = redis_url
    try:
        n = len(instances.split(","))
        wait_for(lambda: r.exists(s.key("config", model)) and
              sum(h.get(b"state") == b"ready" for h in s.instances().values()) == n and
              r.hget(s.key("dispatcher", model), "state") == b"ready", 60, "instances and dispatcher ready")
        yield s
    finally:
        interrupt(proc)


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


@pytest.mark.parametrize("stack", [("echo", "1x4,1x4")], indirect=True)
def test_every_request_answered_exactly_once_with_bad_input_isolated(stack: Stack) -> None:
    reply_to = stack.reply_stream()
    good: dict[str, object] = {}
    for i in range(150):
        good[stack.send(reply_to, json.dumps({"i": i}).encode())] = {"i": i}
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    npy_id = stack.send(reply_to, _npy(arr), "application/x-npy")
    text_id = stack.send(reply_to, "héllo".encode(), "text/plain")
    bad = {
        stack.send(reply_to, b"{not json"): "not valid application/json",
        stack.send(reply_to, b"1", "image/gif"): "unknown content_type",
        stack.send(reply_to, b"1", "image/png"): "not valid image/png",
        stack.send(reply_to, b"\x93NUMPY garbage", "application/x-npy"): "not valid application/x-npy",
        stack.send(reply_to, b"1", deadline_ms="1000"): "deadline exceeded",
    }
    stack.r.xadd(stack.key("requests", "echo"), {"id": "no-reply-to", "payload": b"1"})
    total = len(good) + 2 + len(bad)
    replies = stack.replies(reply_to, total)
    by_id = {f[b"id"].decode(): (entry_id, f) for entry_id, f in replies}
    assert len(by_id) == total and set(by_id) == set(good) | {npy_id, text_id} | set(bad)
    for rid, value in good.items():
        entry_id, f = by_id[rid]
        assert f[b"status"] == b"ok", f
        assert json.loads(f[b"payload"]) == value
        # Both timings lie inside the request's stay in Redis: from its XADD to
        # its reply's XADD, on Redis' clock (whole ms, hence the 1 ms) and the
        # worker's, which on one host are the same clock.
        queue_ms, inference_ms = float(f[b"queue_ms"]), float(f[b"inference_ms"])
        assert inference_ms > 0, f
        assert queue_ms + inference_ms <= _ms(entry_id) - _ms(stack.sent[rid]) + 1.0, f
    assert by_id[npy_id][1][b"content_type"] == b"application/x-npy"
    np.testing.assert_array_equal(np.load(io.BytesIO(by_id[npy_id][1][b"payload"]), allow_pickle=False), arr)
    assert by_id[text_id][1][b"payload"].decode() == "héllo"
    for rid, message in bad.items():
        assert by_id[rid][1][b"status"] == b"error"
        assert message in by_id[rid][1][b"error"].decode()
    assert stack.r.xlen(stack.key("requests", "echo")) == 0
    assert int(stack.r.hget(stack.key("stats", "echo"), "unanswerable") or 0) == 1


@pytest.mark.parametrize("stack", [("sleep", "1x1,1x1", "base_ms=400")], indirect=True)
def test_worker_killed_mid_batch_is_replaced_and_its_sub_batch_delivered_again(stack: Stack) -> None:
    reply_to = stack.reply_stream()
    ids = [stack.send(reply_to, b"{}") for _ in range(4)]
    # Wait until an instance has just read a sub-batch: it is pending there and
    # has at least 250 of its 400 ms to run, so the kill lands before its EXEC.
    victim: dict[str, object] = {}

    def busy() -> bool:
        for iid, h in stack.instances().items():
            queue = stack.key("queue", "sleep", iid)
            pending = stack.r.xpending_range(queue, "workers", min="-", max="+", count=1)
            if pending and pending[0]["time_since_delivered"] < 150:
                [(_, sub_batch)] = stack.r.xrange(queue, pending[0]["message_id"], pending[0]["message_id"])
                victim.update(id=iid, pid=int(h[b"pid"]), requests=[q.id for q in decode_subbatch(sub_batch)])
                return True
        return False

    wait_for(busy, 10, "an instance that has just taken a sub-batch", interval=0.01)
    seconds, micros = stack.r.time()
    before_kill_ms = seconds * 1000 + micros / 1000
    os.kill(int(victim["pid"]), signal.SIGKILL)  # type: ignore[arg-type]

    replies = stack.replies(reply_to, len(ids), timeout=30)
    by_id = {f[b"id"].decode(): (entry_id, f) for entry_id, f in replies}
    assert sorted(by_id) == sorted(ids), "every request answered exactly once"
    assert all(f[b"status"] == b"ok" for _, f in replies)
    killed = victim["requests"]
    assert killed and set(killed) <= set(ids)  # type: ignore[arg-type]
    for rid in killed:  # type: ignore[attr-defined]
        entry_id, f = by_id[rid]
        # Answered by the same instance id after the kill: its replacement ran the sub-batch again.
        assert f[b"instance"].decode() == victim["id"], f
        assert _ms(entry_id) >= int(before_kill_ms), f
        # It waited from its XADD until the replacement started, which was after the kill.
        assert float(f[b"queue_ms"]) >= before_kill_ms - _ms(stack.sent[rid]), f
    h = stack.r.hgetall(stack.key("instance", "sleep", victim["id"]))  # type: ignore[arg-type]
    assert int(h[b"restarts"]) == 1 and int(h[b"pid"]) != victim["pid"]


@pytest.mark.parametrize("stack", [("echo", "1x2")], indirect=True)
def test_unknown_model_gets_error_and_ctrl_c_stops_cleanly(stack: Stack) -> None:
    reply_to = stack.reply_stream()
    stack.r.xadd(stack.key("requests", "nosuch"), {"id": "u1", "reply_to": reply_to, "payload": b"1"})
    ((_, reply),) = stack.replies(reply_to, 1, timeout=10)
    assert reply[b"status"] == b"error" and b"unknown model 'nosuch'" in reply[b"error"]
    assert b"echo" in reply[b"error"]
    stack.proc.send_signal(signal.SIGINT)
    assert stack.proc.wait(30) == 0
    assert not stack.r.exists(stack.key("config", "echo"))
    assert all(h.get(b"state") in (None, b"stopped") for h in stack.instances().values())


@pytest.mark.parametrize("stack", [("echo", "1x1,1x1")], indirect=True)
def test_killed_supervisor_leaves_no_orphans(stack: Stack) -> None:
    pids = [int(h[b"pid"]) for h in stack.instances().values()]
    pids.append(int(stack.r.hget(stack.key("dispatcher", "echo"), "pid")))
    assert all(alive(p) for p in pids)
    stack.proc.kill()  # SIGKILL: no chance to stop its children in order
    stack.proc.wait()
    wait_for(lambda: not any(alive(p) for p in pids), 15, "instances and dispatcher to notice and stop")
    assert all(h.get(b"state") == b"stopped" for h in stack.instances().values())


@pytest.mark.parametrize("stack", [("echo", "1x4")], indirect=True)
def test_payloads_in_shared_memory_are_served_and_their_files_deleted(stack: Stack) -> None:
    """A producer on the serving host names files in PACKRAT_SHM_DIR instead of sending the bytes."""
    shm = os.environ["PACKRAT_SHM_DIR"]  # the test's own directory (conftest), which `up` inherits
    os.makedirs(shm, exist_ok=True)
    reply_to = stack.reply_stream()
    arrays = {}
    for i in range(3):
        arrays[f"img-{i}"] = np.full((3, 8, 8), i, dtype=np.float32)
        with open(os.path.join(shm, f"img-{i}"), "wb") as f:
            f.write(_npy(arrays[f"img-{i}"]))

    def send_file(name: str) -> str:
        rid = uuid.uuid4().hex
        stack.r.xadd(stack.key("requests", "echo"), {"id": rid, "reply_to": reply_to, "payload_shm": name,
                                                     "content_type": "application/x-npy"})
        return rid

    ids = {send_file(name): name for name in arrays}
    with open(os.path.join(shm, "both"), "wb") as f:
        f.write(b"refused")
    for rid in ids:  # the file named, not the (empty) payload, is the input
        stack.r.xadd(stack.key("requests", "echo"), {"id": f"dup-{rid}"[:40], "reply_to": reply_to,
                                                     "payload": b"1", "payload_shm": "both"})
    missing = send_file("never-written")
    replies = stack.replies(reply_to, len(ids) + 3 + 1)
    by_id = {f[b"id"].decode(): f for _, f in replies}
    for rid, name in ids.items():
        assert by_id[rid][b"status"] == b"ok", by_id[rid][b"error"]
        np.testing.assert_array_equal(np.load(io.BytesIO(by_id[rid][b"payload"]), allow_pickle=False), arrays[name])
    assert b"is not in" in by_id[missing][b"error"]
    refused = [f for i, f in by_id.items() if i.startswith("dup-")]
    assert len(refused) == 3 and all(b"exclusive" in f[b"error"] for f in refused)
    assert os.listdir(shm) == [], "answered requests' files deleted by the worker; a refused one's by the dispatcher"


@pytest.mark.parametrize("stack", [("echo", "1x2")], indirect=True)
def test_submit_shm_sends_the_file_through_shared_memory(stack: Stack, tmp_path: Path) -> None:
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    path = tmp_path / "x.npy"
    path.write_bytes(_npy(arr))
    done = subprocess.run([sys.executable, "-m", "packrat_mq", "submit", "-m", "echo", "--file", str(path), "--shm",
                           "--json", "--redis-url", stack.url, "--prefix", stack.prefix],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["value"] == arr.tolist()
    assert int(stack.r.hget(stack.key("stats", "echo"), "replies")) == 1
    assert os.listdir(os.environ["PACKRAT_SHM_DIR"]) == [], "the client deletes its file at close"
    # A producer whose payload directory is not the service's: the worker cannot find the file, and says so.
    elsewhere = dict(os.environ, PACKRAT_SHM_DIR=str(tmp_path / "other"))
    done = subprocess.run([sys.executable, "-m", "packrat_mq", "submit", "-m", "echo", "--file", str(path), "--shm",
                           "--redis-url", stack.url, "--prefix", stack.prefix],
                          capture_output=True, text=True, timeout=60, env=elsewhere)
    assert done.returncode == 1 and "payload_shm" in done.stderr and "is not in" in done.stderr, done.stderr


@pytest.mark.parametrize("stack", [("echo", "1x2")], indirect=True)
def test_sealed_payloads_are_mapped_by_the_served_instances(stack: Stack, tmp_path: Path) -> None:
    """A producer on the serving host hands the workers sealed memfds (payload_fd), lent or copied into."""
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    path = tmp_path / "x.npy"
    path.write_bytes(_npy(arr))
    done = subprocess.run([sys.executable, "-m", "packrat_mq", "submit", "-m", "echo", "--file", str(path), "--sealed",
                           "--json", "--redis-url", stack.url, "--prefix", stack.prefix],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["value"] == arr.tolist()
    client = Client(stack.url, prefix=stack.prefix, shared_memory="sealed", shm_min_bytes=1)
    try:
        lent = [client.empty((64, 64), np.float32) for _ in range(4)]
        for i, img in enumerate(lent):
            img[...] = i
        replies = client.submit_many("echo", [*lent, np.ones(5000)], timeout=30)
        for i, rep in enumerate(replies[:4]):
            np.testing.assert_array_equal(rep.value(), np.full((64, 64), i, dtype=np.float32))
        np.testing.assert_array_equal(replies[4].value(), np.ones(5000))
    finally:
        client.close()
    # A sealed payload that is gone by the time it is served (its producer closed it): that request's error.
    gone = shared_payloads.SealedFile(len(_npy(arr)))
    gone.write(_npy(arr))
    gone.close()
    reply_to = stack.reply_stream()
    stack.r.xadd(stack.key("requests", "echo"), {"id": "gone", "reply_to": reply_to, "payload_fd": gone.ref,
                                                 "content_type": "application/x-npy"})
    [(_, f)] = stack.replies(reply_to, 1)
    # (Its descriptor may be reused meanwhile, by a socket say: then it is no sealed payload instead.)
    assert f[b"status"] == b"error" and f[b"error"].startswith(f"payload_fd '{gone.ref}'".encode()), f
