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
"""
from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from packrat_mq import protocol
from packrat_mq.connection import connect, is_cluster
from packrat_mq.keys import Keys

#: How many answered ids a client remembers to drop a second reply to (a few MB at most).
ANSWERED_IDS = 65536


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

    def __init__(self, r: redis.Redis | str, *, prefix: str = "packrat", client_id: str | None = None) -> None:
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

    # --- sending ----------------------------------------------------------
    def _fields(
        self, data: Any, content_type: str | None, timeout_s: float | None, request_id: str | None
    ) -> tuple[str, dict[str, Any]]:
        if content_type is None:
            payload, content_type = protocol.encode_payload(data)
        elif isinstance(data, bytes):
            payload = data  # already encoded as content_type says
        else:
            payload = protocol.encode_as(content_type, data)
        rid = request_id or uuid.uuid4().hex
        deadline = int((time.time() + timeout_s) * 1000) if timeout_s else None
        return rid, protocol.request_fields(rid, self.reply_to, payload, content_type, deadline)

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
        self.r.xadd(self.keys.requests(model), fields)
        return rid

    def send_many(
        self, model: str, items: Iterable[Any], *, content_type: str | None = None, deadline_s: float | None = None
    ) -> list[str]:
        """Queue many requests in one round trip; returns their ids in order."""
        # On Redis Cluster a pipeline outside a transaction sends a command again, alone, when its
        # connection failed: a second request. The XADDs go to one stream (one slot): one MULTI/EXEC.
        pipe = self.r.pipeline(transaction=is_cluster(self.r))
        ids = []
        now = time.time()
        for data in items:
            rid, fields = self._fields(data, content_type, deadline_s, None)
            ids.append(rid)
            self._sent_at[rid] = now
            pipe.xadd(self.keys.requests(model), fields)
        pipe.execute()
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
        """Delete this client's reply stream; a client made from a URL also closes its connection."""
        try:
            self.r.delete(self.reply_to)
        finally:
            if self._owns_connection:
                self.r.close()
