"""packrat-mq on Redis Cluster: 3 masters with a replica each, on loopback (tests/redis_cluster.py).

A model's keys carry its hash tag, so each model lives on one master and
its transactions stay single-slot; replies, in other slots, are written
before the transaction that acknowledges them: at least once, and the
client keeps the first reply to an id (docs/decisions.md, "Redis Cluster").
"""
from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from redis.cluster import RedisCluster

from dispatcher.dispatcher import Dispatcher
from packrat_mq import protocol, replies
from packrat_mq.client import Client
from packrat_mq.connection import check_cluster, connect
from packrat_mq.deployment import Deployment, InstanceRecord
from packrat_mq.keys import DISPATCHER_GROUP, WORKER_GROUP, Keys
from packrat_mq.settings import Settings
from packrat_mq.streams import ensure_group
from packrat_mq.zoo.testing import EchoHandler
from tests import helpers
from tests.cli_run import PASSWORD, Started, assert_one_line_failure, free_port, run_cli
from tests.cli_run import password_server  # noqa: F401 - a fixture of these tests
from tests.helpers import hand_out
from tests.redis_cluster import LocalCluster
from workers.worker import Worker, WorkerSpec

pytestmark = [pytest.mark.timeout(240)]

#: Two model names whose hash tags fall on different masters of a three-master cluster
#: (slots 865 and 15419 of 0-5460, 5461-10922, 10923-16383).
MODELS = ("alpha", "beta")


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """:func:`tests.helpers.wait_for` through a failover: a refused or redirected command counts as not yet."""
    helpers.wait_for(predicate, timeout, what, ignore=(redis.RedisError, AssertionError))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture
def rc(cluster: LocalCluster) -> Iterator[redis.Redis]:
    client = connect(cluster.url)
    yield client
    client.close()


@pytest.fixture
def cluster_settings(cluster: LocalCluster, prefix: str) -> Settings:
    return Settings(redis_url=cluster.url, prefix=prefix, batch_timeout_ms=2.0, heartbeat_s=0.2)


def _short_read(w: Worker, block_ms: int = 100) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return Worker.read(w, min(block_ms, 100))


@pytest.fixture
def service(cluster: LocalCluster, rc: redis.Redis, cluster_settings: Settings) -> Iterator[None]:
    """For each of MODELS a dispatcher and one echo instance (batch 2), each in a thread, on the cluster."""
    processes: list[Dispatcher | Worker] = []
    for model in MODELS:
        dep = Deployment(model=model, handler="echo", instances=[InstanceRecord(id="i0", threads=1, batch=2)])
        rc.set(cluster_settings.keys.config(model), dep.model_dump_json())
        spec = WorkerSpec(url=cluster.url, settings=cluster_settings, model=model, handler="echo",
                          instance_id="i0", batch=2)
        handler = EchoHandler()
        handler.initialize(spec.context())
        w = Worker(connect(cluster.url), spec, handler)
        ensure_group(w.r, w.queue, WORKER_GROUP)
        w.read = functools.partial(_short_read, w)  # type: ignore[method-assign]
        processes += [Dispatcher(connect(cluster.url), cluster_settings, model), w]
    threads = [threading.Thread(target=p.run, daemon=True) for p in processes]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        for p in processes:
            p.stop()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
        for p in processes:
            p.r.close()


