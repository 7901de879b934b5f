"""The Prometheus endpoint: what a process exports, and the HTTP server that exports it.

One exporter per serving command, on ``PACKRAT_METRICS_PORT`` (off when
unset) at ``PACKRAT_METRICS_ADDRESS`` (127.0.0.1 by default), path
``/metrics``:

- ``packrat-mq up`` and ``packrat-mq node``: the supervisor's process exports
  its pool (instances by state, restarts, reconfigurations, the instances'
  replies, errors and latencies) and its dispatcher's families (requests,
  rejections, backlog, B, B̃, Q̃, batch sizes, dispatch wait); one port;
- ``packrat-mq pool``: the pool's families alone;
- ``packrat-mq dispatch``: the dispatcher's families alone.

What each process counted comes as :class:`ModelView` objects from
callables given to :func:`serve`, read at every scrape (the processes'
tallies from their live records, gauges from Redis); see
:mod:`packrat_mq.metrics` for how the counting is done and added up. Every
family has a ``model`` label; the families are listed in :data:`FAMILIES`.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

import redis
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from packrat_mq import streams
from packrat_mq.metrics import HISTOGRAMS, Tally
from packrat_mq.records import DispatcherState
from packrat_mq.settings import Settings

log = logging.getLogger("packrat_mq.exposition")

PREFIX = "packrat_"


@dataclass(frozen=True)
class Family:
    """One exported family: its Prometheus name (without ``_total``), type, help, and the tally key it reads."""

    name: str
    kind: str  # counter, gauge, histogram
    help: str
    #: Label names after ``model`` (the tally key's label values, in order).
    labels: tuple[str, ...] = ()
    #: Tally counter or histogram name; gauges have none.
    key: str = ""
    #: Who exports it: the dispatcher's families or the pool's.
    owner: str = "pool"


FAMILIES: tuple[Family, ...] = (
    # --- the dispatcher's ---
    Family("packrat_requests", "counter", "Requests the dispatcher took from the request stream "
           "(dispatched, rejected or refused as overloaded).", key="requests", owner="dispatcher"),
    Family("packrat_partial_batches", "counter", "Batches dispatched before they were full (the batch timeout).",
           key="partial_batches", owner="dispatcher"),
    Family("packrat_batch_size", "histogram", "Size of each aggregated batch the dispatcher fanned out.",
           key="batch_size", owner="dispatcher"),
    Family("packrat_dispatch_wait_seconds", "histogram", "Each dispatched request's wait from its XADD to its "
           "fan-out to an instance (request stream and aggregation).", key="dispatch_wait", owner="dispatcher"),
    Family("packrat_request_stream_length", "gauge", "XLEN of the request stream: waiting and in flight.",
           owner="dispatcher"),
    Family("packrat_backlog", "gauge", "Requests no dispatcher has read yet (XLEN less pending entries).",
           owner="dispatcher"),
    Family("packrat_batch_current", "gauge", "B: the aggregated batch the dispatcher serves now.", owner="dispatcher"),
    Family("packrat_batch_estimated", "gauge", "B̃: the estimator's batch (mode of the last estimates).",
           owner="dispatcher"),
    Family("packrat_queue_estimated", "gauge", "Q̃: the estimator's smoothed request stream length (EWMA).",
           owner="dispatcher"),
    Family("packrat_batch_requested", "gauge", "The B the estimator asked the supervisor for and is waiting for.",
           owner="dispatcher"),
    Family("packrat_adaptive", "gauge", "1 while the estimator chooses B, 0 while B is pinned.", owner="dispatcher"),
    Family("packrat_generation", "gauge", "The deployment generation the dispatcher serves.", owner="dispatcher"),
    # --- the pool's (its worker instances and supervisor) ---
    Family("packrat_sub_batch_size", "histogram", "Size of each sub-batch an instance ran.", key="sub_batch_size"),
    Family("packrat_inference_seconds", "histogram", "Handler time of each sub-batch "
           "(preprocess, inference, postprocess; the reply's inference_ms).", key="inference"),
    Family("packrat_queue_seconds", "histogram", "Each request's wait from its XADD to the start of its batch "
           "on an instance (the reply's queue_ms).", key="queue"),
    Family("packrat_end_to_end_seconds", "histogram", "Each request's time from its XADD to its reply written.",
           key="end_to_end"),
    Family("packrat_instances", "gauge", "Worker instances by state (ready, starting, restarting, stale, stopped, "
           "missing) and role (active, passive while warming, retiring).", labels=("state", "role")),
    Family("packrat_restarts", "counter", "Processes the supervisor started again after they died.",
           labels=("process",), key="restarts"),
    Family("packrat_reconfigurations", "counter", "Reconfigurations carried out, by kind (reshare, scale, "
           "active-passive), status (done, failed) and origin (estimator, cli, ...).",
           labels=("kind", "status", "origin"), key="reconfigurations"),
    Family("packrat_reconfiguration_seconds", "histogram", "How long each reconfiguration took, from the decision "
           "to the old instances stopped.", key="reconfiguration"),
    Family("packrat_reconfiguring", "gauge", "1 while a reconfiguration is in progress.", labels=("phase",)),
    # --- both: each exports what its own processes wrote ---
    Family("packrat_replies", "counter", "Replies written, by status (ok, error).", labels=("status",),
           key="replies", owner="both"),
    Family("packrat_errors", "counter", "Requests that failed, by kind (bad_request, too_large, deadline, "
           "overloaded, unanswerable, bad_payload, invalid_input, inference, worker_died, gone, internal, "
           "bad_output, undeliverable).", labels=("kind",), key="errors", owner="both"),
)


@dataclass
class ModelView:
    """What one exporter knows about one model at one scrape."""

    model: str
    #: The counts of every process it speaks for, added up.
    tally: Tally
    #: Whether it speaks for the model's dispatcher, its pool, or both.
    dispatcher: bool = False
    pool: bool = False
    #: The dispatcher's live record (B, B̃, Q̃, generation); None when there is none.
    dispatcher_state: DispatcherState | None = None
    #: (XLEN, pending) of the request stream; None when Redis did not answer.
    stream: tuple[int, int] | None = None
    #: Instances by (state, role).
    instances: dict[tuple[str, str], int] = field(default_factory=dict)
    #: The phase of a reconfiguration in progress; "" when none.
    phase: str = ""


def read_stream(r: redis.Redis, stream: str, group: str) -> tuple[int, int] | None:
    """(XLEN, pending entries of ``group``) of a request stream, or None when Redis does not answer."""
    try:
        backlog, pending = streams.read_backlog(r, stream, group)
    except redis.RedisError as exc:
        log.debug("metrics: cannot read %s: %s", stream, exc)
        return None
    return backlog + pending, pending


def _counter_samples(tally: Tally, key: str) -> Iterator[tuple[tuple[str, ...], float]]:
    head = key + "|"
    for name, value in tally.counters.items():
        if name == key:
            yield (), value
        elif name.startswith(head):
            yield tuple(name[len(head):].split("|")), value


def _histogram(family: HistogramMetricFamily, model: str, tally: Tally, key: str) -> None:
    h = tally.histograms.get(key)
    counts = h.counts if h is not None else [0] * (len(HISTOGRAMS[key]) + 1)
    total = h.sum if h is not None else 0.0
    buckets, running = [], 0
    for bound, n in zip((*HISTOGRAMS[key], float("inf")), counts):
        running += n
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    family.add_metric([model], buckets, total)


#: Counter samples every view of an owner shows from the start, so a dashboard reads 0, not "no data".
_ZERO: dict[str, tuple[tuple[str, ...], ...]] = {
    "requests": ((),), "partial_batches": ((),), "replies": (("ok",), ("error",)), "restarts": (("instance",),),
}


def _gauges(view: ModelView) -> dict[str, list[tuple[tuple[str, ...], float]]]:
    out: dict[str, list[tuple[tuple[str, ...], float]]] = {}
    if view.dispatcher:
        if view.stream is not None:
            length, pending = view.stream
            out["packrat_request_stream_length"] = [((), length)]
            out["packrat_backlog"] = [((), max(0, length - pending))]
        d = view.dispatcher_state
        if d is not None:
            for name, value in (("packrat_batch_current", d.batch), ("packrat_batch_estimated", d.b_tilde),
                                ("packrat_queue_estimated", d.q_tilde), ("packrat_batch_requested", d.requested_batch),
                                ("packrat_generation", d.generation)):
                if value is not None:
                    out[name] = [((), float(value))]
            out["packrat_adaptive"] = [((), 1.0 if d.adaptive else 0.0)]
    if view.pool:
        out["packrat_instances"] = [(labels, n) for labels, n in sorted(view.instances.items())]
        out["packrat_reconfiguring"] = [((view.phase or "none",), 1.0 if view.phase else 0.0)]
    return out


def render(views: list[ModelView]) -> list[Metric]:
    """The families of ``views`` (one sample set per model), as prometheus_client metric families."""
    out: list[Metric] = []
    gauges = [_gauges(v) for v in views]
    for fam in FAMILIES:
        labels = ["model", *fam.labels]
        shown = [v for v in views if (fam.owner == "both" and (v.dispatcher or v.pool))
                 or (fam.owner == "dispatcher" and v.dispatcher) or (fam.owner == "pool" and v.pool)]
        if not shown:
            continue
        if fam.kind == "counter":
            metric: Metric = CounterMetricFamily(fam.name, fam.help, labels=labels)
            for v in shown:
                samples = dict(_counter_samples(v.tally, fam.key))
                for zero in _ZERO.get(fam.key, ()):
                    samples.setdefault(zero, 0.0)
                for values, n in sorted(samples.items()):
                    if len(values) == len(fam.labels):
                        metric.add_metric([v.model, *values], n)
        elif fam.kind == "histogram":
            metric = HistogramMetricFamily(fam.name, fam.help, labels=["model"])
            for v in shown:
                _histogram(metric, v.model, v.tally, fam.key)
        else:
            metric = GaugeMetricFamily(fam.name, fam.help, labels=labels)
            for v, g in zip(views, gauges):
                for values, n in g.get(fam.name, []):
                    metric.add_metric([v.model, *values], n)
        out.append(metric)
    return out


Views = Callable[[], list[ModelView]]


class _Collector:
    """A prometheus_client collector that asks for the views at every scrape."""

    def __init__(self, views: Views) -> None:
        self.views = views

    def collect(self) -> Iterator[Metric]:
        try:
            views = self.views()
        except Exception:  # noqa: BLE001 - a scrape must not take the exporter (or its process) down
            log.exception("metrics: collecting failed")
            return
        yield from render(views)


class ExporterError(RuntimeError):
    """The metrics endpoint could not listen (a port in use, an address not of this host)."""


class Exporter:
    """A running metrics endpoint (an HTTP server in a daemon thread); :meth:`close` stops it."""

    def __init__(self, server: WSGIServer, thread: threading.Thread, address: str, port: int) -> None:
        self.server, self.thread = server, thread
        self.address, self.port = address, port

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(2.0)

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(settings: Settings, views: Views) -> Exporter | None:
    """Export ``views`` (and this process's CPU and memory) on ``http://<metrics_address>:<metrics_port>/metrics``.

    None when ``metrics_port`` is unset: metrics are off. Raises
    :class:`ExporterError` when the address cannot be bound.
    """
    address, port = settings.metrics_address, settings.metrics_port
    if port is None:
        return None
    registry = CollectorRegistry()
    registry.register(_Collector(views))  # type: ignore[arg-type]
    ProcessCollector(registry=registry)
    try:
        server, thread = start_http_server(port, address, registry)
    except OSError as exc:
        raise ExporterError(f"cannot serve metrics on {address}:{port}: {exc.strerror or exc}") from None
    return Exporter(server, thread, address, port)
