"""A node's pool of registered models: ``packrat-mq node --node NAME``.

Models are registered over the control stream (``packrat-mq models register``,
see :mod:`packrat_mq.control`), each naming the node that serves it. The
node pool keeps the registry (``<prefix>:registry:models``) and serves every
registered model that names its node: one :class:`~workers.supervisor.Supervisor`
per model (with its dispatcher), each on cores no other model of the node
holds, each taking its own ``reconfigure`` messages. A registration is
answered once the model's instances are ready; an unregistration once its
supervisor has stopped in order (dispatcher first, queues drained), so
nothing it held is lost. A pool started again serves what the registry says
is its node's.

The pool's one loop checks every supervisor in turn (restarts, control
messages, reconfiguration steps) and reads the node's own control group.
Starting a newly registered model blocks that loop until the model's
instances are ready (its load and warm-up); the other models' processes go
on serving meanwhile, only their restarts wait.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import time
from typing import Any

import redis
from pydantic import BaseModel, Field

from optimizer.planning.selection import choose, find_profile
from packrat_mq import control, graph
from packrat_mq.exposition import ModelView
from packrat_mq.handler import load_handler
from packrat_mq.instances import Configuration
from packrat_mq.keys import check_model_name, node_group
from packrat_mq.records import NodeState
from packrat_mq.settings import Settings
from packrat_mq.streams import ensure_group
from packrat_mq.topology import Topology
from workers.allocation import AllocationError
from workers.supervisor import Supervisor

log = logging.getLogger("packrat_mq.node")


class Registration(BaseModel):
    """A registered model, as the registry keeps it."""

    model: str
    handler: str
    node: str
    options: dict[str, Any] = Field(default_factory=dict)
    instances: str | None = None
    batch: int | None = None
    threads: int | None = None
    adaptive: bool = True
    registered: float = Field(default_factory=time.time)


class NodePool:
    """The supervisors of every registered model of one node."""

    def __init__(self, r: redis.Redis, settings: Settings, url: str, node: str | None = None, *,
                 topology: Topology | None = None, ready_timeout_s: float = 600.0) -> None:
        self.r = r
        self.settings = settings
        self.keys = settings.keys
        self.url = url
        self.node = check_model_name(node or socket.gethostname().split(".")[0])
        self.topology = topology or Topology.detect()
        self.ready_timeout_s = ready_timeout_s
        self.supervisors: dict[str, Supervisor] = {}
        self.group = node_group(self.node)
        self._stopping = False

    # --- registry ----------------------------------------------------------
    def registrations(self) -> list[Registration]:
        out = []
        for raw in self.r.hvals(self.keys.registry()):
            try:
                reg = Registration.model_validate_json(raw)
            except ValueError:
                continue
            if reg.node == self.node:
                out.append(reg)
        return sorted(out, key=lambda g: g.registered)

    def free_topology(self) -> Topology:
        """This node's cores less those its models hold (every instance, passive and retiring included;
        spares are idle and hold none)."""
        held = {c for sup in self.supervisors.values() for inst in sup.holding for c in inst.record.cpus}
        return self.topology.without(held)

    # --- serving a model ---------------------------------------------------------
    def serve(self, reg: Registration) -> Supervisor:
        """Start the supervisor of a registered model on free cores; returns once its instances are ready."""
        load_handler(reg.handler)  # an unknown model or import path fails here, before any process starts
        free = self.free_topology()
        budget = min(reg.threads or free.max_cores_per_socket, free.max_cores_per_socket)
        if budget < 1:
            raise AllocationError(f"node {self.node} has no free core for {reg.model}")
        mode = graph.resolve(self.settings.graph_mode, reg.handler)
        profile = find_profile(reg.model, mode=mode)
        # By hand, or the optimizer's plan for B (1 when adaptive) within the cores this model may use.
        config = (Configuration.parse(reg.instances) if reg.instances else
                  choose(reg.model, budget, reg.batch or 1, profile, mode=mode, handler=reg.handler).configuration)
        sup = Supervisor(self.r, self.settings, self.url, reg.model, config, handler=reg.handler,
                         options=reg.options, profile=profile, node=self.node, topology=free,
                         adaptive=reg.adaptive and not reg.instances, threads_budget=budget,
                         ready_timeout_s=self.ready_timeout_s)
        try:
            sup.start(ready_timeout=self.ready_timeout_s)
        except BaseException:
            sup.stop()  # what did start (instances that loaded) stops again: nothing stays behind
            raise
        self.supervisors[reg.model] = sup
        log.info("node %s serves %s: %s", self.node, reg.model, sup.configuration.compact())
        return sup

    def start(self) -> None:
        """Serve every model the registry gives this node (a failed one is logged and skipped)."""
        ensure_group(self.r, self.keys.control(), self.group, start="$")
        self._beat()
        for reg in self.registrations():
            try:
                self.serve(reg)
            except Exception as exc:  # noqa: BLE001 - one broken registration must not stop the others
                log.error("node %s cannot serve registered model %s: %s", self.node, reg.model, exc)
        self._beat()

    # --- control messages ---------------------------------------------------------
    def poll_control(self, block_ms: int | None = None) -> int:
        entries = control.read(self.r, self.keys, self.group, "pool", block_ms=block_ms)
        for entry_id, fields in entries:
            self._on_message(entry_id, fields)
        return len(entries)

    def _on_message(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            message = control.parse(entry_id, fields, self.settings.prefix)
        except control.ControlError as exc:
            control.refuse(self.r, self.keys, entry_id, exc, claimant=self.node, ttl_s=self.settings.reply_ttl_s,
                           who=f"node {self.node}")
            return
        if message.command == "register" and message.node == self.node:
            self._register(message)
        elif message.command == "unregister" and self._is_mine(message):
            self._unregister(message)

    def _is_mine(self, message: control.ControlMessage) -> bool:
        if message.node is not None:
            return message.node == self.node
        raw = self.r.hget(self.keys.registry(), message.model)
        return raw is not None and Registration.model_validate_json(raw).node == self.node

    def _register(self, message: control.ControlMessage) -> None:
        model = message.model
        try:
            if model in self.supervisors or self.r.hexists(self.keys.registry(), model):
                raise ValueError(f"{model!r} is registered already; unregister it first")
            reg = Registration(model=model, handler=message.handler or model, node=self.node,
                               options=message.options, instances=message.instances, batch=message.batch,
                               threads=message.threads,
                               adaptive=message.adaptive if message.adaptive is not None else message.batch is None
                               and message.instances is None)
            sup = self.serve(reg)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the producer reads why and nothing stays
            self._answer(message, error=f"cannot register {model}: {exc}")
            log.warning("registration of %s refused: %s", model, exc)
            return
        self.r.hset(self.keys.registry(), model, reg.model_dump_json())
        self._beat()
        self._answer(message, result={"model": model, "node": self.node, "handler": reg.handler,
                                      "configuration": sup.configuration.compact(), "batch": sup.configuration.batch,
                                      "adaptive": sup.adaptive,
                                      "instances": [i.record.model_dump() for i in sup.instances]})

    def _unregister(self, message: control.ControlMessage) -> None:
        model = message.model
        sup = self.supervisors.pop(model, None)
        if sup is not None:
            sup.stop()
        removed = self.r.hdel(self.keys.registry(), model)
        self._beat()
        if sup is None and not removed:
            self._answer(message, error=f"{model!r} is not registered on node {self.node}")
            return
        self._answer(message, result={"model": model, "node": self.node, "stopped": sup is not None})

    def _answer(self, message: control.ControlMessage, *, result: dict[str, Any] | None = None,
                error: str | None = None) -> None:
        control.answer(self.r, message, result=result, error=error, ttl_s=self.settings.reply_ttl_s,
                       who=f"node {self.node}")

    def metrics_views(self) -> list[ModelView]:
        """What this node's exporter shows: each served model's pool and dispatcher (see :mod:`packrat_mq.exposition`)."""
        return [sup.metrics_view() for sup in list(self.supervisors.values())]

    # --- the loop ------------------------------------------------------------
    def _beat(self) -> None:
        free = self.free_topology()
        record = NodeState(state="ready", pid=os.getpid(), host=socket.gethostname(),
                           interval=self.settings.heartbeat_s, heartbeat=time.time(), node=self.node,
                           models=sorted(self.supervisors), cores=self.topology.physical_cores,
                           free_cpus=sorted(c.cpu for c in free.cores))
        pipe = self.r.pipeline(transaction=False)
        record.save(pipe, self.keys.node(self.node))
        pipe.sadd(self.keys.nodes(), self.node)
        pipe.execute()

    def check(self) -> None:
        for sup in list(self.supervisors.values()):
            sup.check()
        self.poll_control()
        self._beat()

    def serve_forever(self, poll_s: float = 0.2) -> None:
        def _stop(signum: int, frame: Any) -> None:
            self._stopping = True

        old_int = signal.signal(signal.SIGINT, _stop)
        old_term = signal.signal(signal.SIGTERM, _stop)
        try:
            while not self._stopping:
                try:
                    self.check()
                    busy = any(s.change is not None for s in self.supervisors.values())
                    if busy:
                        time.sleep(0.02)
                    else:
                        self.poll_control(block_ms=int(poll_s * 1000))
                except Exception as exc:  # noqa: BLE001 - the pool outlives any one failure
                    log.warning("node %s: check failed (%s); again in 1 s", self.node, exc)
                    end = time.monotonic() + 1.0
                    while not self._stopping and time.monotonic() < end:
                        time.sleep(0.1)
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)

    def stop(self) -> None:
        """Stop every model in order (each supervisor drains); the registry stays for the next start."""
        for model, sup in list(self.supervisors.items()):
            try:
                sup.stop()
            except Exception as exc:  # noqa: BLE001 - stop the others all the same
                log.warning("stopping %s failed: %s", model, exc)
        self.supervisors.clear()
        try:
            self.r.delete(self.keys.node(self.node))
            self.r.srem(self.keys.nodes(), self.node)
        except redis.RedisError as exc:
            log.warning("could not remove node %s's record: %s", self.node, exc)

