"""Profiles: JSON round trip, CSV import, validation messages, and the ``profile`` commands."""
from __future__ import annotations

import importlib.util
import json
import math
import shlex
import shutil
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

from optimizer.planning.profile import (
    FORMAT_VERSION,
    Calibration,
    MachineInfo,
    Profile,
    ProfileEntry,
    ProfileError,
    _cpu_design,
    _machine_topology,
    as_table,
    machine_profile_path,
    profile_filename,
    profile_path,
    resolve_profile_path,
)
from packrat_mq.cli import main as cli_main
from packrat_mq.cli.profile_cmd import profile as profile_group
from tests.fake_sysfs import make_sysfs

REPO_PROFILES = Path(__file__).resolve().parent.parent / "profiles"


def make_profile(**kw) -> Profile:
    entries = [
        ProfileEntry(threads=t, batch=b, mean_ms=b * 2.0 / t, p50_ms=b * 1.9 / t, p99_ms=b * 2.5 / t,
                     iterations=20)
        for t in (1, 2, 4) for b in (1, 2, 4)
    ]
    return Profile(model="toy", entries=entries, **kw)


def test_json_round_trip(tmp_path):
    prof = make_profile(
        machine=MachineInfo(cpu_model="Test CPU", sockets=1, physical_cores=4, logical_cpus=8),
        calibrations=[Calibration(configuration="2x2,2x2", threads=4, batch=4, predicted_ms=2.0,
                                  measured_p50_ms=2.2, measured_mean_ms=2.3, spread_ms=0.1)],
    )
    path = prof.save(tmp_path / "sub" / "toy.json")
    text = path.read_text()
    assert text.startswith("{\n  ")  # pretty, reviewable
    assert not list(path.parent.glob(".*tmp"))  # the temporary file was renamed away
    loaded = Profile.load(path)
    assert loaded == prof
    threads, batches, lat = loaded.table()
    assert threads.tolist() == [1, 2, 4] and batches.tolist() == [1, 2, 4]
    assert lat[2, 1] == loaded.latency(4, 2) == 1.0


def test_table_marks_holes_and_is_cached():
    prof = Profile(model="m", entries=[ProfileEntry(threads=1, batch=1, mean_ms=3.0),
                                       ProfileEntry(threads=2, batch=4, mean_ms=5.0)])
    t, b, lat = prof.table()
    assert np.isnan(lat[0, 1]) and np.isnan(lat[1, 0])
    assert prof.table() is prof.table()
    with pytest.raises(ValueError):
        lat[0, 0] = 1.0  # cached arrays are read-only
    prof.upsert(ProfileEntry(threads=1, batch=4, mean_ms=9.0))
    assert prof.table().latency_ms[0, 1] == 9.0
    assert prof.max_threads == 2 and prof.batch_sizes == [1, 4]
    with pytest.raises(KeyError, match="threads=2, batch=1"):
        prof.latency(2, 1)
    assert prof.entry(2, 1) is None


