"""A worker instance: one process, pinned to its cores, serving its own queue.

Started by the supervisor (``python -m workers.worker``, its spec on stdin,
its thread variables in its environment: see :mod:`workers.launch`); it
becomes a ready instance with :func:`workers.runtime.start` (the same start
the profiler measures), then loops: read a sub-batch (request metadata and
stream ids), fetch its payloads from the request stream, run it, and in one
MULTI/EXEC send every reply, XACK and XDEL the sub-batch and its requests
and wake the dispatcher, every write guarded by the instance's fence
(:mod:`workers.acks`). The transaction is what makes each request answered exactly once: a worker that
dies before EXEC leaves the sub-batch pending, and its replacement (same
consumer name) delivers it again; one that dies after has nothing pending.
On Redis Cluster the replies (in other slots) are written just before that
transaction instead, so the same failure answers the sub-batch twice: at
least once (:mod:`packrat_mq.replies`).

No input ends the process: any exception while decoding or running a
sub-batch becomes error replies for that sub-batch, and any error of an
iteration of the loop (Redis gone, a consumer group lost to a Redis restart)
is logged, counted in the instance hash (``loop_errors``) and retried with
exponential backoff. A heartbeat thread keeps the instance hash current even
while a long batch runs, so the dispatcher and ``status`` can tell a busy
instance from a dead one.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

import redis
from pydantic import Field

from packrat_mq import graph as graph_modes
from packrat_mq import logs, protocol, replies, shared_payloads
from packrat_mq.backoff import Backoff
from packrat_mq.connection import check_cluster, connect
from packrat_mq.graph import GraphModeError
from packrat_mq.handler import BaseHandler, Input, Outcome, run_batch
from packrat_mq.keys import WORKER_GROUP
from packrat_mq.metrics import WORKER_HISTOGRAMS, Tally, count_replies
from packrat_mq.records import InstanceState
from packrat_mq.recovery import recover
from packrat_mq.settings import Settings
from workers import acks, rebinding, runtime
from workers.launch import read_spec
from workers.runtime import RuntimeSpec

log = logging.getLogger("packrat_mq.worker")

#: How long an idle worker blocks on its queue: also how long it may take to notice SIGTERM
#: (a reconfiguration waits for retired instances to exit). Four reads a second cost nothing.
READ_BLOCK_MS = 250
#: How many recent sub-batch times (with their sizes) the record's served time is taken from.
SERVED_WINDOW = 20
#: A sub-batch begun within this long of the end of the one before ran back to back, as a profile
#: times batches, and only those are timed for the record: after a pause the model's memory is cold
#: (a lone MiniLM request ran 1.4x its back-to-back time after 20 ms, 2.9x after 200 ms; docs/figures.md),
#: and an idle trickle of lone ResNet-50 requests set the profile check at 1.16-1.19x, which the
#: estimator then applied to every plan under load.
BACK_TO_BACK_S = 0.005
#: How often a held first sub-batch looks whether the instances leaving its cores are done (:meth:`Worker.hand_over`).
HANDOVER_POLL_S = 0.005


def served_fields(served: Iterable[tuple[int, float]]) -> dict[str, Any]:
    """The record's ``served_batch``, ``served_ms`` and ``served_batches`` from recent (size, ms) of sub-batches.

    The size most of them had (of equals, the latest's), the median time of
    those and how many they were: what the supervisor holds against the
    profile's latency at that size. By the size served, not the instance's
    planned share: a reshare, or a change that keeps an instance, gives it a
    new share without telling the process, which kept timing batches of the
    old size (a ResNet-50 served at B=8 for 45 s had its check stuck at the
    ratio of its first B=1 batches, 1.19, applied to every plan).
    """
    served = list(served)
    if not served:
        return {"served_batch": None, "served_ms": None, "served_batches": 0}
    counts = Counter(size for size, _ in served)
    most = max(counts.values())
    size = next(size for size, _ in reversed(served) if counts[size] == most)
    times = [ms for s, ms in served if s == size]
    return {"served_batch": size, "served_ms": statistics.median(times), "served_batches": len(times)}


class WorkerSpec(RuntimeSpec):
    """Everything a worker process needs: what it runs (:class:`RuntimeSpec`) and where it serves."""

    url: str
    settings: Settings
    #: A sub-batch delivered this many times (its worker died each time) is
    #: answered with an error instead of being run again.
    max_deliveries: int = 3
    #: The supervisor's pid: the worker stops when it is no longer its parent
    #: (a SIGKILLed supervisor must not leave instances running unsupervised).
    parent_pid: int | None = None
    #: Start as a spare: loaded and warm, but serving no one until a ``serve`` order (:mod:`workers.rebinding`).
    spare: bool = False
    #: The (threads, batch) sizes a spare warms up at while it waits: a ``serve`` order at one of them then
    #: takes no warm-up (see :meth:`Worker.warm_ahead`).
    warm_at: list[tuple[int, int]] = Field(default_factory=list)
    #: Instances leaving on this one's cores (an active-passive change that over-subscribes them): its
    #: first sub-batch waits until they have answered what they hold (:meth:`Worker.hand_over`).
    after: list[str] = Field(default_factory=list)


class Worker:
    """Consumes one instance queue with one handler."""

    def __init__(self, r: redis.Redis, spec: WorkerSpec, handler: BaseHandler | None = None) -> None:
        check_cluster(r, spec.settings)
        self.r = r
        self.spec = spec
        self.handler = handler
        self.settings = spec.settings
        self.keys = self.settings.keys
        self.queue = self.keys.queue(spec.model, spec.instance_id)
        self.requests_stream = self.keys.requests(spec.model)
        self.instance_key = self.keys.instance(spec.model, spec.instance_id)
        self.fence = self.keys.fence(spec.model, spec.instance_id)
        self.payload_files = self.settings.payload_files
        #: One read buffer per position in a sub-batch, for .npy payloads in shared memory.
        self._payload_buffers: list[shared_payloads.PayloadBuffer] = []
        #: Producers' sealed payloads (``payload_fd``), mapped and kept: read in place.
        self.sealed = shared_payloads.SealedMaps()
        self._stopping = threading.Event()
        self._recovering = True
        self._last_beat = 0.0
        self._state = "starting"
        self.batches = 0
        self.backoff = Backoff()
        #: (threads, batch) this process has run a batch at (warm-up or serving): a rebind to one of them
        #: needs no warm-up.
        self.warmed: set[tuple[int, int]] = {(spec.threads, spec.batch)}
        #: Seconds from this process's creation to loaded (``InstanceState.load_s``; None until it is).
        self.load_s: float | None = None
        #: What it counts for the metrics while they are on, published in its record at every
        #: heartbeat for its supervisor's exporter: no command of its own on the request path.
        self.tally = Tally(WORKER_HISTOGRAMS) if self.settings.metrics_port else None
        #: ``inference_ms`` of the last full-size sub-batches at the current binding, and how many
        #: it served: its record carries their median, which the supervisor holds against the
        #: profile (:mod:`optimizer.planning.drift`).
        #: (size, inference_ms) of the last sub-batches run back to back whose every request reached
        #: the handler.
        self._served: deque[tuple[int, float]] = deque(maxlen=SERVED_WINDOW)
        #: When the last sub-batch ended (monotonic), and whether the one being served began right after.
        self._done_at: float | None = None
        self._back_to_back = False
        #: Instances leaving this one's cores, to wait for before the next sub-batch (:meth:`hand_over`).
        self._after: list[str] = list(spec.after)
        self._held_s: float | None = None

    def stop(self) -> None:
        self._stopping.set()

    # --- live state -------------------------------------------------------
    def record(self) -> InstanceState:
        """This instance's live record (its counters are incremented where they change)."""
        s = self.spec
        return InstanceState(state=self._state, pid=os.getpid(), host=socket.gethostname(),
                             interval=self.settings.heartbeat_s, heartbeat=time.time(), threads=s.threads,
                             batch=s.batch, cpus=s.cpus, socket=s.socket,
                             **served_fields(self._served), held_s=self._held_s,
                             load_s=self.load_s,
                             metrics=self.tally.dump() if self.tally is not None else None)

    def register(self, state: str) -> None:
        """Write the whole record with a new state (and join the model's instance index)."""
        self._state = state
        self._write_record()

    def _write_record(self) -> None:
        # The whole record every time, not only the heartbeat field: after a
        # Redis restart without persistence the next beat restores it.
        pipe = self.r.pipeline(transaction=False)
        self.record().save(pipe, self.instance_key)
        pipe.sadd(self.keys.instances(self.spec.model), self.spec.instance_id)
        pipe.execute()
        self._last_beat = time.monotonic()

    def heartbeat(self) -> None:
        """Renew the record if a heartbeat interval has passed."""
        if time.monotonic() - self._last_beat >= self.settings.heartbeat_s:
            self._write_record()

    def _beat_forever(self) -> None:
        """Heartbeat thread: beats while the main thread runs long batches."""
        while not self._stopping.wait(self.settings.heartbeat_s):
            try:
                self.heartbeat()
            except Exception as exc:  # noqa: BLE001 - a missed beat is retried next interval
                log.debug("heartbeat failed: %s", exc)

    # --- loop -------------------------------------------------------------
    def read(self, block_ms: int = READ_BLOCK_MS) -> list[tuple[bytes, dict[bytes, bytes]]]:
        if self._recovering:
            resp = self.r.xreadgroup(WORKER_GROUP, self.spec.instance_id, {self.queue: "0"}, count=1)
            entries = resp[0][1] if resp else []
            if entries:
                return entries
            self._recovering = False
        resp = self.r.xreadgroup(WORKER_GROUP, self.spec.instance_id, {self.queue: ">"}, count=1, block=block_ms)
        return resp[0][1] if resp else []

    def run(self) -> None:
        # A new process of this instance: whatever an earlier one held was handed back when the fence was set.
        self.r.delete(self.fence)
        self.register("spare" if self.spec.spare else "ready")
        log.info("instance %s ready on cpus %s", self.spec.instance_id, self.spec.cpus)
        beat = threading.Thread(target=self._beat_forever, name="heartbeat", daemon=True)
        beat.start()
        while not self._stopping.is_set():
            if self.spec.parent_pid is not None and os.getppid() != self.spec.parent_pid:
                log.warning("supervisor (pid %d) is gone; instance %s stops", self.spec.parent_pid, self.spec.instance_id)
                break
            try:
                self.run_once()
                self.backoff.success()
            except Exception as exc:  # noqa: BLE001 - one failed iteration never ends the instance
                self._recover(exc)
        self._stopping.set()
        beat.join(self.settings.heartbeat_s + 1)
        try:
            self.register("stopped")
        except redis.RedisError as exc:
            log.warning("could not record the stop: %s", exc)

    def run_once(self, block_ms: int = READ_BLOCK_MS) -> int:
        """Read and serve what is there (at most one sub-batch); returns how many were served.

        Heartbeats are the heartbeat thread's (see :meth:`run`), not this loop's.
        """
        entries = self.read(block_ms)
        for entry_id, fields in entries:
            self.process(entry_id, fields)
        return len(entries)

    def _recover(self, exc: Exception) -> None:
        """After a failed iteration: see :func:`packrat_mq.recovery.recover`; then re-read pending work."""
        # A sub-batch read before the failure may still be pending here.
        self._recovering = True
        delay = recover(self.r, exc, stream=self.queue, group=WORKER_GROUP, record=InstanceState,
                        record_key=self.instance_key, interval=self.settings.heartbeat_s,
                        rewrite_record=lambda: self.register(self._state), backoff=self.backoff,
                        who=f"instance {self.spec.instance_id}", log=log)
        self._stopping.wait(delay)

    def _deliveries(self, entry_id: bytes) -> int:
        info = self.r.xpending_range(self.queue, WORKER_GROUP, min=entry_id, max=entry_id, count=1)
        return int(info[0]["times_delivered"]) if info else 1

    def process(self, entry_id: bytes, fields: dict[bytes, bytes] | None) -> None:
        """Run one sub-batch and reply to each of its requests, atomically with the ack."""
        began = time.monotonic()
        self._back_to_back = self._done_at is not None and began - self._done_at <= BACK_TO_BACK_S
        try:
            self._process(entry_id, fields)
        finally:
            self._done_at = time.monotonic()

    def _process(self, entry_id: bytes, fields: dict[bytes, bytes] | None) -> None:
        if not fields:
            self._finish(entry_id, [])
            return
        if rebinding.is_order(fields):
            self.rebind(entry_id, fields)
            return
        try:
            requests = protocol.decode_subbatch(fields)
        except Exception as exc:  # noqa: BLE001
            # Only the dispatcher writes here; a broken entry is a bug, not input.
            log.error("unreadable sub-batch %s dropped: %s", entry_id, exc)
            self._finish(entry_id, [])
            return
        if self._after:
            self.hand_over()
        self.fetch_payloads(requests)
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
        try:
            outcomes, inference_ms = self._serve(requests, started_ms)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, this sub-batch alone fails
            log.exception("instance %s: sub-batch %s failed outside the handler", self.spec.instance_id, entry_id)
            outcomes = [Outcome(error=f"internal error serving this batch: {type(exc).__name__}: {exc}")
                        for _ in requests]
            inference_ms = 0.0
        self._finish(entry_id, requests, outcomes, started_ms=started_ms, inference_ms=inference_ms)

    def rebind(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        """Carry out a supervisor's order (:mod:`workers.rebinding`), then acknowledge it.

        A ``serve`` order re-pins and re-threads the loaded model and warms
        it up at the new batch size; the record says ``starting`` meanwhile
        and ``ready`` with the new binding after, which is what the
        supervisor waits for. If it fails the process stops: the
        supervisor starts a new one with the new binding, which takes the
        order again.
        """
        try:
            order = rebinding.parse(fields)
        except ValueError as exc:
            log.error("unreadable order %s dropped: %s", entry_id, exc)
            self._ack(entry_id)
            return
        if order.role == "spare":
            self.spec = self.spec.model_copy(update={"spare": True})
            self._state = "spare"
        else:
            new = self.spec.model_copy(update={"threads": order.threads, "batch": order.batch, "cpus": order.cpus,
                                               "socket": order.socket, "pin": order.pin, "spare": False,
                                               "after": order.after})
            self._after = list(order.after)
            self._held_s = None
            self.register("starting")
            began = time.monotonic()
            try:
                assert self.handler is not None, "no handler: serve after workers.runtime.start"
                runtime.rebind(self.handler, new, warm_up=(new.threads, new.batch) not in self.warmed)
                self.warmed.add((new.threads, new.batch))
            except Exception:  # noqa: BLE001 - the supervisor starts a fresh process with the new binding
                log.exception("instance %s could not be rebound to %d threads on cpus %s; stopping",
                              self.spec.instance_id, order.threads, order.cpus)
                self._stopping.set()
                return
            self.spec = new
            self._served.clear()  # times at the old threads say nothing of the new ones
            self._state = "ready"
            log.info("instance %s rebound to %d threads, batch %d, cpus %s in %.2f s", new.instance_id,
                     new.threads, new.batch, new.cpus, time.monotonic() - began)
        self._write_record()
        self._ack(entry_id)

    def hand_over(self) -> float:
        """Wait until the instances leaving this one's cores have answered what they hold; the seconds waited.

        An active-passive change on a machine without free cores starts its
        new instances on the cores of the ones they replace, and those still
        answer the sub-batches they hold after the switch. Run side by side,
        the two sets do not share the cores, they fight over them: OpenMP
        threads of each wait at every barrier for a thread the other one's
        has preempted. ResNet-50 on two cores (2026-12-05, ``bench_corun``),
        one 2-thread instance at b=8 beside two 1-thread ones at b=16: its
        batch took 3.3-3.5x as long as alone, theirs 2.0-2.1x, and the three
        together served 16.2-16.8 images/s, where either set alone serves
        20.5-21.7. So the first
        sub-batch after the change waits (in this instance's queue, where
        nothing is lost) until the leaving instances' queues are empty: one
        sub-batch each at most, run at full speed (the dispatcher keeps one
        waiting per instance). At most ``handover_timeout_s``: a leaving
        instance that died mid-drain holds its queue until the dispatcher
        takes it back, and this one does not wait for that. Their queues
        are read, not their records, since a sub-batch leaves its queue in
        the transaction that answers it.
        """
        timeout = self.settings.handover_timeout_s
        queues = [self.keys.queue(self.spec.model, instance) for instance in self._after]
        began = time.monotonic()
        while queues and timeout > 0 and not self._stopping.is_set():
            pipe = self.r.pipeline(transaction=False)
            for queue in queues:
                pipe.xlen(queue)
            if not any(pipe.execute()):
                break
            if time.monotonic() - began >= timeout:
                log.warning("instance %s: %s still hold work after %.1f s; serving beside them",
                            self.spec.instance_id, ", ".join(self._after), timeout)
                break
            self._stopping.wait(HANDOVER_POLL_S)
        held = time.monotonic() - began
        self._after = []
        self._held_s = round(held, 3)
        self._write_record()
        log.info("instance %s: took over its cores after %.3f s", self.spec.instance_id, held)
        return held

    def warm_ahead(self) -> None:
        """A spare warms up at each (threads, batch) its supervisor's plans give instances.

        A ``serve`` order warms the instance at its new size before it says
        ``ready``; during an active-passive change that warm-up runs on the
        cores the old instances still serve on: two ResNet-50 spares warming
        at b=2 took 0.6-0.8 s of a 2.1-2.9 s switch on two cores. A spare has
        the time before any change (it is pre-started only while the machine
        is quiet), so it runs one batch at each size then, and a rebind to
        one of them skips the warm-up. At every thread count the plans have,
        not its own alone: on 64 simulated cores (12-07) the plans' instances
        have 2 to 16 threads, every spare started at one, and each of the 32
        rebound by the step's move to B=32 warmed up for 57 ms before the
        switch. Only where the model runs any batch size as it is (eager, or
        TorchScript): a backend built for one size is built again at a rebind
        anyway. It goes back to its own threads and batch after.
        """
        if not self.spec.spare or self.handler is None:
            return
        if self.spec.graph_mode and self.spec.graph_mode not in graph_modes.ANY_BATCH:
            return
        moved, current = False, self.spec.threads
        for threads, b in self.spec.warm_at:
            if (threads, b) in self.warmed or self._stopping.is_set():
                continue
            if threads == current:  # the thread count it runs at now (its own, or the last one moved to)
                runtime.warm(self.handler, b)
            else:
                runtime.rebind(self.handler, self.spec.model_copy(update={"threads": threads, "batch": b}))
                moved, current = True, threads
            self.warmed.add((threads, b))
        if moved:
            runtime.rebind(self.handler, self.spec, warm_up=False)

    def _ack(self, entry_id: bytes) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(self.queue, WORKER_GROUP, entry_id)
        pipe.xdel(self.queue, entry_id)
        pipe.execute()

    def fetch_payloads(self, requests: list[protocol.Request]) -> None:
        """Read the sub-batch's payloads from the request stream, where the producer wrote them.

        The dispatcher hands each instance a run of consecutive requests, so
        one ``XRANGE first last COUNT n`` nearly always returns exactly them
        (0.33 ms for 128 small entries, against 1.8 ms for one ``XRANGE id
        id`` each). Any request it did not return (another instance's or a
        deleted entry between them cut the run short) is read by id. A
        request whose entry is gone (deleted or trimmed by someone else)
        keeps ``payload=None`` and is answered with an error. A request whose
        entry names a payload file in shared memory (``payload_shm``) gets the
        file's bytes, or, if they cannot be read, the reason as its error.
        Nothing is fetched of a request whose payload, or the name of its
        file, came with the sub-batch (``carried``, small ones: see
        :func:`packrat_mq.protocol.encode_subbatch`).
        """
        wanted = []
        for slot, req in enumerate(requests):
            if req.carried and (req.payload_shm is not None or req.payload_fd is not None):
                self._read_file(req, slot)
            elif not (req.inline or req.carried):
                wanted.append((slot, req))
        if not wanted:
            return
        first, last = wanted[0][1].stream_id, wanted[-1][1].stream_id
        found = {sid.decode(): fields for sid, fields in self.r.xrange(self.requests_stream, first, last, count=len(wanted))}
        missing = []
        for slot, req in wanted:
            fields = found.get(req.stream_id)
            if fields is None:
                missing.append((slot, req))
            else:
                self._take_payload(req, fields, slot)
        if missing:
            pipe = self.r.pipeline(transaction=False)
            for _, req in missing:
                pipe.xrange(self.requests_stream, req.stream_id, req.stream_id)
            for (slot, req), entries in zip(missing, pipe.execute()):
                if entries:
                    self._take_payload(req, entries[0][1], slot)

    def _take_payload(self, req: protocol.Request, fields: dict[bytes, bytes], slot: int) -> None:
        name = shared_payloads.name_of(fields)
        fd_ref = fields.get(shared_payloads.FD_FIELD_BYTES)
        if fd_ref is not None:
            req.payload_fd = fd_ref.decode("ascii", "replace")
        elif name is None:
            req.payload = fields.get(b"payload")
            return
        else:
            req.payload_shm = name
            req.payload_shm_keep = shared_payloads.kept(fields)
        self._read_file(req, slot)

    def _read_file(self, req: protocol.Request, slot: int) -> None:
        """Read ``req``'s payload file (``req.payload_shm``), or map its sealed payload (``req.payload_fd``),
        or set why it cannot be had as its error."""
        if req.payload_fd is not None:
            try:
                view = self.sealed.read(req.payload_fd, self.settings.max_payload_bytes)
                # An .npy array is decoded in place (its array views the map); other decoders take bytes.
                req.payload = view if req.content_type == protocol.NPY else bytes(view)
            except shared_payloads.SharedPayloadError as exc:
                req.fetch_error = str(exc)
            return
        assert req.payload_shm is not None
        # An .npy array is decoded in place: read into this batch position's reusable buffer.
        buffer = None
        if req.content_type == protocol.NPY:
            if slot >= len(self._payload_buffers):
                self._payload_buffers.append(shared_payloads.PayloadBuffer())
            buffer = self._payload_buffers[slot]
        try:
            req.payload = self.payload_files.read(req.payload_shm, self.settings.max_payload_bytes, into=buffer)
        except shared_payloads.SharedPayloadError as exc:
            req.fetch_error = str(exc)

    def _serve(self, requests: list[protocol.Request], started_ms: float) -> tuple[list[Outcome], float]:
        outcomes: list[Outcome | None] = [None] * len(requests)
        items: list[Input] = []
        positions: list[int] = []
        for k, req in enumerate(requests):
            if req.deadline_ms is not None and req.deadline_ms <= started_ms:
                outcomes[k] = Outcome(error=f"deadline exceeded before inference ({started_ms - req.deadline_ms:.0f} ms late)")
                continue
            if req.fetch_error is not None:
                outcomes[k] = Outcome(error=req.fetch_error)
                continue
            if req.payload is None:
                outcomes[k] = Outcome(error="the request is no longer in the request stream "
                                            "(deleted or trimmed before it was served)")
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
            assert self.handler is not None, "no handler: serve after workers.runtime.start"
            result = run_batch(self.handler, items)
            inference_ms = result.inference_ms
            if self._back_to_back and len(items) == len(requests) and inference_ms > 0:
                self._served.append((len(items), inference_ms))
            for k, outcome in zip(positions, result.outcomes):
                outcomes[k] = outcome
        return [o or Outcome(error="no result") for o in outcomes], inference_ms

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
        stats = self.keys.stats(s.model)
        if self.keys.cluster and self.r.exists(self.fence):
            # There the replies are written before the transaction (packrat_mq.replies): not when fenced.
            self._fenced(entry_id)
            return
        pairs = []
        for req, outcome in zip(requests, outcomes or []):
            timing = {
                # Not clamped at 0: a negative value says the worker's clock is
                # behind Redis's (the request's time is its stream id), which
                # a clamp would hide.
                "queue_ms": started_ms - req.enqueued_ms,
                "inference_ms": inference_ms,
                "batch_size": len(requests),
                "instance": s.instance_id,
                "model": s.model,
            }
            if outcome.ok:
                try:
                    payload, ctype = protocol.encode_payload(outcome.value)
                except Exception as exc:  # noqa: BLE001 - a bad value fails its own request only
                    outcome = Outcome(error=f"handler output could not be encoded: {exc}")
                else:
                    pairs.append((req.reply_to, protocol.reply_fields(req.id, payload=payload, content_type=ctype,
                                                                      **timing)))
            if not outcome.ok:
                pairs.append((req.reply_to, protocol.error_reply(req.id, outcome.error or "error", **timing)))
        # The requests themselves, left in the request stream by the dispatcher (owned by this instance).
        fetched = [req.stream_id for req in requests if req.stream_id and not req.inline]
        with self.r.pipeline(transaction=True) as pipe:
            # Every write checks the fence (a dispatcher that took this instance for dead handed its
            # requests to others and set it): all of the transaction happens, or none (workers.acks).
            delivery = replies.queue(self.r, pipe, pairs, ttl_s=self.settings.reply_ttl_s, stats_key=stats,
                                     guard=self.fence)
            at = len(pipe)  # after the replies (or, on Redis Cluster, their counters)
            acks.queue_ack(pipe, self.keys, s.model, s.instance_id, entry_id, fetched)
            results = replies.execute(pipe, f"instance {s.instance_id}", delivery)
        ran, errors = acks.outcome(results[at])
        if not ran:
            self._fenced(entry_id)
            return
        for error in errors:
            log.warning("instance %s: a command acknowledging sub-batch %s failed: %s", s.instance_id,
                        entry_id.decode(), error)
        # Answered and deleted for good: their payload files are done with (never before the commit,
        # so that a worker that dies first leaves them for the instance that serves them again).
        shm_files = [req.payload_shm for req in requests if req.payload_shm and not req.payload_shm_keep]
        if shm_files:
            self.payload_files.discard(shm_files)
        for reply_to, group in delivery.undelivered():
            ids = ", ".join(str(f["id"]) for f in group)
            log.warning("instance %s: reply_to %r is not a stream; replies to %s were not written",
                        s.instance_id, reply_to, ids)
        self.batches += 1
        if self.tally is not None and requests:
            self._count(requests, delivery, started_ms, inference_ms)

    def _fenced(self, entry_id: bytes) -> None:
        """Its requests were handed to other instances (it was taken for dead): reply nothing, and stop.

        Its supervisor, if alive, starts it again, and the new process lifts the fence.
        """
        log.error("instance %s: its requests were handed back to the dispatcher (it was taken for dead); "
                  "sub-batch %s not answered here, stopping", self.spec.instance_id, entry_id.decode())
        self._stopping.set()

    def _count(self, requests: list[protocol.Request], delivery: replies.Delivery, started_ms: float,
               inference_ms: float) -> None:
        """The sub-batch in the metrics' tally (in memory; the heartbeat publishes it)."""
        tally = self.tally
        assert tally is not None
        answered_ms = time.time() * 1000.0
        tally.observe("sub_batch_size", len(requests))
        if inference_ms > 0:  # 0: nothing ran (every request failed before the handler)
            tally.observe("inference", inference_ms / 1000.0)
        enqueued_ms = [req.enqueued_ms for req in requests]
        tally.observe_many("queue", [(started_ms - e) / 1000.0 for e in enqueued_ms])
        tally.observe_many("end_to_end", [(answered_ms - e) / 1000.0 for e in enqueued_ms])
        count_replies(tally, delivery.grouped, delivery.results)


def loaded_s() -> float | None:
    """Seconds since this process was created (the kernel's start time: a few ms after its parent spawned it);
    None where the kernel does not say (not Linux).

    Timed here, not by the supervisor: it sees a spare loaded at its next
    check, and on 64 simulated cores its checks came half a second apart, so
    a spare loaded in 0.64 s, past one check, read 1.06 s, and one in 0.5 s
    read 0.52 (12-08). Both ends on the clock since boot, to the kernel's tick
    (10 ms): ``psutil``'s ``create_time`` adds the boot time, which the kernel
    gives to the whole second, and read 0.25 s long here.
    """
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime: ticks since boot
        return round(max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started), 3)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> int:
    spec = WorkerSpec.model_validate_json(read_spec(argv))
    logs.configure(spec.settings, f"worker {spec.instance_id}")
    worker = Worker(connect(spec.url), spec)
    worker.register("starting")
    try:
        worker.handler = runtime.start(spec)
        worker.load_s = loaded_s()
        worker.warm_ahead()
    except GraphModeError as exc:
        # The model and the backend asked for do not go together: one line that says so and what
        # to choose instead (a traceback would only bury it), and no start.
        log.error("instance %s cannot start: %s", spec.instance_id, exc)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
