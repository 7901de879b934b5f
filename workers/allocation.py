"""Which physical cores each instance of a configuration runs on.

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

The supervisor allocates; the instance pins itself to what it was given
(:mod:`workers.runtime`), unless the topology is a simulated one
(:meth:`packrat_mq.topology.Topology.synthetic`), whose cpus are labels only.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

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
    #: False on a simulated topology: ``cpus`` are labels, and the instance is not pinned to them.
    pin: bool = True

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
            pin=not topology.simulated,
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
