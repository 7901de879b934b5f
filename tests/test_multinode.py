"""Several nodes on one Redis: two pools of one model, each on its own CPU, and one dispatcher.

The deployment document holds both nodes' instances (each pool writes its own
part, merged atomically); the dispatcher spreads batches over both; a pool
SIGKILLed mid-load loses nothing and answers nothing twice: the requests its
instances held are handed to the other node once it has been silent for the
grace period (``PACKRAT_NODE_GRACE_S``), behind a fence its workers check.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import redis

from dispatcher.dispatcher import Dispatcher
from packrat_mq import control, protocol
from packrat_mq.deployment import Deployment, InstanceRecord, merge, node_share, publish_part, withdraw_part
from packrat_mq.keys import DISPATCHER_GROUP, WORKER_GROUP, Keys, request_owner
from packrat_mq.records import DispatcherState, SupervisorState
from packrat_mq.settings import Settings
from packrat_mq.streams import ensure_group
from packrat_mq.zoo.testing import EchoHandler
from tests.cli_run import Tracked, run_cli
from tests.helpers import hand_out, terminate_all, wait_for
from packrat_mq.instances import Configuration
from packrat_mq.topology import Topology
from workers.supervisor import Supervisor
from workers.worker import Worker, WorkerSpec


def _part(node: str, generation: int = 1, *, n: int = 1, budget: int = 1) -> Deployment:
    return Deployment(model="m", handler="echo", generation=generation, node=node, threads_budget=budget,
                      instances=[InstanceRecord(id=f"{node}-g{generation}-{i}", threads=1, batch=2, node=node)
                                 for i in range(n)])


def test_the_document_holds_every_nodes_part(r: redis.Redis, prefix: str) -> None:
    keys = Keys(prefix)
    publish_part(r, keys, _part("a"))
    single = Deployment.model_validate_json(r.get(keys.config("m")))
    assert (single.node, single.generation, single.nodes) == ("a", 1, {"a": 1})  # one node: as before
    publish_part(r, keys, _part("b", 3, n=2))
    publish_part(r, keys, _part("a", 2))  # a's new generation leaves b's instances alone
    doc = Deployment.model_validate_json(r.get(keys.config("m")))
    assert [i.id for i in doc.instances] == ["a-g2-0", "b-g3-0", "b-g3-1"]
    assert doc.nodes == {"a": 2, "b": 3} and doc.batch == 6
    assert withdraw_part(r, keys, "m", "a") is not None
    assert [i.id for i in Deployment.model_validate_json(r.get(keys.config("m"))).instances] == ["b-g3-0", "b-g3-1"]
    assert withdraw_part(r, keys, "m", "b") is None and not r.exists(keys.config("m"))


def test_parts_written_at_once_by_many_nodes_all_stay(r: redis.Redis, prefix: str, redis_url: str) -> None:
    keys = Keys(prefix)
    nodes = [f"n{i}" for i in range(8)]

    def write(node: str) -> None:
        c = redis.Redis.from_url(redis_url)
        for gen in range(1, 6):
            publish_part(c, keys, _part(node, gen))

    threads = [threading.Thread(target=write, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    doc = Deployment.model_validate_json(r.get(keys.config("m")))
    assert doc.nodes == {n: 5 for n in nodes}
    assert sorted(i.id for i in doc.instances) == sorted(f"{n}-g5-0" for n in nodes)


def test_a_model_wide_batch_is_shared_by_thread_budgets() -> None:
    budgets = {"a": 3, "b": 1}
    assert [node_share(8, budgets, n) for n in ("a", "b")] == [6, 2]
    assert node_share(7, budgets, "a") + node_share(7, budgets, "b") == 7
    assert node_share(1, {"a": 1, "b": 1}, "b") == 1  # never 0: each node serves something
    assert node_share(8, {"a": 4}, "a") == 8
    assert merge({"a": _part("a", budget=3), "b": _part("b")}).budgets == {"a": 3, "b": 1}  # type: ignore[union-attr]


def test_the_dispatcher_record_says_each_nodes_generation() -> None:
    rec = DispatcherState(generation=3, nodes=["a=3", "b=1"])
    assert (rec.generation_of("a"), rec.generation_of("b"), rec.generation_of("c")) == (3, 1, None)
    assert DispatcherState(generation=2).generation_of("a") == 2  # a document naming no node


# --- two pools as two nodes ------------------------------------------------------------

BASE_MS = 30


def _pool(node: str, cpu: int, redis_url: str, prefix: str, tracked: Tracked, env: dict[str, str]) -> subprocess.Popen[str]:
    out = open(Path(tracked.tmp) / f"{node}.txt", "w")  # noqa: SIM115 - closed with the test's processes
    return subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-m", "packrat_mq", "pool", "-m", "sleep",
                             "-o", f"base_ms={BASE_MS}", "-o", "per_item_ms=0", "-i", "1x2", "--node", node,
                             "--redis-url", redis_url, "--prefix", prefix],
                            stdout=out, stderr=subprocess.STDOUT, text=True, env=tracked.env(env),
                            stdin=subprocess.DEVNULL)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not Path("/usr/bin/taskset").exists(),
                    reason="needs two CPUs and taskset")
def test_two_pools_as_two_nodes_one_killed_mid_load(redis_url: str, prefix: str, r: redis.Redis) -> None:
    keys = Keys(prefix)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    env = {"PACKRAT_HEARTBEAT_S": "0.2", "PACKRAT_NODE_GRACE_S": "1.5", "PACKRAT_BATCH_TIMEOUT_MS": "5"}
    tracked = Tracked()
    procs: list[subprocess.Popen[str]] = []
    stop = threading.Event()
    replies: Counter[str] = Counter()
    by_instance: list[tuple[float, str]] = []
    sent: list[str] = []
    failures: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        c = redis.Redis.from_url(redis_url)
        stream = keys.replies(f"mn-{k}-{uuid.uuid4().hex[:6]}")
        last = "0"
        while not stop.is_set():
            rid = f"c{k}-{uuid.uuid4().hex[:8]}"
            with lock:
                sent.append(rid)
            c.xadd(keys.requests("sleep"), {"id": rid, "reply_to": stream, "payload": json.dumps(k)})
            got = None
            deadline = time.monotonic() + 30
            while got is None and time.monotonic() < deadline:
                resp = c.xread({stream: last}, block=1000, count=10)
                for _, entries in resp or []:
                    for sid, fields in entries:
                        last = sid
                        fid = fields[b"id"].decode()
                        with lock:
                            replies[fid] += 1
                            by_instance.append((time.monotonic(), fields[b"instance"].decode()))
                        if fields[b"status"] != b"ok":
                            failures.append(f"{fid}: {fields[b'error'].decode()}")
                        if fid == rid:
                            got = fields
            if got is None:
                failures.append(f"{rid}: no reply in 30 s")
                return

    try:
        procs.append(_pool("n1", cpus[0], redis_url, prefix, tracked, env))
        procs.append(_pool("n2", cpus[1], redis_url, prefix, tracked, env))

        def both_published() -> bool:
            raw = r.get(keys.config("sleep"))
            return bool(raw) and set(Deployment.model_validate_json(raw).nodes) == {"n1", "n2"}

        wait_for(both_published, 60, "both nodes in the deployment")
        doc = Deployment.model_validate_json(r.get(keys.config("sleep")))
        assert sorted(i.id for i in doc.instances) == ["n1-g1-0", "n2-g1-0"]
        assert {i.node: i.cpus for i in doc.instances} == {"n1": [cpus[0]], "n2": [cpus[1]]}
        wait_for(lambda: all(r.hget(keys.instance("sleep", i), "state") == b"ready"
                             for i in ("n1-g1-0", "n2-g1-0")), 60, "both instances ready")
        out = open(Path(tracked.tmp) / "dispatch.txt", "w")  # noqa: SIM115
        procs.append(subprocess.Popen([sys.executable, "-m", "packrat_mq", "dispatch", "-m", "sleep",
                                       "--redis-url", redis_url, "--prefix", prefix],
                                      stdout=out, stderr=subprocess.STDOUT, text=True, env=tracked.env(env),
                                      stdin=subprocess.DEVNULL))
        clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(6)]
        for t in clients:
            t.start()
        wait_for(lambda: {i for _, i in list(by_instance)} >= {"n1-g1-0", "n2-g1-0"}, 30, "replies from both nodes")
        time.sleep(1.0)
        # Mid-load: n1's instance holds a sub-batch (30 ms of every ~35) when its pool dies.
        wait_for(lambda: r.xpending_range(keys.requests("sleep"), DISPATCHER_GROUP, min="-", max="+", count=1,
                                          consumername=request_owner("n1-g1-0")), 10, "n1 holding requests",
                 interval=0.002)
        procs[0].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        procs[0].wait(10)
        # The other node carries on: it answers during the grace period, and after it everything.
        time.sleep(5.0)
        stop.set()
        for t in clients:
            t.join(40)
        time.sleep(1.0)  # a late second reply would show up here
        assert not failures, failures[:10]
        with lock:
            assert set(replies) == set(sent), set(sent) ^ set(replies)
            assert [rid for rid, n in replies.items() if n != 1] == []
            after = [inst for t, inst in by_instance if t > killed + 0.5]
        assert after and set(after) == {"n2-g1-0"}, Counter(after)
        assert int(r.hget(keys.stats("sleep"), "replies")) == len(sent)
        assert not r.xpending_range(keys.requests("sleep"), DISPATCHER_GROUP, min="-", max="+", count=10,
                                    consumername=request_owner("n1-g1-0"))
        assert r.exists(keys.fence("sleep", "n1-g1-0")) and not r.exists(keys.queue("sleep", "n1-g1-0"))
        assert r.xlen(keys.requests("sleep")) == 0
    finally:
        stop.set()
        terminate_all(procs)
        logs = {f.name: f.read_text()[-3000:] for f in Path(tracked.tmp).glob("*.txt")}
        tracked.leftovers(grace_s=5)
        tracked.close()
        print(logs)  # shown when the test fails


def test_a_slow_instance_taken_for_dead_answers_nothing(r: redis.Redis, redis_url: str, prefix: str) -> None:
    """Its requests go to a live node's instance; its own reply transaction finds the fence and aborts."""
    settings = Settings(redis_url=redis_url, prefix=prefix, batch_timeout_ms=2.0, node_grace_s=0.05)
    keys = settings.keys

    def worker(iid: str) -> Worker:
        spec = WorkerSpec(url=redis_url, settings=settings, model="m", handler="echo", instance_id=iid)
        handler = EchoHandler()
        handler.initialize(spec.context())
        w = Worker(r, spec, handler)
        ensure_group(r, w.queue, WORKER_GROUP)
        return w

    publish_part(r, keys, _part("gone"))
    publish_part(r, keys, _part("live"))
    live = worker("live-g1-0")
    live.register("ready")
    SupervisorState(state="ready", heartbeat=time.time(), interval=60.0, node="live").save(
        r, keys.supervisor("m", "live"))
    slow = worker("gone-g1-0")
    req = protocol.Request(id="q1", reply_to=keys.replies("t"), payload=b'"hi"', content_type="application/json",
                           enqueued_ms=time.time() * 1000)
    hand_out(r, keys, "m", "gone-g1-0", [req])
    held = slow.read(block_ms=10)  # read, still running when its node is taken for dead
    assert held

    d = Dispatcher(r, settings, "m")
    d.setup()
    d.run_once(idle_block_ms=10)  # reads the document
    rec = DispatcherState.load(r, keys.dispatcher("m"))
    assert (rec.generation_of("gone"), rec.generation_of("live")) == (1, 1)  # what the supervisors wait for
    assert d.reclaimer.check(d.deployment) == 0  # silent, but not yet for the grace period
    time.sleep(0.1)
    assert d.reclaimer.check(d.deployment) == 1
    d._recovering, d._recover_from = True, "0"
    assert r.exists(keys.fence("m", "gone-g1-0")) and not r.exists(keys.queue("m", "gone-g1-0"))
    wait_for(lambda: d.run_once(idle_block_ms=10) == 1, 5, "the request dispatched again")
    assert live.run_once(block_ms=100) == 1

    for entry_id, fields in held:
        slow.process(entry_id, fields)  # the slow one finishes: fenced, it replies nothing and stops
    assert slow._stopping.is_set()
    got = r.xrange(keys.replies("t"))
    assert [(f[b"id"], f[b"instance"]) for _, f in got] == [(b"q1", b"live-g1-0")]
    assert int(r.hget(keys.stats("m"), "replies")) == 1
    assert r.xlen(keys.requests("m")) == 0


