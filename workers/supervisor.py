"""The supervisor: the one owner of a node's processes and cores for one model.

It allocates cores, starts the worker instances (and, unless the dispatcher
runs elsewhere, the dispatcher), publishes the deployment, restarts whatever
dies, and stops everything in the order that loses nothing. ``packrat-mq up``,
``packrat-mq pool``, the demo and calibration all run this one class, so there
is one restart policy and one place that knows which process owns which core.

It is also what reconfigures the model: it reads the control stream
(:mod:`packrat_mq.control`: an operator's ``packrat-mq reconfigure``, or the
dispatcher's estimator asking for another B), plans the new configuration
with the optimizer and carries it out in phases (:mod:`workers.reconfiguration`),
one step per :meth:`Supervisor.check`, so supervision (restarts) goes on
during a reconfiguration and a request is never lost or answered twice.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import statistics
import subprocess
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis
from redis.client import Pipeline

from dispatcher.spec import DispatcherSpec
from optimizer.planning import drift
from optimizer.planning.profile import Profile
from optimizer.planning.selection import choose, find_profile, quick_profile_command
from packrat_mq import control, graph
from packrat_mq.backoff import Backoff
from packrat_mq.connection import check_cluster
from packrat_mq.deployment import Deployment, InstanceRecord, node_share, publish_part, withdraw_part
from packrat_mq.exposition import ModelView, read_stream
from packrat_mq.instances import Configuration, plan_change
from packrat_mq.keys import DISPATCHER_GROUP, WORKER_GROUP, check_model_name, control_group
from packrat_mq.metrics import SUPERVISOR_HISTOGRAMS, Tally, Totals
from packrat_mq.records import DispatcherState, InstanceState, LiveRecord, SupervisorState
from packrat_mq.settings import Settings
from packrat_mq.streams import ensure_group
from packrat_mq.topology import Topology, allowed_cpus
from workers.allocation import AllocationError, CoreAssignment, allocate
from workers.launch import instance_env, spawn
from workers import rebinding
from workers.reconfiguration import HISTORY, Reconfiguration
from workers.worker import WorkerSpec

log = logging.getLogger("packrat_mq.supervisor")

#: How often a supervisor holds what its instances serve against the profile (seconds).
PROFILE_CHECK_S = 10.0
#: How long a thread count's served / profiled ratio is kept once no instance of that count serves (seconds):
#: the estimator plans the other layouts with it, and a host's speed drifts within tens of minutes.
THREAD_RATIO_TTL_S = 600.0
#: How often a supervisor sweeps its host's payload files in shared memory for ones past ``shm_ttl_s``.
SHM_SWEEP_S = 60.0

#: Seconds after a reconfiguration ends during which the machine is not taken as it serves: no spare is
#: pre-started and no profile check is made. The change's over-subscribed seconds leave slow batches in
#: the instances' medians and a backlog to drain; an idle ResNet-50 on two cores read "served 9.3x the
#: profile" just after one, and a spare pre-started at once slowed the next seconds' batches again.
SETTLE_S = 10.0

#: The shortest window the machine's CPU use is averaged over before a spare is pre-started: over one
#: supervision tick (tens of milliseconds) an instance serving a third of the time reads idle most ticks.
PREWARM_CPU_WINDOW_S = 2.0


#: How many of the last spares loaded alone the published start time is the median of (``process_start_s``).
START_SAMPLES = 8

#: How often supervision checks while a reconfiguration is in progress (its phases are short).
CHANGE_POLL_S = 0.02


def restart_policy() -> Backoff:
    """The one restart policy: at once, then 1 s doubling to 30 s; forgotten after 30 s healthy."""
    return Backoff(base=1.0, factor=2.0, cap=30.0, healthy_s=30.0, first_immediate=True)


def _cgroup_memory(root: str = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """(limit, usage) in bytes of this process's cgroup v2, or None without a limit."""
    try:
        raw = Path(root, "memory.max").read_text().strip()
        if raw == "max":
            return None
        return int(raw), int(Path(root, "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


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
    #: False once it is being stopped for good (a reconfiguration retired it): never restarted.
    wanted: bool = True

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
        if self.process is None or not self.wanted:
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
        adaptive: bool = False,
        threads_budget: int | None = None,
        planner: Callable[[int], Configuration] | None = None,
        ready_timeout_s: float = 600.0,
    ) -> None:
        check_cluster(r, settings)
        self.r = r
        self.settings = settings
        self.keys = settings.keys
        self.url = url
        self.model = check_model_name(model)
        self.handler = handler or model
        #: The concrete mode its instances serve in: eager, or the backend PACKRAT_GRAPH_MODE names
        #: (``graph``: the handler's default backend).
        self.graph_mode = graph.resolve(settings.graph_mode, self.handler)
        self.options = dict(options or {})
        self.profile = str(profile) if profile else None
        self.configuration = configuration
        self.node = node or socket.gethostname().split(".")[0]
        self.generation = generation
        #: False: the instances alone (docker-compose runs the dispatcher in its own container).
        self.with_dispatcher = with_dispatcher
        #: The parent to outlive by no more than a poll, when asked to.
        self.parent_pid = os.getppid() if exit_with_parent else None
        self.topology = topology or Topology.detect()
        self.assignments: list[CoreAssignment] = allocate(self.topology, configuration)
        #: The instances the deployment names (the active ones).
        self.instances = [self._instance(a, generation) for a in self.assignments]
        #: Started by a reconfiguration, warming up, not yet served to.
        self.passive: list[Instance] = []
        #: Left out of the deployment by a reconfiguration: answering what they hold, then stopped
        #: (or kept as spares).
        self.retiring: list[Instance] = []
        #: Loaded instances serving no one, which a reconfiguration rebinds instead of starting
        #: processes (see :mod:`workers.rebinding`).
        self.spares: list[Instance] = []
        self._spare_seq = 0
        #: Spare id -> the pid whose record said ``spare`` (loaded): read from Redis once per process.
        self._loaded: dict[str, int] = {}
        #: Spare id -> (pid, monotonic start) of the spares pre-started one at a time, until loaded.
        self._spare_started: dict[str, tuple[int, float]] = {}
        #: Seconds each of the last ``START_SAMPLES`` of those took from start to loaded (:meth:`process_start_s`).
        self._start_times: deque[float] = deque(maxlen=START_SAMPLES)
        self._largest: int | None = None
        #: The (threads, batch) sizes a pre-started spare warms up at (:meth:`_spare_sizes`), planned once.
        self._warm_sizes: list[tuple[int, int]] | None = None
        #: When the current CPU-use window began (monotonic; None: no window yet).
        self._cpu_window_at: float | None = None
        #: Monotonic time before which the machine is settling after a change (see ``SETTLE_S``).
        self._unsettled_until = 0.0
        self.dispatcher = self._dispatcher() if with_dispatcher else None
        #: Whether the dispatcher's estimator chooses B (see ``dispatcher.estimation``).
        self.adaptive = adaptive
        #: T, the cores the optimizer may plan a new B with.
        self.threads_budget = threads_budget or self.topology.max_cores_per_socket
        self.planner = planner or self._plan
        self.ready_timeout_s = ready_timeout_s
        self.change: Reconfiguration | None = None
        #: The control message to carry out after the current change (a newer one supersedes it).
        self._next: control.ControlMessage | None = None
        self.control_group = control_group(self.model, self.node)
        self.loop_errors = 0
        self._loop_backoff = Backoff(base=0.1, cap=5.0)
        self._started = time.time()
        #: How often :meth:`serve_forever` checks (and so beats) when idle.
        self._poll_s = 0.0
        #: Its own counts for the metrics (restarts, reconfigurations), and the sum of what its
        #: processes publish in their records (see :meth:`metrics_view`).
        self.tally = Tally(SUPERVISOR_HISTOGRAMS)
        self.totals = Totals()
        #: The last comparison of what its instances serve with the profile (see :meth:`check_profile`).
        self.profile_check: drift.ProfileCheck | None = None
        #: Per instance thread count, (served / profiled, when measured): kept across changes, so that the
        #: estimator plans a layout not serving now by its own last measure (``drift.ProfileCheck.by_threads``).
        self.thread_ratios: dict[int, tuple[float, float]] = {}
        self._profile_checked_at = 0.0
        self._shm_swept_at = 0.0
        self._profile_warned = False
        self._loaded_profile: tuple[Path, Profile] | None = None

    def _instance(self, a: CoreAssignment, generation: int, after: list[str] | None = None) -> Instance:
        return self._new_instance(f"{self.node}-g{generation}-{a.instance}", a.threads, a.batch, list(a.cpus),
                                  a.socket, a.pin, after=after)

    def _new_instance(self, instance_id: str, threads: int, batch: int, cpus: list[int], socket: int, pin: bool,
                      *, spare: bool = False, warm_at: list[tuple[int, int]] | None = None,
                      after: list[str] | None = None) -> Instance:
        """An instance not yet started: its record in the deployment, its worker spec, its process."""
        record = InstanceRecord(id=instance_id, threads=threads, batch=batch, cpus=cpus, socket=socket,
                                node=self.node)
        spec = WorkerSpec(url=self.url, settings=self.settings, model=self.model, handler=self.handler,
                          instance_id=instance_id, threads=threads, batch=batch, cpus=cpus, socket=socket, pin=pin,
                          graph_mode=self.graph_mode, options=self.options, parent_pid=os.getpid(), spare=spare,
                          warm_at=warm_at or [], after=after or [])
        child = Child(name=f"instance {instance_id}", module="workers.worker", spec_json=spec.model_dump_json(),
                      record_key=self.keys.instance(self.model, instance_id), record=InstanceState,
                      env=instance_env(threads, self.settings))
        return Instance(record=record, spec=spec, child=child)

    def _dispatcher(self) -> Child:
        spec = DispatcherSpec(url=self.url, settings=self.settings, model=self.model, profile=self.profile,
                              parent_pid=os.getpid())
        return Child(name="dispatcher", module="dispatcher", spec_json=spec.model_dump_json(),
                     record_key=self.keys.dispatcher(self.model), record=DispatcherState)

    @property
    def holding(self) -> list[Instance]:
        """The instances that hold cores: active, passive and retiring (a spare holds none: it is idle)."""
        return self.instances + self.passive + self.retiring

    @property
    def all_instances(self) -> list[Instance]:
        """Active, passive, retiring and spare instances: every worker process this supervisor owns."""
        return self.instances + self.passive + self.retiring + self.spares

    @property
    def children(self) -> list[Child]:
        """Every supervised process, instances first."""
        return [i.child for i in self.all_instances] + ([self.dispatcher] if self.dispatcher else [])

    @property
    def deployment(self) -> Deployment:
        return Deployment(
            model=self.model,
            handler=self.handler,
            generation=self.generation,
            node=self.node,
            graph_mode=self.graph_mode,
            predicted_latency_ms=self.configuration.predicted_latency_ms,
            adaptive=self.adaptive,
            instances=[i.record for i in self.instances],
            threads_budget=self.threads_budget,
        )

    # --- starting -----------------------------------------------------
    def start(self, ready_timeout: float = 600.0, publish: bool = True) -> None:
        """Start the instances, publish the deployment, then the dispatcher; return once all are ready."""
        # Control messages sent from now on reach this supervisor (not those of before it started).
        ensure_group(self.r, self.keys.control(), self.control_group, start="$")
        for inst in self.instances:
            self._start_instance(inst)
        if publish:
            self.publish()
        self.wait_ready([i.child for i in self.instances], ready_timeout)
        if self.dispatcher is not None:
            self.dispatcher.start()
            self.wait_ready([self.dispatcher], ready_timeout)
        self._beat()

    def _start_instance(self, inst: Instance) -> None:
        ensure_group(self.r, self.keys.queue(self.model, inst.record.id), WORKER_GROUP)
        inst.child.start()
        assert inst.child.process is not None
        log.info("started %s (pid %d) on cpus %s", inst.child.name, inst.child.process.pid, inst.record.cpus)

    def _is_ready(self, child: Child) -> bool:
        """Whether the child's own record (with its own pid) says ``ready``."""
        assert child.process is not None
        record = child.record.load(self.r, child.record_key)
        return record is not None and record.state == "ready" and record.pid == child.process.pid

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
        """Make this node's instances its part of the deployment the dispatcher serves with.

        Only this node's part changes: the other nodes' instances stay in the
        document (see :func:`packrat_mq.deployment.publish_part`).
        """
        publish_part(self.r, self.keys, self.deployment)
        self.r.sadd(self.keys.models(), self.model)

    def republish_if_lost(self) -> bool:
        """Publish again when Redis lost the deployment (a restart without persistence, a FLUSHALL)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.exists(self.keys.config(self.model))
        pipe.hexists(self.keys.deployment(self.model), self.node)
        if all(pipe.execute()):
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

    # --- reconfiguring --------------------------------------------------
    def _plan(self, batch: int) -> Configuration:
        """The optimizer's configuration for B=``batch`` within the thread budget (as ``up`` plans)."""
        return choose(self.model, self.threads_budget, batch, self.profile, mode=self.graph_mode,
                      handler=self.handler).configuration

    def _share(self, batch: int) -> int:
        """This node's part of a model-wide B: in proportion to the thread budgets of the nodes serving it."""
        raw = self.r.get(self.keys.config(self.model))
        if not raw:
            return batch
        budgets = Deployment.model_validate_json(raw).budgets
        share = node_share(batch, budgets, self.node)
        if share != batch:
            log.info("model %s: B=%d over nodes %s; this node (%s) plans B=%d", self.model, batch,
                     budgets, self.node, share)
        return share

    def reconfigure(self, target: Configuration, *, reason: str = "operator", origin: str = "api",
                    adaptive: bool | None = None, message: control.ControlMessage | None = None,
                    decided: float | None = None) -> Reconfiguration | None:
        """Begin serving ``target``; :meth:`check` carries the change through (see :mod:`workers.reconfiguration`).

        Returns the change begun, or None when ``target`` is what is served
        already (only ``adaptive`` may change then). Raises ``RuntimeError``
        while another change is in progress, :class:`AllocationError` when the
        target does not fit the cores.
        """
        if self.change is not None:
            raise RuntimeError(f"a reconfiguration to {self.change.target} is in progress ({self.change.phase})")
        new_adaptive = self.adaptive if adaptive is None else adaptive
        current = [(i.record.threads, i.record.batch) for i in self.instances]
        if current == [(s.threads, s.batch) for s in target.instances] and new_adaptive == self.adaptive:
            return None
        plan = plan_change(current, target)
        kept = [self.instances[i] for i, _ in plan.kept]
        leaving = [self.instances[i] for i in plan.stop]
        used = {c for inst in kept for c in inst.record.cpus}
        leaving_cpus = {c for inst in leaving for c in inst.record.cpus}
        generation = self.generation + 1
        starting = Configuration(instances=plan.start) if plan.start else None
        oversubscribed = False
        assignments: list[CoreAssignment] = []
        if starting is not None:
            try:
                assignments = allocate(self.topology.without(used | leaving_cpus), starting)
            except AllocationError:
                # Not enough free cores: warm up on the cores of the instances being replaced.
                assignments = allocate(self.topology.without(used), starting)
                oversubscribed = bool({c for a in assignments for c in a.cpus} & leaving_cpus)
        self.change = Reconfiguration(
            source=self.configuration, target=target, kind=plan.kind, generation=generation,
            reason=message.reason if message else reason, origin=message.origin if message else origin,
            adaptive=new_adaptive, message=message,
            decided=(message.decided if message and message.decided else decided) or time.time(),
            oversubscribed=oversubscribed)
        self._kept = [(inst, batch) for inst, (_, batch) in zip(kept, plan.kept)]
        self._leaving = leaving
        self.passive = []
        # The serve orders in one round trip: on 64 simulated cores (two real ones, 12-07) the step's move to
        # B=32 sent 32, one by one, in 38-41 ms of the backlog's growth.
        orders = self.r.pipeline(transaction=False)
        try:
            for a in assignments:
                # Where it takes the cores of instances leaving, it waits for them to answer what they hold
                # before its first sub-batch (:meth:`workers.worker.Worker.hand_over`).
                after = ([inst.record.id for inst in leaving if set(inst.record.cpus) & set(a.cpus)]
                         if oversubscribed and self.settings.handover_timeout_s > 0 else [])
                spare = self._take_spare(a)
                if spare is not None:
                    self._bind(spare, a, after, orders)
                    self.change.reused += 1
                    self.passive.append(spare)
                else:
                    inst = self._instance(a, generation, after)
                    self._start_instance(inst)
                    self.passive.append(inst)
                if after:
                    self.change.handing_over.append(self.passive[-1].record.id)
        finally:
            orders.execute()  # what was bound is ordered, even where a process start then failed
        change = self.change
        log.info("reconfiguring %s: %s -> %s (%s, %s%s%s)", self.model, self.configuration.compact(),
                 target.compact(), plan.kind, change.reason,
                 f", {change.reused} of {len(self.passive)} new instances from spares" if change.reused else "",
                 ", over-subscribed while warming" if oversubscribed else "")
        self._advance()
        # The change begun, even when it ended within this call (a reshare with no live
        # dispatcher to wait for finishes at once and has already cleared ``self.change``).
        return change

    def _advance(self) -> None:
        """One step of the reconfiguration in progress, if any; never blocks."""
        change = self.change
        if change is None:
            return
        if change.phase == "warming":
            for inst in self.passive:
                if inst.child.restarts >= 2 and not inst.child.running():
                    self._fail(f"{inst.child.name} failed to start {inst.child.restarts + 1} times")
                    return
            if time.monotonic() - change.phase_since > self.ready_timeout_s:
                self._fail(f"new instances not ready after {self.ready_timeout_s:.0f} s")
                return
            if not all(inst.child.running() and self._bound(inst) for inst in self.passive):
                return
            self._switch()
            return
        if change.phase == "switching":
            if self._dispatcher_adopted(change.generation) or time.monotonic() - change.phase_since > 60.0:
                change.enter("draining")
            else:
                return
        if change.phase == "draining":
            if any(self.r.xlen(self.keys.queue(self.model, i.record.id)) for i in self.retiring):
                return
            kept = self._keep_as_spares(self.retiring)
            self.retiring = [i for i in self.retiring if i not in kept]
            for inst in self.retiring:
                inst.child.wanted = False
                inst.child.next_start = 0.0
                inst.child.terminate()
            change.enter("stopping")
        if change.phase == "stopping":
            waiting = [i for i in self.retiring if i.child.process is not None and i.child.process.poll() is None]
            if waiting and time.monotonic() - change.phase_since < 30.0:
                return
            for inst in waiting:
                inst.child.wait_or_kill(time.monotonic())
            self._forget(self.retiring)
            self.retiring = []
            change.enter("done")
            self._finish()

    def _switch(self) -> None:
        """Passive instances are ready: publish the new generation (the dispatcher adopts it at a batch boundary)."""
        change = self.change
        assert change is not None
        for inst, batch in self._kept:
            inst.record = inst.record.model_copy(update={"batch": batch})
        self.instances = [inst for inst, _ in self._kept] + self.passive
        self.retiring = self._leaving
        self.passive = []
        self.configuration = change.target
        self.generation = change.generation
        self.adaptive = change.adaptive
        self.publish()
        change.enter("switching")
        self._advance()

    # --- spares ---------------------------------------------------------
    def spare_cap(self) -> int:
        """How many spares to keep: the setting, or for an adaptive deployment the largest plan's instance count."""
        if self.settings.spare_instances is not None:
            return self.settings.spare_instances
        if not self.adaptive:
            return 0
        if self._largest is None:
            self._largest = self._largest_plan()
        return self._largest

    def _range_plans(self) -> list[Configuration]:
        """The plans of the adaptive range (every power of two B in it) that the profile can make."""
        s = self.settings
        plans, b = [], 1
        while b <= s.adaptive_max_batch:
            if b >= s.adaptive_min_batch:
                try:
                    plans.append(self.planner(self._share(b)))
                except Exception as exc:  # noqa: BLE001 - a B the profile cannot plan sizes no spare
                    log.debug("no plan for B=%d to size the spares by: %s", b, exc)
            b *= 2
        return plans

    def _largest_plan(self) -> int:
        """The most instances any plan of the adaptive range has."""
        return max((len(plan.instances) for plan in self._range_plans()), default=0)

    def _spare_sizes(self) -> list[tuple[int, int]]:
        """The (threads, batch) of every instance the adaptive range's plans have (what a spare is re-bound to).

        A pre-started spare warms up at each (``WorkerSpec.warm_at``), so that a change to one of these
        plans takes no warm-up while the old instances serve beside it.
        """
        if self._warm_sizes is None:
            self._warm_sizes = sorted({(i.threads, i.batch) for plan in self._range_plans() for i in plan.instances})
        return self._warm_sizes

    def _room_for_spare(self) -> bool:
        """Whether there is memory to spare: above ``spare_min_free_fraction`` available.

        Of the machine, and of this process's cgroup where it has a limit (a
        container sees the host's memory in ``/proc/meminfo``, not its own).
        """
        vm = psutil.virtual_memory()
        total, available = vm.total, vm.available
        limit = _cgroup_memory()
        if limit is not None:
            total, available = min(total, limit[0]), min(available, limit[0] - limit[1])
        return available > self.settings.spare_min_free_fraction * total

    def _take_spare(self, a: CoreAssignment) -> Instance | None:
        """A spare for ``a``: a live one already on its cpus and threads if any, else any live one."""
        live = [i for i in self.spares if i.child.running()]
        if not live:
            return None
        same = [i for i in live if i.record.threads == a.threads and i.record.cpus == list(a.cpus)]
        inst = (same or live)[0]
        self.spares.remove(inst)
        self._loaded.pop(inst.record.id, None)
        self._spare_started.pop(inst.record.id, None)  # taken before it loaded: its load is not timed alone
        return inst

    def _bind(self, inst: Instance, a: CoreAssignment, after: list[str] | None, orders: Pipeline) -> None:
        """Order a spare to serve as ``a`` (threads, batch, cpus), after the instances ``after`` have drained
        (a handover); a restart of it starts it so bound. The order is queued on ``orders``, which the
        caller executes."""
        spec = inst.spec.model_copy(update={"threads": a.threads, "batch": a.batch, "cpus": list(a.cpus),
                                            "socket": a.socket, "pin": a.pin, "spare": False,
                                            "after": list(after or [])})
        self._rebound(inst, spec)
        rebinding.send(orders, self.keys.queue(self.model, inst.record.id),
                       rebinding.Order(role="serve", threads=a.threads, batch=a.batch, cpus=list(a.cpus),
                                       socket=a.socket, pin=a.pin, after=list(after or [])))
        log.debug("rebinding spare %s to %d threads, batch %d, cpus %s", inst.record.id, a.threads, a.batch,
                  list(a.cpus))

    def _rebound(self, inst: Instance, spec: WorkerSpec) -> None:
        inst.spec = spec
        inst.record = inst.record.model_copy(update={"threads": spec.threads, "batch": spec.batch,
                                                     "cpus": list(spec.cpus), "socket": spec.socket})
        inst.child.spec_json = spec.model_dump_json()
        inst.child.env = instance_env(spec.threads, self.settings)

    def _bound(self, inst: Instance) -> bool:
        """Whether the instance's own record says ``ready`` with its pid and the binding it was given."""
        assert inst.child.process is not None
        rec = InstanceState.load(self.r, inst.child.record_key)
        return (rec is not None and rec.state == "ready" and rec.pid == inst.child.process.pid
                and rec.threads == inst.record.threads and rec.batch == inst.record.batch
                and rec.cpus == inst.record.cpus)

    def _keep_as_spares(self, leaving: list[Instance]) -> list[Instance]:
        """Of the drained instances leaving, those kept loaded as spares (the cap and the memory allowing)."""
        kept = []
        for inst in leaving:
            if len(self.spares) >= self.spare_cap() or not self._room_for_spare():
                break
            if not inst.child.running():
                continue  # died while draining: it is stopped with the rest; the next one may still be kept
            self._rebound(inst, inst.spec.model_copy(update={"spare": True}))
            rebinding.send(self.r, self.keys.queue(self.model, inst.record.id), rebinding.Order(role="spare"))
            self.spares.append(inst)
            kept.append(inst)
        if kept:
            log.info("kept %d retired instances loaded as spares (%d spares)", len(kept), len(self.spares))
        return kept

    def _prewarm(self) -> None:
        """Start one more spare if asked to pre-start them, none is starting and there is room; never blocks."""
        # Which spares have loaded: one read per spare process until it has (then cached).
        loading = [i for i in self.spares if not self._is_spare(i)]
        prewarm = self.settings.prewarm_spares
        if prewarm is None:
            prewarm = self.adaptive
        if not prewarm or self.change is not None or len(self.spares) >= self.spare_cap():
            return
        if loading or not self._room_for_spare():
            return  # one at a time: a start takes CPU from the instances serving
        # A simulated topology too: its cores are labels, but its processes, the dispatcher and Redis run on
        # this machine's real ones, and a worker process starting takes about a second of one of them. On 64
        # simulated cores (two real ones, 12-07) the step's move from B=1 to 32 took all 32 spares, the
        # supervisor loaded 32 more one after another through the step, and B=32 drained the step's backlog at
        # 25 requests/s beyond the arrivals instead of the 60 it has to spare.
        if time.monotonic() < self._unsettled_until:
            return  # right after a change: the instances have a backlog to drain first
        busy = self._cpu_busy()
        if busy is None or busy > self.settings.prewarm_max_cpu:
            return  # loading a model beside instances that serve slows them down: wait for a quiet moment
        cores = self.topology.cores
        pin = not self.topology.simulated
        cpus = [c.cpus[0] for c in cores if c.socket == cores[0].socket]
        self._spare_seq += 1
        inst = self._new_instance(f"{self.node}-spare-{self._spare_seq}", 1, 1, cpus, cores[0].socket, pin,
                                  spare=True, warm_at=self._spare_sizes())
        self._start_instance(inst)
        if inst.child.process is not None:
            self._spare_started[inst.record.id] = (inst.child.process.pid, time.monotonic())
        self.spares.append(inst)

    def _cpu_busy(self) -> float | None:
        """The machine's CPU use (0..1) over the window just ended; None while a window is still open.

        A window lasts at least ``PREWARM_CPU_WINDOW_S``; one left open longer than three windows (no
        spare was wanted meanwhile) is started again, so the figure is always recent.

        Pre-starting a spare loads a model (ResNet-50 traced in TorchScript: seconds of every core) beside
        the instances that serve. On the 2-core development machine a spare prewarmed right after a
        change, while a step of load was being served, slowed the serving instances several-fold.
        """
        now = time.monotonic()
        began = self._cpu_window_at
        if began is not None and now - began < PREWARM_CPU_WINDOW_S:
            return None
        busy = psutil.cpu_percent(interval=None) / 100.0  # since the previous call: the window's start
        self._cpu_window_at = now
        if began is None or now - began > 3 * PREWARM_CPU_WINDOW_S:
            return None
        return busy

    def settled(self) -> bool:
        """No change in progress or just ended, and no spare loading: the instances serve as they will."""
        if self.change is not None or time.monotonic() < self._unsettled_until:
            return False
        return all(self._is_spare(i) for i in self.spares)

    def _is_spare(self, inst: Instance) -> bool:
        """Whether a spare has loaded (its record says ``spare`` with its pid); one read per process."""
        if inst.child.process is None or not inst.child.running():
            return False
        pid = inst.child.process.pid
        if self._loaded.get(inst.record.id) == pid:
            return True
        rec = InstanceState.load(self.r, inst.child.record_key)
        if rec is not None and rec.state == "spare" and rec.pid == pid:
            self._loaded[inst.record.id] = pid
            started = self._spare_started.pop(inst.record.id, None)
            if started is not None and started[0] == pid:
                # As the process timed itself (its warm-up ahead at other sizes left out); else as seen here.
                self._start_times.append(rec.load_s if rec.load_s is not None else time.monotonic() - started[1])
            return True
        return False

    def process_start_s(self) -> float | None:
        """Seconds a worker process takes from its start to loaded, the median of the last spares
        pre-started (one at a time, on a machine under ``prewarm_max_cpu``); None before one has loaded.

        Published for the estimator, which prices a move by the processes it
        would start beyond the loaded spares (``PlannedCapacity.cold_start_s``):
        on 64 simulated cores (two real ones, 12-07) moves from B=32 down to 16
        that found 0-4 spares loaded started 12-15 processes and took 6.2-6.9 s
        to be ready, while the policy priced them at the last switch (0.2 s).
        A spare's load is the same work as a started instance's (the handler's
        ``initialize`` and the warm-up batch), and the only one timed alone; its
        warm-up ahead at the plans' other sizes is not. Each spare times itself
        from its process's creation to loaded (``load_s`` in its record): seen
        from here, at the check that reads its record, a time was up to a check
        interval long, and the warm-up ahead moved the 64-core figure from 0.52 s
        (loaded just before a check) to 0.92 s (just after one).
        """
        return statistics.median_high(self._start_times) if self._start_times else None

    @staticmethod
    def start_cpus() -> int:
        """How many CPUs this node's processes may run on (this process's affinity, which they inherit or
        are pinned within): processes started together load side by side on at most that many."""
        return max(1, len(allowed_cpus()))

    def spares_loaded(self) -> int:
        """How many spares are loaded (as last seen: no Redis read)."""
        return sum(1 for i in self.spares if i.child.process is not None
                   and self._loaded.get(i.record.id) == i.child.process.pid and i.child.running())

    def _dispatcher_adopted(self, generation: int) -> bool:
        """Whether the dispatcher serves ``generation`` (or none is alive to send anything at all)."""
        record = DispatcherState.load(self.r, self.keys.dispatcher(self.model))
        if record is None or record.effective_state(time.time()) not in ("ready", "starting"):
            return True
        served = record.generation_of(self.node)
        return served is not None and served >= generation

    def _fail(self, error: str) -> None:
        """Give a reconfiguration up while still warming: stop the passive instances, keep serving as before."""
        change = self.change
        assert change is not None
        change.error = error
        log.error("reconfiguration of %s to %s failed: %s", self.model, change.target.compact(), error)
        for inst in self.passive:
            inst.child.wanted = False
            inst.child.next_start = 0.0
            inst.child.terminate()
        deadline = time.monotonic() + 10.0
        for inst in self.passive:
            inst.child.wait_or_kill(deadline)
        self._forget(self.passive)
        self.passive = []
        change.enter("failed")
        self._finish()

    def _forget(self, instances: list[Instance]) -> None:
        """Remove the records and (empty) queues of instances that stopped."""
        self._absorb_quietly(instances)
        pipe = self.r.pipeline()
        for inst in instances:
            queue = self.keys.queue(self.model, inst.record.id)
            pipe.delete(self.keys.instance(self.model, inst.record.id))
            pipe.srem(self.keys.instances(self.model), inst.record.id)
            if self.r.xlen(queue) == 0:
                pipe.delete(queue)
        pipe.execute()

    def _finish(self) -> None:
        """Record the change in the model's history, answer whoever asked, and take up the next request."""
        change = self.change
        assert change is not None
        change.held_s = self._held_s(change.handing_over)
        for inst in self.instances:
            if inst.spec.after:
                # The instances it waited for are gone: a restart of it must not wait for an instance
                # that later takes one of their ids back (a spare serving again).
                inst.spec = inst.spec.model_copy(update={"after": []})
                inst.child.spec_json = inst.spec.model_dump_json()
        summary = change.summary()
        self.tally.count("reconfigurations", change.kind, summary["status"], change.origin)
        if summary["total_s"] is not None:
            self.tally.observe("reconfiguration", summary["total_s"])
        pipe = self.r.pipeline(transaction=False)
        pipe.lpush(self.keys.reconfigurations(self.model), json.dumps(summary))
        pipe.ltrim(self.keys.reconfigurations(self.model), 0, HISTORY - 1)
        pipe.execute()
        if change.error is None:
            log.info("reconfigured %s to %s (generation %d) in %.2f s", self.model, change.target.compact(),
                     change.generation, summary["total_s"] or 0.0)
        self.change = None
        self._unsettled_until = time.monotonic() + SETTLE_S
        if change.message is not None:
            self._reply(change.message, result=summary if change.error is None else None, error=change.error)
        self._beat()
        nxt, self._next = self._next, None
        if nxt is not None:
            self._carry_out(nxt)

    def _held_s(self, instance_ids: list[str]) -> float | None:
        """The longest a handover held a new instance's first sub-batch (their records), if any said."""
        held = []
        for instance_id in instance_ids:
            try:
                rec = InstanceState.load(self.r, self.keys.instance(self.model, instance_id))
            except redis.RedisError:
                continue
            if rec is not None and rec.held_s is not None:
                held.append(rec.held_s)
        return max(held) if held else None

    def _reply(self, message: control.ControlMessage, *, result: dict[str, Any] | None = None,
               error: str | None = None) -> None:
        control.answer(self.r, message, result=result, error=error, ttl_s=self.settings.reply_ttl_s,
                       who=f"supervisor of {self.model}")

    def poll_control(self, count: int = 10, block_ms: int | None = None) -> int:
        """Read the control stream and act on this model's messages; returns how many were read.

        Never blocks unless ``block_ms`` is given (the idle supervision loop waits there).
        """
        entries = control.read(self.r, self.keys, self.control_group, self.node, count=count, block_ms=block_ms)
        for entry_id, fields in entries:
            self._on_message(entry_id, fields)
        return len(entries)

    def _on_message(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            message = control.parse(entry_id, fields, self.settings.prefix)
        except control.ControlError as exc:
            control.refuse(self.r, self.keys, entry_id, exc, claimant=self.node, ttl_s=self.settings.reply_ttl_s,
                           who=f"supervisor of {self.model}")
            log.warning("control message %s refused: %s", entry_id.decode(), exc)
            return
        if message.model != self.model or message.command != "reconfigure":
            return  # another model's, or a node pool's (register, unregister)
        if message.origin == "estimator" and not self.adaptive:
            return  # a request made before the model was pinned
        if self.change is not None:
            if self._next is not None:
                self._reply(self._next, error=f"superseded by control message {message.id}")
            self._next = message
            return
        self._carry_out(message)

    def _carry_out(self, message: control.ControlMessage) -> None:
        """Plan the message's target and begin the change; an impossible one is answered with why."""
        try:
            if message.instances:
                target = Configuration.parse(message.instances)
            else:
                assert message.batch is not None
                target = self.planner(self._share(message.batch))
            # An operator's B or instances pin B unless they ask for the estimator; the estimator's own keeps it.
            adaptive = message.adaptive if message.adaptive is not None else (
                self.adaptive if message.origin == "estimator" else False)
            change = self.reconfigure(target, adaptive=adaptive, message=message)
        except (ValueError, AllocationError, RuntimeError) as exc:
            self._reply(message, error=f"cannot reconfigure {self.model}: {exc}")
            log.warning("reconfiguration of %s refused: %s", self.model, exc)
            return
        if change is None:
            self._reply(message, result={"unchanged": True, "configuration": self.configuration.compact(),
                                         "generation": self.generation, "adaptive": self.adaptive})

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
            self.tally.count("restarts", "dispatcher" if child is self.dispatcher else "instance")
            child.start()
            self._record(child, restarted=True)
            restarted.append(child.name)
        # After a Redis restart without persistence the deployment is gone.
        self.republish_if_lost()
        self.poll_control()
        self._advance()
        self._prewarm()
        if time.monotonic() - self._profile_checked_at >= PROFILE_CHECK_S and self.settled():
            self.check_profile()
        if time.monotonic() - self._shm_swept_at >= SHM_SWEEP_S:
            self.sweep_payload_files()
        self._beat()
        return restarted

    def sweep_payload_files(self) -> int:
        """Delete this host's payload files in shared memory older than ``shm_ttl_s``; returns how many.

        A file is normally deleted by the worker that answers its request.
        What is left (a request refused by a dispatcher on another host, a
        worker killed between its commit and the unlink, a producer whose
        XADD was lost with its connection) would otherwise hold memory
        until the host restarts. Every supervisor of the host sweeps; they
        race harmlessly.
        """
        self._shm_swept_at = time.monotonic()
        deleted = self.settings.payload_files.sweep(self.settings.shm_ttl_s)
        if deleted:
            log.warning("deleted %d payload files older than %.0f s from %s (their requests were answered "
                        "elsewhere or never served here)", deleted, self.settings.shm_ttl_s, self.settings.shm_dir)
        return deleted

    def _profile_in_use(self) -> tuple[Path, Profile] | None:
        """The profile its plans come from (the one given, else the model's for the mode served), loaded once."""
        if self._loaded_profile is None:
            try:
                path = find_profile(self.model, self.profile, mode=self.graph_mode)
                if path is None:
                    return None
                self._loaded_profile = (path, Profile.load(path))
            except Exception as exc:  # noqa: BLE001 - no usable profile: nothing to hold serving against
                log.debug("no profile to check serving against: %s", exc)
                return None
        return self._loaded_profile

    def check_profile(self) -> drift.ProfileCheck | None:
        """Hold what the serving instances measure against the profile; warn once when it is off.

        Each instance's record carries the median time of its recent
        sub-batches of the size most of them had, at its own threads. A simulated topology's profile is
        another machine's by design, and is not checked. Never raises: a
        failed read is tried at the next check.
        """
        self._profile_checked_at = time.monotonic()
        loaded = None if self.topology.simulated else self._profile_in_use()
        if loaded is None:
            return None
        path, profile = loaded
        try:
            pipe = self.r.pipeline(transaction=False)
            for inst in self.instances:
                pipe.hgetall(self.keys.instance(self.model, inst.record.id))
            raw = pipe.execute()
        except redis.RedisError as exc:
            log.debug("profile check: records not read: %s", exc)
            return self.profile_check
        served = []
        for inst, fields in zip(self.instances, raw):
            rec = InstanceState.parse(fields)
            # By the size it served, not its share here: a reshare changes the share, not the process.
            if rec is None or rec.served_ms is None or rec.threads != inst.record.threads:
                continue
            served.append(drift.Served(inst.record.id, rec.threads, rec.served_batch or rec.batch, rec.served_ms,
                                       rec.served_batches))
        check = drift.check_profile(profile, served)
        if check.ratio is None:
            return self.profile_check
        self.profile_check = check
        now = time.monotonic()
        for threads, ratio in check.by_threads().items():
            self.thread_ratios[threads] = (ratio, now)
        self.thread_ratios = {t: v for t, v in self.thread_ratios.items() if now - v[1] <= THREAD_RATIO_TTL_S}
        if check.off and not self._profile_warned:
            self._profile_warned = True
            command = quick_profile_command(self.model, path, mode=self.graph_mode,
                                            threads=self.threads_budget, batch=self.deployment.batch)
            log.warning("model %s: %s in %s. The profile does not hold on this machine now (another host, "
                        "other tenants, another clock): plans and the estimator's capacities are off by as "
                        "much. To profile this machine (minutes): %s",
                        self.model, check.describe(), path, command)
        elif not check.off and self._profile_warned:
            self._profile_warned = False
            log.info("model %s: serving matches the profile again (%s)", self.model, check.describe())
        return check

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
            # It beats once per check, every poll at least: a heartbeat shorter than the poll would read as stale.
            state="ready", pid=os.getpid(), host=socket.gethostname(),
            interval=max(self.settings.heartbeat_s, self._poll_s),
            heartbeat=time.time(), loop_errors=self.loop_errors, node=self.node, generation=self.generation,
            instances=[i.record.id for i in self.instances], with_dispatcher=self.with_dispatcher,
            adaptive=self.adaptive, phase=self.change.phase if self.change else "",
            target=self.change.target.compact() if self.change else "",
            spares=self.spares_loaded(), spares_wanted=self.spare_cap(),
            process_start_s=round(start, 3) if (start := self.process_start_s()) is not None else None,
            start_cpus=self.start_cpus(),
            profile_ratio=round(self.profile_check.ratio, 3) if self.profile_check and self.profile_check.ratio
            else None,
            profile_ratios=[f"{t}={r:.3f}" for t, (r, _) in sorted(self.thread_ratios.items())],
        )
        try:
            pipe = self.r.pipeline(transaction=False)
            record.save(pipe, self.keys.supervisor(self.model, self.node))
            pipe.sadd(self.keys.supervisors(self.model), self.node)
            pipe.execute()
        except redis.RedisError as exc:
            log.debug("supervisor heartbeat not written: %s", exc)

    # --- metrics --------------------------------------------------------
    def metrics_view(self) -> ModelView:
        """What this pool exports (and its dispatcher's families, when it runs one): see :mod:`packrat_mq.exposition`.

        Called by the exporter's thread at every scrape: it reads the live
        records of this supervisor's processes (one pipeline), adds their
        tallies up, and counts the instances by state and role.
        """
        roles = ([(i, "active") for i in self.instances] + [(i, "passive") for i in self.passive]
                 + [(i, "retiring") for i in self.retiring] + [(i, "spare") for i in self.spares])
        change = self.change
        view = ModelView(model=self.model, tally=Tally(), pool=True, dispatcher=self.with_dispatcher,
                         phase=change.phase if change else "")
        try:
            records, view.dispatcher_state = self._absorb([inst for inst, _ in roles], self.with_dispatcher)
        except redis.RedisError as exc:
            log.debug("metrics: cannot read the records of %s: %s", self.model, exc)
            records = None
        now = time.time()
        for inst, role in roles:
            if records is None:
                state = "unknown"
            else:
                rec = records.get(inst.record.id)
                state = rec.effective_state(now) if rec is not None else "missing"
            view.instances[(state, role)] = view.instances.get((state, role), 0) + 1
        if self.with_dispatcher:
            view.stream = read_stream(self.r, self.keys.requests(self.model), DISPATCHER_GROUP)
        view.tally = self.totals.total()
        view.tally.add(self.tally.copy())
        return view

    def _absorb(self, instances: list[Instance], dispatcher: bool) -> tuple[dict[str, InstanceState],
                                                                          DispatcherState | None]:
        """Read the records of ``instances`` (and the dispatcher's) and add their tallies to :attr:`totals`.

        Only tallies written since this supervisor started count: a record
        left by an earlier run of the same node (same instance ids, the
        dispatcher's last "stopped") holds that run's counts.
        """
        pipe = self.r.pipeline(transaction=False)
        for inst in instances:
            pipe.hgetall(self.keys.instance(self.model, inst.record.id))
        if dispatcher:
            pipe.hgetall(self.keys.dispatcher(self.model))
        raw = pipe.execute()
        records: dict[str, InstanceState] = {}
        for inst, fields in zip(instances, raw):
            rec = InstanceState.parse(fields)
            if rec is None:
                continue
            records[inst.record.id] = rec
            tally = Tally.load(rec.metrics)
            if tally is not None and rec.heartbeat >= self._started:
                self.totals.update(f"instance:{inst.record.id}", rec.pid, tally)
        drec = DispatcherState.parse(raw[-1]) if dispatcher else None
        if drec is not None:
            tally = Tally.load(drec.metrics)
            if tally is not None and drec.heartbeat >= self._started:
                self.totals.update("dispatcher", drec.pid, tally)
        return records, drec

    def _absorb_quietly(self, instances: list[Instance]) -> None:
        """The last tallies of instances about to be forgotten (their records deleted), while metrics are on."""
        if self.settings.metrics_port is None or not instances:
            return
        try:
            self._absorb(instances, False)
        except redis.RedisError as exc:
            log.debug("metrics: the last counts of stopped instances are lost: %s", exc)

    def parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def serve_forever(self, poll_s: float = 0.5) -> None:
        """Supervise until SIGINT/SIGTERM (or the parent's death, if watched), then return.

        Any exception of one check (Redis restarting, a write refused) is
        logged and counted, and the next check comes after an exponential
        backoff; the loop itself never sleeps longer than its poll.
        """
        stopping = False
        self._poll_s = poll_s

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
                healthy = True
                try:
                    self.check()
                    self._loop_backoff.success()
                except Exception as exc:  # noqa: BLE001 - supervision must outlive any one failure
                    healthy = False
                    self.loop_errors += 1
                    wait = max(poll_s, self._loop_backoff.failure())
                    if isinstance(exc, redis.RedisError):
                        log.warning("supervisor: redis error (%s); checking again in %.1f s", exc, wait)
                    else:
                        log.exception("supervisor check failed; checking again in %.1f s", wait)
                if healthy and self.change is not None:
                    wait = min(wait, CHANGE_POLL_S)  # a reconfiguration's phases move on quickly
                elif healthy and not stopping:
                    # Idle: wait on the control stream itself, so a reconfiguration begins at once.
                    try:
                        self.poll_control(block_ms=max(1, int(wait * 1000)))
                        continue
                    except Exception as exc:  # noqa: BLE001 - the next check reports and backs off
                        log.debug("control stream read failed: %s", exc)
                end = time.monotonic() + wait
                while not stopping and time.monotonic() < end:
                    time.sleep(min(wait, 0.1))
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
        for inst in self.all_instances:
            inst.child.terminate()
        deadline = time.monotonic() + timeout
        for inst in self.all_instances:
            inst.child.wait_or_kill(deadline)
        try:
            self.retire()
        except redis.RedisError as exc:
            log.warning("could not remove this deployment's records from Redis: %s", exc)

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every instance queue is empty (after the dispatcher stopped)."""
        deadline = time.monotonic() + timeout
        queues = [self.keys.queue(self.model, i.record.id) for i in self.all_instances]
        while time.monotonic() < deadline:
            if all(self.r.xlen(q) == 0 for q in queues):
                return True
            if not any(i.child.running() for i in self.all_instances):
                return False
            time.sleep(0.02)
        return False

    def retire(self) -> None:
        """Forget this supervisor's processes in Redis (after they stopped).

        With its own dispatcher it also withdraws its node's part of the
        deployment; without, the part stays, and a supervisor started again on
        the same node and generation takes it over.
        """
        self._absorb_quietly(self.all_instances)
        pipe = self.r.pipeline()
        for inst in self.all_instances:
            queue = self.keys.queue(self.model, inst.record.id)
            pipe.delete(self.keys.instance(self.model, inst.record.id))
            pipe.srem(self.keys.instances(self.model), inst.record.id)
            if self.r.xlen(queue) == 0:
                pipe.delete(queue)
            else:
                log.warning("queue %s still holds work; kept for the next start", queue)
        pipe.delete(self.keys.supervisor(self.model, self.node))
        pipe.srem(self.keys.supervisors(self.model), self.node)
        pipe.execute()
        if self.with_dispatcher:
            # Its dispatcher is gone: its node's part goes too (other nodes' parts stay, with their own dispatcher).
            withdraw_part(self.r, self.keys, self.model, self.node)

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
