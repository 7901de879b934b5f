"""Every ``packrat-mq`` command, run for real, fails in one line and leaves nothing behind; and stops clean.

Each command runs as a subprocess (``python -m packrat_mq``) with bad
arguments, a bad model, an unreachable Redis, a Redis that refuses the
password, a missing profile, a configuration larger than the machine: the
exit code is non-zero, stderr is one clear line, there is no traceback, and
no process it started outlives it (see :mod:`tests.cli_run` for how only
this run's processes are looked at). Commands that would serve fail before
they start anything, so the whole table runs in well under a minute.

Then the ways out of a command that did start things: ``up`` stopped by
Ctrl-C and by SIGTERM once serving and while starting, ``up`` whose second
instance fails to load, ``pool`` and ``node`` stopped by SIGTERM, the
profiler stopped by SIGTERM, and the demo (``make demo``) run to its end and
stopped midway.
"""
from __future__ import annotations

import concurrent.futures
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from packrat_mq.cli import main
from packrat_mq.connection import connect
from tests.cli_run import PasswordServer, Run, Started, assert_one_line_failure, run_cli
from tests.conftest import delete_prefixed
from tests.cli_run import password_server  # noqa: F401 - a fixture of these tests
from tests.helpers import wait_for

UNREACHABLE = "redis://127.0.0.1:1/0"
WRONG = "wrong-pass-77"
MISSING = "/nonexistent/packrat-smoke/missing.json"
CANNOT_REACH = f"cannot reach Redis at {UNREACHABLE}: Connection refused"
REFUSED = "Redis refused the password for redis://:***@127.0.0.1:"

# Placeholders in the argument lists below, filled in per test run.
REDIS, PREFIX, REFUSING, PROFILE = "{redis}", "{prefix}", "{refusing}", "{profile}"

