"""``packrat-mq profile path``: measure what the service adds to a model's batches.

A profile times the handler alone; a caller also waits for Redis, the
dispatcher and the worker's payload handling. This command measures that
cost per batch size with the model's own example payloads, served by the
model itself or a no-op stand-in (:func:`optimizer.calibration.measure_path`),
and stores it in the profile (``path_ms``), so predicted latencies are what a
caller sees. It lives apart from ``profile show`` and ``import`` because it
serves for real.
"""
from __future__ import annotations

import json
import click

from optimizer.calibration import measure_path
from optimizer.planning.profile import Profile, ProfileError, resolve_profile_path
from optimizer.profiling.options import power_of_two_batches
from packrat_mq.cli.helpers import redis_options, require_handler, url_or_private_redis
from packrat_mq.settings import Settings


@click.command("path")
@click.option("--model", required=True, help="Zoo name or module:Class whose example requests are sent.")
@click.option("--profile", "profile_ref", default=None,
              help="Profile to store the result in [default: the model's profile for this machine, as `up` finds it].")
@click.option("--max-batch", type=click.IntRange(min=1), default=32, show_default=True,
              help="Measure batches 1, 2, 4, ... up to this size.")
@click.option("--rounds", type=click.IntRange(min=1), default=15, show_default=True,
              help="Timed batches per size (after 3 warm-up batches); the median is kept.")
@click.option("--stand-in", "stand_in", is_flag=True,
              help="Serve with a no-op handler instead of the model: quicker, and it serves where the model "
                   "cannot, but it misses what a real batch leaves behind (0.3-1.7 ms for MiniLM).")
@click.option("--json", "as_json", is_flag=True, help="Print {batch: ms} as JSON.")
@redis_options
def path(model: str, profile_ref: str | None, max_batch: int, rounds: int, stand_in: bool, as_json: bool,
         settings: Settings) -> None:
    """Measure the serving path's cost per batch size and store it in the model's profile.

    Serves the model's own example requests (their size and type are what
    costs) through Redis, the dispatcher and one worker of the model with
    all the socket's cores (or a no-op stand-in, `--stand-in`), and
    keeps the median of each batch's latency less its handler's time per
    batch size. Predicted latencies (`up`, `optimize`) then include it.
    The model is served in the profile's mode (eager or its graph backend).

    \b
    Examples:
      packrat-mq profile path --model minilm
      packrat-mq profile path --model resnet50 --profile profiles/resnet50.torchscript.json --max-batch 16
    """
    require_handler(model)
    try:
        file = resolve_profile_path(profile_ref or model)
        prof = Profile.load(file)
    except ProfileError as exc:
        raise click.ClickException(str(exc)) from None
    say = (lambda m: click.echo(m, err=True)) if as_json else click.echo
    try:
        with url_or_private_redis(settings.redis_url) as url:
            # Its own prefix: a deployment of the same model on a shared Redis is not touched.
            measuring = settings.model_copy(update={"redis_url": url, "prefix": f"{settings.prefix}-path",
                                                    "graph_mode": prof.mode})
            costs = measure_path(url, measuring, model, power_of_two_batches(max_batch), rounds=rounds,
                                 progress=say, stand_in=stand_in)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    prof.path_ms = {**prof.path_ms, **costs}
    prof.save(file)
    if as_json:
        click.echo(json.dumps({str(b): ms for b, ms in sorted(prof.path_ms.items())}))
    else:
        click.echo(f"saved to {file}: " + ", ".join(f"b={b} {ms:.2f} ms" for b, ms in sorted(costs.items())))