def test_each_node_plans_its_share_of_a_model_wide_batch(r: redis.Redis, redis_url: str, prefix: str) -> None:
    """A reconfiguration to B reaches every node: each plans B × its T / all nodes' T, with its own planner."""
    settings = Settings(redis_url=redis_url, prefix=prefix)
    asked: dict[str, list[int]] = {"big": [], "small": []}
    sups = {}
    for node, cores in (("big", 3), ("small", 1)):
        sups[node] = Supervisor(r, settings, redis_url, "m", Configuration.parse("1x1"), handler="echo", node=node,
                                topology=Topology.synthetic(cores), with_dispatcher=False,
                                planner=lambda b, node=node: asked[node].append(b) or Configuration.parse("1x1"))
        sups[node].publish()
    doc = Deployment.model_validate_json(r.get(settings.keys.config("m")))
    assert doc.budgets == {"big": 3, "small": 1}
    for node in sups:  # what each supervisor does with `packrat-mq reconfigure m --batch 8` (planned as served: no change)
        sups[node]._carry_out(control.ControlMessage(id="c1", model="m", batch=8, adaptive=False))
    assert asked == {"big": [6], "small": [2]}
    assert (sups["big"]._share(1), sups["small"]._share(1)) == (1, 1)  # never 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not Path("/usr/bin/taskset").exists(),
                    reason="needs two CPUs and taskset")
