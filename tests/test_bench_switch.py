"""bench_switch end to end on the sleep model (real `up`, real switches), and its windows."""
from __future__ import annotations

import importlib
import os

import pytest


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    # The benchmark quiets the processes it starts by setting PACKRAT_LOG_LEVEL when imported: kept to
    # this test, or every later test's `up` would log at WARNING (their checks read its INFO lines).
    monkeypatch.setenv("PACKRAT_LOG_LEVEL", os.environ.get("PACKRAT_LOG_LEVEL", "INFO"))
    return importlib.import_module("benchmarks.bench_switch")


def test_a_window_counts_the_replies_received_in_it(bench) -> None:  # type: ignore[no-untyped-def]
    done = [(0.0, 0.5, "a", True), (0.2, 1.2, "a", True), (1.0, 1.5, "b", True), (1.1, 1.6, "b", False),
            (2.0, 3.5, "b", True)]
    w = bench.window(done, 1.0, 2.0)
    assert w["n"] == 2 and w["replies_per_s"] == 2.0  # the failed one is not counted
    assert w["p50_ms"] == pytest.approx(500.0)  # nearest rank, as bench_adaptive reads its percentiles


def test_switches_back_and_forth_are_measured_and_lose_nothing(bench, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    assert bench.main(["--model", "sleep", "--graph", "eager", "--a", "2x4", "--b", "2*1x2", "--clients", "4",
                       "--warmup", "1", "--switches", "2", "--every", "2", "--window", "1",
                       "--setups", "handover", "--name", "s"]) == 0
    import json

    result = json.loads((tmp_path / "s.json").read_text())
    (run,) = result["runs"]
    assert run["sent"] > 0 and run["unanswered"] == 0 and run["duplicated"] == 0 and run["errors"] == 0
    assert [s["to"] for s in run["switches"]] == ["2*1x2", "2x4"]
    for s in run["switches"]:
        assert s["kind"] == "active-passive" and s["handover"] is True
        # None when the old instances drained before a new one had its first sub-batch (a fast model).
        assert s["held_s"] is None or 0 <= s["held_s"] <= 10
        assert s["after"]["n"] > 0
    assert result["summary"]["handover"]["switches"] == 2
