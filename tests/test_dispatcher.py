"""The dispatcher loop against a real Redis, run in-process one batch at a time."""
from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from dispatcher.waiting import DeadlineRead
from dispatcher.dispatcher import Dispatcher, ensure_group
from dispatcher.orphans import sweep
from packrat_mq import protocol
from packrat_mq.deployment import Deployment, InstanceRecord
from packrat_mq.keys import DISPATCHER_GROUP, WORKER_GROUP, request_owner
from packrat_mq.settings import Settings
from packrat_mq.streams import read_backlog

MODEL = "m"


def reply_key(settings: Settings, client: str = "c1") -> str:
    """The reply stream requests sent by :func:`send` name (under this test's prefix)."""
    return settings.keys.replies(client)


def deploy(
    r: redis.Redis, settings: Settings, shares: list[tuple[int, int]], *, model: str = MODEL, generation: int = 1
) -> Deployment:
    dep = Deployment(
        model=model,
        handler="echo",
        generation=generation,
        instances=[InstanceRecord(id=f"g{generation}i{j}", threads=t, batch=b) for j, (t, b) in enumerate(shares)],
    )
    r.set(settings.keys.config(model), dep.model_dump_json())
    for inst in dep.instances:
        ensure_group(r, settings.keys.queue(model, inst.id), WORKER_GROUP)
    return dep


def make_dispatcher(r: redis.Redis, settings: Settings, model: str = MODEL, **kw: Any) -> Dispatcher:
    d = Dispatcher(r, settings, model, **kw)
    d.setup()
    d.refresh_deployment(r.get(settings.keys.config(model)))
    assert d.deployment is not None
    return d


def send(r: redis.Redis, settings: Settings, n: int, *, model: str = MODEL, start: int = 0, **overrides: Any) -> list[str]:
    ids = []
    for i in range(start, start + n):
        f = protocol.request_fields(f"req-{i}", reply_key(settings), f'{{"i": {i}}}'.encode(), protocol.JSON)
        f.update(overrides)
        f = {k: v for k, v in f.items() if v is not None}
        r.xadd(settings.keys.requests(model), f)
        ids.append(f"req-{i}")
    return ids


def queued(r: redis.Redis, settings: Settings, dep: Deployment) -> dict[str, list[list[protocol.Request]]]:
    """Sub-batches in each instance queue, decoded."""
    return {
        inst.id: [protocol.decode_subbatch(f) for _, f in r.xrange(settings.keys.queue(dep.model, inst.id))]
        for inst in dep.instances
    }


def replies(r: redis.Redis, stream: str) -> list[dict[str, str]]:
    return [
        {k.decode(): v.decode() for k, v in f.items() if k != b"payload"} for _, f in r.xrange(stream)
    ]


def pending(r: redis.Redis, settings: Settings, model: str = MODEL) -> int:
    """Requests the dispatcher has read and not handed out (its own pending entries)."""
    return len(r.xpending_range(settings.keys.requests(model), DISPATCHER_GROUP, "-", "+", 10_000,
                                consumername="dispatcher"))


def held_by(r: redis.Redis, settings: Settings, instance_id: str, model: str = MODEL) -> list[str]:
    """Stream ids of the requests handed to one instance (pending under its consumer)."""
    entries = r.xpending_range(settings.keys.requests(model), DISPATCHER_GROUP, "-", "+", 10_000,
                               consumername=request_owner(instance_id))
    return [e["message_id"].decode() for e in entries]


def backlog(r: redis.Redis, settings: Settings, model: str = MODEL) -> int:
    """Requests no dispatcher has read yet."""
    return read_backlog(r, settings.keys.requests(model), DISPATCHER_GROUP)[0]


def spy(monkeypatch: pytest.MonkeyPatch, obj: Any, name: str) -> list[tuple[dict[str, Any], Any]]:
    """Record (keyword arguments, result) of every call to ``obj.name``; the calls still run."""
    calls: list[tuple[dict[str, Any], Any]] = []
    real = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        calls.append((kwargs, result))
        return result

    monkeypatch.setattr(obj, name, wrapper)
    return calls


