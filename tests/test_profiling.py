"""The profiler: statistics, schedule rules, real child processes, resume, RQ jobs."""
from __future__ import annotations

import base64
import contextlib
import json
import math
import zlib
from pathlib import Path
from typing import Any

import pytest
import redis

from optimizer.planning.profile import FORMAT_VERSION, MachineInfo, Profile, ProfileEntry
from optimizer.profiling.jobs import enqueue_profile
from optimizer.profiling.options import (
    ProfilingError,
    ProfilingOptions,
    default_output,
    power_of_two_batches,
    run_log_path,
)
from optimizer.profiling.scheduler import _best_split, profile_model
from optimizer.profiling.statistics import measure, t_quantile
from packrat_mq import graph as graph_modes
from packrat_mq.instances import Configuration
from packrat_mq.settings import Settings
from packrat_mq.topology import Topology
from workers.allocation import allocate


def test_t_quantiles_match_tables() -> None:
    for df, conf, expected in [(1, 0.95, 12.706), (2, 0.95, 4.303), (4, 0.95, 2.776),
                               (9, 0.99, 3.250), (30, 0.95, 2.042), (5, 0.90, 2.015)]:
        assert t_quantile(conf, df) == pytest.approx(expected, abs=5e-4)
    assert t_quantile(0.95, 5000) == pytest.approx(1.960, abs=1e-3)


class FakeTime:
    """A clock that advances only when the measured function 'runs'."""

    def __init__(self, samples_ms: list[float]) -> None:
        self.now, self.samples = 0.0, list(samples_ms)

    def clock(self) -> float:
        return self.now

    def run(self) -> None:
        self.now += (self.samples.pop(0) if self.samples else 10.0) / 1000.0


def _measure(samples: list[float], **kw: Any):
    fake = FakeTime(samples)
    args = dict(warmup=0, min_iters=5, max_iters=100, rel_ci=0.02, confidence=0.95, budget_s=1e9)
    args.update(kw)
    return measure(fake.run, clock=fake.clock, **args)


def test_measure_stops_when_converged() -> None:
    m = _measure([10.0, 10.1, 9.9, 10.0, 10.05] + [10.0] * 50)
    assert m.stop == "converged" and m.n == 5
    assert m.stats()["mean_ms"] == pytest.approx(10.01, abs=0.01)


def test_measure_noisy_runs_to_max_iters() -> None:
    noisy = [5.0, 15.0] * 100
    m = _measure(noisy, max_iters=20)
    assert m.stop == "max_iters" and m.n == 20


def test_measure_budget_and_warmup() -> None:
    m = _measure([5.0, 15.0] * 100, warmup=2, budget_s=0.1)
    assert m.stop == "budget" and 5 <= m.n < 100
    assert m.warmup_s == pytest.approx(0.02)


def test_measure_stops_early_when_dominated() -> None:
    noisy = [95.0, 105.0] * 100
    m = _measure(noisy, dominated_above_ms=50.0)
    assert m.stop == "dominated" and m.n == 5


def test_best_split_uses_same_cores() -> None:
    upper = {(1, 1): 5.0, (1, 2): 9.0, (2, 1): 4.0, (3, 1): 3.0}
    # (2, 2) can run as (1, 1) + (1, 1): 5 ms.
    assert _best_split(2, 2, upper, [1, 2, 4]) == 5.0
    # (3, 2): (1, 1) + (2, 1) -> max(5, 4).
    assert _best_split(3, 2, upper, [1, 2, 4]) == 5.0
    assert _best_split(1, 2, upper, [1, 2, 4]) == math.inf
    assert _best_split(2, 1, upper, [1, 2, 4]) == math.inf


def test_power_of_two_batches() -> None:
    assert power_of_two_batches(32) == [1, 2, 4, 8, 16, 32]
    assert power_of_two_batches(12) == [1, 2, 4, 8, 12]
    assert power_of_two_batches(1) == [1]


def test_options_validate() -> None:
    with pytest.raises(ValueError):
        ProfilingOptions(model="echo", min_iters=10, max_iters=5)
    assert ProfilingOptions(model="echo", batches=[4, 1, 4]).batches == [1, 4]


def _quick(model: str, **kw: Any) -> ProfilingOptions:
    # No floor on a point's timed seconds unless a test asks for one: these models are steady.
    args: dict[str, Any] = dict(model=model, threads=[1], batches=[1, 2], warmup=1,
                                min_iters=5, max_iters=40, rel_ci=0.1, min_timed_s=0.0)
    args.update(kw)
    return ProfilingOptions(**args)


