"""``packrat-mq up``, ``dispatch`` and ``pool``: running the serving stack."""
from __future__ import annotations

import logging
import os
from typing import Any

import click

from packrat_mq.cli.helpers import err, redis_options
from packrat_mq.instances import Configuration, ConfigurationError
from packrat_mq.settings import Settings


def _options(pairs: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r}: expected KEY=VALUE", param_hint="--option")
        try:
            out[key] = float(value) if "." in value else int(value)
        except ValueError:
            out[key] = value
    return out


def model_and_handler(model: str, name: str | None) -> tuple[str, str]:
    """(served name, handler spec): ``--model pkg.mod:MyHandler`` is served as ``myhandler``."""
    from packrat_mq.keys import check_model_name

    served = name or (model.rsplit(":", 1)[1].lower() if ":" in model else model)
    try:
        return check_model_name(served), model
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--name") from None


def choose_configuration(
    model: str, instances: str | None, threads: int | None, batch: int | None, profile: str | None
) -> tuple[Configuration, str | None]:
    """The configuration to serve with, and the profile it came from (if any).

    ``--instances`` wins; otherwise :func:`optimizer.selection.choose` decides
    for ``--threads`` (default: the cores of one socket) and ``--batch``.
    """
    if instances:
        try:
            return Configuration.parse(instances), None
        except ConfigurationError as exc:
            raise click.BadParameter(str(exc), param_hint="--instances") from None
    from optimizer.selection import choose
    from packrat_mq.service import default_threads

    try:
        choice = choose(model, threads or default_threads(), batch or 1, profile)
    except ValueError as exc:
        raise click.ClickException(f"optimizer: {exc}") from None
    err(choice.note)
    return choice.configuration, str(choice.profile_path) if choice.profile_path else None


