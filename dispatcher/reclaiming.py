"""Handing a dead node's held work back: the requests its instances were given and never answered.

A request handed to an instance stays pending in the request stream for the
consumer ``instance:<id>`` until that instance answers it (see
:mod:`dispatcher.dispatcher`). When its node restarts, the same instance ids
serve it again. When the node is gone for good, the dispatcher takes the
requests back: an instance of a node named in the deployment whose own
record and whose node's supervisor record have both been not alive (expired
or stale) for ``node_grace_s`` is taken for dead, and

1. its fence (:meth:`packrat_mq.keys.Keys.fence`) is set: from then on that
   instance's reply transaction writes nothing (every write in it checks the
   fence: :mod:`workers.acks`), so an instance that was only slow cannot answer;
2. its pending requests are XCLAIMed back to the dispatcher's own consumer,
   which re-reads its pending entries first (the same path as after its own
   crash) and dispatches them to live instances;
3. its queue (sub-batches naming those requests) is deleted.

Because of 1, a request is answered at most once whatever the clocks and the
grace say; the grace only decides how long a silent node's requests wait.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import redis

from packrat_mq.deployment import Deployment
from packrat_mq.keys import DISPATCHER_GROUP, Keys, request_owner
from packrat_mq.records import LIVE_STATES, InstanceState, SupervisorState

log = logging.getLogger("packrat_mq.dispatcher")

#: Instance records that say a live process (its supervisor restarting it counts).
ALIVE = (*LIVE_STATES, "restarting")
#: Fence keys outlive any reasonable outage of a node; a new process of the instance deletes its own.
FENCE_TTL_S = 7 * 24 * 3600


def node_of(instance_id: str) -> str:
    """The node in an instance id (``<node>-g<generation>-<index>``)."""
    return instance_id.rpartition("-g")[0]


class Reclaimer:
    """Remembers since when each instance has looked dead, and takes back what the dead ones hold."""

    def __init__(self, r: redis.Redis, keys: Keys, model: str, consumer: str, grace_s: float) -> None:
        self.r = r
        self.keys = keys
        self.model = model
        self.consumer = consumer
        self.grace_s = grace_s
        self.stream = keys.requests(model)
        #: instance id -> when (monotonic) it was first seen not alive with its node's supervisor.
        self._dead_since: dict[str, float] = {}

    def held(self) -> dict[str, int]:
        """Instance id -> how many requests it holds, for every ``instance:`` consumer of the stream."""
        out: dict[str, int] = {}
        for c in self.r.xinfo_consumers(self.stream, DISPATCHER_GROUP):
            name = c["name"].decode() if isinstance(c["name"], bytes) else str(c["name"])
            if name.startswith("instance:") and int(c["pending"]) > 0:
                out[name.removeprefix("instance:")] = int(c["pending"])
        return out

    def check(self, deployment: Deployment | None) -> int:
        """Take back what dead instances of the deployment's nodes hold; returns how many requests."""
        if deployment is None or not deployment.nodes:
            return 0  # a document written by hand or by an older version: no node to judge
        candidates = {i.id: i.node or node_of(i.id) for i in deployment.instances}
        for inst_id in self.held():
            candidates.setdefault(inst_id, node_of(inst_id))  # e.g. a dead node's retiring instances
        candidates = {i: n for i, n in candidates.items() if n in deployment.nodes}
        dead = self._dead(candidates, time.time())
        now = time.monotonic()
        for inst_id in list(self._dead_since):
            if inst_id not in dead:
                del self._dead_since[inst_id]
        taken = 0
        for inst_id in dead:
            since = self._dead_since.setdefault(inst_id, now)
            if now - since >= self.grace_s:
                taken += self.take_back(inst_id)
        return taken

    def _dead(self, candidates: dict[str, str], now: float) -> set[str]:
        ids = list(candidates)
        nodes = sorted(set(candidates.values()))
        pipe = self.r.pipeline(transaction=False)
        for inst_id in ids:
            pipe.hmget(self.keys.instance(self.model, inst_id), *InstanceState.LIVENESS_FIELDS)
        for node in nodes:
            pipe.hmget(self.keys.supervisor(self.model, node), *SupervisorState.LIVENESS_FIELDS)
        raw = pipe.execute()
        node_alive = {n: InstanceState.liveness(v, now) in LIVE_STATES for n, v in zip(nodes, raw[len(ids):])}
        return {i for i, v in zip(ids, raw[: len(ids)])
                if not node_alive[candidates[i]] and InstanceState.liveness(v, now) not in ALIVE}

    def take_back(self, instance_id: str) -> int:
        """Fence ``instance_id``, claim its pending requests for the dispatcher, delete its queue."""
        owner = request_owner(instance_id)
        queue = self.keys.queue(self.model, instance_id)
        pending = self.r.xpending_range(self.stream, DISPATCHER_GROUP, min="-", max="+", count=1, consumername=owner)
        if not pending and not self.r.exists(queue):
            return 0
        # The fence first: from here on the instance's reply transaction writes nothing, so its pending list is ours.
        self.r.set(self.keys.fence(self.model, instance_id), "1", ex=FENCE_TTL_S)
        ids = list(self._pending_ids(owner))
        pipe = self.r.pipeline(transaction=True)
        for start in range(0, len(ids), 1000):
            pipe.xclaim(self.stream, DISPATCHER_GROUP, self.consumer, 0, ids[start : start + 1000], justid=True)
        pipe.delete(queue)
        pipe.execute()
        log.warning("model %s: instance %s and its node's supervisor have not beaten for %.0f s; "
                    "%d requests it held are dispatched again", self.model, instance_id, self.grace_s, len(ids))
        return len(ids)

    def _pending_ids(self, owner: str) -> Iterable[bytes]:
        start = "-"
        while True:
            batch = self.r.xpending_range(self.stream, DISPATCHER_GROUP, min=start, max="+", count=1000,
                                          consumername=owner)
            if not batch:
                return
            for item in batch:
                yield item["message_id"]
            last = batch[-1]["message_id"]
            start = "(" + (last.decode() if isinstance(last, bytes) else str(last))
