"""Waiting on conditions and on processes, for the tests that start real ones."""
from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

from packrat_mq import protocol
from packrat_mq.keys import DISPATCHER_GROUP, request_owner
from packrat_mq.streams import ensure_group


def eventually(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Whether ``predicate`` came true within ``timeout`` seconds (polled every ``interval``)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05,
             ignore: tuple[type[BaseException], ...] = ()) -> None:
    """Wait until ``predicate`` is true or fail the test naming ``what``; exceptions in ``ignore`` count as false."""
    def check() -> Any:
        try:
            return predicate()
        except ignore:
            return False

    if not eventually(check, timeout, interval):
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, its stat was read
        return False


def interrupt(proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    """Ctrl-C ``proc`` as a user would, and SIGKILL it if it has not stopped within ``timeout``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def terminate_all(procs: list[subprocess.Popen[Any]], timeout: float = 30.0) -> None:
    """SIGTERM every process still running, last started first, then wait for each (SIGKILL after ``timeout``)."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()


def stop_supervisors(supervisors: list[Any], timeout: float, *, only_if_running: bool = False) -> None:
    """A fixture's teardown: stop each supervisor in order, then SIGKILL whatever of its processes is left.

    ``only_if_running``: skip the orderly stop of a supervisor none of whose processes runs (one whose
    start failed).
    """
    for sup in supervisors:
        if not only_if_running or any(c.running() for c in sup.children):
            try:
                sup.stop(timeout=timeout)
            except Exception:  # noqa: BLE001 - the kill below still runs
                pass
        for child in sup.children:
            if child.process is not None and child.process.poll() is None:
                child.process.kill()
                child.process.wait()


def hand_out(r: Any, keys: Any, model: str, instance_id: str, requests: list[Any], batch_id: str = "b1", *,
             carry_bytes: int = 0) -> bytes:
    """Do what the dispatcher does for one sub-batch, for tests that drive a worker directly.

    Each request is XADDed to the model's request stream (its ``stream_id``
    set to the new entry's), read by the dispatchers group and claimed for
    the instance, and the sub-batch (ids and metadata, and the payloads up to
    ``carry_bytes``) is XADDed to the instance's queue; returns the queue entry's id.
    """
    stream = keys.requests(model)
    ensure_group(r, stream, DISPATCHER_GROUP)
    for req in requests:
        fields = protocol.request_fields(req.id, req.reply_to, req.payload or b"", req.content_type, req.deadline_ms,
                                         payload_shm=req.payload_shm, keep=req.payload_shm_keep,
                                         payload_fd=req.payload_fd)
        req.stream_id = r.xadd(stream, fields).decode()
    r.xreadgroup(DISPATCHER_GROUP, "dispatcher", {stream: ">"})
    if requests:
        r.xclaim(stream, DISPATCHER_GROUP, request_owner(instance_id), 0, [q.stream_id for q in requests], justid=True)
    return r.xadd(keys.queue(model, instance_id), protocol.encode_subbatch(requests, batch_id, carry_bytes=carry_bytes))
