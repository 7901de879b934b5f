"""Metrics: the tallies, their sums, the exported families, and a real ``up`` scraped over HTTP."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.dispatcher import Dispatcher
from packrat_mq import protocol
from packrat_mq.client import Client
from packrat_mq.deployment import Deployment, InstanceRecord
from packrat_mq.exposition import FAMILIES, ExporterError, ModelView, render, serve
from packrat_mq.instances import Configuration
from packrat_mq.keys import WORKER_GROUP
from packrat_mq.metrics import HISTOGRAMS, WORKER_HISTOGRAMS, Tally, Totals
from packrat_mq.records import DispatcherState, InstanceState
from packrat_mq.settings import Settings
from packrat_mq.streams import ensure_group
from packrat_mq.zoo.testing import EchoHandler
from tests.helpers import hand_out, interrupt, wait_for
from workers.supervisor import Supervisor
from workers.worker import Worker, WorkerSpec

MODEL = "m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``/metrics`` as {sample name: {sorted labels: value}}."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(metrics: dict[str, Any], name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels``; 0 when there is none."""
    found = [v for k, v in metrics.get(name, {}).items() if set(labels.items()) <= set(k)]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else 0.0


# --- off unless asked -----------------------------------------------------------
def test_metrics_are_off_when_the_port_is_unset(r: redis.Redis, settings: Settings,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings.metrics_port is None
    assert serve(settings, lambda: []) is None
    d = Dispatcher(r, settings, MODEL)
    assert d.tally is None and d.record().metrics is None
    d.heartbeat("ready")
    assert DispatcherState.load(r, settings.keys.dispatcher(MODEL)).metrics is None
    spec = WorkerSpec(url="", settings=settings, model=MODEL, handler="echo", instance_id="i0")
    assert Worker(r, spec).tally is None and Worker(r, spec).record().metrics is None
    # Set but empty (docker-compose's METRICS_PORT=) is off too.
    monkeypatch.setenv("PACKRAT_METRICS_PORT", "")
    assert Settings().metrics_port is None
    monkeypatch.setenv("PACKRAT_METRICS_PORT", "9750")
    assert Settings().metrics_port == 9750 and Settings().metrics_address == "127.0.0.1"


def test_a_port_in_use_is_one_clear_error(settings: Settings) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ExporterError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            serve(settings.model_copy(update={"metrics_port": port}), lambda: [])


# --- counting and adding up --------------------------------------------------------
def test_histograms_count_upper_bounds_inclusive_and_survive_json() -> None:
    t = Tally(("batch_size",))
    t.observe_many("batch_size", [1, 1, 2, 3, 5000])
    t.count("errors", "deadline")
    t.count("errors", "deadline", n=2)
    h = t.histograms["batch_size"]
    assert h.counts[:3] == [2, 1, 1] and h.counts[-1] == 1 and h.count == 5 and h.sum == 5007
    back = Tally.load(t.dump())
    assert back is not None and back.counters == {"errors|deadline": 3}
    assert back.histograms["batch_size"].counts == h.counts
    assert Tally.load("not json") is None and Tally.load(None) is None
    # A histogram written with other buckets (another version) is left out, not misread.
    assert "batch_size" not in Tally.load(json.dumps({"c": {}, "h": {"batch_size": [[1, 2], 3]}})).histograms


def test_totals_never_go_down_when_a_process_starts_again() -> None:
    totals = Totals()

    def tally(n: int) -> Tally:
        t = Tally(("inference",))
        t.count("replies", "ok", n=n)
        t.observe_many("inference", [0.001] * n)
        return t

    totals.update("instance:a", 100, tally(5))
    totals.update("instance:a", 100, tally(8))     # the same process, further on
    totals.update("instance:b", 200, tally(1))
    assert totals.total().counters["replies|ok"] == 9
    totals.update("instance:a", 101, tally(2))     # restarted: counts from zero again
    total = totals.total()
    assert total.counters["replies|ok"] == 8 + 2 + 1
    assert total.histograms["inference"].count == 11


def test_error_kinds_follow_the_documented_messages() -> None:
    def rejected(fields: dict[bytes, bytes], **kw: Any) -> str:
        with pytest.raises(protocol.RequestRejected) as info:
            protocol.parse_request(b"1-0", fields, max_payload_bytes=10, **kw)
        return protocol.error_kind(str(info.value))

    ok = {b"id": b"r", b"reply_to": b"x", b"payload": b"{}"}
    assert rejected({b"reply_to": b"x", b"payload": b"{}"}) == "bad_request"
    assert rejected({**ok, b"content_type": b"text/x"}) == "bad_request"
    assert rejected({**ok, b"payload": b"x" * 11}) == "too_large"
    assert rejected({**ok, b"deadline_ms": b"soon"}) == "bad_request"
    assert rejected({**ok, b"deadline_ms": b"1"}) == "deadline"
    assert protocol.error_kind("overloaded: m has more than 5 requests waiting; retry later") == "overloaded"
    assert protocol.error_kind("inference failed for this batch: RuntimeError: x") == "inference"
    assert protocol.error_kind("payload is not valid application/json: x") == "bad_payload"
    assert protocol.error_kind("worker instance died 3 times while serving this batch") == "worker_died"
    assert protocol.error_kind("unknown model 'x'; served models: none") == "unknown_model"
    assert protocol.error_kind("ValueError: empty text") == "invalid_input"


# --- the processes' tallies -----------------------------------------------------------
def test_a_worker_counts_its_sub_batches_and_publishes_them(r: redis.Redis, settings: Settings) -> None:
    on = settings.model_copy(update={"metrics_port": 1})  # on; nothing listens in a worker
    spec = WorkerSpec(url="", settings=on, model=MODEL, handler="echo", instance_id="i0")
    handler = EchoHandler()
    handler.initialize(spec.context())
    w = Worker(r, spec, handler)
    ensure_group(r, w.queue, WORKER_GROUP)
    now = int(time.time() * 1000)
    reply_to = settings.keys.replies("c1")
    reqs = [protocol.Request(id=f"q{i}", reply_to=reply_to, payload=b'{"i": 1}', content_type=protocol.JSON,
                             enqueued_ms=now) for i in range(3)]
    reqs.append(protocol.Request(id="bad", reply_to=reply_to, payload=b"{", content_type=protocol.JSON,
                                 enqueued_ms=now))
    reqs.append(protocol.Request(id="hash", reply_to=f"{settings.prefix}-other:h", payload=b"{}",
                                 content_type=protocol.JSON, enqueued_ms=now))
    r.hset(f"{settings.prefix}-other:h", "a", "b")  # a reply_to that is not a stream
    hand_out(r, settings.keys, MODEL, "i0", reqs)
    for entry_id, fields in w.read(block_ms=50):
        w.process(entry_id, fields)
    w.register("ready")
    tally = Tally.load(InstanceState.load(r, w.instance_key).metrics)
    assert tally is not None
    assert tally.counters == {"replies|ok": 3, "replies|error": 1, "errors|bad_payload": 1,
                              "errors|undeliverable": 1}
    assert set(tally.histograms) == set(WORKER_HISTOGRAMS)
    assert tally.histograms["sub_batch_size"].count == 1 and tally.histograms["sub_batch_size"].sum == 5
    assert tally.histograms["inference"].count == 1
    assert tally.histograms["queue"].count == 5 and tally.histograms["end_to_end"].count == 5
    assert tally.histograms["end_to_end"].sum >= tally.histograms["queue"].sum


def test_packrat_dispatch_exports_the_dispatchers_families(r: redis.Redis, settings: Settings) -> None:
    on = settings.model_copy(update={"metrics_port": free_port()})
    dep = Deployment(model=MODEL, handler="echo", generation=3,
                     instances=[InstanceRecord(id="i0", threads=1, batch=4)])
    r.set(settings.keys.config(MODEL), dep.model_dump_json())
    ensure_group(r, settings.keys.queue(MODEL, "i0"), WORKER_GROUP)
    d = Dispatcher(r, on, MODEL)
    d.setup()
    reply_to = settings.keys.replies("c1")
    for i in range(3):
        r.xadd(settings.keys.requests(MODEL), protocol.request_fields(f"q{i}", reply_to, b"{}", protocol.JSON))
    r.xadd(settings.keys.requests(MODEL), {"id": "nopayload", "reply_to": reply_to})
    r.xadd(settings.keys.requests(MODEL), {"id": "noreply", "payload": b"{}"})
    r.xadd(settings.keys.requests(MODEL), protocol.request_fields("later", reply_to, b"{}", protocol.JSON))
    assert d.run_once(idle_block_ms=50) == 0  # reads the deployment first
    assert d.run_once(idle_block_ms=50) == 4  # B=4: three good, one without payload
    with serve(on, lambda: [d.metrics_view()]) as exporter:
        assert exporter.server.server_address[0] == "127.0.0.1"
        got = scrape(exporter.url)
    assert value(got, "packrat_requests_total", model=MODEL) == 4
    assert value(got, "packrat_errors_total", model=MODEL, kind="bad_request") == 1
    assert value(got, "packrat_replies_total", model=MODEL, status="error") == 1
    assert value(got, "packrat_batch_size_count", model=MODEL) == 1
    assert value(got, "packrat_batch_size_bucket", model=MODEL, le="4.0") == 1
    assert value(got, "packrat_batch_size_bucket", model=MODEL, le="2.0") == 0
    assert value(got, "packrat_dispatch_wait_seconds_count", model=MODEL) == 3
    # Two left in the stream: the one no dispatcher read, and the unanswerable one is gone.
    assert value(got, "packrat_backlog", model=MODEL) == 2
    assert value(got, "packrat_request_stream_length", model=MODEL) == 2 + 3  # the 3 handed out are pending
    assert value(got, "packrat_batch_current", model=MODEL) == 4
    assert value(got, "packrat_generation", model=MODEL) == 3
    assert value(got, "packrat_adaptive", model=MODEL) == 0
    assert "packrat_instances" not in got  # the pool's families are the pool's exporter's
    assert "process_cpu_seconds_total" in got


def test_every_family_renders_for_a_pool_with_its_dispatcher() -> None:
    tally = Tally(HISTOGRAMS)
    view = ModelView(model="m", tally=tally, dispatcher=True, pool=True,
                     dispatcher_state=DispatcherState(batch=2, b_tilde=4, q_tilde=3.5, generation=1, adaptive=True,
                                                      requested_batch=4),
                     stream=(5, 1), instances={("ready", "active"): 2}, phase="warming")
    tally.count("errors", "inference")
    tally.count("reconfigurations", "scale", "done", "estimator")
    names = {m.name for m in render([view])}
    # Counters are named without _total by prometheus_client.
    assert names == {f.name for f in FAMILIES}


# --- a real up, scraped ------------------------------------------------------------------
@pytest.fixture
def up(redis_url: str, r: redis.Redis, prefix: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    cmd = [sys.executable, "-m", "packrat_mq", "up", "--model", "echo", "--instances", "1x1",
           "--redis-url", redis_url, "--prefix", prefix, "--batch-timeout-ms", "2", "--exit-with-parent"]
    env = dict(os.environ, PACKRAT_LOG_LEVEL="WARNING", PACKRAT_METRICS_PORT=str(port), PACKRAT_HEARTBEAT_S="0.2")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: r.hget(f"{prefix}:dispatcher:echo", "state") == b"ready", 60, "up to be ready")
        yield proc, f"http://127.0.0.1:{port}/metrics"
    finally:
        interrupt(proc)


@pytest.mark.timeout(120)
def test_a_running_up_is_scraped_over_http(up: tuple[subprocess.Popen[bytes], str], redis_url: str,
                                           r: redis.Redis, prefix: str) -> None:
    proc, url = up
    client = Client(redis_url, prefix=prefix)
    try:
        for i in range(5):
            assert client.submit("echo", {"i": i}).ok
        bad = client.submit("echo", b"{", content_type=protocol.JSON)
        assert not bad.ok
    finally:
        client.close()

    def counted() -> bool:
        # The dispatcher and the instance publish their counts with their heartbeats (every 0.2 s here).
        got = scrape(url)
        return (value(got, "packrat_replies_total", model="echo", status="ok") >= 5
                and value(got, "packrat_requests_total", model="echo") >= 6)

    wait_for(counted, 15, "the requests and replies in the metrics")
    got = scrape(url)
    assert value(got, "packrat_requests_total", model="echo") == 6
    assert value(got, "packrat_replies_total", model="echo", status="ok") == 5
    assert value(got, "packrat_replies_total", model="echo", status="error") == 1
    assert value(got, "packrat_errors_total", model="echo", kind="bad_payload") == 1
    assert value(got, "packrat_batch_size_count", model="echo") == 6  # one at a time, B=1
    assert value(got, "packrat_sub_batch_size_count", model="echo") == 6
    for name in ("packrat_queue_seconds", "packrat_end_to_end_seconds", "packrat_dispatch_wait_seconds"):
        assert value(got, f"{name}_count", model="echo") == 6, name
    assert value(got, "packrat_inference_seconds_count", model="echo") == 5  # the bad payload never ran
    assert value(got, "packrat_instances", model="echo", state="ready", role="active") == 1
    assert value(got, "packrat_batch_current", model="echo") == 1
    assert value(got, "packrat_backlog", model="echo") == 0
    assert value(got, "packrat_reconfiguring", model="echo") == 0
    assert value(got, "packrat_restarts_total", model="echo", process="instance") == 0

    # A live reconfiguration (a reshare: same instance, B=2) and a restart are counted.
    res = subprocess.run([sys.executable, "-m", "packrat_mq", "reconfigure", "echo", "--instances", "1x2",
                          "--redis-url", redis_url, "--prefix", prefix], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    (iid,) = [i.decode() for i in r.smembers(f"{prefix}:index:instances:echo")]
    os.kill(int(r.hget(f"{prefix}:instance:echo:{iid}", "pid")), signal.SIGKILL)
    wait_for(lambda: value(scrape(url), "packrat_restarts_total", model="echo", process="instance") == 1
             and value(scrape(url), "packrat_instances", model="echo", state="ready", role="active") == 1,
             30, "the restart in the metrics")
    got = scrape(url)
    assert value(got, "packrat_reconfigurations_total", model="echo", kind="reshare", status="done", origin="cli") == 1
    assert value(got, "packrat_reconfiguration_seconds_count", model="echo") == 1
    assert value(got, "packrat_batch_current", model="echo") == 2
    # The restarted instance counts from zero; the exporter's sum does not go back.
    assert value(got, "packrat_replies_total", model="echo", status="ok") == 5
    assert proc.poll() is None


def test_a_pool_without_its_dispatcher_exports_its_own_families_and_keeps_what_retired_instances_counted(
    r: redis.Redis, settings: Settings, redis_url: str
) -> None:
    on = settings.model_copy(update={"metrics_port": 1, "log_level": "WARNING", "heartbeat_s": 0.2})
    sup = Supervisor(r, on, redis_url, MODEL, Configuration.parse("1x2"), handler="echo", node="n1",
                     with_dispatcher=False)
    try:
        sup.start(ready_timeout=60)
        (inst,) = sup.instances
        now = int(time.time() * 1000)
        reqs = [protocol.Request(id=f"q{i}", reply_to=settings.keys.replies("c1"), payload=b"{}",
                                 content_type=protocol.JSON, enqueued_ms=now) for i in range(2)]
        hand_out(r, settings.keys, MODEL, inst.record.id, reqs)  # as the dispatcher elsewhere would
        wait_for(lambda: r.xlen(settings.keys.replies("c1")) == 2, 10, "the replies")
        view = sup.metrics_view()
        assert view.pool and not view.dispatcher and view.stream is None
        assert view.instances == {("ready", "active"): 1}
        names = {m.name for m in render([view])}
        assert "packrat_instances" in names and "packrat_requests" not in names and "packrat_backlog" not in names
    finally:
        sup.stop(timeout=10)
    # The instance stopped and its record is gone; what it counted stays in the pool's sums.
    assert not r.exists(settings.keys.instance(MODEL, inst.record.id))
    view = sup.metrics_view()
    assert view.tally.counters.get("replies|ok") == 2
    assert view.tally.histograms["end_to_end"].count == 2


@pytest.mark.timeout(180)
def test_a_node_exports_every_model_it_serves(redis_url: str, r: redis.Redis, prefix: str) -> None:
    port = free_port()
    env = dict(os.environ, PACKRAT_LOG_LEVEL="WARNING", PACKRAT_METRICS_PORT=str(port), PACKRAT_HEARTBEAT_S="0.2")
    base = ["--redis-url", redis_url, "--prefix", prefix]
    proc = subprocess.Popen([sys.executable, "-m", "packrat_mq", "node", "--node", "mn1", *base], env=env,
                            stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        wait_for(lambda: r.hget(f"{prefix}:node:mn1", "state") == b"ready", 60, "the node pool")
        assert "packrat_instances" not in scrape(url)  # nothing served yet
        res = subprocess.run([sys.executable, "-m", "packrat_mq", "models", "register", "e1", "--handler", "echo",
                              "--node", "mn1", "--instances", "1x1", *base],
                             capture_output=True, text=True, timeout=120, env=env)
        assert res.returncode == 0, res.stderr
        client = Client(redis_url, prefix=prefix)
        assert all(rep.ok for rep in client.submit_many("e1", [{}] * 3))
        client.close()
        wait_for(lambda: value(scrape(url), "packrat_replies_total", model="e1", status="ok") == 3
                 and value(scrape(url), "packrat_requests_total", model="e1") == 3, 15, "e1 in the node's metrics")
        assert value(scrape(url), "packrat_instances", model="e1", state="ready", role="active") == 1
    finally:
        interrupt(proc)


def test_counts_left_in_redis_by_an_earlier_run_are_not_added(r: redis.Redis, settings: Settings,
                                                               redis_url: str) -> None:
    on = settings.model_copy(update={"metrics_port": 1})
    old = Tally()
    old.count("requests", n=7)
    # The last record of the previous run's dispatcher: same key, its own counts.
    DispatcherState(state="stopped", pid=1, heartbeat=time.time() - 5, metrics=old.dump()).save(
        r, settings.keys.dispatcher(MODEL))
    sup = Supervisor(r, on, redis_url, MODEL, Configuration.parse("1x1"), handler="echo", node="n1")
    view = sup.metrics_view()  # nothing started: the instance has no record yet
    assert "requests" not in view.tally.counters
    assert view.instances == {("missing", "active"): 1}
    DispatcherState(state="ready", pid=2, heartbeat=time.time() + 0.001, metrics=old.dump()).save(
        r, settings.keys.dispatcher(MODEL))
    assert sup.metrics_view().tally.counters["requests"] == 7
