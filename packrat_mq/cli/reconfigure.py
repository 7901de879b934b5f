"""``packrat-mq reconfigure`` and ``packrat-mq models``: the management interface over the control stream."""
from __future__ import annotations

import json
import time
from typing import Any

import click
import redis

from packrat_mq import control
from packrat_mq.cli.helpers import connect_or_fail, echo_json, parse_handler_options, redis_options
from packrat_mq.deployment import Deployment
from packrat_mq.handler import load_handler
from packrat_mq.instances import Configuration, ConfigurationError
from packrat_mq.keys import check_model_name
from packrat_mq.records import NodeState, SupervisorState
from packrat_mq.settings import Settings


@click.command()
@click.argument("model")
@click.option("--batch", "-b", type=click.IntRange(min=1, max=control.MAX_BATCH), default=None,
              help="New aggregated batch B; the optimizer plans the instances for it (as `up` does).")
@click.option("--instances", "-i", default=None, help='New instances by hand: "TxB,..." (e.g. "2*1x4").')
@click.option("--adaptive", is_flag=True, default=False,
              help="Let the estimator choose B from the load from now on (with --batch: its starting point). "
                   "Without it, the B given is pinned.")
@click.option("--reason", default="operator", show_default=True, help="Recorded in the history `status` shows.")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=600.0, show_default=True,
              help="Seconds to wait for the reconfiguration to finish (new instances load and warm up first).")
@click.option("--json", "as_json", is_flag=True, help="Print the reply as one JSON object.")
@redis_options
def reconfigure(settings: Settings, model: str, batch: int | None, instances: str | None, adaptive: bool,
                reason: str, timeout: float, as_json: bool) -> None:
    """Reconfigure MODEL while it serves, without losing a request.

    Keeps instances whose thread count stays, starts the new ones and lets
    them warm up while the old ones serve, switches at a batch boundary, then
    drains and stops the old ones (see docs/decisions.md). Waits for the
    supervisor's reply and prints what was done, with how long each phase took.

    \b
    Examples:
      packrat-mq reconfigure resnet50 --batch 16            # optimizer plans B=16; B pinned
      packrat-mq reconfigure resnet50 --instances 2*1x4     # by hand
      packrat-mq reconfigure resnet50 --batch 1 --adaptive  # back to the estimator, from B=1
    """
    try:
        check_model_name(model)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="MODEL") from None
    if (batch is None) == (instances is None):
        raise click.UsageError("give exactly one of --batch and --instances")
    if instances is not None:
        try:
            Configuration.parse(instances)
        except ConfigurationError as exc:
            raise click.BadParameter(str(exc), param_hint="--instances") from None
        if adaptive:
            raise click.UsageError("--adaptive goes with --batch: the estimator changes B and the optimizer plans it")
    r, _ = connect_or_fail(settings)
    keys = settings.keys
    nodes = [n.decode() for n in r.smembers(keys.supervisors(model))]
    live = [n for n in nodes if (s := SupervisorState.load(r, keys.supervisor(model, n))) is not None
            and s.effective_state(time.time()) == "ready"]
    if not live:
        served = sorted(m.decode() for m in r.smembers(keys.models()))
        raise click.ClickException(f"no live supervisor serves {model!r} (served: {', '.join(served) or 'none'}); "
                                   f"start it with `packrat-mq up --model {model}`")
    message = control.ControlMessage(id=control.new_id(), model=model, batch=batch, instances=instances,
                                     adaptive=adaptive, reason=reason, origin="cli",
                                     reply_to=keys.replies(f"control-{control.new_id()}"))
    if not as_json:
        click.echo(f"asked {model} on {', '.join(sorted(live))} for "
                   + (f"B={batch}" if batch is not None else str(instances))
                   + (" (adaptive)" if adaptive else "") + "; waiting ...", err=True)
    result = _ask(r, settings, message, timeout,
                  f"no reply within {timeout:g} s; the reconfiguration may still be in progress "
                  "(see `packrat-mq status`)")
    if as_json:
        echo_json(result)
        return
    if result.get("unchanged"):
        click.echo(f"{model}: already {result['configuration']} (generation {result['generation']}); nothing to do")
        return
    click.echo(describe_change(model, result))


