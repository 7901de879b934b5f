"""Live state in Redis: the typed records of instances, dispatchers and supervisors.

Each record is a pydantic model written and read only here, after rq's
``Worker.serialize()``/``refresh()``: :meth:`LiveRecord.save` writes the
whole record and renews its TTL, :meth:`LiveRecord.load` reads it back,
:meth:`LiveRecord.count` increments one of its counters (counters are
incremented where they change and never overwritten by a save), and
:meth:`LiveRecord.mark` changes its state. Every write renews the TTL, so the
record of a process that is gone (a SIGKILLed supervisor and its children)
disappears by itself a few heartbeats later.

A record whose heartbeat is older than :data:`STALE_AFTER` intervals belongs
to a process that is gone or hung, whatever its ``state`` field still says:
:meth:`LiveRecord.effective_state` reads it as ``stale``, ``status`` shows it
so and the dispatcher sends it nothing. Ages are measured with the reader's
clock against the writer's: the processes of one deployment are expected to
share a clock (one host, or NTP-synchronised hosts).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import redis
from pydantic import BaseModel, ConfigDict, ValidationError

#: Heartbeat intervals after which a record is stale.
STALE_AFTER = 3.0
#: Heartbeat intervals after which a record no one renews expires.
EXPIRE_AFTER = 30.0
#: Shortest TTL, so that a supervisor backing off a crash loop (up to 30 s
#: between restarts) keeps the record of the instance it is restarting.
MIN_TTL_S = 60
#: States written by a live process that a stale heartbeat contradicts.
LIVE_STATES = ("starting", "ready", "spare")


def ttl_for(interval_s: float) -> int:
    """Seconds a record lives without being written again."""
    return max(MIN_TTL_S, math.ceil(EXPIRE_AFTER * interval_s))


class LiveRecord(BaseModel):
    """What every supervised process says about itself."""

    model_config = ConfigDict(extra="ignore")

    #: Incremented with :meth:`count`, never written by :meth:`save`.
    COUNTERS: ClassVar[tuple[str, ...]] = ("restarts", "loop_errors", "groups_recreated")
    #: List fields, stored comma-separated, and their item type.
    LISTS: ClassVar[dict[str, type]] = {}

    state: str = "starting"
    pid: int | None = None
    host: str = ""
    #: Seconds between heartbeats, as the writer was configured.
    interval: float = 1.0
    #: Wall-clock time of the last write (``time.time()``); 0 when never written.
    heartbeat: float = 0.0
    restarts: int = 0
    loop_errors: int = 0
    groups_recreated: int = 0
    #: The process's metrics tally as JSON (:meth:`packrat_mq.metrics.Tally.dump`), written with
    #: every heartbeat while metrics are on, for the exporter of its supervisor; None: off.
    metrics: str | None = None

    # --- writing ------------------------------------------------------
    def fields(self) -> dict[str, str]:
        """The hash fields :meth:`save` writes (every field but the counters)."""
        out: dict[str, str] = {}
        for name, value in self.model_dump().items():
            if name in self.COUNTERS or value is None:
                continue
            if isinstance(value, bool):
                value = int(value)
            elif isinstance(value, (list, tuple)):
                value = ",".join(map(str, value))
            out[name] = str(value)
        return out

    def save(self, r: Any, key: str) -> None:
        """Write the whole record (but its counters) and renew its TTL; ``r`` may be a pipeline."""
        r.hset(key, mapping=self.fields())
        r.expire(key, ttl_for(self.interval))

    @classmethod
    def count(cls, r: Any, key: str, counter: str, n: int = 1, *, interval: float = 1.0,
              renew: bool = True) -> None:
        """Increment ``counter`` by ``n`` and renew the TTL; ``r`` may be a pipeline.

        ``renew=False`` is for a process counting its own work on the request
        path (every batch): its heartbeat renews the TTL anyway, and HINCRBY
        keeps the TTL a key has.
        """
        if counter not in cls.COUNTERS:
            raise ValueError(f"{cls.__name__} has no counter {counter!r}")
        r.hincrby(key, counter, n)
        if renew:
            r.expire(key, ttl_for(interval))

    @classmethod
    def mark(cls, r: Any, key: str, state: str, *, interval: float = 1.0) -> None:
        """Set the state alone (a supervisor about to restart the process) and renew the TTL."""
        r.hset(key, "state", state)
        r.expire(key, ttl_for(interval))

    # --- reading ------------------------------------------------------
    @classmethod
    def parse(cls, raw: Mapping[bytes | str, bytes | str]) -> Any:
        """A record from a hash as HGETALL returns it; ``None`` when empty.

        An unreadable field (a record written by another version) is left at
        its default rather than losing the whole record.
        """
        if not raw:
            return None
        data: dict[str, Any] = {}
        for k, v in raw.items():
            name = k.decode() if isinstance(k, bytes) else k
            data[name] = v.decode(errors="replace") if isinstance(v, bytes) else v
        for name, item in cls.LISTS.items():
            if name in data:
                data[name] = _split(str(data[name]), item)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            bad = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
            return cls.model_validate({k: v for k, v in data.items() if k not in bad})

    @classmethod
    def load(cls, r: redis.Redis, key: str) -> Any:
        """The record at ``key``, or ``None`` when there is none (never written, or expired)."""
        return cls.parse(r.hgetall(key))

    def effective_state(self, now: float) -> str:
        """``state``, or ``stale`` when a live state's heartbeat is too old to believe."""
        return _judge(self.state, self.heartbeat, self.interval, now)

    #: The fields :meth:`liveness` reads: a hot-path reader (the dispatcher,
    #: before every batch) fetches these with HMGET instead of the whole record.
    LIVENESS_FIELDS: ClassVar[tuple[str, str, str]] = ("state", "heartbeat", "interval")

    @staticmethod
    def liveness(values: list[bytes | None], now: float) -> str | None:
        """:meth:`effective_state` from an HMGET of :attr:`LIVENESS_FIELDS`; ``None`` when there is no record."""
        state, beat, interval = values
        if state is None:
            return None
        return _judge(state.decode(errors="replace"), _float(beat), _float(interval), now)

    def heartbeat_age(self, now: float) -> float | None:
        return round(now - self.heartbeat, 3) if self.heartbeat > 0 else None


