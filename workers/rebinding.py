"""Rebinding: a loaded instance moved to other cores, threads or batch, in place.

Starting an instance is a process start, an import of torch, a model load
and a warm-up: seconds, and on a busy machine many of them (sixteen
instances took 5.7 s on two cores). An active-passive reconfiguration that
starts its new instances pays that while the backlog grows. A supervisor
therefore keeps *spare* instances: loaded processes that serve no one (the
instances a reconfiguration retired, or ones it pre-started), and makes a
change's new instances out of them by sending each an order on its own
queue stream, where only the supervisor and the dispatcher write:

- ``serve``: pin to these cores, size torch to this many threads, take this
  batch size (:func:`workers.runtime.rebind`), warm up, then say ``ready``
  with the new binding in the instance record;
- ``spare``: serve no one; say ``spare`` in the record (the process keeps
  its cores and threads until its next ``serve``; it blocks on its empty
  queue and costs no CPU).

The order goes through the queue, not a side channel, so it is taken at a
sub-batch boundary and after everything sent before it; a process that dies
while rebinding leaves the order pending, and its replacement, started with
the new binding already, takes it again (a no-op but for the warm-up).
"""
from __future__ import annotations

from typing import Literal

import redis
from redis.client import Pipeline
from pydantic import BaseModel, Field

#: The queue entry field that makes an entry an order instead of a sub-batch.
FIELD = b"rebind"


class Order(BaseModel):
    """What a spare instance is told to become."""

    role: Literal["serve", "spare"]
    threads: int = Field(default=1, ge=1)
    batch: int = Field(default=1, ge=1)
    cpus: list[int] = Field(default_factory=list)
    socket: int = 0
    pin: bool = True
    #: Instances leaving on the same cores: the first sub-batch waits until their queues are empty
    #: (:meth:`workers.worker.Worker.hand_over`).
    after: list[str] = Field(default_factory=list)


def send(r: redis.Redis | Pipeline, queue: str, order: Order) -> bytes | Pipeline:
    """Queue ``order`` on an instance's queue stream; returns its entry id (on a pipeline: the pipeline)."""
    return r.xadd(queue, {FIELD: order.model_dump_json()})


def is_order(fields: dict[bytes, bytes] | None) -> bool:
    return bool(fields) and FIELD in fields  # type: ignore[operator]


def parse(fields: dict[bytes, bytes]) -> Order:
    """The order of a queue entry (``ValueError`` if it is not one)."""
    return Order.model_validate_json(fields[FIELD])
