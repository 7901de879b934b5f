"""A worker instance in-process against a real Redis: replies, acks, redelivery."""
from __future__ import annotations

import io
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
import redis

from dispatcher.dispatcher import ensure_group
from packrat_mq import protocol
from packrat_mq.handler import BaseHandler, Context
from packrat_mq.keys import DISPATCHER_GROUP, WORKER_GROUP
from packrat_mq.settings import Settings
from packrat_mq.zoo.testing import EchoHandler, SleepHandler
from tests.helpers import hand_out
from workers.worker import Worker, WorkerSpec

MODEL = "m"
#: The reply stream of this test's requests, under its own key prefix (set below).
REPLY = ""


@pytest.fixture(autouse=True)
def _reply_stream(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "REPLY", settings.keys.replies("c1"))


class Counting(EchoHandler):
    """Echo that counts the batches it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def inference(self, batch: Any) -> Any:
        self.calls += 1
        return batch


class Unencodable(EchoHandler):
    def inference(self, batch: Any) -> Any:
        return [object() if x == "bad" else x for x in batch]


def make_worker(
    r: redis.Redis, settings: Settings, handler: BaseHandler | None = None, *, instance_id: str = "i0", **kw: Any
) -> Worker:
    spec = WorkerSpec(
        url=settings.redis_url or "", settings=settings, model=MODEL, handler="echo", instance_id=instance_id, **kw
    )
    handler = handler or Counting()
    handler.initialize(spec.context())
    w = Worker(r, spec, handler)
    ensure_group(r, w.queue, WORKER_GROUP)
    return w


def request(i: int, value: Any = None, *, reply_to: str | None = None, deadline_ms: int | None = None,
            payload: bytes | None = None, content_type: str | None = None) -> protocol.Request:
    """A request that has waited 3 ms in the request stream (``enqueued_ms`` is now - 3)."""
    if payload is None:
        payload, content_type = protocol.encode_payload({"i": i} if value is None else value)
    now = int(time.time() * 1000)
    return protocol.Request(
        id=f"req-{i}", reply_to=reply_to or REPLY, payload=payload, content_type=content_type or protocol.JSON,
        enqueued_ms=now - 3, deadline_ms=deadline_ms, stream_id=f"{now}-{i}",
    )


def push(r: redis.Redis, w: Worker, reqs: list[protocol.Request], batch_id: str = "b1", *, carry_bytes: int = 0) -> bytes:
    return hand_out(r, w.keys, MODEL, w.spec.instance_id, reqs, batch_id, carry_bytes=carry_bytes)


def step(w: Worker) -> int:
    """Read and process what is there (one sub-batch); returns how many were processed."""
    entries = w.read(block_ms=50)
    for entry_id, fields in entries:
        w.process(entry_id, fields)
    return len(entries)


def replies(r: redis.Redis, stream: str | None = None) -> list[dict[bytes, bytes]]:
    return [f for _, f in r.xrange(stream or REPLY)]


def text(f: dict[bytes, bytes], name: str) -> str:
    return f[name.encode()].decode()


def assert_queue_clean(r: redis.Redis, w: Worker) -> None:
    """Nothing left: neither the sub-batch in the queue nor its requests in the request stream."""
    assert r.xlen(w.queue) == 0
    assert r.xpending(w.queue, WORKER_GROUP)["pending"] == 0
    assert r.xlen(w.requests_stream) == 0
    if r.exists(w.requests_stream):
        assert r.xpending(w.requests_stream, DISPATCHER_GROUP)["pending"] == 0


# --- replies -----------------------------------------------------------------
def test_replies_for_every_request(r: redis.Redis, settings: Settings) -> None:
    w = make_worker(r, settings)
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    buf = io.BytesIO()
    np.save(buf, arr)
    reqs = [
        request(0),
        request(1, "héllo"),
        request(2, payload=buf.getvalue(), content_type=protocol.NPY),
        request(3, payload=b"\x00\xff", content_type=protocol.BYTES),
    ]
    push(r, w, reqs)
    before_ms = time.time() * 1000.0
    assert step(w) == 1
    after_ms = time.time() * 1000.0

    got = replies(r)
    assert [text(f, "id") for f in got] == ["req-0", "req-1", "req-2", "req-3"]
    # queue_ms runs from the request's enqueue time (3 ms before it was made)
    # to the start of its batch; inference_ms is the batch's, shared by its replies.
    waited_ms = [float(text(f, "queue_ms")) for f in got]
    assert all(3.0 - 1e-3 <= q <= after_ms - reqs[0].enqueued_ms + 1e-3 for q in waited_ms), waited_ms
    (inference_ms,) = {float(text(f, "inference_ms")) for f in got}
    assert 0.0 < inference_ms <= after_ms - before_ms
    for f in got:
        assert text(f, "status") == protocol.OK and text(f, "error") == ""
        assert text(f, "batch_size") == "4"
        assert text(f, "instance") == "i0" and text(f, "model") == MODEL
    values = [protocol.decode_payload(text(f, "content_type"), f[b"payload"]) for f in got]
    assert values[0] == {"i": 0}
    assert values[1] == "héllo"
    np.testing.assert_array_equal(values[2], arr)
    assert values[3] == b"\x00\xff"
    assert 0 < r.ttl(REPLY) <= settings.reply_ttl_s

    assert_queue_clean(r, w)
    assert r.lrange(settings.keys.wakeup(MODEL), 0, -1) == [b"i0"]
    assert r.hget(settings.keys.stats(MODEL), "replies") == b"4"
    assert r.hget(settings.keys.stats(MODEL), "errors") is None
    assert w.handler.calls == 1  # type: ignore[attr-defined]
    assert w.batches == 1
    assert r.hget(w.instance_key, "batches") == b"1"


def test_payloads_are_fetched_from_the_request_stream_and_deleted_with_the_replies(
    r: redis.Redis, settings: Settings
) -> None:
    w = make_worker(r, settings)
    reqs = [request(0), request(1, "two")]
    push(r, w, reqs)
    [(_, sub)] = r.xrange(w.queue)
    assert b"p0" not in sub, "the sub-batch names the requests; their payloads stay in the request stream"
    assert step(w) == 1
    values = [protocol.decode_payload(text(f, "content_type"), f[b"payload"]) for f in replies(r)]
    assert values == [{"i": 0}, "two"]
    assert_queue_clean(r, w)


def test_a_request_gone_from_the_stream_fails_alone(r: redis.Redis, settings: Settings) -> None:
    w = make_worker(r, settings)
    reqs = [request(0), request(1)]
    push(r, w, reqs)
    r.xdel(w.requests_stream, reqs[0].stream_id)  # trimmed by someone else before it was served
    assert step(w) == 1
    got = {text(f, "id"): f for f in replies(r)}
    assert text(got["req-0"], "status") == protocol.ERROR
    assert "no longer in the request stream" in text(got["req-0"], "error")
    assert text(got["req-1"], "status") == protocol.OK
    assert_queue_clean(r, w)


def test_sub_batch_with_inline_payloads_is_served_as_before(r: redis.Redis, settings: Settings) -> None:
    """A queue entry written by an older dispatcher (payloads in p0, p1, ...) during an upgrade."""
    w = make_worker(r, settings)
    reqs = [request(0), request(1)]
    fields = protocol.encode_subbatch(reqs, "old")
    fields.update({f"p{i}": req.payload for i, req in enumerate(reqs)})
    r.xadd(w.queue, fields)
    assert step(w) == 1
    assert [text(f, "status") for f in replies(r)] == [protocol.OK, protocol.OK]
    assert r.xlen(w.queue) == 0


def test_a_sub_batch_that_carries_its_payloads_is_served_without_fetching(
    r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small payloads the dispatcher put in the sub-batch: no XRANGE; the requests are acknowledged all the same."""
    w = make_worker(r, settings)
    push(r, w, [request(0), request(1, "two")], carry_bytes=protocol.CARRY_MAX_BYTES)
    fetched: list[Any] = []
    real = w.r.xrange
    monkeypatch.setattr(w.r, "xrange", lambda *a, **k: fetched.append(a) or real(*a, **k))
    assert step(w) == 1
    assert fetched == [], "a carried payload was fetched"
    got = replies(r)
    assert [protocol.decode_payload(text(f, "content_type"), f[b"payload"]) for f in got] == [{"i": 0}, "two"]
    assert_queue_clean(r, w)


