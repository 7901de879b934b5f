"""The profiling children: the copies of one instance timed together, both ends of their protocol.

The parent (:class:`ProfilingGroup`, one :class:`ProfilingChild` per copy)
spawns ``python -m optimizer.profiling.child`` the way a worker instance is
spawned (:func:`workers.launch.spawn` with :func:`workers.launch.instance_env`,
so OpenMP/MKL size their pools before torch loads), with a :class:`ChildSpec`
as the first line of its stdin, once per copy, on the cores the scheduler
placed that copy on. Each child (:func:`main`) starts the model with
:func:`workers.runtime.start`, exactly as a served instance does (pin, load
the handler, size torch, initialise), then answers one JSON line on stdout
per JSON request line on stdin:

- ``{"op": "prepare", "batch": b}``: make the instance serve ``b`` (in a graph
  mode, build the graph again at ``b``), build ``example_batch(b)`` and run it once
  through the framework's contract check; answers ``prepared`` with the
  seconds that took.
- ``{"op": "run"}``: run ``handler.handle(items)`` once (preprocess +
  inference + postprocess, the serving path) and answer ``ran`` with the
  milliseconds it took, timed in the child.

**Lockstep.** The parent drives every copy of a point together: it sends
``prepare`` to all and waits for all, then each timed iteration is a round in
which it sends ``run`` to all and waits for all; the round's sample is the
slowest copy's own time, which is the batch latency of a configuration of
those copies. Every scheduling decision (warm-up, when to stop, dominance)
stays in the parent, which runs :func:`optimizer.profiling.statistics.measure`
over the rounds. One copy (isolated placement) is the same protocol.

**One group per thread count, not per (t, b).** What must be fresh for each
``t`` is the process: thread pools and affinity are fixed when torch starts.
Within one ``t`` a new batch size only changes input shapes, and warm-up
iterations at that size absorb the new shapes' one-off costs (oneDNN
primitives, allocator growth). Loading a model (torch import, weights, and in
graph mode a trace) costs 1-10 s (a compiling backend tens of seconds), often more than measuring one (t, b), so a
group per (t, b) would multiply the load cost by the number of batch sizes for
nothing. The children load in eager mode and, in a graph mode, build the graph
again at each ``b`` from those weights (:func:`workers.runtime.resize`),
because a served instance is built at its own batch size.
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
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from optimizer.profiling.options import ProfilingError, ProfilingOptions
from packrat_mq.handler import BaseHandler, Input, run_batch
from packrat_mq.settings import Settings
from workers import runtime
from workers.allocation import CoreAssignment
from workers.launch import instance_env, read_spec, spawn
from workers.runtime import RuntimeSpec

#: What ``python -m`` runs in the child.
MODULE = "optimizer.profiling.child"


class PointError(RuntimeError):
    """One (t, b) failed in a child (an exception, a child that died or went silent): data, not a crash."""


class ChildSpec(BaseModel):
    """What one profiling child runs: the instance (as a worker would run it) and how to measure it."""

    runtime: RuntimeSpec
    options: ProfilingOptions

    @classmethod
    def for_threads(
        cls, options: ProfilingOptions, threads: int, cpus: Sequence[int], socket: int = 0, copy: int = 0
    ) -> ChildSpec:
        """Load in eager mode at the first batch size; a graph mode builds per batch size later."""
        return cls(
            runtime=RuntimeSpec(
                model=options.model,
                handler=options.model,
                instance_id=f"profile-t{threads}-{copy}",
                threads=threads,
                batch=options.batches[0],
                cpus=list(cpus),
                socket=socket,
                graph_mode=None,
                options=dict(options.options),
            ),
            options=options,
        )


# ---------------------------------------------------------------------------
# the parent's end


class ProfilingChild:
    """One measuring process, driven over its stdin/stdout."""

    def __init__(self, options: ProfilingOptions, threads: int, cpus: Sequence[int], socket: int = 0,
                 copy: int = 0) -> None:
        self.options, self.threads, self.cpus, self.copy = options, threads, tuple(cpus), copy
        self.spec = ChildSpec.for_threads(options, threads, cpus, socket, copy)
        # The thread environment a served instance gets from the same PACKRAT_* settings.
        self.env = instance_env(threads, Settings())
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr = tempfile.TemporaryFile()
        self._buf = b""

    def spawn(self) -> None:
        """Start the child; :meth:`wait_ready` waits for its model to load."""
        # spawn() gives it its own session: Ctrl-C reaches the parent only,
        # which then stops the child; the profile is saved by the parent.
        self.proc = spawn(
            MODULE, self.spec.model_dump_json(), self.env,
            keep_stdin=True, stdout=subprocess.PIPE, stderr=self.stderr,
        )

    def wait_ready(self) -> None:
        """Wait for the child's ``ready``; ``ProfilingError`` with its output if it did not start."""
        ready = self.read()
        if ready.get("event") != "ready":
            message = (
                f"profiling child for {self.options.model} at {self.threads} threads "
                f"(cpus {','.join(map(str, self.cpus))}) did not start: "
                f"{ready.get('message', '')}\n{self.stderr_tail()}"
            )
            raise ProfilingError(message.rstrip())

    def send(self, request: dict[str, Any]) -> str | None:
        """Write one request line; the reason it could not be written, or None."""
        if self.proc is None or self.proc.stdin is None:
            return "child is not running"
        code = self.proc.poll()
        if code is not None:
            return f"child exited with {code}\n{self.stderr_tail()}"
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            return "child exited"
        return None

    def read(self) -> dict[str, Any]:
        """The child's next answer, or an ``error`` event if it exited or said nothing for ``child_timeout_s``."""
        if self.proc is None or self.proc.stdout is None:
            return {"event": "error", "message": "child is not running"}
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + self.options.child_timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                return {"event": "error", "message": f"no answer within {self.options.child_timeout_s:g} s"}
            readable, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not readable:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.wait()
                return {"event": "error", "message": f"child exited with {code}\n{self.stderr_tail()}"}
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def stderr_tail(self, limit: int = 2000) -> str:
        with contextlib.suppress(ValueError, OSError):  # closed already
            self.stderr.seek(0)
            return self.stderr.read().decode(errors="replace")[-limit:]
        return ""

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
            if proc.stdout:
                proc.stdout.close()
        self.stderr.close()


