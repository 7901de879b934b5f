"""Deadline reads (dispatcher.waiting) against a real Redis: they end at their deadline, and lose nothing."""
from __future__ import annotations

import threading
import time

import fakeredis
import pytest
import redis

from dispatcher.waiting import DeadlineRead


GROUP = "g"


@pytest.fixture
def stream(prefix: str) -> str:
    return f"{prefix}:waiting"  # under the test's prefix: deleted after it


def _stream(r: redis.Redis, stream: str) -> None:
    r.delete(stream)
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)


def test_a_read_ends_at_its_deadline_not_at_the_servers_tick(r: redis.Redis, stream: str) -> None:
    _stream(r, stream)
    w = DeadlineRead(r)
    assert w.probe()
    for block_ms in (5, 30):
        t0 = time.monotonic()
        assert w.read(GROUP, "c", stream, 1, block_ms) is None
        elapsed = (time.monotonic() - t0) * 1000
        # The server alone ends it on its next cron tick (hz 10: 90-101 ms for BLOCK 5).
        assert block_ms <= elapsed + 1 and elapsed < block_ms + 60, elapsed
    w.close()


def test_an_entry_that_arrives_during_the_wait_is_returned_at_once(r: redis.Redis, stream: str) -> None:
    _stream(r, stream)
    w = DeadlineRead(r)
    w.probe()
    threading.Timer(0.02, lambda: r.xadd(stream, {"x": "1"})).start()
    t0 = time.monotonic()
    resp = w.read(GROUP, "c", stream, 1, 2000)
    assert (time.monotonic() - t0) < 1.0
    assert resp is not None and resp[0][1][0][1] == {b"x": b"1"}  # parsed as xreadgroup parses it
    # Read, and pending for its consumer: nothing lost, nothing read twice.
    assert r.xpending(stream, GROUP)["pending"] == 1
    assert w.read(GROUP, "c", stream, 1, 5) is None
    w.close()


def test_a_stale_client_id_still_ends_by_the_servers_timeout_and_is_read_again(r: redis.Redis, stream: str) -> None:
    _stream(r, stream)
    w = DeadlineRead(r)
    w.probe()
    real = w._client_id
    w._client_id = 10**9  # as after a reconnect under a new id
    assert w.read(GROUP, "c", stream, 1, 5) is None  # UNBLOCK found nobody; BLOCK 5 ended it on a tick
    assert w._client_id is None
    r.xadd(stream, {"x": "2"})
    assert w.read(GROUP, "c", stream, 1, 50) is not None
    assert w._client_id is not None and w._client_id != 10**9
    assert real is not None
    w.close()


def test_without_the_commands_reads_block_on_the_main_connection() -> None:
    fake = fakeredis.FakeRedis()
    stream = "waiting"
    _stream(fake, stream)
    w = DeadlineRead(fake)
    w.precise = False
    fake.xadd(stream, {"x": "3"})
    assert w.read(GROUP, "c", stream, 1, 5)[0][1][0][1] == {b"x": b"3"}
