"""The dispatcher loop of one model.

Reads the request stream with a consumer group, aggregates a batch, splits it
among the deployment's instances and pushes each sub-batch (the requests'
metadata and stream ids, not their payloads) to that instance's own stream,
in one MULTI/EXEC with an XCLAIM that hands the requests' pending entries to
the instance (consumer ``instance:<id>``, see
:func:`packrat_mq.keys.request_owner`). The payloads stay in the request
stream until the instance answers: it fetches them by id, and acknowledges
and deletes them with its replies. While payloads are large, the dispatcher
reads requests without them (:mod:`dispatcher.reading`). So a request is pending here (read, not
handed out), or owned by exactly one instance whose queue names it, never
both and never neither; after a crash the dispatcher re-reads its own
pending entries first, so nothing it read is lost. The backlog is the
stream's length minus its pending entries (:func:`packrat_mq.streams.backlog`).

Flow control: a batch is read only for instances that can take it. When
some instances are idle (nothing queued), the batch is the sum of their
shares and goes to them alone, at once: in a closed loop the instance that
finishes first gets its clients' next requests without waiting for the
other instances' clients (with every instance waited for, a 1x4,1x4
deployment under eight clients hit the batch timeout on every batch). When
none is idle, the instances with room (at most ``max_waiting`` sub-batches
queued behind the one they run) are fed, so each has its next sub-batch
ready. The backlog stays in the request stream, whose length is what the
estimator reads, instead of piling up in instance queues. Only live
instances count: one whose record says it is restarting, stopped or whose
heartbeat is stale (see ``packrat_mq.records``) is sent nothing and holds
nobody up.

Backpressure: past ``max_backlog`` entries in the request stream, the newest
requests that no dispatcher has read yet get an immediate "overloaded" error
reply and are removed, so the backlog (and Redis's memory) stays bounded.

No error of one iteration ends the loop: it is logged, counted in the
dispatcher hash (``loop_errors``) and retried with exponential backoff; a
consumer group lost to a Redis restart is recreated.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Iterable
from typing import Any

import redis

from dispatcher.adaptive import Adaptive, PlannedCapacity
from dispatcher.aggregation import Aggregator
from dispatcher.orphans import sweep
from dispatcher.partitioning import LatencyFn, split
from dispatcher.reading import Entry, RequestReader
from dispatcher.reclaiming import Reclaimer
from dispatcher.waiting import DeadlineRead
from packrat_mq import protocol, replies, shared_payloads, streams
from packrat_mq.backoff import Backoff
from packrat_mq.connection import check_cluster, connect
from packrat_mq.deployment import Deployment, InstanceRecord
from packrat_mq.exposition import ModelView, read_stream
from packrat_mq.keys import DISPATCHER_GROUP, check_model_name, request_owner
from packrat_mq.metrics import DISPATCHER_HISTOGRAMS, Tally, count_replies
from packrat_mq.records import LIVE_STATES, DispatcherState, InstanceState, SupervisorState
from packrat_mq.recovery import recover
from packrat_mq.settings import Settings
from packrat_mq.streams import ensure_group

log = logging.getLogger("packrat_mq.dispatcher")
#: How often the dispatcher reads what its supervisors measured of serving against the profile (seconds).
RATIOS_EVERY_S = 10.0


class Dispatcher:
    """Aggregates and fans out the requests of one model."""

    def __init__(
        self,
        r: redis.Redis,
        settings: Settings,
        model: str,
        *,
        consumer: str | None = None,
        max_waiting: int = 1,
        latency: LatencyFn | None = None,
        parent_pid: int | None = None,
        profile: str | None = None,
    ) -> None:
        self.r = r
        # Stop when this supervisor is no longer the parent (it was killed).
        self.parent_pid = parent_pid
        check_cluster(r, settings)
        self.settings = settings
        self.keys = settings.keys
        self.payload_files = settings.payload_files
        self.model = check_model_name(model)
        # One dispatcher per model: a stable consumer name lets a restarted
        # dispatcher take over the entries its predecessor read.
        self.consumer = consumer or "dispatcher"
        self.max_waiting = max_waiting
        self.sweep_interval_s = 1.0
        self.latency = latency
        self.stream = self.keys.requests(model)
        self.deployment: Deployment | None = None
        self._raw_config: bytes | None = None
        self._batch_seq = 0
        self._recovering = True
        self._recover_from: bytes | str = "0"
        self._stopping = False
        self._last_beat = 0.0
        self._ratios_read_at = 0.0
        self._state = "starting"
        self.backoff = Backoff()
        #: Blocking reads that end at their deadline, so partial batches are not polled for.
        self.waiter = DeadlineRead(r, self.stream)
        self.reader = RequestReader(r, self.stream, DISPATCHER_GROUP, self.consumer, waiter=self.waiter)
        self.aggregator: Aggregator[Entry] = Aggregator(self._read, poll_interval_ms=settings.batch_poll_ms)
        #: Takes back what the instances of a dead node hold (:mod:`dispatcher.reclaiming`).
        self.reclaimer = Reclaimer(r, self.keys, self.model, self.consumer, settings.node_grace_s)
        #: The estimator: samples the backlog in a thread of its own while running (see :meth:`run`).
        #: What each B can serve by the profile's plans: the estimator's guard against a B too small.
        self.capacity = PlannedCapacity(self.model, profile, timeout_ms=settings.batch_timeout_ms,
                                        max_waiting=max_waiting)
        self.adaptive = Adaptive(r, settings, self.model, capacity=self.capacity)
        #: What it counts for the metrics while they are on: published in its record at every
        #: heartbeat, exported by its supervisor (or by ``packrat-mq dispatch`` itself, :meth:`metrics_view`).
        self.tally = Tally(DISPATCHER_HISTOGRAMS) if settings.metrics_port else None

    # --- setup ----------------------------------------------------------
    def setup(self) -> None:
        if self.waiter.probe():
            self.aggregator.server_tick_ms = 0.0  # reads end at their deadline: nothing to poll for
        ensure_group(self.r, self.stream, DISPATCHER_GROUP)
        self.r.sadd(self.keys.models(), self.model)
        self.heartbeat("ready")

    def heartbeat(self, state: str | None = None) -> None:
        """Tell supervisors and ``status`` that this dispatcher is alive (every ``heartbeat_s``).

        The whole record is written each time, so a Redis restart loses it
        for one interval at most; its counters are incremented where they
        change (see :mod:`packrat_mq.records`).
        """
        now = time.time()
        if state is not None:
            self._state = state
        elif now - self._last_beat < self.settings.heartbeat_s:
            return
        pipe = self.r.pipeline(transaction=False)
        self.record(now).save(pipe, self.keys.dispatcher(self.model))
        pipe.sadd(self.keys.models(), self.model)
        pipe.execute()
        self._last_beat = now
        if self.capacity.budgets and self.adaptive.adaptive:
            self._read_spares()
        if now - self._ratios_read_at >= RATIOS_EVERY_S and self.capacity.budgets:
            self._read_ratios(now)

    def _read_spares(self) -> None:
        """How many spares each node's supervisor has loaded and keeps, and what a process takes there to load:
        a move down that would start processes waits for the spares being loaded
        (``PlannedCapacity.awaiting_spares``), and is priced by the processes it starts beyond them
        (``PlannedCapacity.cold_start_s``).

        Every heartbeat (they load about one a second on simulated cores), one read per node, off the request
        path; only while adaptive.
        """
        nodes = list(self.capacity.budgets)
        pipe = self.r.pipeline(transaction=False)
        for node in nodes:
            pipe.hmget(self.keys.supervisor(self.model, node), "spares", "spares_wanted", "process_start_s",
                       "start_cpus")
        spares, starts = {}, {}
        for node, (loaded, wanted, start_s, cpus) in zip(nodes, pipe.execute()):
            try:
                spares[node] = (int(loaded or 0), int(wanted or 0))
            except ValueError:
                continue  # an unreadable record says nothing of its spares
            try:
                if start_s is not None and float(start_s) > 0:
                    starts[node] = (float(start_s), max(1, int(cpus or 1)))
            except ValueError:
                pass  # unreadable: the start time is unknown, as before one was measured
        self.capacity.observe_spares(spares, self.adaptive.clock(), starts)

    def _read_ratios(self, now: float) -> None:
        """What each node's supervisor measured of serving against the profile: the capacities follow it.

        A machine slower than its profile (another host, other tenants) carries
        less than the profile plans; the estimator's guards read capacities, so
        they read them corrected (``PlannedCapacity.ratios``). Every
        ``RATIOS_EVERY_S``, one read per node, off the request path.
        """
        self._ratios_read_at = now
        nodes = list(self.capacity.budgets)
        pipe = self.r.pipeline(transaction=False)
        for node in nodes:
            pipe.hgetall(self.keys.supervisor(self.model, node))
        ratios, by_threads = {}, {}
        for node, raw in zip(nodes, pipe.execute()):
            record = SupervisorState.parse(raw)  # an unreadable ratio parses as none
            ratio = record.profile_ratio if record is not None else None
            if ratio is not None and ratio > 0:
                ratios[node] = min(max(round(ratio, 2), 0.25), 10.0)
            per = record.ratios_by_threads() if record is not None else {}
            if per:
                by_threads[node] = {t: min(max(round(r, 2), 0.25), 10.0) for t, r in per.items()}
        if by_threads != self.capacity.thread_ratios:
            self.capacity.thread_ratios = by_threads
        if ratios != self.capacity.ratios:
            # Said at INFO only when some node's ratio moved by more than 10% (it wanders every read).
            moved = set(ratios) != set(self.capacity.ratios) or any(
                abs(ratios[n] / self.capacity.ratios[n] - 1) > 0.1 for n in ratios)
            (log.info if moved else log.debug)(
                "model %s: served / profiled latency by node %s; the estimator's capacities follow",
                self.model, ratios or "unknown")
            self.capacity.ratios = ratios

    def record(self, now: float | None = None) -> DispatcherState:
        """This dispatcher's live record as of now (its counters are incremented where they change)."""
        estimate = self.adaptive.snapshot()
        deployment = self.deployment
        return DispatcherState(state=self._state, pid=os.getpid(), host=socket.gethostname(),
                               interval=self.settings.heartbeat_s, heartbeat=time.time() if now is None else now,
                               max_backlog=self.settings.max_backlog,
                               generation=deployment.generation if deployment else None,
                               batch=deployment.batch if deployment else None,
                               nodes=[f"{n}={g}" for n, g in deployment.nodes.items()] if deployment else [],
                               adaptive=estimate.adaptive,
                               q_tilde=round(estimate.q_tilde, 3) if estimate.q_tilde is not None else None,
                               b_tilde=estimate.b_tilde, requested_batch=estimate.requested,
                               served=[f"{b}={rate:.1f}" for b, rate in sorted(estimate.served.items())],
                               metrics=self.tally.dump() if self.tally is not None else None)

    def metrics_view(self) -> ModelView:
        """What ``packrat-mq dispatch`` exports (called by the exporter's thread; see :mod:`packrat_mq.exposition`)."""
        return ModelView(model=self.model, tally=self.tally.copy() if self.tally is not None else Tally(),
                         dispatcher=True, dispatcher_state=self.record(),
                         stream=read_stream(self.r, self.stream, DISPATCHER_GROUP))

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        """Close the connection of the deadline reads (the client's own pool is the caller's)."""
        self.waiter.close()

    # --- reading --------------------------------------------------------
    def _read(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to ``count`` requests, without their payloads while those are large (:mod:`dispatcher.reading`).

        Waits up to ``block_ms`` for the first one when none is there.
        """
        if self._recovering:
            # Entries this consumer read before a restart and never fanned out.
            # They stay pending until their batch is dispatched, so the next
            # read of the same batch starts after the last one handed out;
            # from "0" it would return them again (duplicates in the batch).
            entries = self.reader.read(count, self._recover_from)
            if entries:
                self._recover_from = entries[-1][0]
                return entries
            self._recovering = False
        entries = self.reader.read(count)
        if entries or not block_ms:
            return entries
        return self.reader.wait(block_ms, count)

    def refresh_deployment(self, raw: bytes | None) -> Deployment | None:
        if raw != self._raw_config:
            self._raw_config = raw
            self.deployment = Deployment.model_validate_json(raw) if raw else None
            if self.deployment:
                d = self.deployment
                log.info("model %s: serving generation %d, %s (B=%d%s)", self.model, d.generation,
                         d.configuration, d.batch, ", adaptive" if d.adaptive else "")
                self.capacity.budgets = dict(d.budgets)
                self.capacity.mode = d.graph_mode or "eager"
                self.adaptive.serving(d.batch, d.generation, d.adaptive, d.predicted_latency_ms)
                # Say so at once: the supervisor waits for this to retire the old instances.
                self.heartbeat(self._state)
        return self.deployment

    def _ready(self) -> tuple[Deployment | None, bool]:
        """(the deployment to serve the next batch with, whether the deployment just changed).

        The deployment comes back restricted to the instances that should
        take the next batch: the idle ones (nothing queued) when any is idle,
        else those with room (at most ``max_waiting`` sub-batches queued);
        gone or restarting instances never. So an instance that finishes
        first is fed its own share at once instead of waiting, with its
        share's requests, for the others to finish too. Sheds load when the
        backlog is over its bound.
        """
        pipe = self.r.pipeline(transaction=False)
        pipe.get(self.keys.config(self.model))
        pipe.xlen(self.stream)
        pipe.xpending(self.stream, DISPATCHER_GROUP)
        deployment = self.deployment
        instances = deployment.instances if deployment else []
        for inst in instances:
            pipe.xlen(self.keys.queue(self.model, inst.id))
            pipe.hmget(self.keys.instance(self.model, inst.id), *InstanceState.LIVENESS_FIELDS)
        nodes = list(deployment.nodes) if deployment else []
        for node in nodes:
            pipe.hmget(self.keys.supervisor(self.model, node), *SupervisorState.LIVENESS_FIELDS)
        raw, length, pending, *rest = pipe.execute()
        now = time.time()
        beating = {node: SupervisorState.liveness(v, now) in LIVE_STATES
                   for node, v in zip(nodes, rest[2 * len(instances):])}
        rest = rest[: 2 * len(instances)]
        backlog = streams.backlog(length, streams.pending_count(pending))
        if backlog > self.settings.max_backlog:
            self.shed(backlog - self.settings.max_backlog)
        current = self.refresh_deployment(raw)
        if current is not deployment:
            return None, True  # a new deployment: measure again with its own queues
        if current is None:
            return None, False
        idle: list[InstanceRecord] = []
        room: list[InstanceRecord] = []
        for inst, length, liveness in zip(instances, rest[0::2], rest[1::2]):
            state = InstanceState.liveness(liveness, now)
            if state is not None and state != "ready":
                continue  # gone or restarting: sent nothing, the others go on
            if state is None and not beating.get(inst.node, True):
                continue  # no record, and its node's supervisor does not beat either: the node is gone
            # No record at all: nothing says it is gone; flow control still bounds its queue.
            if length == 0:
                idle.append(inst)
            if length <= self.max_waiting:
                room.append(inst)
        serve = idle or room
        if not serve:
            return None, False
        if len(serve) < len(instances):
            # Only as many requests as these instances' shares take.
            return current.model_copy(update={"instances": serve}), False
        return current, False

    # --- the loop -------------------------------------------------------
    def run_once(self, idle_block_ms: int = 500) -> int:
        """Wait for room, aggregate and dispatch one batch; returns its size."""
        deployment, changed = self._ready()
        if deployment is None:
            if not changed:
                # Workers push a token when they finish a sub-batch; the
                # timeout covers a first deployment appearing.
                self.r.blpop([self.keys.wakeup(self.model)], timeout=0.1)
            return 0
        self._recover_from = "0"  # the previous batch is acked: nothing handed out is pending
        entries = self.aggregator.next_batch(
            deployment.batch, self.settings.batch_timeout_ms, idle_block_ms=idle_block_ms
        )
        if entries:
            self.dispatch(entries, deployment)
            oldest_ms = protocol.entry_ms(entries[0][0])
            partial = len(entries) < deployment.batch
            self.adaptive.record_batch(len(entries), partial, max(0.0, time.time() * 1000.0 - oldest_ms))
            if self.tally is not None:
                self.tally.observe("batch_size", len(entries))
                if partial:
                    self.tally.count("partial_batches")
        return len(entries)

    def run(self) -> None:
        self.setup()
        log.info("dispatcher for %s reading %s", self.model, self.stream)
        self.adaptive.start()
        try:
            self._loop()
        finally:
            self.adaptive.stop()
            self.close()
        try:
            self.heartbeat("stopped")
        except redis.RedisError as exc:
            log.warning("could not record the stop: %s", exc)

    def _loop(self) -> None:
        next_sweep = 0.0
        while not self._stopping:
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning("supervisor (pid %d) is gone; dispatcher for %s stops", self.parent_pid, self.model)
                break
            try:
                self._housekeep(self.heartbeat, "heartbeat")
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self.sweep_interval_s
                    self._housekeep(lambda: sweep(self.r, self.settings, own=self.model), "orphan sweep")
                    if self.reclaimer.check(self.deployment):
                        # Claimed back to this consumer: read again first, like its own pending entries.
                        self._recovering = True
                        self._recover_from = "0"
                self.run_once()
                self.backoff.success()
            except Exception as exc:  # noqa: BLE001 - one failed iteration never ends the dispatcher
                self._recover(exc)

    def _housekeep(self, step: Any, what: str) -> None:
        """Run the heartbeat or the orphan sweep; on Redis Cluster a failure of it does not stop the batches.

        Both write keys of no one model (the models index, the sweep's lock)
        and the sweep scans every master: on a cluster those may be on a
        master that is failing over while this model's master is fine, so
        the failure is logged and the step tried again at its next time. On
        one Redis a failure here is Redis's, and fails the iteration as before.
        """
        if not self.keys.cluster:
            step()
            return
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - housekeeping; the batch path reports its own failures
            if step == self.heartbeat:
                self._last_beat = time.time()  # next try in one interval, not at every batch
            log.warning("dispatcher for %s: %s failed (%s); serving on", self.model, what, exc)

    def _recover(self, exc: Exception) -> None:
        """After a failed iteration: see :func:`packrat_mq.recovery.recover`; then re-read pending entries."""
        # Entries read before the failure may be pending, not dispatched.
        self._recovering = True
        self._recover_from = "0"
        delay = recover(self.r, exc, stream=self.stream, group=DISPATCHER_GROUP, record=DispatcherState,
                        record_key=self.keys.dispatcher(self.model), interval=self.settings.heartbeat_s,
                        rewrite_record=lambda: self.heartbeat(self._state),
                        backoff=self.backoff, who=f"dispatcher for {self.model}", log=log)
        end = time.monotonic() + delay
        while not self._stopping and time.monotonic() < end:
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))

    # --- backpressure ---------------------------------------------------
    def shed(self, excess: int) -> int:
        """Answer the newest ``excess`` unread requests with "overloaded" and remove them.

        Only entries after the group's last-delivered id are taken, so
        nothing this dispatcher has read (and may be fanning out) is touched.
        """
        last = b"0-0"
        for group in self.r.xinfo_groups(self.stream):
            if group["name"] in (DISPATCHER_GROUP, DISPATCHER_GROUP.encode()):
                last = group["last-delivered-id"]
        last_s = last.decode() if isinstance(last, bytes) else str(last)
        entries = self.r.xrevrange(self.stream, max="+", min=f"({last_s}", count=excess)
        if not entries:
            return 0
        message = (f"overloaded: {self.model} has more than {self.settings.max_backlog} requests waiting; "
                   "retry later")
        pairs = []
        unanswerable = 0
        for sid, fields in entries:
            reply_to = protocol.answerable_reply_to(fields, self.settings.prefix)
            if reply_to is None:
                unanswerable += 1
                continue
            pairs.append((reply_to, protocol.error_reply(protocol.entry_request_id(fields), message, model=self.model)))
        with self.r.pipeline(transaction=True) as pipe:
            stats_key = self.keys.stats(self.model)
            delivery = replies.queue(self.r, pipe, pairs, ttl_s=self.settings.reply_ttl_s, stats_key=stats_key)
            pipe.xdel(self.stream, *(sid for sid, _ in entries))
            pipe.hincrby(stats_key, "requests", len(entries))
            pipe.hincrby(stats_key, "overloaded", len(entries))
            if unanswerable:
                pipe.hincrby(stats_key, "unanswerable", unanswerable)
            replies.execute(pipe, f"model {self.model}", delivery)
        self._discard_payload_files(fields for _, fields in entries)
        if self.tally is not None:
            self.tally.count("requests", n=len(entries))
            if unanswerable:
                self.tally.count("errors", "unanswerable", n=unanswerable)
            count_replies(self.tally, delivery.grouped, delivery.results)
        log.warning("model %s: backlog over %d; %d newest requests refused as overloaded",
                    self.model, self.settings.max_backlog, len(entries))
        return len(entries)

    def _discard_payload_files(self, refused: Iterable[dict[bytes, bytes]]) -> None:
        """Delete the payload files in shared memory of requests answered here (refused), once that committed.

        Only where this dispatcher runs on the producer's host; elsewhere the
        files are that host's supervisors' to sweep (``shm_ttl_s``).
        """
        names = [name for name in map(shared_payloads.owned_name, refused) if name]
        if names:
            self.payload_files.discard(names)

    # --- fan-out --------------------------------------------------------
    def dispatch(self, entries: list[Entry], deployment: Deployment) -> None:
        """Fan ``entries`` out to the instances of ``deployment`` in one transaction."""
        instances = deployment.instances
        now_ms = int(time.time() * 1000)
        accepted: list[protocol.Request] = []
        rejected: list[protocol.RequestRejected] = []
        # Answered here (rejected) or already deleted: acknowledged and deleted by this transaction.
        done: list[bytes] = []
        refused: list[dict[bytes, bytes]] = []
        for sid, fields in entries:
            if fields is None:  # deleted while pending: nothing to answer
                done.append(sid)
                continue
            try:
                accepted.append(
                    protocol.parse_request(
                        sid, fields, max_payload_bytes=self.settings.max_payload_bytes, now_ms=now_ms,
                        prefix=self.settings.prefix,
                    )
                )
            except protocol.RequestRejected as exc:
                rejected.append(exc)
                done.append(sid)
                refused.append(fields)

        counts = split(len(accepted), [(i.threads, i.batch) for i in instances], self.latency) if accepted else []
        self._batch_seq += 1
        batch_id = f"{os.getpid()}-{self._batch_seq}"

        stats_key = self.keys.stats(self.model)
        pairs = []
        unanswerable = 0
        for exc in rejected:
            if exc.reply_to is None:
                unanswerable += 1
                log.warning("model %s: dropped request %r that cannot be answered: %s", self.model, exc.request_id, exc)
                continue
            pairs.append((exc.reply_to, protocol.error_reply(exc.request_id, str(exc), model=self.model)))
        with self.r.pipeline(transaction=True) as pipe:
            delivery = replies.queue(self.r, pipe, pairs, ttl_s=self.settings.reply_ttl_s, stats_key=stats_key)
            start = 0
            for inst, n in zip(instances, counts):
                if n == 0:
                    continue
                sub = accepted[start : start + n]
                start += n
                pipe.xadd(self.keys.queue(self.model, inst.id),
                          protocol.encode_subbatch(sub, batch_id, carry_bytes=protocol.CARRY_MAX_BYTES))
                # The requests stay in the stream, pending, now owned by the instance: it fetches
                # their payloads (but the small ones it gets here) and acknowledges and deletes them
                # with its replies.
                pipe.xclaim(self.stream, DISPATCHER_GROUP, request_owner(inst.id), 0,
                            [r.stream_id for r in sub], justid=True)
            if done:
                pipe.xack(self.stream, DISPATCHER_GROUP, *done)
                pipe.xdel(self.stream, *done)
            pipe.hincrby(stats_key, "requests", len(accepted) + len(rejected))
            pipe.hincrby(stats_key, "batches", 1)
            DispatcherState.count(pipe, self.keys.dispatcher(self.model), "batches", renew=False)
            if rejected:
                pipe.hincrby(stats_key, "rejected", len(rejected))
            if unanswerable:
                pipe.hincrby(stats_key, "unanswerable", unanswerable)
            replies.execute(pipe, f"model {self.model}", delivery)
        self._discard_payload_files(refused)
        if self.tally is not None:
            self.tally.count("requests", n=len(accepted) + len(rejected))
            if unanswerable:
                self.tally.count("errors", "unanswerable", n=unanswerable)
            count_replies(self.tally, delivery.grouped, delivery.results)
            sent_s = time.time()
            self.tally.observe_many("dispatch_wait", [sent_s - req.enqueued_ms / 1000.0 for req in accepted])

    def serve(self) -> None:
        """Run until SIGTERM/SIGINT (or until the supervisor ``parent_pid`` is gone)."""

        def _stop(signum: int, frame: Any) -> None:
            self.stop()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        self.run()


def run_dispatcher(
    settings: Settings, url: str, model: str, *, latency: LatencyFn | None = None, parent_pid: int | None = None,
    profile: str | None = None,
) -> None:
    """Process entry point: run until SIGTERM/SIGINT (or until the supervisor ``parent_pid`` is gone)."""
    Dispatcher(connect(url), settings, model, latency=latency, parent_pid=parent_pid, profile=profile).serve()
