"""``packrat-mq status``: what is served, by which instances, with what backlog.

States are shown as the heartbeats allow: a process whose record says
``ready`` but whose heartbeat is older than three intervals is shown as
``stale`` (see ``packrat_mq.records``), never as ready.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Any

import click
import redis

from packrat_mq.cli.helpers import connect_or_fail, echo_json, redis_options
from packrat_mq.cli.reconfigure import describe_change
from packrat_mq.connection import redact
from packrat_mq.deployment import Deployment
from packrat_mq.keys import DISPATCHER_GROUP, Keys
from packrat_mq.records import DispatcherState, InstanceState, LiveRecord, SupervisorState
from packrat_mq.settings import Settings
from packrat_mq.streams import read_backlog


def _process(record: LiveRecord | None, now: float) -> dict[str, Any]:
    """What every supervised process shows: state as its heartbeat allows, pid, counters."""
    if record is None:
        return {"state": "gone", "pid": None, "host": None, "restarts": 0, "loop_errors": 0,
                "groups_recreated": 0, "heartbeat_age_s": None}
    return {"state": record.effective_state(now), "pid": record.pid, "host": record.host or None,
            "restarts": record.restarts, "loop_errors": record.loop_errors,
            "groups_recreated": record.groups_recreated, "heartbeat_age_s": record.heartbeat_age(now)}


def served_capacities(items: list[str]) -> dict[str, float]:
    """The dispatcher record's ``B=rate`` items as ``{"B": rate}`` (JSON keys are strings); unreadable ones skipped."""
    out = {}
    for item in items:
        batch, _, rate = item.partition("=")
        try:
            out[str(int(batch))] = float(rate)
        except ValueError:
            continue
    return out


