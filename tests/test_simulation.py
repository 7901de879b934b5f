"""Simulating a bigger machine: the ``profiled`` model, ``Topology.synthetic`` and ``--simulate-cores``.

No torch: the models that may run on a simulated machine only sleep.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import click
import pytest
import redis
from click.testing import CliRunner

from optimizer.planning.profile import Profile, ProfileEntry
from optimizer.planning.solving import solve
from packrat_mq.cli import main
from packrat_mq.cli.serve import ServePlan, serving_options
from packrat_mq.handler import Context, Input, load_handler, run_batch
from packrat_mq.instances import Configuration
from packrat_mq.settings import Settings
from packrat_mq.topology import Topology
from packrat_mq.zoo.profiled import ProfiledHandler
from tests.helpers import interrupt, wait_for
from tests.test_reconfiguration import Load, assert_exactly_once, history, supervise_until
from workers import runtime
from workers.allocation import allocate
from workers.runtime import RuntimeSpec
from workers.supervisor import Supervisor

ROOT = Path(__file__).resolve().parent.parent

#: A tiny profile: T=16, B=8 plans two instances of 8 threads taking 4 each (8 ms).
POINTS = {
    (1, 1): 10.0, (1, 2): 18.0, (1, 4): 34.0, (1, 8): 66.0,
    (8, 1): 5.0, (8, 2): 6.0, (8, 4): 8.0, (8, 8): 14.0,
}


def _tiny_profile(path: Path) -> Path:
    entries = tuple(ProfileEntry(threads=t, batch=b, mean_ms=ms) for (t, b), ms in POINTS.items())
    return Profile(model="tiny", entries=entries).save(path)


def _profiled(path: Path, threads: int, **options: object) -> ProfiledHandler:
    handler = load_handler("profiled")
    assert isinstance(handler, ProfiledHandler)
    handler.initialize(Context(model_name="profiled", threads=threads, batch_size=4,
                               options={"profile": str(path), **options}))
    return handler


# --- the profiled model -----------------------------------------------------
def test_profiled_latency_interpolates_between_profiled_sizes_and_scales_beyond(tmp_path: Path) -> None:
    one = _profiled(_tiny_profile(tmp_path / "p.json"), threads=1)
    assert [one.latency_ms(b) for b in (1, 2, 4, 8)] == [10.0, 18.0, 34.0, 66.0]
    assert one.latency_ms(3) == pytest.approx(26.0)  # halfway between b=2 and b=4
    assert one.latency_ms(6) == pytest.approx(50.0)
    assert one.latency_ms(16) == pytest.approx(132.0)  # beyond the largest: in proportion
    assert one.latency_ms(12) == pytest.approx(99.0)
    eight = _profiled(tmp_path / "p.json", threads=8)
    assert eight.latency_ms(4) == 8.0 and eight.latency_ms(3) == pytest.approx(7.0)


def test_profiled_sleeps_its_latency_times_the_scale_for_the_batch_it_is_given(tmp_path: Path) -> None:
    handler = _profiled(_tiny_profile(tmp_path / "p.json"), threads=1, time_scale=2.0)
    # Not the context's batch_size (4): the batch it is handed (a reshare changes the share).
    items = [Input(id=str(i), data=payload, content_type="application/json")
             for i, payload in enumerate([{}, "text", [1, 2]])]
    start = time.perf_counter()
    result = run_batch(handler, items)
    elapsed_ms = (time.perf_counter() - start) * 1000
    assert elapsed_ms >= 52.0  # L[1, 3] = 26 ms, times 2
    assert [o.value for o in result.outcomes] == [{"slept_ms": 52.0, "batch": 3, "threads": 1}] * 3


def test_profiled_time_scale_defaults_to_one_and_may_be_zero(tmp_path: Path) -> None:
    path = _tiny_profile(tmp_path / "p.json")
    assert _profiled(path, threads=8).time_scale == 1.0
    fast = _profiled(path, threads=8, time_scale=0)
    assert run_batch(fast, fast.example_batch(2)).outcomes[0].value == {"slept_ms": 0.0, "batch": 2, "threads": 8}


@pytest.mark.parametrize("options, message", [
    ({}, "needs a profile: -o profile=PATH"),
    ({"profile": "missing.json"}, "no profile at"),
    ({"profile": "bad.json"}, "is not valid JSON"),
    ({"profile": "empty.json"}, "has no entries"),
    ({"profile": "p.json", "time_scale": -1}, "time_scale must be a number >= 0"),
    ({"profile": "p.json", "time_scale": "fast"}, "time_scale must be a number >= 0"),
])
def test_profiled_initialize_says_what_is_wrong(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               options: dict, message: str) -> None:
    monkeypatch.chdir(tmp_path)
    _tiny_profile(tmp_path / "p.json")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "empty.json").write_text('{"entries": []}')
    handler = load_handler("profiled")
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        handler.initialize(Context(model_name="profiled", threads=1, options=options))


def test_profiled_threads_not_in_the_profile_fail_at_initialize(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no entries for 4 threads .it has threads 1, 8."):
        _profiled(_tiny_profile(tmp_path / "p.json"), threads=4)


def test_the_modelled_16_core_profile_covers_t_1_to_16() -> None:
    """profiles/sim/resnet50-16core.json, as make_resnet50_16core.py imports it: a model, and it says so."""
    prof = Profile.load(ROOT / "profiles" / "sim" / "resnet50-16core.json")
    assert prof.max_threads == 16 and prof.batch_sizes == [1, 2, 4, 8, 16, 32, 64]
    assert prof.machine is not None and prof.machine.cpu_model.startswith("MODEL, not a measurement")
    assert prof.machine.cores_per_socket == 16
    # More threads never slower, a larger batch never faster.
    table = prof.table().latency_ms
    assert (table[1:] <= table[:-1]).all() and (table[:, 1:] >= table[:, :-1]).all()
    # 64 simulated cores are planned with instances of the profile's 16 threads at most.
    config = solve(prof, 64, 256)
    assert config.batch == 256 and config.threads <= 64 and len(config.instances) > 1
    assert max(i.threads for i in config.instances) <= 16


# --- the synthetic topology -------------------------------------------------
def test_synthetic_topology_is_one_socket_of_labels_that_allocation_does_not_pin() -> None:
    topo = Topology.synthetic(64)
    assert topo.simulated and topo.source == "synthetic"
    assert len(topo.sockets) == 1 and topo.physical_cores == 64 == topo.max_cores_per_socket
    assert [c.cpu for c in topo.cores] == list(range(64)) and topo.allowed == frozenset(range(64))
    assert "simulated" in topo.describe() and "64 physical cores" in topo.summary()
    placed = allocate(topo, Configuration.parse("4*16x8"))
    assert [a.cpus for a in placed][-1] == tuple(range(48, 64))
    assert all(not a.pin for a in placed)
    rest = topo.without(range(8))  # what a reconfiguration allocates its new instances on
    assert rest.simulated and all(not a.pin for a in allocate(rest, Configuration.parse("2*16x8")))
    assert not Topology.detect().simulated
    assert all(a.pin for a in allocate(Topology.detect(), Configuration.parse("1x1")))
    with pytest.raises(ValueError):
        Topology.synthetic(0)


def test_an_instance_not_to_pin_is_not_pinned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pinned: list[list[int]] = []
    monkeypatch.setattr(runtime, "pin", pinned.append)
    spec = RuntimeSpec(model="profiled", handler="profiled", instance_id="s0", threads=8, batch=4,
                       cpus=list(range(8, 16)), pin=False,
                       options={"profile": str(_tiny_profile(tmp_path / "p.json")), "time_scale": 0})
    handler = runtime.start(spec)
    assert pinned == [] and handler.initialized
    runtime.start(spec.model_copy(update={"pin": True}), warm_up=False)
    assert pinned == [list(range(8, 16))]  # the default still pins


# --- the command line -------------------------------------------------------
@pytest.mark.parametrize("command", ["up", "pool"])
def test_simulate_cores_is_refused_for_a_model_that_computes(command: str, redis_url: str, prefix: str) -> None:
    res = CliRunner().invoke(main, [command, "--model", "resnet50", "--simulate-cores", "16", "--instances", "16x1",
                                    "--redis-url", redis_url, "--prefix", prefix])
    assert res.exit_code == 1
    assert res.output.strip().splitlines() == [
        "Error: --simulate-cores serves only models that sleep instead of computing (echo, sleep, "
        "profiled), not 'resnet50'"
    ]


def _plan(*args: str) -> tuple[ServePlan, str]:
    plans: list[ServePlan] = []

    @serving_options
    def command(plan: ServePlan) -> None:
        plans.append(plan)

    res = CliRunner().invoke(click.command()(command), list(args))
    assert res.exit_code == 0, res.output
    return plans[0], res.stderr


def test_simulated_plan_defaults_t_to_the_simulated_cores_and_shares_the_profile(tmp_path: Path) -> None:
    path = _tiny_profile(tmp_path / "p.json")
    plan, note = _plan("--model", "profiled", "-o", f"profile={path}", "--simulate-cores", "16", "--batch", "8")
    assert plan.topology is not None and plan.topology.simulated and plan.topology.physical_cores == 16
    assert str(plan.configuration) == "8x4,8x4" and plan.configuration.threads == 16
    assert plan.profile_path == str(path) and plan.options["profile"] == str(path.resolve())
    assert "T=16, B=8" in note and "another machine" not in note
    # --profile alone is what the instances sleep by as well. Not simulated, the plan must fit
    # this machine's cores (up refuses -t 8 on 2 before starting anything): T=2.
    plan, _ = _plan("--model", "profiled", "--profile", str(path), "-t", "2", "-b", "4")
    assert plan.options["profile"] == str(path.resolve()) and plan.topology is None
    assert str(plan.configuration) == "1x2,1x2"


def test_profiled_without_any_profile_is_one_line() -> None:
    res = CliRunner().invoke(main, ["up", "--model", "profiled", "--simulate-cores", "4"])
    assert res.exit_code == 1
    assert res.output.strip().splitlines() == [
        "Error: the profiled model needs a profile: -o profile=PATH (or --profile PATH)"]


# --- end to end ---------------------------------------------------------------
def test_up_serves_a_simulated_16_core_machine_on_unpinned_instances(
    tmp_path: Path, redis_url: str, r: redis.Redis, prefix: str,
) -> None:
    path = _tiny_profile(tmp_path / "p.json")
    cmd = [sys.executable, "-m", "packrat_mq", "up", "--model", "profiled", "-o", f"profile={path}",
           "-o", "time_scale=0.01", "--simulate-cores", "16", "--threads", "16", "--batch", "8",
           "--redis-url", redis_url, "--prefix", prefix, "--batch-timeout-ms", "3"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PACKRAT_LOG_LEVEL="WARNING"), stdout=subprocess.PIPE,
                            text=True)

    def key(*parts: str) -> str:
        return ":".join((prefix, *parts))

    def instances() -> list[dict[bytes, bytes]]:
        ids = [i.decode() for i in r.smembers(key("index", "instances", "profiled"))]
        return [r.hgetall(key("instance", "profiled", i)) for i in ids]

    try:
        wait_for(lambda: sum(h.get(b"state") == b"ready" for h in instances()) == 2
                 and r.hget(key("dispatcher", "profiled"), "state") == b"ready", 60, "two instances ready")
        records = instances()
        cpus = sorted(tuple(int(c) for c in h[b"cpus"].split(b",")) for h in records)
        assert cpus == [tuple(range(8)), tuple(range(8, 16))]  # past this machine's cores
        allowed = os.sched_getaffinity(0)
        for h in records:
            assert int(h[b"threads"]) == 8
            assert os.sched_getaffinity(int(h[b"pid"])) == allowed  # not pinned

        reply_to = key("replies", uuid.uuid4().hex)
        sent = set()
        for i in range(40):
            rid = f"r{i}"
            r.xadd(key("requests", "profiled"), {"id": rid, "reply_to": reply_to, "payload": json.dumps({"i": i}),
                                                 "content_type": "application/json"})
            sent.add(rid)
        wait_for(lambda: r.xlen(reply_to) >= len(sent), 30, "40 replies")
        replies = {f[b"id"].decode(): f for _, f in r.xrange(reply_to)}
        assert set(replies) == sent
        for f in replies.values():
            assert f[b"status"] == b"ok", f
            value = json.loads(f[b"payload"])
            assert value["threads"] == 8 and 1 <= value["batch"] <= 4
            expected = {1: 5.0, 2: 6.0, 3: 7.0, 4: 8.0}[value["batch"]] * 0.01
            assert value["slept_ms"] == pytest.approx(expected)
    finally:
        interrupt(proc)
    out = proc.stdout.read() if proc.stdout else ""
    assert "simulating one socket of 16 cores" in out and "cpus [8, 9, 10, 11, 12, 13, 14, 15]" in out


# --- the estimator and reconfiguration at 16 simulated cores ------------------
@pytest.mark.timeout(240)
def test_the_estimator_and_both_kinds_of_reconfiguration_at_16_simulated_cores(
    r: redis.Redis, settings: Settings, redis_url: str, prefix: str,
) -> None:
    """Adaptive from B=1 on the modelled 16-core profile: 8 clients move B to 8 (16x1 -> 8 x 2x1, new
    unpinned instances on cpus past this machine's), idle brings B back to 1, a reshare keeps the process."""
    sim = str(ROOT / "profiles" / "sim" / "resnet50-16core.json")
    quiet = settings.model_copy(update={"log_level": "WARNING", "batch_timeout_ms": 5.0})
    sup = Supervisor(r, quiet, redis_url, "profiled", Configuration.parse("16x1"), handler="profiled",
                     options={"profile": sim, "time_scale": 1.0}, profile=sim, node="n1",
                     topology=Topology.synthetic(16), adaptive=True)
    assert sup.threads_budget == 16
    allowed = os.sched_getaffinity(0)
    try:
        sup.start(ready_timeout=60)
        with Load(redis_url, prefix, "profiled", clients=8, payload={}) as load:
            supervise_until(sup, lambda: sup.deployment.batch == 8 and sup.change is None, 90,
                            "B to follow eight clients")
            assert sorted(i.record.threads for i in sup.instances) == [2] * 8
            assert max(max(i.record.cpus) for i in sup.instances) > 2
            for inst in sup.instances:
                assert os.sched_getaffinity(inst.child.process.pid) == allowed  # not pinned
        supervise_until(sup, lambda: sup.deployment.batch == 1 and sup.change is None, 60, "B back to 1")
        assert [i.record.threads for i in sup.instances] == [16]
        kinds = [(e["kind"], e["origin"]) for e in history(r, quiet, "profiled")]
        assert ("active-passive", "estimator") in kinds
        assert_exactly_once(load, r, quiet, "profiled")
        pid = sup.instances[0].child.process.pid
        change = sup.reconfigure(Configuration.parse("16x4"), reason="test")
        assert change is not None and change.kind == "reshare"
        supervise_until(sup, lambda: sup.change is None, 20, "the reshare")
        assert sup.instances[0].child.process.pid == pid and sup.deployment.batch == 4
    finally:
        sup.stop(timeout=10)
