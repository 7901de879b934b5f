"""``packrat-mq status``: what is served, by which instances, with what backlog."""
from __future__ import annotations

import time
from typing import Any

import click
import redis

from packrat_mq.cli.helpers import connect_or_fail, echo_json, redis_options
from packrat_mq.connection import redact
from packrat_mq.deployment import Deployment
from packrat_mq.keys import Keys
from packrat_mq.settings import Settings


def collect_status(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    """Everything ``status`` shows, as one JSON-able document."""
    models = sorted(m.decode() for m in r.smembers(keys.models()))
    out: dict[str, Any] = {"models": []}
    now = time.time()
    for model in models:
        raw = r.get(keys.config(model))
        deployment = Deployment.model_validate_json(raw) if raw else None
        stats = {k.decode(): int(v) for k, v in r.hgetall(keys.stats(model)).items()}
        entry: dict[str, Any] = {
            "model": model,
            "backlog": r.xlen(keys.requests(model)),
            "stats": stats,
            "configuration": str(deployment.configuration) if deployment else None,
            "batch": deployment.batch if deployment else None,
            "generation": deployment.generation if deployment else None,
            "predicted_latency_ms": deployment.predicted_latency_ms if deployment else None,
            "instances": [],
        }
        d = {k.decode(): v.decode() for k, v in r.hgetall(keys.dispatcher(model)).items()}
        beat = float(d.get("heartbeat") or 0)
        entry["dispatcher"] = {
            "state": d.get("state", "none"),
            "pid": int(d["pid"]) if d.get("pid") else None,
            "host": d.get("host"),
            "batches": int(d.get("batches") or 0),
            "heartbeat_age_s": round(now - beat, 3) if beat else None,
        }
        ids = sorted(i.decode() for i in r.smembers(keys.instances(model)))
        for iid in ids:
            h = {k.decode(): v.decode() for k, v in r.hgetall(keys.instance(model, iid)).items()}
            beat = float(h.get("heartbeat") or 0)
            entry["instances"].append({
                "id": iid,
                "state": h.get("state", "gone"),
                "pid": int(h["pid"]) if h.get("pid") else None,
                "host": h.get("host"),
                "threads": int(h.get("threads") or 0),
                "batch": int(h.get("batch") or 0),
                "cpus": h.get("cpus", ""),
                "socket": int(h.get("socket") or 0),
                "queue": r.xlen(keys.queue(model, iid)),
                "batches": int(h.get("batches") or 0),
                "restarts": int(h.get("restarts") or 0),
                "heartbeat_age_s": round(now - beat, 3) if beat else None,
            })
        out["models"].append(entry)
    return out


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@redis_options
def status(settings: Settings, as_json: bool) -> None:
    """Show models, their configuration, instances (cores, pids, queues) and backlog.

    \b
    Examples:
      packrat-mq status
      packrat-mq status --json | jq '.models[].backlog'
    """
    r, url = connect_or_fail(settings)
    doc = collect_status(r, settings.keys)
    doc["redis_url"] = redact(url)
    if as_json:
        echo_json(doc)
        return
    if not doc["models"]:
        click.echo(f"no models served on {redact(url)} (prefix {settings.prefix!r})")
        return
    for m in doc["models"]:
        click.echo(f"{m['model']}: {m['configuration'] or 'no deployment'} (B={m['batch']}, "
                   f"generation {m['generation']}), backlog {m['backlog']}, "
                   + ", ".join(f"{k} {v}" for k, v in sorted(m["stats"].items())))
        d = m["dispatcher"]
        click.echo(f"  {'dispatcher':<24} {d['state']:<10} pid {d['pid'] or '-':<7} batches {d['batches']}  "
                   f"heartbeat {d['heartbeat_age_s'] if d['heartbeat_age_s'] is not None else '-'} s ago")
        for i in m["instances"]:
            age = i["heartbeat_age_s"]
            click.echo(f"  {i['id']:<24} {i['state']:<10} pid {i['pid'] or '-':<7} {i['threads']}x{i['batch']:<4} "
                       f"cpus {i['cpus']:<10} queue {i['queue']}  batches {i['batches']}  restarts {i['restarts']}  "
                       f"heartbeat {age if age is not None else '-'} s ago")