# --- fan-out ----------------------------------------------------------------
def test_full_batch_split_per_deployment(r: redis.Redis, settings: Settings) -> None:
    dep = deploy(r, settings, [(4, 4), (2, 2), (2, 2)])
    d = make_dispatcher(r, settings)
    ids = send(r, settings, 8)
    assert d.run_once() == 8

    q = queued(r, settings, dep)
    assert [len(q[i.id]) for i in dep.instances] == [1, 1, 1]  # one sub-batch each
    sizes = [len(q[i.id][0]) for i in dep.instances]
    assert sizes == [4, 2, 2]
    # Arrival order is kept across the instances.
    flat = [req.id for inst in dep.instances for req in q[inst.id][0]]
    assert flat == ids
    first = q[dep.instances[0].id][0][0]
    assert first.reply_to == reply_key(settings)
    assert first.content_type == protocol.JSON
    # A small payload the dispatcher read rides along with the sub-batch; the request stays in the
    # request stream all the same, handed to the instance, which acknowledges it with its reply.
    assert first.payload == b'{"i": 0}' and first.carried and not first.inline
    [(_, fields)] = r.xrange(settings.keys.requests(MODEL), first.stream_id, first.stream_id)
    assert fields[b"payload"] == b'{"i": 0}'
    for inst in dep.instances:
        assert held_by(r, settings, inst.id) == [req.stream_id for req in q[inst.id][0]]
    assert r.xlen(settings.keys.requests(MODEL)) == 8
    assert backlog(r, settings) == 0 and pending(r, settings) == 0
    stats = r.hgetall(settings.keys.stats(MODEL))
    assert stats[b"requests"] == b"8" and stats[b"batches"] == b"1"
    assert replies(r, reply_key(settings)) == []  # nothing answered by the dispatcher
    assert MODEL.encode() in r.smembers(settings.keys.models())


def test_only_small_payloads_and_payload_file_names_ride_along(r: redis.Redis, settings: Settings) -> None:
    """Up to CARRY_MAX_BYTES the payload goes in the sub-batch; larger ones stay to be fetched."""
    dep = deploy(r, settings, [(1, 3)])
    d = make_dispatcher(r, settings)
    stream = settings.keys.requests(MODEL)
    big = b"x" * (protocol.CARRY_MAX_BYTES + 1)
    r.xadd(stream, protocol.request_fields("small", reply_key(settings), b"[1]", protocol.JSON))
    r.xadd(stream, protocol.request_fields("big", reply_key(settings), big, protocol.BYTES))
    r.xadd(stream, protocol.request_fields("file", reply_key(settings), None, protocol.NPY,
                                           payload_shm="img-1.npy", keep=True))
    assert d.run_once() == 3
    [[small, large, shm]] = queued(r, settings, dep)[dep.instances[0].id]
    assert (small.payload, small.carried) == (b"[1]", True)
    assert (large.payload, large.carried) == (None, False)
    assert (shm.payload, shm.carried, shm.payload_shm, shm.payload_shm_keep) == (None, True, "img-1.npy", True)
    assert held_by(r, settings, dep.instances[0].id) == [small.stream_id, large.stream_id, shm.stream_id]