def test_a_cluster_url_gives_a_cluster_client_and_a_node_url_is_refused(cluster: LocalCluster, prefix: str) -> None:
    r = connect(cluster.url)
    try:
        assert isinstance(r, RedisCluster) and r.ping()
    finally:
        r.close()
    # Any one node finds the others.
    one = connect(f"redis+cluster://127.0.0.1:{cluster.ports[-1]}")
    try:
        assert len(one.get_primaries()) == 3
    finally:
        one.close()
    ok = run_cli("status", "--redis-url", cluster.url, "--prefix", prefix, "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["models"] == [], ok.stderr
    assert not ok.leftovers
    refused = run_cli("status", "--redis-url", f"redis://127.0.0.1:{cluster.ports[0]}/0", "--prefix", prefix)
    assert_one_line_failure(refused, says="redis+cluster://")
    with pytest.raises(ValueError, match="cluster client"):
        check_cluster(redis.Redis(), Settings(redis_url=cluster.url))


def test_a_cluster_url_without_a_cluster_fails_in_one_line(password_server: Any) -> None:
    nobody = run_cli("status", "--redis-url", f"redis+cluster://127.0.0.1:{free_port()}")
    assert_one_line_failure(nobody, says="cannot use Redis Cluster at redis+cluster://127.0.0.1:")
    plain = password_server.url(":" + quote(PASSWORD, safe="")).replace("redis://", "redis+cluster://")
    not_a_cluster = run_cli("status", "--redis-url", plain.removesuffix("/0"))
    assert_one_line_failure(not_a_cluster, PASSWORD, says="is not a cluster")


def test_each_model_lives_on_its_own_master_and_every_request_is_answered_once(
        cluster: LocalCluster, rc: redis.Redis, cluster_settings: Settings, service: None) -> None:
    keys = cluster_settings.keys
    masters = {m: cluster.master_of(keys.requests(m)) for m in MODELS}
    assert len(set(masters.values())) == len(MODELS), masters
    for m in MODELS:  # the transactions' keys are on the model's master
        for key in (keys.queue(m, "i0"), keys.fence(m, "i0"), keys.stats(m), keys.dispatcher(m), keys.config(m)):
            assert cluster.master_of(key) == masters[m], key
    c = Client(rc, prefix=cluster_settings.prefix)
    assert c.keys.cluster
    sent = {m: [{"model": m, "i": i} for i in range(20)] for m in MODELS}
    ids = {m: c.send_many(m, items) for m, items in sent.items()}
    for m in MODELS:
        got = c.gather(ids[m], timeout=60)
        assert [rep.value() for rep in got] == sent[m]
        assert {rep.fields["model"] for rep in got} == {m}
    assert c.duplicates == 0
    # A request the dispatcher refuses is answered from outside its fan-out transaction, once.
    bad = c.send("alpha", b"x", content_type="bad/type")
    (rep,) = c.gather([bad], timeout=30)
    assert not rep.ok and rep.error.startswith("unknown content_type")
    # On a cluster the reply (another slot) is written before the transaction that counts it,
    # so the counters catch up just after the reply arrives (docs/decisions.md, "Redis Cluster").
    want = {"requests": 21, "replies": 21, "rejected": 1, "errors": 1}

    def counted() -> bool:
        stats = {k.decode(): int(v) for k, v in rc.hgetall(keys.stats("alpha")).items()}
        assert {k: stats.get(k) for k in want} == want, stats
        return True

    wait_for(counted, 10, "the refused request counted")
    for m in MODELS:
        assert rc.xlen(keys.requests(m)) == 0
        assert rc.xpending(keys.requests(m), DISPATCHER_GROUP)["pending"] == 0


def test_deadline_reads_block_on_the_streams_master_and_follow_it_through_a_failover(
        cluster: LocalCluster, rc: redis.Redis, cluster_settings: Settings) -> None:
    """The dispatcher's blocking read ends at its deadline on a cluster too, not on the server's tick.

    Without it a partial batch is polled (every ``batch_poll_ms``), which
    takes CPU from the instances; the read and its ``CLIENT UNBLOCK`` must
    reach the one master that owns the stream's slot.
    """
    stream = cluster_settings.keys.requests("alpha")
    ensure_group(rc, stream, DISPATCHER_GROUP)
    d = Dispatcher(connect(cluster.url), cluster_settings, "alpha")
    try:
        d.setup()
        assert d.waiter.precise and d.aggregator.server_tick_ms == 0.0
        w = d.waiter
        for block_ms in (5, 30):
            t0 = time.monotonic()
            assert w.read(DISPATCHER_GROUP, "c", stream, 1, block_ms) is None
            elapsed = (time.monotonic() - t0) * 1000
            # The server alone ends BLOCK 5 on its next cron tick (hz 10: 90-101 ms).
            assert block_ms <= elapsed + 1 and elapsed < block_ms + 60, elapsed
        threading.Timer(0.02, lambda: rc.xadd(stream, {"x": "1"})).start()
        resp = w.read(DISPATCHER_GROUP, "c", stream, 1, 5000)
        assert resp is not None and resp[0][1][0][1] == {b"x": b"1"}
        # The stream's master hands its slots to its replica: the next reads reach the new master.
        old = cluster.master_of(stream)
        cluster.failover(cluster.replica_of(old))
        assert cluster.master_of(stream) != old

        def reads_again() -> bool:
            rc.xadd(stream, {"x": "2"})
            got = w.read(DISPATCHER_GROUP, "c", stream, 1, 200)
            return got is not None and got[0][1][0][1] == {b"x": b"2"}

        wait_for(reads_again, 30, "a deadline read on the new master")
        assert w._node is not None and w._node.connection_pool.connection_kwargs["port"] == cluster.master_of(stream)
        t0 = time.monotonic()
        while w.read(DISPATCHER_GROUP, "c", stream, 10, 5) is not None:  # what the retries left
            pass
        assert (time.monotonic() - t0) < 5
    finally:
        d.close()
        d.r.close()
        rc.delete(stream)


def test_the_sweep_scans_every_master_and_names_the_tagged_stream(
        rc: redis.Redis, cluster_settings: Settings, service: None) -> None:
    keys = cluster_settings.keys
    c = Client(rc, prefix=cluster_settings.prefix)
    rc.xadd(keys.requests("nosuch"), protocol.request_fields("n1", c.reply_to, b"{}", protocol.JSON))
    # A producer that writes the one-Redis name on a cluster: no dispatcher reads it.
    untagged = Keys(cluster_settings.prefix).requests("alpha")
    rc.xadd(untagged, protocol.request_fields("u1", c.reply_to, b"{}", protocol.JSON))
    nosuch, wrong = c.gather(["n1", "u1"], timeout=60)
    assert nosuch.error.startswith("unknown model 'nosuch'")
    assert f"is {keys.requests('alpha')!r}" in wrong.error and "Redis Cluster" in wrong.error
    # On a cluster the replies go out before the XDEL that follows them (they cannot share its
    # transaction), so a client can read its answer a moment before the entry is gone.
    deadline = time.monotonic() + 5
    while (rc.xlen(untagged) or rc.xlen(keys.requests("nosuch"))) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rc.xlen(untagged) == 0 and rc.xlen(keys.requests("nosuch")) == 0
    assert c.duplicates == 0


@pytest.mark.parametrize("mode", ["one Redis", "Redis Cluster"])
def test_a_failure_between_the_replies_and_their_ack(mode: str, request: pytest.FixtureRequest, r: redis.Redis,
                                                     settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's transaction fails once, after its replies are written on a cluster, before on one Redis.

    One Redis: nothing of it took effect; the sub-batch is served again and
    each request answered once. Redis Cluster: the replies were written
    already, so each request is answered twice, with its own id; the client
    keeps the first. Either way the requests are acknowledged once and gone.
    """
    if mode == "Redis Cluster":
        cluster: LocalCluster = request.getfixturevalue("cluster")
        client = connect(cluster.url)
        s = Settings(redis_url=cluster.url, prefix=settings.prefix, heartbeat_s=0.2)
    else:
        client, s = connect(settings.redis_url or ""), settings.model_copy(update={"heartbeat_s": 0.2})
    spec = WorkerSpec(url=s.redis_url or "", settings=s, model="alpha", handler="echo", instance_id="i0", batch=2)
    handler = EchoHandler()
    handler.initialize(spec.context())
    w = Worker(client, spec, handler)
    ensure_group(client, w.queue, WORKER_GROUP)
    c = Client(client, prefix=s.prefix, client_id="c")
    now = int(time.time() * 1000)
    reqs = [protocol.Request(id=f"r{i}", reply_to=c.reply_to, payload=b'{"i": %d}' % i, content_type=protocol.JSON,
                             enqueued_ms=now, stream_id="") for i in range(2)]
    hand_out(client, w.keys, "alpha", "i0", reqs)

    real, failed = replies.execute, []

    def fail_once(pipe: Any, who: str, delivery: Any = None) -> list[Any]:
        if not failed:
            failed.append(who)
            pipe.reset()  # the EXEC never reaches Redis
            raise redis.ConnectionError("connection lost before EXEC (injected)")
        return real(pipe, who, delivery)

    monkeypatch.setattr(replies, "execute", fail_once)
    thread = threading.Thread(target=w.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: failed and client.xlen(w.requests_stream) == 0, 30, "the requests acknowledged")
    finally:
        w.stop()
        thread.join(10)
    written = [f[b"id"].decode() for _, f in client.xrange(c.reply_to)]
    assert sorted(written) == (["r0", "r1"] if mode == "one Redis" else ["r0", "r0", "r1", "r1"])
    got = c.gather(["r0", "r1"], timeout=10)
    assert [rep.value() for rep in got] == [{"i": 0}, {"i": 1}]
    assert c.duplicates == (0 if mode == "one Redis" else 2)
    assert client.xlen(w.queue) == 0 and client.xpending(w.queue, WORKER_GROUP)["pending"] == 0
    assert client.xpending(w.requests_stream, DISPATCHER_GROUP)["pending"] == 0
    c.close()
    client.close()


# --- failover end to end -------------------------------------------------------------------------
def _ready(r: Any, keys: Keys, model: str) -> bool:
    instances = [i.decode() for i in r.smembers(keys.instances(model))]
    return (r.hget(keys.dispatcher(model), "state") == b"ready" and bool(instances)
            and all(r.hget(keys.instance(model, i), "state") == b"ready" for i in instances))


class Producer:
    """Producers speaking the wire format with plain redis-py: per model, a request every ``every_s``.

    One thread per model, so a model whose master is away holds up none of
    the others. An XADD that fails (the master failing over) is sent again
    with the same id until it is accepted: the documented way on a cluster,
    where the first reply to an id is its answer.
    """

    def __init__(self, port: int, keys: Keys, models: tuple[str, ...], every_s: float = 0.03) -> None:
        self.r = RedisCluster(host="127.0.0.1", port=port)  # redis-py's own defaults, as any producer's
        self.keys, self.models, self.every_s = keys, models, every_s
        #: Where each model's replies go: a stream tagged with the other master's model, so a
        #: reply written is never on the master this test kills (Redis replicates asynchronously).
        self.reply_to = {m: keys.replies(f"{{{models[-1]}}}-{m}") for m in models}
        self.sent: dict[str, list[str]] = {m: [] for m in models}
        self.errors = 0
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._send, args=(m,), daemon=True) for m in models]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(30)

    def _send(self, m: str) -> None:
        n = 0
        while not self.stopping.is_set():
            rid = f"{m}-{n}"
            fields = protocol.request_fields(rid, self.reply_to[m], json.dumps({"n": n}).encode(), protocol.JSON)
            while not self.stopping.is_set():
                try:
                    self.r.xadd(self.keys.requests(m), fields)
                except (redis.RedisError, redis.exceptions.RedisClusterException):
                    self.errors += 1
                    time.sleep(0.2)
                    continue
                self.sent[m].append(rid)
                break
            n += 1
            self.stopping.wait(self.every_s)

    def answered(self, m: str) -> list[str]:
        return [f[b"id"].decode() for _, f in self.r.xrange(self.reply_to[m])]

    def longest_silence_s(self, m: str) -> float:
        """The longest time between two replies to ``m`` (by their stream ids: the reply master's clock)."""
        times = [protocol.entry_ms(eid) for eid, _ in self.r.xrange(self.reply_to[m])]
        return max((b - a for a, b in zip(times, times[1:])), default=0) / 1000.0

    def replies(self, m: str) -> list[dict[bytes, bytes]]:
        return [f for _, f in self.r.xrange(self.reply_to[m])]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_models_on_two_masters_lose_nothing_while_a_master_fails_over(tmp_path: Path, prefix: str) -> None:
    """`packrat-mq up` serves echo and sleep (on different masters) through two failovers of echo's master.

    First a manual one (CLUSTER FAILOVER on its replica: the master hands
    over in step), then a crash (SIGKILL of the new master; the old one, now
    its replica, takes over after the node timeout). Every request is
    answered; a second reply to an id is allowed (at least once) and counted.
    """
    keys = Keys(prefix, cluster=True)
    with LocalCluster(tmp_path / "cluster") as cluster:
        first = cluster.master_of(keys.requests("echo"))
        assert cluster.master_of(keys.requests("sleep")) != first
        env = {"PACKRAT_HEARTBEAT_S": "0.2", "PACKRAT_LOG_LEVEL": "WARNING"}
        common = ("--prefix", prefix, "--redis-url", cluster.url, "--batch-timeout-ms", "2")
        ups = [Started("up", "--model", "echo", "--instances", "1x2", *common, env=env),
               Started("up", "--model", "sleep", "--instances", "1x2", "--option", "base_ms=5", *common, env=env)]
        producer = None
        try:
            probe = connect(cluster.url)
            wait_for(lambda: _ready(probe, keys, "echo") and _ready(probe, keys, "sleep"), 120, "both models ready")
            producer = Producer(cluster.ports[-1], keys, ("echo", "sleep"))
            producer.start()

            def served_more(n: int) -> Any:
                base = {m: len(producer.answered(m)) for m in producer.models}
                return lambda: all(len(producer.answered(m)) >= base[m] + n for m in producer.models)

            wait_for(served_more(20), 60, "both models serving")
            second = cluster.replica_of(first)
            cluster.failover(second)
            wait_for(lambda: cluster.master_of(keys.requests("echo")) == second, 60, "the replica to take over")
            wait_for(served_more(20), 90, "both models serving after the manual failover")
            cluster.kill(second)
            wait_for(lambda: cluster.master_of(keys.requests("echo")) == first, 90, "the old master to take over")
            wait_for(served_more(20), 120, "both models serving after the crash")
            producer.stop()
            for m in producer.models:
                wait_for(lambda m=m: set(producer.sent[m]) <= set(producer.answered(m)), 120,
                         f"a reply to every {m} request")
            for m in producer.models:
                got = producer.replies(m)
                ids = [f[b"id"].decode() for f in got]
                assert set(ids) == set(producer.sent[m]), f"{m}: replies to ids never sent"
                assert all(f[b"status"] == b"ok" for f in got), [f for f in got if f[b"status"] != b"ok"][:3]
            duplicates = sum(len(producer.answered(m)) - len(producer.sent[m]) for m in producer.models)
            gaps = {m: producer.longest_silence_s(m) for m in producer.models}
            print(f"sent {sum(len(v) for v in producer.sent.values())}, duplicates {duplicates}, "
                  f"producer retries {producer.errors}, longest time without a reply {gaps}")
            # sleep's master never failed: it was served on while echo's master was away.
            assert gaps["sleep"] < gaps["echo"], gaps
            probe.close()
        finally:
            if producer is not None:
                producer.stop()
                producer.r.close()
            runs = [u.finish() for u in ups]
        for run in runs:
            assert run.returncode == 0, run.stdout[-3000:]
            assert not run.leftovers, run.leftovers
            # Every error of the failovers was taken for what it is (a master away for a while),
            # not as a failure of packrat-mq's own (logged with its traceback, counted as a loop error).
            assert "Traceback" not in run.stdout, run.stdout[-6000:]


def test_free_ports_stay_below_the_ephemeral_range_and_avoid_what_was_tried() -> None:
    """Ports (and their bus ports) are drawn where no outgoing connection is handed them."""
    from tests import redis_cluster

    low = redis_cluster._ephemeral_low()
    ports = redis_cluster.free_ports(6)
    assert len(set(ports)) == 6
    assert all(1024 <= p and p + 10000 < low for p in ports)
    again = redis_cluster.free_ports(6, avoid=set(ports))
    assert not set(again) & set(ports)


def test_a_node_that_loses_its_port_starts_again_on_another(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CI failure of 12-07: a node whose port was taken before it bound exited, and the
    start waited 90 s for it. Now the node starts again on another port, and the cluster forms."""
    import socket

    from tests import redis_cluster

    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = int(taken.getsockname()[1])
    real = redis_cluster.free_ports
    calls: list[int] = []

    def first_one_taken(n: int, *, avoid: set[int] | frozenset[int] = frozenset()) -> list[int]:
        calls.append(n)
        ports = real(n, avoid=avoid)
        return [port, *ports[1:]] if len(calls) == 1 else ports

    monkeypatch.setattr(redis_cluster, "free_ports", first_one_taken)
    try:  # before, the start waited out its deadline for the node that had exited, and failed
        with LocalCluster(tmp_path / "c", masters=3, replicas=0) as c:
            assert port not in c.ports and len(c.ports) == 3
            assert c.healthy()
            assert calls == [3, 1]
    finally:
        taken.close()
