"""Every command that connects turns a bad URL, an unreachable server or a refused password into one line.

The real CLI runs as a subprocess (``python -m packrat_mq``), as a user runs it:
non-zero exit, one line on stderr, no traceback, the password nowhere in the
output, and no process it started (worker, dispatcher, embedded redis-server)
left behind. A password-protected redis-server of the tests' own is started
here; the shared session server keeps no password.
"""
from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli_run import PASSWORD, PasswordServer, assert_one_line_failure, run_cli
from tests.cli_run import password_server  # noqa: F401 - a fixture of these tests

WRONG = "wrong-pass-99"
ENCODED = "pa%2Fss-w0rd-42"

COMMANDS = {
    "status": ["status"],
    "submit": ["submit", "-m", "echo", "-d", "{}"],
    "up": ["up", "-m", "echo"],
    "pool": ["pool", "-m", "echo"],
    "dispatch": ["dispatch", "-m", "echo"],
    "profile-enqueue": ["profile", "run", "--model", "echo", "--enqueue"],
}


def _url(kind: str, server: PasswordServer) -> str:
    return {
        "unreachable": "redis://127.0.0.1:1/0",
        "wrong-password": server.url(f":{WRONG}"),
        "malformed": "redis://127.0.0.1:notaport/0",
        "unencoded-slash": server.url(f":{PASSWORD}"),
    }[kind]


EXPECTED = {
    "unreachable": "cannot reach Redis at redis://127.0.0.1:1/0: Connection refused",
    "wrong-password": "Redis refused the password for redis://:***@127.0.0.1:",
    "malformed": "invalid Redis URL redis://127.0.0.1:notaport/0: the port is not a number",
    "unencoded-slash": "invalid Redis URL redis://:***@127.0.0.1:",
}


# An unreachable server and a refused password, for every command: tests/test_cli_smoke.py.
@pytest.mark.parametrize("kind", ["malformed", "unencoded-slash"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_bad_url_is_one_line(command: str, kind: str, password_server: PasswordServer) -> None:
    run = run_cli(*COMMANDS[command], "--redis-url", _url(kind, password_server))
    assert_one_line_failure(run, PASSWORD, WRONG, "ss-w0rd-42", says=EXPECTED[kind])


@pytest.mark.parametrize("kind", ["unreachable", "unencoded-slash"])
def test_optimize_calibrate_bad_url_is_one_line(kind: str, password_server: PasswordServer) -> None:
    run = run_cli("optimize", "-p", "minilm", "-t", "1", "-b", "1", "--calibrate", "--top-k", "1", "--rounds", "1",
                  "--redis-url", _url(kind, password_server))
    # Checked before any candidate is served: the URL's own error, not one per candidate.
    assert_one_line_failure(run, PASSWORD, "ss-w0rd-42", says=EXPECTED[kind])
    assert run.stdout == ""


@pytest.mark.parametrize(("userinfo", "says"), [
    ("", "wants a password"),                                 # NOAUTH
    (":" + WRONG, "refused the password"),                    # WRONGPASS, default user
    ("ghost:" + WRONG, "refused the password"),               # WRONGPASS, no such user
    ("nothing:nothing-pw", "lacks a permission"),             # NOPERM at PING
    ("pingonly:pingonly-pw", "lacks a permission"),           # NOPERM after PING: caught by the group
])
def test_authentication_failures(userinfo: str, says: str, password_server: PasswordServer) -> None:
    run = run_cli("status", "--redis-url", password_server.url(userinfo))
    assert_one_line_failure(run, PASSWORD, WRONG, "nothing-pw", "pingonly-pw", says=says)


def test_wrong_password_in_a_unix_url(password_server: PasswordServer) -> None:
    url = f"unix://{password_server.socket_path}?password={WRONG}"
    line = assert_one_line_failure(run_cli("status", "--redis-url", url), WRONG, says="refused the password")
    assert "password=***" in line


def test_percent_encoded_password_works(password_server: PasswordServer) -> None:
    run = run_cli("status", "--json", "--redis-url", password_server.url(f":{ENCODED}"), "--prefix", "t-cli-errors")
    assert run.returncode == 0, run.stderr
    assert PASSWORD not in run.stdout + run.stderr and ENCODED not in run.stdout + run.stderr
    assert '"redis_url": "redis://:***@127.0.0.1:' in run.stdout


@pytest.mark.parametrize(("url", "says"), [
    ("http://127.0.0.1:6379/0", "scheme 'http'"),
    ("127.0.0.1:6379", "no scheme"),
    (f"redis://user:{PASSWORD}@c@127.0.0.1:1/0", "percent-encoded"),
    ("redis://nosuchhost.invalid:6379/0", "cannot reach Redis at redis://nosuchhost.invalid:6379/0"),
])
def test_other_bad_urls(url: str, says: str) -> None:
    assert_one_line_failure(run_cli("status", "--redis-url", url), PASSWORD, "ss-w0rd-42", says=says)


@pytest.mark.parametrize("command", ["status", "submit", "pool", "dispatch", "profile-enqueue"])
def test_no_url_and_no_embedded_server(command: str) -> None:
    assert_one_line_failure(run_cli(*COMMANDS[command]), says="no Redis to talk to")


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield int(s.getsockname()[1])


def test_timeout(silent_port: int) -> None:
    run = run_cli("status", "--redis-url", f"redis://:{WRONG}@127.0.0.1:{silent_port}/0")
    assert_one_line_failure(run, WRONG, says="did not answer in time")


@pytest.fixture
def tls_port(tmp_path: Path) -> Iterator[int]:
    """A TLS server with a self-signed certificate, which a client must not trust."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command for a self-signed certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"],
                   check=True, capture_output=True, timeout=60)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                context.wrap_socket(conn, server_side=True).close()
            except OSError:
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        listener.close()


def test_tls_failure(tls_port: int) -> None:
    run = run_cli("status", "--redis-url", f"rediss://:{WRONG}@127.0.0.1:{tls_port}/0")
    assert_one_line_failure(run, WRONG, says="TLS with Redis at rediss://:***@127.0.0.1:")


def test_up_with_a_wrong_password_starts_nothing(password_server: PasswordServer) -> None:
    # Without --instances the optimizer would print its choice first: the URL is checked before it.
    run = run_cli("up", "-m", "echo", "--redis-url", password_server.url(f":{WRONG}"))
    assert_one_line_failure(run, WRONG, says="refused the password")
    assert run.stdout == ""
