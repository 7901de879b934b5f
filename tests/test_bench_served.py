"""bench_served's reading of replies and layouts (no processes: replies made up)."""
from __future__ import annotations

import importlib
import os

import pytest


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    # Importing the benchmark pulls in bench_adaptive, which quiets the processes it starts through
    # PACKRAT_LOG_LEVEL: kept to this test (later tests read `up`'s INFO lines).
    monkeypatch.setenv("PACKRAT_LOG_LEVEL", os.environ.get("PACKRAT_LOG_LEVEL", "INFO"))
    return importlib.import_module("benchmarks.bench_served")


def _reply(instance: str, ms: float, k: int, status: str = "ok") -> dict[str, str]:
    return {"instance": instance, "inference_ms": f"{ms:.3f}", "batch_size": str(k), "status": status}


def test_a_batch_is_counted_once_however_many_replies_it_answered(bench) -> None:  # type: ignore[no-untyped-def]
    """Two 16-batches on two instances (16 replies each) and three 4-batches: the p50s are of batches,
    so a 16-batch does not outweigh a 4-batch sixteen to four."""
    replies = ([_reply("a", 1600.0, 16)] * 16 + [_reply("b", 2000.0, 16)] * 16
               + [_reply("a", 400.0, 4)] * 4 + [_reply("b", 420.0, 4)] * 4 + [_reply("a", 410.0, 4)] * 4)
    replies.append(_reply("a", 9999.0, 4, status="error"))  # a failed request's time is not the model's
    out = bench.by_batch(replies)
    assert set(out) == {4, 16}
    assert out[16]["batches"] == 2 and out[16]["p50_ms"] == pytest.approx(1800.0)
    assert out[16]["per_request_ms"] == pytest.approx(112.5)
    assert out[4]["batches"] == 3 and out[4]["p50_ms"] == pytest.approx(410.0)


def test_instances_are_pinned_from_core_zero_in_order(bench) -> None:  # type: ignore[no-untyped-def]
    from packrat_mq.instances import Configuration

    assert bench.cores_of(Configuration.parse("2*1x16")) == [[0], [1]]
    assert bench.cores_of(Configuration.parse("2x8,1x8,1x8")) == [[0, 1], [2], [3]]


def test_the_full_batch_is_read_from_served_and_back_to_back_results_alike(bench) -> None:  # type: ignore[no-untyped-def]
    served = {"by_batch": bench.by_batch([_reply("a", 1700.0, 16)] * 16 + [_reply("a", 300.0, 3)] * 3)}
    b2b = {"processes": [{"batch": 16, "median_ms": 1500.0}, {"batch": 16, "median_ms": 1600.0}]}
    assert bench.full_batch_ms(served, 16) == pytest.approx(1700.0)
    assert bench.full_batch_ms(b2b, 16) == pytest.approx(1550.0)
    assert bench.full_batch_ms(served, 8) is None, "no full batch served: no figure, not a zero"
