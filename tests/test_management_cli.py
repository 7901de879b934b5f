"""The management interface end to end: a real ``up``, and ``reconfigure``, ``models``, ``status`` as users run them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import click
import pytest
import redis
from click.testing import CliRunner

from packrat_mq.cli.serve import ServePlan, serving_options
from tests.helpers import interrupt, wait_for

pytestmark = [pytest.mark.timeout(180)]


def cli(redis_url: str, prefix: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "packrat_mq", *args, "--redis-url", redis_url, "--prefix", prefix],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PACKRAT_LOG_LEVEL="WARNING"))


@pytest.fixture
def up(redis_url: str, r: redis.Redis, prefix: str) -> Iterator[subprocess.Popen[bytes]]:
    """``up --model echo`` with no --batch: adaptive from B=1."""
    cmd = [sys.executable, "-m", "packrat_mq", "up", "--model", "echo", "--threads", "1",
           "--redis-url", redis_url, "--prefix", prefix, "--exit-with-parent"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PACKRAT_LOG_LEVEL="WARNING"), stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: r.hget(f"{prefix}:dispatcher:echo", "state") == b"ready"
                 and r.hget(f"{prefix}:supervisor:echo:" + os.uname().nodename.split(".")[0], "state") == b"ready",
                 60, "up to be ready")
        yield proc
    finally:
        interrupt(proc)


def test_reconfigure_models_and_status(up: subprocess.Popen[bytes], redis_url: str, prefix: str) -> None:
    res = cli(redis_url, prefix, "models", "--json")
    assert res.returncode == 0, res.stderr
    (row,) = json.loads(res.stdout)
    assert row["model"] == "echo" and row["adaptive"] is True and row["batch"] == 1

    res = cli(redis_url, prefix, "reconfigure", "echo", "--batch", "4", "--reason", "test", "--json")
    assert res.returncode == 0, res.stderr
    done = json.loads(res.stdout)
    assert done["kind"] == "reshare" and done["to_batch"] == 4 and done["adaptive"] is False
    assert done["total_s"] < 5

    res = cli(redis_url, prefix, "reconfigure", "echo", "--batch", "4")
    assert res.returncode == 0 and "nothing to do" in res.stdout

    res = cli(redis_url, prefix, "status", "--json")
    (model,) = json.loads(res.stdout)["models"]
    assert model["batch"] == 4 and model["adaptive"] is False and model["generation"] == 2
    assert model["reconfigurations"][0]["reason"] == "test" and model["reconfiguring"] is None
    assert model["estimate"]["q_tilde"] is not None
    text = cli(redis_url, prefix, "status").stdout
    assert "pinned, B=4" in text and "last reconfigurations" in text and "1x1 -> 1x4" in text

    res = cli(redis_url, prefix, "reconfigure", "echo", "--batch", "1", "--adaptive")
    assert res.returncode == 0, res.stderr
    assert json.loads(cli(redis_url, prefix, "models", "--json").stdout)[0]["adaptive"] is True


@pytest.mark.parametrize("args, message", [
    (["reconfigure", "echo"], "exactly one of --batch and --instances"),
    (["reconfigure", "echo", "--batch", "2", "--instances", "1x2"], "exactly one of --batch and --instances"),
    (["reconfigure", "echo", "--instances", "1y2"], "cannot read instance"),
    (["reconfigure", "bad name", "--batch", "2"], "model name"),
    (["reconfigure", "nosuch", "--batch", "2"], "no live supervisor serves 'nosuch'"),
])
def test_reconfigure_refuses_bad_requests_with_one_line(redis_url: str, prefix: str, r: redis.Redis,
                                                        args: list[str], message: str) -> None:
    res = cli(redis_url, prefix, *args)
    assert res.returncode != 0
    assert message in res.stderr
    assert "Traceback" not in res.stderr


def test_a_configuration_that_does_not_fit_is_refused_and_nothing_changes(up: subprocess.Popen[bytes],
                                                                          redis_url: str, prefix: str) -> None:
    res = cli(redis_url, prefix, "reconfigure", "echo", "--instances", "512x1")
    assert res.returncode == 1
    assert "needs 512 physical cores" in res.stderr and "Traceback" not in res.stderr
    (row,) = json.loads(cli(redis_url, prefix, "models", "--json").stdout)
    assert row["generation"] == 1 and row["configuration"] == "1x1"


@click.command()
@serving_options
def _plan_only(plan: ServePlan) -> None:
    click.echo(json.dumps({"adaptive": plan.adaptive, "batch": plan.configuration.batch}))


@pytest.mark.parametrize("args, adaptive, batch", [
    ([], True, 1),
    (["--batch", "8"], False, 8),
    (["--batch", "8", "--adaptive"], True, 8),
    (["--instances", "1x2"], False, 2),
    (["--instances", "1x2", "--adaptive"], True, 2),
])
def test_up_is_adaptive_unless_b_is_given(args: list[str], adaptive: bool, batch: int) -> None:
    res = CliRunner().invoke(_plan_only, ["--model", "echo", "--threads", "1", *args])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == {"adaptive": adaptive, "batch": batch}


def test_a_change_line_says_what_the_switch_shared_and_how_long_the_handover_held() -> None:
    from packrat_mq.cli.reconfigure import describe_change

    entry = {"from": "2x16", "to": "2*1x8", "from_batch": 16, "to_batch": 16, "kind": "active-passive",
             "generation": 3, "reason": "operator", "decision_to_ready_s": 0.01, "ready_to_switch_s": 0.05,
             "switch_to_drained_s": 0.93, "total_s": 1.2, "reused": 2, "oversubscribed_s": 1.2,
             "handover": True, "held_s": 0.45}
    line = describe_change("resnet50", entry)
    assert "drained 0.93 s" in line and "cores shared for 1.20 s" in line
    assert line.endswith("new instances waited 0.45 s for the old ones to drain")
    assert "waited" not in describe_change("resnet50", {**entry, "handover": False})
    # Nothing held: the old instances drained before a new one had its first sub-batch.
    assert describe_change("resnet50", {**entry, "held_s": None}).endswith(
        "the old instances drained before the new ones had work")
