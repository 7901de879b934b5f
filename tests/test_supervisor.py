"""The supervisor, constructed directly: restart policy, start-up failures, restarts, and stopping without loss.

Real Redis and real worker/dispatcher processes (the ``echo`` and ``sleep``
handlers, one-core configurations), except for the restart policy itself,
which is driven with a fake process and an explicit clock.
"""
from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from packrat_mq import protocol
from packrat_mq.client import Client
from packrat_mq.instances import Configuration
from packrat_mq.keys import DISPATCHER_GROUP, WORKER_GROUP
from packrat_mq.records import DispatcherState, InstanceState, SupervisorState, ttl_for
from packrat_mq.settings import Settings
from tests.helpers import stop_supervisors, wait_for
from workers import supervisor as supervisor_module
from workers.supervisor import Child, Supervisor

pytestmark = [pytest.mark.timeout(120)]

FAILING_LOAD = "tests.supervisor_handlers:FailingLoad"
FAILING_SECOND = "tests.supervisor_handlers:FailingSecondInstance"


MakeSupervisor = Callable[..., Supervisor]


@pytest.fixture
def make(r: redis.Redis, settings: Settings, redis_url: str) -> Iterator[MakeSupervisor]:
    """Build supervisors (node ``n1``, generation 1 unless told); whatever still runs afterwards is stopped."""
    made: list[Supervisor] = []
    quiet = settings.model_copy(update={"log_level": "WARNING"})

    def build(model: str, config: str = "1x1", **kw: Any) -> Supervisor:
        kw.setdefault("node", "n1")
        sup = Supervisor(r, quiet, redis_url, model, Configuration.parse(config), **kw)
        made.append(sup)
        return sup

    yield build
    stop_supervisors(made, 3, only_if_running=True)


def replies_by_id(r: redis.Redis, reply_to: str) -> Counter[str]:
    return Counter(f[b"id"].decode() for _, f in r.xrange(reply_to))


def queued_ids(r: redis.Redis, queue: str) -> list[str]:
    """Request ids of the sub-batches in an instance queue."""
    return [req.id for _, fields in r.xrange(queue) for req in protocol.decode_subbatch(fields)]


def stream_ids(r: redis.Redis, settings: Settings, model: str, *, held: bool) -> list[str]:
    """Request ids in the model's request stream that an instance holds (``held``), or that none does.

    Requests handed to an instance stay in the request stream (their payloads
    are read from there) until it answers them, pending under the consumer
    ``instance:<id>``; the others wait for the dispatcher.
    """
    stream = settings.keys.requests(model)
    try:
        pending = r.xpending_range(stream, DISPATCHER_GROUP, min="-", max="+", count=100_000)
    except redis.ResponseError:  # no such stream or group yet
        pending = []
    owned = {e["message_id"] for e in pending if e["consumer"].startswith(b"instance:")}
    return [f[b"id"].decode() for sid, f in r.xrange(stream) if (sid in owned) == held]


def pending_count(r: redis.Redis, queue: str) -> int:
    try:
        return int(r.xpending(queue, WORKER_GROUP)["pending"])
    except redis.ResponseError:  # no such stream or group yet
        return 0