def test_replies_go_to_each_producers_stream(r: redis.Redis, settings: Settings) -> None:
    w = make_worker(r, settings)
    a, b = settings.keys.replies("a"), settings.keys.replies("b")
    push(r, w, [request(0, reply_to=a), request(1, reply_to=b), request(2, reply_to=a)])
    step(w)
    assert [text(f, "id") for f in replies(r, a)] == ["req-0", "req-2"]
    assert [text(f, "id") for f in replies(r, b)] == ["req-1"]


def test_wakeup_list_is_capped(r: redis.Redis, settings: Settings) -> None:
    from workers.acks import WAKEUP_CAP

    w = make_worker(r, settings)
    r.rpush(settings.keys.wakeup(MODEL), *(["old"] * (WAKEUP_CAP + 10)))
    push(r, w, [request(0)])
    step(w)
    assert r.llen(settings.keys.wakeup(MODEL)) == WAKEUP_CAP
    assert r.lindex(settings.keys.wakeup(MODEL), 0) == b"i0"


def test_undecodable_payload_fails_alone(r: redis.Redis, settings: Settings) -> None:
    w = make_worker(r, settings)
    push(r, w, [
        request(0),
        request(1, payload=b"{broken", content_type=protocol.JSON),
        request(2, payload=b"not npy", content_type=protocol.NPY),
        request(3),
    ])
    step(w)
    got = {text(f, "id"): f for f in replies(r)}
    assert text(got["req-0"], "status") == protocol.OK and text(got["req-3"], "status") == protocol.OK
    assert text(got["req-1"], "status") == protocol.ERROR
    assert "not valid application/json" in text(got["req-1"], "error")
    assert "not valid application/x-npy" in text(got["req-2"], "error")
    assert r.hget(settings.keys.stats(MODEL), "errors") == b"2"
    assert w.handler.calls == 1  # type: ignore[attr-defined]
    assert_queue_clean(r, w)


