"""Options every command shares, and small helpers for output."""
from __future__ import annotations

import contextlib
import functools
import json
import re
import socket
import ssl
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click
import redis
from pydantic import ValidationError
from redis.exceptions import RedisClusterException

from packrat_mq import graph as graph_modes
from packrat_mq.connection import (
    EmbeddedRedis,
    NoRedisError,
    RedisURLError,
    connect,
    is_cluster,
    redact,
    resolve_url,
    scrub,
)
from packrat_mq.handler import check_handler
from packrat_mq.settings import Settings


def redis_options(func: Callable[..., Any] | None = None, *, check: bool = False,
                  embedded_ok: bool = False) -> Any:
    """Add ``--redis-url`` and ``--prefix``; the command receives ``settings``.

    With ``check=True`` the Redis is connected to and PINGed before the
    command runs (and before the decorators below this one), so a bad URL or
    no server fails with one line before anything starts; ``embedded_ok``: no
    URL is fine, the command starts its own server. Use as ``@redis_options``
    or ``@redis_options(check=True)``.
    """
    if func is None:
        return functools.partial(redis_options, check=check, embedded_ok=embedded_ok)

    @click.option(
        "--redis-url",
        envvar="PACKRAT_REDIS_URL",
        default=None,
        help="redis://[user:password@]host:port/db, rediss:// (TLS), unix:///path, or "
        "redis+cluster://host:port[,host:port...] (rediss+cluster://) for Redis Cluster. "
        "Default: the embedded server started by `packrat-mq up`.",
    )
    @click.option("--prefix", envvar="PACKRAT_PREFIX", default="packrat", show_default=True,
                  help="Key prefix; deployments sharing one Redis use different prefixes.")
    @functools.wraps(func)
    def wrapper(*args: Any, redis_url: str | None, prefix: str, **kwargs: Any) -> Any:
        overrides = {"prefix": prefix}
        if redis_url:
            overrides["redis_url"] = redis_url
            remember_url(redis_url)
        try:
            settings = Settings(**overrides)
        except ValidationError as exc:
            raise click.ClickException(scrub(settings_error(exc), redis_url)) from None
        except ValueError as exc:
            raise click.ClickException(scrub(str(exc), redis_url)) from None
        if check and (settings.redis_url or not embedded_ok):
            require_redis(resolve_or_fail(settings))
        return func(*args, settings=settings, **kwargs)

    return wrapper


