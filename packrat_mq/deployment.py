"""What is being served now: the deployment document a pool writes to Redis.

The pool that starts the instances owns it (``<prefix>:config:<model>``);
the dispatcher reads it every loop, so a new document (a later generation)
is how a reconfiguration reaches the dispatcher without a restart.
"""
from __future__ import annotations

import time

from pydantic import BaseModel, Field

from packrat_mq.instances import Configuration, InstanceSpec


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
    graph_mode: bool = False
    created: float = Field(default_factory=time.time)
    predicted_latency_ms: float | None = None
    #: Whether the dispatcher's estimator chooses B from the load (see ``dispatcher.estimation``).
    adaptive: bool = False
    instances: list[InstanceRecord]

    @property
    def batch(self) -> int:
        return sum(i.batch for i in self.instances)

    @property
    def configuration(self) -> Configuration:
        return Configuration(
            instances=tuple(InstanceSpec(threads=i.threads, batch=i.batch) for i in self.instances),
            predicted_latency_ms=self.predicted_latency_ms,
        )