def test_fan_out_is_one_transaction(r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    dep = deploy(r, settings, [(2, 2), (2, 2)])
    d = make_dispatcher(r, settings)
    send(r, settings, 4)
    executed: list[tuple[bool, list[tuple[str, str]]]] = []
    real_pipeline = r.pipeline

    def spy(transaction: bool = True, **kw: Any) -> Any:
        pipe = real_pipeline(transaction=transaction, **kw)
        real_execute = pipe.execute

        def execute(*a: Any, **k: Any) -> Any:
            executed.append((transaction, [(str(c[0][0]), str(c[0][1])) for c in pipe.command_stack]))
            return real_execute(*a, **k)

        pipe.execute = execute  # type: ignore[method-assign]
        return pipe

    monkeypatch.setattr(r, "pipeline", spy)
    assert d.run_once() == 4
    stream = settings.keys.requests(MODEL)
    fanouts = [cmds for tx, cmds in executed if any(name == "XCLAIM" for name, _ in cmds)]
    assert len(fanouts) == 1
    [(tx, cmds)] = [(tx, c) for tx, c in executed if c is fanouts[0]]
    assert tx, "queue XADDs and the requests' XCLAIMs must be one MULTI/EXEC"
    for inst in dep.instances:
        assert ("XADD", settings.keys.queue(MODEL, inst.id)) in cmds
    assert [name for name, key in cmds if key == stream] == ["XCLAIM", "XCLAIM"]  # one per instance
    assert backlog(r, settings) == 0 and pending(r, settings) == 0
    assert sorted(sum((held_by(r, settings, i.id) for i in dep.instances), [])) == [
        sid.decode() for sid, _ in r.xrange(stream)]


def test_bad_requests_answered_rest_dispatched(r: redis.Redis, settings: Settings) -> None:
    dep = deploy(r, settings, [(2, 4), (2, 4)])
    d = make_dispatcher(r, settings)
    stream = settings.keys.requests(MODEL)
    reply, other_reply = reply_key(settings), reply_key(settings, "c2")
    good = send(r, settings, 2)
    r.xadd(stream, {"id": "bad-ct", "reply_to": reply, "payload": b"x", "content_type": "image/gif"})
    r.xadd(stream, {"reply_to": reply, "payload": b"x"})  # no id
    r.xadd(stream, {"id": "late", "reply_to": reply, "payload": b"{}", "deadline_ms": int(time.time() * 1000) - 5})
    r.xadd(stream, {"id": "huge", "reply_to": other_reply, "payload": b"x" * (settings.max_payload_bytes + 1)})
    r.xadd(stream, {"id": "anon", "payload": b"{}"})  # no reply_to: cannot be answered
    good += send(r, settings, 1, start=10)

    assert d.run_once() == 8
    q = queued(r, settings, dep)
    dispatched = [req.id for subs in q.values() for sub in subs for req in sub]
    assert sorted(dispatched) == sorted(good)

    errs = {rep["id"]: rep for rep in replies(r, reply)}
    assert set(errs) == {"bad-ct", "", "late"}
    assert all(rep["status"] == protocol.ERROR and rep["model"] == MODEL for rep in errs.values())
    assert "image/gif" in errs["bad-ct"]["error"]
    assert "missing id" in errs[""]["error"]
    assert "deadline exceeded" in errs["late"]["error"]
    [other] = replies(r, other_reply)
    assert other["id"] == "huge" and "over the limit" in other["error"]
    assert 0 < r.ttl(reply) <= settings.reply_ttl_s
    assert 0 < r.ttl(other_reply) <= settings.reply_ttl_s

    # The rejected are deleted; the dispatched stay, handed to their instances.
    assert r.xlen(stream) == len(good) and backlog(r, settings) == 0 and pending(r, settings) == 0
    assert sorted(f[b"id"].decode() for _, f in r.xrange(stream)) == sorted(good)
    stats = r.hgetall(settings.keys.stats(MODEL))
    assert stats[b"requests"] == b"8"
    assert stats[b"rejected"] == b"5"
    assert stats[b"unanswerable"] == b"1"


def test_request_without_reply_to_dropped_and_counted(r: redis.Redis, settings: Settings) -> None:
    dep = deploy(r, settings, [(1, 2)])
    d = make_dispatcher(r, settings)
    r.xadd(settings.keys.requests(MODEL), {"id": "x", "payload": b"{}"})
    assert d.run_once() == 1
    assert r.xlen(settings.keys.requests(MODEL)) == 0
    assert queued(r, settings, dep) == {dep.instances[0].id: []}
    assert r.hget(settings.keys.stats(MODEL), "unanswerable") == b"1"
    # Nothing was written anywhere a reply could go.
    assert list(r.scan_iter(f"{settings.prefix}:replies:*")) == []


def test_whole_batch_rejected_sends_no_sub_batch(r: redis.Redis, settings: Settings) -> None:
    dep = deploy(r, settings, [(1, 2), (1, 2)])
    d = make_dispatcher(r, settings)
    send(r, settings, 2, content_type="bad/type")
    assert d.run_once() == 2
    assert all(subs == [] for subs in queued(r, settings, dep).values())
    assert len(replies(r, reply_key(settings))) == 2


# --- partial batches ---------------------------------------------------------
def test_partial_batch_after_timeout(r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    dep = deploy(r, settings, [(4, 8), (2, 4), (2, 4)])
    d = make_dispatcher(r, settings)
    send(r, settings, 6)
    reads: list[tuple[int | None, int]] = []  # (block_ms, entries read) of each read of the batch
    real_read = d.aggregator.read

    def read(count: int, block_ms: int | None) -> list[Any]:
        got = real_read(count, block_ms)
        reads.append((block_ms, len(got)))
        return got

    monkeypatch.setattr(d.aggregator, "read", read)
    blocking = spy(monkeypatch, d.r, "xreadgroup")
    t0 = time.monotonic()
    assert d.run_once() == 6
    elapsed_ms = (time.monotonic() - t0) * 1000
    assert elapsed_ms >= settings.batch_timeout_ms, "a partial batch must wait for the batch timeout"
    # The window is one blocking read that ends at its deadline (dispatcher.waiting), not polling:
    # Redis alone ends a BLOCK only on its 10 Hz cron tick, which made a 2 ms window cost 100 ms.
    assert d.waiter.precise and d.aggregator.server_tick_ms == 0.0
    assert reads[0][1] == 6, "the waiting requests are read at once"
    window = [block for block, _ in reads[1:]]
    assert window and window[0] is not None and window[0] >= 1, window
    assert len(window) <= 2, "the window was not polled"
    assert elapsed_ms < settings.batch_timeout_ms + 60, "the read ended at the deadline, not at the server's tick"
    assert all(kw.get("block") is None for kw, _ in blocking), "requests already waiting are never read by a blocking read"
    q = queued(r, settings, dep)
    sizes = [sum(len(s) for s in q[i.id]) for i in dep.instances]
    assert sizes == [4, 1, 1]  # split by threads: the 4-thread instance takes more
    assert r.hget(settings.keys.stats(MODEL), "batches") == b"1"


def test_partial_batch_polled_where_reads_cannot_end_at_their_deadline(
        r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server without CLIENT UNBLOCK: the window is kept by polling, never by a blocking read."""
    monkeypatch.setattr(DeadlineRead, "probe", lambda self: False)
    deploy(r, settings, [(4, 8), (2, 4), (2, 4)])
    d = make_dispatcher(r, settings)
    assert not d.waiter.precise and d.aggregator.server_tick_ms > 0
    send(r, settings, 6)
    reads: list[int | None] = []
    real_read = d.aggregator.read
    monkeypatch.setattr(d.aggregator, "read", lambda count, block_ms: reads.append(block_ms) or real_read(count, block_ms))
    assert d.run_once() == 6
    assert len(reads) >= 3 and reads[1:] == [None] * (len(reads) - 1), reads


def test_partial_batch_split_by_latency(r: redis.Redis, settings: Settings) -> None:
    dep = deploy(r, settings, [(4, 8), (2, 4), (2, 4)])
    d = make_dispatcher(r, settings, latency=lambda t, b: float(b))  # threads do not help
    send(r, settings, 6)
    assert d.run_once() == 6
    q = queued(r, settings, dep)
    assert [sum(len(s) for s in q[i.id]) for i in dep.instances] == [2, 2, 2]


def test_idle_returns_nothing(r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    deploy(r, settings, [(1, 2)])
    d = make_dispatcher(r, settings)
    waits = []
    real = d.waiter.read
    monkeypatch.setattr(d.waiter, "read", lambda *a: waits.append(a[-1]) or real(*a))
    took = []
    for _ in range(3):
        t0 = time.monotonic()
        assert d.run_once(idle_block_ms=50) == 0
        took.append((time.monotonic() - t0) * 1000)
    # The wait for a first request is bounded by idle_block_ms (BLOCK 0 would wait forever).
    assert waits == [50, 50, 50]
    # The quickest of three: a server's tick would make every one late, a busy machine only some.
    assert min(took) < 50 + 60, f"ended at its deadline, not the server's tick: {took}"
    assert r.hget(settings.keys.stats(MODEL), "batches") is None


def test_batches_larger_than_b_are_split_over_rounds(r: redis.Redis, settings: Settings) -> None:
    dep = deploy(r, settings, [(1, 2), (1, 2)])
    d = make_dispatcher(r, settings, max_waiting=10)
    send(r, settings, 9)
    assert [d.run_once() for _ in range(3)] == [4, 4, 1]
    q = queued(r, settings, dep)
    ids = [req.id for inst in dep.instances for sub in q[inst.id] for req in sub]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(9))


# --- flow control ------------------------------------------------------------
def test_no_read_while_every_instance_queue_is_full(r: redis.Redis, settings: Settings) -> None:
    dep = deploy(r, settings, [(2, 2), (2, 2)])
    d = make_dispatcher(r, settings, max_waiting=1)
    for inst in dep.instances:
        queue = settings.keys.queue(MODEL, inst.id)
        r.xadd(queue, {"batch": "running", "meta": "[]"})
        r.xadd(queue, {"batch": "waiting", "meta": "[]"})
    send(r, settings, 4)
    assert d.run_once() == 0
    stream = settings.keys.requests(MODEL)
    assert r.xlen(stream) == 4
    assert pending(r, settings) == 0, "the backlog must stay unread in the request stream"

    # A worker finishes one sub-batch and pushes a wake-up token: room again, for that instance.
    busy = settings.keys.queue(MODEL, dep.instances[1].id)
    r.xtrim(busy, maxlen=1, approximate=False)
    r.lpush(settings.keys.wakeup(MODEL), dep.instances[1].id)
    assert d.run_once() == 2, "its own share, queued behind the batch it runs"
    assert r.xlen(busy) == 2 and backlog(r, settings) == 2


def test_a_full_instance_holds_nobody_up(r: redis.Redis, settings: Settings) -> None:
    dep = deploy(r, settings, [(2, 2), (2, 2)])
    d = make_dispatcher(r, settings, max_waiting=1)
    busy = settings.keys.queue(MODEL, dep.instances[1].id)
    r.xadd(busy, {"batch": "running", "meta": "[]"})
    r.xadd(busy, {"batch": "waiting", "meta": "[]"})
    send(r, settings, 4)
    assert d.run_once() == 2, "the free instance takes its share"
    q = queued(r, settings, dep)
    assert [req.id for sub in q[dep.instances[0].id] for req in sub] == ["req-0", "req-1"]
    assert r.xlen(busy) == 2 and backlog(r, settings) == 2


def test_an_idle_instance_is_fed_its_share_at_once(r: redis.Redis, settings: Settings) -> None:
    """The instance that finished first does not wait, with its share, for one still running."""
    dep = deploy(r, settings, [(1, 4), (1, 4)])
    # A long batch timeout: waiting for the other instance's share would show.
    d = make_dispatcher(r, settings.model_copy(update={"batch_timeout_ms": 5000.0}), max_waiting=1)
    running = settings.keys.queue(MODEL, dep.instances[1].id)
    r.xadd(running, {"batch": "running", "meta": "[]"})  # room for one more, but not idle
    send(r, settings, 4)  # the idle instance's clients, back with their next requests
    t0 = time.monotonic()
    assert d.run_once() == 4
    assert (time.monotonic() - t0) * 1000 < 1000, "no wait for requests that only the other instance's share needs"
    q = queued(r, settings, dep)
    assert len(q[dep.instances[0].id]) == 1 and len(q[dep.instances[0].id][0]) == 4
    assert r.xlen(running) == 1

    # Now none is idle: both have room, and the next batch is the whole B, split.
    send(r, settings, 8, start=4)
    assert d.run_once() == 8
    q = queued(r, settings, dep)
    assert [len(q[i.id]) for i in dep.instances] == [2, 1 + 1]


def test_blocked_dispatcher_wakes_on_token(r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    dep = deploy(r, settings, [(2, 2)])
    d = make_dispatcher(r, settings)
    busy = settings.keys.queue(MODEL, dep.instances[0].id)
    for _ in range(2):
        r.xadd(busy, {"meta": "[]"})
    r.lpush(settings.keys.wakeup(MODEL), "x")
    waits = spy(monkeypatch, d.r, "blpop")
    assert d.run_once() == 0
    # The token ended the wait (BLPOP returned it), not the 0.1 s timeout (None).
    assert [result for _, result in waits] == [(settings.keys.wakeup(MODEL).encode(), b"x")]
    assert r.llen(settings.keys.wakeup(MODEL)) == 0


# --- deployments -------------------------------------------------------------
def test_no_deployment_reads_nothing(r: redis.Redis, settings: Settings) -> None:
    d = Dispatcher(r, settings, MODEL)
    d.setup()
    send(r, settings, 2)
    assert d.run_once() == 0
    assert r.xlen(settings.keys.requests(MODEL)) == 2 and pending(r, settings) == 0


def test_new_deployment_generation_is_picked_up(r: redis.Redis, settings: Settings) -> None:
    old = deploy(r, settings, [(1, 2)])
    d = make_dispatcher(r, settings)
    send(r, settings, 2)
    assert d.run_once() == 2
    new = deploy(r, settings, [(2, 1), (2, 1), (2, 1)], generation=2)
    send(r, settings, 3, start=2)
    assert d.run_once() == 0  # first look at the new deployment: measure its queues
    assert d.deployment is not None and d.deployment.generation == 2
    assert d.run_once() == 3
    assert [len(v) for v in queued(r, settings, old).values()] == [1]
    assert [len(v) for v in queued(r, settings, new).values()] == [1, 1, 1]


def test_new_deployment_is_measured_at_once_not_after_a_wait(
    r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    deploy(r, settings, [(1, 2)])
    d = Dispatcher(r, settings, MODEL)
    d.setup()
    waits: list[Any] = []
    monkeypatch.setattr(d.r, "blpop", lambda *a, **kw: waits.append(a))
    assert d.run_once() == 0 and d.deployment is not None
    assert waits == [], "a deployment seen for the first time must not wait for a wake-up token"
    deploy(r, settings, [(1, 2), (1, 2)], generation=2)
    assert d.run_once() == 0 and d.deployment.generation == 2
    assert waits == []


def test_dispatcher_reports_ready_and_heartbeat(r: redis.Redis, settings: Settings) -> None:
    deploy(r, settings, [(1, 2)])
    d = make_dispatcher(r, settings)
    h = r.hgetall(settings.keys.dispatcher(MODEL))
    assert h[b"state"] == b"ready" and int(h[b"pid"]) > 0 and float(h[b"heartbeat"]) > 0
    from packrat_mq.cli.status import collect_status

    send(r, settings, 2)
    assert d.run_once() == 2
    (model,) = collect_status(r, settings.keys)["models"]
    assert model["dispatcher"]["state"] == "ready"
    assert model["dispatcher"]["batches"] == 1, "counted in the fan-out transaction, not only at heartbeats"
    d.stop()
    d.heartbeat("stopped")
    assert r.hget(settings.keys.dispatcher(MODEL), "state") == b"stopped"


# --- recovery ----------------------------------------------------------------
def test_entries_read_but_not_dispatched_are_recovered(r: redis.Redis, settings: Settings) -> None:
    dep = deploy(r, settings, [(2, 2), (2, 2)])
    Dispatcher(r, settings, MODEL).setup()
    stream = settings.keys.requests(MODEL)
    ids = send(r, settings, 3)
    # The previous dispatcher read these and died before its MULTI/EXEC.
    got = r.xreadgroup(DISPATCHER_GROUP, "dispatcher", {stream: ">"}, count=3)
    assert len(got[0][1]) == 3 and pending(r, settings) == 3
    later = send(r, settings, 1, start=3)

    d = make_dispatcher(r, settings)
    total = 0
    for _ in range(3):
        total += d.run_once(idle_block_ms=20)
    q = queued(r, settings, dep)
    dispatched = [req.id for inst in dep.instances for sub in q[inst.id] for req in sub]
    assert sorted(dispatched) == sorted(ids + later), "each request exactly once"
    assert len(dispatched) == len(set(dispatched))
    assert backlog(r, settings) == 0 and pending(r, settings) == 0


def test_recovery_of_more_entries_than_a_batch(r: redis.Redis, settings: Settings) -> None:
    dep = deploy(r, settings, [(1, 2)])
    Dispatcher(r, settings, MODEL).setup()
    stream = settings.keys.requests(MODEL)
    ids = send(r, settings, 5)
    r.xreadgroup(DISPATCHER_GROUP, "dispatcher", {stream: ">"}, count=5)
    d = make_dispatcher(r, settings, max_waiting=10)
    sizes = [d.run_once(idle_block_ms=20) for _ in range(4)]
    q = queued(r, settings, dep)
    dispatched = [req.id for sub in q[dep.instances[0].id] for req in sub]
    assert dispatched == ids
    assert sizes[:3] == [2, 2, 1]
    assert pending(r, settings) == 0


def test_pending_entry_deleted_meanwhile_is_acked(r: redis.Redis, settings: Settings) -> None:
    dep = deploy(r, settings, [(1, 2)])
    Dispatcher(r, settings, MODEL).setup()
    stream = settings.keys.requests(MODEL)
    send(r, settings, 2)
    [(_, entries)] = r.xreadgroup(DISPATCHER_GROUP, "dispatcher", {stream: ">"}, count=2)
    r.xdel(stream, entries[0][0])
    d = make_dispatcher(r, settings)
    for _ in range(2):
        d.run_once(idle_block_ms=20)
    q = queued(r, settings, dep)
    assert [req.id for sub in q[dep.instances[0].id] for req in sub] == ["req-1"]
    assert pending(r, settings) == 0


# --- orphans -----------------------------------------------------------------
def test_sweep_answers_unknown_model(r: redis.Redis, settings: Settings) -> None:
    deploy(r, settings, [(1, 2)])
    make_dispatcher(r, settings)  # registers MODEL as served
    send(r, settings, 2)  # for the served model: left alone
    ghost = settings.keys.requests("ghost")
    reply, c2 = reply_key(settings), reply_key(settings, "c2")
    r.xadd(ghost, {"id": "g1", "reply_to": reply, "payload": b"{}"})
    r.xadd(ghost, {"id": "g2", "reply_to": c2, "payload": b"{}"})
    r.xadd(ghost, {"id": "g3", "payload": b"{}"})  # no reply_to: dropped

    assert sweep(r, settings, grace_ms=0) == 3
    assert r.xlen(ghost) == 0
    [g1] = replies(r, reply)
    [g2] = replies(r, c2)
    for rep, rid in ((g1, "g1"), (g2, "g2")):
        assert rep["id"] == rid and rep["status"] == protocol.ERROR
        assert "unknown model 'ghost'" in rep["error"]
        assert MODEL in rep["error"]  # says what is served
    assert r.ttl(reply) > 0
    assert r.xlen(settings.keys.requests(MODEL)) == 2
    assert r.get(settings.keys.lock("orphan-sweep")) is None
    assert sweep(r, settings, grace_ms=0) == 0  # nothing left


def test_sweep_leaves_fresh_entries_and_its_own_model_alone(r: redis.Redis, settings: Settings) -> None:
    """After a FLUSHALL the models index is empty until the next heartbeat: that window answers nothing."""
    ghost, mine = settings.keys.requests("ghost"), settings.keys.requests(MODEL)
    r.xadd(ghost, {"id": "g1", "reply_to": reply_key(settings), "payload": b"{}"})
    r.xadd(mine, {"id": "m1", "reply_to": reply_key(settings), "payload": b"{}"})
    assert not r.sismember(settings.keys.models(), MODEL)
    assert sweep(r, settings, own=MODEL) == 0  # both younger than three heartbeats
    assert r.xlen(ghost) == 1 and r.xlen(mine) == 1
    assert sweep(r, settings, own=MODEL, grace_ms=0) == 1  # the ghost only: MODEL is the sweeper's own
    assert r.xlen(ghost) == 0 and r.xlen(mine) == 1
    [rep] = replies(r, reply_key(settings))
    assert rep["id"] == "g1" and "unknown model 'ghost'" in rep["error"]


def test_sweep_skipped_while_another_holds_the_lock(r: redis.Redis, settings: Settings) -> None:
    ghost = settings.keys.requests("ghost")
    r.xadd(ghost, {"id": "g1", "reply_to": reply_key(settings), "payload": b"{}"})
    r.set(settings.keys.lock("orphan-sweep"), "1", px=2000)
    assert sweep(r, settings, grace_ms=0) == 0
    assert r.xlen(ghost) == 1 and replies(r, reply_key(settings)) == []


def test_sweep_ignores_other_prefixes_and_non_streams(r: redis.Redis, settings: Settings) -> None:
    # Another deployment whose prefix starts like this one's (and is cleaned up with it).
    other = Settings(redis_url=settings.redis_url, prefix=f"{settings.prefix}-other").keys.requests("ghost")
    r.xadd(other, {"id": "x", "reply_to": reply_key(settings), "payload": b"{}"})
    r.set(settings.keys.requests("not-a-stream"), "v")
    assert sweep(r, settings, grace_ms=0) == 0
    assert r.xlen(other) == 1 and replies(r, reply_key(settings)) == []


def test_sweep_respects_prefix(r: redis.Redis, settings: Settings) -> None:
    tenant = Settings(redis_url=settings.redis_url, prefix=f"{settings.prefix}-tenant")
    r.xadd(tenant.keys.requests("ghost"), {"id": "x", "reply_to": tenant.keys.replies("c"), "payload": b"{}"})
    r.xadd(settings.keys.requests("ghost"), {"id": "y", "reply_to": reply_key(settings), "payload": b"{}"})
    assert sweep(r, tenant, grace_ms=0) == 1
    assert replies(r, tenant.keys.replies("c"))[0]["id"] == "x"
    assert r.xlen(settings.keys.requests("ghost")) == 1


# --- robustness ----------------------------------------------------------------
def test_reply_to_of_wrong_type_does_not_kill_the_dispatcher(r: redis.Redis, settings: Settings) -> None:
    dep = deploy(r, settings, [(1, 4)])
    d = make_dispatcher(r, settings)
    not_a_stream = settings.keys.replies("not-a-stream")  # a string, not a stream
    r.set(not_a_stream, "v")
    stream = settings.keys.requests(MODEL)
    r.xadd(stream, {"id": "evil", "reply_to": not_a_stream, "payload": b"x", "content_type": "bad/type"})
    good = send(r, settings, 1)
    r.xadd(stream, {"id": "bad", "reply_to": reply_key(settings), "payload": b"x", "content_type": "bad/type"})
    assert d.run_once() == 3
    assert [req.id for sub in queued(r, settings, dep)[dep.instances[0].id] for req in sub] == good
    assert [rep["id"] for rep in replies(r, reply_key(settings))] == ["bad"]
    assert r.get(not_a_stream) == b"v"
    assert backlog(r, settings) == 0 and pending(r, settings) == 0
    assert r.hget(settings.keys.stats(MODEL), "rejected") == b"2"


def test_sweep_survives_reply_to_of_wrong_type(r: redis.Redis, settings: Settings) -> None:
    not_a_stream = settings.keys.replies("not-a-stream")  # a string, not a stream
    r.set(not_a_stream, "v")
    ghost = settings.keys.requests("ghost")
    r.xadd(ghost, {"id": "g0", "reply_to": not_a_stream, "payload": b"{}"})
    r.xadd(ghost, {"id": "g1", "reply_to": reply_key(settings), "payload": b"{}"})
    assert sweep(r, settings, grace_ms=0) == 2
    assert [rep["id"] for rep in replies(r, reply_key(settings))] == ["g1"]
    assert r.xlen(ghost) == 0


def test_connection_loss_mid_batch_does_not_strand_requests(
    r: redis.Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import dispatcher.dispatcher as dispatcher_module

    dep = deploy(r, settings, [(2, 2), (2, 2)])
    d = make_dispatcher(r, settings)
    monkeypatch.setattr(dispatcher_module.time, "sleep", lambda s: None)  # the 0.5 s retry pause
    real_dispatch = d.dispatch
    calls = []

    def flaky(entries: Any, deployment: Any) -> None:
        calls.append(len(entries))
        if len(calls) == 1:
            raise redis.ConnectionError("connection reset")  # read, never fanned out
        real_dispatch(entries, deployment)

    d.dispatch = flaky  # type: ignore[method-assign]
    ids = send(r, settings, 4)
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and pending(r, settings) + r.xlen(settings.keys.requests(MODEL)) > 0:
            time.sleep(0.01)
    finally:
        d.stop()
        t.join(5)
    assert not t.is_alive()
    dispatched = [req.id for subs in queued(r, settings, dep).values() for sub in subs for req in sub]
    assert sorted(dispatched) == sorted(ids)
    assert pending(r, settings) == 0


def test_the_dispatcher_reads_what_its_supervisors_measured_of_the_profile(r: redis.Redis, settings: Settings) -> None:
    """A supervisor's served / profiled ratio reaches the estimator's capacities at the next heartbeat due."""
    deploy(r, settings, [(1, 2)])
    d = make_dispatcher(r, settings)
    node = "n1"
    d.capacity.budgets = {node: 2}  # what a supervisor's published part says (merged deployments carry it)
    assert d.capacity.ratios == {}
    r.hset(settings.keys.supervisor(MODEL, node), "profile_ratio", "1.9")
    d._last_beat = d._ratios_read_at = 0.0
    d.heartbeat()
    assert d.capacity.ratios == {node: 1.9}
    r.hset(settings.keys.supervisor(MODEL, node), "profile_ratio", "junk")
    d._last_beat = d._ratios_read_at = 0.0
    d.heartbeat()
    assert d.capacity.ratios == {}, "an unreadable ratio is no ratio"
    # By thread count: each layout is planned by its own count's measure.
    r.hset(settings.keys.supervisor(MODEL, node), "profile_ratios", "1=0.72,2=0.86,x=3")
    d._last_beat = d._ratios_read_at = 0.0
    d.heartbeat()
    assert d.capacity.thread_ratios == {node: {1: 0.72, 2: 0.86}}


def test_an_adaptive_dispatcher_reads_its_supervisors_spares_at_every_heartbeat(r: redis.Redis,
                                                                                settings: Settings) -> None:
    """What each node has loaded and keeps reaches the estimator (a move down waits for spares loading)."""
    deploy(r, settings, [(1, 2)])
    d = make_dispatcher(r, settings)
    node = "n1"
    d.capacity.budgets = {node: 2}
    d.adaptive.adaptive = True

    def beat(**fields: str) -> None:
        """The supervisor's record says ``fields``; then the dispatcher's next heartbeat, due now."""
        r.hset(settings.keys.supervisor(MODEL, node), mapping=fields)
        d._last_beat = 0.0
        d.heartbeat()

    beat(spares="1", spares_wanted="2")
    assert d.capacity.spares == {node: (1, 2)}
    beat(spares="2")
    assert d.capacity.spares == {node: (2, 2)} and node in d.capacity._spares_rose_at
    assert d.capacity.start_s == {}, "no start time measured yet"
    beat(process_start_s="0.95", start_cpus="2")
    assert d.capacity.start_s == {node: (0.95, 2)}
    beat(process_start_s="junk")
    assert d.capacity.start_s == {}, "an unreadable start time is none"
    beat(spares="junk")
    assert d.capacity.spares == {}, "an unreadable count is no count"
    d.adaptive.adaptive = False  # a pinned deployment waits for nothing: nothing is read
    beat(spares="1")
    assert d.capacity.spares == {}
