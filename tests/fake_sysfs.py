"""A fake Linux sysfs ``cpu/`` (and ``node/``) tree for topology and allocation tests."""
from __future__ import annotations

from pathlib import Path

from packrat_mq.topology import format_cpulist


def make_sysfs(
    root: Path, sockets: int = 2, cores: int = 8, threads: int = 2, numa: bool = True
) -> Path:
    """Write a Linux-style ``cpu/`` tree: primaries first, then their HT siblings."""
    cpu_root = root / "cpu"
    total = sockets * cores
    for s in range(sockets):
        for c in range(cores):
            siblings = [s * cores + c + k * total for k in range(threads)]
            for cpu in siblings:
                topo = cpu_root / f"cpu{cpu}" / "topology"
                topo.mkdir(parents=True)
                (topo / "physical_package_id").write_text(f"{s}\n")
                (topo / "core_id").write_text(f"{c}\n")
                (topo / "thread_siblings_list").write_text(format_cpulist(siblings) + "\n")
        if numa:
            node = root / "node" / f"node{s}"
            node.mkdir(parents=True)
            cpus = [s * cores + c + k * total for c in range(cores) for k in range(threads)]
            (node / "cpulist").write_text(format_cpulist(cpus) + "\n")
    return cpu_root
