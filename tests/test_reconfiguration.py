"""Live reconfiguration: planning a change, and carrying it out under load without loss or duplicates.

Real Redis and real worker/dispatcher processes (``echo`` and ``sleep``), on
this machine's own cores (configurations of at most two 1-thread instances).
The supervisor's checks are driven from the test, as ``serve_forever`` would.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from packrat_mq import control
from packrat_mq.client import Client
from packrat_mq.instances import Configuration, plan_change
from packrat_mq.records import DispatcherState, SupervisorState
from packrat_mq.settings import Settings
from packrat_mq.topology import Topology
from tests.helpers import stop_supervisors, wait_for
from workers.supervisor import Supervisor

pytestmark = [pytest.mark.timeout(180)]

TWO_CORES = pytest.mark.skipif(Topology.detect().physical_cores < 2, reason="needs two physical cores")


# --- planning ------------------------------------------------------------------
def test_plan_keeps_instances_of_the_same_thread_count() -> None:
    plan = plan_change([(2, 4), (1, 2), (1, 2)], Configuration.parse("1x8,1x8"))
    assert plan.kept == ((1, 8), (2, 8)) and plan.start == () and plan.stop == (0,)
    assert plan.kind == "scale"


def test_plan_kinds() -> None:
    assert plan_change([(1, 1)], Configuration.parse("1x4")).kind == "reshare"
    assert plan_change([(1, 1)], Configuration.parse("1x2,1x2")).kind == "scale"
    plan = plan_change([(2, 8)], Configuration.parse("1x4,1x4"))
    assert plan.kind == "active-passive" and plan.stop == (0,) and len(plan.start) == 2


def test_topology_without_cores() -> None:
    topo = Topology.detect()
    first = topo.cores[0].cpu
    rest = topo.without({first})
    assert rest.physical_cores == topo.physical_cores - 1
    assert first not in rest.allowed


# --- carrying it out -----------------------------------------------------------
MakeSupervisor = Callable[..., Supervisor]


@pytest.fixture
def make(r: redis.Redis, settings: Settings, redis_url: str) -> Iterator[MakeSupervisor]:
    made: list[Supervisor] = []
    quiet = settings.model_copy(update={"log_level": "WARNING", "batch_timeout_ms": 5.0})

    def build(model: str, config: str, settings_update: dict[str, Any] | None = None, **kw: Any) -> Supervisor:
        kw.setdefault("node", "n1")
        sup = Supervisor(r, quiet.model_copy(update=settings_update or {}), redis_url, model,
                         Configuration.parse(config), **kw)
        made.append(sup)
        return sup

    yield build
    stop_supervisors(made, 5)


class Load:
    """Closed-loop producers (threads) sending requests until stopped; every id is kept."""

    def __init__(self, redis_url: str, prefix: str, model: str, clients: int = 4,
                 payload: dict[str, Any] | None = None) -> None:
        self.url, self.prefix, self.model = redis_url, prefix, model
        self.payload = payload if payload is not None else {"sleep_ms": 15}
        self.sent: list[str] = []
        self.replies: Counter[str] = Counter()
        self.errors: list[str] = []
        #: (instance, received at (epoch s), inference_ms) of every reply.
        self.timings: list[tuple[str, float, float]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        client = Client(self.url, prefix=self.prefix)
        try:
            while not self._stop.is_set():
                rid = f"q-{uuid.uuid4().hex[:12]}"
                self.sent.append(rid)
                client.send(self.model, self.payload, request_id=rid)
                for reply in client.gather([rid], timeout=60):
                    self.replies[reply.id] += 1
                    self.timings.append((reply.fields.get("instance", ""), reply.received_at, reply.inference_ms))
                    if not reply.ok:
                        self.errors.append(f"{reply.id}: {reply.error}")
        finally:
            client.close()

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)


def supervise_until(sup: Supervisor, done: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what} (phase {sup.change.phase if sup.change else '-'})"
        sup.check()
        time.sleep(0.02)


def history(r: redis.Redis, settings: Settings, model: str) -> list[dict[str, Any]]:
    import json

    return [json.loads(x) for x in r.lrange(settings.keys.reconfigurations(model), 0, -1)]


def assert_exactly_once(load: Load, r: redis.Redis, settings: Settings, model: str = "sleep") -> None:
    assert load.errors == []
    assert len(load.sent) > 0
    assert set(load.replies) == set(load.sent), "a request was not answered"
    assert max(load.replies.values()) == 1, "a request was answered twice"
    # Every reply written is counted: a duplicate shows here even if no client read it.
    assert int(r.hget(settings.keys.stats(model), "replies") or 0) == len(load.sent)


def test_reshare_is_instant_and_loses_nothing(make: MakeSupervisor, r: redis.Redis, settings: Settings,
                                             redis_url: str, prefix: str) -> None:
    sup = make("sleep", "1x1")
    sup.start(ready_timeout=60)
    pids = [i.child.process.pid for i in sup.instances]
    with Load(redis_url, prefix, "sleep") as load:
        time.sleep(0.5)
        change = sup.reconfigure(Configuration.parse("1x4"), reason="test")
        assert change is not None and change.kind == "reshare"
        supervise_until(sup, lambda: sup.change is None, 20, "the reshare")
        time.sleep(0.5)
    assert [i.child.process.pid for i in sup.instances] == pids  # the same process
    assert sup.deployment.batch == 4 and sup.generation == 2
    d = DispatcherState.load(r, settings.keys.dispatcher("sleep"))
    assert d.generation == 2 and d.batch == 4
    (entry,) = history(r, settings, "sleep")
    assert entry["kind"] == "reshare" and entry["status"] == "done" and entry["to"] == "1x4"
    assert entry["total_s"] < 2.0
    assert_exactly_once(load, r, settings)


@TWO_CORES
def test_scaling_adds_and_removes_instances_under_load(make: MakeSupervisor, r: redis.Redis, settings: Settings,
                                                       redis_url: str, prefix: str) -> None:
    sup = make("sleep", "1x2")
    sup.start(ready_timeout=60)
    first = sup.instances[0].record.id
    with Load(redis_url, prefix, "sleep") as load:
        time.sleep(0.5)
        assert sup.reconfigure(Configuration.parse("1x2,1x2")).kind == "scale"
        supervise_until(sup, lambda: sup.change is None, 60, "the scale-out")
        assert [i.record.id for i in sup.instances][0] == first and len(sup.instances) == 2
        time.sleep(1.0)
        assert sup.reconfigure(Configuration.parse("1x2")).kind == "scale"
        supervise_until(sup, lambda: sup.change is None, 60, "the scale-in")
        time.sleep(0.5)
    assert [i.record.id for i in sup.instances] == [first]
    assert len(r.smembers(settings.keys.instances("sleep"))) == 1  # the removed one's record is gone
    assert [e["kind"] for e in history(r, settings, "sleep")] == ["scale", "scale"]
    assert_exactly_once(load, r, settings)


@TWO_CORES
def test_active_passive_switch_under_load(make: MakeSupervisor, r: redis.Redis, settings: Settings,
                                          redis_url: str, prefix: str) -> None:
    sup = make("sleep", "2x4")
    sup.start(ready_timeout=60)
    old = sup.instances[0]
    with Load(redis_url, prefix, "sleep", clients=6) as load:
        time.sleep(0.5)
        change = sup.reconfigure(Configuration.parse("1x2,1x2"))
        assert change.kind == "active-passive" and change.oversubscribed
        assert old.child.running() and len(sup.passive) == 2  # the old one serves while the new warm up
        supervise_until(sup, lambda: sup.change is None, 60, "the switch")
        time.sleep(0.5)
    assert old.child.process.poll() is not None  # stopped after draining
    assert [i.record.threads for i in sup.instances] == [1, 1]
    (entry,) = history(r, settings, "sleep")
    assert entry["status"] == "done" and entry["kind"] == "active-passive"
    for field in ("decision_to_ready_s", "ready_to_switch_s", "switch_to_drained_s", "oversubscribed_s"):
        assert entry[field] is not None and entry[field] >= 0
    # After the switch only the new generation's instances got work.
    served_by = {i.record.id for i in sup.instances} | {old.record.id}
    assert set(r.smembers(settings.keys.instances("sleep"))) == {i.record.id.encode() for i in sup.instances}
    assert served_by
    assert_exactly_once(load, r, settings)


@TWO_CORES
def test_new_instances_on_the_cores_of_leaving_ones_serve_once_those_have_drained(
        make: MakeSupervisor, r: redis.Redis, settings: Settings, redis_url: str, prefix: str) -> None:
    """The handover: on cores shared with the instance it replaces, a new instance's first sub-batch
    waits until the old one has answered what it held (side by side, OpenMP instances slow each other
    down by more than they share), and the history says how long it waited."""
    sup = make("sleep", "2x4")
    sup.start(ready_timeout=60)
    old = sup.instances[0].record.id
    with Load(redis_url, prefix, "sleep", clients=6, payload={"sleep_ms": 150}) as load:
        time.sleep(0.8)
        change = sup.reconfigure(Configuration.parse("1x2,1x2"))
        assert change.oversubscribed and change.handing_over == [i.record.id for i in sup.passive]
        supervise_until(sup, lambda: sup.change is None, 60, "the switch")
        time.sleep(0.6)
    (entry,) = history(r, settings, "sleep")
    assert entry["status"] == "done" and entry["handover"] is True
    assert entry["held_s"] is not None and entry["held_s"] >= 0
    assert all(i.spec.after == [] for i in sup.instances)  # a restart after the change waits for no one
    old_done = max(at for instance, at, _ in load.timings if instance == old)
    new_began = min(at - ms / 1000.0 for instance, at, ms in load.timings if instance != old)
    # Each reply is read after its batch ended: a new batch began no earlier than this, the old one's last
    # ended no later (50 ms for the client threads' own scheduling; a batch here sleeps 150 ms).
    assert new_began >= old_done - 0.05, (new_began, old_done)
    assert_exactly_once(load, r, settings)


@TWO_CORES
def test_an_instance_killed_during_a_switch_loses_nothing(make: MakeSupervisor, r: redis.Redis,
                                                         settings: Settings, redis_url: str, prefix: str) -> None:
    sup = make("sleep", "1x2,1x2")
    sup.start(ready_timeout=60)
    with Load(redis_url, prefix, "sleep", clients=6) as load:
        time.sleep(0.5)
        change = sup.reconfigure(Configuration.parse("2x4"))
        assert change.kind == "active-passive"
        # Kill one old (still active) instance mid-batch while the new one warms up.
        victim = sup.instances[1]
        os.kill(victim.child.process.pid, signal.SIGKILL)
        supervise_until(sup, lambda: sup.change is None, 90, "the switch with a killed instance")
        time.sleep(0.5)
    assert victim.child.restarts >= 1  # restarted to answer what it held
    assert [i.record.threads for i in sup.instances] == [2]
    assert_exactly_once(load, r, settings)


def test_control_messages_reconfigure_and_bad_ones_change_nothing(make: MakeSupervisor, r: redis.Redis,
                                                                  settings: Settings) -> None:
    sup = make("echo", "1x1")
    sup.start(ready_timeout=60)
    reply_to = f"{settings.prefix}:replies:ctl"

    def ask(**fields: str) -> dict[bytes, bytes]:
        mid = control.new_id()
        r.xadd(settings.keys.control(), {"id": mid, "reply_to": reply_to, **fields})
        deadline = time.monotonic() + 30
        while True:
            sup.check()
            got = [f for _, f in r.xrange(reply_to) if f[b"id"].decode() == mid]
            if got:
                return got[0]
            assert time.monotonic() < deadline, f"no reply to {fields}"
            time.sleep(0.02)

    bad = [
        {"command": "explode", "model": "echo", "batch": "2"},
        {"command": "reconfigure", "model": "echo"},
        {"command": "reconfigure", "model": "echo", "batch": "2", "instances": "1x2"},
        {"command": "reconfigure", "model": "echo", "batch": "zero"},
        {"command": "reconfigure", "model": "echo", "instances": "1y2"},
        {"command": "reconfigure", "model": "bad name", "batch": "2"},
        {"command": "reconfigure", "model": "echo", "instances": "64x1"},  # more cores than there are
    ]
    for fields in bad:
        reply = ask(**fields)
        assert reply[b"status"] == b"error", fields
        assert reply[b"error"], fields
    assert sup.generation == 1 and sup.configuration.compact() == "1x1"
    reply = ask(command="reconfigure", model="echo", batch="4")
    assert reply[b"status"] == b"ok", reply
    assert sup.deployment.batch == 4 and sup.adaptive is False
    reply = ask(command="reconfigure", model="echo", batch="4")
    assert reply[b"status"] == b"ok" and b"unchanged" in reply[b"payload"]
    reply = ask(command="reconfigure", model="echo", batch="2", adaptive="1")
    assert reply[b"status"] == b"ok" and sup.adaptive is True
    record = SupervisorState.load(r, settings.keys.supervisor("echo", "n1"))
    assert record.adaptive is True and record.phase == ""


def test_the_estimator_moves_b_with_the_load(make: MakeSupervisor, r: redis.Redis, settings: Settings,
                                             redis_url: str, prefix: str) -> None:
    """Adaptive from B=1: eight closed-loop clients raise B to 8; when they stop, B goes back to 1."""
    sup = make("sleep", "1x1", adaptive=True, threads_budget=1)
    sup.start(ready_timeout=60)
    with Load(redis_url, prefix, "sleep", clients=8, payload={"sleep_ms": 30}) as load:
        supervise_until(sup, lambda: sup.deployment.batch == 8 and sup.change is None, 30,
                        "B to follow eight clients")
        d = DispatcherState.load(r, settings.keys.dispatcher("sleep"))
        assert d.adaptive and d.q_tilde is not None and d.q_tilde > 5
        # Steady load: no further reconfiguration.
        steady = len(history(r, settings, "sleep"))
        t_end = time.monotonic() + 4
        while time.monotonic() < t_end:
            sup.check()
            time.sleep(0.05)
        assert len(history(r, settings, "sleep")) == steady
    supervise_until(sup, lambda: sup.deployment.batch == 1, 30, "B back to 1 when idle")
    reasons = [e["origin"] for e in history(r, settings, "sleep")]
    assert set(reasons) == {"estimator"}
    assert_exactly_once(load, r, settings)


# --- spares: loaded instances rebound in place ----------------------------------
def pids_of(sup: Supervisor) -> set[int]:
    return {i.child.process.pid for i in sup.all_instances if i.child.process is not None}


@TWO_CORES
def test_retired_instances_become_spares_and_later_changes_rebind_them(
        make: MakeSupervisor, r: redis.Redis, settings: Settings, redis_url: str, prefix: str) -> None:
    """After the first active-passive change, going back and forth starts no process: spares are rebound."""
    sup = make("sleep", "2x4", settings_update={"spare_instances": 2})
    sup.start(ready_timeout=60)
    original = sup.instances[0]
    with Load(redis_url, prefix, "sleep", clients=6) as load:
        time.sleep(0.5)
        first = sup.reconfigure(Configuration.parse("1x2,1x2"))
        assert first.reused == 0  # no spare yet: two processes started
        supervise_until(sup, lambda: sup.change is None, 60, "the first switch")
        assert sup.spares == [original] and original.child.running()
        wait_for(lambda: r.hget(settings.keys.instance("sleep", original.record.id), "state") == b"spare", 10,
                 "the retired instance to say spare")
        pids = pids_of(sup)
        assert len(pids) == 3
        back = sup.reconfigure(Configuration.parse("2x4"))
        # The very same process, bound again (passive, or already serving: a rebind to a binding it has
        # run before takes no warm-up, so the change may be past its warming by now).
        assert back.reused == 1 and original in sup.passive + sup.instances
        supervise_until(sup, lambda: sup.change is None, 60, "the switch back")
        assert [i.record.id for i in sup.instances] == [original.record.id]
        assert len(sup.spares) == 2
        again = sup.reconfigure(Configuration.parse("1x2,1x2"))
        assert again.reused == 2
        supervise_until(sup, lambda: sup.change is None, 60, "the third switch")
        time.sleep(0.5)
    assert pids_of(sup) == pids, "no process started or stopped after the first change"
    assert [i.record.threads for i in sup.instances] == [1, 1]
    for inst in sup.instances:
        rec = r.hgetall(settings.keys.instance("sleep", inst.record.id))
        assert rec[b"state"] == b"ready" and rec[b"threads"] == b"1" and rec[b"batch"] == b"2"
    entries = history(r, settings, "sleep")
    assert [e["reused"] for e in reversed(entries)] == [0, 1, 2]
    assert all(e["status"] == "done" for e in entries)
    assert_exactly_once(load, r, settings)
    # Stopping stops the spares too, and forgets their records.
    sup.stop(timeout=10)
    assert not any(i.child.running() for i in sup.all_instances)
    assert r.smembers(settings.keys.instances("sleep")) == set()


def test_a_spares_start_time_is_what_it_timed_itself(make: MakeSupervisor, r: redis.Redis,
                                                    settings: Settings) -> None:
    """The published process start is the spare's own time from its creation to loaded (``load_s``), not when
    a check saw it (up to a check interval later, and after its warm-up ahead at other sizes); a record
    without one (an older worker) is timed as seen."""
    import subprocess

    from packrat_mq.records import InstanceState

    sup = make("sleep", "1x1", settings_update={"spare_instances": 1})
    for name, load_s in (("n1-spare-8", 0.42), ("n1-spare-9", None)):
        inst = sup._new_instance(name, 1, 1, [0], 0, False, spare=True)
        inst.child.process = subprocess.Popen(["sleep", "30"])
        try:
            pid = inst.child.process.pid
            InstanceState(state="spare", pid=pid, interval=1.0, heartbeat=time.time(),
                          load_s=load_s).save(r, inst.child.record_key)
            sup._spare_started[inst.record.id] = (pid, time.monotonic() - 1.0)
            assert sup._is_spare(inst)
        finally:
            inst.child.process.kill()
            inst.child.process.wait()
    assert sup._start_times[0] == 0.42
    assert 1.0 <= sup._start_times[1] < 1.5


def test_a_worker_times_its_own_load_from_its_process_creation() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3); from workers.worker import loaded_s; "
                          "print(loaded_s())"], capture_output=True, text=True, check=True, timeout=60)
    assert 0.3 <= float(out.stdout) < 30.0


@TWO_CORES
def test_prewarmed_spares_make_even_the_first_change_without_a_start(
        make: MakeSupervisor, r: redis.Redis, settings: Settings, redis_url: str, prefix: str) -> None:
    sup = make("sleep", "2x4", settings_update={"spare_instances": 2, "prewarm_spares": True})
    sup.start(ready_timeout=60)
    supervise_until(sup, lambda: sup.spares_loaded() == 2, 60, "two spares to load")
    assert r.hget(settings.keys.supervisor("sleep", "n1"), "spares") == b"2"  # all of them, the last one too
    assert r.hget(settings.keys.supervisor("sleep", "n1"), "instances") == sup.instances[0].record.id.encode()
    # Each spare was timed from its start to loaded (one at a time), and the median is published with the
    # CPUs they load on: the estimator prices the processes a move would start beyond the spares by it.
    assert len(sup._start_times) == 2 and all(0.0 < s < 60.0 for s in sup._start_times)
    record = SupervisorState.load(r, settings.keys.supervisor("sleep", "n1"))
    assert record.process_start_s == round(sorted(sup._start_times)[1], 3)
    assert record.start_cpus == len(os.sched_getaffinity(0))
    with Load(redis_url, prefix, "sleep", clients=6) as load:
        time.sleep(0.5)
        change = sup.reconfigure(Configuration.parse("1x2,1x2"))
        assert change.reused == 2
        supervise_until(sup, lambda: sup.change is None, 60, "the switch")
        time.sleep(0.5)
    assert {i.record.id for i in sup.instances} == {f"n1-spare-{k}" for k in (1, 2)}
    assert_exactly_once(load, r, settings)


@TWO_CORES
def test_a_spare_killed_while_rebinding_comes_back_bound(
        make: MakeSupervisor, r: redis.Redis, settings: Settings, redis_url: str, prefix: str) -> None:
    sup = make("sleep", "2x4", settings_update={"spare_instances": 1, "prewarm_spares": True})
    sup.start(ready_timeout=60)
    supervise_until(sup, lambda: len(sup.spares) == 1 and sup._is_spare(sup.spares[0]), 60, "a spare")
    spare = sup.spares[0]
    with Load(redis_url, prefix, "sleep", clients=6) as load:
        time.sleep(0.3)
        change = sup.reconfigure(Configuration.parse("1x2,1x2"))
        assert change.reused == 1
        os.kill(spare.child.process.pid, signal.SIGKILL)
        supervise_until(sup, lambda: sup.change is None, 90, "the switch with a killed spare")
        time.sleep(0.5)
    assert spare.child.restarts >= 1 and spare in sup.instances
    rec = r.hgetall(settings.keys.instance("sleep", spare.record.id))
    assert rec[b"state"] == b"ready" and rec[b"threads"] == b"1"
    assert_exactly_once(load, r, settings)


def test_cgroup_memory_limit_is_read_where_there_is_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from workers.supervisor import _cgroup_memory

    assert _cgroup_memory(str(tmp_path)) is None  # no cgroup files
    (tmp_path / "memory.max").write_text("max\n")
    assert _cgroup_memory(str(tmp_path)) is None  # no limit
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text("536870912\n")
    assert _cgroup_memory(str(tmp_path)) == (1 << 30, 1 << 29)


def test_a_dead_retiree_does_not_stop_the_next_from_being_kept_as_a_spare(
        make: MakeSupervisor, monkeypatch: pytest.MonkeyPatch) -> None:
    """A retiree that died while draining is skipped, not the end of the list (it was a ``break``)."""
    sup = make("sleep", "1x1", settings_update={"spare_instances": 2})
    sent: list[str] = []
    monkeypatch.setattr("workers.supervisor.rebinding.send", lambda r, queue, order: sent.append(queue))
    monkeypatch.setattr(sup, "_room_for_spare", lambda: True)

    class Child:
        def __init__(self, alive: bool) -> None:
            self.alive = alive
            self.spec_json = ""
            self.env: dict[str, str] = {}

        def running(self) -> bool:
            return self.alive

    dead, alive = sup._instance(sup.assignments[0], 1), sup._instance(sup.assignments[0], 1)
    dead.child, alive.child = Child(False), Child(True)  # type: ignore[assignment]
    kept = sup._keep_as_spares([dead, alive])
    assert kept == [alive] and sup.spares == [alive] and len(sent) == 1
    assert alive.spec.spare and not dead.spec.spare
    sup.spares = []  # fakes: nothing for the fixture to stop


@pytest.mark.parametrize("simulated", [False, True], ids=["real", "simulated"])
def test_a_spare_is_prestarted_only_while_the_machine_is_quiet(
        make: MakeSupervisor, monkeypatch: pytest.MonkeyPatch, simulated: bool) -> None:
    """On a simulated topology too: its cores are labels, but a process starting takes the real ones from the
    dispatcher, Redis and the instances' path (64 simulated cores on two real ones, 12-07)."""
    sup = make("sleep", "1x1", settings_update={"spare_instances": 1, "prewarm_spares": True},
               **({"topology": Topology.synthetic(16)} if simulated else {}))
    assert sup.topology.simulated == simulated
    started: list[str] = []
    monkeypatch.setattr(sup, "_start_instance", lambda inst: started.append(inst.record.id))
    monkeypatch.setattr(sup, "_room_for_spare", lambda: True)
    use = iter([10.0, 90.0, 30.0, 30.0])  # percent: first sample (no window yet), busy, quiet
    monkeypatch.setattr("workers.supervisor.psutil.cpu_percent", lambda interval=None: next(use))

    def window_of(seconds: float) -> None:  # the current CPU window began this long ago
        sup._cpu_window_at = time.monotonic() - seconds

    sup._prewarm()
    assert started == [], "the first sample has no window behind it"
    sup._prewarm()
    assert started == [], "a window shorter than PREWARM_CPU_WINDOW_S says nothing yet"
    window_of(2.5)
    sup._prewarm()
    assert started == [], "90% busy: serving instances would pay for the load"
    window_of(60.0)
    sup._prewarm()
    assert started == [], "a window left open for a minute is not recent: it starts again"
    window_of(2.5)
    sup._unsettled_until = time.monotonic() + 5.0
    sup._prewarm()
    assert started == [], "a change just ended: the machine settles first"
    sup._unsettled_until = 0.0
    sup._prewarm()
    assert started == ["n1-spare-1"]
    sup.spares = []  # never started: nothing for the fixture to stop
