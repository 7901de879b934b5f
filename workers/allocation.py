"""Which physical cores each instance of a configuration runs on, and how it pins itself.

Every instance gets ``t`` whole, consecutive physical cores of *one* socket
(its threads then share that socket's caches and memory controller, and two
instances never share a core), and one thread per core: it is pinned to the
first allowed hyper-thread sibling of each core, so ``t`` threads get ``t``
physical cores. Instances of one configuration may sit on different sockets.

Placement is first-fit decreasing (largest instance first, into the first
socket with room), which avoids leaving each socket a few cores short of a
large instance. When that heuristic fails although the cores would suffice, a
small exact search over socket capacities decides, so an allocation error
always means the configuration really does not fit.

Threads are set by the parent, before torch is imported: the parent puts
:func:`thread_env` into the child's environment (OpenMP/MKL read it once, at
load), and the child calls :func:`pin_current_process` before loading a model.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable

from packrat_mq.instances import Configuration, InstanceSpec
from packrat_mq.topology import Topology, format_cpulist


class AllocationError(ValueError):
    """A configuration that cannot be placed on the cores this process may use."""


@dataclass(frozen=True)
class CoreAssignment:
    """Where instance ``instance`` (its index in the configuration) runs."""

    instance: int
    spec: InstanceSpec
    socket: int
    #: sysfs ``core_id`` of each physical core, in order.
    cores: tuple[int, ...]
    #: The logical CPU to pin on each core (one per core).
    cpus: tuple[int, ...]
    node: int | None = None

    @property
    def threads(self) -> int:
        return self.spec.threads

    @property
    def batch(self) -> int:
        return self.spec.batch

    def __str__(self) -> str:
        return f"instance {self.instance} ({self.spec}): socket {self.socket}, cpus {format_cpulist(self.cpus)}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "threads": self.spec.threads,
            "batch": self.spec.batch,
            "socket": self.socket,
            "cores": list(self.cores),
            "cpus": list(self.cpus),
            "node": self.node,
        }


def allocate(topology: Topology, configuration: Configuration) -> list[CoreAssignment]:
    """Place every instance of ``configuration``; one assignment per instance, in order.

    Raises :class:`AllocationError` when the configuration needs more physical
    cores than this process may use, or an instance more than any one socket has.
    """
    sizes = [spec.threads for spec in configuration.instances]
    capacity = [len(s.cores) for s in topology.sockets]
    need, have = sum(sizes), sum(capacity)
    if need > have:
        raise AllocationError(
            f"configuration {configuration} needs {need} physical cores; "
            f"this process may use {have} (cpus {format_cpulist(topology.allowed)}) "
            f"on {len(topology.sockets)} socket{'s' * (len(topology.sockets) != 1)}"
        )
    largest = max(capacity, default=0)
    for index, spec in enumerate(configuration.instances):
        if spec.threads > largest:
            raise AllocationError(
                f"instance {index} ({spec}) of configuration {configuration} needs {spec.threads} "
                f"physical cores on one socket; the largest socket this process may use has {largest} "
                f"({_sockets_text(topology)})"
            )

    placement = _first_fit_decreasing(sizes, capacity)
    if placement is None:
        placement = _exact(sizes, capacity)
    if placement is None:
        raise AllocationError(
            f"configuration {configuration} needs {need} physical cores and {have} are allowed, "
            f"but its instances cannot be split over the sockets without crossing one "
            f"({_sockets_text(topology)})"
        )

    # Hand out consecutive cores per socket, largest instance first, so the
    # cores a socket has left stay one consecutive run.
    next_core = [0] * len(topology.sockets)
    result: list[CoreAssignment | None] = [None] * len(sizes)
    for index in _decreasing(sizes):
        s = placement[index]
        socket = topology.sockets[s]
        cores = socket.cores[next_core[s] : next_core[s] + sizes[index]]
        next_core[s] += sizes[index]
        result[index] = CoreAssignment(
            instance=index,
            spec=configuration.instances[index],
            socket=socket.id,
            cores=tuple(c.core_id for c in cores),
            cpus=tuple(c.cpu for c in cores),
            node=cores[0].node,
        )
    return [a for a in result if a is not None]


def _decreasing(sizes: list[int]) -> list[int]:
    """Instance indexes, largest first, configuration order among equals."""
    return sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))


def _first_fit_decreasing(sizes: list[int], capacity: list[int]) -> list[int] | None:
    free = list(capacity)
    placement = [0] * len(sizes)
    for index in _decreasing(sizes):
        for s, room in enumerate(free):
            if room >= sizes[index]:
                free[s] -= sizes[index]
                placement[index] = s
                break
        else:
            return None
    return placement


def _exact(sizes: list[int], capacity: list[int]) -> list[int] | None:
    """Exact bin packing by search over remaining capacities (few sockets, memoised)."""
    order = _decreasing(sizes)
    ordered = tuple(sizes[i] for i in order)

    @lru_cache(maxsize=None)
    def solve(k: int, free: tuple[int, ...]) -> tuple[int, ...] | None:
        if k == len(ordered):
            return ()
        tried: set[int] = set()
        for s, room in enumerate(free):
            # Two sockets with the same room left are interchangeable.
            if room < ordered[k] or room in tried:
                continue
            tried.add(room)
            rest = solve(k + 1, free[:s] + (room - ordered[k],) + free[s + 1 :])
            if rest is not None:
                return (s,) + rest
        return None

    found = solve(0, tuple(capacity))
    if found is None:
        return None
    placement = [0] * len(sizes)
    for index, s in zip(order, found):
        placement[index] = s
    return placement


def _sockets_text(topology: Topology) -> str:
    return "; ".join(
        f"socket {s.id}: {len(s.cores)} cores, cpus {format_cpulist(c.cpu for c in s.cores)}"
        for s in topology.sockets
    )


#: Environment variables that size the thread pools of the libraries torch
#: and tokenizers load. They are read once, when the library initialises, so
#: they must be in the child's environment before it imports torch.
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "RAYON_NUM_THREADS",
)


def thread_env(threads: int) -> dict[str, str]:
    """Environment a parent gives a child that will run ``threads`` intra-op threads."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    env = {name: str(threads) for name in THREAD_ENV_VARS}
    # Spin-waiting OpenMP threads burn the cores of the instance next door
    # between batches; passive waiting costs microseconds per batch.
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def pin_current_process(
    cpus: Iterable[int], threads: int, *, configure_torch: bool | None = None
) -> dict[str, Any]:
    """Pin this process to ``cpus`` and size torch's thread pools; the child calls it first.

    ``configure_torch``: ``True`` imports torch and sets its threads, ``False``
    leaves torch alone (``echo``/``sleep`` workers should not pay for the
    import), ``None`` (default) does it when torch is installed. Returns what
    was done, for logs.
    """
    cpu_set = sorted(set(cpus))
    if not cpu_set:
        raise ValueError("pin_current_process needs at least one CPU")
    done: dict[str, Any] = {"cpus": cpu_set, "threads": threads, "pinned": False, "torch": False}
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpu_set)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot pin to cpus {format_cpulist(cpu_set)} (allowed: "
                f"{format_cpulist(os.sched_getaffinity(0))}): {exc.strerror}",
            ) from exc
        done["pinned"] = True
    if configure_torch is None:
        configure_torch = "torch" in sys.modules or importlib.util.find_spec("torch") is not None
    if configure_torch:
        import torch

        torch.set_num_threads(threads)
        # One inter-op thread: the instances already are the parallelism
        # across requests; a second pool would only compete for the same cores.
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            # Already set, or inter-op work already ran in this process;
            # torch allows setting it once.
            done["interop_unchanged"] = True
        done["torch"] = True
    return done
