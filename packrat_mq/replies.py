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

A ``guard`` key makes the delivery conditional: while it exists the script
writes nothing and returns -2. A worker passes its fence
(:meth:`packrat_mq.keys.Keys.fence`), so a transaction whose every write is
guarded by the fence needs no WATCH: inside EXEC every script sees the same
fence, and a fenced instance's transaction writes nothing at all.

Names inside the deployment's own namespace are refused earlier, by
:func:`packrat_mq.protocol.reply_to_problem`, before anything is written.

On Redis Cluster a reply stream is a key of its own slot, and a transaction
cannot span two slots. There :func:`queue` writes the replies at once (the
same script, with the reply stream as its only key), before the caller's
transaction that acknowledges their requests, and queues the counters in
that transaction instead. A process (or a Redis master) that fails between
the two leaves the requests unacknowledged, and they are answered again: at
least once, never none; a producer keeps the first reply to an id (see
docs/decisions.md, "Redis Cluster").
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.exceptions import AskError, ClusterError, TryAgainError

from packrat_mq.connection import is_cluster

log = logging.getLogger("packrat_mq.replies")

# KEYS[1] reply stream, KEYS[2] (optional) stats hash, KEYS[3] (optional, with KEYS[2]) guard.
# ARGV: ttl_s, n_errors, then per reply: field count, f1, v1, f2, v2, ...
_DELIVER = """
local key = KEYS[1]
if KEYS[3] and redis.call('EXISTS', KEYS[3]) == 1 then return -2 end
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

@dataclass
class Delivery:
    """The replies that go with one transaction, by ``reply_to``, and what writing them gave."""

    grouped: dict[str, list[Mapping[str, Any]]]
    #: Per reply stream, in the order of ``grouped``: the number written, -1 when
    #: ``reply_to`` is a key of another type, -2 when the guard was set (nothing
    #: written), or the error of the script.
    results: list[Any] = field(default_factory=list)
    #: True: queued in the transaction (one Redis); False: written before it (Redis Cluster).
    in_transaction: bool = True

    def undelivered(self) -> Iterator[tuple[str, list[Mapping[str, Any]]]]:
        """The reply streams that were keys of another type, with the replies not written there."""
        for (reply_to, group), res in zip(self.grouped.items(), self.results):
            if res == -1:
                yield reply_to, group


def _eval(pipe: Any, keys: list[str], args: list[Any]) -> None:
    # EVAL, not EVALSHA: the server caches the compiled script by its hash, and a
    # pipeline holding scripts would add a SCRIPT EXISTS round trip. As a plain
    # command: a cluster pipeline has no eval() (it routes EVAL by its keys all the same).
    pipe.execute_command("EVAL", _DELIVER, len(keys), *keys, *args)


def _args(group: list[Mapping[str, Any]], ttl_s: int) -> list[Any]:
    args: list[Any] = [ttl_s, sum(f.get("status") == "error" for f in group)]
    for fields in group:
        args.append(2 * len(fields))
        for name, value in fields.items():
            args.extend((name, value))
    return args


def queue(
    r: Any,
    pipe: Any,
    pairs: Iterable[tuple[str, Mapping[str, Any]]],
    *,
    ttl_s: int,
    stats_key: str | None = None,
    guard: str | None = None,
) -> Delivery:
    """Deliver ``(reply_to, fields)`` pairs with the transaction ``pipe`` (a pipeline of ``r``).

    One Redis: one script call per reply stream, queued in the transaction,
    first; :func:`execute` fills in their results. Each writes nothing (-2)
    if ``guard`` exists when it runs (see the module text; a guard needs
    ``stats_key``). Redis Cluster: written now through ``r`` (see the module
    text), the counters queued on ``pipe``; a Redis error that leaves replies
    unwritten (a node unreachable, a slot moving) is raised, so nothing is
    acknowledged without its reply. There the guard, in the transaction's
    slot and not the reply streams', is the caller's to check first.
    """
    if guard is not None and stats_key is None:
        raise ValueError("a guarded delivery needs its stats key")
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for reply_to, fields in pairs:
        grouped.setdefault(reply_to, []).append(fields)
    if not is_cluster(pipe):
        for reply_to, group in grouped.items():
            keys = [reply_to] if stats_key is None else [reply_to, stats_key]
            if guard is not None:
                keys.append(guard)
            _eval(pipe, keys, _args(group, ttl_s))
        return Delivery(grouped)
    delivery = Delivery(grouped, _write_now(r, grouped, ttl_s), in_transaction=False)
    if stats_key is not None:
        written = undeliverable = errors = 0
        for group, res in zip(grouped.values(), delivery.results):
            if res == -1:
                undeliverable += len(group)
            elif isinstance(res, int):
                written += res
                errors += sum(f.get("status") == "error" for f in group)
        for counter, n in (("replies", written), ("undeliverable", undeliverable), ("errors", errors)):
            if n:
                pipe.hincrby(stats_key, counter, n)
    return delivery


def _write_now(r: Any, grouped: dict[str, list[Mapping[str, Any]]], ttl_s: int) -> list[Any]:
    """Write each reply stream's replies (its script call alone in its slot); the scripts' results."""
    if not grouped:
        return []
    pipe = r.pipeline(transaction=False)  # split by node; one round trip to each
    for reply_to, group in grouped.items():
        _eval(pipe, [reply_to], _args(group, ttl_s))
    results = pipe.execute(raise_on_error=False)
    for res in results:
        if isinstance(res, Exception) and _unwritten(res):
            raise res
    return results


def _unwritten(exc: Exception) -> bool:
    """Whether ``exc`` may have left replies unwritten for a reason a retry outlives (not a script error)."""
    if isinstance(exc, (ClusterError, AskError, TryAgainError)):  # CLUSTERDOWN, MOVED, ASK, TRYAGAIN
        return True
    return not isinstance(exc, redis.ResponseError)


def execute(pipe: Any, who: str, delivery: Delivery | None = None) -> list[Any]:
    """EXEC a transaction that delivers replies; a failed command is logged, never raised.

    EXEC applies every queued command even when one fails, so the acks and
    the other replies of the transaction take effect and the process lives.
    A reply stream of the wrong type shows as -1 from the delivery script.
    ``delivery`` (from :func:`queue`) gets its scripts' results when they ran in
    the transaction (queued first, they come first).
    """
    results = pipe.execute(raise_on_error=False)
    for res in results:
        if isinstance(res, redis.ResponseError):
            log.warning("%s: a command of the reply transaction failed: %s", who, res)
    if delivery is not None and delivery.in_transaction:
        delivery.results = results[: len(delivery.grouped)]
    if delivery is not None and not delivery.in_transaction:
        for res in delivery.results:
            if isinstance(res, redis.ResponseError):
                log.warning("%s: a reply script failed: %s", who, res)
    return results
