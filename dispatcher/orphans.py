"""Requests for models nobody serves get an error reply instead of waiting forever.

A producer may XADD to ``<prefix>:requests:<model>`` for any name. Every
dispatcher sweeps, about once a second, for request streams whose model is
not in the models index and answers each entry with "unknown model". A short
lock keeps two dispatchers from answering the same entry twice.
"""
from __future__ import annotations

import logging
import uuid

import redis

from packrat_mq import protocol
from packrat_mq.connection import execute_replies
from packrat_mq.settings import Settings

log = logging.getLogger("packrat_mq.orphans")

LOCK_MS = 5000
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


def sweep(r: redis.Redis, settings: Settings, *, batch: int = 500) -> int:
    """Answer requests sent to unknown models; returns how many were answered or dropped."""
    keys = settings.keys
    token = uuid.uuid4().hex
    if not r.set(keys.lock("orphan-sweep"), token, nx=True, px=LOCK_MS):
        return 0
    try:
        served = {m.decode() for m in r.smembers(keys.models())}
        pattern = keys.requests("*")
        handled = 0
        for raw_key in r.scan_iter(match=pattern, count=1000, _type="stream"):
            key = raw_key.decode()
            model = key[len(keys.requests("")):]
            if model in served:
                continue
            entries = r.xrange(key, count=batch)
            if not entries:
                continue
            known = ", ".join(sorted(served)) or "none"
            pipe = r.pipeline(transaction=True)
            for sid, fields in entries:
                rid = (fields.get(b"id") or b"").decode("utf-8", "replace")
                reply_to = (fields.get(b"reply_to") or b"").decode("utf-8", "replace")
                if reply_to:
                    pipe.xadd(reply_to, protocol.error_reply(rid, f"unknown model {model!r}; served models: {known}"))
                    pipe.expire(reply_to, settings.reply_ttl_s)
                else:
                    log.warning("dropped request %r for unknown model %r with no reply_to", rid, model)
            pipe.xdel(key, *(sid for sid, _ in entries))
            execute_replies(pipe, log, f"unknown model {model!r}")
            handled += len(entries)
        return handled
    finally:
        # Delete the lock only if it is still ours: a sweep slower than the
        # lock's expiry must not release a lock another sweeper now holds.
        r.eval(_RELEASE, 1, keys.lock("orphan-sweep"), token)
