"""The Python client against a dispatcher and an echo worker running in threads."""
from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import redis

from dispatcher.dispatcher import Dispatcher, ensure_group
from packrat_mq import protocol
from packrat_mq.client import Client, Reply, ReplyTimeout
from packrat_mq.connection import connect
from packrat_mq.deployment import Deployment, InstanceRecord
from packrat_mq.keys import WORKER_GROUP
from packrat_mq.settings import Settings
from packrat_mq.zoo.testing import EchoHandler
from workers.worker import Worker, WorkerSpec

MODEL = "echo"


def _short_read(w: Worker, block_ms: int = 100) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return Worker.read(w, min(block_ms, 100))


@pytest.fixture
def service(r: redis.Redis, redis_url: str, settings: Settings) -> Iterator[Dispatcher]:
    """A dispatcher and two echo instances (batch 2 each), each in its own thread."""
    dep = Deployment(
        model=MODEL,
        handler="echo",
        instances=[InstanceRecord(id=f"i{j}", threads=1, batch=2) for j in range(2)],
    )
    r.set(settings.keys.config(MODEL), dep.model_dump_json())
    workers = []
    for inst in dep.instances:
        spec = WorkerSpec(url=redis_url, settings=settings, model=MODEL, handler="echo", instance_id=inst.id, batch=2)
        handler = EchoHandler()
        handler.initialize(spec.context())
        w = Worker(connect(redis_url), spec, handler)
        ensure_group(w.r, w.queue, WORKER_GROUP)
        # Shorter blocking reads than the default 1 s, so stopping is quick.
        w.read = functools.partial(_short_read, w)  # type: ignore[method-assign]
        workers.append(w)
    d = Dispatcher(connect(redis_url), settings, MODEL)
    threads = [threading.Thread(target=x.run, daemon=True) for x in (d, *workers)]
    for t in threads:
        t.start()
    try:
        yield d
    finally:
        d.stop()
        for w in workers:
            w.stop()
        for t in threads:
            t.join(5)
        assert not any(t.is_alive() for t in threads)
        for x in (d, *workers):
            x.r.close()


def test_submit(r: redis.Redis, settings: Settings, service: Dispatcher) -> None:
    c = Client(r, prefix=settings.prefix)
    reply = c.submit(MODEL, {"hello": [1, 2]}, timeout=10)
    assert isinstance(reply, Reply)
    assert reply.ok and reply.error == ""
    assert reply.value() == {"hello": [1, 2]}
    assert reply.latency_ms is not None and reply.latency_ms > 0
    # The service's timings are parts of what the client waited (one host, one
    # clock; the enqueue time is Redis' whole milliseconds, hence the 1 ms).
    assert reply.inference_ms > 0
    assert reply.queue_ms + reply.inference_ms <= reply.latency_ms + 1.0, reply.fields
    assert reply.fields["model"] == MODEL and reply.fields["instance"] in {"i0", "i1"}
    assert r.xlen(c.reply_to) == 0, "replies read are deleted"


def test_submit_many_in_order(r: redis.Redis, settings: Settings, service: Dispatcher) -> None:
    c = Client(r, prefix=settings.prefix)
    items = [{"i": i} for i in range(7)] + ["text ✓", b"\x00raw", np.arange(3, dtype=np.int16)]
    got = c.submit_many(MODEL, items, timeout=10)
    assert len(got) == len(items)
    values = [rep.value() for rep in got]
    assert values[:8] == items[:8]
    assert values[8] == b"\x00raw"
    np.testing.assert_array_equal(values[9], items[9])
    assert values[9].dtype == np.int16
    assert all(rep.ok and rep.latency_ms is not None and rep.latency_ms > 0 for rep in got)
    assert len({rep.id for rep in got}) == len(items)
    assert r.xlen(c.reply_to) == 0
    assert c._buffer == {} and c._sent_at == {}


def test_two_clients_get_their_own_replies(r: redis.Redis, settings: Settings, service: Dispatcher) -> None:
    a, b = Client(r, prefix=settings.prefix), Client(r, prefix=settings.prefix)
    ids_a = a.send_many(MODEL, ["a1", "a2", "a3"])
    ids_b = b.send_many(MODEL, ["b1", "b2"])
    assert [rep.value() for rep in b.gather(ids_b, timeout=10)] == ["b1", "b2"]
    assert [rep.value() for rep in a.gather(ids_a, timeout=10)] == ["a1", "a2", "a3"]


