"""A worker instance: one process, pinned to its cores, serving its own queue.

Started by the pool (``python -m workers.worker SPEC_JSON``) with OMP/MKL
thread variables already in its environment; it pins itself, loads the
handler once, then loops: read a sub-batch, run it, and in one MULTI/EXEC
send every reply, XACK and XDEL the sub-batch and wake the dispatcher. The
transaction is what makes each request answered exactly once: a worker that
dies before EXEC leaves the sub-batch pending, and its replacement (same
consumer name) delivers it again; one that dies after has nothing pending.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from typing import Any

import redis
from pydantic import BaseModel, Field

from packrat_mq import protocol
from packrat_mq.connection import execute_replies
from packrat_mq.handler import BaseHandler, Context, Input, Outcome, load_handler, run_batch
from packrat_mq.keys import WORKER_GROUP
from packrat_mq.settings import Settings

log = logging.getLogger("packrat_mq.worker")

#: Cap on the dispatcher's wake-up list; tokens only say "look again".
WAKEUP_CAP = 64


class WorkerSpec(BaseModel):
    """Everything a worker process needs, passed by the pool as JSON."""

    url: str
    settings: Settings
    model: str
    handler: str
    instance_id: str
    threads: int = 1
    batch: int = 1
    cpus: list[int] = Field(default_factory=list)
    socket: int = 0
    options: dict[str, Any] = Field(default_factory=dict)
    #: A sub-batch delivered this many times (its worker died each time) is
    #: answered with an error instead of being run again.
    max_deliveries: int = 3
    #: The supervisor's pid: the worker stops when it is no longer its parent
    #: (a SIGKILLed supervisor must not leave instances running unsupervised).
    parent_pid: int | None = None


class Worker:
    """Consumes one instance queue with one handler."""

    def __init__(self, r: redis.Redis, spec: WorkerSpec, handler: BaseHandler) -> None:
        self.r = r
        self.spec = spec
        self.handler = handler
        self.settings = spec.settings
        self.keys = self.settings.keys
        self.queue = self.keys.queue(spec.model, spec.instance_id)
        self.instance_key = self.keys.instance(spec.model, spec.instance_id)
        self._stopping = False
        self._recovering = True
        self._last_beat = 0.0
        self.batches = 0

    def stop(self) -> None:
        self._stopping = True

    def register(self, state: str) -> None:
        s = self.spec
        self.r.hset(
            self.instance_key,
            mapping={
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "state": state,
                "threads": s.threads,
                "batch": s.batch,
                "cpus": ",".join(map(str, s.cpus)),
                "socket": s.socket,
                "heartbeat": f"{time.time():.3f}",
            },
        )
        self.r.sadd(self.keys.instances(s.model), s.instance_id)

    def heartbeat(self) -> None:
        now = time.time()
        if now - self._last_beat >= self.settings.heartbeat_s:
            self.r.hset(self.instance_key, "heartbeat", f"{now:.3f}")
            self._last_beat = now

    # --- loop -------------------------------------------------------------
    def read(self, block_ms: int = 1000) -> list[tuple[bytes, dict[bytes, bytes]]]:
        if self._recovering:
            resp = self.r.xreadgroup(WORKER_GROUP, self.spec.instance_id, {self.queue: "0"}, count=1)
            entries = resp[0][1] if resp else []
            if entries:
                return entries
            self._recovering = False
        resp = self.r.xreadgroup(WORKER_GROUP, self.spec.instance_id, {self.queue: ">"}, count=1, block=block_ms)
        return resp[0][1] if resp else []

    def run(self) -> None:
        self.register("ready")
        log.info("instance %s ready on cpus %s", self.spec.instance_id, self.spec.cpus)
        while not self._stopping:
            if self.spec.parent_pid is not None and os.getppid() != self.spec.parent_pid:
                log.warning("supervisor (pid %d) is gone; instance %s stops", self.spec.parent_pid, self.spec.instance_id)
                break
            try:
                self.heartbeat()
                for entry_id, fields in self.read():
                    self.process(entry_id, fields)
            except redis.ConnectionError as exc:
                log.warning("redis connection lost (%s); retrying in 0.5 s", exc)
                # A sub-batch read before the loss may still be pending here.
                self._recovering = True
                time.sleep(0.5)
        self.register("stopped")

    def _deliveries(self, entry_id: bytes) -> int:
        info = self.r.xpending_range(self.queue, WORKER_GROUP, min=entry_id, max=entry_id, count=1)
        return int(info[0]["times_delivered"]) if info else 1

    def process(self, entry_id: bytes, fields: dict[bytes, bytes] | None) -> None:
        """Run one sub-batch and reply to each of its requests, atomically with the ack."""
        if not fields:
            self._finish(entry_id, [])
            return
        try:
            requests = protocol.decode_subbatch(fields)
        except (KeyError, ValueError, IndexError, TypeError) as exc:
            # Only the dispatcher writes here; a broken entry is a bug, not input.
            log.error("unreadable sub-batch %s dropped: %s", entry_id, exc)
            self._finish(entry_id, [])
            return
        started_ms = time.time() * 1000.0
        if self._recovering:
            deliveries = self._deliveries(entry_id)
            if deliveries > self.spec.max_deliveries:
                message = (
                    f"worker instance died {deliveries - 1} times while serving this batch; "
                    "it is not run again"
                )
                outcomes = [Outcome(error=message) for _ in requests]
                self._finish(entry_id, requests, outcomes, started_ms=started_ms, inference_ms=0.0)
                return

        outcomes: list[Outcome | None] = [None] * len(requests)
        items: list[Input] = []
        positions: list[int] = []
        for k, req in enumerate(requests):
            if req.deadline_ms is not None and req.deadline_ms <= started_ms:
                outcomes[k] = Outcome(error=f"deadline exceeded before inference ({started_ms - req.deadline_ms:.0f} ms late)")
                continue
            try:
                data = protocol.decode_payload(req.content_type, req.payload)
            except protocol.PayloadError as exc:
                outcomes[k] = Outcome(error=str(exc))
                continue
            items.append(Input(id=req.id, data=data, content_type=req.content_type))
            positions.append(k)
        inference_ms = 0.0
        if items:
            result = run_batch(self.handler, items)
            inference_ms = result.inference_ms
            for k, outcome in zip(positions, result.outcomes):
                outcomes[k] = outcome
        self._finish(entry_id, requests, [o or Outcome(error="no result") for o in outcomes],
                     started_ms=started_ms, inference_ms=inference_ms)

    def _finish(
        self,
        entry_id: bytes,
        requests: list[protocol.Request],
        outcomes: list[Outcome] | None = None,
        *,
        started_ms: float = 0.0,
        inference_ms: float = 0.0,
    ) -> None:
        s = self.spec
        pipe = self.r.pipeline(transaction=True)
        errors = 0
        for req, outcome in zip(requests, outcomes or []):
            timing = {
                "queue_ms": max(0.0, started_ms - req.enqueued_ms),
                "inference_ms": inference_ms,
                "batch_size": len(requests),
                "instance": s.instance_id,
                "model": s.model,
            }
            if outcome.ok:
                try:
                    payload, ctype = protocol.encode_payload(outcome.value)
                except (TypeError, ValueError) as exc:
                    outcome = Outcome(error=f"handler output could not be encoded: {exc}")
                else:
                    pipe.xadd(req.reply_to, protocol.reply_fields(req.id, payload=payload, content_type=ctype, **timing))
            if not outcome.ok:
                errors += 1
                pipe.xadd(req.reply_to, protocol.error_reply(req.id, outcome.error or "error", **timing))
        # One EXPIRE per reply stream, not per reply: a client's requests share one.
        for reply_to in {req.reply_to for req in requests}:
            pipe.expire(reply_to, self.settings.reply_ttl_s)
        pipe.xack(self.queue, WORKER_GROUP, entry_id)
        pipe.xdel(self.queue, entry_id)
        pipe.lpush(self.keys.wakeup(s.model), s.instance_id)
        pipe.ltrim(self.keys.wakeup(s.model), 0, WAKEUP_CAP - 1)
        stats = self.keys.stats(s.model)
        pipe.hincrby(stats, "replies", len(requests))
        if errors:
            pipe.hincrby(stats, "errors", errors)
        pipe.hincrby(self.instance_key, "batches", 1)
        execute_replies(pipe, log, f"instance {s.instance_id}")
        self.batches += 1


def build_context(spec: WorkerSpec) -> Context:
    return Context(
        model_name=spec.model,
        instance_id=spec.instance_id,
        threads=spec.threads,
        cores=tuple(spec.cpus),
        batch_size=spec.batch,
        graph_mode=spec.settings.graph_mode,
        options=dict(spec.options),
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = WorkerSpec.model_validate_json(argv[0])
    logging.basicConfig(
        level=os.environ.get("PACKRAT_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s worker {spec.instance_id} %(levelname)s %(message)s",
    )
    from packrat_mq.connection import connect
    from workers.allocation import pin_current_process

    if spec.cpus:
        pin_current_process(spec.cpus, spec.threads, configure_torch=False)
    r = connect(spec.url)
    handler = load_handler(spec.handler)
    worker = Worker(r, spec, handler)
    worker.register("starting")
    if "torch" in sys.modules:
        # After the handler import: size torch's pools only when torch is used.
        pin_current_process(spec.cpus or sorted(os.sched_getaffinity(0)), spec.threads, configure_torch=True)
    handler.initialize(build_context(spec))
    _warm_up(handler, spec.batch)

    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())
    worker.run()
    return 0


def _warm_up(handler: BaseHandler, batch: int) -> None:
    """One batch of the serving size before taking traffic (allocator, JIT caches)."""
    try:
        items = handler.example_batch(batch)
    except NotImplementedError:
        return
    run_batch(handler, items)


if __name__ == "__main__":
    sys.exit(main())
