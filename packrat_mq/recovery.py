"""How a reader loop (worker, dispatcher) recovers from a failed iteration.

One rule for both: a consumer group that Redis lost (restart without
persistence, FLUSHALL) is recreated at once, the process's record rewritten
and the event counted (``groups_recreated``); anything else is logged,
counted when it is not Redis being unreachable (``loop_errors``), and waited
out with the loop's exponential backoff. The caller re-reads its pending
entries before new ones, so nothing read before the failure is lost.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import redis
from redis.exceptions import AskError, ClusterDownError, SlotNotCoveredError, TryAgainError

from packrat_mq.backoff import Backoff
from packrat_mq.records import LiveRecord
from packrat_mq.streams import ensure_group, is_nogroup


#: Redis (or, on Redis Cluster, the master of a slot: failing over, a slot moved or not covered
#: meanwhile) cannot be reached for now: waited out, not counted as a loop error.
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, TryAgainError, AskError,
               SlotNotCoveredError)


def _unblocked(exc: Exception) -> bool:
    """A blocking read cut short because its master became a replica (Redis Cluster failing over)."""
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("UNBLOCKED")


def recover(
    r: redis.Redis,
    exc: Exception,
    *,
    stream: str,
    group: str,
    record: type[LiveRecord],
    record_key: str,
    interval: float,
    rewrite_record: Callable[[], None],
    backoff: Backoff,
    who: str,
    log: logging.Logger,
) -> float:
    """Handle ``exc`` from one iteration; returns how long to wait before the next (0: go on now)."""
    if is_nogroup(exc):
        log.warning("%s: %s lost its consumer group (Redis restarted or flushed); recreating it", who, stream)
        try:
            ensure_group(r, stream, group)
            rewrite_record()
            record.count(r, record_key, "groups_recreated", interval=interval)
            return 0.0
        except redis.RedisError as again:
            exc = again
    delay = backoff.failure()
    if isinstance(exc, UNREACHABLE) or _unblocked(exc):
        log.warning("%s: redis unreachable (%s); retrying in %.2f s", who, exc, delay)
    else:
        log.error("%s: loop iteration failed; retrying in %.2f s", who, delay, exc_info=exc)
        try:
            record.count(r, record_key, "loop_errors", interval=interval)
        except redis.RedisError:
            pass
    return delay