# --- the restart policy ------------------------------------------------------
class FakeProcess:
    """Enough of Popen for Child: a pid, and poll() giving the exit code once it 'died'."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


def test_crash_loop_backs_off_to_the_cap_and_resets_after_a_healthy_run(monkeypatch: pytest.MonkeyPatch) -> None:
    pids = iter(range(1000, 2000))
    monkeypatch.setattr(supervisor_module, "spawn", lambda module, spec_json, env=None: FakeProcess(next(pids)))
    clock = [5000.0]
    child = Child(name="instance n1-g1-0", module="workers.worker", spec_json="{}", record_key="k",
                  record=InstanceState)
    # The backoff measures the healthy period with its own clock: the same fake time as ``now``.
    child.backoff.clock = lambda: clock[0]
    assert child.backoff.healthy_s == 30.0
    assert not child.restart_due(clock[0]), "never started: nothing to restart"

    def run_for(seconds: float) -> None:
        """The process runs healthy for ``seconds``, checked every few seconds."""
        end = clock[0] + seconds
        while clock[0] < end:
            clock[0] = min(end, clock[0] + 3.0)
            assert not child.restart_due(clock[0]), "a running process is never due"

    def die() -> float:
        """Kill the process; returns the delay before its restart, checking it is not due a moment earlier."""
        assert child.process is not None
        child.process.returncode = 1  # type: ignore[misc]
        died = clock[0]
        if child.restart_due(died):
            delay = 0.0
        else:
            delay = child.next_start - died
            clock[0] = died + delay - 0.01
            assert not child.restart_due(clock[0]), f"due before its {delay} s delay"
            clock[0] = died + delay
            assert child.restart_due(clock[0]), f"not due after its {delay} s delay"
        # What Supervisor.check does with a due child.
        child.next_start = 0.0
        child.restarts += 1
        child.start()
        return delay

    child.start()
    # A process that dies at once after every start.
    delays = [die() for _ in range(10)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]
    # Not healthy long enough: still at the cap.
    run_for(29.0)
    assert die() == 30.0
    # Healthy for the healthy period: the next death restarts at once, then backs off from 1 s again.
    run_for(30.0)
    assert die() == 0.0
    assert die() == 1.0
    assert die() == 2.0
    # Healthy without a check in between (failure() sees the healthy run too).
    clock[0] += 31.0
    assert die() == 0.0
    assert child.restarts == 15


def test_check_never_blocks_on_a_crash_loop_and_restarts_only_when_due(make: MakeSupervisor,
                                                                       r: redis.Redis) -> None:
    sup = make("echo", handler=FAILING_LOAD, with_dispatcher=False)
    with pytest.raises(RuntimeError):
        sup.start(ready_timeout=60)
    child = sup.instances[0].child
    key = child.record_key

    def timed_check() -> tuple[list[str], float, float]:
        before = time.monotonic()
        restarted = sup.check()
        after = time.monotonic()
        assert after - before < 0.5, f"check() took {after - before:.2f} s"
        return restarted, before, after

    # First death: restarted at once.
    restarted, _, _ = timed_check()
    assert restarted == [child.name] and child.restarts == 1
    assert InstanceState.load(r, key).restarts == 1
    # The next death waits 1 s (the doubling and the cap are the unit test's above).
    for expected_delay in (1.0,):
        assert child.process is not None
        wait_for(lambda: child.process.poll() is not None, 30, "the restarted instance to die again")
        restarted, before, after = timed_check()
        assert restarted == []
        scheduled = child.next_start
        assert before + expected_delay <= scheduled <= after + expected_delay
        assert InstanceState.load(r, key).state == "restarting"
        restarts = child.restarts
        while True:
            restarted, before, after = timed_check()
            if restarted:
                break
            assert before < scheduled, "a due restart was not made"
            assert child.restarts == restarts
            time.sleep(0.05)
        assert restarted == [child.name] and after >= scheduled
        assert child.restarts == restarts + 1
        assert InstanceState.load(r, key).restarts == child.restarts


# --- starting -----------------------------------------------------------------
def test_start_raises_at_once_when_an_instance_fails_to_load(make: MakeSupervisor) -> None:
    sup = make("echo", handler=FAILING_LOAD)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="instance n1-g1-0 exited with code 1 while starting"):
        sup.start(ready_timeout=120)
    assert time.monotonic() - started < 30, "start waited for its timeout"
    assert sup.dispatcher is not None and sup.dispatcher.process is None, "no dispatcher without instances"


def test_a_failed_start_under_with_stops_the_instances_that_did_start(make: MakeSupervisor) -> None:
    sup = make("echo", "1x1,1x1", handler=FAILING_SECOND)
    with pytest.raises(RuntimeError, match="instance n1-g1-1"):
        with sup:
            pytest.fail("the supervisor started although an instance failed")
    first = sup.instances[0].child
    assert first.process is not None and first.process.poll() is not None, "instance 0 left running"


# --- supervising --------------------------------------------------------------
def test_a_killed_dispatcher_is_restarted_and_serves(make: MakeSupervisor, r: redis.Redis, prefix: str) -> None:
    sup = make("echo")
    sup.start(ready_timeout=60)
    dispatcher = sup.dispatcher
    assert dispatcher is not None and dispatcher.process is not None
    key = dispatcher.record_key
    old = dispatcher.process.pid
    os.kill(old, signal.SIGKILL)
    dispatcher.process.wait()
    client = Client(r, prefix=prefix)
    while_dead = client.send("echo", {"sent": "while the dispatcher was dead"})

    assert sup.check() == ["dispatcher"], "a first death is restarted at once"
    assert dispatcher.process.pid != old

    def new_one_ready() -> bool:
        assert sup.check() == [], "restarted twice"
        record = DispatcherState.load(r, key)
        return record is not None and record.state == "ready" and record.pid == dispatcher.process.pid

    wait_for(new_one_ready, 30, "the new dispatcher's record to say ready")
    assert DispatcherState.load(r, key).restarts == 1 and dispatcher.restarts == 1
    after = client.send("echo", {"sent": "after the restart"})
    got = client.gather([while_dead, after], timeout=30)
    assert [g.value() for g in got] == [{"sent": "while the dispatcher was dead"}, {"sent": "after the restart"}]


def test_live_records_carry_a_ttl(make: MakeSupervisor, r: redis.Redis, settings: Settings) -> None:
    sup = make("echo")
    sup.start(ready_timeout=60)
    keys = settings.keys
    ttl = ttl_for(settings.heartbeat_s)
    records = {
        keys.instance("echo", sup.instances[0].record.id): InstanceState,
        keys.dispatcher("echo"): DispatcherState,
        keys.supervisor("echo", "n1"): SupervisorState,
    }
    for key, kind in records.items():
        assert kind.load(r, key).state == "ready", key
        assert 0 < r.ttl(key) <= ttl, f"{key} has TTL {r.ttl(key)}"
    r.persist(keys.supervisor("echo", "n1"))
    sup.check()
    assert 0 < r.ttl(keys.supervisor("echo", "n1")) <= ttl, "check() renews the supervisor's record"


# --- stopping -----------------------------------------------------------------
def test_a_worker_busy_past_the_grace_is_killed_and_its_batch_kept(make: MakeSupervisor, r: redis.Redis,
                                                                   settings: Settings, prefix: str) -> None:
    sup = make("sleep")
    sup.start(ready_timeout=60)
    inst = sup.instances[0]
    queue = settings.keys.queue("sleep", inst.record.id)
    client = Client(r, prefix=prefix)
    rid = client.send("sleep", {"sleep_ms": 60_000})
    wait_for(lambda: pending_count(r, queue) == 1, 30, "the instance to take the batch")
    proc = inst.child.process
    assert proc is not None

    started = time.monotonic()
    sup.stop(timeout=1)
    elapsed = time.monotonic() - started
    # Dispatcher (at once), drain (1 s), SIGTERM ignored for the batch (1 s), SIGKILL.
    assert elapsed < 8, f"stop(timeout=1) took {elapsed:.1f} s"
    assert proc.returncode == -signal.SIGKILL

    # Nothing lost: the batch is still in the queue, pending for the same consumer, and unanswered.
    assert queued_ids(r, queue) == [rid]
    (pending,) = r.xpending_range(queue, WORKER_GROUP, min="-", max="+", count=10)
    assert pending["consumer"].decode() == inst.record.id
    assert stream_ids(r, settings, "sleep", held=True) == [rid]
    assert stream_ids(r, settings, "sleep", held=False) == []
    assert not r.exists(client.reply_to)
    # The rest of the deployment is retired.
    assert not r.exists(inst.child.record_key)
    assert not r.exists(settings.keys.supervisor("sleep", "n1"))


@pytest.mark.slow
def test_a_queue_kept_at_shutdown_is_served_exactly_once_by_the_next_start(
    make: MakeSupervisor, r: redis.Redis, settings: Settings, prefix: str
) -> None:
    first = make("sleep", "1x4")
    first.start(ready_timeout=60)
    queue = settings.keys.queue("sleep", first.instances[0].record.id)
    client = Client(r, prefix=prefix)
    slow = client.send("sleep", {"sleep_ms": 60_000})
    wait_for(lambda: pending_count(r, queue) == 1, 30, "the instance to take the slow batch")
    quick = client.send_many("sleep", [{"sleep_ms": 0, "i": i} for i in range(10)])
    wait_for(lambda: r.xlen(queue) == 2, 30, "a second sub-batch queued behind the slow one")
    first.stop(timeout=1)

    kept = queued_ids(r, queue)
    assert kept[0] == slow and len(kept) >= 2, kept
    in_stream = stream_ids(r, settings, "sleep", held=False)
    assert sorted(kept + in_stream) == sorted([slow, *quick])
    assert sorted(stream_ids(r, settings, "sleep", held=True)) == sorted(kept)
    assert not r.exists(client.reply_to)

    # The same node and generation, now with a fast handler for the same model.
    second = make("sleep", "1x4", handler="echo")
    assert second.instances[0].record.id == first.instances[0].record.id
    second.start(ready_timeout=60)
    wait_for(lambda: r.xlen(client.reply_to) >= 11, 30, "a reply to every request")
    # Watch a while longer: a late duplicate would show here.
    time.sleep(1.0)
    entries = [f for _, f in r.xrange(client.reply_to)]
    assert replies_by_id(r, client.reply_to) == Counter({slow: 1, **{q: 1 for q in quick}})
    assert all(f[b"status"] == b"ok" for f in entries), [f.get(b"error") for f in entries]
    assert r.xlen(queue) == 0 and pending_count(r, queue) == 0


@pytest.mark.slow
def test_stopping_with_requests_in_flight_loses_and_duplicates_nothing(
    make: MakeSupervisor, r: redis.Redis, settings: Settings, prefix: str
) -> None:
    sup = make("sleep", "1x4", options={"base_ms": 100})
    sup.start(ready_timeout=60)
    queue = settings.keys.queue("sleep", sup.instances[0].record.id)
    client = Client(r, prefix=prefix)
    ids = client.send_many("sleep", [{} for _ in range(60)])
    wait_for(lambda: r.xlen(client.reply_to) >= 4, 30, "the first replies")
    sup.stop(timeout=10)
    assert all(not c.running() for c in sup.children)

    def where() -> tuple[Counter[str], Counter[str], Counter[str]]:
        return (replies_by_id(r, client.reply_to),
                Counter(stream_ids(r, settings, "sleep", held=False)),
                Counter(queued_ids(r, queue)))

    replied, in_stream, in_queue = where()
    # A queued request's entry (with its payload) is held in the request stream for its instance.
    assert Counter(stream_ids(r, settings, "sleep", held=True)) == in_queue
    assert set(replied) | set(in_stream) | set(in_queue) == set(ids)
    for rid in ids:
        assert replied[rid] + in_stream[rid] + in_queue[rid] == 1, (
            f"{rid}: {replied[rid]} replies, {in_stream[rid]} in the request stream, {in_queue[rid]} queued")
    assert replied and in_stream, "the stop did not come mid-flight"
    time.sleep(0.5)
    assert where() == (replied, in_stream, in_queue), "something moved after stop() returned"

    # The next start answers the rest, each exactly once.
    again = make("sleep", "1x4", handler="echo")
    again.start(ready_timeout=60)
    wait_for(lambda: r.xlen(client.reply_to) >= len(ids), 30, "a reply to every request")
    time.sleep(0.5)
    assert replies_by_id(r, client.reply_to) == Counter({rid: 1 for rid in ids})


def test_serving_slower_than_the_profile_is_measured_and_warned_about_once(
        make: MakeSupervisor, r: redis.Redis, settings: Settings, prefix: str, tmp_path: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """A profile that says 10 ms for what serves in 40: the supervisor's check says 4x, warns once, records it."""
    from optimizer.planning.profile import Profile, ProfileEntry

    path = Profile(model="sleep", entries=(ProfileEntry(threads=1, batch=1, mean_ms=10.0),)).save(tmp_path / "p.json")
    sup = make("sleep", "1x1", profile=path, options={"base_ms": 40})
    sup.start(ready_timeout=60)
    assert sup.check_profile() is None  # nothing served yet: nothing to say
    client = Client(r, prefix=prefix)
    # At once: the instance serves them back to back, as a profile times batches (after a pause it is not timed).
    client.submit_many("sleep", [{"k": k} for k in range(10)], timeout=30)
    key = settings.keys.instance("sleep", sup.instances[0].record.id)
    wait_for(lambda: (InstanceState.load(r, key) or InstanceState()).served_batches >= 8, 15,
             "the instance's record to carry its served batches")
    rec = InstanceState.load(r, key)
    assert rec is not None and 40.0 <= rec.served_ms < 80.0  # type: ignore[operator]
    with caplog.at_level("WARNING", logger="packrat_mq.supervisor"):
        check = sup.check_profile()
        sup.check_profile()
    assert check is not None and check.off and 4.0 <= check.ratio < 8.0  # type: ignore[operator]
    warnings = [rec for rec in caplog.records if "does not hold on this machine" in rec.getMessage()]
    assert len(warnings) == 1, "warned once, not at every check"
    assert "packrat-mq profile run --model sleep --quick" in warnings[0].getMessage()
    sup._beat()
    state = SupervisorState.load(r, settings.keys.supervisor("sleep", "n1"))
    assert state is not None and state.profile_ratio == pytest.approx(check.ratio, rel=0.01)
    # By thread count too, kept across checks (a layout not serving now keeps its last measure).
    assert state.ratios_by_threads() == {1: pytest.approx(check.ratio, rel=0.01)}
    sup.thread_ratios[2] = (0.86, time.monotonic())
    sup._beat()
    state = SupervisorState.load(r, settings.keys.supervisor("sleep", "n1"))
    assert state is not None and state.ratios_by_threads() == {1: pytest.approx(check.ratio, rel=0.01), 2: 0.86}