def settings_error(exc: ValidationError) -> str:
    """A bad setting in one line, named as its environment variable: ``PACKRAT_GRAPH_MODE: unknown ...``."""
    parts = []
    for error in exc.errors():
        name = "PACKRAT_" + "_".join(str(p) for p in error["loc"]).upper() if error["loc"] else "settings"
        parts.append(f"{name}: {error['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def graph_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--graph [BACKEND]`` and ``--eager``; the command receives ``graph``: the mode asked for, or None.

    ``--graph`` alone is ``graph`` (the model's default backend,
    :func:`packrat_mq.graph.default_backend`), ``--graph BACKEND`` that
    backend, ``--eager`` ``eager``; neither is None, and the command falls
    back on ``PACKRAT_GRAPH_MODE``. Resolving ``graph`` needs the model, so
    the command does it (:func:`packrat_mq.graph.resolve`).
    """

    @click.option("--graph", "graph", is_flag=False, flag_value="graph", default=None, metavar="[BACKEND]",
                  help=f"Graph mode: alone, the model's default backend (measured fastest); or one of "
                       f"{', '.join(graph_modes.BACKENDS)}. Default: PACKRAT_GRAPH_MODE, else eager.")
    @click.option("--eager", is_flag=True, default=False, help="Serve the model as loaded, no graph (the default).")
    @functools.wraps(func)
    def wrapper(*args: Any, graph: str | None, eager: bool, **kwargs: Any) -> Any:
        if eager and graph is not None:
            raise click.UsageError("--graph and --eager exclude each other: give one")
        try:
            choice = "eager" if eager else (graph_modes.parse(graph) if graph is not None else None)
        except graph_modes.GraphModeError as exc:
            raise click.BadParameter(str(exc), param_hint="--graph") from None
        return func(*args, graph=choice, **kwargs)

    return wrapper


def parse_handler_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``--option KEY=VALUE`` pairs; a VALUE that parses as JSON (numbers, true) is taken as such."""
    out: dict[str, Any] = {}
    for item in pairs:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--option")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def require_handler(spec: str, *, here: bool = True) -> None:
    """``--model`` names a zoo model or an importable ``BaseHandler`` subclass, or one usage line says not.

    Checked before anything starts: a worker that cannot load its handler
    would only say so after Redis and the other workers were up. ``here=False``:
    loaded on another node, so only its form is checked.
    """
    try:
        check_handler(spec, here=here)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from None


def echo_json(value: Any) -> None:
    """Exactly one JSON document on stdout, for scripts."""
    click.echo(json.dumps(value, indent=2, default=str))


def err(message: str) -> None:
    click.echo(message, err=True)


# Where the URL a command uses is kept (click shares ``meta`` with every nested
# context), so the group can name it when a Redis error escapes a command.
URL_KEY = "packrat_mq.redis_url"


def remember_url(url: str) -> None:
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta[URL_KEY] = url


def connect_or_fail(settings: Settings) -> tuple[redis.Redis, str]:
    """A client for the configured Redis (else the embedded server), PINGed; one clear line if not."""
    url = resolve_or_fail(settings)
    require_redis(url)
    return connect(url), url


def resolve_or_fail(settings: Settings) -> str:
    """The configured URL, else a running embedded server's; one clear line if neither."""
    try:
        return resolve_url(settings)
    except NoRedisError as exc:
        raise click.ClickException(str(exc)) from None


def require_redis(url: str, timeout_s: float = 5.0) -> None:
    """Connect to ``url`` and PING it, or raise a one-line ``ClickException`` saying why not.

    A node of a Redis Cluster named by a ``redis://`` URL is refused too: one
    client would see a slot's keys and be sent elsewhere for the rest.
    """
    remember_url(url)
    try:
        probe = connect(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            probe.ping()
            clustered = not is_cluster(probe) and _cluster_enabled(probe)
        finally:
            probe.close()
    except (redis.RedisError, OSError, RedisURLError, RedisClusterException) as exc:
        raise click.ClickException(describe_failure(exc, url)) from None
    if clustered:
        raise click.ClickException(f"Redis at {redact(url)} is a node of a Redis Cluster: give its nodes as "
                                   "redis+cluster://host:port[,host:port...] (rediss+cluster:// with TLS)")


def _cluster_enabled(r: redis.Redis) -> bool:
    """Whether the server has cluster mode on (False when INFO is not allowed: nothing to say then)."""
    try:
        return bool(r.info("cluster").get("cluster_enabled"))
    except redis.ResponseError:
        return False


def describe_failure(exc: BaseException, url: str | None) -> str:
    """One line saying why talking to Redis at ``url`` failed; the password never shows."""
    if isinstance(exc, (RedisURLError, NoRedisError)):
        return scrub(str(exc), url)
    shown = redact(url) if url else "the server"
    detail = _detail(exc, url)
    if isinstance(exc, RedisClusterException):
        if "Cluster mode is not enabled" in str(exc):
            return f"Redis at {shown} is not a cluster (its cluster mode is off): use redis:// for one Redis"
        return f"cannot use Redis Cluster at {shown}: {detail}"
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return f"the Redis user of {shown} lacks a permission packrat-mq needs ({detail})"
    if isinstance(exc, redis.AuthenticationError) or _code(exc) in ("WRONGPASS", "NOAUTH"):
        if _code(exc) == "NOAUTH":
            return (f"Redis at {shown} wants a password: give it in the URL "
                    f"(redis://:PASSWORD@host:port/db or ?password=...) ({detail})")
        if "no password is set" in detail or "without any password configured" in detail:
            return f"Redis at {shown} has no password set, but the URL gives one ({detail})"
        return f"Redis refused the password for {shown} ({detail})"
    if _is_tls(exc):
        return f"TLS with Redis at {shown} failed: {detail}"
    if isinstance(exc, (redis.TimeoutError, TimeoutError)):
        # A plain server on a rediss:// port never answers the TLS handshake.
        hint = " (is the server speaking TLS on that port?)" if (url or "").lower().startswith("rediss:") else ""
        return f"Redis at {shown} did not answer in time: {detail}{hint}"
    if isinstance(exc, (redis.ConnectionError, OSError)):
        return f"cannot reach Redis at {shown}: {detail}"
    if isinstance(exc, redis.exceptions.InvalidResponse):
        return f"the server at {shown} does not answer like Redis ({detail})"
    return f"Redis error at {shown}: {detail}"


def is_connection_failure(exc: BaseException) -> bool:
    """Errors :func:`describe_failure` explains in one line.

    Not other ``OSError`` (a missing file is not about Redis), nor redis-py's
    ``DataError``, raised before anything is sent for an argument of the wrong
    type: that is a bug, and its traceback is what finds it.
    """
    if isinstance(exc, OSError):
        return isinstance(exc, (ConnectionError, TimeoutError, socket.gaierror, socket.herror, ssl.SSLError))
    if isinstance(exc, redis.DataError):
        return False
    if isinstance(exc, RedisClusterException):  # not a RedisError; a cross-slot command is a bug, not Redis
        return not isinstance(exc, redis.exceptions.CrossSlotTransactionError)
    return isinstance(exc, (redis.RedisError, RedisURLError, NoRedisError))


def _code(exc: BaseException) -> str:
    return getattr(exc, "status_code", None) or ""


def _is_tls(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    for _ in range(8):  # the cause chain, not a cycle
        if seen is None:
            return False
        if isinstance(seen, (ssl.SSLError, ssl.CertificateError)) or "SSL" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# redis-py's "Error 111 connecting to host:port. Connection refused." repeats
# the address the message already names (and may hold a mangled URL's parts).
_CONNECTING = re.compile(r"^Error -?\d+ connecting to .*?\.\s+(?=\S)", re.DOTALL)


def _detail(exc: BaseException, url: str | None) -> str:
    text = _CONNECTING.sub("", str(exc)).strip().rstrip(".") or type(exc).__name__
    code = _code(exc)
    if code and not text.startswith(code):
        text = f"{code} {text}"
    return " ".join(scrub(text, url).split())


def is_tty() -> bool:
    return sys.stdout.isatty()


@contextlib.contextmanager
def url_or_private_redis(url: str | None) -> Iterator[str]:
    """``url``, or else the URL of a private embedded server that lives for the block.

    For commands that serve for real to measure (calibration, the serving
    path) and need no server the user can see: it is not announced, and it
    stops however the block ends.
    """
    if url is not None:
        yield url
        return
    with EmbeddedRedis(announce=False) as server:
        yield server.url
