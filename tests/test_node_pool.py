"""Registered models: ``packrat-mq node`` serves what ``models register`` gives its node, end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis

from packrat_mq import control
from packrat_mq.client import Client
from packrat_mq.topology import Topology
from tests.helpers import interrupt, wait_for

pytestmark = [pytest.mark.timeout(240)]


def cli(redis_url: str, prefix: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "packrat_mq", *args, "--redis-url", redis_url, "--prefix", prefix],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PACKRAT_LOG_LEVEL="WARNING"))


def start_node(redis_url: str, prefix: str, r: redis.Redis) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "packrat_mq", "node", "--node", "tn1", "--redis-url", redis_url,
                             "--prefix", prefix], env=dict(os.environ, PACKRAT_LOG_LEVEL="WARNING"),
                            stdout=subprocess.DEVNULL)
    wait_for(lambda: r.hget(f"{prefix}:node:tn1", "state") == b"ready", 60, "the node pool to be ready")
    return proc


@pytest.fixture
def node(redis_url: str, prefix: str, r: redis.Redis) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [start_node(redis_url, prefix, r)]
    try:
        yield procs
    finally:
        for p in procs:
            interrupt(p)


def test_register_serve_reconfigure_unregister(node: list[subprocess.Popen[bytes]], redis_url: str, prefix: str,
                                               r: redis.Redis) -> None:
    res = cli(redis_url, prefix, "models", "register", "sleepy", "--handler", "sleep", "-o", "base_ms=3",
              "--threads", "1", "--json")
    assert res.returncode == 0, res.stderr
    done = json.loads(res.stdout)
    assert done["node"] == "tn1" and done["adaptive"] is True and done["batch"] == 1

    client = Client(redis_url, prefix=prefix)
    replies = client.submit_many("sleepy", [{}] * 5)
    assert all(rep.ok for rep in replies) and replies[0].value()["slept_ms"] == 3.0

    rows = {row["model"]: row for row in json.loads(cli(redis_url, prefix, "models", "--json").stdout)}
    assert rows["sleepy"]["registered"]["node"] == "tn1" and rows["sleepy"]["nodes"][0]["state"] == "ready"

    res = cli(redis_url, prefix, "reconfigure", "sleepy", "--batch", "4", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["to_batch"] == 4

    # A registered model survives its node pool's restart.
    interrupt(node[0])
    node[0] = start_node(redis_url, prefix, r)
    wait_for(lambda: r.hget(f"{prefix}:dispatcher:sleepy", "state") == b"ready", 60, "sleepy served again")
    assert client.submit("sleepy", {}).ok

    res = cli(redis_url, prefix, "models", "unregister", "sleepy", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["stopped"] is True
    assert not r.hexists(f"{prefix}:registry:models", "sleepy")
    assert not r.exists(f"{prefix}:config:sleepy")
    client.close()


def test_bad_registrations_are_refused_and_change_nothing(node: list[subprocess.Popen[bytes]], redis_url: str,
                                                          prefix: str, r: redis.Redis) -> None:
    res = cli(redis_url, prefix, "models", "register", "x", "--handler", "no.such.module:Nope", "--node", "tn1")
    assert res.returncode != 0 and "cannot import handler module" in res.stderr and "Traceback" not in res.stderr
    res = cli(redis_url, prefix, "models", "unregister", "never")
    assert res.returncode == 1 and "not registered" in res.stderr

    # Over the wire, as any client would: each gets an error reply.
    reply_to = f"{prefix}:replies:ctl"

    def ask(**fields: str) -> dict[bytes, bytes]:
        mid = control.new_id()
        r.xadd(f"{prefix}:control", {"id": mid, "reply_to": reply_to, **fields})
        got = control.wait_reply(r, reply_to, mid, 60)
        assert got is not None, fields
        return got

    cores = Topology.detect().physical_cores
    for fields in (
        {"command": "register", "model": "x", "handler": "no.such:Nope", "node": "tn1"},
        {"command": "register", "model": "x", "handler": "sleep", "node": "tn1", "options": "[1]"},
        {"command": "register", "model": "x", "handler": "sleep", "node": "tn1", "instances": f"{cores + 1}x1"},
        {"command": "register", "model": "x", "handler": "sleep"},  # no node
    ):
        reply = ask(**fields)
        assert reply[b"status"] == b"error" and reply[b"error"], fields
    assert r.hlen(f"{prefix}:registry:models") == 0
    assert not r.exists(f"{prefix}:config:x")


@pytest.mark.skipif(Topology.detect().physical_cores < 2, reason="needs two physical cores")
def test_two_models_on_one_node_get_disjoint_cores(node: list[subprocess.Popen[bytes]], redis_url: str,
                                                   prefix: str, r: redis.Redis) -> None:
    for name in ("one", "two"):
        res = cli(redis_url, prefix, "models", "register", name, "--handler", "echo", "--instances", "1x1")
        assert res.returncode == 0, res.stderr
    cpus = []
    for name in ("one", "two"):
        (inst,) = json.loads(r.get(f"{prefix}:config:{name}"))["instances"]
        cpus.append(set(inst["cpus"]))
    assert not cpus[0] & cpus[1]
    res = cli(redis_url, prefix, "models", "register", "three", "--handler", "echo", "--instances", "1x1")
    if Topology.detect().physical_cores == 2:
        assert res.returncode == 1 and "core" in res.stderr
    client = Client(redis_url, prefix=prefix)
    assert client.submit("one", {"a": 1}).value() == {"a": 1}
    assert client.submit("two", {"b": 2}).value() == {"b": 2}
    client.close()


@pytest.mark.skipif(Topology.detect().physical_cores < 2, reason="needs two physical cores")
def test_a_models_spares_hold_no_cores(node: list[subprocess.Popen[bytes]], redis_url: str,
                                       prefix: str, r: redis.Redis) -> None:
    """An adaptive model pre-starts a spare (pinned to every core it may use, idle): a second model still fits."""
    res = cli(redis_url, prefix, "models", "register", "one", "--handler", "echo", "--threads", "1")
    assert res.returncode == 0, res.stderr

    def spare_loaded() -> bool:
        ids = [i.decode() for i in r.smembers(f"{prefix}:index:instances:one")]
        return any(r.hget(f"{prefix}:instance:one:{i}", "state") == b"spare" for i in ids)

    wait_for(spare_loaded, 60, "model one's spare")
    res = cli(redis_url, prefix, "models", "register", "two", "--handler", "echo", "--instances", "1x1")
    assert res.returncode == 0, res.stderr
    (one,) = json.loads(r.get(f"{prefix}:config:one"))["instances"]
    (two,) = json.loads(r.get(f"{prefix}:config:two"))["instances"]
    assert not set(one["cpus"]) & set(two["cpus"])
