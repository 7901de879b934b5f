"""Fuzzing the wire format against a real `packrat-mq up`: hostile entries mixed with valid ones.

Hypothesis builds request entries with random and non-UTF-8 bytes in every
field, missing, duplicate and extra fields, huge and nested payloads, wrong
dtypes and shapes, hostile ``reply_to`` names, unknown models, expired and
malformed deadlines, and sends them with valid requests to a real service.

Asserted for every example:
- every valid request gets exactly one correct reply;
- every entry with a usable ``reply_to`` gets exactly one reply;
- no process exits (same pids, no restarts);
- no key outside reply streams gains a TTL, and keys of other types named as
  ``reply_to`` are left exactly as they were.
"""
from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from packrat_mq.records import ttl_for
from tests.test_reliability import huge_npy_header
from tests.test_reliability_e2e import Up, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "echo"


@pytest.fixture(scope="module")
def service(redis_url: str) -> Iterator[Up]:
    prefix = f"fz-{uuid.uuid4().hex[:10]}"
    svc = Up(redis_url, prefix, MODEL, "1x2,1x2")
    svc.other = f"{prefix}-out"  # type: ignore[attr-defined]
    svc.r.hset(f"{svc.other}:hash", "k", "v")  # type: ignore[attr-defined]
    svc.r.xadd(f"{svc.other}:stream", {"k": "v"})  # type: ignore[attr-defined]
    svc.pids = {i: h[b"pid"] for i, h in svc.instances().items()}  # type: ignore[attr-defined]
    svc.pids["dispatcher"] = svc.dispatcher()[b"pid"]  # type: ignore[attr-defined]
    try:
        yield svc
    finally:
        svc.stop()
        from tests.conftest import delete_prefixed

        delete_prefixed(svc.r, prefix)


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


junk = st.binary(max_size=64)
non_utf8 = st.sampled_from([b"\xff", b"\xfe\xfd", b"a\x80b", b"\xc3("])
payloads = st.one_of(
    junk,
    non_utf8,
    st.just(b"[" * 50_000),
    st.just(b'{"a":' * 50_000),
    st.just(huge_npy_header()),
    st.just(_npy(np.arange(6, dtype=np.float32))[:-4]),
    st.just(_npy(np.zeros((2, 3), dtype=np.complex64))),
    st.just(_npy(np.array(["a", "b"]))),
    st.just(b"\x93NUMPY\x01\x00\x10\x00{'descr': '|O'}\n"),
    st.just(b"x" * 300_000),
    st.binary(min_size=1, max_size=2000),
)
content_types = st.one_of(
    st.sampled_from([b"application/json", b"application/x-npy", b"text/plain", b"application/octet-stream",
                     b"image/png", b"", b"APPLICATION/JSON; charset=utf-8"]),
    junk,
)
deadlines = st.one_of(st.just(b"1"), st.just(b"not-a-number"), st.just(b"99999999999999"), junk,
                      st.just(b"-5"), st.just(b"1e30"))
field_names = st.sampled_from([b"id", b"reply_to", b"payload", b"content_type", b"deadline_ms", b"extra",
                               b"\xff", b"p0", b"meta"])


@st.composite
def hostile_entry(draw: Any) -> dict[str, Any]:
    """One entry: its fields (as a list, so names may repeat), target stream and reply_to kind."""
    # Answerable entries are drawn more often than not, so that hostile payloads
    # reach the workers instead of being refused at the dispatcher.
    reply_kind = draw(st.sampled_from(["fresh"] * 4 + ["fresh-outside"] * 2 + [
        "config", "queue", "requests", "stats", "other-hash", "other-stream", "non-utf8", "empty", "long",
        "missing"]))
    often = st.integers(0, 9).map(lambda n: n > 1)  # 80%
    fields: list[tuple[bytes, bytes]] = []
    if draw(often):
        fields.append((b"id", draw(st.one_of(st.text(min_size=1, max_size=20).map(str.encode), non_utf8, junk,
                                             st.just(b"i" * 500)))))
    if draw(often):
        fields.append((b"payload", draw(payloads)))
    if draw(st.booleans()):
        fields.append((b"content_type", draw(content_types)))
    if draw(st.integers(0, 3).map(lambda n: n == 0)):
        fields.append((b"deadline_ms", draw(deadlines)))
    for _ in range(draw(st.integers(0, 3))):
        fields.append((draw(field_names), draw(junk)))
    return {"reply_kind": reply_kind, "fields": fields,
            "unknown_model": draw(st.booleans()) and draw(st.booleans())}


