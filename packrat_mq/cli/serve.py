"""``packrat-mq up``, ``dispatch`` and ``pool``: running the serving stack."""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import click

from dispatcher.dispatcher import Dispatcher
from dispatcher.partitioning import latency_from_profile
from optimizer.planning.profile import Profile, ProfileError
from optimizer.planning.selection import choose, find_profile, machine_warning
from packrat_mq import graph as graph_modes
from packrat_mq import logs
from packrat_mq.cli.helpers import (
    connect_or_fail,
    err,
    graph_options,
    parse_handler_options,
    redis_options,
    remember_url,
    require_handler,
)
from packrat_mq.connection import EmbeddedRedis, connect, discover_url
from packrat_mq.exposition import Exporter, ExporterError, Views, serve
from packrat_mq.handler import ZOO
from packrat_mq.instances import Configuration, ConfigurationError
from packrat_mq.interrupts import uninterrupted
from packrat_mq.keys import check_model_name
from packrat_mq.settings import Settings
from packrat_mq.topology import Topology, format_cpulist
from workers.allocation import AllocationError, allocate
from workers.supervisor import Supervisor

#: The models a simulated machine (``--simulate-cores``) may serve: they sleep instead of
#: computing, so N "cores" of instances fit on this machine's few.
SIMULATED_MODELS = ("echo", "sleep", "profiled")


@dataclass
class ServePlan:
    """What to serve, from the options ``up`` and ``pool`` share."""

    model: str
    handler: str
    configuration: Configuration
    profile_path: str | None
    options: dict[str, Any]
    node: str | None
    #: The concrete graph mode: ``eager`` or a backend (``--graph`` alone resolved for the model).
    graph: str
    #: Stop (in order) when the program that started this one dies.
    exit_with_parent: bool = False
    #: The dispatcher's estimator chooses B from the load (no --batch, or --adaptive).
    adaptive: bool = False
    #: T: the cores the optimizer plans with, now and at every reconfiguration.
    threads: int | None = None
    #: The machine to allocate on: a synthetic one with ``--simulate-cores``, else None (this one).
    topology: Topology | None = None
    #: Settings the command line gives (``--spares``, ``--prewarm``), applied over the environment's.
    setting_updates: dict[str, Any] = field(default_factory=dict)

    def settings(self, settings: Settings) -> Settings:
        """``settings`` with this plan's graph mode and command-line settings."""
        return settings.model_copy(update={"graph_mode": self.graph, **self.setting_updates})


def model_and_handler(model: str, name: str | None) -> tuple[str, str]:
    """(served name, handler spec): ``--model pkg.mod:MyHandler`` is served as ``myhandler``."""
    served = name or (model.rsplit(":", 1)[1].lower() if ":" in model else model)
    try:
        return check_model_name(served), model
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--name") from None


def require_cores(config: Configuration, topology: Topology) -> None:
    """The configuration fits the cores ``topology`` has (this process may use), or one line says how not."""
    try:
        allocate(topology, config)
    except AllocationError as exc:
        raise click.ClickException(f"{exc}: ask for fewer (--threads, --instances)") from None


def choose_configuration(
    model: str, instances: str | None, threads: int | None, batch: int | None, profile: str | None,
    graph: str = "eager", handler: str | None = None, topology: Topology | None = None, *, fit: bool = False,
) -> tuple[Configuration, str | None]:
    """The configuration to serve with, and the profile it came from (if any).

    ``--instances`` wins; otherwise :func:`optimizer.planning.selection.choose` decides
    for ``--threads`` (default: the cores of one socket of ``topology``, this machine's
    when None) and ``--batch``. Without ``--profile`` the model's profile of the mode
    ``graph`` served in is used (``profiles/<model>.<backend>.json`` for a graph
    backend, else ``profiles/<model>.json``). A profile measured on another kind of machine is used
    all the same, with a warning on stderr that says so and how to profile this
    machine; not on a simulated machine, which no profile was measured on. With
    ``fit`` the configuration (and ``--threads``) must fit the cores of ``topology``,
    checked before any of that is said.
    """
    simulated = topology is not None and topology.simulated
    machine = topology or Topology.detect()
    if fit and threads is not None and threads > machine.physical_cores:
        raise click.ClickException(
            f"--threads {threads}: this process may use {machine.physical_cores} physical cores "
            f"(cpus {format_cpulist(machine.allowed)}); give --threads {machine.physical_cores} or fewer")
    if instances:
        try:
            config = Configuration.parse(instances)
        except ConfigurationError as exc:
            raise click.BadParameter(str(exc), param_hint="--instances") from None
        if fit:
            require_cores(config, machine)
        # A hand-given configuration still has the profile split partial batches.
        try:
            path = find_profile(model, profile, mode=graph)
        except ProfileError:
            raise click.BadParameter(f"no profile {profile!r}", param_hint="--profile") from None
        if path is not None:
            err(f"profile for splitting partial batches: {path}")
            try:
                warning = machine_warning(Profile.load(path), path, handler or model, mode=graph,
                                          threads=config.threads, batch=config.batch, named=profile is not None)
            except ProfileError:
                warning = None  # a broken file is the dispatcher's to report when it reads it
            if warning and not simulated:
                err(warning)
        return config, str(path) if path else None
    try:
        choice = choose(model, threads or machine.max_cores_per_socket, batch or 1, profile,
                        mode=graph, handler=handler)
    except ValueError as exc:
        raise click.ClickException(f"optimizer: {exc}") from None
    if fit:
        require_cores(choice.configuration, machine)
    err(choice.note)
    if choice.warning and not simulated:
        err(choice.warning)
    return choice.configuration, str(choice.profile_path) if choice.profile_path else None