def test_upsert_replaces_and_merge_checks_model():
    prof = make_profile()
    prof.upsert(ProfileEntry(threads=1, batch=1, mean_ms=42.0))
    assert prof.latency(1, 1) == 42.0 and len(prof.entries) == 9
    other = Profile(model="toy", entries=[ProfileEntry(threads=8, batch=1, mean_ms=0.5),
                                          ProfileEntry(threads=1, batch=1, mean_ms=7.0)])
    prof.merge(other)
    assert prof.latency(1, 1) == 7.0 and prof.latency(8, 1) == 0.5 and prof.max_threads == 8
    with pytest.raises(ProfileError, match="cannot merge"):
        prof.merge(Profile(model="other"))


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"model": "m", "entries": [{"threads": 0, "batch": 1, "mean_ms": 1}]},
         r"entries\[0\] \(threads=0, batch=1\)\.threads"),
        ({"model": "m", "entries": [{"threads": 1, "batch": 1, "mean_ms": -2}]}, "mean_ms"),
        ({"model": "m", "entries": [{"threads": 1, "batch": 1, "mean_ms": 1},
                                    {"threads": 1, "batch": 1, "mean_ms": 2}]}, "two entries for threads=1, batch=1"),
        ({"model": "m", "format_version": 99}, "format_version 99"),
        ({"model": "m", "mode": "jit"}, "mode"),
        ({"model": "bad name"}, "model name"),
        ({"model": "m", "calibrations": [{"configuration": "2x4", "threads": 4, "batch": 8}]},
         "serves batch 4, not 8"),
    ],
)
def test_load_rejects_bad_documents(tmp_path, doc, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=message):
        Profile.load(path)


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(ProfileError, match="no profile at"):
        Profile.load(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match=r"bad.json: not valid JSON \(line 1"):
        Profile.load(bad)
    empty = Profile(model="empty")
    with pytest.raises(ProfileError, match="no entries"):
        empty.table()


def test_csv_import_ignores_extra_columns_and_averages_duplicates(tmp_path):
    path = tmp_path / "resnet.csv"
    path.write_text(
        "model, threads ,batch_size,latency_ms,notes\n"
        "r,1,1,10.0,first\n"
        "\n"
        "r,1,2,18.0,\n"
        "r,2,1,6.0,x\n"
        "r,1,1,12.0,repeat\n"
    )
    prof = Profile.from_csv(path)
    assert prof.model == "resnet" and prof.machine is None
    assert prof.latency(1, 1) == 11.0
    assert prof.latency(1, 2) == 18.0 and prof.latency(2, 1) == 6.0
    with pytest.raises(ProfileError, match=r"line 6: duplicate threads=1, batch_size=1 \(first on line 2\)"):
        Profile.from_csv(path, duplicates="error")


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty file"),
        ("threads,batch,latency_ms\n1,1,1\n", "header lacks batch_size"),
        ("threads,batch_size,latency_ms\n", "no data rows"),
        ("threads,batch_size,latency_ms\n1,1,1\nx,2,3\n", "line 3: threads must be a positive integer, got 'x'"),
        ("threads,batch_size,latency_ms\n1,0,1\n", "line 2: batch_size must be a positive integer"),
        ("threads,batch_size,latency_ms\n1,2.5,1\n", "line 2: batch_size must be a positive integer"),
        ("threads,batch_size,latency_ms\n1,1,-3\n", "line 2: latency_ms must be positive"),
        ("threads,batch_size,latency_ms\n1,1,nan\n", "line 2: latency_ms must be positive and finite"),
        ("threads,batch_size,latency_ms\n1,1,fast\n", "line 2: latency_ms must be a number"),
        ("threads,batch_size,latency_ms\n1,1\n", "line 2: no value for latency_ms"),
    ],
)
def test_bad_csv(tmp_path, text, message):
    path = tmp_path / "m.csv"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message):
        Profile.from_csv(path)


def test_missing_csv(tmp_path):
    with pytest.raises(ProfileError, match="no CSV file at"):
        Profile.from_csv(tmp_path / "nope.csv")


def test_as_table_sorts_and_validates():
    t, b, lat = as_table([2, 1], [4, 1], [[1.0, 2.0], [3.0, np.nan]])
    assert t.tolist() == [1, 2] and b.tolist() == [1, 4]
    assert math.isnan(lat[0, 0]) and lat[0, 1] == 3.0 and lat[1, 0] == 2.0 and lat[1, 1] == 1.0
    with pytest.raises(ProfileError, match="duplicates"):
        as_table([1, 1], [1], [[1.0], [2.0]])
    with pytest.raises(ProfileError, match=">= 1"):
        as_table([0], [1], [[1.0]])


