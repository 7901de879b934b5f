"""Which configuration to serve a model with, given a core budget T and batch B.

The order of preference, shared by ``packrat-mq up``/``pool`` and the demo:
the measured best recorded by calibration for exactly (T, B); else the
optimizer's choice from the model's profile; else, with no profile, one
instance with every thread (the TorchServe default), said out loud.

The profile is the one of the mode served in (``<model>.json`` eager,
``<model>.graph.json`` graph mode): latencies measured in one mode say little
about the other, so a profile of the other mode is not used.

The pure parts of calibration live here too: which candidates calibration
should measure (:func:`candidates`, ranked by :func:`predicted_latency`), and
the measured best it recorded (:func:`best_calibrated`). Serving them for real
is ``optimizer.calibration``'s job.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from optimizer.planning.profile import Calibration, Profile, ProfileError, profile_filename, resolve_profile_path
from optimizer.planning.solving import InfeasibleError, solve
from packrat_mq.instances import Configuration


@dataclass
class Choice:
    configuration: Configuration
    #: How it was chosen, for the operator: "calibrated", "optimizer" or "default".
    source: str
    profile_path: Path | None
    note: str


def find_profile(model: str, profile: str | Path | None = None, *, graph: bool = False) -> Path | None:
    """The profile to use: ``profile`` if given (``ProfileError`` if missing), else the model's, if any.

    The model's profile is the one of the mode served in: ``<model>.graph.json``
    when ``graph``, else ``<model>.json``.
    """
    try:
        return resolve_profile_path(profile or model, graph=graph)
    except ProfileError:
        if profile:
            raise
        return None


def choose(model: str, threads: int, batch: int, profile: str | Path | None = None, *,
           graph: bool = False) -> Choice:
    """The configuration for (T, B); raises ``ProfileError`` for a named profile that is missing.

    ``InfeasibleError`` (a ``ValueError``) propagates when the profile cannot
    cover B within T.
    """
    path = find_profile(model, profile, graph=graph)
    if path is None:
        config = Configuration.uniform(1, threads, batch)
        other = find_profile(model, graph=not graph)
        unused = (f"; {other} is {'an eager' if graph else 'a graph'}-mode profile, not used in "
                  f"{'graph' if graph else 'eager'} mode" if other is not None else "")
        command = f"packrat-mq profile run --model {model}" + (" --graph" if graph else "")
        return Choice(config, "default", None,
                      f"no {profile_filename(model, graph)} profile for {model!r}{unused}: one instance with "
                      f"{threads} threads and batch {batch} (run `{command}` to let the optimizer choose)")
    loaded = Profile.load(path)
    calibrated = best_calibrated(loaded, threads, batch)
    if calibrated is not None:
        config, row = calibrated
        return Choice(config, "calibrated", path,
                      f"calibrated best for T={threads}, B={batch} from {path}: {config} "
                      f"(measured p50 {row.measured_p50_ms:.2f} ms)")
    config = solve(loaded, threads, batch)
    return Choice(config, "optimizer", path,
                  f"optimizer on {path} for T={threads}, B={batch}: {config} "
                  f"(predicted {config.predicted_latency_ms:.2f} ms per batch)")


def predicted_latency(profile: Profile, configuration: Configuration) -> float | None:
    """The profile's prediction for a configuration: its slowest instance, if all are profiled."""
    worst = 0.0
    for inst in configuration.instances:
        entry = profile.entry(inst.threads, inst.batch)
        if entry is None:
            return None
        worst = max(worst, entry.mean_ms)
    return worst


def candidates(profile: Profile, threads: int, batch: int, k: int = 3) -> list[Configuration]:
    """Up to ``k`` distinct configurations for (T, B), best predicted first.

    The dynamic program returns only its optimum, so the candidates are the
    optimum for every thread budget t <= T (idle threads included) plus every
    uniform configuration (i instances of t threads, B/i each) whose point is
    profiled, ranked by predicted latency.
    """
    found: dict[tuple[tuple[int, int], ...], Configuration] = {}

    def add(config: Configuration) -> None:
        key = tuple(sorted((i.threads, i.batch) for i in config.instances))
        if key not in found:
            found[key] = config

    for t in range(1, threads + 1):
        try:
            add(solve(profile, t, batch))
        except InfeasibleError:
            continue
    for count in range(1, batch + 1):
        if batch % count:
            continue
        for t in range(1, threads // count + 1):
            config = Configuration.uniform(count, t, batch // count)
            predicted = predicted_latency(profile, config)
            if predicted is not None:
                add(config.model_copy(update={"predicted_latency_ms": predicted}))
    ranked = sorted(found.values(), key=lambda c: (c.predicted_latency_ms or float("inf"), c.threads, len(c.instances)))
    return ranked[:k]


def best_calibrated(profile: Profile, threads: int, batch: int) -> tuple[Configuration, Calibration] | None:
    """The measured best configuration recorded for exactly (T, B), if calibrated."""
    rows = [c for c in profile.calibrations if c.threads == threads and c.batch == batch and c.measured_p50_ms]
    if not rows:
        return None
    best = min(rows, key=lambda c: c.measured_p50_ms or float("inf"))
    config = Configuration.parse(best.configuration)
    return config.model_copy(update={"predicted_latency_ms": best.predicted_ms}), best