class ProfilingGroup:
    """The copies of one instance, ``(t, b)`` on each placement, started and timed together."""

    def __init__(self, options: ProfilingOptions, placements: Sequence[CoreAssignment]) -> None:
        if not placements or len({p.threads for p in placements}) != 1:
            raise ValueError("a profiling group is one or more copies of one thread count")
        self.threads = placements[0].threads
        self.children = [
            ProfilingChild(options, p.threads, p.cpus, p.socket, copy=i) for i, p in enumerate(placements)
        ]

    @property
    def cpus(self) -> list[list[int]]:
        """Each copy's CPUs, in copy order."""
        return [list(c.cpus) for c in self.children]

    def start(self) -> float:
        """Start every copy and wait until all are loaded; seconds taken (they load concurrently).

        Timed from the parent, so interpreter start and imports count as load cost.
        """
        started = time.perf_counter()
        try:
            for child in self.children:
                child.spawn()
            for child in self.children:
                child.wait_ready()
        except BaseException:
            self.kill()
            self.close()
            raise
        return time.perf_counter() - started

    def prepare(self, batch: int) -> float:
        """Make every copy serve ``batch`` (trace, example batch, contract check); the slowest one's seconds."""
        answers = self._round({"op": "prepare", "batch": batch}, "prepared")
        return max(float(a.get("setup_s", 0.0)) for a in answers)

    def run(self) -> float:
        """One timed round: every copy runs its batch once; the slowest copy's milliseconds."""
        return max(float(a["ms"]) for a in self._round({"op": "run"}, "ran"))

    def _round(self, request: dict[str, Any], expected: str) -> list[dict[str, Any]]:
        # Written to all before any answer is read, so the copies run together.
        problems = {i: child.send(request) for i, child in enumerate(self.children)}
        answers = []
        for i, child in enumerate(self.children):
            answer = {"event": "error", "message": problems[i]} if problems[i] else child.read()
            answers.append(answer)
        for child, answer in zip(self.children, answers):
            if answer.get("event") != expected:
                where = f" (copy {child.copy} of {len(self.children)})" if len(self.children) > 1 else ""
                raise PointError(f"{answer.get('message', answer)}{where}".rstrip())
        return answers

    def kill(self) -> None:
        for child in self.children:
            child.kill()

    def close(self) -> None:
        for child in self.children:
            child.close()


# ---------------------------------------------------------------------------
# the child's end


def main(argv: list[str] | None = None) -> int:
    """Start the instance once, then answer one JSON line per request (prepare a batch size, run it once)."""
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
        eager = handler.model  # a graph mode builds each batch size from these weights
        load_s = time.perf_counter() - started
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which shows it
        send({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    send({"event": "ready", "load_s": load_s, "pid": os.getpid(), "cpus": spec.runtime.cpus})
    items: list[Input] | None = None
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            if request.get("op") == "prepare":
                items = None
                b = int(request["batch"])
                setup = time.perf_counter()
                items = _prepare(handler, eager, spec.options, b)
                send({"event": "prepared", "batch": b, "setup_s": time.perf_counter() - setup})
            elif request.get("op") == "run":
                if items is None:
                    raise RuntimeError("run before a batch size was prepared")
                t0 = time.perf_counter()
                handler.handle(items)
                send({"event": "ran", "ms": (time.perf_counter() - t0) * 1000.0})
            else:
                raise ValueError(f"unknown request {request!r}")
        except Exception as exc:  # noqa: BLE001 - one batch size failing is data, not a crash
            send({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
    return 0


def _prepare(handler: BaseHandler, eager: Any, options: ProfilingOptions, b: int) -> list[Input]:
    runtime.resize(handler, eager, b, options.graph)
    items = handler.example_batch(b)
    # Once through the framework's contract check: a model that fails or
    # answers the wrong number of results must not be timed as if it worked.
    check = run_batch(handler, items)
    errors = [o.error for o in check.outcomes if not o.ok]
    if errors:
        raise RuntimeError(f"{len(errors)} of {b} example requests failed: {errors[0]}")
    gc.collect()
    return items


if __name__ == "__main__":
    sys.exit(main())
