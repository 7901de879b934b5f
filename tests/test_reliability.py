"""Reliability, in process against a real Redis: each defect of the reliability issue, reproduced.

One bad request or one fault never stops a model, and no internal key is
writable from a request. The end-to-end versions, with real processes, are in
test_reliability_e2e.py.
"""
from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis

from dispatcher.dispatcher import Dispatcher
from dispatcher.orphans import sweep
from packrat_mq import protocol
from packrat_mq.cli.status import collect_status, render
from packrat_mq.deployment import Deployment, InstanceRecord
from packrat_mq.handler import BaseHandler
from packrat_mq.keys import DISPATCHER_GROUP, WORKER_GROUP
from packrat_mq.settings import Settings
from packrat_mq.streams import ensure_group
from packrat_mq.zoo.testing import EchoHandler
from tests.helpers import eventually, hand_out
from workers.worker import Worker, WorkerSpec

MODEL = "m"


# --- helpers -------------------------------------------------------------------
def make_worker(r: redis.Redis, settings: Settings, handler: BaseHandler | None = None, iid: str = "i0") -> Worker:
    spec = WorkerSpec(url=settings.redis_url or "", settings=settings, model=MODEL, handler="echo", instance_id=iid)
    handler = handler or EchoHandler()
    handler.initialize(spec.context())
    w = Worker(r, spec, handler)
    ensure_group(r, w.queue, WORKER_GROUP)
    return w


def deploy(r: redis.Redis, settings: Settings, shares: list[tuple[int, int]]) -> Deployment:
    dep = Deployment(model=MODEL, handler="echo",
                     instances=[InstanceRecord(id=f"i{j}", threads=t, batch=b) for j, (t, b) in enumerate(shares)])
    r.set(settings.keys.config(MODEL), dep.model_dump_json())
    for inst in dep.instances:
        ensure_group(r, settings.keys.queue(MODEL, inst.id), WORKER_GROUP)
    return dep


def make_dispatcher(r: redis.Redis, settings: Settings) -> Dispatcher:
    d = Dispatcher(r, settings, MODEL)
    d.setup()
    return d


def beat(r: redis.Redis, settings: Settings, iid: str, state: str = "ready", age_s: float = 0.0) -> None:
    r.hset(settings.keys.instance(MODEL, iid),
           mapping={"state": state, "heartbeat": f"{time.time() - age_s:.3f}", "interval": 1.0, "pid": 1})
    r.sadd(settings.keys.instances(MODEL), iid)


def npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def huge_npy_header() -> bytes:
    """A valid .npy header claiming 2**40 float32 elements, followed by no data."""
    header = np.lib.format.header_data_from_array_1_0(np.zeros(1, dtype="<f4"))
    header["shape"] = (1 << 40,)
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue()


def request(rid: str, payload: bytes, content_type: str, reply_to: str) -> protocol.Request:
    now = int(time.time() * 1000)
    return protocol.Request(id=rid, reply_to=reply_to, payload=payload, content_type=content_type,
                            enqueued_ms=now, stream_id=f"{now}-0")


def by_id(r: redis.Redis, stream: str) -> dict[str, dict[bytes, bytes]]:
    out: dict[str, dict[bytes, bytes]] = {}
    for _, f in r.xrange(stream):
        rid = f[b"id"].decode()
        assert rid not in out, f"two replies to {rid}"
        out[rid] = f
    return out


# --- 1. payloads that raise unexpected exceptions --------------------------------
POISON = {
    "deep-json": (b"[" * 100_000, protocol.JSON, "nested too deeply"),
    "deep-object": (b'{"a":' * 100_000, protocol.JSON, "nested too deeply"),
    "huge-npy-header": (huge_npy_header(), protocol.NPY, "header says shape (1099511627776,)"),
    "latin1-json": ('{"a": "é"}'.encode("latin-1"), protocol.JSON, "not UTF-8"),
    "truncated-npy": (npy(np.arange(10, dtype=np.float32))[:-8], protocol.NPY, "bytes follow"),
    "object-npy": (b"\x93NUMPY\x01\x00v\x00{'descr': '|O', 'fortran_order': False, 'shape': (1,), }"
                   + b" " * 50 + b"\n", protocol.NPY, "not valid application/x-npy"),
}