def test_machine_info_current_reads_this_machine():
    info = MachineInfo.current()
    assert info.logical_cpus and info.logical_cpus >= 1
    assert info.hostname and info.date
    assert info.physical_cores is None or info.physical_cores <= info.logical_cpus
    summary = info.summary()
    assert f"{info.logical_cpus} CPUs" in summary and info.hostname in summary


def test_machine_info_counts_cores_with_the_core_topology(tmp_path):
    # Two sockets of 8 cores with hyper-threading: 16 physical cores of 32 CPUs,
    # all of them counted whatever this process's cpuset is.
    root = make_sysfs(tmp_path, sockets=2, cores=8, threads=2)
    (root / "online").write_text("0-31\n")
    topology = _machine_topology(root)
    assert topology is not None
    assert (len(topology.sockets), topology.physical_cores, topology.logical_cpus) == (2, 16, 32)
    assert _machine_topology(tmp_path / "no-sysfs") is None  # a guess is not recorded
    info = MachineInfo.current()
    here = _machine_topology()
    if here is not None:
        assert (info.sockets, info.physical_cores) == (len(here.sockets), here.physical_cores)


def test_profile_file_names():
    assert profile_filename("toy") == "toy.json"
    assert profile_filename("toy", "compile") == "toy.compile.json"
    assert profile_path("toy", "torchscript", "somewhere") == Path("somewhere/toy.torchscript.json")
    assert profile_path("toy") == Path("profiles/toy.json")
    with pytest.raises(ProfileError, match="model name"):
        profile_filename("../toy")


def test_resolve_profile_path_by_mode(tmp_path):
    dirs = [tmp_path / "profiles"]
    eager = make_profile().save(profile_path("toy", "eager", dirs[0]))
    assert resolve_profile_path("toy", dirs) == eager
    with pytest.raises(ProfileError, match=r"no compile profile for model 'toy' \(toy\.compile\.json\)"):
        resolve_profile_path("toy", dirs, mode="compile")  # the eager one is not taken instead
    graph = make_profile(mode="compile").save(profile_path("toy", "compile", dirs[0]))
    assert resolve_profile_path("toy", dirs, mode="compile") == graph
    assert resolve_profile_path("toy", dirs) == eager
    with pytest.raises(ProfileError, match="no torchscript profile"):
        resolve_profile_path("toy", dirs, mode="torchscript")  # nor another backend's
    assert resolve_profile_path(eager, dirs, mode="compile") == eager  # a path is used as given


def test_resolve_profile_path(tmp_path, monkeypatch):
    prof = make_profile()
    saved = prof.save(tmp_path / "profiles" / "toy.json")
    assert resolve_profile_path(saved) == saved
    assert resolve_profile_path("toy", [tmp_path / "profiles"]) == saved
    monkeypatch.chdir(tmp_path)
    assert resolve_profile_path("toy").resolve() == saved.resolve()
    with pytest.raises(ProfileError, match=r"no profile for model 'nosuchmodel'.*available: .*toy"):
        resolve_profile_path("nosuchmodel")
    with pytest.raises(ProfileError, match="no profile file at"):
        resolve_profile_path("elsewhere/toy.json")


XEON = MachineInfo(cpu_model="Intel(R) Xeon(R) Processor", cpu_id="GenuineIntel family 6 model 167 stepping 1",
                   cpu_isa=("avx2", "avx512f", "amx_tile"), sockets=1, physical_cores=2)
EPYC = MachineInfo(cpu_model="AMD EPYC", cpu_id="AuthenticAMD family 25 model 1 stepping 1", cpu_isa=("avx2",),
                   sockets=1, physical_cores=2)


