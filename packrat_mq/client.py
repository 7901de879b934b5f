"""The Python client: submit requests and gather their replies.

It speaks the documented wire format and nothing more, so any other Redis
client can do the same. Each client owns one reply stream
(``<prefix>:replies:<client id>``), reads it with XREAD and deletes what it
has read; replies for other outstanding requests that arrive while waiting
for one are kept until asked for.

The first reply to an id is its answer; a later one to the same id is
dropped. On one Redis a second reply comes only after a Redis machine crash
lost the transaction that acknowledged the first; on Redis Cluster, where
replies are written at least once, also after a worker or a master failed
between a reply and its acknowledgement (docs/decisions.md, "Redis Cluster").

A client on the serving host can keep large payloads out of Redis
(``shared_memory=True``): each payload of at least ``shm_min_bytes`` is
written to a file in the host's payload directory and the request names it
(``payload_shm``; :mod:`packrat_mq.shared_payloads`). The client keeps its
files (``payload_shm_keep``), each mapped, and writes the next payload into one
whose reply has arrived: one memory copy. :meth:`Client.close` deletes them.
With ``shared_memory="sealed"`` the payloads are sealed memfds instead
(``payload_fd``), which workers map rather than read: no copy on their side,
for a producer in the workers' PID namespace and of their user. Either way,
:meth:`Client.empty` lends an array in shared memory that the producer fills
and sends with no copy on its side either.
"""
from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from packrat_mq import protocol, shared_payloads
from packrat_mq.connection import connect, is_cluster
from packrat_mq.keys import Keys
from packrat_mq.settings import Settings

#: How many answered ids a client remembers to drop a second reply to (a few MB at most).
ANSWERED_IDS = 65536
#: Payloads from this size on go to shared memory when the client is asked to use it. Below it the
#: bytes cost Redis little (a stream hop is about 0.2 ms) and a file costs two system calls more.
SHM_MIN_BYTES = 64 * 1024
#: Payload files a client keeps for reuse once their requests are answered (more are deleted).
SHM_POOL = 32


class ReplyTimeout(TimeoutError):
    """No reply within the timeout; the request may still be served later."""


@dataclass
class Reply:
    """One reply, decoded."""

    id: str
    status: str
    payload: bytes
    content_type: str
    error: str
    queue_ms: float
    inference_ms: float
    fields: dict[str, str]
    received_at: float = 0.0
    sent_at: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == protocol.OK

    @property
    def latency_ms(self) -> float | None:
        """Client-side time from send to receipt (for replies gathered by this client)."""
        return (self.received_at - self.sent_at) * 1000.0 if self.sent_at else None

    def value(self) -> Any:
        """The decoded payload; raises ``RuntimeError`` for an error reply."""
        if not self.ok:
            raise RuntimeError(f"request {self.id} failed: {self.error}")
        return protocol.decode_payload(self.content_type, self.payload)

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> Reply:
        text = {k.decode(): v.decode("utf-8", "replace") for k, v in fields.items() if k != b"payload"}
        return cls(
            id=text.get("id", ""),
            status=text.get("status", protocol.ERROR),
            payload=fields.get(b"payload", b""),
            content_type=text.get("content_type", protocol.JSON),
            error=text.get("error", ""),
            queue_ms=float(text.get("queue_ms") or 0.0),
            inference_ms=float(text.get("inference_ms") or 0.0),
            fields=text,
            received_at=time.time(),
        )