def test_unknown_model_gets_error_reply(r: redis.Redis, settings: Settings, service: Dispatcher) -> None:
    c = Client(r, prefix=settings.prefix)
    reply = c.submit("no-such-model", {"x": 1}, timeout=10)
    assert not reply.ok
    assert "unknown model 'no-such-model'" in reply.error and MODEL in reply.error
    with pytest.raises(RuntimeError, match="unknown model"):
        reply.value()


def test_reply_timeout_when_nobody_answers(r: redis.Redis, settings: Settings) -> None:
    c = Client(r, prefix=settings.prefix)
    t0 = time.monotonic()
    with pytest.raises(ReplyTimeout, match="1 of 1 replies not received within 0.3 s"):
        c.submit("nobody", {"x": 1}, timeout=0.3)
    assert time.monotonic() - t0 >= 0.3, "gave up before its timeout"
    assert r.xlen(c.keys.requests("nobody")) == 1  # still queued: may be served later


def test_send_many_reaches_a_blocked_reader_at_once(r: redis.Redis, redis_url: str, settings: Settings) -> None:
    """One MULTI/EXEC: a dispatcher blocked on the stream wakes to all of them, not to the first alone."""
    c = Client(r, prefix=settings.prefix)
    stream = c.keys.requests("together")
    reader = connect(redis_url)
    got: list[int] = []
    ready = threading.Event()

    def read() -> None:
        ready.set()
        resp = reader.xread({stream: "$"}, count=100, block=5000)
        got.append(len(resp[0][1]) if resp else 0)

    t = threading.Thread(target=read)
    t.start()
    ready.wait()
    deadline = time.monotonic() + 5.0
    while not any(row.get("cmd") == "xread" for row in r.client_list()) and time.monotonic() < deadline:
        time.sleep(0.005)  # until the reader is blocked
    c.send_many("together", list(range(8)))
    t.join(timeout=10.0)
    assert got == [8]


def test_reply_timeout_counts_missing(r: redis.Redis, settings: Settings) -> None:
    c = Client(r, prefix=settings.prefix)
    ids = c.send_many("nobody", [1, 2, 3])
    r.xadd(c.reply_to, protocol.reply_fields(ids[1], payload=b"2"))
    with pytest.raises(ReplyTimeout, match="2 of 3"):
        c.gather(ids, timeout=0.2)
    # The reply that did come is kept for a later gather.
    assert c.gather([ids[1]], timeout=0.1)[0].value() == 2


