"""Configuration strings and the Redis key builder."""
from __future__ import annotations

import inspect

import pytest
import redis
from pydantic import ValidationError
from redis.crc import key_slot

from packrat_mq.instances import Configuration, ConfigurationError, InstanceSpec
from packrat_mq.keys import Keys
from packrat_mq.settings import Settings


def shape(c: Configuration) -> list[tuple[int, int]]:
    return [(i.threads, i.batch) for i in c.instances]


# --- Configuration.parse ----------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("4x8", [(4, 8)]),
        ("4x8,2x4", [(4, 8), (2, 4)]),
        ("2*2x4", [(2, 4), (2, 4)]),
        ("3x2x4", [(2, 4), (2, 4), (2, 4)]),
        ("4x8,2*2x4", [(4, 8), (2, 4), (2, 4)]),
        (" 4x8 , 2 * 2x4 ", [(4, 8), (2, 4), (2, 4)]),
        ("4 x 8", [(4, 8)]),
        ("1x1,", [(1, 1)]),
        ("1*16x32", [(16, 32)]),
    ],
)
def test_parse_forms(text: str, expected: list[tuple[int, int]]) -> None:
    assert shape(Configuration.parse(text)) == expected


def test_parse_round_trips_through_str() -> None:
    c = Configuration.parse("4x8,2*2x4")
    assert str(c) == "4x8,2x4,2x4"
    assert Configuration.parse(str(c)) == c


@pytest.mark.parametrize("text", ["", " ", ",", ", ,"])
def test_parse_empty(text: str) -> None:
    with pytest.raises(ConfigurationError, match="no instances"):
        Configuration.parse(text)