def simulated_topology(cores: int | None, handler: str) -> Topology | None:
    """``--simulate-cores N``: one synthetic socket of N cores, for a model that only sleeps; else None.

    Refused (one line, before anything starts) for any other model: it would
    really compute, with N threads' worth of instances on this machine's cores.
    """
    if cores is None:
        return None
    allowed = {ZOO[name] for name in SIMULATED_MODELS}
    if ZOO.get(handler, handler) not in allowed:
        raise click.ClickException(
            f"--simulate-cores serves only models that sleep instead of computing "
            f"({', '.join(SIMULATED_MODELS)}), not {handler!r}"
        )
    return Topology.synthetic(cores)


def profiled_profile(served: str, profile: str | None, options: dict[str, Any],
                     graph: str = "eager") -> tuple[str | None, dict[str, Any]]:
    """For ``--model profiled``: one profile for the handler to sleep by and the optimizer to plan from.

    ``-o profile=P`` plans from P too when ``--profile`` is not given, and
    ``--profile P`` is what the instances sleep by when ``-o profile`` is not;
    either is a path or a model name (``profiles/<name>.json``), handed to the
    instances as an absolute path.
    """
    given = options.get("profile")
    if given is None and profile is None:
        raise click.ClickException("the profiled model needs a profile: -o profile=PATH (or --profile PATH)")
    source, hint = (str(given), "--option profile") if given is not None else (str(profile), "--profile")
    try:
        path = find_profile(served, source, mode=graph)
    except ProfileError as exc:
        raise click.BadParameter(str(exc), param_hint=hint) from None
    assert path is not None  # a named profile is found or raises
    return (profile if profile is not None else str(path)), {**options, "profile": str(path.resolve())}