def test_interleaved_replies_are_buffered(r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    c = Client(r, prefix=settings.prefix, client_id="me")
    assert c.reply_to == f"{settings.prefix}:replies:me"
    a = c.send("m", {"n": 1})
    b = c.send("m", {"n": 2})
    # The service answers b first, plus a reply for an id nobody here asked about.
    r.xadd(c.reply_to, protocol.reply_fields(b, payload=b'{"n": 2}'))
    r.xadd(c.reply_to, protocol.reply_fields("stranger", payload=b"0"))
    r.xadd(c.reply_to, protocol.error_reply(a, "boom"))

    [ra] = c.gather([a], timeout=2)
    assert ra.id == a and not ra.ok and ra.error == "boom"
    assert ra.latency_ms is not None and ra.latency_ms >= 0
    assert r.xlen(c.reply_to) == 0  # all three read and deleted
    assert set(c._buffer) == {b, "stranger"}

    reads: list[object] = []
    real_xread = c.r.xread
    monkeypatch.setattr(c.r, "xread", lambda *a, **kw: reads.append(kw) or real_xread(*a, **kw))
    [rb] = c.gather([b], timeout=2)
    assert reads == [], "a buffered reply must not wait for the stream"
    assert rb.value() == {"n": 2} and rb.latency_ms is not None
    assert c.gather(["stranger"], timeout=0.1)[0].latency_ms is None  # not sent by this client


def test_gather_returns_in_requested_order(r: redis.Redis, settings: Settings) -> None:
    c = Client(r, prefix=settings.prefix)
    ids = c.send_many("m", [0, 1, 2, 3])
    for rid in reversed(ids):
        r.xadd(c.reply_to, protocol.reply_fields(rid, payload=protocol.encode_payload(ids.index(rid))[0]))
    assert [rep.value() for rep in c.gather(ids, timeout=2)] == [0, 1, 2, 3]


def test_request_fields_on_the_wire(r: redis.Redis, redis_url: str, prefix: str) -> None:
    c = Client(redis_url, prefix=prefix, client_id="x")
    before_ms = time.time() * 1000
    rid = c.send("m", "hi", deadline_s=30)
    after_ms = time.time() * 1000
    [(_, f)] = r.xrange(f"{prefix}:requests:m")
    assert f[b"id"] == rid.encode() and f[b"reply_to"] == f"{prefix}:replies:x".encode()
    assert f[b"payload"] == b"hi" and f[b"content_type"] == protocol.TEXT.encode()
    deadline = int(f[b"deadline_ms"])
    assert before_ms + 30_000 - 1 <= deadline <= after_ms + 30_000  # 30 s after sending, in whole ms
    req = protocol.parse_request(_, f, max_payload_bytes=100)
    assert req.id == rid and req.deadline_ms == deadline
    c.close()  # made from a URL: closes its own connection

    c.send("m", b'{"a": 1}', content_type=protocol.JSON)
    f2 = r.xrange(f"{prefix}:requests:m")[-1][1]
    assert f2[b"payload"] == b'{"a": 1}' and f2[b"content_type"] == protocol.JSON.encode()
    assert b"deadline_ms" not in f2


def test_close_deletes_reply_stream(r: redis.Redis, settings: Settings) -> None:
    c = Client(r, prefix=settings.prefix)
    r.xadd(c.reply_to, {"id": "x"})
    c.close()
    assert not r.exists(c.reply_to)


def test_expired_deadline_answered_by_dispatcher(r: redis.Redis, settings: Settings, service: Dispatcher) -> None:
    c = Client(r, prefix=settings.prefix)
    rid = c.send(MODEL, {"x": 1}, deadline_s=0.001)
    time.sleep(0.01)
    [reply] = c.gather([rid], timeout=10)
    assert not reply.ok and "deadline exceeded" in reply.error


# --- payloads in shared memory ------------------------------------------------------
def test_large_payloads_go_to_shared_memory_and_small_ones_to_redis(r: redis.Redis, prefix: str) -> None:
    c = Client(r, prefix=prefix, shared_memory=True, shm_min_bytes=1000)
    big = np.arange(1000, dtype=np.float32)
    rid = c.send("m", big)
    c.send("m", {"small": 1})
    [(sid, f), (_, small)] = r.xrange(f"{prefix}:requests:m")
    assert b"payload" not in f and f[b"payload_shm_keep"] == b"1" and f[b"content_type"] == protocol.NPY.encode()
    req = protocol.parse_request(sid, f, max_payload_bytes=100)
    assert req.payload_shm and req.payload_shm_keep
    assert c.payload_files is not None
    stored = c.payload_files.read(req.payload_shm, 1 << 20)
    np.testing.assert_array_equal(protocol.decode_payload(protocol.NPY, stored), big)
    assert small[b"payload"] == b'{"small":1}' and b"payload_shm" not in small
    assert c._file_of == {rid: req.payload_shm}
    c.close()  # its files go with it, in flight or not
    assert os.listdir(c.payload_files.directory) == []


def test_shared_memory_round_trip_reuses_the_clients_files(r: redis.Redis, settings: Settings,
                                                           service: Dispatcher) -> None:
    c = Client(r, prefix=settings.prefix, shared_memory=True, shm_min_bytes=1000)
    assert c.payload_files is not None and c.payload_files.directory == settings.shm_dir  # PACKRAT_SHM_DIR
    items = [np.full(2000, i, dtype=np.float32) for i in range(3)]
    for _ in range(2):
        got = c.submit_many(MODEL, items, timeout=10)
        for rep, arr in zip(got, items):
            assert rep.ok, rep.error
            np.testing.assert_array_equal(rep.value(), arr)
        # Answered: the three files wait to be written again, none deleted, none made anew.
        assert sorted(os.listdir(settings.shm_dir)) == sorted(c._free_files) and len(c._free_files) == 3
        assert c._file_of == {}
    c.close()
    assert os.listdir(settings.shm_dir) == []


def test_arrays_go_straight_into_the_clients_mapped_payload_files(r: redis.Redis, prefix: str) -> None:
    c = Client(r, prefix=prefix, shared_memory=True, shm_min_bytes=1000)
    arr = np.asfortranarray(np.arange(600, dtype=np.float64).reshape(20, 30))
    rid = c.send("m", arr)
    [(sid, f)] = r.xrange(f"{prefix}:requests:m")
    req = protocol.parse_request(sid, f, max_payload_bytes=1 << 20)
    assert req.content_type == protocol.NPY and req.payload_shm == c._file_of[rid]
    assert c.payload_files is not None
    np.testing.assert_array_equal(protocol.decode_payload(protocol.NPY, c.payload_files.read(req.payload_shm, 1 << 20)),
                                  arr)
    assert set(c._mapped) == {req.payload_shm}
    # Answered, the file is written again in place with the next array.
    c._release_file(rid)
    c.send("m", arr + 1)
    np.testing.assert_array_equal(
        protocol.decode_payload(protocol.NPY, c.payload_files.read(req.payload_shm, 1 << 20)), arr + 1)
    assert len(os.listdir(c.payload_files.directory)) == 1
    c.close()
    assert c._mapped == {} and os.listdir(c.payload_files.directory) == []


def test_sealed_payloads_round_trip_and_each_memfd_is_reused_for_its_size(r: redis.Redis, settings: Settings,
                                                                          service: Dispatcher) -> None:
    c = Client(r, prefix=settings.prefix, shared_memory="sealed", shm_min_bytes=1000)
    assert c.payload_files is None  # no files: memfds
    items = [np.full(2000, i, dtype=np.float32) for i in range(3)] + [np.zeros(3000, dtype=np.int16)]
    made = None
    for _ in range(2):
        got = c.submit_many(MODEL, items, timeout=10)
        for rep, arr in zip(got, items):
            assert rep.ok, rep.error
            np.testing.assert_array_equal(rep.value(), arr)
        assert c._file_of == {} and len(c._free_files) == 4
        made = made or set(c._mapped)
        assert set(c._mapped) == made, "answered: the same memfds hold the next round"
    c.close()
    assert c._mapped == {}


def test_a_sealed_client_names_its_memfd_in_payload_fd(r: redis.Redis, prefix: str) -> None:
    c = Client(r, prefix=prefix, shared_memory="sealed", shm_min_bytes=1000)
    rid = c.send("m", np.arange(1000, dtype=np.float32))
    [(sid, f)] = r.xrange(f"{prefix}:requests:m")
    assert b"payload" not in f and b"payload_shm" not in f and f[b"payload_fd"].decode() == c._file_of[rid]
    req = protocol.parse_request(sid, f, max_payload_bytes=1 << 20)
    assert req.payload_fd == c._file_of[rid]
    c.close()
    with pytest.raises(ValueError, match="shared_memory is"):
        Client(r, prefix=prefix, shared_memory="memfd")


@pytest.mark.parametrize("shared", [True, "sealed"], ids=["files", "sealed"])
def test_an_array_lent_by_empty_is_sent_as_it_is_without_a_copy(r: redis.Redis, settings: Settings,
                                                                service: Dispatcher, shared: bool | str) -> None:
    c = Client(r, prefix=settings.prefix, shared_memory=shared)
    img = c.empty((3, 40, 40), np.float32)
    img[...] = 7.0  # filled where it is sent from
    rid = c.send(MODEL, img)
    name = c._file_of[rid]
    assert c._lent == {} and set(c._mapped) == {name}, "sent from its own file: none other made"
    [rep] = c.gather([rid], timeout=10)
    assert rep.ok, rep.error
    np.testing.assert_array_equal(rep.value(), np.full((3, 40, 40), 7.0, dtype=np.float32))
    # Answered: its file is free again, and the next lent array is the same memory.
    again = c.empty((3, 40, 40), np.float32)
    assert c._lent[again.__array_interface__["data"][0]][0] == name
    # A view of another shape is not what the file's header says: copied, like any array.
    again[...] = 1.0
    rid = c.send(MODEL, again.reshape(-1))
    assert c._file_of.get(rid) != name
    [rep] = c.gather([rid], timeout=10)
    np.testing.assert_array_equal(rep.value(), np.ones(3 * 40 * 40, dtype=np.float32))
    c.close()
    with pytest.raises(RuntimeError, match="needs a client made with shared_memory"):
        Client(r, prefix=settings.prefix).empty(3)


def test_refused_sends_free_their_payload_files(r: redis.Redis, prefix: str) -> None:
    c = Client(r, prefix=prefix, shared_memory=True, shm_min_bytes=10, shm_pool=1)
    r.set(f"{prefix}:requests:m", "not a stream")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        c.send("m", b"x" * 100, content_type=protocol.BYTES)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        c.send_many("m", [b"y" * 100, b"z" * 100], content_type=protocol.BYTES)
    assert c._file_of == {}
    assert c.payload_files is not None
    assert len(c._free_files) == 1 and os.listdir(c.payload_files.directory) == c._free_files  # pool of one
    c.close()
