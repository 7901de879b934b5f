"""Topology read from fake sysfs trees: sockets, hyper-threads, cpusets, no sysfs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fake_sysfs import make_sysfs
from packrat_mq.topology import Topology, format_cpulist, parse_cpulist


def test_cpulist_round_trip() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []
    assert parse_cpulist("0-6:2") == [0, 2, 4, 6]
    assert format_cpulist([3, 1, 2, 8, 10, 11]) == "1-3,8,10-11"


def test_two_sockets_with_hyperthreads(tmp_path: Path) -> None:
    root = make_sysfs(tmp_path)
    topo = Topology.from_sysfs(root, allowed=range(32))
    assert topo.source == "sysfs"
    assert [s.id for s in topo.sockets] == [0, 1]
    assert topo.physical_cores == 16 and topo.logical_cpus == 32
    assert topo.max_cores_per_socket == 8
    s0, s1 = topo.sockets
    assert [c.core_id for c in s0.cores] == list(range(8))
    assert s0.cores[0].cpus == (0, 16)  # primary thread first, then its sibling
    assert [c.cpu for c in s1.cores] == list(range(8, 16))
    assert s0.nodes == (0,) and s1.nodes == (1,)
    text = topo.describe()
    assert "16 physical cores" in text and "hyper-thread siblings 16-23" in text
    assert "NUMA node 1" in text
    data = json.loads(json.dumps(topo.as_dict()))
    assert data["physical_cores"] == 16 and len(data["sockets"][1]["cores"]) == 8


def test_restricted_cpuset_keeps_usable_cores_only(tmp_path: Path) -> None:
    root = make_sysfs(tmp_path)
    # A container given cpus 2-5 of socket 0 and only the HT siblings 26-27 of socket 1.
    topo = Topology.from_sysfs(root, allowed=[2, 3, 4, 5, 26, 27])
    assert topo.physical_cores == 6
    s0, s1 = topo.sockets
    assert [c.core_id for c in s0.cores] == [2, 3, 4, 5]
    assert [c.cpus for c in s0.cores] == [(2,), (3,), (4,), (5,)]  # siblings 18-21 not allowed
    # A core counts when any of its threads is allowed; it is pinned on that thread.
    assert [(c.core_id, c.cpu) for c in s1.cores] == [(2, 26), (3, 27)]
    assert s1.cores[0].siblings == (10, 26)
    assert "6 physical cores (cpus 2-5,26-27) on 2 sockets" in topo.describe()


def test_one_socket_without_hyperthreads_or_numa(tmp_path: Path) -> None:
    root = make_sysfs(tmp_path, sockets=1, cores=4, threads=1, numa=False)
    topo = Topology.from_sysfs(root, allowed=range(4))
    assert topo.physical_cores == 4 and topo.logical_cpus == 4
    assert topo.sockets[0].nodes == ()
    assert "hyper-thread" not in topo.describe()


def test_missing_sysfs_falls_back_to_one_socket(tmp_path: Path) -> None:
    topo = Topology.from_sysfs(tmp_path / "nothing", allowed=[0, 1, 5])
    assert topo.source == "fallback"
    assert len(topo.sockets) == 1
    assert [c.cpu for c in topo.cores] == [0, 1, 5]
    assert "fallback" in topo.describe()


def test_allowed_cpu_without_topology_is_its_own_core(tmp_path: Path) -> None:
    root = make_sysfs(tmp_path, sockets=1, cores=2, threads=1, numa=False)
    topo = Topology.from_sysfs(root, allowed=[0, 1, 7])
    assert topo.physical_cores == 3
    assert any("cpus 7" in n for n in topo.notes)


def test_detect_on_this_machine() -> None:
    topo = Topology.detect()
    assert topo.physical_cores >= 1
    assert {c.cpu for c in topo.cores} <= set(topo.allowed)


def test_no_allowed_cpus_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        Topology.from_sysfs(make_sysfs(tmp_path), allowed=[])
