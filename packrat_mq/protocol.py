"""The wire format: requests, sub-batches and replies as Redis stream fields.

Any Redis client can produce (see docs/protocol.md)::

    XADD <prefix>:requests:<model> * id <id> reply_to <stream> payload <bytes>
         content_type <type> [deadline_ms <unix epoch ms>]

and reads one reply per request from ``reply_to``. Payloads are decoded by
content type, never unpickled: JSON, numpy ``.npy`` (``allow_pickle=False``),
UTF-8 text, raw bytes, or JPEG/PNG/WebP images (checked by their first bytes
here; their pixels are decoded by the handler that takes them, so the core
needs no image library).

Validation is split where it is cheapest: the dispatcher checks the fields
(``parse_request``) so a malformed message never reaches a worker; the worker
decodes the payload (``decode_payload``) in parallel with other workers.
"""
from __future__ import annotations

import io
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from packrat_mq import shared_payloads
from packrat_mq.keys import Keys

JSON = "application/json"
NPY = "application/x-npy"
TEXT = "text/plain"
BYTES = "application/octet-stream"
JPEG = "image/jpeg"
PNG = "image/png"
WEBP = "image/webp"
IMAGE_TYPES = (JPEG, PNG, WEBP)
CONTENT_TYPES = (JSON, NPY, TEXT, BYTES, *IMAGE_TYPES)

OK = "ok"
ERROR = "error"

#: The field that stands for ``payload`` in an entry read without it: the payload's size in bytes.
#: Internal to the dispatcher (see ``dispatcher.reading``); a producer's field of this name is ignored.
PAYLOAD_BYTES = "payload:bytes"

#: Longest id / reply_to accepted, so a hostile producer cannot blow up replies.
MAX_ID_LEN = 256
MAX_REPLY_TO_LEN = 1024