def collect_status(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    """Everything ``status`` shows, as one JSON-able document."""
    models = sorted(m.decode() for m in r.smembers(keys.models()))
    out: dict[str, Any] = {"models": []}
    now = time.time()
    for model in models:
        raw = r.get(keys.config(model))
        deployment = Deployment.model_validate_json(raw) if raw else None
        stats = {k.decode(): int(v) for k, v in r.hgetall(keys.stats(model)).items()}
        backlog, in_flight = read_backlog(r, keys.requests(model), DISPATCHER_GROUP)
        entry: dict[str, Any] = {
            "model": model,
            "backlog": backlog,
            "in_flight": in_flight,
            "stats": stats,
            "configuration": str(deployment.configuration) if deployment else None,
            "batch": deployment.batch if deployment else None,
            "generation": deployment.generation if deployment else None,
            #: Several nodes: each node's generation in the document (see docs/decisions.md#several-nodes).
            "nodes": dict(deployment.nodes) if deployment else {},
            "predicted_latency_ms": deployment.predicted_latency_ms if deployment else None,
            "graph_mode": (deployment.graph_mode or "eager") if deployment else None,
            "instances": [],
            "supervisors": [],
        }
        d = DispatcherState.load(r, keys.dispatcher(model))
        entry["dispatcher"] = {**_process(d, now), "batches": d.batches if d else 0,
                               "max_backlog": d.max_backlog if d else None,
                               "generation": d.generation if d else None}
        entry["adaptive"] = deployment.adaptive if deployment else False
        entry["estimate"] = {"q_tilde": d.q_tilde if d else None, "b_tilde": d.b_tilde if d else None,
                             "requested_batch": d.requested_batch if d else None,
                             "served": served_capacities(d.served) if d else {}}
        entry["reconfigurations"] = [json.loads(x) for x in r.lrange(keys.reconfigurations(model), 0, 9)]
        entry["reconfiguring"] = None
        if d is None:
            entry["dispatcher"]["state"] = "none"
        shares = {i.id: i.batch for i in deployment.instances} if deployment else {}
        for iid in sorted(i.decode() for i in r.smembers(keys.instances(model))):
            h = InstanceState.load(r, keys.instance(model, iid))
            entry["instances"].append({
                "id": iid,
                **_process(h, now),
                "threads": h.threads if h else 0,
                # The deployment's share: a reshare changes it without restarting the instance.
                "batch": shares.get(iid, h.batch if h else 0),
                "cpus": ",".join(map(str, h.cpus)) if h else "",
                "socket": h.socket if h else 0,
                "queue": r.xlen(keys.queue(model, iid)),
                "batches": h.batches if h else 0,
                # In the deployment (served to), or loaded and kept for a reconfiguration (state "spare").
                "serving": iid in shares,
            })
        for node in sorted(n.decode() for n in r.smembers(keys.supervisors(model))):
            sup = SupervisorState.load(r, keys.supervisor(model, node))
            entry["supervisors"].append({
                "node": node,
                **_process(sup, now),
                "generation": sup.generation if sup else None,
                "instances": sup.instances if sup else [],
                "with_dispatcher": sup.with_dispatcher if sup else None,
                "phase": (sup.phase or None) if sup else None,
                "target": (sup.target or None) if sup else None,
                # Served / profiled latency at the instances' own (t, b): far from 1, the profile is not
                # this machine's now (optimizer.planning.drift).
                "profile_ratio": sup.profile_ratio if sup else None,
                # The same by instance thread count, each the last measured: the estimator plans each layout by it.
                "profile_ratios": {str(t): r for t, r in sup.ratios_by_threads().items()} if sup else {},
            })
            if sup is not None and sup.phase:
                entry["reconfiguring"] = {"node": node, "phase": sup.phase, "to": sup.target}
        entry["predicted_now_ms"] = predicted_now(entry)
        out["models"].append(entry)
    return out


def predicted_now(entry: dict[str, Any]) -> float | None:
    """The plan's predicted batch latency at the speed this machine serves now; None until measured.

    ``up`` prints the profile's prediction when it starts, before anything is
    served. The supervisors then measure served over profiled latency at their
    instances' own (t, b) (``profile_ratio``, ``optimizer.planning.drift``): on a
    host slower than its profile by 1.3x the plan's batches take 1.3x the
    prediction, and this says so next to it (the median over the nodes).
    """
    predicted = entry.get("predicted_latency_ms")
    ratios = [s["profile_ratio"] for s in entry.get("supervisors", []) if s.get("profile_ratio")]
    if predicted is None or not ratios:
        return None
    return round(predicted * statistics.median(ratios), 3)


def add_rates(doc: dict[str, Any], previous: dict[str, Any] | None, elapsed_s: float) -> None:
    """Requests and replies per second of each model since ``previous`` (a live view's last frame)."""
    before = {m["model"]: m["stats"] for m in (previous or {}).get("models", [])}
    for m in doc["models"]:
        old = before.get(m["model"])
        m["rates"] = None if old is None or elapsed_s <= 0 else {
            f"{k}_per_s": round((m["stats"].get(k, 0) - old.get(k, 0)) / elapsed_s, 1)
            for k in ("requests", "replies", "errors")
        }


def render(doc: dict[str, Any], prefix: str) -> str:
    """The text view of a status document."""
    if not doc["models"]:
        return f"no models served on {doc['redis_url']} (prefix {prefix!r})"
    lines = []
    for m in doc["models"]:
        rates = m.get("rates")
        bound = m["dispatcher"].get("max_backlog")
        graph = m.get("graph_mode")
        lines.append(f"{m['model']}: {m['configuration'] or 'no deployment'} (B={m['batch']}, "
                     + (f"graph mode {graph}, " if graph and graph != "eager" else "")
                     + f"generation {m['generation']}), backlog {m['backlog']}"
                     + (f" of at most {bound}" if bound else "") + f", in flight {m['in_flight']}, "
                     + ", ".join(f"{k} {v}" for k, v in sorted(m["stats"].items()))
                     + (f"; {rates['requests_per_s']:.1f} req/s, {rates['replies_per_s']:.1f} replies/s" if rates else ""))
        predicted, now = m.get("predicted_latency_ms"), m.get("predicted_now_ms")
        if predicted is not None:
            lines.append(f"  {'predicted per batch':<24} {predicted:.2f} ms from the profile"
                         + (f", {now:.2f} ms at the speed served now" if now is not None else
                            " (served speed not measured yet)"))
        est = m.get("estimate") or {}
        q = est.get("q_tilde")
        lines.append(f"  {'batch size':<24} " + ("adaptive" if m.get("adaptive") else "pinned")
                     + f", B={m['batch']}, Q̃={q if q is not None else '-'}, B̃={est.get('b_tilde') or '-'}"
                     + (f", asked for B={est['requested_batch']}" if est.get("requested_batch") else "")
                     + ("; served under a backlog: " + ", ".join(f"B={b} {rate:.1f}/s" for b, rate in est["served"].items())
                        + " (in place of the plan)" if est.get("served") else ""))
        if m.get("reconfiguring"):
            rc = m["reconfiguring"]
            lines.append(f"  {'reconfiguring':<24} to {rc['to']} on {rc['node']}: {rc['phase']}")
        d = m["dispatcher"]
        lines.append(f"  {'dispatcher':<24} {d['state']:<10} pid {d['pid'] or '-':<7} batches {d['batches']}  "
                     f"restarts {d['restarts']}  " + _troubles(d) +
                     f"heartbeat {d['heartbeat_age_s'] if d['heartbeat_age_s'] is not None else '-'} s ago")
        for sup in m.get("supervisors", []):
            lines.append(f"  {'supervisor ' + sup['node']:<24} {sup['state']:<10} pid {sup['pid'] or '-':<7} "
                         f"generation {sup['generation']}  " + _troubles(sup)
                         + (f"served {sup['profile_ratio']:.2f}x the profile  " if sup.get("profile_ratio") else "")
                         + f"heartbeat {sup['heartbeat_age_s'] if sup['heartbeat_age_s'] is not None else '-'} s ago")
        for i in m["instances"]:
            age = i["heartbeat_age_s"]
            lines.append(f"  {i['id']:<24} {i['state']:<10} pid {i['pid'] or '-':<7} {i['threads']}x{i['batch']:<4} "
                         f"cpus {i['cpus']:<10} queue {i['queue']}  batches {i['batches']}  restarts {i['restarts']}  "
                         + _troubles(i) + f"heartbeat {age if age is not None else '-'} s ago")
        if m.get("reconfigurations"):
            lines.append("  last reconfigurations (newest first):")
            for e in m["reconfigurations"]:
                when = time.strftime("%H:%M:%S", time.localtime(e["decided"])) if e.get("decided") else "-"
                lines.append(f"    {when} {describe_change(m['model'], e)}")
    return "\n".join(lines)


def _troubles(record: dict[str, Any]) -> str:
    """Counters of recovered faults, shown only when there were any."""
    parts = [f"{label} {record[key]}" for key, label in (("loop_errors", "loop errors"),
                                                          ("groups_recreated", "groups recreated"))
             if record.get(key)]
    return "".join(p + "  " for p in parts)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout (with --watch: one per line).")
@click.option("--watch", "-w", type=click.FloatRange(min=0.1), default=None, metavar="SECONDS",
              help="Refresh every SECONDS until Ctrl-C, with request and reply rates.")
@redis_options
def status(settings: Settings, as_json: bool, watch: float | None) -> None:
    """Show models, their configuration, instances (cores, pids, queues) and backlog.

    \b
    Examples:
      packrat-mq status
      packrat-mq status --watch 1                 # live view with rates
      packrat-mq status --json | jq '.models[].backlog'
    """
    r, url = connect_or_fail(settings)
    previous: dict[str, Any] | None = None
    last = time.monotonic()
    try:
        while True:
            doc = collect_status(r, settings.keys)
            doc["redis_url"] = redact(url)
            now = time.monotonic()
            if watch is not None:
                add_rates(doc, previous, now - last)
            if as_json:
                if watch is None:
                    echo_json(doc)
                else:
                    click.echo(json.dumps(doc, default=str))
            else:
                if watch is not None:
                    click.clear()
                    click.echo(time.strftime("%H:%M:%S") + f"  every {watch:g} s, Ctrl-C to stop")
                click.echo(render(doc, settings.prefix))
            if watch is None:
                return
            previous, last = doc, now
            time.sleep(watch)
    except KeyboardInterrupt:
        return
