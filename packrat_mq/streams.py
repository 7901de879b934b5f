"""Consumer groups: created when missing, recreated when Redis lost them.

Groups are created at start-up, but a Redis restart without persistence (or a
FLUSHALL) removes streams and groups under running readers, whose
XREADGROUP then fails with NOGROUP. Every reader recreates its group when it
finds it gone, instead of crash-looping.
"""
from __future__ import annotations

import redis


def ensure_group(r: redis.Redis, stream: str, group: str, *, start: str = "0") -> bool:
    """Create ``group`` on ``stream`` (and the stream) unless it exists; True if created.

    ``start`` is where a new group begins: ``"0"`` (everything in the stream)
    or ``"$"`` (only what is added from now on).
    """
    try:
        r.xgroup_create(stream, group, id=start, mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
        return False
    return True


def is_nogroup(exc: BaseException) -> bool:
    """Whether ``exc`` says the stream or its consumer group does not exist.

    Also when the error came from a pipeline, which redis-py reports as
    ``Command # N (...) of pipeline caused error: NOGROUP ...``.
    """
    if not isinstance(exc, redis.ResponseError):
        return False
    message = str(exc)
    return message.startswith("NOGROUP") or "of pipeline caused error: NOGROUP" in message


def pending_count(summary: dict) -> int:
    """The count of an ``XPENDING <stream> <group>`` summary."""
    return int(summary.get("pending") or 0)


def backlog(length: int, pending: int) -> int:
    """Requests waiting for a dispatcher: the stream's length less its pending entries.

    Requests handed to an instance stay in the request stream, pending under
    that instance's consumer, until they are answered (their payloads are
    fetched from there), and those the dispatcher has read into a batch are
    pending under its own; neither waits for a dispatcher any more.
    """
    return max(0, int(length) - pending)


def read_backlog(r: redis.Redis, stream: str, group: str) -> tuple[int, int]:
    """(backlog, in flight) of a request stream, for status: see :func:`backlog`.

    A stream without the group yet (no dispatcher has started) has nothing in flight.
    """
    length = r.xlen(stream)
    try:
        pending = pending_count(r.xpending(stream, group))
    except redis.ResponseError as exc:
        if not is_nogroup(exc):
            raise
        pending = 0
    return backlog(length, pending), pending