def test_sleep_profile_stops_adaptively(tmp_path: Path) -> None:
    out = tmp_path / "sleep.json"
    opts = _quick("sleep", batches=[1, 2, 4], options={"base_ms": 5})
    report = profile_model(opts, out, progress=False)
    assert not report.failed and not report.interrupted
    profile = Profile.load(out)
    assert profile.model == "sleep" and profile.mode == "eager"
    assert [(e.threads, e.batch) for e in profile.entries] == [(1, 1), (1, 2), (1, 4)]
    for e in profile.entries:
        assert 5.0 <= e.mean_ms < 50.0 and e.min_ms <= e.p50_ms <= e.max_ms
    # A steady sleep is known within 10% long before 40 iterations.
    assert sum(m["iterations"] for m in report.measured) < 3 * opts.max_iters
    assert any(m["stop"] == "converged" for m in report.measured)
    assert report.fixed_estimate_s > report.adaptive_s
    log = [json.loads(line) for line in run_log_path(out).read_text().splitlines()]
    assert log[-1]["saved_s"] == pytest.approx(report.saved_s, abs=1e-3)
    assert "saved" in report.summary()


def test_echo_profile_and_resume(tmp_path: Path) -> None:
    out = tmp_path / "echo.json"
    first = profile_model(_quick("echo", max_iters=10), out, progress=False)
    assert len(first.measured) == 2 and first.resumed == 0
    again = profile_model(_quick("echo", batches=[1, 2, 4], max_iters=10), out, progress=False)
    assert again.resumed == 2
    assert [(m["threads"], m["batch"]) for m in again.measured] == [(1, 4)]
    assert len(Profile.load(out).entries) == 3
    # Graph mode is a different profile: refused in the same file.
    with pytest.raises(ProfilingError, match="eager profile"):
        profile_model(_quick("echo", graph="torchscript"), out, progress=False)
    assert default_output("echo", "torchscript") == Path("profiles/echo.torchscript.json")
    assert _quick("echo", graph=True).mode == graph_modes.default_backend("echo")  # jobs queued as booleans


def test_profiling_a_second_kind_of_machine_keeps_the_first_ones_profile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = MachineInfo.current()
    if here.cpu_model is None:
        pytest.skip("this machine's CPU model is unknown")
    monkeypatch.chdir(tmp_path)
    other = MachineInfo(cpu_model="Imaginary CPU 9000", sockets=1, physical_cores=64)
    theirs = Profile(model="echo", machine=other,
                     entries=(ProfileEntry(threads=1, batch=1, mean_ms=1.0),)).save(Path("profiles/echo.json"))
    before = theirs.read_text()
    report = profile_model(_quick("echo", max_iters=10), None, progress=False)
    assert report.path == Path("profiles") / "machines" / here.key / "echo.json"
    assert theirs.read_text() == before  # the other machine's profile is untouched
    assert Profile.load(report.path).machine.matches(here)
    assert default_output("echo") == report.path  # the next run here resumes its own
    again = profile_model(_quick("echo", batches=[1, 2, 4], max_iters=10), None, progress=False)
    assert again.path == report.path and again.resumed == 2
    # The command says why the profile is not where the operator may look for it.
    from click.testing import CliRunner

    from packrat_mq.cli.profile_run import run
    result = CliRunner().invoke(run, ["--model", "echo", "--threads-max", "1", "--batches", "1,2,4", "--quiet"])
    assert result.exit_code == 0, result.output
    assert (f"profiles/echo.json holds another machine's profile (Imaginary CPU 9000, 1 socket, 64 cores); this "
            f"machine's goes beside it, to {report.path}") in result.output
    assert theirs.read_text() == before


def test_interrupt_keeps_points_and_rerun_resumes(tmp_path: Path) -> None:
    out = tmp_path / "echo.json"

    def stop_after_first(point: dict[str, Any]) -> None:
        raise KeyboardInterrupt

    report = profile_model(_quick("echo", max_iters=10), out, progress=False, on_point=stop_after_first)
    assert report.interrupted and len(report.measured) == 1
    assert len(Profile.load(out).entries) == 1
    rest = profile_model(_quick("echo", max_iters=10), out, progress=False)
    assert rest.resumed == 1 and len(rest.measured) == 1
    assert len(Profile.load(out).entries) == 2


