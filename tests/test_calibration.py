"""Calibration serves candidates for real (sleep model) and records what it measured."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from optimizer.calibration import PATH_HANDLER, Measured, calibrate, example_reply, measure_path, time_batches
from optimizer.planning.profile import Profile, ProfileEntry
from optimizer.planning.selection import best_calibrated, candidates, predicted_latency
from packrat_mq import protocol
from packrat_mq.cli import main
from packrat_mq.handler import Context, Input, load_handler, run_batch
from packrat_mq.instances import Configuration
from packrat_mq.settings import Settings


def _profile() -> Profile:
    # One thread is slow per request, two threads barely help: splitting wins on paper.
    points = {(1, 1): 10.0, (1, 2): 18.0, (1, 4): 34.0, (2, 1): 9.0, (2, 2): 15.0, (2, 4): 26.0}
    return Profile(model="sleep", entries=tuple(ProfileEntry(threads=t, batch=b, mean_ms=ms)
                                                for (t, b), ms in points.items()))


def test_candidates_are_distinct_and_ranked_by_prediction() -> None:
    cands = candidates(_profile(), threads=2, batch=4, k=5)
    assert str(cands[0]) in ("1x2,1x2",)
    preds = [c.predicted_latency_ms for c in cands]
    assert preds == sorted(preds)
    keys = [tuple(sorted((i.threads, i.batch) for i in c.instances)) for c in cands]
    assert len(keys) == len(set(keys))
    assert all(c.batch == 4 and c.threads <= 2 for c in cands)
    assert predicted_latency(_profile(), Configuration.parse("2x4")) == 26.0
    assert predicted_latency(_profile(), Configuration.parse("1x8")) is None


def test_calibrate_measures_records_and_is_used_later(redis_url: str, settings: Settings, tmp_path: Path) -> None:
    prof = _profile()
    best, results = calibrate(prof, redis_url, settings, 2, 4, k=2, rounds=3, warmup=1)
    assert len(results) == 2
    for m in results:
        assert m.error is None and len(m.latencies_ms) == 3
        # the sleep handler sleeps 10 ms per batch: a batch cannot be faster
        assert min(m.latencies_ms) >= 10.0
    assert best.batch == 4
    rows = [c for c in prof.calibrations if c.threads == 2 and c.batch == 4]
    assert len(rows) == 2 and all(c.measured_p50_ms and c.predicted_ms for c in rows)
    chosen, row = best_calibrated(prof, 2, 4)  # type: ignore[misc]
    assert str(chosen) == str(best) and row.measured_p50_ms == min(c.measured_p50_ms for c in rows)
    assert best_calibrated(prof, 2, 8) is None
    path = prof.save(tmp_path / "sleep.json")
    assert Profile.load(path).calibrations == prof.calibrations


def test_optimize_calibrate_cli(tmp_path: Path) -> None:
    path = _profile().save(tmp_path / "sleep.json")
    # No --redis-url: the command starts a private server. (With one it would use
    # the fixed prefix "packrat-calibrate", not this test's.)
    res = CliRunner().invoke(main, ["optimize", "-p", str(path), "-t", "2", "-b", "4", "--calibrate",
                                    "--top-k", "2", "--rounds", "2", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert sum(g["batch"] * g["count"] for g in doc["instances"]) == 4
    assert len(Profile.load(path).calibrations) == 2


def test_calibrate_refuses_infeasible() -> None:
    with pytest.raises(ValueError, match="batch 3"):
        calibrate(_profile().model_copy(update={"entries": (ProfileEntry(threads=1, batch=2, mean_ms=1.0),)}),
                  "redis://unused", Settings(), 2, 3)


# --- the serving path ----------------------------------------------------------
def test_path_cost_is_interpolated_and_added_to_predictions(tmp_path: Path) -> None:
    prof = _profile()
    assert prof.path_cost_ms(4) is None and prof.service_latency_ms(26.0, 4) == 26.0
    prof.path_ms = {1: 1.0, 2: 1.5, 8: 4.5}
    assert prof.path_cost_ms(1) == 1.0 and prof.path_cost_ms(4) == 2.5  # between 2 and 8
    assert prof.path_cost_ms(16) == 8.5  # beyond the largest: along the last two
    assert prof.service_latency_ms(26.0, 4) == 28.5 and prof.service_latency_ms(None, 4) is None
    loaded = Profile.load(prof.save(tmp_path / "sleep.json"))
    assert loaded.path_ms == {1: 1.0, 2: 1.5, 8: 4.5}, "batch sizes come back as integers"


def test_measure_path_serves_the_models_own_payloads_with_a_no_op_handler(redis_url: str, settings: Settings) -> None:
    said: list[str] = []
    costs = measure_path(redis_url, settings, "minilm", [1, 4], rounds=3, warmup=1, stand_in=True,
                         progress=said.append)
    assert sorted(costs) == [1, 4]
    # Round trips through Redis, the dispatcher and a worker: positive, and far below
    # MiniLM's own 8 ms per batch (no model ran).
    assert all(0.0 < ms < 200.0 for ms in costs.values()), costs
    assert said[0].startswith("replies as minilm's own")


def test_measure_path_by_default_serves_the_model_itself(redis_url: str, settings: Settings) -> None:
    """The path as it runs after a real batch: latency less the model's own reported handler time."""
    said: list[str] = []
    costs = measure_path(redis_url, settings, "minilm", [1, 2], rounds=3, warmup=1, threads=1, progress=said.append)
    assert sorted(costs) == [1, 2]
    assert said[0] == "served by minilm itself: one instance of 1 threads"
    # What the service adds, not the model's 8-15 ms: its handler time is taken off each batch.
    assert all(0.0 < ms < 100.0 for ms in costs.values()), costs


