"""Reading the request stream without payloads (dispatcher.reading) against a real Redis."""
from __future__ import annotations

import redis

from dispatcher.reading import LARGE_PAYLOAD_BYTES, RequestReader, read_fields
from packrat_mq.protocol import PAYLOAD_BYTES, payload_size
from packrat_mq.streams import ensure_group

SIZE = PAYLOAD_BYTES.encode()


def test_entries_come_without_payloads_but_with_their_sizes(r: redis.Redis, prefix: str) -> None:
    stream = f"{prefix}:s"
    ensure_group(r, stream, "g")
    big = bytes(range(256)) * 2400  # 614,400 bytes
    first = r.xadd(stream, {"id": "a", "reply_to": "x", "payload": big, "content_type": "application/octet-stream"})
    second = r.xadd(stream, {"id": "b", "payload": b""})
    entries = read_fields(r, stream, "g", "c", 10)
    assert [sid for sid, _ in entries] == [first, second]
    a, b = (fields for _, fields in entries)
    assert a == {b"id": b"a", b"reply_to": b"x", SIZE: str(len(big)).encode(),
                 b"content_type": b"application/octet-stream"}
    assert b == {b"id": b"b", SIZE: b"0"}
    # They were read by the group like XREADGROUP would: pending for the consumer, nothing new left.
    assert r.xpending(stream, "g")["pending"] == 2
    assert read_fields(r, stream, "g", "c", 10) == []


def test_count_pending_reread_and_deleted_entries(r: redis.Redis, prefix: str) -> None:
    stream = f"{prefix}:s"
    ensure_group(r, stream, "g")
    ids = [r.xadd(stream, {"id": str(i), "payload": b"x" * i}) for i in range(4)]
    assert [sid for sid, _ in read_fields(r, stream, "g", "c", 3)] == ids[:3]
    r.xdel(stream, ids[1])
    # Re-reading the consumer's own pending entries (after a crash), from the start and after an id.
    again = read_fields(r, stream, "g", "c", 10, "0")
    assert again == [(ids[0], {b"id": b"0", SIZE: b"0"}), (ids[1], None), (ids[2], {b"id": b"2", SIZE: b"2"})]
    assert [sid for sid, _ in read_fields(r, stream, "g", "c", 10, ids[1])] == [ids[2]]
    assert read_fields(r, stream, "g", "other", 10, "0") == [], "another consumer's pending entries are not read"


def test_a_producer_cannot_forge_the_size_field(r: redis.Redis, prefix: str) -> None:
    stream = f"{prefix}:s"
    ensure_group(r, stream, "g")
    r.xadd(stream, {"id": "forged", PAYLOAD_BYTES: "1"})  # no payload at all
    [(_, fields)] = read_fields(r, stream, "g", "c", 1)
    assert fields == {b"id": b"forged", SIZE + b":from-producer": b"1"}, (
        "no payload field: the dispatcher rejects it as missing")


def test_the_reader_leaves_payloads_in_redis_only_while_they_are_large(r: redis.Redis, prefix: str) -> None:
    stream = f"{prefix}:s"
    ensure_group(r, stream, "g")
    reader = RequestReader(r, stream, "g", "c")
    r.xadd(stream, {"id": "small", "payload": b"{}"})
    [(_, fields)] = reader.read(10)
    assert fields[b"payload"] == b"{}", "small payloads: plain XREADGROUP is cheaper than the script"
    big = b"x" * (4 * LARGE_PAYLOAD_BYTES)
    for i in range(3):
        r.xadd(stream, {"id": f"big{i}", "payload": big})
    [(_, first)] = reader.read(1)
    assert first[b"payload"] == big  # what it had seen so far was small
    assert reader.without_payloads
    rest = reader.read(10)
    assert [f for _, f in rest] == [{b"id": f"big{i}".encode(), SIZE: str(len(big)).encode()} for i in (1, 2)]
    assert payload_size(first) == payload_size(rest[0][1]) == len(big)
    forged = r.xadd(stream, {"id": "forged", PAYLOAD_BYTES: "1"})
    assert reader.wait(100) == [(forged, {b"id": b"forged"})], "a blocking read drops a forged size field"


def test_a_blocking_read_takes_a_burst_at_once_while_payloads_are_small(r: redis.Redis, prefix: str) -> None:
    """One round trip for B requests that arrived together; one entry at a time once payloads are large."""
    stream = f"{prefix}:burst"
    r.xgroup_create(stream, "g", id="0", mkstream=True)
    reader = RequestReader(r, stream, "g", "c")
    for i in range(5):
        r.xadd(stream, {"id": f"s{i}", "payload": b"{}"})
    got = reader.wait(100, count=4)
    assert [f[b"id"] for _, f in got] == [b"s0", b"s1", b"s2", b"s3"]
    assert [f[b"payload"] for _, f in got] == [b"{}"] * 4
    big = b"x" * (4 * LARGE_PAYLOAD_BYTES)
    reader.read(1)
    for i in range(3):
        r.xadd(stream, {"id": f"big{i}", "payload": big})
    reader.read(1)  # a large one seen: the reader leaves payloads in Redis from now on
    assert reader.without_payloads
    assert [f[b"id"] for _, f in reader.wait(100, count=8)] == [b"big1"]
