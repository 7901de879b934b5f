"""Graph modes: their names, the default backend, each backend answering as eager does, and a worker in each."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import ValidationError

from optimizer.planning.profile import Profile, ProfileError, profile_filename, resolve_profile_path
from optimizer.profiling.options import ProfilingOptions
from packrat_mq import graph
from packrat_mq.client import Client
from packrat_mq.deployment import Deployment
from packrat_mq.graph import BACKENDS, GraphModeError
from packrat_mq.handler import BaseHandler, Context, load_handler, run_batch
from packrat_mq.instances import Configuration
from packrat_mq.settings import Settings
from tests.cli_run import Started, assert_one_line_failure, run_cli
from tests.helpers import stop_supervisors
from workers.runtime import RuntimeSpec
from workers.supervisor import Supervisor

SMALL = "tests.graph_fixtures:SmallConvHandler"
KEYWORDS = "tests.graph_fixtures:KeywordHandler"
#: Backends that compile C++ (seconds per build, tens of seconds with a cold inductor cache).
COMPILING = ("compile", "aoti")


def backend_params(*backends: str) -> list[Any]:
    return [pytest.param(b, marks=pytest.mark.slow) if b in COMPILING else b for b in backends]


# --- names ---------------------------------------------------------------------------
def test_modes_are_named_as_before_and_by_backend() -> None:
    assert graph.parse(False) == graph.parse(None) == graph.parse("false") == graph.parse("") == "eager"
    assert graph.parse(True) == graph.parse("TRUE") == graph.parse("graph") == graph.parse("1") == "graph"
    assert [graph.parse(f" {b.upper()} ") for b in BACKENDS] == list(BACKENDS)
    assert graph.resolve("graph", "resnet50") == graph.default_backend("resnet50")
    assert graph.resolve("graph", "mypkg.mod:Mine") == graph.DEFAULT_BACKEND
    assert graph.resolve("export", "resnet50") == "export"
    assert graph.backend_of("eager") is None and graph.backend_of("graph", "bert") == graph.default_backend("bert")
    assert set(graph.MODEL_DEFAULTS.values()) <= set(BACKENDS)


def test_a_bad_mode_name_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(GraphModeError, match=r"unknown graph mode 'jit': use eager, graph \(the model's default "
                                             r"backend\), torchscript, compile, export, aoti"):
        graph.parse("jit")
    with pytest.raises(GraphModeError, match="unknown graph backend 'graph'"):
        graph.build(object(), None, "graph")
    monkeypatch.setenv("PACKRAT_GRAPH_MODE", "jit")
    with pytest.raises(ValidationError, match="unknown graph mode 'jit'"):
        Settings()
    with pytest.raises(ValidationError, match="unknown graph mode 'jit'"):
        RuntimeSpec(model="m", handler="echo", instance_id="i0", graph_mode="jit")
    with pytest.raises(ValidationError, match="unknown graph mode 'jit'"):
        ProfilingOptions(model="echo", graph="jit")


def test_settings_context_and_specs_take_a_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PACKRAT_GRAPH_MODE", "compile")
    assert Settings().graph_mode == "compile"
    monkeypatch.setenv("PACKRAT_GRAPH_MODE", "true")  # the boolean the setting was: the default backend
    assert Settings().graph_mode == "graph"
    monkeypatch.delenv("PACKRAT_GRAPH_MODE")
    assert Settings().graph_mode == "eager"
    assert Context(model_name="bert", graph_mode=True).graph_mode == graph.default_backend("bert")
    assert Context(model_name="m", graph_mode=False).graph_mode is None
    assert Context(model_name="m", graph_mode="eager").graph_mode is None
    spec = RuntimeSpec(model="m", handler="resnet50", instance_id="i0", graph_mode="graph")
    assert spec.graph_mode == graph.default_backend("resnet50") and spec.context().graph_mode == spec.graph_mode
    assert RuntimeSpec(model="m", handler="echo", instance_id="i0").graph_mode is None
    assert ProfilingOptions(model="bert", graph=True).mode == graph.default_backend("bert")
    assert ProfilingOptions(model="echo").mode == "eager"


def test_documents_and_profiles_from_the_boolean_days_read_as_torchscript(tmp_path: Path) -> None:
    assert Deployment(model="m", handler="m", graph_mode=True, instances=[]).graph_mode == "torchscript"
    assert Deployment(model="m", handler="m", graph_mode=False, instances=[]).graph_mode is None
    assert Deployment(model="m", handler="m", graph_mode="eager", instances=[]).graph_mode is None
    assert Profile(model="toy", mode="graph").mode == "torchscript"
    assert [profile_filename("toy", m) for m in ("eager", *BACKENDS)] == [
        "toy.json", "toy.torchscript.json", "toy.compile.json", "toy.export.json", "toy.aoti.json"]
    with pytest.raises(ProfileError, match="unknown profile mode 'graph'"):
        profile_filename("toy", "graph")
    legacy = tmp_path / "toy.graph.json"
    legacy.write_text('{"format_version": 3, "model": "toy", "mode": "graph", "placement": "isolated"}')
    assert resolve_profile_path("toy", [tmp_path], mode="torchscript") == legacy
    assert Profile.load(legacy).mode == "torchscript"
    with pytest.raises(ProfileError, match=r"no compile profile for model 'toy' \(toy\.compile\.json\)"):
        resolve_profile_path("toy", [tmp_path], mode="compile")
    Profile(model="toy", mode="torchscript").save(tmp_path / "toy.torchscript.json")
    assert resolve_profile_path("toy", [tmp_path], mode="torchscript") == tmp_path / "toy.torchscript.json"


# --- each backend answers as eager does ------------------------------------------------
def make(spec: str, mode: str | None, batch: int = 4) -> BaseHandler:
    handler = load_handler(spec)
    handler.initialize(Context(model_name="small", threads=1, batch_size=batch, graph_mode=mode))
    return handler


def outputs(handler: BaseHandler, n: int) -> list[list[float]]:
    result = run_batch(handler, handler.example_batch(n))
    assert all(o.ok for o in result.outcomes), [o.error for o in result.outcomes]
    return [o.value for o in result.outcomes]


def close(a: list[list[float]], b: list[list[float]], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("backend", backend_params(*BACKENDS))
def test_each_backend_answers_as_eager_at_every_sub_batch_size(backend: str) -> None:
    pytest.importorskip("torch")
    eager, built = make(SMALL, None), make(SMALL, backend)
    assert type(built.model) is not type(eager.model)
    # The built size, a partial sub-batch (padded for the static backends) and a bigger one (in pieces).
    for n in (4, 3, 1, 6, 8):
        assert close(outputs(built, n), outputs(eager, n)), f"{backend} at {n} rows"


@pytest.mark.parametrize("backend", backend_params("torchscript", "compile", "export"))
def test_keyword_inputs_reach_the_graph_by_name(backend: str) -> None:
    pytest.importorskip("torch")
    eager, built = make(KEYWORDS, None, batch=2), make(KEYWORDS, backend, batch=2)
    for n in (2, 1, 5):
        assert close(outputs(built, n), outputs(eager, n)), f"{backend} at {n} rows"


def test_a_model_a_backend_cannot_build_fails_the_start_saying_so() -> None:
    pytest.importorskip("torch")
    with pytest.raises(GraphModeError, match=r"graph backend export cannot build Branchy: .*"
                                             r"\(serve it eager, or with another backend: torchscript, compile, aoti\)"):
        make("tests.graph_fixtures:DataDependent", "export")
    make("tests.graph_fixtures:DataDependent", None)  # eager serves it


def test_inputs_without_a_batch_dimension_are_refused() -> None:
    pytest.importorskip("torch")
    import torch

    with pytest.raises(GraphModeError, match="first dimension"):
        graph.build(torch.nn.Bilinear(2, 2, 2), (torch.ones(3, 2), torch.ones(4, 2)), "export")


# --- a worker in each mode -----------------------------------------------------------------
@pytest.fixture
def supervisors() -> Iterator[list[Supervisor]]:
    made: list[Supervisor] = []
    yield made
    stop_supervisors(made, 3)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", backend_params("eager", *BACKENDS))
def test_a_worker_starts_and_serves_in_each_mode(mode: str, r: redis.Redis, settings: Settings, redis_url: str,
                                                 prefix: str, supervisors: list[Supervisor]) -> None:
    pytest.importorskip("torch")
    quiet = settings.model_copy(update={"log_level": "WARNING", "graph_mode": mode})
    sup = Supervisor(r, quiet, redis_url, "small", Configuration.parse("1x2"), handler=SMALL, node="n1")
    supervisors.append(sup)
    sup.start(ready_timeout=150)
    assert sup.deployment.graph_mode == (None if mode == "eager" else mode)
    replies = Client(r, prefix=prefix).submit_many("small", [{"seed": i} for i in range(3)], timeout=60)
    assert all(reply.ok for reply in replies), [reply.error for reply in replies]
    assert close([reply.value() for reply in replies], outputs(make(SMALL, None), 3))


# --- the command line ----------------------------------------------------------------------
def test_a_bad_graph_mode_is_one_line_before_anything_starts() -> None:
    assert_one_line_failure(run_cli("up", "-m", "echo", "--graph", "jit"), says="unknown graph mode 'jit'")
    assert_one_line_failure(run_cli("profile", "run", "--model", "echo", "--graph", "jit"),
                            says="unknown graph mode 'jit'")
    assert_one_line_failure(run_cli("up", "-m", "echo", env={"PACKRAT_GRAPH_MODE": "jit"}),
                            says="PACKRAT_GRAPH_MODE: unknown graph mode 'jit'")


def test_up_with_a_backend_that_cannot_build_the_model_says_so_and_stops() -> None:
    pytest.importorskip("torch")
    started = Started("up", "-m", "tests.graph_fixtures:DataDependent", "--graph", "export", "-i", "1x1")
    started.proc.wait(120)
    run = started.finish()
    assert run.returncode == 1, run.stdout
    assert run.stdout.strip().splitlines()[-1].startswith("Error: datadependent did not start: instance "), run.stdout
    # Its log says why in one line: the backend, the model, what to serve it with instead.
    assert "cannot start: graph backend export cannot build Branchy" in run.stdout, run.stdout
    assert "serve it eager, or with another backend: torchscript, compile, aoti" in run.stdout
    assert "Traceback" not in run.stdout, run.stdout
    assert not run.leftovers, f"left behind: {run.leftovers}\n{run.stdout}"


# --- the benchmark's tables ------------------------------------------------------------------
def test_bench_graph_compares_modes_within_each_round() -> None:
    from benchmarks.bench_graph import report, summarise

    point = {"warmup": {"eager": {"warmup_s": 0.1}, "compile": {"warmup_s": 30.0}},
             "rounds_ms": {"eager": [[100.0, 110.0], [300.0]], "compile": [[50.0, 70.0], [90.0]]},
             "load_avg": [1.0, 2.0], "errors": {}, "max_abs_diff": {}}
    result = {"modes": ["eager", "compile"], "threads": 2, "date": "d",
              "models": {"toy": {"points": {"1": point}, "errors": {}, "restarts": {}, "load_s": {}}}}
    row = summarise(result)["toy"]["1"]
    # Per round: 60/105 and 90/300; eager's median of round medians is 202.5 ms.
    assert row["compile"]["ratio_median"] == pytest.approx((60 / 105 + 90 / 300) / 2)
    assert row["eager"]["median_ms"] == pytest.approx(202.5) and row["compile"]["best_ratio"] == pytest.approx(0.5)
    table = report(result)
    assert "| toy | 1 | 202.5 (105.0–300.0) (0.1) | 75.0 (60.0–90.0) (30.0) |" in table