#: command -> kind of failure -> (arguments, what the one line says)
CASES: dict[str, dict[str, tuple[list[str], str]]] = {
    "up": {
        "bad arguments": (["up"], "Missing option '--model'"),
        "bad model": (["up", "-m", "nosuch"], "unknown model 'nosuch'"),
        "unreachable": (["up", "-m", "echo", "--redis-url", UNREACHABLE], CANNOT_REACH),
        "refused": (["up", "-m", "echo", "--redis-url", REFUSING], REFUSED),
        "missing profile": (["up", "-m", "echo", "--profile", MISSING], "no profile file at " + MISSING),
        "too many cores": (["up", "-m", "echo", "-i", "64x1"], "needs 64 physical cores"),
    },
    "pool": {
        "bad arguments": (["pool", "-m", "echo", "-t", "0"], "--threads"),
        "bad model": (["pool", "-m", "os:path", "--redis-url", REDIS, "--prefix", PREFIX],
                      "os:path is not a packrat_mq.handler.BaseHandler subclass"),
        "unreachable": (["pool", "-m", "echo", "--redis-url", UNREACHABLE], CANNOT_REACH),
        "refused": (["pool", "-m", "echo", "--redis-url", REFUSING], REFUSED),
        "missing profile": (["pool", "-m", "echo", "-i", "1x1", "--profile", MISSING, "--redis-url", REDIS,
                             "--prefix", PREFIX], "no profile"),
        "too many cores": (["pool", "-m", "echo", "-t", "64", "--redis-url", REDIS, "--prefix", PREFIX],
                           "--threads 64: this process may use"),
    },
    "dispatch": {
        "bad arguments": (["dispatch"], "Missing option '--model'"),
        "bad model": (["dispatch", "-m", "bad name", "--redis-url", REDIS], "model name 'bad name'"),
        "unreachable": (["dispatch", "-m", "echo", "--redis-url", UNREACHABLE], CANNOT_REACH),
        "refused": (["dispatch", "-m", "echo", "--redis-url", REFUSING], REFUSED),
        "missing profile": (["dispatch", "-m", "echo", "--profile", MISSING, "--redis-url", REDIS],
                            "no profile at " + MISSING),
    },
    "submit": {
        "bad arguments": (["submit", "-m", "echo"], "give exactly one of --data, --text, --file"),
        "bad model": (["submit", "-m", "nosuch", "-d", "{}", "--redis-url", REDIS, "--prefix", PREFIX],
                      "model 'nosuch' is not served here"),
        "unreachable": (["submit", "-m", "echo", "-d", "{}", "--redis-url", UNREACHABLE], CANNOT_REACH),
        "refused": (["submit", "-m", "echo", "-d", "{}", "--redis-url", REFUSING], REFUSED),
    },
    "status": {
        "bad arguments": (["status", "--watch", "often"], "--watch"),
        "unreachable": (["status", "--redis-url", UNREACHABLE], CANNOT_REACH),
        "refused": (["status", "--redis-url", REFUSING], REFUSED),
    },
    "reconfigure": {
        "bad arguments": (["reconfigure", "echo"], "give exactly one of --batch and --instances"),
        "bad model": (["reconfigure", "nosuch", "-b", "2", "--redis-url", REDIS, "--prefix", PREFIX],
                      "no live supervisor serves 'nosuch'"),
        "unreachable": (["reconfigure", "echo", "-b", "2", "--redis-url", UNREACHABLE], CANNOT_REACH),
        "refused": (["reconfigure", "echo", "-b", "2", "--redis-url", REFUSING], REFUSED),
    },
    "models": {
        "bad arguments": (["models", "--bogus"], "No such option '--bogus'"),
        "unreachable": (["models", "--redis-url", UNREACHABLE], CANNOT_REACH),
        "refused": (["models", "--redis-url", REFUSING], REFUSED),
    },
    "models register": {
        "bad arguments": (["models", "register", "x"], "Missing option '--handler'"),
        "bad model": (["models", "register", "x", "--handler", "nosuch", "--node", "n1", "--redis-url", REDIS,
                       "--prefix", PREFIX], "unknown model 'nosuch'"),
        "unreachable": (["models", "register", "x", "--handler", "echo", "--node", "n1", "--redis-url", UNREACHABLE],
                        CANNOT_REACH),
        "refused": (["models", "register", "x", "--handler", "echo", "--node", "n1", "--redis-url", REFUSING],
                    REFUSED),
    },
    "models unregister": {
        "bad arguments": (["models", "unregister"], "Missing argument 'NAME'"),
        "bad model": (["models", "unregister", "nosuch", "--redis-url", REDIS, "--prefix", PREFIX],
                      "'nosuch' is not registered"),
        "unreachable": (["models", "unregister", "x", "--redis-url", UNREACHABLE], CANNOT_REACH),
        "refused": (["models", "unregister", "x", "--redis-url", REFUSING], REFUSED),
    },
    "node": {
        "bad arguments": (["node", "--bogus"], "No such option '--bogus'"),
        "unreachable": (["node", "--redis-url", UNREACHABLE], CANNOT_REACH),
        "refused": (["node", "--redis-url", REFUSING], REFUSED),
    },
    "optimize": {
        "bad arguments": (["optimize", "-p", "minilm"], "Missing option '--batch'"),
        "unreachable": (["optimize", "-p", "minilm", "-t", "1", "-b", "1", "--calibrate", "--top-k", "1",
                         "--rounds", "1", "--redis-url", UNREACHABLE], CANNOT_REACH),
        "refused": (["optimize", "-p", "minilm", "-t", "1", "-b", "1", "--calibrate", "--top-k", "1",
                     "--rounds", "1", "--redis-url", REFUSING], REFUSED),
        "missing profile": (["optimize", "-p", MISSING, "-b", "2"], "no profile file at " + MISSING),
    },
    "profile run": {
        "bad arguments": (["profile", "run", "--model", "echo", "--batches", "1,x"], "comma-separated integers"),
        "bad model": (["profile", "run", "--model", "nosuchmodule:Handler", "-o", MISSING],
                      "cannot import handler module 'nosuchmodule'"),
        "unreachable": (["profile", "run", "--model", "echo", "--enqueue", "--redis-url", UNREACHABLE],
                        CANNOT_REACH),
        "refused": (["profile", "run", "--model", "echo", "--enqueue", "--redis-url", REFUSING],
                    REFUSED),
    },
    "profile path": {
        "bad arguments": (["profile", "path", "--model", "echo", "--max-batch", "0"], "--max-batch"),
        "bad model": (["profile", "path", "--model", "nosuch"], "unknown model 'nosuch'"),
        "unreachable": (["profile", "path", "--model", "echo", "--profile", PROFILE, "--redis-url", UNREACHABLE],
                        CANNOT_REACH),
        "refused": (["profile", "path", "--model", "echo", "--profile", PROFILE, "--redis-url", REFUSING],
                    REFUSED),
        "missing profile": (["profile", "path", "--model", "echo", "--profile", MISSING],
                            "no profile file at " + MISSING),
    },
    "profile show": {
        "bad arguments": (["profile", "show"], "Missing argument 'PROFILE'"),
        "missing profile": (["profile", "show", MISSING], "no profile file at " + MISSING),
    },
    "profile list": {
        "bad arguments": (["profile", "list", "--nosuch"], "No such option '--nosuch'"),
    },
    "profile import": {
        "bad arguments": (["profile", "import"], "Missing argument 'FILE.csv'"),
        "bad model": (["profile", "import", PROFILE, "--model", "bad name"], "model name 'bad name'"),
        "missing profile": (["profile", "import", "/nonexistent/packrat-smoke/missing.csv"], "no CSV file at"),
    },
    "": {  # the group itself
        "bad arguments": (["nosuch"], "No such command 'nosuch'"),
    },
}