def test_deadline_passed_before_inference(r: redis.Redis, settings: Settings) -> None:
    w = make_worker(r, settings)
    now = int(time.time() * 1000)
    push(r, w, [request(0, deadline_ms=now - 50), request(1, deadline_ms=now + 60_000)])
    step(w)
    got = {text(f, "id"): f for f in replies(r)}
    assert text(got["req-0"], "status") == protocol.ERROR
    assert "deadline exceeded before inference" in text(got["req-0"], "error")
    assert text(got["req-1"], "status") == protocol.OK


def test_all_expired_model_not_run(r: redis.Redis, settings: Settings) -> None:
    w = make_worker(r, settings)
    push(r, w, [request(0, deadline_ms=1), request(1, deadline_ms=2)])
    step(w)
    assert [text(f, "status") for f in replies(r)] == [protocol.ERROR, protocol.ERROR]
    assert w.handler.calls == 0  # type: ignore[attr-defined]
    assert_queue_clean(r, w)


def test_validate_rejection_and_unencodable_output(r: redis.Redis, settings: Settings) -> None:
    sleep = make_worker(r, settings, SleepHandler(), instance_id="s0", options={"base_ms": 0})
    push(r, sleep, [request(0, {"sleep_ms": 5}), request(1, {"sleep_ms": "soon"})])
    step(sleep)
    got = {text(f, "id"): f for f in replies(r)}
    assert text(got["req-0"], "status") == protocol.OK
    assert float(text(got["req-0"], "inference_ms")) >= 5.0, "the batch slept 5 ms"
    assert "sleep_ms must be a number" in text(got["req-1"], "error")

    r.delete(REPLY)
    w = make_worker(r, settings, Unencodable(), instance_id="u0")
    push(r, w, [request(0, "bad"), request(1, "fine")])
    step(w)
    got = {text(f, "id"): f for f in replies(r)}
    assert "could not be encoded" in text(got["req-0"], "error")
    assert text(got["req-1"], "status") == protocol.OK
    assert_queue_clean(r, w)