def test_machine_keys_name_the_machine_and_tell_apart_what_differences_tell_apart():
    assert EPYC.key.startswith("amd-epyc-25-1-2c-") and XEON.key.startswith("intel-xeon-6-167-2c-")
    assert EPYC.key == MachineInfo(**{**EPYC.model_dump(), "hostname": "other", "date": "x"}).key  # not compared
    hidden = MachineInfo(**{**XEON.model_dump(), "cpu_isa": ("avx2",)})  # a VM that hides AVX-512
    assert XEON.differences(hidden) and XEON.key != hidden.key
    bigger = MachineInfo(**{**EPYC.model_dump(), "physical_cores": 16})
    assert bigger.key.startswith("amd-epyc-25-1-16c-")
    assert MachineInfo().key.startswith("unknown-")
    assert EPYC.matches(EPYC) and not EPYC.matches(XEON) and not MachineInfo().matches(EPYC)


def test_a_second_machines_profile_goes_beside_the_first_and_each_machine_finds_its_own(tmp_path):
    root = tmp_path / "profiles"
    assert machine_profile_path("toy", directory=root, here=XEON) == root / "toy.json"  # a free slot
    xeon = make_profile(machine=XEON).save(root / "toy.json")
    assert machine_profile_path("toy", directory=root, here=XEON) == xeon  # its own: resumed, re-run
    slot = machine_profile_path("toy", directory=root, here=EPYC)
    assert slot == root / "machines" / EPYC.key / "toy.json"  # not over the Xeon's
    # One profile: whatever machine it is from, it is the one (the caller warns).
    assert resolve_profile_path("toy", [root], here=EPYC) == xeon
    epyc = make_profile(machine=EPYC).save(slot)
    assert machine_profile_path("toy", directory=root, here=EPYC) == epyc
    assert resolve_profile_path("toy", [root], here=EPYC) == epyc
    assert resolve_profile_path("toy", [root], here=XEON) == xeon
    third = MachineInfo(cpu_model="Imaginary CPU 9000", physical_cores=64, sockets=1)
    assert resolve_profile_path("toy", [root], here=third) == xeon  # none of its own: the directory's file
    # Modes stay apart in the machines' slots too.
    with pytest.raises(ProfileError, match="no compile profile"):
        resolve_profile_path("toy", [root], mode="compile", here=EPYC)
    graph = make_profile(mode="compile", machine=EPYC).save(root / "machines" / EPYC.key / "toy.compile.json")
    assert resolve_profile_path("toy", [root], mode="compile", here=XEON) == graph
    # A directory earlier in the search finds its own file before a later one's machine slot.
    local = tmp_path / "cwd-profiles"
    mine = make_profile(machine=EPYC).save(local / "toy.json")
    assert resolve_profile_path("toy", [local, root], here=EPYC) == mine
    assert resolve_profile_path("toy", [local, root], here=XEON) == xeon


def test_profile_list_marks_the_file_used_on_this_machine(tmp_path, monkeypatch):
    here = MachineInfo.current()
    if here.cpu_model is None:
        pytest.skip("this machine's CPU model is unknown")
    monkeypatch.chdir(tmp_path)
    other = XEON if here.differences(XEON) else EPYC
    theirs = make_profile(machine=other).save(Path("profiles/toy.json"))
    mine = make_profile(machine=here).save(Path("profiles/machines") / here.key / "toy.json")
    (Path("profiles") / "broken.json").write_text("{")
    rows = json.loads(invoke("list", "--json").output)
    ours = {Path(r["path"]).resolve(): r for r in rows if r.get("model") == "toy"}
    assert ours[mine.resolve()]["used"] is True and ours[mine.resolve()]["matches_this_machine"] is True
    assert ours[theirs.resolve()]["used"] is False and ours[theirs.resolve()]["matches_this_machine"] is False
    assert ours[mine.resolve()]["machine_key"] == here.key
    assert any(r["path"].endswith("broken.json") and "error" in r for r in rows)
    text = invoke("list").output
    assert f"this machine: {here.summary()} [{here.key}]" in text
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("*") and "toy.json" in ln]
    assert str(Path("machines") / here.key / "toy.json") in line


# ----------------------------------------------------------------------- CLI


def invoke(*args):
    group = click.Group("packrat-mq", commands=[profile_group])
    return CliRunner().invoke(group, ["profile", *args])