def test_after_a_reshare_the_profile_is_held_against_the_new_share(
        make: MakeSupervisor, r: redis.Redis, settings: Settings, prefix: str, tmp_path: Any) -> None:
    """The process is not told of its new share: the check follows the size it serves, not a stale ratio."""
    from optimizer.planning.profile import Profile, ProfileEntry

    entries = (ProfileEntry(threads=1, batch=1, mean_ms=10.0), ProfileEntry(threads=1, batch=4, mean_ms=20.0))
    path = Profile(model="sleep", entries=entries).save(tmp_path / "p.json")
    sup = make("sleep", "1x1", profile=path, options={"base_ms": 40})
    sup.start(ready_timeout=60)
    client = Client(r, prefix=prefix)
    client.submit_many("sleep", [{"k": k} for k in range(8)], timeout=30)  # back to back
    key = settings.keys.instance("sleep", sup.instances[0].record.id)
    wait_for(lambda: (InstanceState.load(r, key) or InstanceState()).served_batches >= 6, 15, "six served at B=1")
    first = sup.check_profile()
    assert first is not None and [p.batch for p in first.points] == [1]
    assert 3.0 <= first.ratio < 6.0  # type: ignore[operator]
    sup.reshare(Configuration.parse("1x4"))
    wait_for(lambda: (DispatcherState.load(r, settings.keys.dispatcher("sleep")) or DispatcherState()).batch == 4,
             15, "the dispatcher to serve B=4")
    client.submit_many("sleep", [{"i": i} for i in range(40)], timeout=30)  # ten sub-batches of 4, back to back
    wait_for(lambda: (InstanceState.load(r, key) or InstanceState()).served_batch == 4, 15,
             "the record to time the new share")
    check = sup.check_profile()
    assert check is not None and [p.batch for p in check.points] == [4]
    assert 1.5 <= check.ratio < 3.0  # type: ignore[operator]  # 40 ms served against 20 profiled at b=4