@pytest.mark.parametrize("text", ["4", "4x", "x8", "4y8", "4x8x", "a*2x4", "4x-1", "2x4;1x1", "4.0x8", "2**2x4"])
def test_parse_malformed_says_what_is_expected(text: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        Configuration.parse(text)
    message = str(info.value)
    assert "expected THREADSxBATCH" in message
    assert "e.g. 4x8" in message


@pytest.mark.parametrize("text", ["0x4", "4x0", "0*2x4", "0x2x4"])
def test_parse_zero_values(text: str) -> None:
    with pytest.raises(ConfigurationError, match=">= 1"):
        Configuration.parse(text)


def test_parse_error_names_the_bad_instance() -> None:
    with pytest.raises(ConfigurationError, match="'2y4'"):
        Configuration.parse("4x8,2y4")


def test_bad_configuration_is_a_usage_error_before_anything_starts(r: redis.Redis, settings: Settings) -> None:
    from click.testing import CliRunner

    from packrat_mq.cli import main

    res = CliRunner().invoke(main, ["up", "--model", "echo", "--instances", "4x8,2y4",
                                    "--redis-url", settings.redis_url, "--prefix", settings.prefix])
    assert res.exit_code == 2, res.output
    assert "--instances" in res.output and "'2y4'" in res.output and "expected THREADSxBATCH" in res.output
    assert list(r.scan_iter(f"{settings.prefix}:*")) == [], "nothing was started"


def test_sums() -> None:
    c = Configuration.parse("4x8,2*2x4")
    assert c.batch == 16
    assert c.threads == 8
    assert Configuration.uniform(3, 2, 5).batch == 15
    assert Configuration.uniform(3, 2, 5).threads == 6


def test_grouped_largest_first() -> None:
    c = Configuration.parse("2x4,4x8,2x4,2x2,4x8,1x1")
    assert c.grouped() == [
        {"threads": 4, "batch": 8, "count": 2},
        {"threads": 2, "batch": 4, "count": 2},
        {"threads": 2, "batch": 2, "count": 1},
        {"threads": 1, "batch": 1, "count": 1},
    ]
    assert sum(g["count"] for g in c.grouped()) == len(c.instances)


def test_invalid_specs_rejected() -> None:
    with pytest.raises(ValidationError):
        InstanceSpec(threads=0, batch=1)
    with pytest.raises(ValidationError):
        InstanceSpec(threads=1, batch=0)
    with pytest.raises(ValueError, match="at least one instance"):
        Configuration(instances=())


def test_configuration_is_immutable_and_hashable() -> None:
    c = Configuration.parse("2x4")
    with pytest.raises(ValidationError):
        c.instances = ()  # type: ignore[misc]
    assert hash(c) == hash(Configuration.parse("2x4"))


# --- Keys -------------------------------------------------------------------
def all_keys(k: Keys) -> dict[str, str]:
    """Every key builder of ``Keys``, called with plausible names."""
    args = {"model": "resnet50", "instance_id": "i3", "client_id": "c0ffee", "node": "node-a", "name": "sweep"}
    out = {}
    for name, fn in inspect.getmembers(k, predicate=inspect.ismethod):
        if name.startswith("_") or name == "model_of":  # model_of reads a key, it builds none
            continue
        params = inspect.signature(fn).parameters
        out[name] = fn(*(args[p] for p in params))
    return out


@pytest.mark.parametrize("cluster", [False, True])
@pytest.mark.parametrize("prefix", ["packrat", "tenant-a", "x.y_z"])
def test_keys_have_no_empty_segments_and_use_prefix(prefix: str, cluster: bool) -> None:
    keys = all_keys(Keys(prefix, cluster=cluster))
    assert len(keys) >= 11  # every builder was found and called
    for name, key in keys.items():
        assert "::" not in key, (name, key)
        assert not key.endswith(":") and not key.startswith(":"), (name, key)
        segments = key.split(":")
        assert all(segments), (name, key)
        assert segments[0] == prefix, (name, key)
        # <prefix>:<kind>:<name>; the control stream is one per deployment, named as issue 9 does.
        assert len(segments) >= 3 or name == "control", (name, key)


def test_keys_are_distinct() -> None:
    keys = all_keys(Keys())
    assert len(set(keys.values())) == len(keys)


def test_key_layout() -> None:
    k = Keys("p")
    assert k.requests("m") == "p:requests:m"
    assert k.queue("m", "i0") == "p:queue:m:i0"
    assert k.wakeup("m") == "p:wakeup:m"
    assert k.replies("c") == "p:replies:c"
    assert k.config("m") == "p:config:m"
    assert k.instance("m", "i0") == "p:instance:m:i0"
    assert k.stats("m") == "p:stats:m"
    assert k.lock("x") == "p:lock:x"
    assert k.models() == "p:index:models"
    assert k.instances("m") == "p:index:instances:m"


def test_settings_keys_follow_prefix() -> None:
    assert Settings(prefix="tenant-b").keys.requests("m") == "tenant-b:requests:m"
    assert Keys().prefix == "packrat"
    with pytest.raises(ValidationError):
        Settings(prefix="a:b")  # a colon would make keys ambiguous


def test_cluster_key_layout() -> None:
    """On Redis Cluster the model segment is a hash tag; keys of no one model stay as they are."""
    k = Keys("p", cluster=True)
    assert k.requests("m") == "p:requests:{m}"
    assert k.queue("m", "i0") == "p:queue:{m}:i0"
    assert k.fence("m", "i0") == "p:fence:{m}:i0"
    assert k.instances("m") == "p:index:instances:{m}"
    assert k.supervisor("m", "n1") == "p:supervisor:{m}:n1"
    assert k.replies("c") == "p:replies:c"
    assert k.models() == "p:index:models"
    assert k.control() == "p:control"
    assert k.registry() == "p:registry:models"
    assert k.request_streams() == "p:requests:*" == Keys("p").request_streams()


# Every builder that takes a model: one model's keys are the transactions' keys.
MODEL_KEYS = [name for name, fn in inspect.getmembers(Keys(), predicate=inspect.ismethod)
              if not name.startswith("_") and "model" in inspect.signature(fn).parameters and name != "model_of"]


def test_a_models_keys_hash_to_one_slot_in_a_cluster_and_models_spread() -> None:
    assert {"requests", "queue", "fence", "wakeup", "stats", "instance", "dispatcher", "deployment",
            "config", "instances"} <= set(MODEL_KEYS)
    k = Keys("packrat", cluster=True)
    for model in ("echo", "sleep", "resnet50"):
        keys = {name: getattr(k, name)(*(model if p == "model" else "x1"
                                         for p in inspect.signature(getattr(k, name)).parameters))
                for name in MODEL_KEYS}
        assert {key_slot(key.encode()) for key in keys.values()} == {key_slot(model.encode())}, keys
    assert key_slot(k.requests("echo").encode()) != key_slot(k.requests("sleep").encode())
    # On one Redis nothing is tagged: the wire format producers use stays as it was.
    assert all("{" not in key for key in all_keys(Keys("packrat")).values())


@pytest.mark.parametrize("cluster", [False, True])
def test_model_of_reads_a_request_stream_name_back(cluster: bool) -> None:
    k = Keys("p", cluster=cluster)
    assert k.model_of(k.requests("echo").encode()) == ("echo", True)
    other = Keys("p", cluster=not cluster).requests("echo").encode()
    assert k.model_of(other) == ("echo", False)  # the other mode's name: no model of this one reads it
    # Any bytes: an untagged name that is not a model's stream on a cluster, an unknown model elsewhere.
    assert k.model_of(b"p:requests:bad\xffname") == ("bad\ufffdname", not cluster)


def test_settings_say_cluster_from_the_url() -> None:
    assert Settings(redis_url="redis+cluster://127.0.0.1:7000,127.0.0.1:7001").keys.cluster
    assert Settings(redis_url="rediss+cluster://h:7000").cluster
    assert not Settings(redis_url="redis://127.0.0.1:6379/0").keys.cluster
    assert not Settings().cluster  # the embedded server is one Redis