def test_import_then_show(tmp_path):
    csv_path = tmp_path / "m.csv"
    csv_path.write_text("threads,batch_size,latency_ms,host\n1,1,10,a\n1,16,150.5,a\n12,16,20.25,a\n")
    out = tmp_path / "out" / "m.json"
    result = invoke("import", str(csv_path), "-o", str(out), "--model", "net")
    assert result.exit_code == 0, result.output
    assert "imported 3 measurements of net" in result.output
    assert Profile.load(out).model == "net"
    result = invoke("import", str(csv_path), "-o", str(out))
    assert result.exit_code == 1 and "--force" in result.output

    result = invoke("show", str(out))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    table = lines[lines.index(next(line for line in lines if line.lstrip().startswith("threads"))):]
    assert table == [
        "threads      1      16",
        "      1  10.00  150.50",
        "     12      -   20.25",
    ]
    result = invoke("show", str(out), "--json")
    doc = json.loads(result.output)
    assert doc["threads"] == [1, 12] and doc["batches"] == [1, 16]
    assert doc["latency_ms"] == [[10.0, 150.5], [None, 20.25]]


def test_import_default_output_by_mode(tmp_path, monkeypatch):
    csv_path = tmp_path / "m.csv"
    csv_path.write_text("threads,batch_size,latency_ms\n1,1,10\n")
    monkeypatch.chdir(tmp_path)
    assert invoke("import", str(csv_path), "--model", "net").exit_code == 0
    result = invoke("import", str(csv_path), "--model", "net", "--mode", "compile")
    assert result.exit_code == 0, result.output
    assert Profile.load(tmp_path / "profiles" / "net.json").mode == "eager"
    assert Profile.load(tmp_path / "profiles" / "net.compile.json").mode == "compile"


def test_import_errors_are_clean(tmp_path):
    csv_path = tmp_path / "m.csv"
    csv_path.write_text("threads,batch_size\n1,1\n")
    result = invoke("import", str(csv_path), "-o", str(tmp_path / "m.json"))
    assert result.exit_code == 1
    assert "header lacks latency_ms" in result.output
    assert isinstance(result.exception, SystemExit)


def test_show_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = make_profile().save(tmp_path / "toy.json")
    png = tmp_path / "toy.png"
    result = invoke("show", str(path), "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def help_examples(*args):
    """The ``packrat-mq ...`` command lines in a command's --help, as argument lists."""
    result = invoke(*args, "--help")
    assert result.exit_code == 0, result.output
    lines = [line.split("#")[0].strip() for line in result.output.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("packrat-mq ")]


def test_help_examples_run(tmp_path, monkeypatch):
    """Every example in the help of profile, profile import and profile show works as printed."""
    examples = [ex for args in ([], ["import"], ["show"]) for ex in help_examples(*args)]
    assert len(examples) >= 4, examples
    csv_text = "threads,batch_size,latency_ms\n1,1,10\n1,2,18\n2,2,11\n"
    for n, argv in enumerate(examples):
        if "--plot" in argv and importlib.util.find_spec("matplotlib") is None:
            continue
        work = tmp_path / str(n)
        work.mkdir()
        monkeypatch.chdir(work)
        for name in {a for a in argv if a.endswith(".csv")}:
            (work / name).write_text(csv_text)
        if argv[1] != "import":  # the repository's profiles, as in a checkout
            shutil.copytree(REPO_PROFILES, work / "profiles")
        result = CliRunner().invoke(cli_main, argv)
        assert result.exit_code == 0, (argv, result.output)
        if "-o" in argv:
            assert Profile.load(work / argv[argv.index("-o") + 1]).model == argv[argv.index("--model") + 1]
        if "--plot" in argv:
            assert (work / argv[argv.index("--plot") + 1]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if "--json" in argv:
            assert json.loads(result.output)["threads"]


def test_placement_and_copies_round_trip_and_format_1_reads_as_isolated(tmp_path):
    prof = make_profile(placement="co-located")
    prof.upsert(ProfileEntry(threads=1, batch=1, mean_ms=2.5, copies=4))
    loaded = Profile.load(prof.save(tmp_path / "toy.json"))
    assert loaded.placement == "co-located" and loaded.entry(1, 1).copies == 4
    assert json.loads((tmp_path / "toy.json").read_text())["format_version"] == FORMAT_VERSION
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format_version": 1, "model": "m",
                               "entries": [{"threads": 1, "batch": 1, "mean_ms": 3.0}]}))
    loaded = Profile.load(old)
    assert loaded.placement == "isolated" and loaded.entry(1, 1).copies is None
    assert json.loads(loaded.save(old).read_text())["format_version"] == FORMAT_VERSION  # saved again in today's format
    with pytest.raises(ProfileError, match="cannot merge"):
        make_profile(placement="co-located").merge(make_profile())
    old.write_text(json.dumps({"model": "m", "placement": "nearby"}))
    with pytest.raises(ProfileError, match="old.json: placement"):
        Profile.load(old)


