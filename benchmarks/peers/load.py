"""One load generator for both servers: closed-loop clients, one process each.

Each client is its own process (spawned, so nothing of the parent is shared)
that sends the same ``.npy`` payload, waits for the answer and sends again,
from a common start for ``warmup_s + measure_s`` seconds. Only requests sent
inside the measured window count towards latency; requests per second are the
answers received inside it, divided by its length. Every client finishes the
request it has in flight, so no latency is cut short. An idle probe is the
same loop with one client.

A client talks to TorchServe over its HTTP inference API (``POST
/predictions/<model>``, one keep-alive connection per client, ``http.client``)
and to packrat-mq with the project's Python client (``XADD`` of the request,
``XREAD`` of its own reply stream, ``packrat_mq.client.Client``). Both are
synchronous and cost the client a few hundred microseconds per request.
"""
from __future__ import annotations

import http.client
import multiprocessing as mp
import queue
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from packrat_mq import protocol
from packrat_mq.client import Client

#: Seconds a request may take before it counts as an error.
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Target:
    """Where a client sends: ``kind`` is ``torchserve`` (``url`` http://...) or ``packrat`` (a Redis URL)."""

    kind: str
    url: str
    model: str
    prefix: str = "packrat"
    #: packrat only: this shared-memory payload directory (the server's ``PACKRAT_SHM_DIR``) carries the
    #: images instead of Redis (``Client(shared_memory=True)``, a producer on the serving host).
    shm_dir: str | None = None
    #: packrat only: the images in sealed memfds the workers map (``Client(shared_memory="sealed")``).
    sealed: bool = False


Sender = Callable[[bytes], "str | None"]


def _torchserve_sender(target: Target) -> tuple[Sender, Callable[[], None]]:
    parts = urlsplit(target.url)
    path = f"/predictions/{target.model}"
    conn: list[http.client.HTTPConnection] = []

    def send(payload: bytes) -> str | None:
        if not conn:
            conn.append(http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S))
        try:
            conn[0].request("POST", path, body=payload, headers={"Content-Type": protocol.NPY})
            resp = conn[0].getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.pop().close()  # a fresh connection for the next request
            return f"{type(exc).__name__}: {exc}"
        if resp.status != 200:
            return f"HTTP {resp.status}: {body[:200].decode('utf-8', 'replace')}"
        return None if b"top5" in body else f"unexpected answer: {body[:200]!r}"

    def close() -> None:
        while conn:
            conn.pop().close()

    return send, close