def test_slo_skips_larger_batches(tmp_path: Path) -> None:
    opts = _quick("sleep", batches=[1, 2, 4, 8], options={"base_ms": 1, "per_item_ms": 4},
                  max_latency_ms=12.0)
    report = profile_model(opts, tmp_path / "sleep.json", progress=False)
    assert [m["batch"] for m in report.measured] == [1, 2, 4]
    assert [(s["threads"], s["batch"]) for s in report.skipped] == [(1, 8)]
    assert Profile.load(tmp_path / "sleep.json").entry(1, 8) is None


def test_dominated_points_stop_at_min_iters(tmp_path: Path) -> None:
    if Topology.detect().max_cores_per_socket < 2:
        pytest.skip("needs two physical cores on one socket")
    # Sleep ignores threads: (2, 2) takes 9 ms but (1, 1) + (1, 1) on the same
    # two cores takes 5, so L[2, 2] is never needed precisely.
    opts = _quick("sleep", threads=[1, 2], batches=[1, 2], options={"base_ms": 1, "per_item_ms": 4},
                  rel_ci=1e-6, max_iters=30, warmup=0)
    report = profile_model(opts, tmp_path / "sleep.json", progress=False)
    stops = {(m["threads"], m["batch"]): m for m in report.measured}
    assert stops[(2, 2)]["stop"] == "dominated"
    assert stops[(2, 2)]["iterations"] < 30
    assert stops[(1, 1)]["iterations"] == 30
    # One copy of a 2-thread instance fills the two cores; the 1-thread points ran two copies.
    assert stops[(2, 2)]["cpus"] == stops[(2, 1)]["cpus"] and [len(c) for c in stops[(2, 2)]["cpus"]] == [2]
    assert stops[(1, 1)]["copies"] == 2 and stops[(2, 2)]["copies"] == 1


def _two_cores() -> Topology:
    topology = Topology.detect()
    if topology.max_cores_per_socket < 2:
        pytest.skip("needs two physical cores on one socket")
    return topology


def _records(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


def test_co_located_copies_run_on_disjoint_cores_and_the_slowest_counts(tmp_path: Path) -> None:
    topology = _two_cores()
    # Where the worker would put two 1-thread instances: the profiler must use the same cores.
    first, second = allocate(topology, Configuration.uniform(2, 1, 1))
    records = tmp_path / "records"
    records.mkdir()
    opts = _quick("tests.profiling_fixtures:SlowOnOneCpu", threads=[1], batches=[1], threads_max=2,
                  min_iters=3, max_iters=5, warmup=0,
                  options={"slow_cpu": second.cpus[0], "fast_ms": 1, "slow_ms": 40, "record_dir": str(records)})
    assert opts.placement == "co-located"  # the default
    report = profile_model(opts, tmp_path / "p.json", progress=False)
    assert not report.failed, report.failed
    (point,) = report.measured
    assert point["copies"] == 2 and point["cpus"] == [list(first.cpus), list(second.cpus)]
    # Two processes, each really pinned to its own core, disjoint.
    seen = _records(records)
    assert sorted(r["affinity"] for r in seen) == sorted([list(first.cpus), list(second.cpus)])
    assert all(r["affinity"] == r["cores"] for r in seen)
    assert len({r["instance"] for r in seen}) == 2
    # Copy 0 takes 1 ms, copy 1 takes 40 ms: each round's sample is the slower one.
    profile = Profile.load(tmp_path / "p.json")
    entry = profile.entry(1, 1)
    assert profile.placement == "co-located" and entry is not None and entry.copies == 2
    assert entry.min_ms is not None and entry.min_ms >= 40.0


def test_isolated_runs_one_copy(tmp_path: Path) -> None:
    topology = _two_cores()
    _, second = allocate(topology, Configuration.uniform(2, 1, 1))
    records = tmp_path / "records"
    records.mkdir()
    opts = _quick("tests.profiling_fixtures:SlowOnOneCpu", threads=[1, 2], batches=[1], threads_max=2,
                  min_iters=3, max_iters=5, warmup=0, placement="isolated",
                  options={"slow_cpu": second.cpus[0], "fast_ms": 1, "slow_ms": 40, "record_dir": str(records)})
    report = profile_model(opts, tmp_path / "p.json", progress=False)
    assert [(m["threads"], m["copies"]) for m in report.measured] == [(1, 1), (2, 1)]
    assert sorted(len(r["affinity"]) for r in _records(records)) == [1, 2]
    profile = Profile.load(tmp_path / "p.json")
    assert profile.placement == "isolated"
    # Alone on the first core, the 1-thread instance is the fast one; the 2-thread one holds the slow cpu.
    assert profile.latency(1, 1) < 40.0 <= profile.latency(2, 1)


def test_resume_refuses_the_other_placement(tmp_path: Path) -> None:
    out = tmp_path / "echo.json"
    profile_model(_quick("echo", max_iters=5), out, progress=False)
    with pytest.raises(ProfilingError, match="measured co-located, and this run measures isolated.*--co-located"):
        profile_model(_quick("echo", max_iters=5, placement="isolated"), out, progress=False)
    fresh = profile_model(_quick("echo", max_iters=5, placement="isolated"), out, progress=False, fresh=True)
    assert len(fresh.measured) == 2 and Profile.load(out).placement == "isolated"

    # A file of format 1 does not say: it was measured isolated, and resumes as such.
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format_version": 1, "model": "echo", "mode": "eager",
                               "entries": [{"threads": 1, "batch": 1, "mean_ms": 0.5}]}))
    with pytest.raises(ProfilingError, match="measured isolated, and this run measures co-located.*--isolated"):
        profile_model(_quick("echo", max_iters=5), old, progress=False)
    resumed = profile_model(_quick("echo", max_iters=5, placement="isolated"), old, progress=False)
    assert resumed.resumed == 1 and [(m["threads"], m["batch"]) for m in resumed.measured] == [(1, 2)]
    assert Profile.load(old).format_version == FORMAT_VERSION  # saved again in today's format


