"""Consumer groups: created when missing, recreated when Redis lost them.

Groups are created at start-up, but a Redis restart without persistence (or a
FLUSHALL) removes streams and groups under running readers, whose
XREADGROUP then fails with NOGROUP. Every reader recreates its group when it
finds it gone, instead of crash-looping.
"""
from __future__ import annotations

import redis


def ensure_group(r: redis.Redis, stream: str, group: str) -> bool:
    """Create ``group`` on ``stream`` (and the stream) unless it exists; True if created."""
    try:
        r.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
        return False
    return True


def is_nogroup(exc: BaseException) -> bool:
    """Whether ``exc`` says the stream or its consumer group does not exist."""
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("NOGROUP")