class RequestRejected(ValueError):
    """A request that cannot be served; ``reply_to`` is set when it can be answered."""

    def __init__(self, message: str, *, request_id: str = "", reply_to: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.reply_to = reply_to


class PayloadError(ValueError):
    """A payload that does not decode as its content type says."""


#: The ``kind`` of an error reply in the metrics (``packrat_errors_total``), by how its message
#: starts (the table "Errors a producer can get" in docs/protocol.md). Kinds known where they
#: happen are added there: ``unanswerable`` (no usable reply_to), ``undeliverable`` (reply_to
#: not a stream), ``overloaded``.
ERROR_KINDS: tuple[tuple[str, str], ...] = (
    ("missing id field", "bad_request"),
    ("missing payload field", "bad_request"),
    ("payload and payload_shm are exclusive", "bad_request"),
    ("payload_shm must be", "bad_request"),
    ("payload_fd and payload", "bad_request"),
    ("payload_fd must be", "bad_request"),
    ("id is not UTF-8", "bad_request"),
    ("id longer than", "bad_request"),
    ("content_type is not UTF-8", "bad_request"),
    ("unknown content_type", "bad_request"),
    ("deadline_ms must be", "bad_request"),
    ("payload of ", "too_large"),
    ("deadline exceeded", "deadline"),
    ("overloaded:", "overloaded"),
    ("unknown model", "unknown_model"),
    ("payload is not valid", "bad_payload"),
    ("the request is no longer in the request stream", "gone"),
    ("payload_shm ", "bad_payload"),
    ("payload_fd ", "bad_payload"),
    ("inference failed for this batch", "inference"),
    ("worker instance died", "worker_died"),
    ("handler output could not be encoded", "bad_output"),
    ("internal error", "internal"),
    ("no result", "internal"),
)


def error_kind(message: str) -> str:
    """The metrics' kind of an error reply's message; ``invalid_input`` for a handler's own (``validate``)."""
    for start, kind in ERROR_KINDS:
        if message.startswith(start):
            return kind
    return "invalid_input"


@dataclass
class Request:
    """One accepted request, as the dispatcher hands it to a worker."""

    id: str
    reply_to: str
    #: None in a sub-batch until the worker fetches it from the request stream (and if it is gone).
    payload: bytes | memoryview | None
    content_type: str
    enqueued_ms: int  # from the stream entry id: Redis' clock when XADD ran
    deadline_ms: int | None = None
    stream_id: str = ""
    #: The payload came with the sub-batch (an older dispatcher's format), not from the request stream.
    inline: bool = False
    #: The payload, or the name of its file, came with the sub-batch (see
    #: :func:`encode_subbatch`): the worker fetches nothing; the request is still pending in the
    #: request stream and acknowledged there with its reply, as a fetched one is.
    carried: bool = False
    #: The payload file in shared memory that holds the payload, if the producer wrote one
    #: (:mod:`packrat_mq.shared_payloads`); the worker deletes it once the request is answered.
    payload_shm: str | None = None
    #: The producer keeps that file (``payload_shm_keep 1``): the service must not delete it.
    payload_shm_keep: bool = False
    #: The producer's sealed payload, ``<pid>:<fd>`` (``payload_fd``; the producer's own, never deleted).
    payload_fd: str | None = None
    #: Why the worker could not fetch the payload (the request's error reply), if it could not.
    fetch_error: str | None = None


def _text(fields: dict[bytes, bytes], name: bytes) -> str | None:
    raw = fields.get(name)
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def entry_ms(stream_id: bytes | str) -> int:
    """Milliseconds part of a stream entry id (``1700000000000-0``)."""
    sid = stream_id.decode() if isinstance(stream_id, bytes) else stream_id
    return int(sid.split("-", 1)[0])


def reply_to_problem(reply_to: str, prefix: str) -> str | None:
    """Why ``reply_to`` may not be written to, or ``None`` if it may.

    A reply stream must never be one of the deployment's own keys (its
    configuration, an instance queue, the request stream): a reply, or the
    reply TTL, would break serving. Only ``<prefix>:replies:...`` is allowed
    inside the prefix.
    """
    if not reply_to or len(reply_to) > MAX_REPLY_TO_LEN:
        return f"reply_to must be 1-{MAX_REPLY_TO_LEN} characters"
    own, replies = f"{prefix}:", Keys(prefix).replies("")
    if reply_to.startswith(own) and not reply_to.startswith(replies):
        return f"reply_to {reply_to[:80]!r} is a key of the service itself; use {replies}<client> or any key outside {own}"
    return None


def entry_request_id(fields: dict[bytes, bytes]) -> str:
    """The entry's id as text for a reply, whatever its bytes (undecodable ones replaced)."""
    return (fields.get(b"id") or b"")[:MAX_ID_LEN].decode("utf-8", "replace")


def answerable_reply_to(fields: dict[bytes, bytes], prefix: str) -> str | None:
    """The entry's ``reply_to`` if a reply may be written there, else ``None``."""
    reply_to = _text(fields, b"reply_to")
    if reply_to is None or reply_to_problem(reply_to, prefix):
        return None
    return reply_to


def payload_size(fields: dict[bytes, bytes]) -> int | None:
    """The size of an entry's payload, read with it or without it (``PAYLOAD_BYTES``); None if it has none."""
    payload = fields.get(b"payload")
    if payload is not None:
        return len(payload)
    size = fields.get(PAYLOAD_BYTES.encode())
    return int(size) if size is not None else None


def parse_request(
    stream_id: bytes,
    fields: dict[bytes, bytes],
    *,
    max_payload_bytes: int,
    now_ms: int | None = None,
    prefix: str = "packrat",
) -> Request:
    """Check one request stream entry; raise :class:`RequestRejected` saying what is wrong.

    ``reply_to`` is set on the exception whenever the request can be answered,
    which is whenever its ``reply_to`` is UTF-8 and outside the service's keys.
    """
    text_id = _text(fields, b"id")
    request_id = text_id if text_id is not None else entry_request_id(fields)
    raw_reply_to = fields.get(b"reply_to")
    reply_to = _text(fields, b"reply_to")
    if raw_reply_to is None:
        raise RequestRejected("missing reply_to field", request_id=request_id)
    if reply_to is None:
        raise RequestRejected("reply_to is not UTF-8 text", request_id=request_id)
    problem = reply_to_problem(reply_to, prefix)
    if problem:
        raise RequestRejected(problem, request_id=request_id)
    if fields.get(b"id") and text_id is None:
        raise RequestRejected("id is not UTF-8 text", request_id=request_id, reply_to=reply_to)
    if not request_id:
        raise RequestRejected(
            "missing id field: every request needs a client-chosen id (UTF-8 text)", reply_to=reply_to
        )
    if len(request_id) > MAX_ID_LEN:
        raise RequestRejected(f"id longer than {MAX_ID_LEN} characters", request_id=request_id[:MAX_ID_LEN], reply_to=reply_to)
    payload = fields.get(b"payload")
    size = payload_size(fields)
    shm = _text(fields, shared_payloads.FIELD_BYTES)
    if shared_payloads.FIELD_BYTES in fields:
        # The payload is a file on the serving host: its size is checked where it is read.
        if size is not None:
            raise RequestRejected(f"payload and {shared_payloads.FIELD} are exclusive: send one of them",
                                  request_id=request_id, reply_to=reply_to)
        if shm is None or not shared_payloads.valid_name(shm):
            raise RequestRejected(shared_payloads.NAME_RULE, request_id=request_id, reply_to=reply_to)
        size = 0
    fd_ref = _text(fields, shared_payloads.FD_FIELD_BYTES)
    if shared_payloads.FD_FIELD_BYTES in fields:
        # The producer's sealed memfd: its size is checked where it is mapped.
        if size is not None:
            raise RequestRejected(f"{shared_payloads.FD_FIELD} and payload or {shared_payloads.FIELD} are "
                                  "exclusive: send one of them", request_id=request_id, reply_to=reply_to)
        if fd_ref is None or not shared_payloads.FD_REF.fullmatch(fd_ref):
            raise RequestRejected(shared_payloads.FD_RULE, request_id=request_id, reply_to=reply_to)
        size = 0
    if size is None:
        raise RequestRejected("missing payload field", request_id=request_id, reply_to=reply_to)
    if size > max_payload_bytes:
        raise RequestRejected(
            f"payload of {size} bytes is over the limit of {max_payload_bytes} bytes",
            request_id=request_id,
            reply_to=reply_to,
        )
    raw_type = fields.get(b"content_type")
    content_type = _text(fields, b"content_type")
    if raw_type is not None and content_type is None:
        raise RequestRejected("content_type is not UTF-8 text", request_id=request_id, reply_to=reply_to)
    content_type = content_type or JSON
    content_type = content_type.split(";", 1)[0].strip().lower()
    if content_type not in CONTENT_TYPES:
        raise RequestRejected(
            f"unknown content_type {content_type!r}; use one of {', '.join(CONTENT_TYPES)}",
            request_id=request_id,
            reply_to=reply_to,
        )
    deadline_ms: int | None = None
    raw_deadline = fields.get(b"deadline_ms")
    if raw_deadline not in (None, b""):
        try:
            deadline_ms = int(raw_deadline)  # type: ignore[arg-type]
        except ValueError:
            raise RequestRejected(
                "deadline_ms must be an integer (unix epoch milliseconds)",
                request_id=request_id,
                reply_to=reply_to,
            ) from None
        now = now_ms if now_ms is not None else int(time.time() * 1000)
        if deadline_ms <= now:
            raise RequestRejected(
                f"deadline exceeded before dispatch ({now - deadline_ms} ms late)",
                request_id=request_id,
                reply_to=reply_to,
            )
    sid = stream_id.decode()
    return Request(
        id=request_id,
        reply_to=reply_to,
        payload=payload,
        content_type=content_type,
        enqueued_ms=entry_ms(sid),
        deadline_ms=deadline_ms,
        stream_id=sid,
        payload_shm=shm,
        payload_shm_keep=shared_payloads.kept(fields),
        payload_fd=fd_ref,
    )


def request_fields(
    request_id: str, reply_to: str, payload: bytes | None, content_type: str, deadline_ms: int | None = None,
    *, payload_shm: str | None = None, keep: bool = False, payload_fd: str | None = None,
) -> dict[str, Any]:
    """Fields of a request entry, for XADD: the payload itself, or the name of its file in shared memory
    (``keep``: the producer keeps the file), or its sealed memfd's ``<pid>:<fd>``."""
    fields: dict[str, Any] = {"id": request_id, "reply_to": reply_to}
    if payload_fd is not None:
        fields[shared_payloads.FD_FIELD] = payload_fd
    elif payload_shm is not None:
        fields[shared_payloads.FIELD] = payload_shm
        if keep:
            fields[shared_payloads.KEEP_FIELD] = 1
    else:
        fields["payload"] = payload if payload is not None else b""
    fields["content_type"] = content_type
    if deadline_ms is not None:
        fields["deadline_ms"] = int(deadline_ms)
    return fields


# --- payloads ---------------------------------------------------------
def decode_payload(content_type: str, payload: bytes) -> Any:
    """Decode a payload; raise :class:`PayloadError` with a readable reason.

    Any failure is a :class:`PayloadError`, whatever the decoder raised
    (``RecursionError`` from deep JSON, ``MemoryError`` from a hostile
    header): a producer's bytes must never be able to end a worker.
    """
    try:
        if content_type == JSON:
            return _decode_json(payload)
        if content_type == NPY:
            return _decode_npy(payload)
        if content_type == TEXT:
            return payload.decode("utf-8")
        if content_type == BYTES:
            return payload
        if content_type in IMAGE_TYPES:
            return _check_image(content_type, payload)
    except PayloadError:
        raise
    except UnicodeDecodeError as exc:
        raise PayloadError(f"payload is not valid {content_type}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise PayloadError(f"payload is not valid {content_type}: nested too deeply") from None
    except MemoryError:
        raise PayloadError(f"payload is not valid {content_type}: too large to decode") from None
    except Exception as exc:  # noqa: BLE001 - any decoder failure is the producer's input
        raise PayloadError(f"payload is not valid {content_type}: {exc}") from None
    raise PayloadError(f"unknown content_type {content_type!r}")


def _decode_json(payload: bytes) -> Any:
    """JSON with orjson (4x the standard library's speed); what it refuses, the standard library decides.

    orjson takes strict JSON of 64-bit integers; the standard library also
    takes ``NaN`` and ``Infinity`` and integers of any size, so anything
    orjson refuses is tried there: what is accepted does not change, and an
    invalid payload gets the standard library's error, which says where.
    """
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        pass
    # Decode as UTF-8 first: json.loads(bytes) guesses UTF-16/32 from the
    # first bytes and then reports a misleading 'utf-16-le' error.
    text = bytes(payload).decode("utf-8")
    return json.loads(text)


def sniff_content_type(payload: bytes) -> str | None:
    """The content type a payload's first bytes announce (a JPEG, PNG or WebP image, a ``.npy`` array), or None."""
    head = bytes(payload[:12])
    if head.startswith(b"\xff\xd8\xff"):
        return JPEG
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return PNG
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return WEBP
    if head.startswith(b"\x93NUMPY"):
        return NPY
    return None


def _check_image(content_type: str, payload: bytes) -> bytes:
    """The image's bytes, once their signature says they are the image type claimed."""
    found = sniff_content_type(payload)
    if found != content_type:
        what = f"they are {found}" if found else f"they begin {bytes(payload[:8])!r}"
        raise PayloadError(f"payload is not valid {content_type}: not {content_type} data ({what})")
    return payload


#: The most of a non-bytes ``.npy`` payload copied to read its header (a version 1 header is at most 65,535
#: bytes after its 10-byte preamble; a longer version 2/3 header is refused as unreadable).
NPY_HEADER_MAX = 65536 + 16


#: The version 1.0 header ``np.save`` writes for a plain dtype (bool, integers, floats, complex), in the
#: exact form numpy writes it. Parsed here in about 2 us; numpy's own parser (``ast.literal_eval``) takes
#: 20-25 us, 0.2 ms of a batch of eight small images on the path before the handler. Any other header
#: (another version, key order or dtype) goes to numpy's parser, which decides.
_NPY_PLAIN_HEADER = re.compile(
    rb"\{'descr': '([<>|=]?[?biufc][0-9]{1,2})', 'fortran_order': (True|False), "
    rb"'shape': \((|[0-9]{1,19},|(?:[0-9]{1,19}, )+[0-9]{1,19})\), \} *\n"
)
_NPY_V1_MAGIC = b"\x93NUMPY\x01\x00"


def _plain_npy_header(payload: bytes | memoryview | Any) -> tuple[tuple[int, ...], bool, np.dtype, int] | None:
    """(shape, fortran order, dtype, data offset) of a header in :data:`_NPY_PLAIN_HEADER`'s form, else None."""
    preamble = bytes(payload[:10])
    if len(preamble) < 10 or preamble[:8] != _NPY_V1_MAGIC:
        return None
    end = 10 + int.from_bytes(preamble[8:10], "little")
    match = _NPY_PLAIN_HEADER.fullmatch(bytes(payload[10:end]))
    if match is None:
        return None
    descr, fortran, dims = match.groups()
    shape = tuple(int(d) for d in dims.split(b",") if d.strip())
    return shape, fortran == b"True", np.dtype(descr.decode("ascii")), end


def _decode_npy(payload: bytes | memoryview | Any) -> Any:
    """A ``.npy`` array whose header agrees with its length, read without pickle or copy.

    The header is checked before any allocation: a header that claims a
    shape of 2**40 elements with no data must be refused, not allocated.
    The array is a read-only view of ``payload`` (``np.frombuffer``; bytes,
    or a read-only view of the buffer a payload file in shared memory was read into): a
    600 KB image is not copied again before the handler's own preprocessing,
    which copies it into its batch tensor anyway. Handlers must not write to
    their input arrays (``validate`` and ``preprocess`` build new ones), nor
    keep them past their batch: a worker reuses the buffer a payload file was
    read into.
    """
    plain = _plain_npy_header(payload)
    if plain is not None:
        shape, fortran_order, dtype, offset = plain
    else:
        # A view of a worker's buffer (a payload file in shared memory) is read in place too: only the
        # header is copied.
        buf = io.BytesIO(payload if isinstance(payload, bytes) else bytes(memoryview(payload)[:NPY_HEADER_MAX]))
        version = np.lib.format.read_magic(buf)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(buf)
        elif version in ((2, 0), (3, 0)):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(buf)
        else:
            raise PayloadError(f"payload is not valid {NPY}: unsupported format version {version}")
        offset = buf.tell()
    if dtype.hasobject:
        raise PayloadError(f"payload is not valid {NPY}: object arrays would need pickle")
    count = 1
    for dim in shape:
        count *= int(dim)
    expected = count * dtype.itemsize
    available = len(payload) - offset
    if expected != available:
        raise PayloadError(
            f"payload is not valid {NPY}: header says shape {tuple(shape)} of {dtype} "
            f"({expected} bytes) but {available} bytes follow"
        )
    array = np.frombuffer(payload, dtype=dtype, count=count, offset=offset)
    return array.reshape(shape, order="F" if fortran_order else "C")


def encode_payload(value: Any) -> tuple[bytes, str]:
    """Encode a value for the wire, choosing its content type."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), BYTES
    if isinstance(value, np.ndarray):
        # One copy into the bytes, where np.save into a BytesIO made three (8 x 600 KB: 2.1 against 2.8 ms).
        return b"".join(npy_parts(value)), NPY
    if isinstance(value, str):
        return value.encode("utf-8"), TEXT
    return _json_bytes(value), JSON


def npy_parts(value: np.ndarray) -> tuple[bytes, np.ndarray]:
    """An array's ``.npy`` encoding in two parts: the header, and the data as a flat ``uint8`` view.

    Joined, they decode as :func:`encode_payload`'s bytes do (C order
    always). For a writer that copies the array once, straight to where the
    request reads it (a payload file in shared memory), instead of through
    ``np.save``'s buffer and ``getvalue``'s copy of it.
    """
    data = np.asarray(value, order="C")  # a copy only of an array that is not C-contiguous already
    return npy_header(data.shape, data.dtype), data.reshape(-1).view(np.uint8)


def npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The ``.npy`` header of a C-order array of this shape and dtype (the bytes before its data)."""
    if dtype.hasobject:  # also structured dtypes with object fields
        raise TypeError("object arrays cannot be sent; they would need pickle")
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)}
    buf = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buf, header)
    except ValueError:  # a header over 64 KiB (many structured fields)
        buf = io.BytesIO()
        np.lib.format.write_array_header_2_0(buf, header)
    return buf.getvalue()