def describe_change(model: str, entry: dict[str, Any]) -> str:
    """One line for a reconfiguration's history entry."""
    def s(key: str) -> str:
        value = entry.get(key)
        return f"{value:.2f} s" if isinstance(value, (int, float)) else "-"

    text = (f"{model}: {entry['from']} -> {entry['to']} (B {entry['from_batch']} -> {entry['to_batch']}, "
            f"{entry['kind']}, generation {entry['generation']}, {entry['reason']}): "
            f"ready {s('decision_to_ready_s')}, switched {s('ready_to_switch_s')}, drained {s('switch_to_drained_s')}, "
            f"total {s('total_s')}")
    if entry.get("reused"):
        text += f"; {entry['reused']} instances rebound from spares"
    if entry.get("oversubscribed_s"):
        text += f"; cores shared for {s('oversubscribed_s')}"
    if entry.get("handover"):
        if entry.get("held_s") is None:
            # No new instance had its first sub-batch before the old ones drained: nothing was held.
            text += "; the old instances drained before the new ones had work"
        else:
            text += f"; new instances waited {s('held_s')} for the old ones to drain"
    if entry.get("error"):
        text += f"; FAILED: {entry['error']}"
    return text


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@redis_options
@click.pass_context
def models(ctx: click.Context, settings: Settings, as_json: bool) -> None:
    """List the models served or registered on this Redis: configuration, B, adaptive or pinned, nodes.

    \b
    Examples:
      packrat-mq models
      packrat-mq models --json | jq '.[].model'
      packrat-mq models register faces --handler mypkg.faces:FaceHandler --node node-7 -o weights=/m/f.pt
      packrat-mq models unregister faces
    """
    if ctx.invoked_subcommand is not None:
        return
    r, _ = connect_or_fail(settings)
    keys = settings.keys
    rows = []
    now = time.time()
    registered = {k.decode(): json.loads(v) for k, v in r.hgetall(keys.registry()).items()}
    names = {m.decode() for m in r.smembers(keys.models())} | set(registered)
    for model in sorted(names):
        raw = r.get(keys.config(model))
        deployment = Deployment.model_validate_json(raw) if raw else None
        nodes = []
        for node in sorted(n.decode() for n in r.smembers(keys.supervisors(model))):
            sup = SupervisorState.load(r, keys.supervisor(model, node))
            nodes.append({"node": node, "state": sup.effective_state(now) if sup else "gone"})
        reg = registered.get(model)
        rows.append({
            "model": model,
            "handler": deployment.handler if deployment else (reg or {}).get("handler"),
            "configuration": deployment.configuration.compact() if deployment else None,
            "batch": deployment.batch if deployment else None,
            "generation": deployment.generation if deployment else None,
            "adaptive": deployment.adaptive if deployment else None,
            "registered": {"node": reg["node"], "options": reg.get("options", {})} if reg else None,
            "nodes": nodes,
        })
    if as_json:
        echo_json(rows)
        return
    if not rows:
        click.echo("no models served or registered")
        return
    for row in rows:
        mode = "-" if row["adaptive"] is None else ("adaptive" if row["adaptive"] else "pinned")
        nodes = ", ".join(f"{n['node']} ({n['state']})" for n in row["nodes"]) or "no supervisor"
        reg = f"  registered on {row['registered']['node']}" if row["registered"] else ""
        click.echo(f"{row['model']:<16} {row['configuration'] or 'not served':<16} B={row['batch'] or '-':<4} "
                   f"{mode:<8} generation {row['generation'] or '-'}  handler {row['handler'] or '-'}  "
                   f"nodes: {nodes}{reg}")


def _ask(r: redis.Redis, settings: Settings, message: control.ControlMessage, timeout: float,
         no_reply: str) -> dict[str, Any]:
    """Send a control message and wait for its reply; a failure is one line (ClickException).

    ``no_reply`` is that line when no reply comes within ``timeout`` seconds.
    """
    assert message.reply_to is not None
    control.send(r, settings.keys, message)
    try:
        fields = control.wait_reply(r, message.reply_to, message.id, timeout)
    finally:
        r.delete(message.reply_to)
    if fields is None:
        raise click.ClickException(no_reply)
    if fields.get(b"status") != b"ok":
        raise click.ClickException((fields.get(b"error") or b"failed").decode("utf-8", "replace"))
    result: dict[str, Any] = json.loads(fields.get(b"payload") or b"{}")
    return result


def _live_nodes(r: redis.Redis, settings: Settings) -> list[str]:
    now = time.time()
    live = []
    for n in sorted(x.decode() for x in r.smembers(settings.keys.nodes())):
        rec = NodeState.load(r, settings.keys.node(n))
        if rec is not None and rec.effective_state(now) == "ready":
            live.append(n)
    return live


