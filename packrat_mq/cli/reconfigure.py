"""``packrat-mq reconfigure`` and ``packrat-mq models``: the management interface over the control stream."""
from __future__ import annotations

import json
import time
from typing import Any

import click

from packrat_mq import control
from packrat_mq.cli.helpers import connect_or_fail, echo_json, redis_options
from packrat_mq.deployment import Deployment
from packrat_mq.instances import Configuration, ConfigurationError
from packrat_mq.keys import check_model_name
from packrat_mq.records import SupervisorState
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
    assert message.reply_to is not None
    control.send(r, keys, message)
    if not as_json:
        click.echo(f"asked {model} on {', '.join(sorted(live))} for "
                   + (f"B={batch}" if batch is not None else str(instances))
                   + (" (adaptive)" if adaptive else "") + "; waiting ...", err=True)
    try:
        fields = control.wait_reply(r, message.reply_to, message.id, timeout)
    finally:
        r.delete(message.reply_to)
    if fields is None:
        raise click.ClickException(f"no reply within {timeout:g} s; the reconfiguration may still be in progress "
                                   "(see `packrat-mq status`)")
    if fields.get(b"status") != b"ok":
        raise click.ClickException((fields.get(b"error") or b"failed").decode("utf-8", "replace"))
    result: dict[str, Any] = json.loads(fields.get(b"payload") or b"{}")
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
    if entry.get("oversubscribed_s"):
        text += f"; cores shared for {s('oversubscribed_s')}"
    if entry.get("error"):
        text += f"; FAILED: {entry['error']}"
    return text


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@redis_options
def models(settings: Settings, as_json: bool) -> None:
    """List the models served on this Redis: configuration, B, whether adaptive, nodes.

    \b
    Examples:
      packrat-mq models
      packrat-mq models --json | jq '.[].model'
    """
    r, _ = connect_or_fail(settings)
    keys = settings.keys
    rows = []
    now = time.time()
    for model in sorted(m.decode() for m in r.smembers(keys.models())):
        raw = r.get(keys.config(model))
        deployment = Deployment.model_validate_json(raw) if raw else None
        nodes = []
        for node in sorted(n.decode() for n in r.smembers(keys.supervisors(model))):
            sup = SupervisorState.load(r, keys.supervisor(model, node))
            nodes.append({"node": node, "state": sup.effective_state(now) if sup else "gone"})
        rows.append({
            "model": model,
            "handler": deployment.handler if deployment else None,
            "configuration": deployment.configuration.compact() if deployment else None,
            "batch": deployment.batch if deployment else None,
            "generation": deployment.generation if deployment else None,
            "adaptive": deployment.adaptive if deployment else None,
            "nodes": nodes,
        })
    if as_json:
        echo_json(rows)
        return
    if not rows:
        click.echo("no models served")
        return
    for row in rows:
        mode = "adaptive" if row["adaptive"] else "pinned"
        nodes = ", ".join(f"{n['node']} ({n['state']})" for n in row["nodes"]) or "no supervisor"
        click.echo(f"{row['model']:<16} {row['configuration'] or 'no deployment':<16} B={row['batch'] or '-':<4} "
                   f"{mode:<8} generation {row['generation'] or '-'}  handler {row['handler'] or '-'}  nodes: {nodes}")
