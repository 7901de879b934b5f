"""Delivering replies: the one way anything is written to a producer's ``reply_to``.

``reply_to`` is chosen by the producer, so it can name any key. Every reply
goes through one Lua script (queued inside the caller's MULTI/EXEC, so it
stays atomic with the acks) that makes writing to a hostile name harmless:

- a key of another type (a hash, a list) gets nothing: no XADD, no EXPIRE;
  the script counts the replies as ``undeliverable`` instead of ``replies``;
- a stream the service creates (the key did not exist) gets the reply TTL;
- an existing stream gets its TTL refreshed only if it already has one, and
  only ever extended: a persistent key never becomes volatile, so a reply can
  never schedule the deletion of a key the service did not create.

Names inside the deployment's own namespace are refused earlier, by
:func:`packrat_mq.protocol.reply_to_problem`, before anything is written.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import redis

log = logging.getLogger("packrat_mq.replies")

# KEYS[1] reply stream, KEYS[2] (optional) stats hash.
# ARGV: ttl_s, n_errors, then per reply: field count, f1, v1, f2, v2, ...
_DELIVER = """
local key = KEYS[1]
local kind = redis.call('TYPE', key)['ok']
local ttl = tonumber(ARGV[1])
local n_err = tonumber(ARGV[2])
local i = 3
local n = 0
local entries = {}
while i <= #ARGV do
  local count = tonumber(ARGV[i])
  entries[#entries + 1] = {i + 1, i + count}
  i = i + count + 1
end
n = #entries
if kind ~= 'none' and kind ~= 'stream' then
  if KEYS[2] then redis.call('HINCRBY', KEYS[2], 'undeliverable', n) end
  return -1
end
for _, span in ipairs(entries) do
  redis.call('XADD', key, '*', unpack(ARGV, span[1], span[2]))
end
if kind == 'none' then
  redis.call('EXPIRE', key, ttl)
else
  local left = redis.call('PTTL', key)
  if left > 0 and left < ttl * 1000 then
    redis.call('EXPIRE', key, ttl)
  end
end
if KEYS[2] then
  redis.call('HINCRBY', KEYS[2], 'replies', n)
  if n_err > 0 then redis.call('HINCRBY', KEYS[2], 'errors', n_err) end
end
return n
"""

def queue(
    pipe: redis.client.Pipeline,
    pairs: Iterable[tuple[str, Mapping[str, Any]]],
    *,
    ttl_s: int,
    stats_key: str | None = None,
) -> dict[str, list[Mapping[str, Any]]]:
    """Queue the delivery of ``(reply_to, fields)`` pairs on ``pipe``: one script call per stream.

    The scripts run inside the pipeline's transaction, queued in the order of
    the returned mapping (reply_to -> its replies); each script's result is
    the number written, or -1 when ``reply_to`` is a key of another type.
    """
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for reply_to, fields in pairs:
        grouped.setdefault(reply_to, []).append(fields)
    for reply_to, group in grouped.items():
        args: list[Any] = [ttl_s, sum(f.get("status") == "error" for f in group)]
        for fields in group:
            args.append(2 * len(fields))
            for name, value in fields.items():
                args.extend((name, value))
        keys = [reply_to] if stats_key is None else [reply_to, stats_key]
        # EVAL, not EVALSHA: the server caches the compiled script by its hash,
        # and a pipeline holding scripts would add a SCRIPT EXISTS round trip.
        pipe.eval(_DELIVER, len(keys), *keys, *args)
    return grouped


def execute(pipe: redis.client.Pipeline, who: str) -> list[Any]:
    """EXEC a transaction that delivers replies; a failed command is logged, never raised.

    EXEC applies every queued command even when one fails, so the acks and
    the other replies of the transaction take effect and the process lives.
    A reply stream of the wrong type shows as -1 from the delivery script.
    """
    results = pipe.execute(raise_on_error=False)
    for res in results:
        if isinstance(res, redis.ResponseError):
            log.warning("%s: a command of the reply transaction failed: %s", who, res)
    return results