class Client:
    """Submits requests for models and waits for their replies."""

    def __init__(
        self,
        r: redis.Redis | str,
        *,
        prefix: str = "packrat",
        client_id: str | None = None,
        shared_memory: bool | str = False,
        shm_dir: str | None = None,
        shm_min_bytes: int = SHM_MIN_BYTES,
        shm_pool: int = SHM_POOL,
    ) -> None:
        """``shared_memory``: write payloads of ``shm_min_bytes`` or more to the host's payload directory
        (``shm_dir``; default ``PACKRAT_SHM_DIR`` or ``/dev/shm/packrat``) instead of into Redis. Only for
        a producer on the host that serves its requests: elsewhere each gets an error reply saying so.
        The client keeps its files (``payload_shm_keep``): it writes a new payload into one whose
        request has been answered, keeps up to ``shm_pool`` of them between requests, and deletes
        them all at :meth:`close`. ``shared_memory="sealed"``: sealed memfds (``payload_fd``) instead
        of files, mapped by the workers, not read; the producer must run in the workers' PID namespace
        as their user (on the host, not in another container), else each request gets an error saying so.
        """
        if shared_memory not in (False, True, "files", "sealed"):
            raise ValueError(f"shared_memory is False, True (or 'files') or 'sealed', not {shared_memory!r}")
        #: Made from a URL, the connection is the client's own, and close() closes it.
        self._owns_connection = isinstance(r, str)
        if isinstance(r, str):
            r = connect(r)
        self.r = r
        self.keys = Keys(prefix, cluster=is_cluster(r))
        self.client_id = client_id or uuid.uuid4().hex
        self.reply_to = self.keys.replies(self.client_id)
        self._last_id = b"0-0"
        self._buffer: dict[str, Reply] = {}
        self._sent_at: dict[str, float] = {}
        #: Ids whose reply ``gather`` returned, newest last: a later reply to one is a duplicate.
        self._answered: OrderedDict[str, None] = OrderedDict()
        #: Replies dropped because their id had one already.
        self.duplicates = 0
        #: Where large payloads go instead of Redis, if anywhere.
        self.payload_files: shared_payloads.SharedPayloads | None = None
        #: Payloads go to sealed memfds (``payload_fd``), not files.
        self.sealed = shared_memory == "sealed"
        if shared_memory and not self.sealed:
            if shm_dir is None:
                shm_dir = Settings().shm_dir  # PACKRAT_SHM_DIR, the variable the service reads
            self.payload_files = shared_payloads.SharedPayloads(shm_dir)
        self.shm_min_bytes = shm_min_bytes
        self.shm_pool = shm_pool
        #: Payload files whose requests are answered, to be written again; and the file of each
        #: request in flight. Named ``<random>-<n>``: this client's own.
        self._free_files: list[str] = []
        self._file_of: dict[str, str] = {}
        #: Each file this client holds, mapped: the next payload is one memory copy into it. Sealed: by
        #: ``<pid>:<fd>``, each of one size for good.
        self._mapped: dict[str, shared_payloads.MappedFile | shared_payloads.SealedFile] = {}
        #: Arrays lent by :meth:`empty` and not yet sent: by address, (file, shape, dtype).
        self._lent: dict[int, tuple[str, tuple[int, ...], np.dtype]] = {}
        self._file_tag = uuid.uuid4().hex[:16]
        self._files_made = 0

    @property
    def _shm(self) -> bool:
        """Whether large payloads go to shared memory (files or sealed memfds) rather than into Redis."""
        return self.sealed or self.payload_files is not None

    # --- sending ----------------------------------------------------------
    def _fields(
        self, data: Any, content_type: str | None, timeout_s: float | None, request_id: str | None
    ) -> tuple[str, dict[str, Any]]:
        rid = request_id or uuid.uuid4().hex
        deadline = int((time.time() + timeout_s) * 1000) if timeout_s else None
        if self._shm and isinstance(data, np.ndarray) and content_type in (None, protocol.NPY):
            name = self._lent_file(data)
            if name is None and data.nbytes >= self.shm_min_bytes:
                # Straight into the payload file: one copy of the array, none through np.save's buffer.
                name = self._write_file(*protocol.npy_parts(data))
            if name is not None:
                return rid, self._shm_fields(rid, name, protocol.NPY, deadline)
        if content_type is None:
            payload, content_type = protocol.encode_payload(data)
        elif isinstance(data, bytes):
            payload = data  # already encoded as content_type says
        else:
            payload = protocol.encode_as(content_type, data)
        if self._shm and len(payload) >= self.shm_min_bytes:
            return rid, self._shm_fields(rid, self._write_file(payload), content_type, deadline)
        return rid, protocol.request_fields(rid, self.reply_to, payload, content_type, deadline)

    def _shm_fields(self, rid: str, name: str, content_type: str, deadline: int | None) -> dict[str, Any]:
        """The fields of request ``rid`` whose payload is in this client's file ``name``, now the request's."""
        self._file_of[rid] = name
        if self.sealed:
            return protocol.request_fields(rid, self.reply_to, None, content_type, deadline, payload_fd=name)
        return protocol.request_fields(rid, self.reply_to, None, content_type, deadline, payload_shm=name, keep=True)

    def empty(self, shape: int | Sequence[int], dtype: Any = np.float32) -> np.ndarray:
        """An uninitialised C-order array in this client's shared memory: fill it, then send it, with no copy.

        ``send``/``submit`` of the array (or of a view with its shape and
        dtype) sends its file as it is. Why: writing a 600 KB payload into
        shared memory is a memory copy, 1.0 ms for eight on the Zen 4 host
        of 12-04, as much as the rest of the path's work on the bytes; a
        producer that decodes or resizes an image can write it here in the
        first place (as Triton's system shared memory is used).

        The array is the request's from its send until its reply arrives:
        writing it meanwhile changes what the model reads. After the reply
        its memory goes back to the client's pool, to hold a later payload:
        keep nothing of it. An array not sent is the client's until
        :meth:`close`. Needs ``shared_memory``.
        """
        if not self._shm:
            raise RuntimeError("Client.empty needs a client made with shared_memory=True or 'sealed'")
        shape_t = (int(shape),) if isinstance(shape, int) else tuple(int(n) for n in shape)
        dt = np.dtype(dtype)
        header = protocol.npy_header(shape_t, dt)
        name = self._take_file(shared_payloads.array_file_size(header, shape_t, dt))
        try:
            arr = self._mapped[name].array(header, shape_t, dt)
        except BaseException:
            self._free_files.append(name)
            raise
        self._lent[arr.__array_interface__["data"][0]] = (name, shape_t, dt)
        return arr

    def _lent_file(self, data: np.ndarray) -> str | None:
        """The file of an array :meth:`empty` lent, when ``data`` is that array as lent; it is the request's now."""
        if not self._lent or not data.flags.c_contiguous:
            return None
        address = data.__array_interface__["data"][0]
        lent = self._lent.get(address)
        if lent is None or lent[1] != data.shape or lent[2] != data.dtype:
            return None  # another array, or a view of another shape (its header would lie): copied
        del self._lent[address]
        return lent[0]

    def _take_file(self, size: int) -> str:
        """A free payload file of this client's for ``size`` bytes, or a new one; its name (or ``<pid>:<fd>``)."""
        if self.sealed:
            # Sealed: each holds one size for good. A free one of that size, else a new one (the pool's
            # oldest free one of another size closed to make room).
            for k in range(len(self._free_files) - 1, -1, -1):
                sealed = self._mapped[self._free_files[k]]
                if isinstance(sealed, shared_payloads.SealedFile) and sealed.size == size:
                    return self._free_files.pop(k)
            if len(self._free_files) >= self.shm_pool:
                self._drop(self._free_files.pop(0))
            made = shared_payloads.SealedFile(size)
            self._mapped[made.ref] = made
            return made.ref
        assert self.payload_files is not None
        if self._free_files:
            name = self._free_files.pop()
        else:
            self._files_made += 1
            name = f"{self._file_tag}-{self._files_made}"
        if name not in self._mapped:
            self._mapped[name] = shared_payloads.MappedFile(self.payload_files, name)
        return name

    def _write_file(self, *parts: Any) -> str:
        """Write a payload, in parts, to a free payload file of this client's (or a new one); returns its name.

        The caller records it in ``_file_of`` under the request's id.
        """
        name = self._take_file(sum(memoryview(part).nbytes for part in parts))
        try:
            self._mapped[name].write(*parts)
        except BaseException:
            self._free_files.append(name)  # not sent: free again
            raise
        return name

    def _drop(self, name: str) -> None:
        """Unmap and delete one of this client's payload files (close a sealed one)."""
        mapped = self._mapped.pop(name, None)
        if mapped is not None:
            mapped.close()
        if self.payload_files is not None:
            self.payload_files.discard([name])

    def _release_file(self, rid: str) -> None:
        """The request ``rid`` is answered (or was never applied): its payload file may be written again."""
        name = self._file_of.pop(rid, None)
        if name is None:
            return
        if len(self._free_files) < self.shm_pool:
            self._free_files.append(name)
        else:
            self._drop(name)

    def _refused(self, sent: Iterable[dict[str, Any]]) -> None:
        """Free the payload files of requests Redis refused (never applied: nobody will read them)."""
        for fields in sent:
            self._release_file(fields["id"])

    def send(
        self,
        model: str,
        data: Any,
        *,
        content_type: str | None = None,
        deadline_s: float | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue one request; returns its id. ``deadline_s``: give up after this long."""
        rid, fields = self._fields(data, content_type, deadline_s, request_id)
        self._sent_at[rid] = time.time()
        try:
            self.r.xadd(self.keys.requests(model), fields)
        except redis.ResponseError:
            # Refused: no request. (After a connection error it may have been applied: the
            # file stays for the service, or for the sweep.)
            self._refused([fields])
            raise
        return rid

    def send_many(
        self, model: str, items: Iterable[Any], *, content_type: str | None = None, deadline_s: float | None = None
    ) -> list[str]:
        """Queue many requests in one round trip, as one transaction; returns their ids in order.

        One MULTI/EXEC, so that they reach the stream together. Redis serves a
        blocked reader after each command: eight plain pipelined XADDs wake the
        dispatcher at the first, and it reads the other seven in a second
        round trip (0.26-0.35 ms of a B=8 batch on a Zen 4 host, 12-04). On
        Redis Cluster it is also what keeps the pipeline from sending a command
        again, alone, when its connection failed (a second request); the XADDs
        go to one stream, one slot.
        """
        pipe = self.r.pipeline(transaction=True)
        ids = []
        sent = []
        now = time.time()
        for data in items:
            rid, fields = self._fields(data, content_type, deadline_s, None)
            ids.append(rid)
            sent.append(fields)
            self._sent_at[rid] = now
            pipe.xadd(self.keys.requests(model), fields)
        try:
            results = pipe.execute(raise_on_error=False)
        except redis.ResponseError:
            self._refused(sent)  # the transaction was discarded (EXECABORT): none of them was applied
            raise
        errors = [(fields, res) for fields, res in zip(sent, results) if isinstance(res, redis.ResponseError)]
        if errors:
            self._refused(fields for fields, _ in errors)
            raise errors[0][1]
        return ids

    # --- receiving --------------------------------------------------------
    def gather(self, ids: Sequence[str], timeout: float = 30.0) -> list[Reply]:
        """Wait for the replies to ``ids``; returns them in the order of ``ids``."""
        wanted = set(ids)
        deadline = time.monotonic() + timeout
        while not wanted.issubset(self._buffer):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = len(wanted - set(self._buffer))
                raise ReplyTimeout(f"{missing} of {len(wanted)} replies not received within {timeout:.1f} s")
            self._poll(block_ms=max(1, int(min(remaining, 1.0) * 1000)))
        found = {i: self._buffer.pop(i) for i in dict.fromkeys(ids)}
        for i in found:
            self._answered[i] = None
        while len(self._answered) > ANSWERED_IDS:
            self._answered.popitem(last=False)
        replies = [found[i] for i in ids]
        for rep in replies:
            rep.sent_at = self._sent_at.pop(rep.id, 0.0)
        return replies

    def _poll(self, block_ms: int) -> None:
        resp = self.r.xread({self.reply_to: self._last_id}, count=1000, block=block_ms)
        if not resp:
            return
        entries = resp[0][1]
        for entry_id, fields in entries:
            rep = Reply.from_fields(fields)
            if rep.id in self._buffer or rep.id in self._answered:
                self.duplicates += 1  # the first reply to an id is its answer
                continue
            self._buffer[rep.id] = rep
            if self._file_of:
                self._release_file(rep.id)  # the service is done with its payload file
        self._last_id = entries[-1][0]
        # Read replies are deleted: the stream holds only what is unread.
        self.r.xdel(self.reply_to, *(e for e, _ in entries))

    def submit(
        self,
        model: str,
        data: Any,
        *,
        content_type: str | None = None,
        timeout: float = 30.0,
        deadline_s: float | None = None,
    ) -> Reply:
        """Send one request and wait for its reply."""
        rid = self.send(model, data, content_type=content_type, deadline_s=deadline_s)
        return self.gather([rid], timeout=timeout)[0]

    def submit_many(
        self, model: str, items: Iterable[Any], *, content_type: str | None = None, timeout: float = 60.0
    ) -> list[Reply]:
        """Send many requests at once and wait for all replies (in order)."""
        return self.gather(self.send_many(model, items, content_type=content_type), timeout=timeout)

    def time_batch(
        self, model: str, items: Iterable[Any], *, content_type: str | None = None, timeout: float = 60.0
    ) -> tuple[float, list[Reply]]:
        """Send ``items`` at once as one batch, wait for every reply; return (batch latency ms, replies).

        Batch latency: from sending the first request to receiving the last
        reply, what a caller waiting for the whole batch sees. Error replies
        count as replies (check ``Reply.ok``); a missing one raises ``ReplyTimeout``.
        """
        start = time.time()  # the clock Reply.received_at is read with
        replies = self.submit_many(model, items, content_type=content_type, timeout=timeout)
        return (max((rep.received_at for rep in replies), default=start) - start) * 1000.0, replies

    def close(self) -> None:
        """Delete this client's reply stream and payload files; a client made from a URL also closes its connection.

        A request still in flight then finds no payload file and is answered with an error.
        """
        if self._shm:
            for name in [*self._mapped]:  # every file this client made, free or in flight
                self._drop(name)
            self._free_files.clear()
            self._file_of.clear()
            self._lent.clear()
        try:
            self.r.delete(self.reply_to)
        finally:
            if self._owns_connection:
                self.r.close()