def serving_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The options that say what to serve; the command receives a :class:`ServePlan` as ``plan``."""

    @click.option("--model", "-m", required=True,
                  help="Zoo name (echo, sleep, profiled, resnet50, inception_v3, bert, gpt2, minilm) or module:Class.")
    @click.option("--instances", "-i", envvar="PACKRAT_INSTANCES", default=None,
                  help='Configuration by hand: "TxB,TxB,..." (e.g. "2x4,2x4" or "2*1x4"); '
                       "env PACKRAT_INSTANCES. Else the optimizer picks.")
    @click.option("--threads", "-t", type=click.IntRange(min=1), default=None,
                  help="Threads T for the optimizer (default: cores of one socket; N with --simulate-cores).")
    @click.option("--batch", "-b", type=click.IntRange(min=1), default=None,
                  help="Aggregated batch B for the optimizer; pins B. Without it (and without --instances) "
                       "B is adaptive: estimated from the load, starting at 1.")
    @click.option("--adaptive", is_flag=True, default=False,
                  help="Estimate B from the load even with --batch/--instances (they give the starting point).")
    @click.option("--profile", default=None,
                  help="Profile JSON (default: profiles/<model>.json; profiles/<model>.<backend>.json "
                       "in a graph mode, e.g. resnet50.compile.json).")
    @graph_options
    @click.option("--option", "-o", "option_pairs", multiple=True, metavar="KEY=VALUE",
                  help="Handler option (repeatable), e.g. -o base_ms=5 for sleep.")
    @click.option("--node", default=None, help="Node name in instance ids (default: host name).")
    @click.option("--name", default=None,
                  help="Name to serve the model under (default: the zoo name, or the handler class).")
    @click.option("--exit-with-parent/--no-exit-with-parent", envvar="PACKRAT_EXIT_WITH_PARENT", default=False,
                  help="Stop in order when the program that started this command dies (a test runner, "
                       "a process manager); env PACKRAT_EXIT_WITH_PARENT=1.")
    @click.option("--simulate-cores", type=click.IntRange(min=1), default=None, metavar="N",
                  help="Simulate one socket of N cores: cpus 0..N-1 are labels, nothing is pinned. "
                       "Only for echo, sleep and profiled (which sleeps as a profile says).")
    @click.option("--spares", type=click.IntRange(min=0), default=None, metavar="N",
                  help="Loaded instances to keep beyond those serving, for reconfigurations to rebind in place "
                       "instead of starting processes (default: the largest plan's instance count when B is "
                       "adaptive, else 0); env PACKRAT_SPARE_INSTANCES.")
    @click.option("--prewarm/--no-prewarm", default=None,
                  help="Start the spares right after start-up, one at a time, so the first change is fast too "
                       "(default: on when B is adaptive); env PACKRAT_PREWARM_SPARES.")
    @functools.wraps(func)
    def wrapper(*args: Any, model: str, instances: str | None, threads: int | None, batch: int | None,
                adaptive: bool, profile: str | None, graph: str | None, option_pairs: tuple[str, ...],
                node: str | None, name: str | None, exit_with_parent: bool, simulate_cores: int | None,
                spares: int | None, prewarm: bool | None, **kwargs: Any) -> Any:
        served, handler = model_and_handler(model, name)
        require_handler(handler)
        settings = kwargs.get("settings") or Settings()
        # --graph/--eager, else PACKRAT_GRAPH_MODE; `graph` is this model's default backend.
        graph = graph_modes.resolve(graph if graph is not None else settings.graph_mode, handler)
        topology = simulated_topology(simulate_cores, handler)
        options = parse_handler_options(option_pairs)
        if ZOO.get(handler, handler) == ZOO["profiled"]:
            profile, options = profiled_profile(served, profile, options, graph)
        config, profile_path = choose_configuration(served, instances, threads, batch, profile, graph, handler,
                                                    topology, fit=True)
        adaptive = adaptive or (batch is None and instances is None)
        updates: dict[str, Any] = {}
        if spares is not None:
            updates["spare_instances"] = spares
        if prewarm is not None:
            updates["prewarm_spares"] = prewarm
        plan = ServePlan(served, handler, config, profile_path, options, node, graph, exit_with_parent,
                         adaptive=adaptive, threads=threads, topology=topology, setting_updates=updates)
        return func(*args, plan=plan, **kwargs)

    return wrapper


def _run(settings: Settings, url: str, plan: ServePlan, *, with_dispatcher: bool) -> None:
    """Start the stack, supervise it until Ctrl-C/SIGTERM, stop it in order.

    However it ends (a signal, an instance that fails to start, an error),
    what was started is stopped the same way: dispatcher first, then the
    instances after they drain. A second signal meanwhile waits until that
    stop is done (:func:`uninterrupted`); it is bounded by the supervisor's
    timeouts.
    """
    config = plan.configuration
    try:
        service = Supervisor(connect(url), settings, url, plan.model, config, handler=plan.handler,
                             options=plan.options, profile=plan.profile_path, node=plan.node,
                             topology=plan.topology, with_dispatcher=with_dispatcher,
                             exit_with_parent=plan.exit_with_parent, adaptive=plan.adaptive,
                             threads_budget=plan.threads)
    except AllocationError as exc:
        raise click.ClickException(str(exc)) from None
    with metrics_endpoint(settings, lambda: [service.metrics_view()]):
        if plan.topology is not None and plan.topology.simulated:
            click.echo(f"simulating one socket of {plan.topology.physical_cores} cores: the cpus below are labels, "
                       "no instance is pinned")
        if plan.adaptive and plan.graph in graph_modes.COMPILING:
            err(f"note: graph mode {plan.graph} compiles the model at every instance start (tens of seconds, "
                f"docs/figures.md); adaptive B starts new instances whenever a change needs other thread "
                f"counts, and waits for them. --graph torchscript starts in seconds")
        click.echo(f"starting {plan.model}: {config} (B={config.batch}, {config.threads} threads"
                   + (f", graph mode {plan.graph}" if plan.graph != "eager" else "")
                   + (f", predicted {config.predicted_latency_ms:.2f} ms" if config.predicted_latency_ms else "")
                   + (f"; adaptive: B follows the load, {settings.adaptive_min_batch}..{settings.adaptive_max_batch}, "
                      f"planned for T={service.threads_budget}" if plan.adaptive else "; B pinned") + ")")
        serving = False
        try:
            try:
                service.start()
            except (RuntimeError, TimeoutError) as exc:  # an instance or the dispatcher did not come up
                raise click.ClickException(f"{plan.model} did not start: {exc}") from None
            for inst in service.instances:
                pid = inst.child.process.pid if inst.child.process else "-"
                click.echo(f"  instance {inst.record.id}: {inst.record.threads} threads, batch {inst.record.batch}, "
                           f"cpus {inst.record.cpus}, pid {pid}")
            click.echo(f"ready: XADD {settings.keys.requests(plan.model)} * id <id> reply_to <stream> payload <bytes> "
                       f"content_type application/json   (Ctrl-C to stop)")
            serving = True
            service.serve_forever()
        finally:
            with uninterrupted():
                if serving:
                    click.echo("stopping: dispatcher, then instances after they drain" if with_dispatcher
                               else "stopping: instances after they drain")
                service.stop()


@contextlib.contextmanager
def metrics_endpoint(settings: Settings, views: Views) -> Iterator[Exporter | None]:
    """The metrics endpoint for the block, when ``PACKRAT_METRICS_PORT`` is set (its URL said on stdout).

    Started before anything else, so a port in use fails with one line before a process starts.
    """
    try:
        exporter = serve(settings, views)
    except ExporterError as exc:
        raise click.ClickException(f"{exc} (PACKRAT_METRICS_PORT, PACKRAT_METRICS_ADDRESS)") from None
    if exporter is None:
        yield None
        return
    click.echo(f"metrics: {exporter.url}")
    with exporter:
        yield exporter


@click.command()
@redis_options(check=True, embedded_ok=True)  # outermost: a bad URL fails before anything runs
@serving_options
@click.option("--batch-timeout-ms", type=click.FloatRange(min=0), default=None,
              help="Send a partial batch this long after its first request.")
def up(settings: Settings, plan: ServePlan, batch_timeout_ms: float | None) -> None:
    """Serve MODEL: worker pool + dispatcher (+ embedded Redis) until Ctrl-C.

    \b
    Examples:
      packrat-mq up --model echo --instances 1x4,1x4               # by hand, B pinned at 8
      packrat-mq up --model resnet50                               # adaptive: B follows the load from 1
      packrat-mq up --model resnet50 --threads 16 --batch 32      # optimizer picks, B pinned
      packrat-mq up --model resnet50 --batch 8 --adaptive         # adaptive, starting at B=8
      packrat-mq up --model resnet50 --no-prewarm                  # adaptive, spares only once a change retires some
      packrat-mq up --model minilm -i 2*1x4 --redis-url redis://localhost:6379/0
      packrat-mq up --model profiled -o profile=profiles/sim/resnet50-16core.json -o time_scale=0.1 \\
                    --simulate-cores 64                            # 64 simulated cores, adaptive B
    """
    logs.configure(settings, "up")
    settings = plan.settings(settings)
    if batch_timeout_ms is not None:
        settings = settings.model_copy(update={"batch_timeout_ms": batch_timeout_ms})
    embedded = None
    try:
        url = settings.redis_url or discover_url()
        if url is None:
            embedded = EmbeddedRedis()
            url = embedded.start().url
            click.echo(f"embedded Redis at {url} (other packrat-mq commands find it; redis-cli -s {url[7:]})")
        remember_url(url)
        _run(settings, url, plan, with_dispatcher=True)
    finally:
        if embedded is not None:
            embedded.stop()  # last: the instances drained through it


@click.command()
@redis_options(check=True)
@serving_options
def pool(settings: Settings, plan: ServePlan) -> None:
    """Run only this node's worker pool for MODEL (for docker-compose; needs a Redis URL).

    \b
    Example:
      packrat-mq pool --model resnet50 -i 4*4x8 --redis-url redis://redis:6379/0
    """
    logs.configure(settings, "pool")
    settings = plan.settings(settings)
    _, url = connect_or_fail(settings)
    _run(settings, url, plan, with_dispatcher=False)


@click.command()
@click.option("--model", "-m", required=True, help="Model whose request stream to dispatch.")
@click.option("--batch-timeout-ms", type=click.FloatRange(min=0), default=None,
              help="Send a partial batch this long after its first request.")
@click.option("--profile", default=None, help="Profile JSON to split partial batches by measured latency (and to know what each B can serve, for the estimator).")
@redis_options
def dispatch(settings: Settings, model: str, batch_timeout_ms: float | None, profile: str | None) -> None:
    """Run only the dispatcher of MODEL (for docker-compose; needs a Redis URL).

    \b
    Example:
      packrat-mq dispatch --model resnet50 --redis-url redis://redis:6379/0
    """
    try:
        check_model_name(model)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from None
    try:
        latency = latency_from_profile(profile) if profile else None
    except ProfileError as exc:
        raise click.BadParameter(str(exc), param_hint="--profile") from None
    logs.configure(settings, f"dispatcher {model}")
    if batch_timeout_ms is not None:
        settings = settings.model_copy(update={"batch_timeout_ms": batch_timeout_ms})
    _, url = connect_or_fail(settings)
    d = Dispatcher(connect(url), settings, model, latency=latency, profile=profile)
    with metrics_endpoint(settings, lambda: [d.metrics_view()]):
        d.serve()