def test_points_with_another_number_of_copies_are_measured_again(tmp_path: Path) -> None:
    _two_cores()
    out = tmp_path / "echo.json"
    first = profile_model(_quick("echo", batches=[1], threads_max=2, max_iters=5), out, progress=False)
    assert [m["copies"] for m in first.measured] == [2]
    again = profile_model(_quick("echo", batches=[1], threads_max=2, max_iters=5), out, progress=False)
    assert again.resumed == 1 and not again.measured
    # T = 1: one copy of a 1-thread instance, so the point of two copies does not stand for it.
    narrow = profile_model(_quick("echo", batches=[1], threads_max=1, max_iters=5), out, progress=False)
    assert narrow.remeasured == 1 and [m["copies"] for m in narrow.measured] == [1]
    entry = Profile.load(out).entry(1, 1)
    assert entry is not None and entry.copies == 1
    assert "measured again with another number of copies" in narrow.summary()


def test_failed_batch_is_reported_and_larger_skipped(tmp_path: Path) -> None:
    opts = _quick("tests.profiling_fixtures:FailAboveOne", batches=[1, 2, 4], max_iters=10)
    report = profile_model(opts, tmp_path / "f.json", progress=False)
    assert [m["batch"] for m in report.measured] == [1]
    assert report.failed[0]["batch"] == 2 and "MemoryError" in report.failed[0]["error"]
    assert [s["batch"] for s in report.skipped] == [4]
    assert Profile.load(tmp_path / "f.json").model == "tests.profiling_fixtures.FailAboveOne"


def test_unknown_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ProfilingError, match="unknown model 'nope'"):
        profile_model(_quick("nope"), tmp_path / "x.json", progress=False)


def _stored_as_json(r: redis.Redis, job_id: str) -> tuple[Any, Any]:
    """The job's call and its latest return value as RQ stored them, parsed as JSON (fails on pickle)."""
    from rq.job import Job
    from rq.results import Result

    call = json.loads(zlib.decompress(r.hget(Job.key_for(job_id), "data")))
    entries = r.xrevrange(Result.get_key(job_id), count=1)
    value = json.loads(base64.b64decode(entries[0][1][b"return_value"])) if entries else None
    return call, value