@click.command()
@click.option("--model", "-m", required=True, help="Zoo name (echo, sleep, resnet50, inception_v3, bert, gpt2, minilm) or module:Class.")
@click.option("--instances", "-i", default=None, help='Configuration by hand: "TxB,TxB,..." (e.g. "2x4,2x4" or "2*1x4").')
@click.option("--threads", "-t", type=int, default=None, help="Threads T for the optimizer (default: cores of one socket).")
@click.option("--batch", "-b", type=int, default=None, help="Aggregated batch B for the optimizer (default 1).")
@click.option("--profile", default=None, help="Profile JSON (default: profiles/<model>.json).")
@click.option("--batch-timeout-ms", type=float, default=None, help="Send a partial batch this long after its first request.")
@click.option("--graph/--eager", default=False, show_default=True, help="TorchScript trace + freeze, or eager.")
@click.option("--option", "-o", "option_pairs", multiple=True, help="Handler option KEY=VALUE (repeatable).")
@click.option("--node", default=None, help="Node name in instance ids (default: host name).")
@click.option("--name", default=None, help="Name to serve the model under (default: the zoo name, or the handler class).")
@redis_options
def up(
    settings: Settings,
    model: str,
    instances: str | None,
    threads: int | None,
    batch: int | None,
    profile: str | None,
    batch_timeout_ms: float | None,
    graph: bool,
    option_pairs: tuple[str, ...],
    node: str | None,
    name: str | None,
) -> None:
    """Serve MODEL: worker pool + dispatcher (+ embedded Redis) until Ctrl-C.

    \b
    Examples:
      packrat-mq up --model echo --instances 1x4,1x4
      packrat-mq up --model resnet50 --threads 16 --batch 32      # optimizer picks
      packrat-mq up --model minilm -i 2*1x4 --redis-url redis://localhost:6379/0
    """
    from packrat_mq.connection import EmbeddedRedis, connect, discover_url
    from packrat_mq.service import Service
    from workers.allocation import AllocationError

    logging.basicConfig(level=os.environ.get("PACKRAT_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    model, handler = model_and_handler(model, name)
    config, profile_path = choose_configuration(model, instances, threads, batch, profile)
    updates: dict[str, Any] = {"graph_mode": graph}
    if batch_timeout_ms is not None:
        updates["batch_timeout_ms"] = batch_timeout_ms
    settings = settings.model_copy(update=updates)

    embedded = None
    url = settings.redis_url or discover_url()
    if url is None:
        embedded = EmbeddedRedis().start()
        url = embedded.url
        click.echo(f"embedded Redis at {url} (other packrat-mq commands find it; redis-cli -s {url[7:]})")
    try:
        r = connect(url)
        try:
            service = Service(r, settings, url, model, config, handler=handler, options=_options(option_pairs),
                              profile=profile_path, node=node)
        except AllocationError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"starting {model}: {config} (B={config.batch}, {config.threads} threads"
                   + (f", predicted {config.predicted_latency_ms:.2f} ms" if config.predicted_latency_ms else "") + ")")
        service.start()
        for inst in service.pool.instances:
            click.echo(f"  instance {inst.record.id}: {inst.record.threads} threads, batch {inst.record.batch}, "
                       f"cpus {inst.record.cpus}, pid {inst.process.pid if inst.process else '-'}")
        click.echo(f"ready: XADD {settings.keys.requests(model)} * id <id> reply_to <stream> payload <bytes> "
                   f"content_type application/json   (Ctrl-C to stop)")
        try:
            service.serve_forever()
        finally:
            click.echo("stopping: dispatcher, then instances after they drain")
            service.stop()
    finally:
        if embedded is not None:
            embedded.stop()


@click.command()
@click.option("--model", "-m", required=True, help="Model whose request stream to dispatch.")
@click.option("--batch-timeout-ms", type=float, default=None)
@click.option("--profile", default=None, help="Profile JSON to split partial batches by measured latency.")
@redis_options
def dispatch(settings: Settings, model: str, batch_timeout_ms: float | None, profile: str | None) -> None:
    """Run only the dispatcher of MODEL (for docker-compose; needs a Redis URL).

    \b
    Example:
      packrat-mq dispatch --model resnet50 --redis-url redis://redis:6379/0
    """
    from dispatcher.dispatcher import run_dispatcher
    from dispatcher.partitioning import latency_from_profile
    from packrat_mq.cli.helpers import connect_or_fail

    logging.basicConfig(level=os.environ.get("PACKRAT_LOG_LEVEL", "INFO"),
                        format="%(asctime)s dispatcher %(levelname)s %(message)s")
    if batch_timeout_ms is not None:
        settings = settings.model_copy(update={"batch_timeout_ms": batch_timeout_ms})
    _, url = connect_or_fail(settings)
    run_dispatcher(settings, url, model, latency=latency_from_profile(profile) if profile else None)


@click.command()
@click.option("--model", "-m", required=True)
@click.option("--instances", "-i", envvar="PACKRAT_INSTANCES", default=None,
              help='"TxB,TxB,..." by hand (env PACKRAT_INSTANCES); else the optimizer picks.')
@click.option("--threads", "-t", type=int, default=None)
@click.option("--batch", "-b", type=int, default=None)
@click.option("--profile", default=None)
@click.option("--graph/--eager", default=False, show_default=True)
@click.option("--option", "-o", "option_pairs", multiple=True, help="Handler option KEY=VALUE.")
@click.option("--node", default=None)
@click.option("--name", default=None, help="Name to serve the model under (default: the zoo name, or the handler class).")
@redis_options
def pool(
    settings: Settings,
    model: str,
    instances: str | None,
    threads: int | None,
    batch: int | None,
    profile: str | None,
    graph: bool,
    option_pairs: tuple[str, ...],
    node: str | None,
    name: str | None,
) -> None:
    """Run only this node's worker pool for MODEL (for docker-compose).

    \b
    Example:
      packrat-mq pool --model resnet50 -i 4*4x8 --redis-url redis://redis:6379/0
    """
    from packrat_mq.cli.helpers import connect_or_fail
    from workers.allocation import AllocationError
    from workers.pool import Pool

    logging.basicConfig(level=os.environ.get("PACKRAT_LOG_LEVEL", "INFO"),
                        format="%(asctime)s pool %(levelname)s %(message)s")
    model, handler = model_and_handler(model, name)
    config, _ = choose_configuration(model, instances, threads, batch, profile)
    settings = settings.model_copy(update={"graph_mode": graph})
    r, url = connect_or_fail(settings)
    try:
        p = Pool(r, settings, url, model, config, handler=handler, options=_options(option_pairs), node=node)
    except AllocationError as exc:
        raise click.ClickException(str(exc)) from None
    p.start()
    p.wait_ready()
    click.echo(f"pool ready: {model} {config}")
    import signal
    import time

    stopping = False

    def _stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    while not stopping:
        p.check()
        time.sleep(0.5)
    p.drain(30)
    p.stop()
    p.retire()
