"""The dispatcher loop of one model.

Reads the request stream with a consumer group, aggregates a batch, splits it
among the deployment's instances and pushes each sub-batch to that instance's
own stream, all in one MULTI/EXEC with the XACK and XDEL of the requests:
either a request is in an instance queue or it is still pending here, never
both and never neither. After a crash the dispatcher re-reads its own pending
entries first, so nothing it read is lost.

Flow control: a batch is read only when every instance has room (at most
``max_waiting`` sub-batches queued behind the one it is running), so the
backlog stays in the request stream, whose length is what the estimator
reads, instead of piling up in instance queues.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from dispatcher.aggregation import Aggregator
from dispatcher.orphans import sweep
from dispatcher.partitioning import LatencyFn, split
from packrat_mq import protocol
from packrat_mq.connection import execute_replies
from packrat_mq.deployment import Deployment
from packrat_mq.keys import DISPATCHER_GROUP, check_model_name
from packrat_mq.settings import Settings

log = logging.getLogger("packrat_mq.dispatcher")

Entry = tuple[bytes, "dict[bytes, bytes] | None"]


@dataclass
class DispatchStats:
    batches: int = 0
    requests: int = 0
    rejected: int = 0
    unanswerable: int = 0
    sizes: dict[int, int] = field(default_factory=dict)


def ensure_group(r: redis.Redis, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` (and the stream) unless it exists."""
    try:
        r.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


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
    ) -> None:
        self.r = r
        # Stop when this supervisor is no longer the parent (it was killed).
        self.parent_pid = parent_pid
        self.settings = settings
        self.keys = settings.keys
        self.model = check_model_name(model)
        # One dispatcher per model: a stable consumer name lets a restarted
        # dispatcher take over the entries its predecessor read.
        self.consumer = consumer or "dispatcher"
        self.max_waiting = max_waiting
        self.sweep_interval_s = 1.0
        self.latency = latency
        self.stream = self.keys.requests(model)
        self.stats = DispatchStats()
        self.deployment: Deployment | None = None
        self._raw_config: bytes | None = None
        self._batch_seq = 0
        self._recovering = True
        self._recover_from: bytes | str = "0"
        self._stopping = False
        self._last_beat = 0.0
        self.aggregator: Aggregator[Entry] = Aggregator(self._read)

    # --- setup ----------------------------------------------------------
    def setup(self) -> None:
        ensure_group(self.r, self.stream, DISPATCHER_GROUP)
        self.r.sadd(self.keys.models(), self.model)
        self.heartbeat("ready")

    def heartbeat(self, state: str | None = None) -> None:
        """Tell supervisors and ``status`` that this dispatcher is alive (every ``heartbeat_s``)."""
        now = time.time()
        if state is None and now - self._last_beat < self.settings.heartbeat_s:
            return
        fields: dict[str, str | int] = {"heartbeat": f"{now:.3f}"}
        if state is not None:
            fields.update(state=state, pid=os.getpid(), host=socket.gethostname())
        self.r.hset(self.keys.dispatcher(self.model), mapping=fields)
        self._last_beat = now

    def stop(self) -> None:
        self._stopping = True

    # --- reading --------------------------------------------------------
    def _read(self, count: int, block_ms: int | None) -> list[Entry]:
        if self._recovering:
            # Entries this consumer read before a restart and never fanned out.
            # They stay pending until their batch is dispatched, so the next
            # read of the same batch starts after the last one handed out;
            # from "0" it would return them again (duplicates in the batch).
            resp = self.r.xreadgroup(
                DISPATCHER_GROUP, self.consumer, {self.stream: self._recover_from}, count=count
            )
            entries = resp[0][1] if resp else []
            if entries:
                self._recover_from = entries[-1][0]
                return entries
            self._recovering = False
        resp = self.r.xreadgroup(DISPATCHER_GROUP, self.consumer, {self.stream: ">"}, count=count, block=block_ms or None)
        return resp[0][1] if resp else []

    def refresh_deployment(self, raw: bytes | None) -> Deployment | None:
        if raw != self._raw_config:
            self._raw_config = raw
            self.deployment = Deployment.model_validate_json(raw) if raw else None
            if self.deployment:
                log.info(
                    "model %s: serving generation %d, %s (B=%d)",
                    self.model,
                    self.deployment.generation,
                    self.deployment.configuration,
                    self.deployment.batch,
                )
        return self.deployment

    def _ready(self) -> tuple[Deployment | None, bool]:
        """(the deployment if every instance can take a sub-batch now, whether it just changed)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(self.keys.config(self.model))
        deployment = self.deployment
        if deployment:
            for inst in deployment.instances:
                pipe.xlen(self.keys.queue(self.model, inst.id))
        raw, *lengths = pipe.execute()
        current = self.refresh_deployment(raw)
        if current is not deployment:
            return None, True  # a new deployment: measure again with its own queues
        if current is not None and all(n <= self.max_waiting for n in lengths):
            return current, False
        return None, False

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
        return len(entries)

    def run(self) -> None:
        self.setup()
        log.info("dispatcher for %s reading %s", self.model, self.stream)
        next_sweep = 0.0
        while not self._stopping:
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.warning("supervisor (pid %d) is gone; dispatcher for %s stops", self.parent_pid, self.model)
                break
            try:
                self.heartbeat()
                if time.monotonic() >= next_sweep:
                    sweep(self.r, self.settings)
                    next_sweep = time.monotonic() + self.sweep_interval_s
                self.run_once()
            except redis.ConnectionError as exc:
                log.warning("redis connection lost (%s); retrying in 0.5 s", exc)
                # Entries read before the loss may be pending, not dispatched.
                self._recovering = True
                time.sleep(0.5)
        self.heartbeat("stopped")

    # --- fan-out --------------------------------------------------------
    def dispatch(self, entries: list[Entry], deployment: Deployment) -> None:
        now_ms = int(time.time() * 1000)
        accepted: list[protocol.Request] = []
        rejected: list[protocol.RequestRejected] = []
        for sid, fields in entries:
            if fields is None:  # deleted while pending: nothing to answer
                continue
            try:
                accepted.append(
                    protocol.parse_request(
                        sid, fields, max_payload_bytes=self.settings.max_payload_bytes, now_ms=now_ms
                    )
                )
            except protocol.RequestRejected as exc:
                rejected.append(exc)

        instances = [(i.threads, i.batch) for i in deployment.instances]
        counts = split(len(accepted), instances, self.latency) if accepted else []
        self._batch_seq += 1
        batch_id = f"{os.getpid()}-{self._batch_seq}"

        ids = [sid for sid, _ in entries]
        pipe = self.r.pipeline(transaction=True)
        start = 0
        for inst, n in zip(deployment.instances, counts):
            if n == 0:
                continue
            sub = accepted[start : start + n]
            start += n
            pipe.xadd(self.keys.queue(self.model, inst.id), protocol.encode_subbatch(sub, batch_id))
        unanswerable = 0
        for exc in rejected:
            if exc.reply_to is None:
                unanswerable += 1
                log.warning("dropped request %r with no usable reply_to: %s", exc.request_id, exc)
                continue
            pipe.xadd(exc.reply_to, protocol.error_reply(exc.request_id, str(exc), model=self.model))
        for reply_to in {exc.reply_to for exc in rejected if exc.reply_to is not None}:
            pipe.expire(reply_to, self.settings.reply_ttl_s)
        pipe.xack(self.stream, DISPATCHER_GROUP, *ids)
        pipe.xdel(self.stream, *ids)
        stats_key = self.keys.stats(self.model)
        pipe.hincrby(stats_key, "requests", len(accepted) + len(rejected))
        pipe.hincrby(stats_key, "batches", 1)
        pipe.hincrby(self.keys.dispatcher(self.model), "batches", 1)
        if rejected:
            pipe.hincrby(stats_key, "rejected", len(rejected))
        if unanswerable:
            pipe.hincrby(stats_key, "unanswerable", unanswerable)
        execute_replies(pipe, log, f"model {self.model}")

        self.stats.batches += 1
        self.stats.requests += len(entries)
        self.stats.rejected += len(rejected)
        self.stats.unanswerable += unanswerable
        self.stats.sizes[len(accepted)] = self.stats.sizes.get(len(accepted), 0) + 1


def run_dispatcher(
    settings: Settings, url: str, model: str, *, latency: LatencyFn | None = None, parent_pid: int | None = None
) -> None:
    """Process entry point: run until SIGTERM/SIGINT (or until the supervisor ``parent_pid`` is gone)."""
    import signal

    from packrat_mq.connection import connect

    d = Dispatcher(connect(url), settings, model, latency=latency, parent_pid=parent_pid)

    def _stop(signum: int, frame: Any) -> None:
        d.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    d.run()