def test_unreadable_sub_batch_is_dropped(r: redis.Redis, settings: Settings) -> None:
    w = make_worker(r, settings)
    r.xadd(w.queue, {"batch": "x", "meta": "{not json"})
    r.xadd(w.queue, {"batch": "y"})  # no meta at all
    assert step(w) == 1 and step(w) == 1
    assert replies(r) == []
    assert_queue_clean(r, w)


def test_reply_to_of_wrong_type_does_not_kill_the_worker(r: redis.Redis, settings: Settings) -> None:
    w = make_worker(r, settings)
    not_a_stream = settings.keys.replies("not-a-stream")  # a string, not a stream
    r.set(not_a_stream, "v")
    push(r, w, [request(0, reply_to=not_a_stream), request(1)])
    step(w)
    assert [text(f, "id") for f in replies(r)] == ["req-1"]
    assert r.get(not_a_stream) == b"v"
    assert_queue_clean(r, w)


class Fencing(EchoHandler):
    """Echo during whose batch a dispatcher takes the instance for dead and sets its fence."""

    def __init__(self, r: redis.Redis, fence: str) -> None:
        super().__init__()
        self.r, self.fence = r, fence

    def inference(self, batch: Any) -> Any:
        self.r.set(self.fence, "1")
        return batch


def test_a_fence_set_while_the_batch_runs_leaves_the_transaction_unwritten(
    r: redis.Redis, settings: Settings
) -> None:
    """Every write of the reply transaction checks the fence: no reply, no ack, no counter, no wake-up."""
    w = make_worker(r, settings, Fencing(r, settings.keys.fence(MODEL, "i0")))
    other = settings.keys.replies("c2")
    push(r, w, [request(0), request(1, reply_to=other)])
    assert step(w) == 1
    assert w._stopping.is_set()  # it stops; a new process lifts the fence
    assert replies(r) == [] and replies(r, other) == []
    assert r.xpending(w.queue, WORKER_GROUP)["pending"] == 1  # still its, for the dispatcher to claim back
    assert r.xlen(w.requests_stream) == 2
    assert r.hget(settings.keys.stats(MODEL), "replies") is None
    assert r.hget(w.instance_key, "batches") is None
    assert r.llen(settings.keys.wakeup(MODEL)) == 0
    assert w.batches == 0


