"""``packrat-mq optimize``: the fastest configuration for a batch, planned from a profile.

It plans for the machine the profile was measured on, not the one it runs on,
so a 16-core server can be planned from a laptop. The command is a pipeline
of small steps (load, plan, report) so that further options, such as running
the plan to calibrate it, slot in between without touching the others.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from optimizer.calibration import calibrate
from optimizer.planning.profile import Profile, ProfileError
from optimizer.planning.solving import InfeasibleError, solve
from packrat_mq.cli.helpers import require_redis, url_or_private_redis
from packrat_mq.cli.profile_cmd import load_profile
from packrat_mq.instances import Configuration
from packrat_mq.settings import Settings


@click.command("optimize")
@click.option(
    "--profile", "-p", "profile_ref", required=True, metavar="PROFILE",
    help="Profile JSON file, or a model name looked up as profiles/<model>.json (this machine's, see `profile list`).",
)
@click.option(
    "--threads", "-t", type=click.IntRange(min=1), default=None,
    help="Core budget T [default: the profiled machine's physical cores, else the most threads profiled].",
)
@click.option("--batch", "-b", type=click.IntRange(min=1), required=True, help="Aggregated batch size B.")
@click.option(
    "--json", "as_json", is_flag=True,
    help='Print one JSON object: {"predicted_latency_ms", "instances": [{"threads", "batch", "count"}]}.',
)
@click.option("--calibrate", is_flag=True,
              help="Serve the top-k predicted configurations for real on this machine, pick the best "
                   "measured one and record the measurements in the profile.")
@click.option("--top-k", "top_k", type=click.IntRange(min=1), default=3, show_default=True,
              help="Candidates to measure with --calibrate.")
@click.option("--rounds", type=click.IntRange(min=1), default=15, show_default=True,
              help="Measured batches per candidate with --calibrate.")
@click.option("--redis-url", envvar="PACKRAT_REDIS_URL", default=None,
              help="Redis for --calibrate (default: a private embedded server).")
def optimize(profile_ref: str, threads: int | None, batch: int, as_json: bool, calibrate: bool,
             top_k: int, rounds: int, redis_url: str | None) -> None:
    """Choose instances (threads, batch) that serve a batch with the lowest predicted latency.

    Splits T cores and a batch of B requests among model instances so that the
    slowest instance, by the profile, is as fast as possible; among equally fast
    plans it uses the fewest threads, then the fewest instances.

    \b
    Examples:
      packrat-mq optimize --profile resnet50 --threads 16 --batch 64
      packrat-mq optimize -p profiles/bert.json -t 32 -b 100 --json
      packrat-mq optimize -p minilm -t 2 -b 8 --calibrate --top-k 3
    """
    path, prof = load_profile(profile_ref)
    budget = threads if threads is not None else default_threads(prof)
    config = plan(prof, budget, batch, where=path)
    if calibrate:
        config = run_calibration(prof, path, budget, batch, top_k, rounds, redis_url, as_json)
    if as_json:
        click.echo(json.dumps(to_json(config)))
    else:
        # Which file a model name found: several machines' profiles of one model may be kept (`profile list`).
        click.echo(f"profile: {path} ({prof.machine.summary() if prof.machine else 'machine unknown'})")
        click.echo(describe(prof, config, budget))


def default_threads(prof: Profile) -> int:
    """The profiled machine's physical cores when recorded, else its largest profiled thread count."""
    if prof.machine is not None and prof.machine.physical_cores:
        return prof.machine.physical_cores
    return max(prof.max_threads, 1)


def plan(prof: Profile, threads: int, batch: int, *, where: Path | None = None) -> Configuration:
    """``solve`` with domain errors turned into CLI errors (exit code 1, no traceback)."""
    try:
        return solve(prof, threads, batch)
    except (InfeasibleError, ProfileError) as exc:
        prefix = f"{where}: " if where is not None and isinstance(exc, ProfileError) else ""
        raise click.ClickException(f"{prefix}{exc}") from None


def to_json(config: Configuration) -> dict[str, Any]:
    return {"predicted_latency_ms": config.predicted_latency_ms, "instances": config.grouped()}


def describe(prof: Profile, config: Configuration, budget: int) -> str:
    groups = config.grouped()
    n = sum(g["count"] for g in groups)
    lines = [f"{prof.model} ({prof.mode}): batch {config.batch} on {budget} threads"]
    lines += [f"  {g['count']} x (threads={g['threads']}, batch={g['batch']})" for g in groups]
    lines.append(
        f"predicted latency: {config.predicted_latency_ms:.3f} ms "
        f"({config.threads} of {budget} threads, {n} instance{'s' if n != 1 else ''})"
    )
    lines.append(f"configuration: {config.compact()}")
    return "\n".join(lines)


def run_calibration(prof: Profile, path: Path, threads: int, batch: int, top_k: int, rounds: int,
                    redis_url: str | None, as_json: bool) -> Configuration:
    """Measure the top-k candidates side by side as served; report and record them; return the best."""
    say = (lambda m: click.echo(m, err=True)) if as_json else click.echo
    if redis_url is not None:
        require_redis(redis_url)  # one line before any candidate is started, not one per candidate
    try:
        with url_or_private_redis(redis_url) as url:
            best, results = calibrate(prof, url, Settings(redis_url=url, prefix="packrat-calibrate"),
                                      threads, batch, k=top_k, rounds=rounds, progress=say)
    except (InfeasibleError, RuntimeError) as exc:
        raise click.ClickException(f"calibration: {exc}") from None
    say(f"{'configuration':<24} {'predicted ms':>12} {'measured p50':>12} {'p10..p90':>18}")
    for m in results:
        d = m.as_dict()
        if m.error:
            say(f"{d['configuration']:<24} {d['predicted_ms'] or float('nan'):>12.2f}   failed: {m.error}")
            continue
        say(f"{d['configuration']:<24} {d['predicted_ms'] or float('nan'):>12.2f} {d['measured_p50_ms']:>12.2f} "
            f"{d['measured_p10_ms']:>8.2f}..{d['measured_p90_ms']:<8.2f}")
    prof.save(path)
    say(f"measured best: {best}; recorded in {path}")
    return best
