"""The profiling child: one measuring process per thread count, both ends of its protocol.

The parent (:class:`ProfilingChild`) spawns ``python -m
optimizer.profiling.child`` the way a worker instance is spawned
(:func:`workers.launch.spawn` with :func:`workers.launch.instance_env`, so
OpenMP/MKL size their pools before torch loads), with a :class:`ChildSpec` as
the first line of its stdin. The child (:func:`main`) starts the model with
:func:`workers.runtime.start`, exactly as a served instance does (pin to the
``t`` cores the scheduler placed it on, load the handler, size torch,
initialise), and then answers one JSON line on stdout per JSON request line
on stdin: ``{"batch": b, "dominated_above_ms": x}`` in, the timing of
``handler.handle(example_batch(b))`` (preprocess + inference + postprocess,
the serving path) out. Every scheduling decision stays in the parent.

**One child per thread count, not per (t, b).** What must be fresh for each
``t`` is the process: thread pools and affinity are fixed when torch starts.
Within one ``t`` a new batch size only changes input shapes, and warm-up
iterations at that size absorb the new shapes' one-off costs (oneDNN
primitives, allocator growth). Loading a model (torch import, weights, and in
graph mode a trace) costs 1-10 s, often more than measuring one (t, b), so a
child per (t, b) would multiply the load cost by the number of batch sizes for
nothing. The child loads in eager mode and, in graph mode, re-traces at each
``b`` from those weights (:func:`workers.runtime.resize`), because a served
instance is traced at its own batch size.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from pydantic import BaseModel

from optimizer.profiling.options import ProfilingError, ProfilingOptions
from optimizer.profiling.statistics import measure
from packrat_mq.handler import BaseHandler, run_batch
from packrat_mq.settings import Settings
from workers import runtime
from workers.launch import instance_env, read_spec, spawn
from workers.runtime import RuntimeSpec

#: What ``python -m`` runs in the child.
MODULE = "optimizer.profiling.child"


class ChildSpec(BaseModel):
    """What one profiling child runs: the instance (as a worker would run it) and how to measure it."""

    runtime: RuntimeSpec
    options: ProfilingOptions

    @classmethod
    def for_threads(
        cls, options: ProfilingOptions, threads: int, cpus: tuple[int, ...], socket: int = 0
    ) -> ChildSpec:
        """Load in eager mode at the first batch size; graph mode traces per batch size later."""
        return cls(
            runtime=RuntimeSpec(
                model=options.model,
                handler=options.model,
                instance_id=f"profile-t{threads}",
                threads=threads,
                batch=options.batches[0],
                cpus=list(cpus),
                socket=socket,
                graph_mode=False,
                options=dict(options.options),
            ),
            options=options,
        )


# ---------------------------------------------------------------------------
# the parent's end


class ProfilingChild:
    """One measuring process for one thread count, driven over stdin/stdout."""

    def __init__(self, options: ProfilingOptions, threads: int, cpus: tuple[int, ...], socket: int = 0) -> None:
        self.options, self.threads, self.cpus = options, threads, cpus
        self.spec = ChildSpec.for_threads(options, threads, cpus, socket)
        # The thread environment a served instance gets from the same PACKRAT_* settings.
        self.env = instance_env(threads, Settings())
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr = tempfile.TemporaryFile()
        self._buf = b""

    def start(self) -> float:
        """Start the child and wait until its model is loaded; returns seconds taken.

        Timed from the parent, so interpreter start and imports count as load cost.
        """
        started = time.perf_counter()
        # spawn() gives it its own session: Ctrl-C reaches the parent only,
        # which then stops the child; the profile is saved by the parent.
        self.proc = spawn(
            MODULE, self.spec.model_dump_json(), self.env,
            keep_stdin=True, stdout=subprocess.PIPE, stderr=self.stderr,
        )
        ready = self._read()
        if ready.get("event") != "ready":
            message = (
                f"profiling child for {self.options.model} at {self.threads} threads did not start: "
                f"{ready.get('message', '')}\n{self._stderr_tail()}"
            )
            self.close()
            raise ProfilingError(message.rstrip())
        return time.perf_counter() - started

    def measure(self, batch: int, dominated_above_ms: float | None) -> dict[str, Any]:
        """Time one batch size; the child's answer (``event`` ``result`` or ``error``)."""
        assert self.proc is not None and self.proc.stdin is not None
        request = {"batch": batch, "dominated_above_ms": dominated_above_ms}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            return {"event": "error", "message": f"child exited\n{self._stderr_tail()}"}
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + self.options.child_timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                return {"event": "error", "message": f"no answer within {self.options.child_timeout_s:g} s"}
            readable, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not readable:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.wait()
                return {"event": "error", "message": f"child exited with {code}\n{self._stderr_tail()}"}
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def _stderr_tail(self, limit: int = 2000) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-limit:]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                if proc.stdin:
                    proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.stderr.close()


# ---------------------------------------------------------------------------
# the child's end


def main(argv: list[str] | None = None) -> int:
    """Start the instance once, then answer one JSON line per requested batch size."""
    # The protocol gets the real stdout; anything a library prints goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

    def send(message: dict[str, Any]) -> None:
        proto.write(json.dumps(message) + "\n")

    try:
        spec = ChildSpec.model_validate_json(read_spec(argv))
        started = time.perf_counter()
        handler = runtime.start(spec.runtime, warm_up=False)
        eager = handler.model  # graph mode traces each batch size from these weights
        load_s = time.perf_counter() - started
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which shows it
        send({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    threads = spec.runtime.threads
    send({"event": "ready", "load_s": load_s, "pid": os.getpid(), "cpus": spec.runtime.cpus})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        b = int(request["batch"])
        try:
            send(_measure_batch(handler, eager, spec.options, threads, b, request.get("dominated_above_ms")))
        except Exception as exc:  # noqa: BLE001 - one batch size failing is data, not a crash
            send({"event": "error", "threads": threads, "batch": b, "message": f"{type(exc).__name__}: {exc}"})
    return 0


def _measure_batch(
    handler: BaseHandler, eager: Any, options: ProfilingOptions, threads: int, b: int,
    dominated_above_ms: float | None,
) -> dict[str, Any]:
    setup = time.perf_counter()
    runtime.resize(handler, eager, b, options.graph)
    items = handler.example_batch(b)
    # Once through the framework's contract check: a model that fails or
    # answers the wrong number of results must not be timed as if it worked.
    check = run_batch(handler, items)
    errors = [o.error for o in check.outcomes if not o.ok]
    if errors:
        raise RuntimeError(f"{len(errors)} of {b} example requests failed: {errors[0]}")
    setup_s = time.perf_counter() - setup
    gc.collect()
    m = measure(
        lambda: handler.handle(items),
        warmup=options.warmup,
        min_iters=options.min_iters,
        max_iters=options.max_iters,
        rel_ci=options.rel_ci,
        confidence=options.confidence,
        budget_s=options.budget_s,
        dominated_above_ms=dominated_above_ms,
    )
    return {"event": "result", "threads": threads, "batch": b, "setup_s": setup_s, **m.stats()}


if __name__ == "__main__":
    sys.exit(main())
