"""``packrat-mq profile run``: measure a model's latency profile on this machine.

Here, in pinned child processes (see :mod:`optimizer.profiling`), or with
``--enqueue`` as an RQ job on another node's profiling worker.
"""
from __future__ import annotations

import socket
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from optimizer.planning.profile import DEFAULT_MAX_BATCH, profile_machine, profile_path
from optimizer.profiling.jobs import enqueue_profile, profile_queue_name, result_name, worker_command
from optimizer.profiling.options import (
    QUICK_SCHEDULE,
    ProfilingError,
    ProfilingOptions,
    default_output,
    power_of_two_batches,
    profile_name,
)
from optimizer.profiling.scheduler import profile_model
from packrat_mq.cli.helpers import (
    connect_or_fail,
    echo_json,
    err,
    graph_options,
    parse_handler_options,
    redis_options,
    require_handler,
)
from packrat_mq.connection import redact
from packrat_mq.settings import Settings


def _int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        out = [int(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers such as 1,2,4,8, got {value!r}") from None
    if not out or any(v < 1 for v in out):
        raise click.BadParameter(f"expected positive integers, got {value!r}")
    return out


@click.command("run")
@click.option("--model", "models", multiple=True, required=True,
              help="Zoo name (resnet50, bert, echo, ...) or module:Class; repeat for several models.")
@click.option("--threads-max", type=click.IntRange(min=1), default=None,
              help="Profile t = 1..T threads [default: the allowed physical cores of one socket].")
@click.option("--batches", callback=_int_list, default=None, metavar="LIST",
              help="Batch sizes, e.g. 1,2,4,8 [default: powers of two up to --max-batch].")
@click.option("--max-batch", type=click.IntRange(min=1), default=DEFAULT_MAX_BATCH, show_default=True,
              help="Largest batch size when --batches is not given.")
@graph_options
@click.option("--co-located/--isolated", "co_located", default=True, show_default=True,
              help="Time each (threads, batch) beside copies of itself on the socket's other cores "
              "(T // threads copies, the slowest taken: what a packed machine serves), or alone.")
@click.option("--quick", is_flag=True,
              help="A fast profile of what the optimizer needs for --threads-max and --max-batch: "
              f"--warmup {QUICK_SCHEDULE['warmup']}, --min-iters {QUICK_SCHEDULE['min_iters']}, "
              f"--max-iters {QUICK_SCHEDULE['max_iters']}, --rel-ci {QUICK_SCHEDULE['rel_ci']:g}, "
              f"--budget-s {QUICK_SCHEDULE['budget_s']:g}, --min-timed-s {QUICK_SCHEDULE['min_timed_s']:g} "
              "(any of them given explicitly still wins).")
@click.option("--passes", type=click.IntRange(1, 10), default=1, show_default=True,
              help="Measure the whole grid N times, each pass in fresh processes, and take each point's mean "
                   "of its passes: on a shared host whose speed moves by the minute, the profile is then "
                   "the host's usual speed rather than one moment's, and the summary says how far the passes "
                   "disagreed. Each pass gets 1/N of a point's iterations and budget.")
@click.option("--option", "model_options", multiple=True, metavar="KEY=VALUE",
              help="Handler option (Context.options), e.g. --option base_ms=5 for sleep.")
@click.option("--rel-ci", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.02,
              show_default=True, help="Stop timing once the mean is known within this fraction.")
@click.option("--confidence", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.95,
              show_default=True, help="Confidence level of that interval.")
@click.option("--min-iters", type=click.IntRange(min=2), default=5, show_default=True)
@click.option("--max-iters", type=click.IntRange(min=2), default=100, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True,
              help="Untimed iterations before timing each (threads, batch).")
@click.option("--budget-s", type=click.FloatRange(0, min_open=True), default=30.0, show_default=True,
              help="Time budget per (threads, batch); --min-iters are always run.")
@click.option("--min-timed-s", type=click.FloatRange(min=0), default=3.0, show_default=True,
              help="Seconds of timed iterations a (threads, batch) needs before it counts as converged: "
                   "a shared host's speed moves in spells of seconds, and a few tight samples of one "
                   "quiet spell are no mean of it.")
@click.option("--max-latency-ms", type=click.FloatRange(0, min_open=True), default=None,
              help="Latency SLO: stop growing the batch at a thread count once slower than this "
              "(the profile then only plans under the SLO).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Profile file [default: profiles/<model>.json, profiles/<model>.<backend>.json in a graph mode; "
              "profiles/machines/<this machine>/... when that file holds another machine's profile].")
@click.option("--fresh", is_flag=True, help="Ignore points already in the output file and start over.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the run report as JSON.")
@click.option("--enqueue", is_flag=True,
              help="Do not measure here: queue an RQ job per model and --node for that node's worker.")
@click.option("--node", "nodes", multiple=True,
              help="With --enqueue: node(s) to profile on [default: this host].")
@click.option("--queue", "queue_name", default=None,
              help="With --enqueue: RQ queue name [default: packrat-profile-<node>].")
@click.option("--store-dir", default="profiles", show_default=True,
              help="With --enqueue: directory on the worker's node the profile is written to.")
@click.option("--job-timeout", type=click.IntRange(min=1), default=6 * 3600, show_default=True,
              help="With --enqueue: seconds before RQ gives the job up.")
@redis_options
def run(
    settings: Settings,
    models: tuple[str, ...],
    threads_max: int | None,
    batches: list[int] | None,
    max_batch: int,
    graph: str | None,
    co_located: bool,
    quick: bool,
    passes: int,
    model_options: tuple[str, ...],
    rel_ci: float,
    confidence: float,
    min_iters: int,
    max_iters: int,
    warmup: int,
    budget_s: float,
    min_timed_s: float,
    max_latency_ms: float | None,
    output: Path | None,
    fresh: bool,
    quiet: bool,
    as_json: bool,
    enqueue: bool,
    nodes: tuple[str, ...],
    queue_name: str | None,
    store_dir: str,
    job_timeout: int,
) -> None:
    """Measure L[threads, batch] of a model the way it is served.

    Each thread count t runs in fresh processes pinned to t physical cores of
    one socket, as many copies as fill the T cores profiled (T // t; one with
    --isolated), started as served instances are; each batch size is timed in
    rounds that run every copy at once, the slowest copy being the sample,
    until its mean is known within --rel-ci. The profile is saved after every
    point: Ctrl-C keeps what is done, and the same command resumes.

    \b
    Examples:
      packrat-mq profile run --model resnet50 --max-batch 32
      packrat-mq profile run --model resnet50 --quick            # t = 1..cores, b = 1,2,4..32, in minutes
      packrat-mq profile run --model resnet50 --quick --passes 3 # a noisy shared host: the mean of 3 passes
      packrat-mq profile run --model resnet50 --isolated -o resnet50-isolated.json
      packrat-mq profile run --model sleep --option base_ms=5 --batches 1,2,4 --threads-max 2
      packrat-mq profile run --model bert --enqueue --node gpu-box-7 --redis-url redis://broker:6379
    """
    if quick:
        # The quick schedule replaces the defaults, not what was asked for.
        ctx = click.get_current_context()
        schedule = {name: value for name, value in QUICK_SCHEDULE.items()
                    if ctx.get_parameter_source(name) is ParameterSource.DEFAULT}
        warmup = schedule.get("warmup", warmup)
        min_iters = schedule.get("min_iters", min_iters)
        max_iters = schedule.get("max_iters", max_iters)
        rel_ci = schedule.get("rel_ci", rel_ci)
        budget_s = schedule.get("budget_s", budget_s)
        min_timed_s = schedule.get("min_timed_s", min_timed_s)
        if "max_iters" in schedule:
            max_iters = max(max_iters, min_iters)  # --quick --min-iters 30 asks for 30
    for model in models:
        require_handler(model, here=not enqueue)  # before a child starts, or a job is queued for nothing
    if output is not None and len(models) > 1:
        raise click.UsageError("-o/--output names one file; give one --model, or leave -o out")
    if max_iters < min_iters:
        raise click.UsageError(f"--max-iters ({max_iters}) must be >= --min-iters ({min_iters})")
    handler_options = parse_handler_options(model_options)
    all_options = [
        ProfilingOptions(
            model=model,
            threads_max=threads_max,
            batches=batches or power_of_two_batches(max_batch),
            # --graph/--eager, else PACKRAT_GRAPH_MODE; `graph` resolves to the model's default backend.
            graph=graph if graph is not None else settings.graph_mode,
            placement="co-located" if co_located else "isolated",
            options=handler_options,
            rel_ci=rel_ci,
            confidence=confidence,
            min_iters=min_iters,
            max_iters=max_iters,
            warmup=warmup,
            budget_s=budget_s,
            min_timed_s=min_timed_s,
            max_latency_ms=max_latency_ms,
            passes=passes,
        )
        for model in models
    ]
    if enqueue:
        _enqueue(settings, all_options, nodes, queue_name, store_dir, fresh, job_timeout, as_json)
        return
    if nodes or queue_name:
        raise click.UsageError("--node and --queue only apply with --enqueue")

    reports = []
    failed = interrupted = False
    for options in all_options:
        try:
            target = output if output is not None else _default_output(options, say=not as_json)
            report = profile_model(options, target, fresh=fresh, progress=not quiet and not as_json)
        except ProfilingError as exc:
            raise click.ClickException(str(exc)) from None
        reports.append(report)
        if not as_json:
            click.echo(report.summary())
        failed = failed or bool(report.failed)
        if report.interrupted:
            interrupted = True
            break
    if as_json:
        echo_json([r.as_dict() for r in reports])
    if interrupted:
        sys.exit(130)
    if failed:
        sys.exit(1)


def _default_output(options: ProfilingOptions, *, say: bool) -> Path:
    """Where the profile goes without ``-o`` (``default_output``), saying why when it is not the usual file.

    It is not when the usual file holds another machine's profile: this
    machine's then goes to its own ``profiles/machines/<key>/``.
    """
    path = default_output(options.model, options.graph)
    usual = profile_path(profile_name(options.model), options.graph)
    theirs = profile_machine(usual) if say and path != usual else None
    if theirs is not None:
        click.echo(f"{usual} holds another machine's profile ({theirs.summary()}); this machine's goes beside "
                   f"it, to {path}, where lookups on this machine find it", err=True)
    return path


def _enqueue(
    settings: Settings, all_options: list[ProfilingOptions], nodes: tuple[str, ...], queue_name: str | None,
    store_dir: str, fresh: bool, job_timeout: int, as_json: bool,
) -> None:
    if settings.cluster:
        # RQ's own transactions span keys of several slots (rq/rq#1942, CROSSSLOT).
        raise click.UsageError("--enqueue needs a Redis that is not a cluster: RQ does not run on Redis Cluster. "
                               "Queue the jobs on a plain Redis (--redis-url redis://...), or profile on the node "
                               "itself without --enqueue")
    r, url = connect_or_fail(settings)
    targets = nodes or (socket.gethostname(),)
    jobs = []
    for node in targets:
        queue = queue_name or profile_queue_name(node)
        for options in all_options:
            job = enqueue_profile(
                r, options, node=node, queue=queue, prefix=settings.prefix,
                store_dir=store_dir, fresh=fresh, job_timeout_s=job_timeout,
            )
            jobs.append({
                "job_id": job.id, "model": options.model, "node": node, "queue": queue,
                "result_key": settings.keys.profile_result(result_name(options), node),
                "worker_command": worker_command(queue, redact(url)),
            })
    if as_json:
        echo_json(jobs)
        return
    for j in jobs:
        click.echo(f"queued job {j['job_id']}: profile {j['model']} on {j['node']} (queue {j['queue']})")
    for queue, node in sorted({(j["queue"], j["node"]) for j in jobs}):
        click.echo(f"start the profiling worker on {node}, from a checkout with packrat-mq installed "
                   "(keep --serializer: the jobs are JSON, and RQ's default serializer is pickle):")
        click.echo(f"  {worker_command(queue, redact(url))}")
    click.echo(
        f"results: the profile JSON at {jobs[0]['result_key']} (and the like) in Redis, "
        f"and in {store_dir}/ on the worker's node"
    )
    if url.startswith("unix://"):
        err("note: a unix:// Redis URL is only reachable from this machine; "
            "pass --redis-url redis://HOST:PORT for workers on other nodes")
