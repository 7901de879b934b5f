"""`packrat-mq status`: the document, its text view, and the live view's rates."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import redis
from click.testing import CliRunner

from packrat_mq.cli import main
from packrat_mq.cli.status import add_rates, collect_status, render
from packrat_mq.deployment import Deployment, InstanceRecord
from packrat_mq.settings import Settings


def _serve(r: redis.Redis, settings: Settings) -> None:
    keys = settings.keys
    dep = Deployment(model="m1", handler="echo", instances=[InstanceRecord(id="n-g1-0", threads=2, batch=4, cpus=[0, 1])])
    r.set(keys.config("m1"), dep.model_dump_json())
    r.sadd(keys.models(), "m1")
    r.sadd(keys.instances("m1"), "n-g1-0")
    r.hset(keys.instance("m1", "n-g1-0"), mapping={"pid": 123, "state": "ready", "threads": 2, "batch": 4,
                                                    "cpus": "0,1", "heartbeat": time.time(), "batches": 7})
    r.xadd(keys.requests("m1"), {"id": "x"})
    r.hset(keys.stats("m1"), mapping={"requests": 10, "replies": 8})


def test_document_and_text_view(r: redis.Redis, settings: Settings) -> None:
    _serve(r, settings)
    doc = collect_status(r, settings.keys)
    (m,) = doc["models"]
    assert m["configuration"] == "2x4" and m["batch"] == 4 and m["backlog"] == 1
    (inst,) = m["instances"]
    assert inst["pid"] == 123 and inst["cpus"] == "0,1" and inst["batches"] == 7 and inst["queue"] == 0
    doc["redis_url"] = "redis://x"
    text = render(doc, "packrat")
    assert "m1: 2x4 (B=4" in text and "n-g1-0" in text and "backlog 1" in text


def test_rates_between_frames(r: redis.Redis, settings: Settings) -> None:
    _serve(r, settings)
    first = collect_status(r, settings.keys)
    add_rates(first, None, 0.0)
    assert first["models"][0]["rates"] is None
    r.hincrby(settings.keys.stats("m1"), "requests", 20)
    r.hincrby(settings.keys.stats("m1"), "replies", 10)
    second = collect_status(r, settings.keys)
    add_rates(second, first, 2.0)
    assert second["models"][0]["rates"] == {"requests_per_s": 10.0, "replies_per_s": 5.0, "errors_per_s": 0.0}


def test_json_once(r: redis.Redis, settings: Settings, redis_url: str) -> None:
    _serve(r, settings)
    res = CliRunner().invoke(main, ["status", "--json", "--redis-url", redis_url, "--prefix", settings.prefix])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["models"][0]["model"] == "m1"


def test_watch_streams_json_lines_until_ctrl_c(r: redis.Redis, settings: Settings, redis_url: str) -> None:
    _serve(r, settings)
    proc = subprocess.Popen([sys.executable, "-m", "packrat_mq", "status", "--json", "--watch", "0.2",
                             "--redis-url", redis_url, "--prefix", settings.prefix], stdout=subprocess.PIPE, text=True)
    try:
        lines = [json.loads(proc.stdout.readline()) for _ in range(2)]  # type: ignore[union-attr]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    assert lines[0]["models"][0]["rates"] is None
    assert lines[1]["models"][0]["rates"]["requests_per_s"] == 0.0


def test_the_prediction_at_the_speed_served_now(r: redis.Redis, settings: Settings) -> None:
    keys = settings.keys
    dep = Deployment(model="m1", handler="echo", predicted_latency_ms=40.0,
                     instances=[InstanceRecord(id="n-g1-0", threads=2, batch=4, cpus=[0, 1])])
    r.set(keys.config("m1"), dep.model_dump_json())
    r.sadd(keys.models(), "m1")
    doc = collect_status(r, keys)
    assert doc["models"][0]["predicted_now_ms"] is None  # nothing served yet: no ratio
    doc["redis_url"] = "redis://x"
    assert "40.00 ms from the profile (served speed not measured yet)" in render(doc, "packrat")
    for node, ratio in (("a", "1.5"), ("b", "1.25"), ("c", "1.3")):
        r.sadd(keys.supervisors("m1"), node)
        r.hset(keys.supervisor("m1", node), mapping={"pid": 1, "heartbeat": time.time(), "profile_ratio": ratio})
    doc = collect_status(r, keys)
    (m,) = doc["models"]
    assert m["predicted_now_ms"] == 52.0  # the median node's ratio, 1.3
    r.hset(keys.supervisor("m1", "a"), "profile_ratios", "1=0.72,2=0.86")
    (m,) = collect_status(r, keys)["models"]
    by_node = {sup["node"]: sup["profile_ratios"] for sup in m["supervisors"]}
    assert by_node == {"a": {"1": 0.72, "2": 0.86}, "b": {}, "c": {}}
    doc["redis_url"] = "redis://x"
    assert "40.00 ms from the profile, 52.00 ms at the speed served now" in render(doc, "packrat")
