"""A blocking stream read that returns at its deadline, not at the server's next tick.

Redis wakes a reader blocked in ``XREADGROUP ... BLOCK ms`` as soon as an
entry arrives, but at its timeout only on a cron tick: with ``hz 10`` a
``BLOCK 5`` returned after 90-101 ms and a ``BLOCK 50`` after 101 ms
(redis-server 6.2.14, measured here). The batch aggregator used to poll
without blocking instead, every 0.2 ms, for the last 200 ms before a
deadline; that took 31-37% of a core (the dispatcher and Redis together)
for as long as a partial batch waited, on a machine whose cores the
instances are meant to own.

This reader blocks on a connection of its own and keeps the deadline on the
client: when nothing has come by then, it ends the read itself with
``CLIENT UNBLOCK <id>`` sent on the main connection (the blocked read then
returns as timed out). Either way exactly one reply is read from the
connection, so an entry that arrives just as the deadline passes is
returned, never lost: an ``UNBLOCK`` that finds the reader no longer blocked
does nothing. The server's own timeout (the same ``BLOCK ms``) stays as the
backstop; if the connection was re-established under a new client id, the
backstop is what ends the read, and the id is read again.

On Redis Cluster the read and its ``UNBLOCK`` go to the master that owns
the stream's slot (``key``), through that node's own client: a cluster
client has no one connection pool, and ``CLIENT UNBLOCK`` only reaches a
client of the same server. A read refused or lost there (a failover moved
the slot, the node went away) drops the connection and asks the cluster
client to map the slots again, so the next read goes to the new master.

Where the server does not take ``CLIENT ID`` / ``CLIENT UNBLOCK`` (Redis
before 5, some proxies), :attr:`precise` is False and callers keep polling.
"""
from __future__ import annotations

import logging
from typing import Any

import redis
from redis.exceptions import AskError  # and MovedError, its subclass

from packrat_mq.connection import is_cluster

log = logging.getLogger("packrat_mq.dispatcher.waiting")


class DeadlineRead:
    """``XREADGROUP GROUP g c COUNT n BLOCK ms STREAMS s >`` that returns within ``ms``."""

    def __init__(self, r: redis.Redis, key: str | None = None) -> None:
        self.r = r
        #: The stream read: on Redis Cluster it names the master to block on (the owner of its slot).
        self.key = key
        self._cluster = is_cluster(r)
        if self._cluster and key is None:
            raise ValueError("a deadline read on Redis Cluster needs the stream's key")
        #: The client of the server the read blocks on: ``r`` itself, or on a cluster the slot owner's.
        self._node: Any = None
        self._conn: Any = None
        self._client_id: int | None = None
        #: Whether reads return at their deadline (False until :meth:`probe` says so: the server's tick
        #: decides, and callers poll).
        self.precise = False

    def probe(self) -> bool:
        """Whether the server takes what this needs (sets :attr:`precise`); raises if Redis cannot be reached."""
        try:
            self._connect()
            # Not blocked, so this unblocks nothing (0): it only asks whether the command exists.
            self._node.execute_command("CLIENT", "UNBLOCK", self._client_id)
            self.precise = hasattr(self._conn, "can_read")  # _connect already used send_command
        except (redis.ResponseError, AttributeError, NotImplementedError) as exc:
            log.warning("blocking reads end on the server's tick (%s): partial batches are polled every "
                        "PACKRAT_BATCH_POLL_MS, which takes CPU from the instances", exc)
            self.close()
            self.precise = False
        return self.precise

    def _server(self) -> Any:
        """The plain client of the server to block on (on a cluster, the stream's master as mapped now)."""
        if not self._cluster:
            return self.r
        return self.r.get_node_from_key(self.key).redis_connection

    def _connect(self) -> None:
        if self._conn is None:
            self._node = self._server()
            self._conn = self._node.connection_pool.make_connection()
            self._client_id = None
        if self._client_id is None:
            self._conn.send_command("CLIENT", "ID")
            self._client_id = int(self._conn.read_response())

    def read(self, group: str, consumer: str, stream: str, count: int, block_ms: int) -> Any:
        """The parsed ``XREADGROUP`` reply (as ``redis.Redis.xreadgroup`` gives it), or None at the deadline."""
        if not self.precise:
            return self.r.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms)
        if self._cluster and stream != self.key:
            raise ValueError(f"this deadline read blocks on {self.key!r}'s master, not {stream!r}'s")
        try:
            self._connect()
            conn = self._conn
            conn.send_command("XREADGROUP", "GROUP", group, consumer, "COUNT", count, "BLOCK", block_ms,
                              "STREAMS", stream, ">")
            if not conn.can_read(timeout=block_ms / 1000.0):
                if not self._node.execute_command("CLIENT", "UNBLOCK", self._client_id):
                    # Not blocked: either the reply is on its way, or the id is stale (a reconnect);
                    # the server's timeout ends the read then. Read the id again next time.
                    self._client_id = None
            raw = conn.read_response()
        except BaseException as exc:
            self.close()  # a read half done leaves the connection's state unknown
            if self._cluster and (isinstance(exc, (AskError, redis.ConnectionError, redis.TimeoutError))
                                  or (isinstance(exc, redis.ResponseError) and str(exc).startswith("UNBLOCKED"))):
                # MOVED (a failover gave the slot to another master) or the master gone: map the slots
                # again so the next read finds the stream's master; the caller's loop retries.
                self._remap()
            raise
        callback = self._node.response_callbacks.get("XREADGROUP")
        return callback(raw) if callback is not None and raw is not None else raw

    def _remap(self) -> None:
        try:
            self.r.nodes_manager.initialize()
        except redis.RedisError as exc:  # the cluster is failing over: the caller's next command maps again
            log.debug("could not map the cluster's slots again: %s", exc)

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.disconnect()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass
        self._conn, self._client_id, self._node = None, None, None