class InstanceState(LiveRecord):
    """A worker instance (``<prefix>:instance:<model>:<id>``)."""

    COUNTERS: ClassVar[tuple[str, ...]] = (*LiveRecord.COUNTERS, "batches")
    LISTS: ClassVar[dict[str, type]] = {"cpus": int}

    threads: int = 1
    batch: int = 1
    cpus: list[int] = []
    socket: int = 0
    batches: int = 0
    #: Of its last sub-batches run back to back at these threads (``workers.worker.served_fields``): the size most had,
    #: their median ``inference_ms`` and how many they were; what the supervisor holds against the
    #: profile at (threads, ``served_batch``). A record without ``served_batch`` (an older worker)
    #: timed sub-batches of its ``batch``.
    served_batch: int | None = None
    served_ms: float | None = None
    served_batches: int = 0
    #: Seconds its first sub-batch after a change waited for the instances leaving its cores (a handover).
    held_s: float | None = None
    #: Seconds from this process's creation to loaded and warm at its own size, as the process itself timed
    #: it (what the supervisor publishes the median of, ``Supervisor.process_start_s``). A spare's warm-up
    #: ahead at the plans' other sizes comes after, and is not in it: an instance started for a change skips it.
    load_s: float | None = None


class DispatcherState(LiveRecord):
    """The dispatcher of one model (``<prefix>:dispatcher:<model>``)."""

    COUNTERS: ClassVar[tuple[str, ...]] = (*LiveRecord.COUNTERS, "batches")
    LISTS: ClassVar[dict[str, type]] = {"nodes": str, "served": str}

    #: The bound on the request stream this dispatcher enforces.
    max_backlog: int | None = None
    batches: int = 0
    #: The deployment generation it dispatches to, and its B: written as soon as it
    #: switches (at a batch boundary), so a supervisor knows no sub-batch goes to
    #: an older generation's instances any more.
    generation: int | None = None
    batch: int | None = None
    #: With a deployment of several nodes, each node's generation it dispatches to (``node=generation``).
    nodes: list[str] = []
    #: The estimator (``dispatcher.estimation``): whether it chooses B, Q̃, B̃, and a B asked for.
    adaptive: bool = False
    q_tilde: float | None = None
    b_tilde: int | None = None
    requested_batch: int | None = None
    #: What each B was measured to serve under a backlog, which the estimator reads in place of its plan
    #: (``B=requests/s``, e.g. ``8=23.0``; ``dispatcher.estimation.Policy.learn``).
    served: list[str] = []

    def generation_of(self, node: str) -> int | None:
        """The generation of ``node``'s instances it dispatches to (``generation`` when it names no node at all)."""
        for item in self.nodes:
            name, _, gen = item.rpartition("=")
            if name == node and gen.isdigit():
                return int(gen)
        # A document of several nodes that does not name this one yet: it serves none of this node's.
        return None if self.nodes else self.generation


