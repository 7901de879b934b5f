"""Signals in a process that starts others: SIGTERM stops it as Ctrl-C does; no signal cuts a start or stop in half.

A command that starts an embedded redis-server, workers or a dispatcher must
stop them on every way out. Python runs ``finally`` blocks on Ctrl-C (a
``KeyboardInterrupt``) but not on SIGTERM, whose default action ends the
process at once; and a ``KeyboardInterrupt`` that lands between starting a
process and recording its pid, or halfway through stopping one, leaves it
running with nobody to stop it. :func:`terminate_as_interrupt` makes SIGTERM
(and SIGHUP) raise :class:`Terminated`, a ``KeyboardInterrupt``, so every
``except KeyboardInterrupt`` and ``finally`` treats them alike;
:func:`uninterrupted` holds SIGINT and SIGTERM back for a short section and
delivers them when it ends.

Signal handlers belong to the main thread: in any other thread both are no-ops.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

#: Signals that end a command the way Ctrl-C does.
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C's ``KeyboardInterrupt`` would be."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code(exc: KeyboardInterrupt) -> int:
    """The shell's exit status for a process ended by this interrupt: 128 + the signal's number."""
    return 128 + (exc.signum if isinstance(exc, Terminated) else signal.SIGINT)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _replaceable(sig: int) -> bool:
    """Not ignored (``nohup``, a background job's SIGINT) and not a handler Python did not set."""
    handler = signal.getsignal(sig)
    return handler is not None and handler is not signal.SIG_IGN


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Inside the block SIGTERM and SIGHUP raise :class:`Terminated`; the old handlers come back after.

    A signal its parent set to be ignored (``nohup``) stays ignored.
    """
    if not _main_thread():
        yield
        return
    old = {sig: signal.signal(sig, _raise_terminated) for sig in TERMINATING if _replaceable(sig)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP back inside the block; the first one received is delivered as it ends.

    For the few steps that must not be cut in half: starting a server and
    recording its pid, stopping it. The signal then reaches whatever handler
    is in place after the block (a ``KeyboardInterrupt`` for SIGINT), so
    nothing is lost, only delayed. Keep the block short: nothing can interrupt
    it. Nested blocks hand the signal outwards.
    """
    if not _main_thread():
        yield
        return
    received: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    old = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, *TERMINATING) if _replaceable(sig)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if received:
            signal.raise_signal(received[0])
