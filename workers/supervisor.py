"""The supervisor: the one owner of a node's processes and cores for one model.

It allocates cores, starts the worker instances (and, unless the dispatcher
runs elsewhere, the dispatcher), publishes the deployment, restarts whatever
dies, and stops everything in the order that loses nothing. ``packrat-mq up``,
``packrat-mq pool``, the demo and calibration all run this one class, so there
is one restart policy and one place that knows which process owns which core.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from dispatcher.spec import DispatcherSpec
from packrat_mq.backoff import Backoff
from packrat_mq.deployment import Deployment, InstanceRecord
from packrat_mq.instances import Configuration
from packrat_mq.keys import WORKER_GROUP, check_model_name
from packrat_mq.records import DispatcherState, InstanceState, LiveRecord, SupervisorState
from packrat_mq.settings import Settings
from packrat_mq.streams import ensure_group
from packrat_mq.topology import Topology
from workers.allocation import CoreAssignment, allocate
from workers.launch import instance_env, spawn
from workers.worker import WorkerSpec

log = logging.getLogger("packrat_mq.supervisor")


def restart_policy() -> Backoff:
    """The one restart policy: at once, then 1 s doubling to 30 s; forgotten after 30 s healthy."""
    return Backoff(base=1.0, factor=2.0, cap=30.0, healthy_s=30.0, first_immediate=True)


@dataclass
class Child:
    """One supervised process (a worker instance or the dispatcher) and when to start it again."""

    name: str
    module: str
    spec_json: str
    #: Its live record in Redis, and that record's type.
    record_key: str
    record: type[LiveRecord]
    env: dict[str, str] | None = None
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    backoff: Backoff = field(default_factory=restart_policy)
    #: When the dead process is started again (monotonic); 0.0 while it runs.
    next_start: float = 0.0

    def start(self) -> None:
        self.process = spawn(self.module, self.spec_json, self.env)
        # Healthy means running: counted from the death instead, a crash
        # loop's 30 s wait at the cap would pass for 30 s healthy.
        self.backoff.retrying()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def restart_due(self, now: float) -> bool:
        """Whether the process is dead and its restart time has come; never blocks.

        The first check that finds it dead schedules the restart with
        :func:`restart_policy` (and says so in its record); a later check
        reports it due.
        """
        if self.process is None:
            return False
        if self.process.poll() is None:
            self.backoff.success()
            return False
        if self.next_start == 0.0:
            delay = self.backoff.failure()
            self.next_start = now + delay
            log.warning("%s (pid %d) exited with code %s; restarting in %.0f s",
                        self.name, self.process.pid, self.process.returncode, delay)
            return delay == 0.0
        if now < self.next_start:
            return False
        return True

    def terminate(self) -> None:
        if self.running():
            assert self.process is not None
            self.process.send_signal(signal.SIGTERM)

    def wait_or_kill(self, deadline: float) -> None:
        """Wait for the process to exit until ``deadline`` (monotonic), then SIGKILL it."""
        if self.process is None:
            return
        try:
            self.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in time; killing it", self.name)
            self.process.kill()
            self.process.wait()


@dataclass
class Instance:
    """A worker instance: where it runs (its record in the deployment) and its process."""

    record: InstanceRecord
    spec: WorkerSpec
    child: Child


class Supervisor:
    """The instances (and, by default, the dispatcher) of one model on this node."""

    def __init__(
        self,
        r: redis.Redis,
        settings: Settings,
        url: str,
        model: str,
        configuration: Configuration,
        *,
        handler: str | None = None,
        options: dict[str, Any] | None = None,
        profile: str | Path | None = None,
        node: str | None = None,
        topology: Topology | None = None,
        generation: int = 1,
        with_dispatcher: bool = True,
        exit_with_parent: bool = False,
    ) -> None:
        self.r = r
        self.settings = settings
        self.keys = settings.keys
        self.url = url
        self.model = check_model_name(model)
        self.handler = handler or model
        self.options = dict(options or {})
        self.profile = str(profile) if profile else None
        self.configuration = configuration
        self.node = node or socket.gethostname().split(".")[0]
        self.generation = generation
        #: False: the instances alone (docker-compose runs the dispatcher in its own container).
        self.with_dispatcher = with_dispatcher
        #: The parent to outlive by no more than a poll, when asked to.
        self.parent_pid = os.getppid() if exit_with_parent else None
        self.assignments: list[CoreAssignment] = allocate(topology or Topology.detect(), configuration)
        self.instances = [self._instance(a) for a in self.assignments]
        self.dispatcher = self._dispatcher() if with_dispatcher else None
        self.loop_errors = 0
        self._loop_backoff = Backoff(base=0.1, cap=5.0)
        self._started = time.time()

    def _instance(self, a: CoreAssignment) -> Instance:
        record = InstanceRecord(id=f"{self.node}-g{self.generation}-{a.instance}", threads=a.threads,
                                batch=a.batch, cpus=list(a.cpus), socket=a.socket, node=self.node)
        spec = WorkerSpec(url=self.url, settings=self.settings, model=self.model, handler=self.handler,
                          instance_id=record.id, threads=a.threads, batch=a.batch, cpus=list(a.cpus),
                          socket=a.socket, graph_mode=self.settings.graph_mode, options=self.options,
                          parent_pid=os.getpid())
        child = Child(name=f"instance {record.id}", module="workers.worker", spec_json=spec.model_dump_json(),
                      record_key=self.keys.instance(self.model, record.id), record=InstanceState,
                      env=instance_env(a.threads, self.settings))
        return Instance(record=record, spec=spec, child=child)

    def _dispatcher(self) -> Child:
        spec = DispatcherSpec(url=self.url, settings=self.settings, model=self.model, profile=self.profile,
                              parent_pid=os.getpid())
        return Child(name="dispatcher", module="dispatcher", spec_json=spec.model_dump_json(),
                     record_key=self.keys.dispatcher(self.model), record=DispatcherState)

    @property
    def children(self) -> list[Child]:
        """Every supervised process, instances first."""
        return [i.child for i in self.instances] + ([self.dispatcher] if self.dispatcher else [])

    @property
    def deployment(self) -> Deployment:
        return Deployment(
            model=self.model,
            handler=self.handler,
            generation=self.generation,
            node=self.node,
            graph_mode=self.settings.graph_mode,
            predicted_latency_ms=self.configuration.predicted_latency_ms,
            instances=[i.record for i in self.instances],
        )

    # --- starting -----------------------------------------------------
    def start(self, ready_timeout: float = 600.0, publish: bool = True) -> None:
        """Start the instances, publish the deployment, then the dispatcher; return once all are ready."""
        for inst in self.instances:
            ensure_group(self.r, self.keys.queue(self.model, inst.record.id), WORKER_GROUP)
            inst.child.start()
            assert inst.child.process is not None
            log.info("started %s (pid %d) on cpus %s", inst.child.name, inst.child.process.pid, inst.record.cpus)
        if publish:
            self.publish()
        self.wait_ready([i.child for i in self.instances], ready_timeout)
        if self.dispatcher is not None:
            self.dispatcher.start()
            self.wait_ready([self.dispatcher], ready_timeout)
        self._beat()

    def wait_ready(self, children: list[Child] | None = None, timeout: float = 300.0) -> None:
        """Block until each child's own record says ``ready``; raise if one dies or time runs out.

        The record must carry the child's pid: a ``ready`` left behind by an
        earlier process of the same name does not count.
        """
        deadline = time.monotonic() + timeout
        pending = list(self.children if children is None else children)
        while pending:
            for child in list(pending):
                assert child.process is not None
                # The record first: a child that said ready and died since has
                # started; restarting it is check()'s work, not a failed start.
                record = child.record.load(self.r, child.record_key)
                if record is not None and record.state == "ready" and record.pid == child.process.pid:
                    pending.remove(child)
                elif child.process.poll() is not None:
                    raise RuntimeError(f"{child.name} exited with code {child.process.returncode} "
                                       "while starting; see its log above")
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout:.0f} s: {', '.join(c.name for c in pending)}")
            if pending:
                time.sleep(0.02)

    def publish(self) -> None:
        """Make this deployment the one the dispatcher serves with."""
        self.r.set(self.keys.config(self.model), self.deployment.model_dump_json())
        self.r.sadd(self.keys.models(), self.model)

    def republish_if_lost(self) -> bool:
        """Publish again when Redis lost the deployment (a restart without persistence, a FLUSHALL)."""
        if self.r.exists(self.keys.config(self.model)):
            return False
        log.warning("the deployment of %s is gone from Redis (restarted or flushed); publishing it again", self.model)
        self.publish()
        return True

    def reshare(self, configuration: Configuration) -> None:
        """Serve a new batch split with the same instances, without restarting them.

        Only the shares ``b_j`` change (e.g. a new B chosen for a new load); the
        threads must match instance for instance. The new deployment is a new
        generation, which the dispatcher picks up before its next batch.
        """
        old = [i.record.threads for i in self.instances]
        new = [i.threads for i in configuration.instances]
        if old != new:
            raise ValueError(f"reshare keeps the instances: threads {old} != {new}")
        for inst, spec in zip(self.instances, configuration.instances):
            inst.record = inst.record.model_copy(update={"batch": spec.batch})
        self.configuration = configuration
        self.generation += 1
        self.publish()

    # --- supervising --------------------------------------------------
    def check(self) -> list[str]:
        """Restart whatever died, when its backoff allows; returns the names restarted now. Never blocks."""
        restarted = []
        now = time.monotonic()
        for child in self.children:
            if not child.restart_due(now):
                if child.next_start and not child.running():
                    self._record(child, state="restarting")
                continue
            child.next_start = 0.0
            child.restarts += 1
            child.start()
            self._record(child, restarted=True)
            restarted.append(child.name)
        # After a Redis restart without persistence the deployment is gone.
        self.republish_if_lost()
        self._beat()
        return restarted

    def _record(self, child: Child, *, state: str | None = None, restarted: bool = False) -> None:
        """Best-effort write to a child's record: Redis may be down while the supervisor restarts it.

        A lost write is harmless: the child rewrites its record when it beats.
        """
        interval = self.settings.heartbeat_s
        try:
            if state is not None:
                child.record.mark(self.r, child.record_key, state, interval=interval)
            if restarted:
                child.record.count(self.r, child.record_key, "restarts", interval=interval)
        except redis.RedisError as exc:
            log.warning("could not record %s of %s: %s", state or "a restart", child.name, exc)

    def _beat(self) -> None:
        """This supervisor's own record (renewed every check, so a SIGKILLed supervisor's expires)."""
        record = SupervisorState(
            state="ready", pid=os.getpid(), host=socket.gethostname(), interval=self.settings.heartbeat_s,
            heartbeat=time.time(), loop_errors=self.loop_errors, node=self.node, generation=self.generation,
            instances=[i.record.id for i in self.instances], with_dispatcher=self.with_dispatcher,
        )
        try:
            pipe = self.r.pipeline(transaction=False)
            record.save(pipe, self.keys.supervisor(self.model, self.node))
            pipe.sadd(self.keys.supervisors(self.model), self.node)
            pipe.execute()
        except redis.RedisError as exc:
            log.debug("supervisor heartbeat not written: %s", exc)

    def parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def serve_forever(self, poll_s: float = 0.5) -> None:
        """Supervise until SIGINT/SIGTERM (or the parent's death, if watched), then return.

        Any exception of one check (Redis restarting, a write refused) is
        logged and counted, and the next check comes after an exponential
        backoff; the loop itself never sleeps longer than its poll.
        """
        stopping = False

        def _stop(signum: int, frame: Any) -> None:
            nonlocal stopping
            stopping = True

        old_int = signal.signal(signal.SIGINT, _stop)
        old_term = signal.signal(signal.SIGTERM, _stop)
        try:
            while not stopping:
                if self.parent_gone():
                    log.warning("parent (pid %d) is gone; stopping", self.parent_pid)
                    break
                wait = poll_s
                try:
                    self.check()
                    self._loop_backoff.success()
                except Exception as exc:  # noqa: BLE001 - supervision must outlive any one failure
                    self.loop_errors += 1
                    wait = max(poll_s, self._loop_backoff.failure())
                    if isinstance(exc, redis.RedisError):
                        log.warning("supervisor: redis error (%s); checking again in %.1f s", exc, wait)
                    else:
                        log.exception("supervisor check failed; checking again in %.1f s", wait)
                end = time.monotonic() + wait
                while not stopping and time.monotonic() < end:
                    time.sleep(min(poll_s, 0.1))
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)

    # --- stopping -----------------------------------------------------
    def stop(self, timeout: float = 30.0) -> None:
        """Stop without losing a request; Redis may be down meanwhile.

        The dispatcher first (no new sub-batches), then the instances drain
        their queues, then they stop (SIGTERM: each finishes its batch;
        SIGKILL after ``timeout``). Requests still in the request stream stay
        there for the next start; a queue that still holds sub-batches is
        kept for the next start of the same node and generation.
        """
        if all(c.process is None for c in self.children):
            return  # nothing was started (a start that failed at once): nothing to stop or retire
        if self.dispatcher is not None:
            self.dispatcher.terminate()
            self.dispatcher.wait_or_kill(time.monotonic() + timeout)
        try:
            drained = self.drain(timeout)
        except redis.RedisError as exc:
            log.warning("cannot see the instance queues (%s); stopping the instances anyway", exc)
            drained = False
        if not drained:
            log.warning("instance queues not empty at shutdown; their work is kept in Redis")
        for inst in self.instances:
            inst.child.terminate()
        deadline = time.monotonic() + timeout
        for inst in self.instances:
            inst.child.wait_or_kill(deadline)
        try:
            self.retire()
        except redis.RedisError as exc:
            log.warning("could not remove this deployment's records from Redis: %s", exc)

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every instance queue is empty (after the dispatcher stopped)."""
        deadline = time.monotonic() + timeout
        queues = [self.keys.queue(self.model, i.record.id) for i in self.instances]
        while time.monotonic() < deadline:
            if all(self.r.xlen(q) == 0 for q in queues):
                return True
            if not any(i.child.running() for i in self.instances):
                return False
            time.sleep(0.02)
        return False

    def retire(self) -> None:
        """Forget this supervisor's processes in Redis (after they stopped).

        With its own dispatcher it also withdraws the deployment; without,
        the deployment stays, and a supervisor started again on the same node
        and generation takes it over.
        """
        pipe = self.r.pipeline()
        for inst in self.instances:
            queue = self.keys.queue(self.model, inst.record.id)
            pipe.delete(self.keys.instance(self.model, inst.record.id))
            pipe.srem(self.keys.instances(self.model), inst.record.id)
            if self.r.xlen(queue) == 0:
                pipe.delete(queue)
            else:
                log.warning("queue %s still holds work; kept for the next start", queue)
        pipe.delete(self.keys.supervisor(self.model, self.node))
        pipe.srem(self.keys.supervisors(self.model), self.node)
        if self.with_dispatcher:
            pipe.delete(self.keys.config(self.model))
        pipe.execute()

    def __enter__(self) -> Supervisor:
        try:
            self.start()
        except BaseException:
            # __exit__ does not run when __enter__ raises: stop what did start.
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
