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
"""
from __future__ import annotations

import logging
import uuid

import redis

from packrat_mq import protocol, replies
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
        head = keys.requests("").encode()
        handled = 0
        for raw_key in r.scan_iter(match=keys.requests("*"), count=1000, _type="stream"):
            model = raw_key[len(head):].decode("utf-8", "replace")
            if model in served:
                continue
            try:
                handled += _answer(r, settings, raw_key, model, served, batch, cutoff_ms)
            except redis.RedisError as exc:
                log.warning("could not sweep request stream %r: %s", raw_key, exc)
        return handled
    finally:
        # Delete the lock only if it is still ours: a sweep slower than the
        # lock's expiry must not release a lock another sweeper now holds.
        r.eval(_RELEASE, 1, keys.lock("orphan-sweep"), token)


def _answer(r: redis.Redis, settings: Settings, key: bytes, model: str, served: set[str], batch: int,
            cutoff_ms: int) -> int:
    """Answer (and delete) up to ``batch`` requests of one unknown model's stream older than ``cutoff_ms``."""
    entries = r.xrange(key, max=f"{cutoff_ms}-18446744073709551615", count=batch)
    if not entries:
        return 0
    known = ", ".join(sorted(served)) or "none"
    message = f"unknown model {model!r}; served models: {known}"
    pairs = []
    for sid, fields in entries:
        rid = protocol.entry_request_id(fields)
        reply_to = protocol.answerable_reply_to(fields, settings.prefix)
        if reply_to is not None:
            pairs.append((reply_to, protocol.error_reply(rid, message)))
        else:
            log.warning("dropped request %r for unknown model %r that cannot be answered", rid, model)
    pipe = r.pipeline(transaction=True)
    replies.queue(pipe, pairs, ttl_s=settings.reply_ttl_s)
    pipe.xdel(key, *(sid for sid, _ in entries))
    replies.execute(pipe, f"unknown model {model!r}")
    return len(entries)
