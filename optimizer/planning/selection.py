"""Which configuration to serve a model with, given a core budget T and batch B.

The order of preference, shared by ``packrat-mq up``/``pool`` and the demo:
the measured best recorded by calibration for exactly (T, B); else the
optimizer's choice from the model's profile; else, with no profile, one
instance with every thread (the TorchServe default), said out loud.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from optimizer.calibration import best_calibrated
from optimizer.planning.profile import Profile, ProfileError, resolve_profile_path
from optimizer.planning.solving import solve
from packrat_mq.instances import Configuration


@dataclass
class Choice:
    configuration: Configuration
    #: How it was chosen, for the operator: "calibrated", "optimizer" or "default".
    source: str
    profile_path: Path | None
    note: str


def find_profile(model: str, profile: str | Path | None = None) -> Path | None:
    """The profile to use: ``profile`` if given (``ProfileError`` if missing), else the model's, if any."""
    try:
        return resolve_profile_path(profile or model)
    except ProfileError:
        if profile:
            raise
        return None


def choose(model: str, threads: int, batch: int, profile: str | Path | None = None) -> Choice:
    """The configuration for (T, B); raises ``ProfileError`` for a named profile that is missing.

    ``InfeasibleError`` (a ``ValueError``) propagates when the profile cannot
    cover B within T.
    """
    path = find_profile(model, profile)
    if path is None:
        config = Configuration.uniform(1, threads, batch)
        return Choice(config, "default", None,
                      f"no profile for {model!r}: one instance with {threads} threads and batch {batch} "
                      f"(run `packrat-mq profile run --model {model}` to let the optimizer choose)")
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
