"""The two servers of the peers benchmark, each started and stopped as its users would.

- :class:`TorchServe`: ``torchserve --start --foreground --ncs`` from the peers
  virtual environment, in a directory of its own (it writes ``logs/`` into its
  working directory and its pid file and worker sockets into the temporary
  directory, which is pointed there too, so two runs on one machine never share
  them), stopped with ``torchserve --stop``.
- :class:`PackratUp`: ``packrat-mq up --graph torchscript`` on a redis-server of its own
  (the embedded one, started here so that its life is this object's), stopped
  with Ctrl-C (SIGINT), which drains as ``up`` always does.

Both are context managers that leave no process behind on any exit path: what
was started runs in a session of its own, and whatever of it is still alive
after the polite stop (and a grace period) is killed, children included.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import psutil

from benchmarks.peers.load import Target, npy_image, probe
from packrat_mq.connection import EmbeddedRedis
from packrat_mq.keys import Keys
from workers.launch import thread_env

#: Variables that would override what a packrat-mq setup says on its command line.
_PACKRAT_OVERRIDES = ("PACKRAT_REDIS_URL", "PACKRAT_PREFIX", "PACKRAT_INSTANCES", "PACKRAT_BATCH_TIMEOUT_MS",
                      "PACKRAT_GRAPH_MODE", "PACKRAT_EXIT_WITH_PARENT")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reap(proc: subprocess.Popen[Any] | None, family: list[psutil.Process], grace_s: float) -> list[int]:
    """Wait ``grace_s`` for ``proc`` and ``family`` to exit, then kill what is left; the pids killed."""
    deadline = time.monotonic() + grace_s
    if proc is not None:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _, alive = psutil.wait_procs(family, timeout=max(0.1, deadline - time.monotonic()))
    killed = []
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the whole group
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        killed.append(proc.pid)
    for p in alive:
        try:
            p.kill()
            killed.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return killed


def _family(pid: int) -> list[psutil.Process]:
    try:
        parent = psutil.Process(pid)
        return [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


class TorchServe:
    """TorchServe serving one model directory of ``store`` (made by :func:`benchmarks.peers.archive.build_store`)."""

    def __init__(self, venv: Path, store: Path, workdir: Path, *, model: str, threads: int,
                 start_timeout_s: float = 300.0) -> None:
        self.venv, self.store, self.workdir = venv, store, workdir
        self.model, self.threads = model, threads
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.family: list[psutil.Process] = []
        self.url = ""
        self._log: IO[bytes] | None = None
        self.killed: list[int] = []

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(thread_env(self.threads))  # the same thread variables a packrat-mq instance gets
        # Its pid file (torchserve --stop reads it) and the worker sockets go to the temporary
        # directory, the JVM's too (TEMP): keep them in this run's directory.
        env.update(TMPDIR=str(self.workdir), TEMP=str(self.workdir),
                   PATH=f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
        env.pop("VIRTUAL_ENV", None)
        env.pop("PYTHONPATH", None)
        return env

    def config(self) -> str:
        inference, management, metrics, grpc_inference, grpc_management = (free_port() for _ in range(5))
        self.url = f"http://127.0.0.1:{inference}"
        return "\n".join([
            f"inference_address=http://127.0.0.1:{inference}",
            f"management_address=http://127.0.0.1:{management}",
            f"metrics_address=http://127.0.0.1:{metrics}",
            "grpc_inference_address=127.0.0.1",
            "grpc_management_address=127.0.0.1",
            f"grpc_inference_port={grpc_inference}",
            f"grpc_management_port={grpc_management}",
            f"number_of_netty_threads={self.threads}",
            f"netty_client_threads={self.threads}",
            "default_workers_per_model=1",
            "default_response_timeout=120",
            # Since 0.11 every API call needs a token unless this is set (or --disable-token-auth).
            "disable_token_authorization=true",
            "enable_model_api=false",
            # A Python process every minute to sample CPU and memory: off, as a measured setup should have it.
            "disable_system_metrics=true",
            "install_py_dep_per_model=false",
            f"model_store={self.store}",
            f"load_models={self.model}",
            "",
        ])

    def __enter__(self) -> Target:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "config.properties"
        config.write_text(self.config())
        self._log = open(self.workdir / "torchserve.out", "wb")
        # --foreground: the launcher waits for the JVM, so it stays our child and is reaped here.
        self.proc = subprocess.Popen(
            [str(self.venv / "bin" / "torchserve"), "--start", "--foreground", "--ncs", "--disable-token-auth",
             "--model-store", str(self.store), "--ts-config", str(config)],
            cwd=self.workdir, env=self._env(), stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            target = Target("torchserve", self.url, self.model)
            self._wait_ready(target)
            self.family = _family(self.proc.pid)
            return target
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def _wait_ready(self, target: Target) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"torchserve exited with {self.proc.returncode}; see {self.workdir}/logs")
            try:
                with socket.create_connection(("127.0.0.1", int(self.url.rsplit(":", 1)[1])), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"torchserve did not listen within {self.start_timeout_s:.0f} s") from None
                time.sleep(0.25)
        probe(target, npy_image(), timeout_s=max(1.0, deadline - time.monotonic()))

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        self.family = self.family or _family(self.proc.pid)
        if self.proc.poll() is None:
            subprocess.run([str(self.venv / "bin" / "torchserve"), "--stop"], cwd=self.workdir, env=self._env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60, check=False)
        self.killed = _reap(self.proc, self.family, grace_s=30)
        self.proc = None
        if self._log is not None:
            self._log.close()


class PackratUp:
    """``packrat-mq up --model MODEL --graph ARGS`` on a redis-server started for it."""

    STARTING = re.compile(r"^starting \S+: (?P<config>\S+) \(B=", re.MULTILINE)

    def __init__(self, workdir: Path, *, model: str, args: list[str], batch_timeout_ms: float,
                 start_timeout_s: float = 300.0, extra_env: Mapping[str, str] | None = None,
                 shm: bool | str = False) -> None:
        self.workdir, self.model, self.args = workdir, model, args
        #: Payloads in shared memory files: a directory of its own on the host's tmpfs, for the server and the
        #: clients. ``"sealed"``: in the clients' sealed memfds, which need none.
        self.shm_dir = tempfile.mkdtemp(prefix="packrat-peers-", dir="/dev/shm") if shm is True else None
        self.sealed = shm == "sealed"
        self.batch_timeout_ms = batch_timeout_ms
        self.start_timeout_s = start_timeout_s
        self.extra_env = dict(extra_env or {})
        self.redis: EmbeddedRedis | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.family: list[psutil.Process] = []
        self.configuration: str | None = None
        self.log_path = workdir / "up.out"
        self._log: IO[bytes] | None = None
        self.killed: list[int] = []

    def command(self, url: str) -> list[str]:
        return [sys.executable, "-m", "packrat_mq", "up", "--model", self.model, "--graph", "torchscript",
                *self.args,
                "--batch-timeout-ms", f"{self.batch_timeout_ms:g}", "--redis-url", url, "--prefix", "peers",
                "--exit-with-parent"]

    def __enter__(self) -> Target:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.redis = EmbeddedRedis(self.workdir / "redis", announce=False).start()
            env = {k: v for k, v in os.environ.items() if k not in _PACKRAT_OVERRIDES}
            env.update(self.extra_env)
            if self.shm_dir:
                env["PACKRAT_SHM_DIR"] = self.shm_dir
            self._log = open(self.log_path, "wb")
            self.proc = subprocess.Popen(self.command(self.redis.url), cwd=self.workdir, env=env, stdout=self._log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            deadline = time.monotonic() + self.start_timeout_s
            while "\nready: " not in "\n" + self.log_path.read_text(errors="replace"):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"packrat-mq up exited with {self.proc.returncode}:\n"
                                       + self.log_path.read_text(errors="replace")[-2000:])
                if time.monotonic() > deadline:
                    raise RuntimeError(f"packrat-mq up was not ready within {self.start_timeout_s:.0f} s")
                time.sleep(0.2)
            found = self.STARTING.search(self.log_path.read_text(errors="replace"))
            self.configuration = found.group("config") if found else None
            self.family = _family(self.proc.pid)
            target = Target("packrat", self.redis.url, self.model, prefix="peers", shm_dir=self.shm_dir,
                            sealed=self.sealed)
            probe(target, npy_image(), timeout_s=max(1.0, deadline - time.monotonic()))
            return target
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def reconfigurations(self) -> list[dict[str, Any]]:
        """The model's reconfiguration history so far, oldest first (what an adaptive setup changed to, and when)."""
        import json

        import redis

        assert self.redis is not None
        r = redis.Redis.from_url(self.redis.url)
        try:
            return [json.loads(x) for x in reversed(r.lrange(Keys("peers").reconfigurations(self.model), 0, -1))]
        finally:
            r.close()

    def __exit__(self, *exc: object) -> None:
        try:
            if self.proc is not None:
                self.family = self.family or _family(self.proc.pid)
                if self.proc.poll() is None:
                    self.proc.send_signal(signal.SIGINT)  # Ctrl-C: dispatcher first, instances drain
                self.killed = _reap(self.proc, self.family, grace_s=60)
                self.proc = None
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
            if self.redis is not None:
                self.redis.stop()
                self.redis = None
            if self.shm_dir:
                shutil.rmtree(self.shm_dir, ignore_errors=True)