def test_machine_differences_compare_cpu_and_cores_per_socket_only():
    xeon = MachineInfo(cpu_model="Xeon", sockets=2, physical_cores=32, hostname="a", torch_version="2.1")
    assert xeon.cores_per_socket == 16
    assert xeon.differences(xeon.model_copy(update={"hostname": "b", "torch_version": "2.9"})) == []
    assert xeon.differences(MachineInfo(cpu_model="Xeon", sockets=1, physical_cores=16)) == []
    assert xeon.differences(MachineInfo(cpu_model="EPYC", sockets=1, physical_cores=2)) == [
        "CPU 'Xeon' vs 'EPYC'", "16 vs 2 cores per socket"]
    # Unknown on either side is no difference.
    assert xeon.differences(MachineInfo()) == [] and MachineInfo().differences(xeon) == []
    assert MachineInfo(physical_cores=4).cores_per_socket is None


_MILAN = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse2 avx fma avx2 sha_ni

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
flags\t\t: avx2 avx512f
"""

_GRAVITON = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd sve asimddp bf16 i8mm
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
"""


def test_the_cpus_design_and_vector_extensions_are_read_from_its_first_processor():
    assert _cpu_design(_MILAN) == ("AuthenticAMD family 25 model 1 stepping 1", ("avx2",))
    assert _cpu_design(_GRAVITON) == ("ARM implementer 0x41 part 0xd40 variant 0x1", ("sve", "asimddp", "bf16", "i8mm"))
    assert _cpu_design("") == (None, None)


def test_two_cpus_of_one_name_differ_by_design_and_vector_extensions(tmp_path):
    milan = MachineInfo(cpu_model="AMD EPYC", cpu_id="AuthenticAMD family 25 model 1 stepping 1", cpu_isa=("avx2",))
    genoa = MachineInfo(cpu_model="AMD EPYC", cpu_id="AuthenticAMD family 25 model 17 stepping 1",
                        cpu_isa=("avx2", "avx512f", "avx512_bf16"))
    assert genoa.differences(milan) == [
        "CPU design 'AuthenticAMD family 25 model 17 stepping 1' vs 'AuthenticAMD family 25 model 1 stepping 1'",
        "vector extensions avx512_bf16 only in the profile, avx512f only in the profile"]
    assert milan.differences(genoa)[1] == "vector extensions avx512_bf16 only here, avx512f only here"
    assert milan.differences(milan.model_copy(update={"hostname": "other"})) == []
    # A profile that does not know its CPU's design (made before it was recorded) differs in nothing of it.
    assert MachineInfo(cpu_model="AMD EPYC").differences(milan) == []
    # Kept in the profile file.
    entries = [ProfileEntry(threads=1, batch=1, mean_ms=2.0)]
    loaded = Profile.load(Profile(model="toy", machine=genoa, entries=entries).save(tmp_path / "p.json"))
    assert loaded.machine == genoa