@pytest.mark.parametrize("name", sorted(POISON))
def test_decode_payload_turns_every_failure_into_a_payload_error(name: str) -> None:
    payload, content_type, message = POISON[name]
    with pytest.raises(protocol.PayloadError, match="not valid") as info:
        protocol.decode_payload(content_type, payload)
    assert message in str(info.value)


def test_poison_payloads_fail_alone_and_the_worker_serves_on(r: redis.Redis, settings: Settings) -> None:
    w = make_worker(r, settings)
    reply_to = settings.keys.replies("c")
    batch = [request(name, payload, ctype, reply_to) for name, (payload, ctype, _) in POISON.items()]
    batch.append(request("good", b'{"ok": 1}', protocol.JSON, reply_to))
    batch.append(request("good-npy", npy(np.arange(4.0)), protocol.NPY, reply_to))
    hand_out(r, w.keys, w.spec.model, w.spec.instance_id, batch, "b1")
    assert w.run_once(block_ms=100) == 1
    got = by_id(r, reply_to)
    assert set(got) == {*POISON, "good", "good-npy"}
    for name, (_, _, message) in POISON.items():
        assert got[name][b"status"] == b"error" and message in got[name][b"error"].decode(), got[name]
    assert got["good"][b"status"] == b"ok"
    np.testing.assert_array_equal(np.load(io.BytesIO(got["good-npy"][b"payload"])), np.arange(4.0))
    assert r.xlen(w.queue) == 0 and r.xpending(w.queue, WORKER_GROUP)["pending"] == 0


class Exploding(EchoHandler):
    """Raises what a careless handler can: MemoryError, RecursionError, a bad result type."""

    def inference(self, batch: Any) -> Any:
        kind = batch[0].get("raise") if isinstance(batch[0], dict) else None
        if kind == "memory":
            raise MemoryError("out of memory")
        if kind == "recursion":
            raise RecursionError("maximum recursion depth exceeded")
        if kind == "unencodable":
            return [{1, 2}]  # a set is not JSON
        return batch


@pytest.mark.parametrize("kind", ["memory", "recursion", "unencodable"])
def test_handler_failures_fail_their_batch_only(r: redis.Redis, settings: Settings, kind: str) -> None:
    w = make_worker(r, settings, Exploding())
    reply_to = settings.keys.replies("c")
    bad = request("bad", f'{{"raise": "{kind}"}}'.encode(), protocol.JSON, reply_to)
    hand_out(r, w.keys, w.spec.model, w.spec.instance_id, [bad], "b1")
    hand_out(r, w.keys, w.spec.model, w.spec.instance_id, [request("next", b'{"fine": true}', protocol.JSON, reply_to)], "b2")
    w.run_once(block_ms=100)
    w.run_once(block_ms=100)
    got = by_id(r, reply_to)
    assert got["bad"][b"status"] == b"error"
    assert got["next"][b"status"] == b"ok"


