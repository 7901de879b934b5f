"""bench_adaptive's analysis of a finished run (no processes: a driver's record, made up)."""
from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

import pytest


def test_idle_wait_of_requests_that_found_the_service_empty_is_reported_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three lone requests, then two sent together: the second of those waits behind the first, needed wait."""
    # The benchmark quiets the processes it starts by setting PACKRAT_LOG_LEVEL when imported: kept
    # to this test, or every later test's `up` would log at WARNING (their checks read its INFO lines).
    monkeypatch.setenv("PACKRAT_LOG_LEVEL", os.environ.get("PACKRAT_LOG_LEVEL", "INFO"))
    bench = importlib.import_module("benchmarks.bench_adaptive")
    Phase, analyse = bench.Phase, bench.analyse
    def reply(at: float, inference_ms: float, queue_ms: float) -> dict[str, object]:
        return {"at": at, "ok": True, "inference_ms": inference_ms, "batch_size": 1, "queue_ms": queue_ms}

    sent = {"a": (0.0, "idle"), "b": (1.0, "idle"), "c": (2.0, "idle"), "d": (3.0, "idle"), "e": (3.001, "idle")}
    replies = {
        "a": [reply(0.062, 60.0, 1.0)],  # 2 ms beyond its inference
        "b": [reply(1.063, 60.0, 1.0)],  # 3 ms
        "c": [reply(2.064, 60.0, 1.0)],  # 4 ms
        "d": [reply(3.062, 60.0, 1.0)],  # 2 ms
        "e": [reply(3.123, 60.0, 61.0)],  # 62 ms beyond: it waited for d's batch
    }
    driver = SimpleNamespace(sent=sent, replies=replies, held_at_end=0, t0=0.0)
    result = analyse("adaptive", driver, [], [], [Phase("idle", 10.0, 1.0, 1.0)], [])  # type: ignore[arg-type]
    idle = result["phases"]["idle"]
    assert idle["alone_b1"] == 4
    assert idle["beyond_inference_alone_ms_b1_p50"] == pytest.approx(2.0, abs=0.01)  # a, b, c, d: 2, 3, 4, 2
    assert idle["beyond_inference_ms_b1_p50"] == pytest.approx(3.0, abs=0.01)  # all five: 2, 2, 3, 4, 62
    assert result["lost"] == 0 and result["duplicated"] == 0


def test_each_phase_of_the_trace_starts_at_its_boundary(monkeypatch: pytest.MonkeyPatch, redis_url: str,
                                                         prefix: str) -> None:
    """The driver used to sleep until the first arrival past a phase's end before starting the next, so
    each phase began late by that overshoot (at 2/s, 0.5 s on average) and the report's boundaries
    drifted from the load's."""
    monkeypatch.setenv("PACKRAT_LOG_LEVEL", os.environ.get("PACKRAT_LOG_LEVEL", "INFO"))
    bench = importlib.import_module("benchmarks.bench_adaptive")
    for seed in range(3):
        driver = bench.Driver(redis_url, prefix, "m", [(b"{}", "application/json")], seed=seed)
        driver.drain_max_s = 0.0  # no service here: nothing is answered
        driver.run([bench.Phase("quiet", 0.6, 2.0, 2.0), bench.Phase("busy", 0.4, 300.0, 300.0),
                    bench.Phase("quiet again", 0.5, 0.05, 0.05)])
        quiet = [at - driver.t0 for at, phase in driver.sent.values() if phase == "quiet"]
        busy = [at - driver.t0 for at, phase in driver.sent.values() if phase == "busy"]
        assert all(at < 0.6 for at in quiet)
        assert busy and 0.6 <= min(busy) < 0.65 and max(busy) < 1.05, (min(busy), max(busy))
        assert 1.45 <= driver.elapsed_s < 1.8  # the trace lasts its phases, a quiet end included


def test_cpu_meter_counts_the_cores_each_role_used_over_the_trace() -> None:
    """A parent that sleeps and a child that spins for the trace: about 0 cores to ``up``, 1 to its instances."""
    import subprocess
    import sys
    import time

    from benchmarks.bench_adaptive import CpuMeter

    spin = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 30: pass"
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {spin!r}]); time.sleep(30)"])
    try:
        time.sleep(0.5)  # the child started and spinning before the trace
        meter = CpuMeter(parent.pid)
        meter.start()
        time.sleep(1.5)
        cores = meter.stop()
    finally:
        for child in __import__("psutil").Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
    assert cores["up"] < 0.2
    assert 0.5 < cores["instances"] <= 1.1  # one spinning process: one core, less what the shared host takes
    assert "client" in cores
