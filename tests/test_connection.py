"""Connecting: the embedded server, discovery, and URLs with ACL users and passwords."""
from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import redis
from click.testing import CliRunner
from redis.connection import Encoder, PythonRespSerializer

from packrat_mq.cli import main
from packrat_mq.connection import (
    LARGE_ARGUMENT_BYTES,
    EmbeddedRedis,
    NoRedisError,
    Packer,
    connect,
    discover_url,
    discovery_file,
    resolve_url,
)
from packrat_mq.settings import Settings


def test_embedded_server_is_announced_and_withdrawn() -> None:
    assert discover_url() is None
    with EmbeddedRedis() as server:
        assert server.url.startswith("unix://")
        assert connect(server.url).ping()
        assert discover_url() == server.url
        assert resolve_url(Settings()) == server.url
        assert connect(server.url).config_get("save")["save"] == ""
    assert discover_url() is None
    assert not discovery_file().exists()


def test_no_url_and_no_server_is_a_clear_error() -> None:
    with pytest.raises(NoRedisError, match="--redis-url"):
        resolve_url(Settings())
    res = CliRunner().invoke(main, ["status"])
    assert res.exit_code == 1 and "packrat-mq up" in res.output


def test_stale_discovery_file_is_ignored(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = discovery_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"url": f"unix://{tmp_path}/gone.sock"}))
    assert discover_url() is None


@pytest.fixture
def acl_user(r: redis.Redis, prefix: str) -> Iterator[tuple[str, str]]:
    user = f"{prefix}-app"  # its own user: the server may be shared
    r.acl_setuser(user, enabled=True, passwords=["+s3cret"], keys=["*"], channels=["*"], commands=["+@all"])
    yield user, "s3cret"
    r.acl_deluser(user)


def _with_user(url: str, user: str, password: str) -> str:
    path = url[len("unix://"):]
    return f"unix://{user}@{path}?password={password}"


def test_acl_user_and_password_in_url(redis_url: str, prefix: str, acl_user: tuple[str, str]) -> None:
    if not redis_url.startswith("unix://"):
        pytest.skip("URL rewriting below is for the embedded server's socket")
    user, password = acl_user
    good = _with_user(redis_url, user, password)
    assert connect(good).acl_whoami() == user
    res = CliRunner().invoke(main, ["status", "--json", "--redis-url", good, "--prefix", prefix])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["models"] == []
    bad = CliRunner().invoke(main, ["status", "--redis-url", _with_user(redis_url, user, "wrong")])
    assert bad.exit_code == 1 and "password=***" in bad.output, bad.output  # names the server, redacted
    assert "wrong" not in bad.output, "the password must not be printed"


# --- packing commands -----------------------------------------------------------------------------
def _wire(chunks: list) -> bytes:  # type: ignore[type-arg]
    return b"".join(bytes(c) for c in chunks)


def _reference(*args: object) -> bytes:
    """The RESP redis-py's own Python packer writes (no cutoff games: every piece joined)."""
    return _wire(PythonRespSerializer(10**9, Encoder("utf-8", "strict", False).encode).pack(*args))


def test_packer_writes_the_same_bytes_and_passes_a_large_value_through_uncopied() -> None:
    packer = Packer(Encoder("utf-8", "strict", False))
    small = ("XADD", "s", "*", "id", "r1", "reply_to", "my:replies", "payload", b'{"a": 1}', "n", 3, 1.5)
    assert _wire(packer.pack(*small)) == _reference(*small)
    image = bytes(range(256)) * (LARGE_ARGUMENT_BYTES // 256 + 4)
    large = ("XADD", "s", "*", "id", "r1", "payload", image, "content_type", "application/x-npy")
    chunks = packer.pack(*large)
    assert _wire(chunks) == _reference(*large)
    # Handed to sendall as it is: the 0.7 ms per 602 KB that hiredis's packer spent copying it.
    assert any(chunk is image for chunk in chunks)


def test_large_values_of_every_bytes_type_round_trip_through_redis(r: redis.Redis, prefix: str) -> None:
    stream = f"{prefix}:payloads"
    value = bytes(range(256)) * 4096  # 1 MiB
    for given in (value, bytearray(value), memoryview(value), value.decode("latin-1")):
        pipe = r.pipeline(transaction=False)
        pipe.xadd(stream, {"payload": given, "small": "x"})
        pipe.xadd(stream, {"payload": b"tiny"})
        pipe.execute()
    entries = r.xrange(stream)
    got = [fields[b"payload"] for _, fields in entries]
    assert got[0::2][:3] == [value] * 3
    assert got[6] == value.decode("latin-1").encode()
    assert got[1::2] == [b"tiny"] * 4
