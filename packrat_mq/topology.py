"""The CPU topology this process may use: sockets -> physical cores -> logical CPUs.

Packrat's premise is that ``t`` intra-op threads run on ``t`` *physical*
cores of *one* socket: two threads on hyper-thread siblings share one core's
execution units, and a thread on the other socket reaches its memory over the
interconnect. So instances are placed on physical cores, not on "CPUs".

The topology is read from sysfs (``cpuN/topology/{physical_package_id,
core_id,thread_siblings_list}`` and ``node/nodeN/cpulist`` for NUMA) and
restricted to the process's allowed cpuset (``os.sched_getaffinity(0)``),
which is what ``taskset``, ``numactl`` and container cpusets change. A
physical core is usable when at least one of its logical CPUs is allowed;
only allowed CPUs are kept in it.

Without sysfs (non-Linux, some sandboxes) the fallback is one socket in which
every allowed CPU is its own core: hyper-thread siblings cannot be told apart
then, and :meth:`Topology.describe` says so.

:meth:`Topology.synthetic` is a machine that is not there: one socket of N
cores whose CPU ids are labels only (``up --simulate-cores N``), for running
the planning and reconfiguration logic at a scale this machine lacks, with
models that only sleep. Nothing is pinned to it (:attr:`Topology.simulated`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

DEFAULT_SYSFS_CPU = "/sys/devices/system/cpu"


def parse_cpulist(text: str) -> list[int]:
    """Parse a kernel cpu list such as ``"0-3,8,10-11"`` (empty -> ``[]``).

    >>> parse_cpulist("0-2,8")
    [0, 1, 2, 8]
    """
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if sep:
            step = 1
            if ":" in hi:  # "0-15:2" (stride form, rare but valid)
                hi, _, s = hi.partition(":")
                step = int(s.split("/")[0])
            cpus.extend(range(int(lo), int(hi) + 1, step))
        else:
            cpus.append(int(lo))
    return sorted(set(cpus))


def format_cpulist(cpus: Iterable[int]) -> str:
    """Format CPU ids as a kernel cpu list, the inverse of :func:`parse_cpulist`.

    >>> format_cpulist([0, 1, 2, 8, 10, 11])
    '0-2,8,10-11'
    """
    ids = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def allowed_cpus() -> frozenset[int]:
    """Logical CPUs this process may run on (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class Core:
    """One physical core: its allowed logical CPUs, first sibling first."""

    socket: int
    core_id: int
    cpus: tuple[int, ...]
    #: All hyper-thread siblings, allowed or not (shows when a cpuset halves a core).
    siblings: tuple[int, ...] = ()
    node: int | None = None

    @property
    def cpu(self) -> int:
        """The logical CPU an instance thread is pinned to on this core."""
        return self.cpus[0]


@dataclass(frozen=True)
class Socket:
    """One package with its usable physical cores, in order."""

    id: int
    cores: tuple[Core, ...]

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted({c.node for c in self.cores if c.node is not None}))

    @property
    def cpus(self) -> tuple[int, ...]:
        return tuple(sorted(cpu for c in self.cores for cpu in c.cpus))