def encode_as(content_type: str, value: Any) -> bytes:
    """Encode ``value`` as the given content type (``TypeError`` if it cannot be)."""
    if content_type == JSON:
        return _json_bytes(value)
    if content_type == TEXT and isinstance(value, str):
        return value.encode("utf-8")
    if content_type == NPY:
        payload, _ = encode_payload(np.asarray(value))
        return payload
    raise TypeError(f"cannot encode {type(value).__name__} as {content_type}; pass bytes")


def _json_bytes(value: Any) -> bytes:
    """Compact JSON of ``value``: orjson, or the standard library for what orjson cannot encode.

    Replies are JSON, and the standard library formats a float in about
    0.4 us: 4.9 ms for a batch of 32 MiniLM embeddings (384 floats each),
    all of it between the handler's end and the replies' transaction, against
    0.3 ms with orjson (docs/decisions.md). orjson writes the same shortest
    round-trip digits; it writes a non-finite float as ``null`` (strict JSON
    has no ``NaN``), and it refuses integers past 64 bits, which go to the
    standard library as before.
    """
    try:
        return orjson.dumps(value, default=_json_default, option=orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        return json.dumps(value, separators=(",", ":"), default=_json_default).encode("utf-8")


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if hasattr(value, "tolist"):  # torch tensors, without importing torch
        return value.tolist()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


# --- sub-batches (dispatcher -> worker instance) ----------------------
#: The most payload bytes one sub-batch carries (see :func:`encode_subbatch`): small requests ride
#: along, a sub-batch of larger ones carries what fits and the worker fetches the rest.
CARRY_MAX_BYTES = 64 * 1024


#: The eighth element of a carried request's metadata that says its seventh is a sealed payload's
#: ``<pid>:<fd>`` (0 and 1: a payload file's name, and whether its producer keeps it).
SEALED = 2


def encode_subbatch(requests: list[Request], batch_id: str, *, carry_bytes: int = 0) -> dict[str, Any]:
    """One instance-queue entry naming a sub-batch: its requests' metadata, and their small payloads.

    Metadata travels as one JSON array (one dumps per sub-batch, not per
    request). Large payloads stay in the request stream, where the producer
    wrote them; the worker fetches them by ``stream_id``
    (``Worker.fetch_payloads``), so a 600 KB image crosses Redis twice
    (producer in, worker out) instead of four times (see docs/decisions.md
    "Payloads stay in the request stream"). Payloads the dispatcher has
    read anyway (it reads small ones with their requests) ride along, up to
    ``carry_bytes`` in all, joined in one field ``c`` (each request's
    length its metadata's seventh element), and a payload file's name and
    keep flag are the metadata's seventh and eighth (a sealed payload's
    ``<pid>:<fd>`` and :data:`SEALED`): the worker then has
    nothing to fetch, one round trip to Redis less per sub-batch. One field,
    not one per request: 128 fields made the dispatcher's fan-out of a
    128-request sub-batch 0.6 ms slower (1.81 -> 2.47 ms), and the
    dispatcher is what bounds a drain. The requests stay pending in the
    request stream either way.
    """
    meta: list[list[Any]] = []
    carried: list[bytes | memoryview] = []
    budget = carry_bytes
    for r in requests:
        m: list[Any] = [r.id, r.reply_to, r.content_type, r.enqueued_ms, r.deadline_ms, r.stream_id]
        if carry_bytes and r.payload_fd is not None:
            m += [r.payload_fd, SEALED]
        elif carry_bytes and r.payload_shm is not None:
            m += [r.payload_shm, int(r.payload_shm_keep)]
        elif carry_bytes and r.payload is not None and len(r.payload) <= budget:
            m.append(len(r.payload))
            carried.append(r.payload)
            budget -= len(r.payload)
        meta.append(m)
    fields: dict[str, Any] = {"batch": batch_id, "meta": _json_bytes(meta)}
    if carried:
        fields["c"] = b"".join(carried)
    return fields


def decode_subbatch(fields: dict[bytes, bytes]) -> list[Request]:
    """The requests of a sub-batch; ``payload`` is None until fetched, unless it came with the sub-batch.

    Carried payloads (in ``c``) and payload files (named in the metadata)
    are the requests' own (see :func:`encode_subbatch`). Sub-batches written
    before payloads stayed in the request stream carry them inline in
    ``p0``, ``p1``, ...; those are used as they are, so a queue filled by an
    older dispatcher is still served.
    """
    meta = _decode_json(fields[b"meta"])
    blob, offset = fields.get(b"c", b""), 0
    requests = []
    for i, m in enumerate(meta):
        inline = f"p{i}".encode()
        sealed = len(m) > 7 and m[7] == SEALED
        shm = m[6] if len(m) > 7 and not sealed else None
        payload = fields.get(inline)
        if len(m) == 7:
            payload, offset = blob[offset : offset + m[6]], offset + m[6]
        requests.append(Request(
            id=m[0],
            reply_to=m[1],
            content_type=m[2],
            enqueued_ms=m[3],
            deadline_ms=m[4],
            stream_id=m[5],
            payload=payload,
            inline=inline in fields,
            carried=len(m) > 6,
            payload_shm=shm,
            payload_shm_keep=bool(m[7]) if shm is not None else False,
            payload_fd=m[6] if sealed else None,
        ))
    return requests


# --- replies ----------------------------------------------------------
def reply_fields(
    request_id: str,
    *,
    payload: bytes = b"",
    content_type: str = JSON,
    error: str = "",
    queue_ms: float = 0.0,
    inference_ms: float = 0.0,
    **extra: Any,
) -> dict[str, Any]:
    """Fields of a reply entry: ``status`` is ``error`` exactly when ``error`` is set."""
    fields: dict[str, Any] = {
        "id": request_id,
        "status": ERROR if error else OK,
        "payload": payload,
        "content_type": content_type,
        "error": error,
        "queue_ms": f"{queue_ms:.3f}",
        "inference_ms": f"{inference_ms:.3f}",
    }
    fields.update({k: str(v) for k, v in extra.items()})
    return fields


def error_reply(request_id: str, message: str, **extra: Any) -> dict[str, Any]:
    return reply_fields(request_id, error=message, **extra)
