"""The wire format: request validation, payload codecs and sub-batch encoding."""
from __future__ import annotations

import dataclasses
import io
import json
import pickle

import numpy as np
import pytest

from packrat_mq import protocol
from packrat_mq.protocol import PayloadError, Request, RequestRejected, parse_request

SID = b"1700000000000-0"
NOW_MS = 1_700_000_000_500
LIMIT = 1024


def fields(**overrides: object) -> dict[bytes, bytes]:
    base: dict[str, object] = {
        "id": "req-1",
        "reply_to": "packrat:replies:c1",
        "payload": b'{"x": 1}',
        "content_type": protocol.JSON,
    }
    base.update(overrides)
    out = {}
    for k, v in base.items():
        if v is None:
            continue
        out[k.encode()] = v if isinstance(v, bytes) else str(v).encode()
    return out


def parse(f: dict[bytes, bytes], **kw: object) -> Request:
    kw.setdefault("max_payload_bytes", LIMIT)
    kw.setdefault("now_ms", NOW_MS)
    return parse_request(SID, f, **kw)  # type: ignore[arg-type]


def npy_bytes(arr: np.ndarray, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return buf.getvalue()


# --- parse_request: accepted ----------------------------------------------
def test_parse_valid_request() -> None:
    req = parse(fields(deadline_ms=NOW_MS + 1000))
    assert req.id == "req-1"
    assert req.reply_to == "packrat:replies:c1"
    assert req.payload == b'{"x": 1}'
    assert req.content_type == protocol.JSON
    assert req.enqueued_ms == 1_700_000_000_000
    assert req.deadline_ms == NOW_MS + 1000
    assert req.stream_id == SID.decode()


def test_content_type_defaults_to_json() -> None:
    assert parse(fields(content_type=None)).content_type == protocol.JSON


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("application/json; charset=utf-8", protocol.JSON),
        ("Application/JSON", protocol.JSON),
        ("text/plain;charset=UTF-8", protocol.TEXT),
        ("  application/x-npy ", protocol.NPY),
        ("application/octet-stream", protocol.BYTES),
    ],
)
def test_content_type_parameters_and_case_accepted(raw: str, expected: str) -> None:
    assert parse(fields(content_type=raw)).content_type == expected


def test_empty_deadline_means_none() -> None:
    assert parse(fields(deadline_ms=b"")).deadline_ms is None


def test_payload_exactly_at_limit_accepted() -> None:
    assert len(parse(fields(payload=b"x" * LIMIT)).payload) == LIMIT


# --- parse_request: rejections --------------------------------------------
def rejection(f: dict[bytes, bytes]) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        parse(f)
    return info.value


@pytest.mark.parametrize("reply_to", [None, "", "x" * 1025, b"\xff\xfe"])
def test_missing_or_unusable_reply_to_is_unanswerable(reply_to: object) -> None:
    exc = rejection(fields(reply_to=reply_to))
    assert exc.reply_to is None
    assert exc.request_id == "req-1"
    assert "reply_to" in str(exc)


def test_missing_id_answerable() -> None:
    exc = rejection(fields(id=None))
    assert exc.reply_to == "packrat:replies:c1"
    assert exc.request_id == ""
    assert "missing id" in str(exc)


def test_overlong_id_rejected_with_truncated_id() -> None:
    exc = rejection(fields(id="a" * (protocol.MAX_ID_LEN + 1)))
    assert exc.reply_to == "packrat:replies:c1"
    assert len(exc.request_id) == protocol.MAX_ID_LEN
    assert str(protocol.MAX_ID_LEN) in str(exc)


def test_missing_payload() -> None:
    exc = rejection(fields(payload=None))
    assert exc.reply_to == "packrat:replies:c1"
    assert exc.request_id == "req-1"
    assert "missing payload" in str(exc)


def test_oversize_payload() -> None:
    exc = rejection(fields(payload=b"x" * (LIMIT + 1)))
    assert exc.reply_to == "packrat:replies:c1"
    assert f"{LIMIT + 1} bytes" in str(exc) and f"{LIMIT} bytes" in str(exc)


