"""One node's serving stack for one model: worker pool plus dispatcher process.

``packrat-mq up`` is a thin shell around :class:`Service`; the demo and the
end-to-end tests use it too. Shutdown order is what makes it lossless: stop
the dispatcher (no new sub-batches), let the instances drain their queues,
then stop them; requests still in the request stream stay there for the
next start.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis

from packrat_mq.instances import Configuration
from packrat_mq.settings import Settings
from workers.pool import Pool

log = logging.getLogger("packrat_mq.service")


class Service:
    """Pool + supervised dispatcher of one model on this node (or the pool alone)."""

    def __init__(
        self,
        r: redis.Redis,
        settings: Settings,
        url: str,
        model: str,
        configuration: Configuration,
        *,
        handler: str | None = None,
        options: dict[str, Any] | None = None,
        profile: str | Path | None = None,
        node: str | None = None,
        with_dispatcher: bool = True,
    ) -> None:
        self.r = r
        self.settings = settings
        self.url = url
        self.model = model
        self.profile = str(profile) if profile else None
        self.pool = Pool(r, settings, url, model, configuration, handler=handler, options=options, node=node)
        self.with_dispatcher = with_dispatcher  # False: the pool alone (docker-compose runs the dispatcher)
        self.dispatcher: subprocess.Popen[bytes] | None = None
        self.dispatcher_restarts = 0

    def start(self, ready_timeout: float = 600.0) -> None:
        self.pool.start()
        self.pool.wait_ready(ready_timeout)
        if self.with_dispatcher:
            self._start_dispatcher()
            self._wait_dispatcher(ready_timeout)

    def _start_dispatcher(self) -> None:
        from dispatcher.__main__ import DispatcherSpec

        spec = DispatcherSpec(url=self.url, settings=self.settings, model=self.model, profile=self.profile,
                              parent_pid=os.getpid())
        self.dispatcher = subprocess.Popen(
            [sys.executable, "-m", "dispatcher", spec.model_dump_json()], start_new_session=True
        )

    def _wait_dispatcher(self, timeout: float) -> None:
        """Block until the dispatcher process reports ready, so "ready" means requests flow."""
        assert self.dispatcher is not None
        key = self.settings.keys.dispatcher(self.model)
        deadline = time.monotonic() + timeout
        while True:
            state = self.r.hmget(key, "state", "pid")
            if state[0] == b"ready" and state[1] == str(self.dispatcher.pid).encode():
                return
            if self.dispatcher.poll() is not None:
                raise RuntimeError(f"dispatcher exited with code {self.dispatcher.returncode} while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"dispatcher not ready after {timeout:.0f} s")
            time.sleep(0.02)

    def check(self) -> None:
        """Restart whatever died (instances, dispatcher)."""
        self.pool.check()
        if self.dispatcher is not None and self.dispatcher.poll() is not None:
            log.warning("dispatcher exited with code %s; restarting", self.dispatcher.returncode)
            self.dispatcher_restarts += 1
            time.sleep(min(5.0, 0.5 * self.dispatcher_restarts))
            self._start_dispatcher()

    def serve_forever(self, poll_s: float = 0.5) -> None:
        """Supervise until SIGINT/SIGTERM, then shut down in order."""
        stopping = False

        def _stop(signum: int, frame: Any) -> None:
            nonlocal stopping
            stopping = True

        old_int = signal.signal(signal.SIGINT, _stop)
        old_term = signal.signal(signal.SIGTERM, _stop)
        try:
            while not stopping:
                self.check()
                time.sleep(poll_s)
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)

    def stop(self, timeout: float = 30.0) -> None:
        if self.dispatcher is not None and self.dispatcher.poll() is None:
            self.dispatcher.send_signal(signal.SIGTERM)
            try:
                self.dispatcher.wait(timeout)
            except subprocess.TimeoutExpired:
                self.dispatcher.kill()
                self.dispatcher.wait()
        if not self.pool.drain(timeout):
            log.warning("instance queues not empty at shutdown; their work is kept in Redis")
        self.pool.stop(timeout)
        self.pool.retire()
        if self.with_dispatcher:
            # With a separate dispatcher the deployment stays: a restarted pool
            # of the same node and generation takes it over.
            self.r.delete(self.settings.keys.config(self.model))

    def __enter__(self) -> Service:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

