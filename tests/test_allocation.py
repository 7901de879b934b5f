"""Allocation of configurations to physical cores, thread environment and pinning."""
from __future__ import annotations

from pathlib import Path

import pytest

from packrat_mq.instances import Configuration
from workers.allocation import AllocationError, allocate
from tests.fake_sysfs import make_sysfs
from packrat_mq.topology import Topology


@pytest.fixture
def big(tmp_path: Path) -> Topology:
    """2 sockets x 8 cores x 2 hyper-threads, all allowed."""
    return Topology.from_sysfs(make_sysfs(tmp_path), allowed=range(32))


def test_one_logical_cpu_per_physical_core(big: Topology) -> None:
    (a,) = allocate(big, Configuration.parse("4x8"))
    assert a.instance == 0 and a.socket == 0 and a.threads == 4 and a.batch == 8
    assert a.cores == (0, 1, 2, 3)
    assert a.cpus == (0, 1, 2, 3)  # never a sibling (16-19)


def test_heterogeneous_largest_first_keeps_order(big: Topology) -> None:
    config = Configuration.parse("2x4,4x8,2x4")
    out = allocate(big, config)
    assert [a.instance for a in out] == [0, 1, 2]
    assert [str(a.spec) for a in out] == ["2x4", "4x8", "2x4"]
    # The 4-thread instance is placed first, then the two 2-thread ones behind it.
    assert out[1].cpus == (0, 1, 2, 3)
    assert out[0].cpus == (4, 5)
    assert out[2].cpus == (6, 7)
    used = [c for a in out for c in a.cpus]
    assert len(used) == len(set(used))


def test_spill_to_second_socket_whole_instances_only(big: Topology) -> None:
    out = allocate(big, Configuration.parse("6x8,2x4,6x8"))
    by_instance = {a.instance: a for a in out}
    assert by_instance[0].socket == 0 and by_instance[0].cpus == tuple(range(0, 6))
    assert by_instance[2].socket == 1 and by_instance[2].cpus == tuple(range(8, 14))
    assert by_instance[1].socket == 0 and by_instance[1].cpus == (6, 7)
    # 16 cores are allowed, but 4 does not fit in either socket's 2 left over:
    # refused, never split across sockets.
    with pytest.raises(AllocationError, match="cannot be split over the sockets"):
        allocate(big, Configuration.parse("6x8,6x8,4x4"))


def test_first_fit_decreasing_beats_configuration_order(big: Topology) -> None:
    # In configuration order 3,3 would go to socket 0 and strand 2+8; FFD fits all.
    out = allocate(big, Configuration.parse("3x1,3x1,5x1,5x1"))
    assert sorted(a.socket for a in out) == [0, 0, 1, 1]


def test_exact_search_when_first_fit_fails(tmp_path: Path) -> None:
    # Two sockets of 10: first-fit decreasing puts 5,4 | 3,3,3 and has no room
    # for the 2; 5,3,2 | 4,3,3 fits, and the exact search finds it.
    topo = Topology.from_sysfs(make_sysfs(tmp_path, sockets=2, cores=10, threads=1), allowed=range(20))
    out = allocate(topo, Configuration.parse("5x1,4x1,3x1,3x1,3x1,2x1"))
    for s in topo.sockets:
        assert sum(a.threads for a in out if a.socket == s.id) == 10
    used = [c for a in out for c in a.cpus]
    assert sorted(used) == list(range(20))


def test_refuses_too_many_cores(tmp_path: Path) -> None:
    topo = Topology.from_sysfs(make_sysfs(tmp_path, sockets=1, cores=6, threads=1), allowed=range(6))
    with pytest.raises(AllocationError) as err:
        allocate(topo, Configuration.parse("4x8,4x8"))
    assert str(err.value) == (
        "configuration 4x8,4x8 needs 8 physical cores; this process may use 6 (cpus 0-5) on 1 socket"
    )


def test_refuses_instance_larger_than_any_socket(big: Topology) -> None:
    with pytest.raises(AllocationError, match=r"instance 1 \(12x4\).*largest socket .* has 8"):
        allocate(big, Configuration.parse("2x2,12x4"))


def test_hyperthreads_do_not_count_as_cores(big: Topology) -> None:
    with pytest.raises(AllocationError, match="needs 17 physical cores; this process may use 16"):
        allocate(big, Configuration.parse("8x1,8x1,1x1"))


def test_restricted_cpuset(tmp_path: Path) -> None:
    topo = Topology.from_sysfs(make_sysfs(tmp_path), allowed=[4, 5, 6, 7, 21, 22, 23])
    # Socket 0 has cores 4-7 (cpus 4-7, siblings 20-23 partly allowed); socket 1 none.
    (a,) = allocate(topo, Configuration.parse("4x2"))
    assert a.cpus == (4, 5, 6, 7) and a.cores == (4, 5, 6, 7)
    with pytest.raises(AllocationError, match=r"may use 4 \(cpus 4-7,21-23\) on 1 socket"):
        allocate(topo, Configuration.parse("5x2"))