def test_the_path_is_measured_with_the_models_own_reply() -> None:
    """MiniLM answers with 384 floats, and the stand-in answers every request with them."""
    payload, content_type = example_reply("minilm")
    value = protocol.decode_payload(content_type, payload)
    assert content_type == protocol.JSON and len(value) == 384 and all(isinstance(x, float) for x in value)
    stand_in = load_handler(PATH_HANDLER)
    stand_in.initialize(Context(model_name="minilm", instance_id="t", options={
        "base_ms": 0, "reply": base64.b64encode(payload).decode(), "reply_content_type": content_type}))
    result = run_batch(stand_in, [Input(id=str(i), data="any text", content_type=protocol.TEXT) for i in range(3)])
    assert [o.value for o in result.outcomes] == [value] * 3


def test_a_model_that_cannot_answer_is_measured_with_the_stand_ins_reply(redis_url: str, settings: Settings) -> None:
    said: list[str] = []
    costs = measure_path(redis_url, settings, "sleep", [1], rounds=2, warmup=1, options={"base_ms": "not a number"},
                         progress=said.append, stand_in=True)
    assert sorted(costs) == [1]
    assert "could not answer its example request" in said[0] and "stand-in's reply" in said[0]


def test_profile_path_cli_stores_the_cost_in_the_profile(tmp_path: Path) -> None:
    path = _profile().save(tmp_path / "sleep.json")
    res = CliRunner().invoke(main, ["profile", "path", "--model", "sleep", "--profile", str(path),
                                    "--max-batch", "2", "--rounds", "2", "--json"])
    assert res.exit_code == 0, res.output
    stored = Profile.load(path).path_ms
    assert sorted(stored) == [1, 2] and json.loads(res.stdout.strip().splitlines()[-1]) == {
        str(b): ms for b, ms in stored.items()}
    shown = CliRunner().invoke(main, ["profile", "show", str(path)])
    assert "serving path (ms per batch" in shown.output


class _Clocked:
    """A client whose every batch takes ``batch_s`` of a fake clock and ``batch_s`` of inference."""

    def __init__(self, batch_s: float) -> None:
        self.now, self.batch_s, self.sent = 0.0, batch_s, 0

    def clock(self) -> float:
        return self.now

    def time_batch(self, model: str, items: list[bytes], **kw: object) -> tuple[float, list[object]]:
        from packrat_mq.client import Reply
        self.now += self.batch_s
        self.sent += 1
        ms = self.sent * 1.0  # each batch a different latency, to see which were kept
        return ms, [Reply(id="x", status="ok", payload=b"1", content_type="application/json", error="",
                          queue_ms=0.0, inference_ms=self.batch_s * 1000, fields={})]


@pytest.mark.parametrize("batch_s, warmed, timed", [(0.008, 63, 250), (1.5, 2, 10)])
def test_timing_warms_up_and_measures_for_at_least_a_time_whatever_the_rounds(
    batch_s: float, warmed: int, timed: int
) -> None:
    """A 8 ms batch: warm for 0.5 s and time 2 s of batches; a 1.5 s batch: the rounds asked for."""
    client = _Clocked(batch_s)
    m = Measured(configuration=Configuration.parse("1x1"), predicted_ms=None)
    time_batches(client, "m", [(b"1", "application/json")], m, rounds=10, warmup=2,  # type: ignore[arg-type]
                 warmup_s=0.5, measure_s=2.0, clock=client.clock)
    assert len(m.latencies_ms) == timed and client.sent == warmed + timed
    assert m.latencies_ms[0] == warmed + 1  # the first timed batch is the one after the warm-up


def test_no_warmup_when_none_is_asked() -> None:
    client = _Clocked(0.01)
    m = Measured(configuration=Configuration.parse("1x1"), predicted_ms=None)
    time_batches(client, "m", [(b"1", "application/json")], m, rounds=3, warmup=0,  # type: ignore[arg-type]
                 warmup_s=0.0, clock=client.clock)
    assert m.latencies_ms == [1.0, 2.0, 3.0]