def test_unknown_content_type() -> None:
    exc = rejection(fields(content_type="image/gif"))
    assert exc.reply_to == "packrat:replies:c1"
    assert "image/gif" in str(exc)
    for ct in protocol.CONTENT_TYPES:
        assert ct in str(exc)


@pytest.mark.parametrize("bad", [b"soon", b"1.5", b"12ms"])
def test_bad_deadline(bad: bytes) -> None:
    exc = rejection(fields(deadline_ms=bad))
    assert exc.reply_to == "packrat:replies:c1"
    assert exc.request_id == "req-1"
    assert "deadline_ms must be an integer" in str(exc)


@pytest.mark.parametrize("late", [0, 250])
def test_expired_deadline(late: int) -> None:
    exc = rejection(fields(deadline_ms=NOW_MS - late))
    assert exc.reply_to == "packrat:replies:c1"
    assert "deadline exceeded" in str(exc)
    assert f"{late} ms late" in str(exc)


# --- decode_payload -------------------------------------------------------
def test_decode_json() -> None:
    assert protocol.decode_payload(protocol.JSON, b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}


@pytest.mark.parametrize("bad", [b"{not json", b"", b"\xff\xfe"])
def test_decode_bad_json(bad: bytes) -> None:
    with pytest.raises(PayloadError, match="not valid application/json"):
        protocol.decode_payload(protocol.JSON, bad)


def test_decode_npy() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = protocol.decode_payload(protocol.NPY, npy_bytes(arr))
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize("arr", [
    np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4)),
    np.arange(6, dtype=">f8").reshape(2, 3),
    np.array(2.5),
    np.zeros((0, 3), dtype=np.uint8),
    np.arange(4, dtype=np.float32)[::-1],
], ids=["fortran", "big-endian", "scalar", "empty", "reversed"])
def test_decode_npy_is_a_read_only_view_of_the_payload(arr: np.ndarray) -> None:
    """No copy of a 600 KB image before the handler's own; the view cannot be written through."""
    payload = npy_bytes(arr)
    out = protocol.decode_payload(protocol.NPY, payload)
    assert out.shape == arr.shape and out.dtype == arr.dtype
    np.testing.assert_array_equal(out, arr)
    assert not out.flags.writeable
    if out.size:
        assert np.shares_memory(out, np.frombuffer(payload, dtype=np.uint8))


@pytest.mark.parametrize("dtype", ["<f4", ">f8", "<f2", "<i8", "|i1", ">u2", "|u1", "|b1", "<c16"])
@pytest.mark.parametrize("shape", [(), (0,), (5,), (1, 3, 4, 4), (2, 0, 3)], ids=str)
@pytest.mark.parametrize("fortran", [False, True], ids=["C", "F"])
def test_plain_npy_headers_are_read_without_numpys_parser(dtype: str, shape: tuple[int, ...], fortran: bool) -> None:
    """What np.save writes for a plain dtype takes the fast header path, and decodes as np.load does."""
    arr = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape).astype(dtype)
    arr = arr.copy(order="F" if fortran else "C")
    payload = npy_bytes(arr)
    header = protocol._plain_npy_header(payload)
    assert header is not None
    assert header[:2] == (shape, bool(arr.flags.f_contiguous and not arr.flags.c_contiguous))
    expected = np.load(io.BytesIO(payload), allow_pickle=False)
    for form in (payload, memoryview(payload)):  # bytes from Redis, a view of a mapped or read file
        out = protocol.decode_payload(protocol.NPY, form)
        assert out.dtype == expected.dtype and out.shape == expected.shape
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("header", [
    b"{'fortran_order': False, 'descr': '<f4', 'shape': (3,), }",  # another key order
    b"{'descr': '<U3', 'fortran_order': False, 'shape': (3,), }",  # another dtype
    b"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (3,), }",  # a structured one
    b"{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'extra': 1, }",
    b"{'descr': '<f4', 'fortran_order': false, 'shape': (3,), }",
    b"{'descr': '<f4', 'fortran_order': False, 'shape': (-3,), }",
    b"{'descr': '<f4', 'fortran_order': False, 'shape': (3), }",
])
def test_other_npy_headers_are_left_to_numpys_parser(header: bytes) -> None:
    """Anything but np.save's own plain form falls back: numpy decides, and its errors are the producer's."""
    padded = header + b" " * (-(len(header) + 11) % 64) + b"\n"
    payload = b"\x93NUMPY\x01\x00" + len(padded).to_bytes(2, "little") + padded + b"\0" * 12
    assert protocol._plain_npy_header(payload) is None
    try:
        out = protocol.decode_payload(protocol.NPY, payload)
    except PayloadError:
        return
    assert out.nbytes == 12  # accepted by numpy's parser: the data agrees with its header


