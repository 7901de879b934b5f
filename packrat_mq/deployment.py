"""What is being served now: the deployment document the pools write to Redis.

Each node's supervisor owns its node's part (a field of the hash
``<prefix>:deployment:<model>``, node -> JSON). The document the dispatcher
reads every loop, ``<prefix>:config:<model>``, is the merge of every part:
all nodes' instances, and each node's generation in ``nodes``. A supervisor
writes its part and the merge in one WATCH/MULTI transaction
(:func:`publish_part`), so two nodes' pools never overwrite each other's
instances. A new document (a node's later generation) is how a
reconfiguration reaches the dispatcher without a restart. With one node the
merge is that node's part as it was (same ``generation`` and ``node``), plus
``nodes``.
"""
from __future__ import annotations

import time

import redis
from pydantic import BaseModel, Field, field_validator

from packrat_mq.instances import Configuration, InstanceSpec
from packrat_mq.keys import Keys


class InstanceRecord(BaseModel):
    """One instance: its queue id, share of the batch and pinned CPUs."""

    id: str
    threads: int = Field(ge=1)
    batch: int = Field(ge=1)
    cpus: list[int] = Field(default_factory=list)
    socket: int = 0
    node: str = ""


class Deployment(BaseModel):
    """The configuration of one model as served, with instance ids and cores."""

    model: str
    handler: str
    generation: int = 1
    node: str = ""
    #: The graph backend its instances serve with (``packrat_mq.graph``); None in eager mode.
    graph_mode: str | None = None
    created: float = Field(default_factory=time.time)
    predicted_latency_ms: float | None = None
    #: Whether the dispatcher's estimator chooses B from the load (see ``dispatcher.estimation``).
    adaptive: bool = False
    instances: list[InstanceRecord]
    #: In the merged document: each node's generation (empty in a node's part, and in a
    #: document written by hand or by an older version: then ``generation`` is the only one).
    nodes: dict[str, int] = Field(default_factory=dict)
    #: The thread budget T its node plans with (a node's part); in the merge, node -> T.
    threads_budget: int | None = None
    budgets: dict[str, int] = Field(default_factory=dict)

    @field_validator("graph_mode", mode="before")
    @classmethod
    def _legacy_graph_mode(cls, v: object) -> object:
        # Documents written while graph mode was a boolean: true was TorchScript.
        if isinstance(v, bool):
            return "torchscript" if v else None
        return None if v == "eager" else v

    @property
    def batch(self) -> int:
        return sum(i.batch for i in self.instances)

    @property
    def configuration(self) -> Configuration:
        return Configuration(
            instances=tuple(InstanceSpec(threads=i.threads, batch=i.batch) for i in self.instances),
            predicted_latency_ms=self.predicted_latency_ms,
        )

    def generation_of(self, node: str) -> int:
        """The generation ``node``'s instances are at in this document."""
        return self.nodes.get(node, self.generation)


def merge(parts: dict[str, Deployment]) -> Deployment | None:
    """The document of every node's part (None when there is none), nodes in name order."""
    if not parts:
        return None
    names = sorted(parts)
    first = parts[names[0]]
    if len(names) == 1:
        return first.model_copy(update={"nodes": {names[0]: first.generation},
                                        "budgets": _budgets(parts)})
    latencies = [p.predicted_latency_ms for p in parts.values() if p.predicted_latency_ms is not None]
    return Deployment(
        model=first.model, handler=first.handler,
        generation=max(p.generation for p in parts.values()),
        node=",".join(names), graph_mode=first.graph_mode,
        created=max(p.created for p in parts.values()),
        predicted_latency_ms=max(latencies) if latencies else None,
        # An estimator request reaches every node; a pinned node ignores it.
        adaptive=any(p.adaptive for p in parts.values()),
        instances=[i for n in names for i in parts[n].instances],
        nodes={n: parts[n].generation for n in names},
        budgets=_budgets(parts),
    )


def _budgets(parts: dict[str, Deployment]) -> dict[str, int]:
    return {n: p.threads_budget for n, p in sorted(parts.items()) if p.threads_budget}


def node_share(batch: int, budgets: dict[str, int], node: str) -> int:
    """``node``'s part of a model's B, in proportion to the nodes' thread budgets (at least 1).

    Largest remainders, ties to the node name: every node computes the same
    split from the same document, so the shares add up to ``batch``.
    """
    if node not in budgets or len(budgets) < 2:
        return batch
    total = sum(budgets.values())
    exact = {n: batch * t / total for n, t in budgets.items()}
    shares = {n: int(v) for n, v in exact.items()}
    rest = batch - sum(shares.values())
    for n in sorted(exact, key=lambda n: (-(exact[n] - shares[n]), n))[:rest]:
        shares[n] += 1
    return max(1, shares[node])


def _parts(raw: dict[bytes, bytes]) -> dict[str, Deployment]:
    return {k.decode(): Deployment.model_validate_json(v) for k, v in raw.items()}


def _rewrite(r: redis.Redis, keys: Keys, model: str, node: str, part: Deployment | None) -> Deployment | None:
    """Set (or, with None, remove) ``node``'s part and rewrite the merge, atomically; returns the merge."""
    hash_key, config_key = keys.deployment(model), keys.config(model)
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(hash_key)
                parts = _parts(pipe.hgetall(hash_key))
                if part is None:
                    parts.pop(node, None)
                else:
                    parts[node] = part
                merged = merge(parts)
                pipe.multi()
                if part is None:
                    pipe.hdel(hash_key, node)
                else:
                    pipe.hset(hash_key, node, part.model_dump_json())
                if merged is None:
                    pipe.delete(config_key)
                else:
                    pipe.set(config_key, merged.model_dump_json())
                pipe.execute()
                return merged
            except redis.WatchError:
                continue  # another node wrote its part meanwhile: merge again


def publish_part(r: redis.Redis, keys: Keys, part: Deployment) -> Deployment:
    """Make ``part`` its node's share of the model's deployment; returns the merged document."""
    merged = _rewrite(r, keys, part.model, part.node, part)
    assert merged is not None
    return merged


def withdraw_part(r: redis.Redis, keys: Keys, model: str, node: str) -> Deployment | None:
    """Remove ``node``'s part (the merge without it; no document once no node is left)."""
    return _rewrite(r, keys, model, node, None)