@models.command("register")
@click.argument("name")
@click.option("--handler", "handler", required=True, help="Zoo name (resnet50, ...) or module:Class of a BaseHandler.")
@click.option("--node", default=None, help="The node whose pool serves it (default: the only node pool running).")
@click.option("--option", "-o", "option_pairs", multiple=True, metavar="KEY=VALUE", help="Handler option (repeatable).")
@click.option("--instances", "-i", default=None, help='Instances by hand, "TxB,..."; B pinned.')
@click.option("--batch", "-b", type=click.IntRange(min=1, max=control.MAX_BATCH), default=None,
              help="Aggregated batch B; pinned. Without it (and --instances), adaptive from B=1.")
@click.option("--threads", "-t", type=click.IntRange(min=1), default=None,
              help="T for the optimizer (default: the cores the node has free).")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=600.0, show_default=True,
              help="Seconds to wait for the model's instances to be ready.")
@click.option("--json", "as_json", is_flag=True, help="Print the reply as one JSON object.")
@redis_options(check=True)  # connected before "registering ..." is said
def register(settings: Settings, name: str, handler: str, node: str | None, option_pairs: tuple[str, ...],
             instances: str | None, batch: int | None, threads: int | None, timeout: float, as_json: bool) -> None:
    """Register model NAME on a node: its pool (`packrat-mq node`) starts serving it.

    \b
    Examples:
      packrat-mq node --node n1 &                                  # the pool of node n1
      packrat-mq models register sleepy --handler sleep -o base_ms=5 --node n1
      packrat-mq models register faces --handler mypkg.faces:FaceHandler --instances 2*1x4
    """
    try:
        check_model_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from None
    if batch is not None and instances is not None:
        raise click.UsageError("give --batch or --instances, not both")
    if instances is not None:
        try:
            Configuration.parse(instances)
        except ConfigurationError as exc:
            raise click.BadParameter(str(exc), param_hint="--instances") from None
    try:
        load_handler(handler)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--handler") from None
    options = parse_handler_options(option_pairs)
    r, _ = connect_or_fail(settings)
    if node is None:
        live = _live_nodes(r, settings)
        if len(live) != 1:
            raise click.UsageError("give --node: " + (f"node pools running: {', '.join(live)}" if live else
                                   "no node pool is running (start one with `packrat-mq node --node NAME`)"))
        node = live[0]
    message = control.ControlMessage(id=control.new_id(), command="register", model=name, handler=handler,
                                     node=node, options=options, instances=instances, batch=batch, threads=threads,
                                     origin="cli", reply_to=settings.keys.replies(f"control-{control.new_id()}"))
    if not as_json:
        click.echo(f"registering {name} ({handler}) on {node}; waiting for its instances ...", err=True)
    result = _ask(r, settings, message, timeout, f"no reply within {timeout:g} s to register {name} on {node}: is "
                  "`packrat-mq node` running for that node? (see `packrat-mq status`)")
    if as_json:
        echo_json(result)
        return
    click.echo(f"{name}: served on {result['node']} as {result['configuration']} (B={result['batch']}, "
               + ("adaptive" if result["adaptive"] else "pinned") + ")")


@models.command("unregister")
@click.argument("name")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=120.0, show_default=True,
              help="Seconds to wait for its instances to drain and stop.")
@click.option("--json", "as_json", is_flag=True, help="Print the reply as one JSON object.")
@redis_options
def unregister(settings: Settings, name: str, timeout: float, as_json: bool) -> None:
    """Stop serving model NAME on its node (dispatcher first, queues drained) and forget it.

    \b
    Example:
      packrat-mq models unregister sleepy
    """
    try:
        check_model_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from None
    r, _ = connect_or_fail(settings)
    if not r.hexists(settings.keys.registry(), name):
        raise click.ClickException(f"{name!r} is not registered (`packrat-mq models` lists what is)")
    message = control.ControlMessage(id=control.new_id(), command="unregister", model=name, origin="cli",
                                     reply_to=settings.keys.replies(f"control-{control.new_id()}"))
    result = _ask(r, settings, message, timeout, f"no reply within {timeout:g} s to unregister {name}: is "
                  "`packrat-mq node` running for that node? (see `packrat-mq status`)")
    if as_json:
        echo_json(result)
        return
    click.echo(f"{name}: unregistered from {result['node']}" + (", its instances stopped" if result["stopped"] else ""))