def test_worker_loop_survives_an_error_in_an_iteration(r: redis.Redis, settings: Settings,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Any exception of one iteration is logged, counted and retried; the loop goes on."""
    w = make_worker(r, settings)
    real = w.read
    calls = {"n": 0}

    def flaky(block_ms: int = 1000) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyError("a bug in one iteration")
        return real(block_ms=50)

    monkeypatch.setattr(w, "read", flaky)
    reply_to = settings.keys.replies("c")
    hand_out(r, w.keys, w.spec.model, w.spec.instance_id, [request("x", b"1", protocol.JSON, reply_to)], "b1")
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and r.xlen(reply_to) < 1:
            time.sleep(0.01)
    finally:
        w.stop()
        t.join(5)
    assert r.xlen(reply_to) == 1
    assert int(r.hget(settings.keys.instance(MODEL, "i0"), "loop_errors")) == 1


# --- 2. request stream names that are not UTF-8 ----------------------------------
def test_sweep_answers_a_stream_whose_name_is_not_utf8(r: redis.Redis, settings: Settings) -> None:
    reply_to = settings.keys.replies("c")
    bad_key = settings.keys.requests("").encode() + b"bad\xffname"
    r.xadd(bad_key, {"id": "x", "reply_to": reply_to, "payload": b"{}"})
    r.xadd(settings.keys.requests("nosuch"), {"id": "y", "reply_to": reply_to, "payload": b"{}"})
    assert sweep(r, settings, grace_ms=0) == 2
    got = by_id(r, reply_to)
    assert got["x"][b"status"] == b"error" and b"unknown model 'bad\xef\xbf\xbdname'" in got["x"][b"error"]
    assert got["y"][b"status"] == b"error"
    assert r.xlen(bad_key) == 0


def test_dispatcher_serves_while_a_non_utf8_stream_exists(r: redis.Redis, settings: Settings) -> None:
    deploy(r, settings, [(1, 2)])
    r.xadd(settings.keys.requests("").encode() + b"\xff\xfe", {"id": "x", "reply_to": "elsewhere", "payload": b"1"})
    d = make_dispatcher(r, settings)
    r.xadd(settings.keys.requests(MODEL), protocol.request_fields("a", settings.keys.replies("c"), b"1", protocol.JSON))
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and r.xlen(settings.keys.queue(MODEL, "i0")) < 1:
            time.sleep(0.01)
    finally:
        d.stop()
        t.join(5)
    assert r.xlen(settings.keys.queue(MODEL, "i0")) == 1
    assert not r.hget(settings.keys.dispatcher(MODEL), "loop_errors")


# --- 3. reply_to naming the service's own keys, or keys of other types ------------
@pytest.mark.parametrize("kind", ["config", "queue", "requests", "instance", "stats", "index"])
def test_reply_to_inside_the_namespace_is_refused(r: redis.Redis, settings: Settings, kind: str) -> None:
    keys = settings.keys
    target = {"config": keys.config(MODEL), "queue": keys.queue(MODEL, "i0"), "requests": keys.requests(MODEL),
              "instance": keys.instance(MODEL, "i0"), "stats": keys.stats(MODEL), "index": keys.models()}[kind]
    deploy(r, settings, [(1, 1)])
    d = make_dispatcher(r, settings)
    beat(r, settings, "i0")
    r.hset(keys.stats(MODEL), "requests", 0)
    r.xadd(keys.requests(MODEL), protocol.request_fields("evil", target, b"1", protocol.JSON))
    d.run_once(idle_block_ms=100)  # learns the deployment
    assert d.run_once(idle_block_ms=100) == 1
    for key in (keys.config(MODEL), keys.queue(MODEL, "i0"), keys.requests(MODEL), keys.instance(MODEL, "i0"),
                keys.stats(MODEL), keys.models()):
        assert r.ttl(key) == -1, f"{key} gained a TTL"
    assert r.xlen(keys.queue(MODEL, "i0")) == 0, "the request was not served"
    assert int(r.hget(keys.stats(MODEL), "unanswerable")) == 1
    assert r.exists(keys.config(MODEL))


def test_reply_to_under_replies_is_allowed(r: redis.Redis, settings: Settings) -> None:
    assert protocol.reply_to_problem(settings.keys.replies("c1"), settings.prefix) is None
    assert protocol.reply_to_problem("my:app:replies", settings.prefix) is None
    assert protocol.reply_to_problem(settings.keys.config("m"), settings.prefix) is not None


def test_replies_never_expire_or_write_keys_they_did_not_create(r: redis.Redis, settings: Settings,
                                                                 prefix: str) -> None:
    w = make_worker(r, settings)
    other = f"{prefix}-other"
    r.hset(f"{other}:hash", "k", "v")
    r.xadd(f"{other}:persistent-stream", {"x": 1})
    r.xadd(f"{other}:volatile-stream", {"x": 1})
    r.expire(f"{other}:volatile-stream", 10)
    batch = [request("to-hash", b"1", protocol.JSON, f"{other}:hash"),
             request("to-persistent", b"2", protocol.JSON, f"{other}:persistent-stream"),
             request("to-volatile", b"3", protocol.JSON, f"{other}:volatile-stream"),
             request("to-new", b"4", protocol.JSON, f"{other}:new-stream")]
    hand_out(r, w.keys, w.spec.model, w.spec.instance_id, batch, "b1")
    w.run_once(block_ms=100)
    assert r.ttl(f"{other}:hash") == -1 and r.hgetall(f"{other}:hash") == {b"k": b"v"}
    assert r.ttl(f"{other}:persistent-stream") == -1, "a persistent key must never become volatile"
    assert r.xlen(f"{other}:persistent-stream") == 2
    assert r.ttl(f"{other}:volatile-stream") > 10, "a volatile reply stream is refreshed (extended only)"
    assert 0 < r.ttl(f"{other}:new-stream") <= settings.reply_ttl_s
    stats = r.hgetall(settings.keys.stats(MODEL))
    assert int(stats[b"replies"]) == 3, "a reply that could not be written is not counted as a reply"
    assert int(stats[b"undeliverable"]) == 1


def test_undeliverable_reply_is_logged_with_request_id_and_key(r: redis.Redis, settings: Settings, prefix: str,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    w = make_worker(r, settings)
    r.hset(f"{prefix}-other:h", "k", "v")
    hand_out(r, w.keys, w.spec.model, w.spec.instance_id, [request("req-42", b"1", protocol.JSON, f"{prefix}-other:h")], "b")
    with caplog.at_level(logging.WARNING):
        w.run_once(block_ms=100)
    assert any("req-42" in rec.getMessage() and f"{prefix}-other:h" in rec.getMessage() for rec in caplog.records)


# --- minor: messages for non-UTF-8 fields ------------------------------------------
def test_non_utf8_fields_are_named_in_the_error() -> None:
    def reject(fields: dict[bytes, bytes]) -> protocol.RequestRejected:
        with pytest.raises(protocol.RequestRejected) as info:
            protocol.parse_request(b"1-0", fields, max_payload_bytes=100, prefix="p")
        return info.value

    exc = reject({b"id": b"\xff\xfe", b"reply_to": b"r", b"payload": b"1"})
    assert "id is not UTF-8" in str(exc) and exc.reply_to == "r"
    exc = reject({b"id": b"x", b"reply_to": b"\xff", b"payload": b"1"})
    assert "reply_to is not UTF-8" in str(exc) and exc.reply_to is None
    with pytest.raises(protocol.PayloadError, match="not UTF-8"):
        protocol.decode_payload(protocol.JSON, '"é"'.encode("latin-1"))


# --- a dead instance does not stall the model ----------------------------------------
def _send(r: redis.Redis, settings: Settings, n: int) -> None:
    for i in range(n):
        r.xadd(settings.keys.requests(MODEL),
               protocol.request_fields(f"r{i}", settings.keys.replies("c"), b"1", protocol.JSON))


@pytest.mark.parametrize("dead", ["restarting", "stale", "starting"])
def test_dispatcher_sends_nothing_to_a_dead_instance_and_serves_with_the_others(
        r: redis.Redis, settings: Settings, dead: str) -> None:
    deploy(r, settings, [(1, 2), (1, 2)])
    beat(r, settings, "i0")
    if dead == "stale":
        beat(r, settings, "i1", "ready", age_s=10.0)
    else:
        beat(r, settings, "i1", dead)
    # i1's queue is full, as a dead instance's would be: it must not hold i0 up.
    r.xadd(settings.keys.queue(MODEL, "i1"), {"batch": "x", "meta": "[]"})
    r.xadd(settings.keys.queue(MODEL, "i1"), {"batch": "y", "meta": "[]"})
    d = make_dispatcher(r, settings)
    _send(r, settings, 4)
    assert d.run_once(idle_block_ms=100) == 0  # learns the deployment
    assert d.run_once(idle_block_ms=100) == 2, "the batch shrinks to the live instance's share"
    assert r.xlen(settings.keys.queue(MODEL, "i0")) == 1
    assert r.xlen(settings.keys.queue(MODEL, "i1")) == 2
    beat(r, settings, "i1")  # back
    r.delete(settings.keys.queue(MODEL, "i1"), settings.keys.queue(MODEL, "i0"))
    ensure_group(r, settings.keys.queue(MODEL, "i1"), WORKER_GROUP)
    ensure_group(r, settings.keys.queue(MODEL, "i0"), WORKER_GROUP)
    assert d.run_once(idle_block_ms=100) == 2
    assert r.xlen(settings.keys.queue(MODEL, "i1")) == 1


# --- backpressure ------------------------------------------------------------------------
def test_backlog_over_the_bound_is_refused_as_overloaded(r: redis.Redis, settings: Settings) -> None:
    settings = settings.model_copy(update={"max_backlog": 5})
    deploy(r, settings, [(1, 1)])
    beat(r, settings, "i0")
    r.xadd(settings.keys.queue(MODEL, "i0"), {"batch": "x", "meta": "[]"})
    r.xadd(settings.keys.queue(MODEL, "i0"), {"batch": "y", "meta": "[]"})  # busy: nothing is read
    d = make_dispatcher(r, settings)
    _send(r, settings, 12)
    d.run_once(idle_block_ms=50)
    assert r.xlen(settings.keys.requests(MODEL)) == 5
    got = by_id(r, settings.keys.replies("c"))
    assert sorted(got) == sorted(f"r{i}" for i in range(5, 12)), "the newest are refused, the oldest kept"
    assert all(b"overloaded" in f[b"error"] for f in got.values())
    assert int(r.hget(settings.keys.stats(MODEL), "overloaded")) == 7
    (m,) = collect_status(r, settings.keys)["models"]
    assert m["dispatcher"]["max_backlog"] == 5
    assert "of at most 5" in render({**collect_status(r, settings.keys), "redis_url": "x"}, settings.prefix)


def test_shedding_never_takes_what_the_dispatcher_has_read(r: redis.Redis, settings: Settings) -> None:
    settings = settings.model_copy(update={"max_backlog": 2})
    deploy(r, settings, [(1, 1)])
    d = make_dispatcher(r, settings)
    _send(r, settings, 3)
    r.xreadgroup(DISPATCHER_GROUP, "dispatcher", {settings.keys.requests(MODEL): ">"}, count=3)  # all read
    assert d.shed(1) == 0
    assert r.xlen(settings.keys.requests(MODEL)) == 3


# --- status is truthful ------------------------------------------------------------------
def test_status_shows_a_stale_heartbeat_as_stale_never_ready(r: redis.Redis, settings: Settings) -> None:
    deploy(r, settings, [(1, 1), (1, 1)])
    r.sadd(settings.keys.models(), MODEL)
    beat(r, settings, "i0", age_s=0.5)
    beat(r, settings, "i1", age_s=3.5)
    r.hset(settings.keys.dispatcher(MODEL), mapping={"state": "ready", "heartbeat": time.time() - 10,
                                                    "interval": 1.0, "restarts": 2})
    (m,) = collect_status(r, settings.keys)["models"]
    states = {i["id"]: i["state"] for i in m["instances"]}
    assert states == {"i0": "ready", "i1": "stale"}
    assert m["dispatcher"]["state"] == "stale" and m["dispatcher"]["restarts"] == 2


# --- consumer groups lost to a Redis restart or FLUSHALL ----------------------------------
@pytest.fixture
def running_worker(r: redis.Redis, settings: Settings) -> Iterator[Worker]:
    w = make_worker(r, settings)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    yield w
    w.stop()
    t.join(5)


def test_worker_recreates_its_group_when_redis_lost_it(r: redis.Redis, settings: Settings,
                                                       running_worker: Worker) -> None:
    w = running_worker
    r.delete(w.queue)  # what a restart without persistence does to the queue and its group
    assert eventually(lambda: r.hget(w.instance_key, "groups_recreated") == b"1")
    hand_out(r, w.keys, w.spec.model, w.spec.instance_id, [request("after", b"1", protocol.JSON, settings.keys.replies("c"))], "b")
    assert eventually(lambda: r.xlen(settings.keys.replies("c")) == 1)
    assert int(r.hget(w.instance_key, "loop_errors") or 0) == 0


def test_worker_heartbeat_restores_its_record_after_a_flush(r: redis.Redis, settings: Settings,
                                                            running_worker: Worker) -> None:
    w = running_worker
    assert eventually(lambda: r.hget(w.instance_key, "state") == b"ready")
    r.delete(w.instance_key, settings.keys.instances(MODEL))
    assert eventually(lambda: r.hget(w.instance_key, "state") == b"ready", timeout=5)
    assert r.sismember(settings.keys.instances(MODEL), "i0")


def test_dispatcher_recreates_its_group_when_redis_lost_it(r: redis.Redis, settings: Settings) -> None:
    deploy(r, settings, [(1, 1)])
    d = make_dispatcher(r, settings)
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    # run() sets up again (the group included) before it starts its estimator: delete the stream only
    # after that, or a slow thread recreates the group itself and never meets NOGROUP (one full run did).
    assert eventually(lambda: d.adaptive._thread is not None)
    try:
        r.delete(settings.keys.requests(MODEL))
        r.xadd(settings.keys.requests(MODEL), protocol.request_fields("a", settings.keys.replies("c"), b"1", protocol.JSON))
        # XADD recreated the stream without the group: the next XREADGROUP gets NOGROUP.
        assert eventually(lambda: r.xlen(settings.keys.queue(MODEL, "i0")) == 1)
    finally:
        d.stop()
        t.join(5)
    assert int(r.hget(settings.keys.dispatcher(MODEL), "groups_recreated")) >= 1