class _Boom:
    """Unpickling this would run code; the test fails if it ever is."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (pytest.fail, ("object array was unpickled",))


def test_decode_npy_refuses_object_arrays() -> None:
    arr = np.empty(1, dtype=object)
    arr[0] = _Boom()
    payload = npy_bytes(arr, allow_pickle=True)
    with pytest.raises(PayloadError, match="not valid application/x-npy"):
        protocol.decode_payload(protocol.NPY, payload)


def test_decode_npy_refuses_raw_pickle() -> None:
    with pytest.raises(PayloadError):
        protocol.decode_payload(protocol.NPY, pickle.dumps(np.arange(3)))


def test_decode_npy_refuses_npz_archive() -> None:
    buf = io.BytesIO()
    np.savez(buf, a=np.arange(3))
    with pytest.raises(PayloadError):
        protocol.decode_payload(protocol.NPY, buf.getvalue())


@pytest.mark.parametrize("bad", [b"", b"not an array", npy_bytes(np.arange(10))[:-8]])
def test_decode_npy_garbage(bad: bytes) -> None:
    with pytest.raises(PayloadError):
        protocol.decode_payload(protocol.NPY, bad)


def test_decode_text() -> None:
    assert protocol.decode_payload(protocol.TEXT, "héllo ✓".encode()) == "héllo ✓"
    with pytest.raises(PayloadError, match="text/plain"):
        protocol.decode_payload(protocol.TEXT, b"\xff\xfe")


def test_decode_bytes_unchanged() -> None:
    raw = bytes(range(256))
    assert protocol.decode_payload(protocol.BYTES, raw) == raw


def test_decode_unknown_content_type() -> None:
    with pytest.raises(PayloadError, match="unknown content_type"):
        protocol.decode_payload("image/gif", b"x")


# --- encode_payload -------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8, np.bool_, np.complex64])
def test_encode_ndarray_round_trip(dtype: type) -> None:
    arr = (np.arange(6) % 2).astype(dtype).reshape(2, 3)
    payload, ct = protocol.encode_payload(arr)
    assert ct == protocol.NPY
    out = protocol.decode_payload(ct, payload)
    assert out.dtype == arr.dtype and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


def test_encode_str_as_text() -> None:
    payload, ct = protocol.encode_payload("ünï ✓")
    assert ct == protocol.TEXT
    assert protocol.decode_payload(ct, payload) == "ünï ✓"


@pytest.mark.parametrize("raw", [b"\x00\x01\xff", bytearray(b"ab"), memoryview(b"cd")])
def test_encode_bytes(raw: object) -> None:
    payload, ct = protocol.encode_payload(raw)
    assert ct == protocol.BYTES
    assert isinstance(payload, bytes) and payload == bytes(raw)  # type: ignore[arg-type]


def test_encode_json_with_numpy_values() -> None:
    value = {
        "label": "cat",
        "score": np.float32(0.5),
        "index": np.int64(7),
        "flag": np.bool_(True),
        "vec": np.array([1, 2, 3]),
        "nested": [np.int32(1), {"x": np.float64(2.0)}],
    }
    payload, ct = protocol.encode_payload(value)
    assert ct == protocol.JSON
    assert protocol.decode_payload(ct, payload) == {
        "label": "cat",
        "score": 0.5,
        "index": 7,
        "flag": True,
        "vec": [1, 2, 3],
        "nested": [1, {"x": 2.0}],
    }


@pytest.mark.parametrize("value", [None, 3, 2.5, [1, "a"], True])
def test_encode_plain_json(value: object) -> None:
    payload, ct = protocol.encode_payload(value)
    assert ct == protocol.JSON
    assert protocol.decode_payload(ct, payload) == value


def test_encoded_floats_are_the_standard_librarys_values() -> None:
    """orjson writes replies: every float must read back as the value json.dumps would have sent."""
    rng = np.random.default_rng(0)
    rows = (rng.standard_normal((8, 384)) * 10.0 ** rng.integers(-30, 30, (8, 384))).astype(np.float32).tolist()
    value = {"embeddings": rows, "tiny": 5e-324, "big": 1.7976931348623157e308, "neg_zero": -0.0}
    payload, ct = protocol.encode_payload(value)
    assert ct == protocol.JSON
    assert json.loads(payload) == json.loads(json.dumps(value))
    assert protocol.decode_payload(ct, payload) == value


def test_json_past_what_orjson_takes_goes_to_the_standard_library() -> None:
    """Integers past 64 bits both ways, and NaN in a request: accepted as they were before orjson."""
    huge = {"n": 2**70, "m": -(2**65)}
    payload, ct = protocol.encode_payload(huge)
    assert protocol.decode_payload(ct, payload) == huge
    assert protocol.decode_payload(protocol.JSON, b"[2361183241434822606848]") == [2**71]
    decoded = protocol.decode_payload(protocol.JSON, b'{"x": NaN, "y": Infinity}')
    assert np.isnan(decoded["x"]) and decoded["y"] == float("inf")


def test_non_finite_floats_are_sent_as_null() -> None:
    """Strict JSON has no NaN: a reply holding one says null, which every JSON parser reads (docs/protocol.md)."""
    payload, _ = protocol.encode_payload([float("nan"), float("inf"), 1.5])
    assert payload == b"[null,null,1.5]"


def test_encode_numpy_scalar_alone() -> None:
    payload, ct = protocol.encode_payload(np.int16(-3))
    assert (ct, json.loads(payload)) == (protocol.JSON, -3)


def test_encode_refuses_object_arrays() -> None:
    with pytest.raises(TypeError, match="object arrays"):
        protocol.encode_payload(np.array([{"a": 1}, None], dtype=object))


def test_encode_refuses_structured_arrays_with_object_fields() -> None:
    with pytest.raises(TypeError, match="object arrays"):
        protocol.encode_payload(np.zeros(2, dtype=[("a", "O"), ("b", "f4")]))


def test_encode_unencodable_value() -> None:
    with pytest.raises(TypeError, match="cannot encode object"):
        protocol.encode_payload({"x": object()})


# --- sub-batches ----------------------------------------------------------
def _redis_round_trip(f: dict[str, object]) -> dict[bytes, bytes]:
    """What XADD then XREAD hands back: every field name and value as bytes."""
    out = {}
    for k, v in f.items():
        if isinstance(v, bytes):
            out[k.encode()] = v
        else:
            out[k.encode()] = str(v).encode("utf-8")
    return out


def test_subbatch_round_trip_binary_and_unicode() -> None:
    requests = [
        Request(
            id="ünïcode-✓-请求",
            reply_to="packrat:replies:ç",
            payload=bytes(range(256)),
            content_type=protocol.BYTES,
            enqueued_ms=1,
            deadline_ms=None,
            stream_id="1-0",
        ),
        Request(
            id="r2",
            reply_to="other",
            payload=npy_bytes(np.arange(4)),
            content_type=protocol.NPY,
            enqueued_ms=2,
            deadline_ms=99,
            stream_id="2-5",
        ),
        Request(id="empty", reply_to="x", payload=b"", content_type=protocol.TEXT, enqueued_ms=3),
    ]
    encoded = protocol.encode_subbatch(requests, "batch-7")
    assert encoded["batch"] == "batch-7"
    assert set(encoded) == {"batch", "meta"}, "payloads stay in the request stream"
    decoded = protocol.decode_subbatch(_redis_round_trip(encoded))
    assert decoded == [dataclasses.replace(req, payload=None) for req in requests]


def test_subbatch_carries_small_payloads_and_payload_file_names() -> None:
    """With ``carry_bytes``: payloads up to it in all in ``c``, a file's name and keep flag in the metadata."""
    small = Request(id="s", reply_to="rt", payload=b"[1,2]", content_type=protocol.JSON, enqueued_ms=1, stream_id="1-0")
    large = Request(id="l", reply_to="rt", payload=b"x" * 9, content_type=protocol.BYTES, enqueued_ms=2, stream_id="2-0")
    named = Request(id="f", reply_to="rt", payload=None, content_type=protocol.NPY, enqueued_ms=3, stream_id="3-0",
                    payload_shm="a.npy", payload_shm_keep=True)
    unread = Request(id="u", reply_to="rt", payload=None, content_type=protocol.NPY, enqueued_ms=4, stream_id="4-0")
    other = Request(id="o", reply_to="rt", payload=b"", content_type=protocol.TEXT, enqueued_ms=5, stream_id="5-0")
    fields = protocol.encode_subbatch([small, large, named, unread, other], "b", carry_bytes=8)
    assert set(fields) == {"batch", "meta", "c"} and fields["c"] == b"[1,2]"  # 9 bytes more would pass 8
    decoded = protocol.decode_subbatch(_redis_round_trip(fields))
    assert decoded == [dataclasses.replace(small, carried=True), dataclasses.replace(large, payload=None),
                       dataclasses.replace(named, carried=True), unread, dataclasses.replace(other, carried=True)]
    assert not any(d.inline for d in decoded)