class SupervisorState(LiveRecord):
    """The supervisor of one model on one node (``<prefix>:supervisor:<model>:<node>``)."""

    LISTS: ClassVar[dict[str, type]] = {"instances": str, "profile_ratios": str}

    node: str = ""
    generation: int = 1
    #: Ids of the instances it runs.
    instances: list[str] = []
    with_dispatcher: bool = True
    #: Whether the dispatcher's estimator chooses B for this deployment.
    adaptive: bool = False
    #: A reconfiguration in progress: its phase (warming, switching, draining, stopping) and target.
    phase: str = ""
    target: str = ""
    #: Spare instances loaded, and how many it keeps (see ``workers.rebinding``).
    spares: int = 0
    spares_wanted: int = 0
    #: Seconds one of its processes takes from start to loaded (the median of the last spares loaded alone;
    #: ``Supervisor.process_start_s``), and how many CPUs its processes load on side by side. None: not
    #: measured yet.
    process_start_s: float | None = None
    start_cpus: int = 1
    #: Served / profiled latency, the median over its instances at their own (t, b)
    #: (``optimizer.planning.drift``); None until measured or without a profile.
    profile_ratio: float | None = None
    #: The same by instance thread count, ``threads=ratio``, each the last measured within
    #: ``workers.supervisor.THREAD_RATIO_TTL_S`` (a layout not serving now keeps its last measure).
    profile_ratios: list[str] = []

    def ratios_by_threads(self) -> dict[int, float]:
        """``profile_ratios`` parsed (items that do not parse are left out)."""
        out = {}
        for item in self.profile_ratios:
            threads, _, ratio = item.partition("=")
            try:
                t, r = int(threads), float(ratio)
            except ValueError:
                continue
            if t > 0 and r > 0:
                out[t] = r
        return out


def _judge(state: str, heartbeat: float, interval: float, now: float) -> str:
    if state in LIVE_STATES:
        beat_every = interval if interval > 0 else 1.0
        if heartbeat <= 0 or now - heartbeat > STALE_AFTER * beat_every:
            return "stale"
    return state


def _float(raw: bytes | None) -> float:
    try:
        return float(raw) if raw is not None else 0.0
    except ValueError:
        return 0.0


def _split(text: str, item: type) -> list[Any]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if item is int:
        return [int(p) for p in parts if p.lstrip("-").isdigit()]
    return parts


class NodeState(LiveRecord):
    """A node pool serving registered models (``<prefix>:node:<node>``)."""

    LISTS: ClassVar[dict[str, type]] = {"models": str, "free_cpus": int}

    node: str = ""
    #: The models it serves now.
    models: list[str] = []
    #: Physical cores it has and those no model holds.
    cores: int = 0
    free_cpus: list[int] = []