def test_a_reconfiguration_reaches_both_nodes(redis_url: str, prefix: str, r: redis.Redis) -> None:
    """`reconfigure --instances` goes to every node's supervisor; each waits for the dispatcher to serve its own generation."""
    keys = Keys(prefix)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    env = {"PACKRAT_HEARTBEAT_S": "0.2"}
    tracked = Tracked()
    procs = [_pool("n1", cpus[0], redis_url, prefix, tracked, env), _pool("n2", cpus[1], redis_url, prefix, tracked, env)]
    try:
        wait_for(lambda: all(r.hget(keys.instance("sleep", i), "state") == b"ready" for i in ("n1-g1-0", "n2-g1-0")),
                 60, "both instances ready")
        procs.append(subprocess.Popen([sys.executable, "-m", "packrat_mq", "dispatch", "-m", "sleep", "--redis-url",
                                       redis_url, "--prefix", prefix], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, env=tracked.env(env), stdin=subprocess.DEVNULL))
        wait_for(lambda: (rec := DispatcherState.load(r, keys.dispatcher("sleep"))) is not None
                 and rec.nodes == ["n1=1", "n2=1"], 30, "the dispatcher serving both nodes")
        run = run_cli("reconfigure", "sleep", "--instances", "1x4", "--redis-url", redis_url, "--prefix", prefix,
                      env=env)
        assert run.returncode == 0, run.stderr

        def both_done() -> bool:
            sups = [SupervisorState.load(r, keys.supervisor("sleep", n)) for n in ("n1", "n2")]
            return all(s is not None and s.generation == 2 and not s.phase for s in sups)

        wait_for(both_done, 30, "both nodes at generation 2")
        doc = Deployment.model_validate_json(r.get(keys.config("sleep")))
        assert doc.nodes == {"n1": 2, "n2": 2} and doc.batch == 8
        rec = DispatcherState.load(r, keys.dispatcher("sleep"))
        assert (rec.generation_of("n1"), rec.generation_of("n2")) == (2, 2)
        stream = keys.replies("reconf")
        for k in range(8):
            r.xadd(keys.requests("sleep"), {"id": f"q{k}", "reply_to": stream, "payload": "1"})
        wait_for(lambda: r.xlen(stream) == 8, 30, "eight replies")
        got = [f for _, f in r.xrange(stream)]
        assert sorted(f[b"id"] for f in got) == sorted(f"q{k}".encode() for k in range(8))
        assert {f[b"instance"] for f in got} <= {b"n1-g1-0", b"n2-g1-0"}  # a reshare keeps the instances
    finally:
        terminate_all(procs)
        tracked.leftovers(grace_s=5)
        tracked.close()
