"""Options every command shares, and small helpers for output."""
from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import click

from packrat_mq.settings import Settings


def redis_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--redis-url`` and ``--prefix``; the command receives ``settings``."""

    @click.option(
        "--redis-url",
        envvar="PACKRAT_REDIS_URL",
        default=None,
        help="redis://[user:password@]host:port/db, rediss:// (TLS) or unix:///path. "
        "Default: the embedded server started by `packrat-mq up`.",
    )
    @click.option("--prefix", envvar="PACKRAT_PREFIX", default="packrat", show_default=True,
                  help="Key prefix; deployments sharing one Redis use different prefixes.")
    @functools.wraps(func)
    def wrapper(*args: Any, redis_url: str | None, prefix: str, **kwargs: Any) -> Any:
        overrides = {"prefix": prefix}
        if redis_url:
            overrides["redis_url"] = redis_url
        try:
            settings = Settings(**overrides)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        return func(*args, settings=settings, **kwargs)

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


def echo_json(value: Any) -> None:
    """Exactly one JSON document on stdout, for scripts."""
    click.echo(json.dumps(value, indent=2, default=str))


def err(message: str) -> None:
    click.echo(message, err=True)


def connect_or_fail(settings: Settings):  # type: ignore[no-untyped-def]
    from packrat_mq.connection import NoRedisError, connect, redact, resolve_url

    try:
        url = resolve_url(settings)
    except NoRedisError as exc:
        raise click.ClickException(str(exc)) from None
    r = connect(url)
    try:
        r.ping()
    except Exception as exc:  # noqa: BLE001 - any failure here is "cannot reach Redis"
        raise click.ClickException(f"cannot reach Redis at {redact(url)}: {exc}") from None
    return r, url


def is_tty() -> bool:
    return sys.stdout.isatty()