def test_show_says_placement_and_whether_the_machine_is_this_one(tmp_path):
    here = MachineInfo.current()
    if here.cpu_model is None:
        pytest.skip("this machine's CPU model is unknown")
    entries = [ProfileEntry(threads=1, batch=1, mean_ms=2.0, copies=2), ProfileEntry(threads=2, batch=1, mean_ms=1.5,
                                                                                     copies=1)]
    mine = Profile(model="toy", placement="co-located", machine=here, entries=entries).save(tmp_path / "mine.json")
    result = invoke("show", str(mine))
    assert result.exit_code == 0, result.output
    assert "placement: co-located" in result.output and "(1, 2 copies)" in result.output
    assert "matches this machine" in result.output and "NOT this machine" not in result.output
    assert json.loads(invoke("show", str(mine), "--json").output)["matches_this_machine"] is True

    other = Profile(model="toy", machine=MachineInfo(cpu_model="Imaginary CPU 9000"), entries=entries)
    path = other.save(tmp_path / "other.json")
    result = invoke("show", str(path))
    assert "placement: isolated" in result.output
    assert f"NOT this machine: CPU 'Imaginary CPU 9000' vs {here.cpu_model!r}" in result.output
    assert f"packrat-mq profile run --model toy --quick --fresh -o {path}" in result.output
    doc = json.loads(invoke("show", str(path), "--json").output)
    assert doc["placement"] == "isolated" and doc["matches_this_machine"] is False

    unknown = Profile(model="toy", entries=entries).save(tmp_path / "unknown.json")
    assert "cannot tell whether it is this one" in invoke("show", str(unknown)).output
    assert json.loads(invoke("show", str(unknown), "--json").output)["matches_this_machine"] is None


def test_import_records_the_placement(tmp_path):
    csv_path = tmp_path / "m.csv"
    csv_path.write_text("threads,batch_size,latency_ms\n1,1,10\n")
    assert invoke("import", str(csv_path), "-o", str(tmp_path / "a.json")).exit_code == 0
    assert Profile.load(tmp_path / "a.json").placement == "isolated"
    result = invoke("import", str(csv_path), "-o", str(tmp_path / "b.json"), "--placement", "co-located")
    assert result.exit_code == 0, result.output
    assert Profile.load(tmp_path / "b.json").placement == "co-located"


def test_show_says_how_far_the_passes_of_a_point_disagreed(tmp_path):
    entries = [ProfileEntry(threads=1, batch=1, mean_ms=60.0, pass_means_ms=[52.0, 68.0]),
               ProfileEntry(threads=1, batch=2, mean_ms=100.0, pass_means_ms=[99.0, 101.0])]
    path = Profile(model="toy", entries=entries).save(tmp_path / "p.json")
    assert Profile.load(path).entry(1, 1).pass_spread == pytest.approx(16 / 60)
    result = invoke("show", str(path))
    assert result.exit_code == 0, result.output
    assert "passes: 2 (2 of 2 points); their means spread by a median 2.0%, at most 26.7% (t=1 b=1)" in result.output
    doc = json.loads(invoke("show", str(path), "--json").output)
    assert doc["pass_spread"][0][0] == pytest.approx(16 / 60) and doc["pass_spread"][0][1] == pytest.approx(0.02)
    # One pass: no line, nulls.
    once = Profile(model="toy", entries=[ProfileEntry(threads=1, batch=1, mean_ms=60.0)]).save(tmp_path / "o.json")
    assert "passes:" not in invoke("show", str(once)).output
    assert json.loads(invoke("show", str(once), "--json").output)["pass_spread"] == [[None]]
    with pytest.raises(ValueError):
        ProfileEntry(threads=1, batch=1, mean_ms=60.0, pass_means_ms=[60.0])  # one pass is no list
