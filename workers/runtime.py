"""The instance runtime: how a started process becomes a ready model instance.

One function, :func:`start`, does it for a served worker and for the
profiler's child alike (pin, load the handler, size torch, initialise, warm
up), so a profile measures exactly what serving runs.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Any

from pydantic import BaseModel, Field, model_validator

from packrat_mq import graph
from packrat_mq.handler import BaseHandler, Context, load_handler, run_batch
from packrat_mq.topology import format_cpulist


class RuntimeSpec(BaseModel):
    """What one instance runs, and where: the part of a worker's spec a profiling child shares."""

    model: str
    #: Zoo name or ``module:Class``; the model name when not given.
    handler: str
    instance_id: str
    threads: int = Field(default=1, ge=1)
    batch: int = Field(default=1, ge=1)
    cpus: list[int] = Field(default_factory=list)
    socket: int = 0
    #: Pin to ``cpus``; False when they are labels of a simulated machine
    #: (``up --simulate-cores``), which this one may not have.
    pin: bool = True
    #: The graph backend (``packrat_mq.graph``); None in eager mode. ``graph`` (or True, as the
    #: boolean setting was written) is resolved to the handler's default backend.
    graph_mode: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _resolve_graph_mode(cls, data: Any) -> Any:
        if isinstance(data, dict) and "graph_mode" in data:
            data = {**data, "graph_mode": graph.backend_of(data["graph_mode"], data.get("handler"))}
        return data

    def context(self) -> Context:
        return Context(
            model_name=self.model,
            instance_id=self.instance_id,
            threads=self.threads,
            cores=tuple(self.cpus),
            batch_size=self.batch,
            graph_mode=self.graph_mode,
            options=dict(self.options),
        )


def pin(cpus: list[int]) -> None:
    """Pin every thread of this process to ``cpus`` (the one place that sets CPU affinity).

    ``sched_setaffinity(0, ...)`` moves the calling thread only; threads
    started before keep their masks. At start nothing else runs yet, but a
    spare rebound to other cores (:func:`rebind`) already has its OpenMP
    pool, torch's inter-op thread and its heartbeat: a 2-thread spare moved
    from cores 0-1 to 4-5 kept its second OpenMP thread on 0-1, beside the
    instance that now serves there. So each thread of ``/proc/self/task``
    is moved, the calling one first (a mask the process may not use fails
    there, with what it may use); a thread that ended meanwhile is passed over.
    """
    cpu_set = sorted(set(cpus))
    if not cpu_set:
        raise ValueError("pin needs at least one CPU")
    if not hasattr(os, "sched_setaffinity"):
        return
    me = threading.get_native_id()
    try:
        others = [tid for tid in map(int, os.listdir("/proc/self/task")) if tid != me]
    except OSError:
        others = []  # no /proc: the calling thread is all that can be moved
    for tid in (0, *others):
        try:
            os.sched_setaffinity(tid, cpu_set)
        except (ProcessLookupError, PermissionError):
            if tid == 0:
                raise
            # Ended since the listing (or not ours to move: never the case for our own threads).
        except OSError as exc:
            if tid != 0:
                raise
            raise OSError(
                exc.errno,
                f"cannot pin to cpus {format_cpulist(cpu_set)} (allowed: "
                f"{format_cpulist(os.sched_getaffinity(0))}): {exc.strerror}",
            ) from exc


def size_torch(threads: int) -> bool:
    """Size torch's thread pools if torch is loaded; returns whether it was.

    Never imports torch itself: ``echo``/``sleep`` instances must not pay for
    it. Safe to call again (torch lets the inter-op pool be set only once).
    """
    if "torch" not in sys.modules:
        return False
    import torch

    torch.set_num_threads(threads)
    # One inter-op thread: the instances already are the parallelism across
    # requests; a second pool would only compete for the same cores.
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set (or inter-op work already ran); torch allows it once
    return True


def start(spec: RuntimeSpec, *, warm_up: bool = True) -> BaseHandler:
    """Pin (unless ``spec.pin`` is False), load the handler, size torch, initialise and (by default) warm up one instance."""
    if spec.pin and spec.cpus:
        pin(spec.cpus)
    handler = load_handler(spec.handler)
    # A handler module that imports torch gets its pools sized before the
    # model loads; one that imports it only in load_model, right after.
    sized = size_torch(spec.threads)
    handler.initialize(spec.context())
    if not sized:
        size_torch(spec.threads)
    if warm_up:
        warm(handler, spec.batch)
    return handler


def rebind(handler: BaseHandler, spec: RuntimeSpec, *, warm_up: bool = True) -> None:
    """Move a loaded instance to ``spec``'s cores, threads and batch, without a new process.

    What a reconfiguration does with a spare instance: pin again, resize
    torch's intra-op pool (``torch.set_num_threads`` takes effect at the next
    parallel region; the inter-op pool stays at one), let the handler adapt
    (:meth:`BaseHandler.rethread`), and warm up at the new size.
    """
    if spec.pin and spec.cpus:
        pin(spec.cpus)
    size_torch(spec.threads)
    handler.rethread(spec.context())
    if warm_up:
        warm(handler, spec.batch)


def warm(handler: BaseHandler, batch: int) -> None:
    """One batch of the serving size before taking traffic (allocator, oneDNN primitives, JIT caches)."""
    try:
        items = handler.example_batch(batch)
    except NotImplementedError:
        return
    run_batch(handler, items)


def resize(handler: BaseHandler, eager: Any, batch: int, graph_mode: str | bool | None) -> None:
    """Make a loaded instance serve ``batch``: in graph mode, build ``eager`` again at that size.

    ``graph_mode`` is a mode as :func:`packrat_mq.graph.resolve` takes it
    (``eager``, a backend, ``graph`` or a boolean for the default backend).

    A served instance is traced at its own batch size; the profiler measures
    many sizes from weights loaded once, and this is how it gets each one.
    """
    assert handler.context is not None
    handler.context.batch_size = batch
    handler.context.graph_mode = graph.backend_of(graph_mode, handler.context.model_name)
    handler.model = handler.prepare(eager)