@dataclass(frozen=True)
class Topology:
    """Sockets and physical cores this process may use.

    ``source`` is ``"sysfs"``, ``"fallback"`` or ``"synthetic"``; ``cpu_quota`` is the cgroup
    CPU bandwidth limit in cores (``cpu.max``), which a cpuset does not show:
    a container may see 16 CPUs and be allowed the time of 4.
    """

    sockets: tuple[Socket, ...]
    allowed: frozenset[int]
    source: str = "sysfs"
    cpu_quota: float | None = None
    notes: tuple[str, ...] = field(default=())

    # --- construction -------------------------------------------------
    @classmethod
    def detect(cls) -> Topology:
        """The topology of this machine, restricted to this process's cpuset."""
        return cls.from_sysfs()

    @classmethod
    def from_sysfs(
        cls,
        root: str | os.PathLike[str] = DEFAULT_SYSFS_CPU,
        allowed: Iterable[int] | None = None,
        *,
        node_root: str | os.PathLike[str] | None = None,
    ) -> Topology:
        """Read ``root`` (a ``/sys/devices/system/cpu`` tree; tests pass a fake one).

        ``allowed`` defaults to the process's affinity mask. NUMA nodes are
        read from ``node_root`` (default: ``<root>/../node``) when present.
        """
        allowed_set = frozenset(allowed) if allowed is not None else allowed_cpus()
        if not allowed_set:
            raise ValueError("no CPUs are allowed")
        cpu_root = Path(root)
        node_dir = Path(node_root) if node_root is not None else cpu_root.parent / "node"
        quota = _cgroup_cpu_quota() if str(cpu_root) == DEFAULT_SYSFS_CPU else None

        info: dict[int, tuple[int, int, tuple[int, ...]]] = {}
        missing: list[int] = []
        for cpu in sorted(allowed_set):
            topo = cpu_root / f"cpu{cpu}" / "topology"
            try:
                package = int((topo / "physical_package_id").read_text())
                core_id = int((topo / "core_id").read_text())
                siblings = tuple(parse_cpulist((topo / "thread_siblings_list").read_text()))
            except (OSError, ValueError):
                missing.append(cpu)
                continue
            info[cpu] = (package, core_id, siblings or (cpu,))
        if not info:
            return cls._fallback(allowed_set, quota, f"no CPU topology under {cpu_root}")

        nodes = _read_nodes(node_dir)
        notes: list[str] = []
        if missing:
            # A CPU we may use but cannot place: give it a core of its own on
            # socket 0 rather than lose it or guess its siblings.
            notes.append(f"no topology for cpus {format_cpulist(missing)}; each counted as its own core")
            for cpu in missing:
                info[cpu] = (0, -1 - cpu, (cpu,))

        # Group by sibling set, not by (package, core_id): core_id repeats
        # across dies of one package on some parts, a sibling set never does.
        by_core: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        core_ids: dict[tuple[int, tuple[int, ...]], int] = {}
        for cpu, (package, core_id, siblings) in info.items():
            key = (package, siblings)
            by_core.setdefault(key, []).append(cpu)
            core_ids[key] = core_id
        sockets: dict[int, list[Core]] = {}
        for (package, siblings), cpus in by_core.items():
            # Keep the kernel's sibling order: the first allowed sibling is
            # the "primary" thread, the one a single-thread-per-core pin uses.
            ordered = tuple(c for c in siblings if c in cpus) + tuple(sorted(set(cpus) - set(siblings)))
            sockets.setdefault(package, []).append(
                Core(
                    socket=package,
                    core_id=core_ids[(package, siblings)],
                    cpus=ordered,
                    siblings=siblings,
                    node=nodes.get(ordered[0]),
                )
            )
        # Cores in order of their lowest sibling: that is the kernel's
        # enumeration, and "consecutive cores" then means neighbours on a die.
        built = tuple(
            Socket(id=package, cores=tuple(sorted(cores, key=lambda c: (min(c.siblings), c.core_id))))
            for package, cores in sorted(sockets.items())
        )
        return cls(sockets=built, allowed=allowed_set, source="sysfs", cpu_quota=quota, notes=tuple(notes))

    @classmethod
    def _fallback(cls, allowed: frozenset[int], quota: float | None, why: str) -> Topology:
        notes = [f"{why}: one socket, every allowed CPU counted as a physical core"]
        try:
            import psutil

            physical = psutil.cpu_count(logical=False)
            logical = psutil.cpu_count(logical=True)
            if physical and logical and physical < logical:
                notes.append(
                    f"psutil reports {physical} physical cores for {logical} logical CPUs: "
                    f"hyper-thread siblings may share a core; use at most {physical} threads in total"
                )
        except Exception:  # noqa: BLE001 - psutil is advice only here
            pass
        cores = tuple(Core(socket=0, core_id=cpu, cpus=(cpu,), siblings=(cpu,)) for cpu in sorted(allowed))
        return cls(
            sockets=(Socket(id=0, cores=cores),),
            allowed=allowed,
            source="fallback",
            cpu_quota=quota,
            notes=tuple(notes),
        )

    @classmethod
    def synthetic(cls, cores: int) -> Topology:
        """A simulated machine: one socket of ``cores`` physical cores, cpus ``0..cores-1``.

        Its CPU ids are labels for allocation and ``status``, not CPUs of this
        machine: an instance placed on it must not be pinned (see
        :attr:`simulated`), and only models that sleep instead of computing
        (``echo``, ``sleep``, ``profiled``) make sense on it.
        """
        if cores < 1:
            raise ValueError(f"a synthetic topology needs at least one core, got {cores}")
        built = tuple(Core(socket=0, core_id=cpu, cpus=(cpu,), siblings=(cpu,)) for cpu in range(cores))
        return cls(
            sockets=(Socket(id=0, cores=built),),
            allowed=frozenset(range(cores)),
            source="synthetic",
            notes=(f"simulated: {cores} cores of one socket; cpus are labels, no instance is pinned",),
        )

    # --- queries ------------------------------------------------------
    @property
    def simulated(self) -> bool:
        """Whether this is a :meth:`synthetic` machine, whose cpus must not be pinned to."""
        return self.source == "synthetic"

    @property
    def cores(self) -> tuple[Core, ...]:
        return tuple(c for s in self.sockets for c in s.cores)

    @property
    def physical_cores(self) -> int:
        return sum(len(s.cores) for s in self.sockets)

    @property
    def logical_cpus(self) -> int:
        return sum(len(c.cpus) for c in self.cores)

    @property
    def max_cores_per_socket(self) -> int:
        """The most threads one instance can get (instances stay on one socket)."""
        return max((len(s.cores) for s in self.sockets), default=0)

    def without(self, cpus: Iterable[int]) -> Topology:
        """This topology less the cores whose CPU is in ``cpus`` (cores other instances hold)."""
        taken = set(cpus)
        sockets = tuple(Socket(id=s.id, cores=tuple(c for c in s.cores if c.cpu not in taken)) for s in self.sockets)
        return replace(self, sockets=sockets, allowed=frozenset(self.allowed - taken))

    def socket(self, socket_id: int) -> Socket:
        for s in self.sockets:
            if s.id == socket_id:
                return s
        raise KeyError(f"no usable socket {socket_id}")

    def summary(self) -> str:
        """One line: ``6 physical cores (cpus 0-5) on 1 socket``."""
        n = len(self.sockets)
        return (
            f"{self.physical_cores} physical core{'s' * (self.physical_cores != 1)} "
            f"(cpus {format_cpulist(self.allowed)}) on {n} socket{'s' * (n != 1)}"
        )

    def describe(self) -> str:
        """A few lines for ``packrat-mq topology`` and error messages."""
        lines = [
            f"{self.summary()}, {self.logical_cpus} logical CPUs allowed [{self.source}]",
        ]
        for s in self.sockets:
            numa = f", NUMA node{'s' * (len(s.nodes) > 1)} {format_cpulist(s.nodes)}" if s.nodes else ""
            primary = [c.cpu for c in s.cores]
            extra = [cpu for c in s.cores for cpu in c.cpus[1:]]
            ht = f" (+ hyper-thread siblings {format_cpulist(extra)})" if extra else ""
            lines.append(
                f"  socket {s.id}{numa}: {len(s.cores)} physical cores, cpus {format_cpulist(primary)}{ht}"
            )
        if self.cpu_quota is not None and self.cpu_quota < self.physical_cores:
            lines.append(
                f"  note: the cgroup CPU quota is {self.cpu_quota:g} cores, fewer than the "
                f"{self.physical_cores} allowed; instances will be throttled beyond it"
            )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form for ``--json``."""
        return {
            "source": self.source,
            "allowed_cpus": sorted(self.allowed),
            "physical_cores": self.physical_cores,
            "logical_cpus": self.logical_cpus,
            "cpu_quota": self.cpu_quota,
            "notes": list(self.notes),
            "sockets": [
                {
                    "id": s.id,
                    "numa_nodes": list(s.nodes),
                    "cores": [
                        {"core_id": c.core_id, "cpus": list(c.cpus), "siblings": list(c.siblings), "node": c.node}
                        for c in s.cores
                    ],
                }
                for s in self.sockets
            ],
        }


def _read_nodes(node_dir: Path) -> dict[int, int]:
    """Map logical CPU -> NUMA node from ``nodeN/cpulist`` (empty if absent)."""
    mapping: dict[int, int] = {}
    try:
        entries = list(node_dir.glob("node[0-9]*"))
    except OSError:
        return mapping
    for entry in entries:
        try:
            node = int(entry.name[4:])
            cpus = parse_cpulist((entry / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        for cpu in cpus:
            mapping[cpu] = node
    return mapping


def _cgroup_cpu_quota(path: str = "/sys/fs/cgroup/cpu.max") -> float | None:
    """CPU bandwidth limit in cores from cgroup v2 ``cpu.max`` (None: unlimited/unknown)."""
    try:
        fields = Path(path).read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        return int(fields[0]) / int(fields[1])
    except (ValueError, ZeroDivisionError):
        return None
