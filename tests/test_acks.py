"""The fence-guarded acknowledgement of a sub-batch (workers.acks), against a real Redis."""
from __future__ import annotations

import redis

from packrat_mq.keys import DISPATCHER_GROUP, WORKER_GROUP, request_owner
from packrat_mq.settings import Settings
from packrat_mq.streams import ensure_group
from workers import acks


def _held(r: redis.Redis, settings: Settings, n: int) -> tuple[bytes, list[str]]:
    """``n`` requests held by instance i0 and the queue entry naming them (as the dispatcher leaves them)."""
    keys = settings.keys
    stream, queue = keys.requests("m"), keys.queue("m", "i0")
    ensure_group(r, stream, DISPATCHER_GROUP)
    ensure_group(r, queue, WORKER_GROUP)
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(stream, {"id": str(i)})
    ids = [sid.decode() for sid in pipe.execute()]
    r.xreadgroup(DISPATCHER_GROUP, "dispatcher", {stream: ">"})
    for k in range(0, n, 1000):
        r.xclaim(stream, DISPATCHER_GROUP, request_owner("i0"), 0, ids[k : k + 1000], justid=True)
    r.xadd(queue, {"batch": "b"})
    [[_, [(entry_id, _)]]] = r.xreadgroup(WORKER_GROUP, "i0", {queue: ">"})
    return entry_id, ids


def test_a_sub_batch_larger_than_luas_unpack_is_acknowledged_whole(r: redis.Redis, settings: Settings) -> None:
    """9,000 requests (past the ~8,000 values Lua's unpack takes): all acknowledged and deleted."""
    entry_id, ids = _held(r, settings, 9000)
    keys = settings.keys
    pipe = r.pipeline(transaction=True)
    acks.queue_ack(pipe, keys, "m", "i0", entry_id, ids)
    assert acks.outcome(pipe.execute()[0]) == (True, [])
    assert r.xlen(keys.requests("m")) == 0 and r.xpending(keys.requests("m"), DISPATCHER_GROUP)["pending"] == 0
    assert r.xlen(keys.queue("m", "i0")) == 0
    assert r.lrange(keys.wakeup("m"), 0, -1) == [b"i0"] and r.hget(keys.instance("m", "i0"), "batches") == b"1"


def test_a_fenced_instance_acknowledges_nothing(r: redis.Redis, settings: Settings) -> None:
    entry_id, ids = _held(r, settings, 3)
    keys = settings.keys
    r.set(keys.fence("m", "i0"), "1")
    pipe = r.pipeline(transaction=True)
    acks.queue_ack(pipe, keys, "m", "i0", entry_id, ids)
    assert acks.outcome(pipe.execute()[0]) == (False, [])
    assert r.xpending(keys.requests("m"), DISPATCHER_GROUP)["pending"] == 3
    assert r.xpending(keys.queue("m", "i0"), WORKER_GROUP)["pending"] == 1
    assert not r.exists(keys.wakeup("m")) and not r.exists(keys.instance("m", "i0"))