def _commands(group: click.Group, path: str = "") -> dict[str, click.Command]:
    """Every command a user can run: leaves, and groups that run by themselves (``models``)."""
    found: dict[str, click.Command] = {}
    for name, command in group.commands.items():
        full = f"{path} {name}".strip()
        if not isinstance(command, click.Group) or command.invoke_without_command:
            found[full] = command
        if isinstance(command, click.Group):
            found.update(_commands(command, full))
    return found


def _kinds_due(command: click.Command) -> set[str]:
    """The failures a command must be smoke-tested with, from the options it takes."""
    names = {p.name for p in command.params}
    kinds = {"bad arguments"}
    if names & {"model", "models", "handler"}:
        kinds.add("bad model")
    if "redis_url" in names:
        kinds |= {"unreachable", "refused"}
    if names & {"profile", "profile_ref", "csv_file"}:
        kinds.add("missing profile")
    return kinds


def test_every_command_is_smoke_tested() -> None:
    commands = _commands(main)
    assert set(CASES) - {""} == set(commands), "a command was added or removed: give it its rows in CASES"
    for name, command in commands.items():
        missing = _kinds_due(command) - set(CASES[name])
        assert not missing, f"{name}: no smoke case for {sorted(missing)}"


@pytest.fixture(scope="module")
def csv_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small profile CSV, for ``profile import`` and as the profile of ``profile path`` (it reads JSON)."""
    directory = tmp_path_factory.mktemp("smoke")
    csv = directory / "echo.csv"
    csv.write_text("threads,batch_size,latency_ms\n1,1,1.0\n1,2,1.5\n")
    res = run_cli("profile", "import", str(csv), "-o", str(directory / "echo.json"), "--model", "echo")
    assert res.returncode == 0, res.stderr
    return directory


def _fill(args: list[str], *, redis_url: str, prefix: str, refusing: str, profiles: Path) -> list[str]:
    values = {REDIS: redis_url, PREFIX: prefix, REFUSING: refusing}
    out = []
    for arg in args:
        if arg == PROFILE:
            # profile import reads the CSV; profile path reads the JSON made from it.
            arg = str(profiles / ("echo.json" if "path" in args else "echo.csv"))
        out.append(values.get(arg, arg))
    return out


ROWS = [(c, k) for c, kinds in CASES.items() for k in kinds]
_TABLE_TEST = "test_fails_in_one_line_and_leaves_nothing"


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, redis_url: str, password_server: PasswordServer,  # noqa: F811
             csv_profile: Path) -> Iterator[dict[tuple[str, str], Run]]:
    """Every selected row of the table, run a few at a time: each is its own process, marker and temp dir.

    Most of a run is the interpreter starting; side by side the table takes
    half the time it takes one row after another.
    """
    wanted = [tuple(item.callspec.params[n] for n in ("command", "kind")) for item in request.session.items
              if getattr(item, "originalname", None) == _TABLE_TEST and hasattr(item, "callspec")]
    prefix = f"t-smoke-{uuid.uuid4().hex[:8]}"
    refusing = password_server.url(f":{WRONG}")

    def run(row: tuple[str, str]) -> Run:
        args, _ = CASES[row[0]][row[1]]
        return run_cli(*_fill(args, redis_url=redis_url, prefix=prefix, refusing=refusing, profiles=csv_profile))

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        done = dict(zip(wanted, pool.map(run, wanted)))
    yield done
    client = connect(redis_url)
    delete_prefixed(client, prefix)
    client.close()


@pytest.mark.parametrize(("command", "kind"), ROWS)
def test_fails_in_one_line_and_leaves_nothing(command: str, kind: str,
                                              outcomes: dict[tuple[str, str], Run]) -> None:
    _, says = CASES[command][kind]
    run = outcomes[(command, kind)]
    line = assert_one_line_failure(run, WRONG, says=says)
    if kind == "bad arguments":
        assert run.returncode == 2 and line.startswith("Error: "), line


# --- the ways out of a command that started things ----------------------------------------


def _processes(started: Started) -> list[str]:
    return [" ".join(p.cmdline()[:3]) for p in started.children()]


def _wait_serving(started: Started, *, timeout: float = 60) -> list[str]:
    """Wait for ``ready:`` and return what it runs: at least one worker (and, for up, a redis-server)."""
    started.wait_for_output("ready: XADD", timeout)
    return _processes(started)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_up_stops_everything_it_started(sig: int) -> None:
    started = Started("up", "-m", "echo", "-i", "1x1")
    running = _wait_serving(started)
    assert any("redis-server" in p for p in running) and any("workers.worker" in p for p in running), running
    assert any("-m dispatcher" in p for p in running), running
    run = started.finish(sig)
    assert run.returncode == 0, run.stdout
    assert "stopping: dispatcher, then instances after they drain" in run.stdout
    assert "Traceback" not in run.stdout, run.stdout
    assert not run.leftovers, f"left behind: {run.leftovers}\n{run.stdout}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_up_interrupted_while_starting_stops_what_had_started(sig: int) -> None:
    started = Started("up", "-m", "tests.supervisor_handlers:SlowLoad", "-i", "1x1", "-o", "load_s=60")
    started.wait_for_output("started instance", 60)
    wait_for(lambda: any("workers.worker" in p for p in _processes(started)), 10, "the worker")
    run = started.finish(sig)
    assert run.returncode == 128 + sig, run.stdout
    assert run.stdout.strip().endswith(f"interrupted by {signal.Signals(sig).name}"), run.stdout
    assert "Traceback" not in run.stdout, run.stdout
    assert not run.leftovers, f"left behind: {run.leftovers}\n{run.stdout}"


def test_up_whose_instance_fails_to_load_stops_the_others() -> None:
    started = Started("up", "-m", "tests.supervisor_handlers:FailingSecondInstance", "-i", "1x1,1x1")
    started.proc.wait(60)
    run = started.finish()
    assert run.returncode == 1, run.stdout
    assert run.stdout.strip().splitlines()[-1].startswith("Error: failingsecondinstance did not start: instance ")
    assert not run.leftovers, f"left behind: {run.leftovers}\n{run.stdout}"


def test_pool_sigterm_stops_its_instances(redis_url: str, prefix: str) -> None:
    started = Started("pool", "-m", "echo", "-i", "1x1,1x1", "--redis-url", redis_url, "--prefix", prefix)
    running = _wait_serving(started)
    assert sum("workers.worker" in p for p in running) == 2, running
    run = started.finish(signal.SIGTERM)
    assert run.returncode == 0, run.stdout
    assert "stopping: instances after they drain" in run.stdout
    assert not run.leftovers, f"left behind: {run.leftovers}\n{run.stdout}"


def test_node_sigterm_stops_every_model(redis_url: str, prefix: str) -> None:
    started = Started("node", "--node", "smoke", "--redis-url", redis_url, "--prefix", prefix)
    started.wait_for_output("node smoke: serving", 60)
    registered = run_cli("models", "register", "e", "--handler", "echo", "-i", "1x1", "--node", "smoke",
                         "--redis-url", redis_url, "--prefix", prefix)
    assert registered.returncode == 0, registered.stderr
    assert any("workers.worker" in p for p in _processes(started)), _processes(started)
    run = started.finish(signal.SIGTERM)
    assert run.returncode == 0, run.stdout
    assert "node smoke: stopping every model" in run.stdout and "Traceback" not in run.stdout, run.stdout
    assert not run.leftovers, f"left behind: {run.leftovers}\n{run.stdout}"


def test_profiler_sigterm_stops_its_children(tmp_path: Path) -> None:
    started = Started("profile", "run", "--model", "sleep", "--option", "base_ms=300", "--batches", "1,2,4",
                      "--threads-max", "1", "--min-iters", "30", "-o", str(tmp_path / "sleep.json"), "--quiet")
    wait_for(lambda: any("optimizer.profiling.child" in p for p in _processes(started)), 60, "a profiling child")
    time.sleep(1.0)  # measuring, not starting
    run = started.finish(signal.SIGTERM)
    assert run.returncode == 130, run.stdout  # interrupted: what was measured is kept
    assert "interrupted: what was measured is saved" in run.stdout
    assert "Traceback" not in run.stdout, run.stdout
    assert not run.leftovers, f"left behind: {run.leftovers}\n{run.stdout}"


@pytest.mark.slow
def test_demo_leaves_nothing_behind() -> None:
    started = Started(module="packrat_mq.cli.demo")
    wait_for(lambda: any("redis-server" in p for p in _processes(started)), 60, "the demo's redis-server")
    assert started.proc.wait(300) == 0, started.output()
    run = started.finish()
    assert "done. single-request median" in run.stdout
    assert not run.leftovers, f"left behind: {run.leftovers}\n{run.stdout}"


@pytest.mark.slow
def test_demo_stopped_midway_leaves_nothing_behind() -> None:
    started = Started(module="packrat_mq.cli.demo")
    started.wait_for_output("== real embeddings", 120)
    run = started.finish(signal.SIGTERM)
    assert run.returncode == 143, run.stdout
    assert "demo interrupted by SIGTERM" in run.stdout and "Traceback" not in run.stdout, run.stdout
    assert not run.leftovers, f"left behind: {run.leftovers}\n{run.stdout}"