def _packrat_sender(target: Target) -> tuple[Sender, Callable[[], None]]:
    client = Client(target.url, prefix=target.prefix,
                    shared_memory="sealed" if target.sealed else target.shm_dir is not None, shm_dir=target.shm_dir)

    def send(payload: bytes) -> str | None:
        try:
            reply = client.submit(target.model, payload, content_type=protocol.NPY, timeout=REQUEST_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a timeout or a lost connection is this request's error
            return f"{type(exc).__name__}: {exc}"
        if not reply.ok:
            return reply.error[:200]
        return None if b"top5" in reply.payload else f"unexpected answer: {reply.payload[:200]!r}"

    return send, client.close


def sender(target: Target) -> tuple[Sender, Callable[[], None]]:
    """``(send, close)`` for ``target``: ``send(payload)`` returns None, or what went wrong."""
    if target.kind == "torchserve":
        return _torchserve_sender(target)
    if target.kind == "packrat":
        return _packrat_sender(target)
    raise ValueError(f"unknown target kind {target.kind!r}")


def _client(target: Target, payload: bytes, go: Any, start: Any, warmup_s: float, measure_s: float,
            results: Any) -> None:
    """One closed-loop client: wait for ``go``, then send until the end; report (sent, received, error)."""
    send, close = sender(target)
    records: list[tuple[float, float, str | None]] = []
    results.put(("ready", None))
    go.wait()
    end = start.value + warmup_s + measure_s
    try:
        while time.monotonic() < end:
            sent = time.monotonic()
            error = send(payload)
            records.append((sent, time.monotonic(), error))
    finally:
        close()
        results.put(("done", records))


@dataclass
class LoadResult:
    """What one closed-loop run measured."""

    clients: int
    warmup_s: float
    measure_s: float
    latencies_ms: list[float] = field(default_factory=list)
    completed: int = 0
    errors: int = 0
    error_samples: dict[str, int] = field(default_factory=dict)
    requests_total: int = 0
    #: Requests each client sent in the window: a server that serves some clients and starves others shows here.
    per_client: list[int] = field(default_factory=list)

    def percentile(self, q: float) -> float | None:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else None

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.measure_s

    def summary(self) -> dict[str, Any]:
        return {"clients": self.clients, "warmup_s": self.warmup_s, "measure_s": self.measure_s,
                "p50_ms": self.percentile(50), "p90_ms": self.percentile(90), "p99_ms": self.percentile(99),
                "mean_ms": float(np.mean(self.latencies_ms)) if self.latencies_ms else None,
                "requests_per_s": self.requests_per_s, "measured_requests": len(self.latencies_ms),
                "completed_in_window": self.completed, "errors": self.errors,
                "error_samples": self.error_samples, "requests_total": self.requests_total,
                "per_client_requests": self.per_client}


def closed_loop(target: Target, payload: bytes, *, clients: int, warmup_s: float, measure_s: float,
                start_timeout_s: float = 120.0) -> LoadResult:
    """Drive ``target`` with ``clients`` closed-loop clients; count the window after ``warmup_s``."""
    ctx = mp.get_context("spawn")
    go, start, results = ctx.Event(), ctx.Value("d", 0.0), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(target, payload, go, start, warmup_s, measure_s, results),
                         name=f"peers-client-{i}", daemon=True) for i in range(clients)]
    records: list[list[tuple[float, float, str | None]]] = []
    try:
        for p in procs:
            p.start()
        for _ in procs:
            kind, _ = results.get(timeout=start_timeout_s)
            if kind != "ready":
                raise RuntimeError(f"a client reported {kind!r} before it was ready")
        start.value = time.monotonic()
        go.set()
        deadline = time.monotonic() + warmup_s + measure_s + REQUEST_TIMEOUT_S + 30
        for _ in procs:
            try:
                _, part = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError("a load client did not report back in time") from None
            records.append(part)
        for p in procs:
            p.join(timeout=10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    window_start = start.value + warmup_s
    window_end = window_start + measure_s
    result = LoadResult(clients=clients, warmup_s=warmup_s, measure_s=measure_s,
                        requests_total=sum(len(part) for part in records))
    errors: Counter[str] = Counter()
    for part in records:
        sent_in_window = 0
        for sent, received, error in part:
            if window_start <= sent < window_end:
                sent_in_window += 1
                if error is None:
                    result.latencies_ms.append((received - sent) * 1000.0)
                else:
                    result.errors += 1
                    errors[error] += 1
            if error is None and window_start <= received <= window_end:
                result.completed += 1
        result.per_client.append(sent_in_window)
    result.error_samples = dict(errors.most_common(5))
    return result


def probe(target: Target, payload: bytes, timeout_s: float = 300.0) -> None:
    """Send one request, retrying until ``timeout_s``, until it is answered: the server is ready."""
    send, close = sender(target)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            error = send(payload)
            if error is None:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{target.kind} at {target.url} never answered correctly: {error}")
            time.sleep(0.5)
    finally:
        close()


def npy_image(size: int = 224, seed: int = 0) -> bytes:
    """The request body: one float32 RGB image (3, size, size) in [0, 1] as ``.npy`` (602,240 bytes at 224)."""
    image = np.random.default_rng(seed).random((3, size, size), dtype=np.float32)
    return protocol.encode_as(protocol.NPY, image)

