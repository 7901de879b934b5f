"""``packrat-mq node``: the pool of one node, serving every model registered for it."""
from __future__ import annotations

import click

from packrat_mq import logs
from packrat_mq.cli.helpers import connect_or_fail, redis_options
from packrat_mq.cli.serve import metrics_endpoint
from packrat_mq.interrupts import uninterrupted
from packrat_mq.settings import Settings
from workers.node import NodePool


@click.command()
@click.option("--node", default=None, help="This node's name in registrations (default: the host name).")
@redis_options(check=True)
def node(settings: Settings, node: str | None) -> None:
    """Serve every model registered for this node until Ctrl-C/SIGTERM.

    Models are registered with `packrat-mq models register NAME --handler H --node NODE`
    (and unregistered likewise); each gets its own dispatcher, instances on cores no other
    model of the node holds, and takes `packrat-mq reconfigure`. Started again, the pool
    serves what the registry says is its node's.

    \b
    Examples:
      packrat-mq node --node n1 --redis-url redis://localhost:6379/0
      packrat-mq models register sleepy --handler sleep --node n1 --redis-url redis://localhost:6379/0
    """
    logs.configure(settings, f"node {node or ''}".strip())
    r, url = connect_or_fail(settings)
    try:
        pool = NodePool(r, settings, url, node)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--node") from None
    with metrics_endpoint(settings, pool.metrics_views):
        try:
            pool.start()
            click.echo(f"node {pool.node}: serving {', '.join(sorted(pool.supervisors)) or 'nothing yet'}; "
                       f"register models with `packrat-mq models register NAME --handler H --node {pool.node}` "
                       "(Ctrl-C to stop)")
            pool.serve_forever()
        finally:
            with uninterrupted():  # interrupted while starting too: what started stops, in order
                click.echo(f"node {pool.node}: stopping every model (dispatchers first, queues drained)")
                pool.stop()