def test_a_failed_acknowledgement_is_logged_and_the_rest_applied(
    r: redis.Redis, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Like EXEC, the acknowledgement script runs every command and reports the one that failed."""
    w = make_worker(r, settings)
    push(r, w, [request(0)])
    r.set(settings.keys.wakeup(MODEL), "not a list")  # its LPUSH fails: WRONGTYPE
    with caplog.at_level("WARNING", logger="packrat_mq.worker"):
        assert step(w) == 1
    assert [text(f, "id") for f in replies(r)] == ["req-0"]
    assert_queue_clean(r, w)
    assert r.hget(w.instance_key, "batches") == b"1"
    assert any("WRONGTYPE" in rec.getMessage() for rec in caplog.records), caplog.text
    assert not w._stopping.is_set()


# --- redelivery --------------------------------------------------------------
def test_redelivered_sub_batch_answered_exactly_once(r: redis.Redis, settings: Settings) -> None:
    first = make_worker(r, settings)
    push(r, first, [request(0), request(1)], "b1")
    # The first worker read it and died before its MULTI/EXEC.
    got = r.xreadgroup(WORKER_GROUP, "i0", {first.queue: ">"}, count=1)
    assert len(got[0][1]) == 1
    push(r, first, [request(2)], "b2")

    fresh = make_worker(r, settings)
    assert step(fresh) == 1  # the pending one first
    assert [text(f, "id") for f in replies(r)] == ["req-0", "req-1"]
    assert step(fresh) == 1
    assert step(fresh) == 0
    assert [text(f, "id") for f in replies(r)] == ["req-0", "req-1", "req-2"]
    assert all(text(f, "status") == protocol.OK for f in replies(r))
    assert_queue_clean(r, fresh)


def test_other_instances_pending_entries_are_not_taken(r: redis.Redis, settings: Settings) -> None:
    a = make_worker(r, settings, instance_id="i0")
    push(r, a, [request(0)])
    r.xreadgroup(WORKER_GROUP, "i0", {a.queue: ">"}, count=1)
    b = make_worker(r, settings, instance_id="i1")
    assert step(b) == 0
    assert replies(r) == []


def test_sub_batch_over_max_deliveries_is_not_run(r: redis.Redis, settings: Settings) -> None:
    counting = Counting()
    probe = make_worker(r, settings, Counting())
    push(r, probe, [request(0), request(1)])
    # Delivered three times already: read, then re-read twice by replacements that died.
    r.xreadgroup(WORKER_GROUP, "i0", {probe.queue: ">"}, count=1)
    r.xreadgroup(WORKER_GROUP, "i0", {probe.queue: "0"}, count=1)
    r.xreadgroup(WORKER_GROUP, "i0", {probe.queue: "0"}, count=1)

    w = make_worker(r, settings, counting, max_deliveries=3)
    assert step(w) == 1  # fourth delivery
    assert counting.calls == 0
    got = replies(r)
    assert [text(f, "id") for f in got] == ["req-0", "req-1"]
    for f in got:
        assert text(f, "status") == protocol.ERROR
        assert "died 3 times" in text(f, "error") and "not run again" in text(f, "error")
    assert_queue_clean(r, w)
    assert r.hget(settings.keys.stats(MODEL), "errors") == b"2"


def test_sub_batch_within_max_deliveries_is_run(r: redis.Redis, settings: Settings) -> None:
    counting = Counting()
    probe = make_worker(r, settings, Counting())
    push(r, probe, [request(0)])
    r.xreadgroup(WORKER_GROUP, "i0", {probe.queue: ">"}, count=1)
    r.xreadgroup(WORKER_GROUP, "i0", {probe.queue: "0"}, count=1)
    w = make_worker(r, settings, counting, max_deliveries=3)
    step(w)  # third delivery: still allowed
    assert counting.calls == 1
    assert text(replies(r)[0], "status") == protocol.OK


# --- the loop ----------------------------------------------------------------
def test_run_loop_registers_serves_and_stops(r: redis.Redis, settings: Settings) -> None:
    w = make_worker(r, settings, threads=2, batch=4, cpus=[0, 1])
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        push(r, w, [request(0), request(1)])
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and r.xlen(REPLY) < 2:
            time.sleep(0.005)
        assert r.xlen(REPLY) == 2
        info = r.hgetall(settings.keys.instance(MODEL, "i0"))
        assert info[b"state"] == b"ready" and info[b"threads"] == b"2" and info[b"cpus"] == b"0,1"
        assert float(info[b"heartbeat"]) > 0
        assert r.smembers(settings.keys.instances(MODEL)) == {b"i0"}
    finally:
        w.stop()
        t.join(5)
    assert not t.is_alive()
    assert r.hget(settings.keys.instance(MODEL, "i0"), "state") == b"stopped"


def test_build_context_carries_the_spec(settings: Settings) -> None:
    spec = WorkerSpec(url="redis://x", settings=settings, model="m", handler="echo", instance_id="i7",
                      threads=4, batch=8, cpus=[2, 3, 4, 5], options={"k": 1})
    ctx = spec.context()
    assert isinstance(ctx, Context)
    assert (ctx.model_name, ctx.instance_id, ctx.threads, ctx.batch_size) == ("m", "i7", 4, 8)
    assert ctx.cores == (2, 3, 4, 5) and ctx.options == {"k": 1}
    spec.options["k"] = 2
    assert ctx.options == {"k": 1}  # a copy


@pytest.mark.parametrize("max_deliveries", [1])
def test_first_delivery_always_runs(r: redis.Redis, settings: Settings, max_deliveries: int) -> None:
    counting = Counting()
    w = make_worker(r, settings, counting, max_deliveries=max_deliveries)
    push(r, w, [request(0)])
    step(w)
    assert counting.calls == 1


def test_payloads_of_a_run_cut_by_other_entries_are_all_fetched(r: redis.Redis, settings: Settings) -> None:
    """One XRANGE over the run normally; by id for whatever it did not return."""
    w = make_worker(r, settings)
    reqs = [request(0), request(1), request(2)]
    push(r, w, reqs)
    # Move the middle request past others (as if another instance's requests sat between).
    stream = w.requests_stream
    for i in range(5):
        r.xadd(stream, {"id": f"other-{i}", "payload": b"{}"})
    middle = r.xadd(stream, protocol.request_fields("req-1", REPLY, b'{"i": 1}', protocol.JSON)).decode()
    r.xdel(stream, reqs[1].stream_id)
    reqs[1].stream_id = middle
    r.delete(w.queue)
    ensure_group(r, w.queue, WORKER_GROUP)
    r.xadd(w.queue, protocol.encode_subbatch([reqs[0], reqs[2], reqs[1]], "b2"))
    assert step(w) == 1
    got = {text(f, "id"): f for f in replies(r)}
    assert all(text(f, "status") == protocol.OK for f in got.values()), got
    assert [protocol.decode_payload(protocol.JSON, got[f"req-{i}"][b"payload"]) for i in range(3)] == [
        {"i": 0}, {"i": 1}, {"i": 2}]


# --- what the record says it served ------------------------------------------
def test_served_fields_take_the_size_most_recent_sub_batches_had() -> None:
    from workers.worker import served_fields

    assert served_fields([]) == {"served_batch": None, "served_ms": None, "served_batches": 0}
    assert served_fields([(8, 10.0), (8, 30.0), (3, 99.0), (8, 20.0)]) == {
        "served_batch": 8, "served_ms": 20.0, "served_batches": 3}
    # As many of each: the latest's size (a new share taking over the window).
    assert served_fields([(1, 5.0), (1, 7.0), (8, 40.0), (8, 44.0)])["served_batch"] == 8
    assert served_fields([(8, 40.0), (8, 44.0), (1, 5.0), (1, 7.0)])["served_batch"] == 1


def test_the_record_times_the_sub_batches_served_not_the_planned_share(r: redis.Redis, settings: Settings) -> None:
    """A reshare gives an instance a new share without telling its process: its record follows what it serves."""
    w = make_worker(r, settings, SleepHandler(), batch=1)
    for k in range(4):
        push(r, w, [request(10 * k + i) for i in range(4)], batch_id=f"b{k}")
    push(r, w, [request(99)], batch_id="one")
    for _ in range(5):
        assert step(w) == 1
    record = w.record()
    assert record.batch == 1  # the share it was started with
    # The first began after a pause (nothing before it): not timed; the rest ran back to back.
    assert (record.served_batch, record.served_batches) == (4, 3)
    assert record.served_ms is not None and record.served_ms >= 10.0  # SleepHandler's 10 ms a batch


def test_a_sub_batch_after_a_pause_is_not_timed(r: redis.Redis, settings: Settings) -> None:
    """Lone requests at idle run on a cold model: what they take says nothing of the profile's back-to-back times."""
    w = make_worker(r, settings, SleepHandler(), batch=1)
    for k in range(3):
        push(r, w, [request(k)], batch_id=f"b{k}")
        assert step(w) == 1
        time.sleep(0.02)
    assert w.record().served_batches == 0 and w.record().served_ms is None


# --- handover: the first sub-batch after a change waits for the instances leaving its cores ---
def test_the_first_sub_batch_waits_until_the_instances_leaving_its_cores_have_drained(
        r: redis.Redis, settings: Settings) -> None:
    """Run beside the instances it replaces, a new instance slows them and itself (OpenMP threads of
    each wait for the other's at every barrier): it serves once their queues are empty, and says how long
    it waited."""
    old = make_worker(r, settings, instance_id="old")
    new = make_worker(r, settings, instance_id="new", after=["old"])
    push(r, old, [request(0)], batch_id="held-by-old")
    push(r, new, [request(1)], batch_id="first-of-new")
    served_at: dict[str, float] = {}

    def serve_new() -> None:
        step(new)
        served_at["new"] = time.monotonic()

    t = threading.Thread(target=serve_new)
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and "new" not in served_at and new.handler.calls == 0  # type: ignore[attr-defined]
    drained_at = time.monotonic()
    assert step(old) == 1  # the old one answers what it held: its queue is empty
    t.join(5)
    assert not t.is_alive() and served_at["new"] >= drained_at
    assert [text(f, "id") for f in replies(r)] == ["req-0", "req-1"]
    held = new.record().held_s
    assert held is not None and held >= 0.3
    assert float(r.hget(new.instance_key, "held_s")) == held
    # Only the first sub-batch after the change waits: the next is served at once.
    push(r, old, [request(2)], batch_id="old-again")
    push(r, new, [request(3)], batch_id="second-of-new")
    began = time.monotonic()
    assert step(new) == 1 and time.monotonic() - began < 0.2


def test_a_handover_waits_no_longer_than_its_timeout(r: redis.Redis, settings: Settings) -> None:
    """A leaving instance that died holding work keeps its queue until the dispatcher takes it back: the
    new one serves beside it after ``handover_timeout_s``, and with 0 it never waits."""
    old = make_worker(r, settings, instance_id="old")
    push(r, old, [request(0)], batch_id="never-answered")
    new = make_worker(r, settings.model_copy(update={"handover_timeout_s": 0.2}), instance_id="new",
                      after=["old"])
    push(r, new, [request(1)])
    began = time.monotonic()
    assert step(new) == 1
    assert 0.2 <= time.monotonic() - began < 2.0
    assert [text(f, "id") for f in replies(r)] == ["req-1"]
    off = make_worker(r, settings.model_copy(update={"handover_timeout_s": 0.0}), instance_id="off",
                      after=["old"])
    push(r, off, [request(2)], batch_id="b-off")
    began = time.monotonic()
    assert step(off) == 1 and time.monotonic() - began < 0.2


def test_a_serve_order_carries_the_instances_to_wait_for(monkeypatch: pytest.MonkeyPatch, r: redis.Redis,
                                                         settings: Settings) -> None:
    """A spare rebound onto the cores of instances leaving waits for them as a new process would."""
    from workers import rebinding, runtime

    monkeypatch.setattr(runtime, "rebind", lambda handler, spec, warm_up=True: None)
    w = make_worker(r, settings, instance_id="spare", spare=True)
    rebinding.send(r, w.queue, rebinding.Order(role="serve", threads=1, batch=1, cpus=[0], pin=False,
                                               after=["old"]))
    assert step(w) == 1
    assert w.spec.after == ["old"] and w._after == ["old"]
    old = make_worker(r, settings, instance_id="old")
    push(r, old, [request(0)], batch_id="held-by-old")
    push(r, w, [request(1)], batch_id="first")
    t = threading.Thread(target=step, args=(w,))
    t.start()
    time.sleep(0.2)
    assert t.is_alive()
    step(old)
    t.join(5)
    assert not t.is_alive() and w._after == [] and (w.record().held_s or 0) >= 0.2