def _delete_rq_traces(r: redis.Redis, queue: str, job_ids: list[str], workers: tuple[str, ...] = ()) -> None:
    """RQ's keys are not under the test's prefix: remove what a test's jobs left on a shared server."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    for job_id in job_ids:
        with contextlib.suppress(Exception):
            Job.fetch(job_id, connection=r, serializer=JSONSerializer).delete()
    keys = [*r.scan_iter(match=f"rq:*:{queue}"), *(f"rq:worker:{w}" for w in workers)]
    if keys:
        r.unlink(*keys)
    r.srem("rq:queues", f"rq:queue:{queue}")


def test_rq_job_is_json_and_profiles_and_stores_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, r: redis.Redis, settings: Settings
) -> None:
    from rq import SimpleWorker
    from rq.job import Job
    from rq.serializers import JSONSerializer

    monkeypatch.chdir(tmp_path)
    node = settings.prefix  # a queue of this test's own, on a server other runs may share
    job = enqueue_profile(r, _quick("echo", max_iters=10), node=node, prefix=settings.prefix,
                          store_dir=str(tmp_path / "store"))
    worker = SimpleWorker([job.origin], connection=r, serializer=JSONSerializer)
    try:
        assert job.origin == f"packrat-profile-{node}"
        (func, _instance, args, kwargs), _ = _stored_as_json(r, job.id)
        assert func == "optimizer.profiling.jobs.profile_job" and args == []
        assert kwargs["options"]["model"] == "echo" and kwargs["prefix"] == settings.prefix

        # The worker runs with the serializer `rq worker --serializer` is told to use.
        assert worker.work(burst=True)
        job = Job.fetch(job.id, connection=r, serializer=JSONSerializer)
        assert job.get_status() == "finished", job.latest_result().exc_string if job.latest_result() else ""
        _, result = _stored_as_json(r, job.id)
        assert result == job.return_value()
        assert result["key"] == settings.keys.profile_result("echo", node)
        stored = Profile.model_validate_json(r.get(result["key"]))
        assert len(stored.entries) == 2
        assert Profile.load(tmp_path / "store" / "echo.json").entries == stored.entries
    finally:
        _delete_rq_traces(r, job.origin, [job.id], (worker.name,))


def test_cli_run_and_enqueue(tmp_path: Path, r: redis.Redis, settings: Settings) -> None:
    import click
    from click.testing import CliRunner
    from rq.cli import main as rq_cli
    from rq.serializers import JSONSerializer, resolve_serializer

    from optimizer.profiling.jobs import SERIALIZER
    from packrat_mq.cli.profile_run import run

    out = tmp_path / "echo.json"
    args = ["--model", "echo", "--batches", "1,2", "--threads-max", "1", "--max-iters", "5",
            "--warmup", "0", "-o", str(out), "--quiet"]
    result = CliRunner().invoke(run, args)
    assert result.exit_code == 0, result.output
    assert "measured 2 points" in result.output and "saved" in result.output
    again = CliRunner().invoke(run, [*args, "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.output)[0]["resumed"] == 2

    bad = CliRunner().invoke(run, ["--model", "echo", "--batches", "1,x"])
    assert bad.exit_code == 2 and "comma-separated integers" in bad.output

    node = settings.prefix
    enqueue = ["--model", "echo", "--enqueue", "--node", node, "--redis-url", settings.redis_url,
               "--prefix", settings.prefix]
    queued = CliRunner().invoke(run, [*enqueue, "--json"])
    assert queued.exit_code == 0, queued.output
    (job,) = json.loads(queued.output)
    try:
        assert job["queue"] == f"packrat-profile-{node}"
        assert job["result_key"] == settings.keys.profile_result("echo", node)
        (_, _, _, kwargs), _ = _stored_as_json(r, job["job_id"])
        assert kwargs["options"]["model"] == "echo"
        # The printed worker command starts a worker with the jobs' serializer.
        assert job["worker_command"] == (
            f"rq worker packrat-profile-{node} --serializer {SERIALIZER} --url {settings.redis_url}")
        rq_worker = rq_cli.get_command(click.Context(rq_cli), "worker")
        ctx = rq_worker.make_context("worker", job["worker_command"].split()[2:])
        assert ctx.params["queues"] == (job["queue"],) and ctx.params["url"] == settings.redis_url
        assert resolve_serializer(ctx.params["serializer"]) is JSONSerializer
    finally:
        _delete_rq_traces(r, job["queue"], [job["job_id"]])


@pytest.mark.slow
def test_graph_mode_traces_each_batch_size(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    opts = _quick("tests.profiling_fixtures:TinyLinear", graph="torchscript", max_iters=10)
    report = profile_model(opts, tmp_path / "tiny.torchscript.json", progress=False)
    assert not report.failed, report.failed
    profile = Profile.load(tmp_path / "tiny.torchscript.json")
    assert profile.mode == "torchscript" and len(profile.entries) == 2


def test_cli_quick_profiles_the_optimizers_grid_with_the_quick_schedule(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from optimizer.profiling.options import QUICK_SCHEDULE
    from packrat_mq.cli.profile_run import run

    cores = min(2, Topology.detect().max_cores_per_socket)
    out = tmp_path / "echo.json"
    result = CliRunner().invoke(run, ["--model", "echo", "--quick", "--threads-max", str(cores),
                                      "--max-batch", "8", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    (report,) = json.loads(result.output)
    # t = 1..T, b = powers of two up to B: what the optimizer can use for (T, B), nothing else.
    grid = [(t, b) for t in range(1, cores + 1) for b in (1, 2, 4, 8)]
    assert [(m["threads"], m["batch"]) for m in report["measured"]] == grid
    assert report["placement"] == "co-located"
    (logged,) = [json.loads(line)["options"] for line in run_log_path(out).read_text().splitlines()]
    assert {k: logged[k] for k in QUICK_SCHEDULE} == QUICK_SCHEDULE
    assert all(m["iterations"] >= QUICK_SCHEDULE["min_iters"] for m in report["measured"])

    # An option given explicitly wins over the quick schedule; --isolated measures one copy.
    other = tmp_path / "isolated.json"
    result = CliRunner().invoke(run, ["--model", "echo", "--quick", "--isolated", "--threads-max", "1",
                                      "--max-batch", "2", "--min-iters", "4", "-o", str(other), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "(eager, isolated): measured 2 points" in result.output
    (logged,) = [json.loads(line)["options"] for line in run_log_path(other).read_text().splitlines()]
    assert logged["min_iters"] == 4 and logged["warmup"] == QUICK_SCHEDULE["warmup"]
    assert logged["placement"] == "isolated" and Profile.load(other).placement == "isolated"
    assert {e.copies for e in Profile.load(other).entries} == {1}


def test_resume_refuses_other_vector_extensions(tmp_path: Path) -> None:
    """Same host, name and design, other vector extensions (a VM that hides AVX-512): other kernels."""
    out = tmp_path / "echo.json"
    profile_model(_quick("echo", max_iters=5), out, progress=False)
    profile = Profile.load(out)
    assert profile.machine is not None
    if profile.machine.cpu_isa is None:
        pytest.skip("this machine's vector extensions are unknown: nothing to differ")
    here = set(profile.machine.cpu_isa)
    other = tuple(sorted(here ^ {"avx512f"}))
    profile.machine = profile.machine.model_copy(update={"cpu_isa": other})
    profile.save(out)
    with pytest.raises(ProfilingError, match="another machine.*vector extensions.*--fresh") as refused:
        profile_model(_quick("echo", batches=[1, 2, 4], max_iters=5), out, progress=False)
    assert len(Profile.load(out).entries) == 2  # nothing was added to the other machine's points
    # And where a run without -o would write this machine's own: here the usual file, being free.
    assert str(refused.value).endswith("(without -o, this machine's profile goes beside it: profiles/echo.json)")


def test_a_point_is_not_converged_before_it_has_covered_min_timed_s() -> None:
    """Five tight samples of one quiet spell (the 12-07 BERT point) are not a converged mean: timing
    goes on until the point has covered ``min_timed_s`` of the host, then stops as soon as it may."""
    from optimizer.profiling.statistics import measure

    now = [0.0]

    def clock() -> float:
        return now[0]

    def run() -> float:
        now[0] += 0.35  # a 350 ms batch, the same every time: converged from the first five
        return 350.0

    common = dict(warmup=0, min_iters=5, max_iters=100, rel_ci=0.02, confidence=0.95, budget_s=30.0,
                  self_timed=True, clock=clock)
    quick = measure(run, **common)  # type: ignore[arg-type]
    assert quick.stop == "converged" and quick.n == 5
    now[0] = 0.0
    floored = measure(run, min_timed_s=3.0, **common)  # type: ignore[arg-type]
    assert floored.stop == "converged" and floored.n == 9  # 9 x 0.35 s = 3.15 s, the first past 3 s
    now[0] = 0.0
    capped = measure(run, min_timed_s=3.0, **{**common, "max_iters": 6})  # type: ignore[arg-type]
    assert capped.stop == "max_iters" and capped.n == 6  # a fast point's iterations still cap it
    assert ProfilingOptions(model="echo").min_timed_s == 3.0


def test_a_pass_schedule_shares_one_points_iterations_and_budget() -> None:
    one = _quick("echo", min_iters=6, max_iters=40, rel_ci=0.05, budget_s=30.0, min_timed_s=3.0)
    assert one.pass_schedule() == {"warmup": 1, "min_iters": 6, "max_iters": 40, "rel_ci": 0.05,
                                   "confidence": 0.95, "budget_s": 30.0, "min_timed_s": 3.0}  # one pass: as asked
    four = _quick("echo", min_iters=6, max_iters=40, rel_ci=0.05, budget_s=30.0, min_timed_s=3.0,
                  passes=4).pass_schedule()
    assert four["min_iters"] == 2 and four["max_iters"] == 10 and four["budget_s"] == 7.5
    assert four["min_timed_s"] == 0.75
    assert four["rel_ci"] == pytest.approx(0.10)  # four pass means within 10% each: their mean within 5%
    with pytest.raises(ValueError):
        _quick("echo", passes=0)


def test_passes_run_in_fresh_processes_and_a_point_is_the_mean_of_its_passes(tmp_path: Path) -> None:
    """The host's speed moves between passes (the handler reads it at load): each pass sees its own."""
    speed = tmp_path / "ms"
    speed.write_text("4")
    threads = [1, 2] if Topology.detect().max_cores_per_socket >= 2 else [1]
    seen: list[tuple[int, int, int]] = []

    def slow_down_after_the_first_pass(point: dict[str, Any]) -> None:
        seen.append((point["pass"], point["threads"], point["batch"]))
        if point["pass"] == 1 and (point["threads"], point["batch"]) == (threads[-1], 2):
            speed.write_text("12")  # the last point of pass 1: pass 2's processes load at 12 ms

    out = tmp_path / "p.json"
    opts = _quick("tests.profiling_fixtures:SleepReadAtLoad", threads=threads, batches=[1, 2],
                  options={"path": str(speed)}, min_iters=4, max_iters=8, passes=2)
    report = profile_model(opts, out, progress=False, on_point=slow_down_after_the_first_pass)
    assert not report.failed and not report.interrupted
    # Pass 2 runs the thread counts the other way round.
    grid = [(t, b) for t in threads for b in (1, 2)]
    back = [(t, b) for t in threads[::-1] for b in (1, 2)]
    assert seen == [(1, t, b) for t, b in grid] + [(2, t, b) for t, b in back]
    for entry in Profile.load(out).entries:
        first, second = entry.pass_means_ms
        assert 4.0 <= first < 8.0 and 12.0 <= second < 16.0
        assert entry.mean_ms == pytest.approx((first + second) / 2, rel=1e-3)
        assert entry.iterations >= 4  # both passes' samples
        assert entry.pass_spread is not None and entry.pass_spread > 0.5
    assert "2 passes: the pass means of a point spread by a median" in report.summary()
    assert "the host moved between passes" in report.summary()
    assert report.as_dict()["pass_spread"]["max"] > 0.5
    # The interval of a point is as wide as its passes disagree, not as its samples (each pass steady).
    from optimizer.profiling.scheduler import _entry_half_width
    e = Profile.load(out).entry(1, 1)
    assert e is not None and _entry_half_width(e, 0.95) > 4.0


def test_an_interrupted_multi_pass_run_resumes_at_the_first_point_a_pass_lacks(tmp_path: Path) -> None:
    out = tmp_path / "echo.json"
    calls: list[dict[str, Any]] = []

    def stop_in_the_second_pass(point: dict[str, Any]) -> None:
        calls.append(point)
        if point["pass"] == 2:
            raise KeyboardInterrupt

    opts = _quick("echo", max_iters=10, passes=2)
    report = profile_model(opts, out, progress=False, on_point=stop_in_the_second_pass)
    assert report.interrupted and [(c["pass"], c["batch"]) for c in calls] == [(1, 1), (1, 2), (2, 1)]
    entries = {e.batch: e for e in Profile.load(out).entries}
    assert len(entries[1].pass_means_ms or []) == 2 and entries[2].pass_means_ms is None
    rest = profile_model(opts, out, progress=False)
    assert rest.resumed == 1 and [(m["pass"], m["batch"]) for m in rest.measured] == [(2, 2)]
    assert all(len(e.pass_means_ms or []) == 2 for e in Profile.load(out).entries)
    # One pass asked of a two-pass profile: nothing to measure.
    assert profile_model(_quick("echo", max_iters=10), out, progress=False).measured == []