def test_subbatch_with_inline_payloads_from_an_older_dispatcher() -> None:
    """A queue filled before payloads stayed in the request stream is still served as it was."""
    requests = [Request(id=f"r{i}", reply_to="rt", payload=bytes([i, 255]), content_type=protocol.BYTES,
                        enqueued_ms=i, stream_id=f"{i}-0") for i in range(3)]
    fields = protocol.encode_subbatch(requests, "old")
    fields.update({f"p{i}": req.payload for i, req in enumerate(requests)})
    decoded = protocol.decode_subbatch(_redis_round_trip(fields))
    assert [(d.payload, d.inline) for d in decoded] == [(req.payload, True) for req in requests]


def test_subbatch_round_trip_through_redis(r) -> None:  # type: ignore[no-untyped-def]
    requests = [
        Request(id=f"ïd-{i}", reply_to="rt", payload=bytes([i, 0, 255]), content_type=protocol.BYTES,
                enqueued_ms=i, deadline_ms=i * 10 or None, stream_id=f"{i}-0")
        for i in range(5)
    ]
    r.xadd("q", protocol.encode_subbatch(requests, "b1"))
    [(_, entry)] = r.xrange("q")
    assert protocol.decode_subbatch(entry) == [dataclasses.replace(req, payload=None) for req in requests]


def test_reply_fields_status_follows_error() -> None:
    ok = protocol.reply_fields("a", payload=b"1", queue_ms=1.23456, instance="i0")
    assert ok["status"] == protocol.OK and ok["error"] == "" and ok["queue_ms"] == "1.235"
    assert ok["instance"] == "i0"
    err = protocol.error_reply("a", "bad", model="m")
    assert err["status"] == protocol.ERROR and err["error"] == "bad" and err["model"] == "m"


def test_request_fields_parse_back() -> None:
    f = protocol.request_fields("id1", "rt", b"\x00", protocol.BYTES, deadline_ms=NOW_MS + 5)
    req = parse(_redis_round_trip(f))
    assert (req.id, req.reply_to, req.payload, req.content_type, req.deadline_ms) == (
        "id1", "rt", b"\x00", protocol.BYTES, NOW_MS + 5,
    )
