"""What `up` and `pool` decide before starting anything: names, configuration, profile."""
from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from optimizer.planning.profile import MachineInfo, Profile, ProfileEntry, profile_path
from packrat_mq import graph as graph_modes
from packrat_mq.cli.serve import ServePlan, choose_configuration, model_and_handler, serving_options
from packrat_mq.handler import ZOO


@pytest.fixture(autouse=True)
def _toy_in_the_zoo(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model toy`` names a handler, as ``up`` checks before it plans."""
    monkeypatch.setitem(ZOO, "toy", ZOO["echo"])


def test_model_and_handler() -> None:
    assert model_and_handler("resnet50", None) == ("resnet50", "resnet50")
    assert model_and_handler("mypkg.mod:MyHandler", None) == ("myhandler", "mypkg.mod:MyHandler")
    assert model_and_handler("mypkg.mod:MyHandler", "faces") == ("faces", "mypkg.mod:MyHandler")
    with pytest.raises(click.BadParameter, match="model name"):
        model_and_handler("echo", "bad name")


def _profile(tmp_path: Path) -> Path:
    points = {(1, 1): 10.0, (1, 2): 18.0, (2, 1): 9.0, (2, 2): 12.0}
    prof = Profile(model="toy", entries=tuple(ProfileEntry(threads=t, batch=b, mean_ms=ms) for (t, b), ms in points.items()))
    return prof.save(tmp_path / "toy.json")


def test_hand_given_instances_keep_the_profile_for_partial_batches(tmp_path: Path) -> None:
    path = _profile(tmp_path)
    config, used = choose_configuration("toy", "1x2,1x2", None, None, str(path))
    assert str(config) == "1x2,1x2" and used == str(path)
    config, used = choose_configuration("no-profile-model", "1x2", None, None, None)
    assert used is None
    with pytest.raises(click.BadParameter, match="no profile"):
        choose_configuration("toy", "1x2", None, None, str(tmp_path / "missing.json"))


def test_optimizer_chooses_from_the_profile(tmp_path: Path) -> None:
    path = _profile(tmp_path)
    config, used = choose_configuration("toy", None, 2, 4, str(path))
    assert config.batch == 4 and config.threads <= 2 and used == str(path)
    assert config.predicted_latency_ms == 18.0  # two 1-thread instances of 2 beat one 2-thread instance of 4 (unprofiled)


def test_without_a_profile_one_instance_takes_every_thread() -> None:
    config, used = choose_configuration("no-profile-model", None, 3, 6, None)
    assert str(config) == "3x6" and used is None


def test_infeasible_batch_is_a_clear_error(tmp_path: Path) -> None:
    path = _profile(tmp_path)
    with pytest.raises(click.ClickException, match="optimizer"):
        choose_configuration("toy", None, 1, 3, str(path))


@click.command()
@serving_options
def _plan_only(plan: ServePlan) -> None:
    """What `up`/`pool` would serve, without starting anything."""
    click.echo(json.dumps({"configuration": str(plan.configuration), "profile": plan.profile_path,
                           "graph": plan.graph}))


#: What ``--graph`` alone serves ``toy`` with.
DEFAULT = graph_modes.default_backend("toy")


def _two_mode_profiles(root: Path, *, graph: str | None = DEFAULT) -> None:
    """``profiles/toy.json`` (eager) and ``profiles/toy.<graph>.json``, which plan T=2, B=4 differently."""
    eager = {(1, 2): 10.0, (2, 4): 12.0}  # two 1x2 instances win
    traced = {(1, 2): 10.0, (2, 4): 6.0}  # one 2x4 instance wins
    for mode, points in (("eager", eager), (graph, traced)):
        if mode is None:
            continue
        Profile(model="toy", mode=mode, entries=tuple(ProfileEntry(threads=t, batch=b, mean_ms=ms)
                                                      for (t, b), ms in points.items())
                ).save(profile_path("toy", mode, root / "profiles"))


def _plan(*args: str) -> tuple[dict, str]:
    res = CliRunner().invoke(_plan_only, ["--model", "toy", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout), res.stderr


@pytest.mark.parametrize("args, served, name, config", [
    (["--graph"], DEFAULT, f"toy.{DEFAULT}.json", "2x4"),
    (["--graph", "export"], "export", "toy.export.json", "2x4"),
    (["--eager"], "eager", "toy.json", "1x2,1x2"),
    ([], "eager", "toy.json", "1x2,1x2"),
])
def test_up_plans_from_the_profile_of_its_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               args: list[str], served: str, name: str, config: str) -> None:
    _two_mode_profiles(tmp_path, graph=None if served == "eager" else served)
    monkeypatch.chdir(tmp_path)
    plan, note = _plan("-t", "2", "-b", "4", *args)
    assert Path(plan["profile"]).name == name and plan["configuration"] == config
    assert plan["graph"] == served
    assert name in note  # the operator is told which file was used
    plan, note = _plan("-i", "1x4", *args)  # by hand: the profile still splits partial batches
    assert Path(plan["profile"]).name == name and name in note


def test_the_graph_mode_setting_is_the_default_and_options_win(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _two_mode_profiles(tmp_path, graph="export")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PACKRAT_GRAPH_MODE", "export")
    assert _plan("-t", "2", "-b", "4")[0]["graph"] == "export"
    assert _plan("-t", "2", "-b", "4", "--eager")[0]["graph"] == "eager"
    monkeypatch.setenv("PACKRAT_GRAPH_MODE", "true")  # as the boolean setting was written
    assert _plan("-t", "2", "-b", "4")[0]["graph"] == DEFAULT


@pytest.mark.parametrize("args, message", [
    (["--graph", "jit"], "unknown graph mode 'jit'"),
    (["--graph", "compile", "--eager"], "--graph and --eager exclude each other"),
])
def test_a_bad_graph_mode_is_one_usage_line(args: list[str], message: str) -> None:
    res = CliRunner().invoke(_plan_only, ["--model", "toy", *args])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output


def test_graph_mode_does_not_plan_from_the_eager_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _two_mode_profiles(tmp_path, graph=None)
    monkeypatch.chdir(tmp_path)
    plan, note = _plan("-t", "2", "-b", "4", "--graph")
    # As with no profile at all: one instance with every thread, said out loud.
    assert plan == {"configuration": "2x4", "profile": None, "graph": DEFAULT}
    assert f"no toy.{DEFAULT}.json profile" in note
    assert f"toy.json is the eager profile, not used in {DEFAULT} mode" in note
    plan, _ = _plan("-i", "1x4", "--graph")
    assert plan["profile"] is None
    plan, _ = _plan("-t", "2", "-b", "4")
    assert Path(plan["profile"]).name == "toy.json" and plan["configuration"] == "1x2,1x2"


def _profile_from(root: Path, machine: MachineInfo | None, *, graph: bool = False) -> Path:
    """``profiles/toy.json`` (or ``toy.<default backend>.json``) measured on ``machine``."""
    points = {(1, 2): 10.0, (2, 4): 12.0}
    mode = DEFAULT if graph else "eager"
    prof = Profile(model="toy", mode=mode, machine=machine,
                   entries=tuple(ProfileEntry(threads=t, batch=b, mean_ms=ms) for (t, b), ms in points.items()))
    return prof.save(profile_path("toy", mode, root / "profiles"))


def _elsewhere() -> tuple[MachineInfo, MachineInfo]:
    """(this machine, another kind of machine that differs in CPU and cores per socket)."""
    here = MachineInfo.current()
    if here.cpu_model is None or here.cores_per_socket is None:
        pytest.skip("this machine's CPU model or cores per socket are unknown")
    other = MachineInfo(cpu_model="Imaginary CPU 9000", sockets=2, physical_cores=4 * (here.cores_per_socket + 1),
                        hostname="elsewhere")
    return here, other


@pytest.mark.parametrize("mode", ["--eager", "--graph"])
def test_up_warns_about_a_profile_of_another_machine_and_still_plans_from_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    here, other = _elsewhere()
    path = _profile_from(tmp_path, other, graph=mode == "--graph")
    monkeypatch.chdir(tmp_path)
    plan, stderr = _plan("-t", "2", "-b", "4", mode)
    assert plan["configuration"] == "1x2,1x2" and Path(plan["profile"]).name == path.name  # still served
    (warning,) = [line for line in stderr.splitlines() if line.startswith("warning:")]
    assert path.name in warning and "another machine" in warning
    assert f"CPU 'Imaginary CPU 9000' vs {here.cpu_model!r}" in warning
    assert f"{other.cores_per_socket} vs {here.cores_per_socket} cores per socket" in warning
    command, where = warning.split("(minutes): ", 1)[1].split(" (written to ", 1)
    assert command.startswith("packrat-mq profile run --model toy --quick")
    assert ("--graph" in command) == (mode == "--graph")
    # Found by the model's name: the advice leaves the other machine's file alone, and writes this
    # machine's beside it, where the next lookup here takes it.
    assert "-o" not in command.split() and "--fresh" not in command
    assert where.startswith(f"profiles/machines/{here.key}/{path.name}, kept beside")
    # Serving a configuration given by hand reads the same profile, and says the same.
    plan, stderr = _plan("-i", "1x4", mode)
    assert any(line.startswith("warning:") and "Imaginary CPU 9000" in line for line in stderr.splitlines())


def test_up_takes_this_machines_profile_from_beside_another_machines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here, other = _elsewhere()
    theirs = _profile_from(tmp_path, other)
    mine = Profile(model="toy", machine=here, entries=tuple(
        ProfileEntry(threads=t, batch=b, mean_ms=ms) for (t, b), ms in {(2, 4): 10.0, (1, 2): 30.0}.items()))
    mine = mine.save(tmp_path / "profiles" / "machines" / here.key / "toy.json")
    monkeypatch.chdir(tmp_path)
    plan, stderr = _plan("-t", "2", "-b", "4")
    assert Path(plan["profile"]).resolve() == mine.resolve()
    assert plan["configuration"] == "2x4"  # this machine's latencies, not the other's (which chose 1x2,1x2)
    assert not [line for line in stderr.splitlines() if line.startswith("warning:")]
    assert theirs.is_file()


@pytest.mark.parametrize("machine", ["this", "unknown"])
def test_no_warning_for_this_machine_or_an_unknown_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       machine: str) -> None:
    # A CSV import knows no machine: nothing to compare, nothing to say.
    _profile_from(tmp_path, MachineInfo.current() if machine == "this" else None)
    monkeypatch.chdir(tmp_path)
    plan, stderr = _plan("-t", "2", "-b", "4")
    assert plan["configuration"] == "1x2,1x2"
    assert not [line for line in stderr.splitlines() if line.startswith("warning:")]
    assert "another machine" not in stderr
