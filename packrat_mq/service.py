"""One node's serving stack for one model: worker pool plus dispatcher process.

``packrat-mq up`` is a thin shell around :class:`Service`; the demo and the
end-to-end tests use it too. Shutdown order is what makes it lossless: stop
the dispatcher (no new sub-batches), let the instances drain their queues,
then stop them; requests still in the request stream stay there for the
next start.

Supervision rides out anything one check can throw (Redis restarting, a
write refused): the error is logged, counted and the next check comes after
an exponential backoff; nothing in the loop sleeps longer than its poll.
With ``exit_with_parent`` the service also stops, in order, when the program
that started it dies (a test runner, a process manager killed with SIGKILL),
the way its own children stop when it dies.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from packrat_mq.backoff import Backoff
from packrat_mq.instances import Configuration
from packrat_mq.settings import Settings
from workers.pool import Pool, Restarter, mark, spawn

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
        exit_with_parent: bool = False,
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
        self._dispatcher_restart = Restarter()
        #: The parent to outlive by no more than a poll, when asked to.
        self.parent_pid = os.getppid() if exit_with_parent else None
        self.loop_errors = 0
        self._loop_backoff = Backoff(base=0.1, cap=5.0)

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
        self.dispatcher = spawn("dispatcher", spec.model_dump_json())

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
        """Restart whatever died (instances, dispatcher); never blocks."""
        self.pool.check()
        key = self.settings.keys.dispatcher(self.model)
        if self._dispatcher_restart.due(self.dispatcher, name="dispatcher", r=self.r, key=key):
            self.dispatcher_restarts += 1
            self._start_dispatcher()
            mark(self.r, key, restarts=1)
        # After a Redis restart without persistence the deployment is gone.
        self.pool.republish_if_lost()

    def parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def serve_forever(self, poll_s: float = 0.5) -> None:
        """Supervise until SIGINT/SIGTERM (or the parent's death, if watched), then return."""
        stopping = False

        def _stop(signum: int, frame: Any) -> None:
            nonlocal stopping
            stopping = True

        old_int = signal.signal(signal.SIGINT, _stop)
        old_term = signal.signal(signal.SIGTERM, _stop)
        try:
            while not stopping:
                if self.parent_gone():
                    log.warning("parent (pid %d) is gone; stopping", self.parent_pid)
                    break
                wait = poll_s
                try:
                    self.check()
                    self._loop_backoff.success()
                except Exception as exc:  # noqa: BLE001 - supervision must outlive any one failure
                    self.loop_errors += 1
                    wait = max(poll_s, self._loop_backoff.failure())
                    if isinstance(exc, redis.RedisError):
                        log.warning("supervisor: redis error (%s); checking again in %.1f s", exc, wait)
                    else:
                        log.exception("supervisor check failed; checking again in %.1f s", wait)
                end = time.monotonic() + wait
                while not stopping and time.monotonic() < end:
                    time.sleep(min(poll_s, 0.1))
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)

    def stop(self, timeout: float = 30.0) -> None:
        """Dispatcher first, then let the instances drain, then stop them; Redis may be down meanwhile."""
        if self.dispatcher is not None and self.dispatcher.poll() is None:
            self.dispatcher.send_signal(signal.SIGTERM)
            try:
                self.dispatcher.wait(timeout)
            except subprocess.TimeoutExpired:
                self.dispatcher.kill()
                self.dispatcher.wait()
        try:
            drained = self.pool.drain(timeout)
        except redis.RedisError as exc:
            log.warning("cannot see the instance queues (%s); stopping the instances anyway", exc)
            drained = False
        if not drained:
            log.warning("instance queues not empty at shutdown; their work is kept in Redis")
        self.pool.stop(timeout)
        try:
            self.pool.retire()
            if self.with_dispatcher:
                # With a separate dispatcher the deployment stays: a restarted pool
                # of the same node and generation takes it over.
                self.r.delete(self.settings.keys.config(self.model))
        except redis.RedisError as exc:
            log.warning("could not remove this deployment's records from Redis: %s", exc)

    def __enter__(self) -> Service:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

