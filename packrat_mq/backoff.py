"""Exponential backoff, the one retry policy of every loop and supervisor.

A fixed retry interval hammers a Redis that is coming back and makes a crash
loop as busy as a healthy service; rq grows its wait by a factor up to a cap
(``exponential_backoff_factor``). Here too: ``base * factor**n`` up to ``cap``,
and back to ``base`` once things have gone well for ``healthy_s``.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Delays for consecutive failures; :meth:`success` forgets them after a healthy period."""

    base: float = 0.05
    factor: float = 2.0
    cap: float = 5.0
    #: Failures are forgotten only after this long without one, so a process
    #: that crashes a few seconds after every start still backs off.
    healthy_s: float = 10.0
    #: The first failure after a healthy period is retried at once (``0``) or after ``base``.
    first_immediate: bool = False
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    failures: int = 0
    _last_failure: float = field(default=0.0, repr=False)

    def failure(self) -> float:
        """Record a failure; returns how long to wait before the next try."""
        now = self.clock()
        if self.failures and now - self._last_failure >= self.healthy_s:
            self.failures = 0
        self.failures += 1
        self._last_failure = now
        if self.first_immediate:
            if self.failures == 1:
                return 0.0
            return min(self.cap, self.base * self.factor ** (self.failures - 2))
        return min(self.cap, self.base * self.factor ** (self.failures - 1))

    def retrying(self) -> None:
        """The retry starts now: the healthy period runs from here, not from the failure.

        A supervisor calls it when it starts a dead process again; the wait
        before the restart is not time the process ran healthy.
        """
        if self.failures:
            self._last_failure = self.clock()

    def success(self) -> None:
        """Things work again: the next failure after ``healthy_s`` starts from the bottom."""
        if self.failures and self.clock() - self._last_failure >= self.healthy_s:
            self.failures = 0