def _reply_to(svc: Up, kind: str) -> bytes | None:
    other = svc.other  # type: ignore[attr-defined]
    iid = next(iter(svc.pids))  # type: ignore[attr-defined]
    return {
        "fresh": f"{svc.prefix}:replies:{uuid.uuid4().hex}".encode(),
        "fresh-outside": f"{other}:r:{uuid.uuid4().hex}".encode(),
        "config": svc.key("config", MODEL).encode(),
        "queue": svc.key("queue", MODEL, iid).encode(),
        "requests": svc.key("requests", MODEL).encode(),
        "stats": svc.key("stats", MODEL).encode(),
        "other-hash": f"{other}:hash".encode(),
        "other-stream": f"{other}:stream".encode(),
        "non-utf8": b"\xff\xfe",
        "empty": b"",
        "long": b"r" * 2000,
        "missing": None,
    }[kind]


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(entries=st.lists(hostile_entry(), min_size=1, max_size=8), n_valid=st.integers(1, 6))
# The payloads that once killed workers, always tried (hypothesis may not draw them).
@example(entries=[{"reply_kind": "fresh", "unknown_model": False,
                   "fields": [(b"id", b"deep"), (b"payload", b"[" * 100_000)]},
                  {"reply_kind": "fresh-outside", "unknown_model": False,
                   "fields": [(b"id", b"npy"), (b"payload", huge_npy_header()),
                              (b"content_type", b"application/x-npy")]},
                  {"reply_kind": "queue", "unknown_model": False, "fields": [(b"id", b"q"), (b"payload", b"1")]},
                  {"reply_kind": "fresh", "unknown_model": True, "fields": [(b"id", b"\xff"), (b"payload", b"1")]}],
         n_valid=2)
def test_hostile_entries_never_hurt_valid_requests_or_the_service(service: Up, entries: list[dict[str, Any]],
                                                                  n_valid: int) -> None:
    svc = service
    r = svc.r
    other_stream = f"{svc.other}:stream"  # type: ignore[attr-defined]
    stream_before = r.xlen(other_stream)
    expect_one: list[bytes] = []  # fresh reply streams that must get exactly one reply
    expect_other_stream = 0
    for e in entries:
        reply_to = _reply_to(svc, e["reply_kind"])
        fields = list(e["fields"])
        if reply_to is not None:
            fields.insert(0, (b"reply_to", reply_to))
        if not fields:
            fields = [(b"extra", b"")]
        target = svc.key("requests", f"nosuch{uuid.uuid4().hex[:6]}" if e["unknown_model"] else MODEL)
        flat = [part for pair in fields for part in pair]
        r.execute_command("XADD", target, "*", *flat)
        # The last reply_to field wins (Redis keeps both; readers see the last).
        last = [v for k, v in fields if k == b"reply_to"]
        if last and last[-1] == reply_to and e["reply_kind"] in ("fresh", "fresh-outside"):
            expect_one.append(reply_to)
        elif last and last[-1] == reply_to and e["reply_kind"] == "other-stream":
            expect_other_stream += 1
    valid: dict[str, tuple[bytes, Any]] = {}
    for i in range(n_valid):
        reply_to = f"{svc.prefix}:replies:{uuid.uuid4().hex}"
        rid = svc.send(reply_to, json.dumps({"v": i}).encode())
        valid[rid] = (reply_to.encode(), {"v": i})

    def settled() -> bool:
        return (all(r.xlen(k) >= 1 for k in expect_one) and all(r.xlen(k) >= 1 for k, _ in valid.values())
                and r.xlen(other_stream) >= stream_before + expect_other_stream)

    wait_for(settled, 30, "every answerable entry answered")
    wait_for(lambda: r.xlen(svc.key("requests", MODEL)) == 0, 10, "the request stream drained")
    import time

    time.sleep(0.3)  # a late duplicate would show now
    for key in expect_one:
        assert r.xlen(key) == 1, f"{key!r}: {r.xlen(key)} replies"
    for rid, (key, value) in valid.items():
        ((_, reply),) = r.xrange(key)
        assert reply[b"id"].decode() == rid and reply[b"status"] == b"ok", reply
        assert json.loads(reply[b"payload"]) == value
    assert r.xlen(other_stream) == stream_before + expect_other_stream
    # Nothing died, nothing restarted.
    now = {i: h.get(b"pid") for i, h in svc.instances().items()}
    now["dispatcher"] = svc.dispatcher().get(b"pid")
    assert now == svc.pids  # type: ignore[attr-defined]
    assert svc.proc.poll() is None
    # No key outside reply streams gained a TTL (the live records carry their own, which no
    # reply's TTL replaced); keys of other types are untouched.
    records = tuple(f"{svc.prefix}:{kind}:" for kind in ("instance", "dispatcher", "supervisor"))
    for key in r.scan_iter(match=f"{svc.prefix}*", count=1000):
        name = key.decode("utf-8", "replace")
        if name.startswith((f"{svc.prefix}:replies:", f"{svc.other}:r:")):  # type: ignore[attr-defined]
            continue
        if name.startswith(records):
            assert 0 < r.ttl(key) <= ttl_for(1.0), f"{name}: TTL {r.ttl(key)}"
            continue
        assert r.ttl(key) == -1, f"{name} gained a TTL"
    assert r.hgetall(f"{svc.other}:hash") == {b"k": b"v"}  # type: ignore[attr-defined]
    assert r.type(svc.key("config", MODEL)) == b"string"
