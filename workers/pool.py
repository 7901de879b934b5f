"""The pool supervisor: starts this node's worker instances and keeps them alive.

Each instance is a spawned process (never forked: a forked torch runtime
shares thread pools with its parent) started as ``python -m workers.worker``
with its thread variables set in its environment before it imports torch.
An instance that dies is started again on the same cores with the same
consumer name, so it picks up the sub-batch it was serving. Restarts back
off exponentially (at once, then 1 s, 2 s, ... up to 30 s) and the count
starts over once an instance has run for 30 s without dying.

The spec, which holds the Redis URL and so its password, goes to the child
on a pipe (stdin), never on its command line: ``/proc/<pid>/cmdline`` is
readable by every user of the machine.

Every Redis write of the supervisor may fail (Redis restarting): it is
logged and done again on the next check, never allowed to end supervision.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from packrat_mq.backoff import Backoff
from packrat_mq.deployment import Deployment, InstanceRecord
from packrat_mq.instances import Configuration
from packrat_mq.keys import WORKER_GROUP, check_model_name
from packrat_mq.settings import Settings
from packrat_mq.streams import ensure_group
from workers.allocation import CoreAssignment, allocate, thread_env
from packrat_mq.topology import Topology
from workers.worker import WorkerSpec

log = logging.getLogger("packrat_mq.pool")


@dataclass
class Instance:
    record: InstanceRecord
    spec: WorkerSpec
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    restart: Restarter = field(default_factory=lambda: Restarter())


def restart_backoff() -> Backoff:
    """The one restart policy: at once, then 1 s doubling to 30 s; forgotten after 30 s healthy."""
    return Backoff(base=1.0, factor=2.0, cap=30.0, healthy_s=30.0, first_immediate=True)


@dataclass
class Restarter:
    """When one supervised process (an instance, the dispatcher) is started again.

    The supervisor calls :meth:`due` on every check; it never sleeps: a
    restart is scheduled with the one restart policy and reported due once
    its time has come.
    """

    backoff: Backoff = field(default_factory=restart_backoff)
    #: When the dead process is started again (monotonic); 0.0 while it runs.
    next_start: float = 0.0

    def due(self, proc: subprocess.Popen[bytes] | None, *, name: str, r: redis.Redis, key: str) -> bool:
        """Whether ``proc`` is dead and should be started now (its hash ``key`` says ``restarting`` meanwhile)."""
        if proc is None:
            return False
        if proc.poll() is None:
            self.backoff.success()
            return False
        now = time.monotonic()
        if self.next_start == 0.0:
            delay = self.backoff.failure()
            self.next_start = now + delay
            log.warning("%s (pid %d) exited with code %s; restarting in %.0f s", name, proc.pid, proc.returncode, delay)
            mark(r, key, state="restarting")
        if now < self.next_start:
            return False
        self.next_start = 0.0
        return True


def mark(r: redis.Redis, key: str, *, state: str | None = None, restarts: int = 0) -> None:
    """Best-effort write of a supervised process's state or restart to its hash.

    Redis may be down while the supervisor restarts something: the write is
    logged and dropped (the process rewrites its record when it heartbeats),
    never allowed to end supervision.
    """
    try:
        if state is not None:
            r.hset(key, "state", state)
        if restarts:
            r.hincrby(key, "restarts", restarts)
    except redis.RedisError as exc:
        log.warning("could not record %s in %s: %s", state or "a restart", key, exc)


def spawn(module: str, spec_json: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``python -m module`` with its spec on stdin (never in argv: it holds the Redis password)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module],
        env=env,
        stdin=subprocess.PIPE,
        start_new_session=True,  # Ctrl-C reaches the supervisor, which stops children in order
    )
    assert proc.stdin is not None
    try:
        proc.stdin.write(spec_json.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass  # it died at once; the supervisor sees the exit code
    return proc


class Pool:
    """Worker instances of one model on this node."""

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
        node: str | None = None,
        topology: Topology | None = None,
        generation: int = 1,
    ) -> None:
        self.r = r
        self.settings = settings
        self.keys = settings.keys
        self.url = url
        self.model = check_model_name(model)
        self.handler = handler or model
        self.configuration = configuration
        self.node = node or socket.gethostname().split(".")[0]
        self.generation = generation
        self.assignments: list[CoreAssignment] = allocate(topology or Topology.detect(), configuration)
        self.instances: list[Instance] = []
        for a in self.assignments:
            record = InstanceRecord(
                id=f"{self.node}-g{generation}-{a.instance}",
                threads=a.threads,
                batch=a.batch,
                cpus=list(a.cpus),
                socket=a.socket,
                node=self.node,
            )
            spec = WorkerSpec(
                url=url,
                settings=settings,
                model=model,
                handler=self.handler,
                instance_id=record.id,
                threads=a.threads,
                batch=a.batch,
                cpus=list(a.cpus),
                socket=a.socket,
                options=options or {},
                parent_pid=os.getpid(),
            )
            self.instances.append(Instance(record=record, spec=spec))

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

    # --- lifecycle --------------------------------------------------------
    def start(self, publish: bool = True) -> None:
        """Create the queues, spawn every instance and (by default) publish the deployment."""
        for inst in self.instances:
            ensure_group(self.r, self.keys.queue(self.model, inst.record.id), WORKER_GROUP)
            self._spawn(inst)
        if publish:
            self.publish()

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

    def _spawn(self, inst: Instance) -> None:
        env = dict(os.environ)
        env.update(thread_env(inst.record.threads))
        # Model loading must stay offline, and its progress bars are noise in a server's log.
        for name, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                            ("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("TRANSFORMERS_VERBOSITY", "error"),
                            ("TOKENIZERS_PARALLELISM", "false")):
            env.setdefault(name, value)
        inst.process = spawn("workers.worker", inst.spec.model_dump_json(), env)
        log.info("started %s (pid %d) on cpus %s", inst.record.id, inst.process.pid, inst.record.cpus)

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until every instance reports ``ready``; raise if one dies or time runs out."""
        deadline = time.monotonic() + timeout
        pending = {i.record.id: i for i in self.instances}
        while pending:
            for iid, inst in list(pending.items()):
                if inst.process is not None and inst.process.poll() is not None:
                    raise RuntimeError(
                        f"instance {iid} exited with code {inst.process.returncode} while starting; see its log above"
                    )
                if self.r.hget(self.keys.instance(self.model, iid), "state") == b"ready":
                    del pending[iid]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"instances not ready after {timeout:.0f} s: {', '.join(pending)}")
            if pending:
                time.sleep(0.05)

    def check(self) -> list[str]:
        """Restart instances that died; returns the ids restarted now. Never blocks.

        A crash loop backs off (see :func:`restart_backoff`) instead of spinning.
        """
        restarted = []
        for inst in self.instances:
            key = self.keys.instance(self.model, inst.record.id)
            if inst.restart.due(inst.process, name=f"instance {inst.record.id}", r=self.r, key=key):
                inst.restarts += 1
                self._spawn(inst)
                mark(self.r, key, restarts=1)
                restarted.append(inst.record.id)
        return restarted

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every instance (each finishes its batch), SIGKILL stragglers."""
        for inst in self.instances:
            if inst.process and inst.process.poll() is None:
                inst.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for inst in self.instances:
            if inst.process is None:
                continue
            try:
                inst.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("instance %s did not stop in time; killing it", inst.record.id)
                inst.process.kill()
                inst.process.wait()

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every instance queue is empty (after the dispatcher stopped)."""
        deadline = time.monotonic() + timeout
        queues = [self.keys.queue(self.model, i.record.id) for i in self.instances]
        while time.monotonic() < deadline:
            if all(self.r.xlen(q) == 0 for q in queues):
                return True
            if all(i.process is None or i.process.poll() is not None for i in self.instances):
                return False
            time.sleep(0.02)
        return False

    def retire(self) -> None:
        """Forget this pool's instances in Redis (after stop).

        A queue that still holds sub-batches is kept: its requests were taken
        from the request stream, and a pool started again with the same node
        and generation serves them.
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
        pipe.execute()
