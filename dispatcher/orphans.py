"""Requests for models nobody serves get an error reply instead of waiting forever.

A producer may XADD to ``<prefix>:requests:<model>`` for any name. Every
dispatcher sweeps, about once a second, for request streams whose model is
not in the models index and answers each entry with "unknown model". A short
lock keeps two dispatchers from answering the same entry twice.

Only entries older than a grace period (three heartbeats, by the entry id's
time against Redis's clock) are answered. After a FLUSHALL or a Redis
restart without persistence, the models index is empty until each model's
dispatcher writes it again at its next heartbeat; a sweep in that window
answered requests of served models with "unknown model" (seen as a flaky
test). A genuinely unknown model's producer hears back a few seconds later
instead of one.

Key names come from producers too: a request stream whose name is not UTF-8
or not a valid model name is an unknown model like any other, and one
stream that cannot be swept never stops the sweep of the others.

On Redis Cluster SCAN sees one node's keys, so every master is scanned, and
one that cannot be reached (failing over) is skipped until the next sweep.
There a served model's stream is ``<prefix>:requests:{<model>}``; entries
written to ``<prefix>:requests:<model>`` (no hash tag) are answered with an
error that names the right stream, and on one Redis the other way round.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import redis
from redis.exceptions import RedisClusterException

from packrat_mq import protocol, replies
from packrat_mq.connection import is_cluster
from packrat_mq.settings import Settings

log = logging.getLogger("packrat_mq.orphans")

LOCK_MS = 5000
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


def sweep(r: redis.Redis, settings: Settings, *, batch: int = 500, own: str | None = None,
          grace_ms: int | None = None) -> int:
    """Answer requests sent to unknown models; returns how many were answered or dropped.

    ``own`` is the sweeping dispatcher's model, served whatever the index says.
    ``grace_ms`` (default three heartbeats) is how old an entry must be.
    """
    keys = settings.keys
    if grace_ms is None:
        grace_ms = int(3000 * settings.heartbeat_s)
    token = uuid.uuid4().hex
    if not r.set(keys.lock("orphan-sweep"), token, nx=True, px=LOCK_MS):
        return 0
    try:
        served = {m.decode("utf-8", "replace") for m in r.smembers(keys.models())}
        if own is not None:
            served.add(own)
        seconds, micros = r.time()
        cutoff_ms = int(seconds) * 1000 + int(micros) // 1000 - grace_ms
        if cutoff_ms <= 0:
            return 0
        handled = 0
        for raw_key in _request_streams(r, keys.request_streams()):
            model, right_form = keys.model_of(raw_key)
            if right_form and model in served:
                continue
            if right_form:
                message = f"unknown model {model!r}; served models: {', '.join(sorted(served)) or 'none'}"
            else:
                where = "on Redis Cluster" if keys.cluster else "on this Redis (not a cluster)"
                message = (f"no model reads {raw_key.decode('utf-8', 'replace')!r}: {where} the request stream "
                           f"of model {model!r} is {keys.requests(model)!r}")
            try:
                handled += _answer(r, settings, raw_key, model, message, batch, cutoff_ms)
            except (redis.RedisError, RedisClusterException) as exc:
                log.warning("could not sweep request stream %r: %s", raw_key, exc)
        return handled
    finally:
        # Delete the lock only if it is still ours: a sweep slower than the
        # lock's expiry must not release a lock another sweeper now holds.
        r.eval(_RELEASE, 1, keys.lock("orphan-sweep"), token)


def _request_streams(r: redis.Redis, pattern: str) -> Iterator[bytes]:
    """The names of the request streams of every model, served or not, on every master."""
    if not is_cluster(r):
        yield from r.scan_iter(match=pattern, count=1000, _type="stream")
        return
    for node in r.get_primaries():  # type: ignore[attr-defined]
        try:
            found = list(r.scan_iter(match=pattern, count=1000, _type="stream", target_nodes=node))
        except (redis.RedisError, RedisClusterException) as exc:
            log.warning("could not scan %s for request streams: %s", node.name, exc)
            continue
        yield from found


def _answer(r: redis.Redis, settings: Settings, key: bytes, model: str, message: str, batch: int,
            cutoff_ms: int) -> int:
    """Answer (and delete) up to ``batch`` requests of one unknown model's stream older than ``cutoff_ms``."""
    entries = r.xrange(key, max=f"{cutoff_ms}-18446744073709551615", count=batch)
    if not entries:
        return 0
    pairs = []
    for sid, fields in entries:
        rid = protocol.entry_request_id(fields)
        reply_to = protocol.answerable_reply_to(fields, settings.prefix)
        if reply_to is not None:
            pairs.append((reply_to, protocol.error_reply(rid, message)))
        else:
            log.warning("dropped request %r for unknown model %r that cannot be answered", rid, model)
    with r.pipeline(transaction=True) as pipe:
        delivery = replies.queue(r, pipe, pairs, ttl_s=settings.reply_ttl_s)
        pipe.xdel(key, *(sid for sid, _ in entries))
        replies.execute(pipe, f"unknown model {model!r}", delivery)
    return len(entries)
