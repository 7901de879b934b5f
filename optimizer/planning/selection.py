"""Which configuration to serve a model with, given a core budget T and batch B.

The order of preference, shared by ``packrat-mq up``/``pool`` and the demo:
the measured best recorded by calibration for exactly (T, B); else the
optimizer's choice from the model's profile; else, with no profile, one
instance with every thread (the TorchServe default), said out loud.

The profile is the one of the mode served in (``<model>.json`` eager,
``<model>.<backend>.json`` for a graph backend, e.g. ``resnet50.compile.json``):
latencies measured in one mode say little about another, so a profile of
another mode is not used.

A profile measured on another kind of machine (another CPU model, another
number of cores per socket) is still used, with a warning
(:func:`machine_warning`) that names both machines and the command that
profiles this one in minutes: its latencies are off, but its shape (how
latency grows with the batch, how it falls with threads) usually still ranks
configurations better than one instance with every thread, and refusing to
serve would turn a planning problem into an outage.

The pure parts of calibration live here too: which candidates calibration
should measure (:func:`candidates`, ranked by :func:`predicted_latency`), and
the measured best it recorded (:func:`best_calibrated`). Serving them for real
is ``optimizer.calibration``'s job.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from optimizer.planning.profile import (
    DEFAULT_MAX_BATCH,
    MODES,
    Calibration,
    MachineInfo,
    Profile,
    ProfileError,
    machine_profile_path,
    profile_filename,
    resolve_profile_path,
)
from optimizer.planning.solving import InfeasibleError, solve
from packrat_mq.instances import Configuration
from packrat_mq.topology import Topology


@dataclass
class Choice:
    configuration: Configuration
    #: How it was chosen, for the operator: "calibrated", "optimizer" or "default".
    source: str
    profile_path: Path | None
    note: str
    #: Set when the profile was measured on another kind of machine (see :func:`machine_warning`).
    warning: str | None = None


def find_profile(model: str, profile: str | Path | None = None, *, mode: str = "eager") -> Path | None:
    """The profile to use: ``profile`` if given (``ProfileError`` if missing), else the model's, if any.

    The model's profile is the one of the mode served in (``mode``: ``eager``
    or a graph backend): ``<model>.<backend>.json``, else ``<model>.json``.
    """
    try:
        return resolve_profile_path(profile or model, mode=mode)
    except ProfileError:
        if profile:
            raise
        return None


def choose(model: str, threads: int, batch: int, profile: str | Path | None = None, *,
           mode: str = "eager", handler: str | None = None) -> Choice:
    """The configuration for (T, B); raises ``ProfileError`` for a named profile that is missing.

    ``InfeasibleError`` (a ``ValueError``) propagates when the profile cannot
    cover B within T. ``handler`` (default ``model``) is what the commands
    this recommends profile.
    """
    path = find_profile(model, profile, mode=mode)
    if path is None:
        config = Configuration.uniform(1, threads, batch)
        others = [(m, p) for m in MODES if m != mode and (p := find_profile(model, mode=m)) is not None]
        if len(others) == 1:
            unused = f"; {others[0][1]} is the {others[0][0]} profile, not used in {mode} mode"
        else:
            unused = (f"; {', '.join(f'{p} ({m})' for m, p in others)} are other modes' profiles, not used in "
                      f"{mode} mode" if others else "")
        command = f"packrat-mq profile run --model {model}" + graph_option(mode)
        return Choice(config, "default", None,
                      f"no {profile_filename(model, mode)} profile for {model!r}{unused}: one instance with "
                      f"{threads} threads and batch {batch} (run `{command}` to let the optimizer choose)")
    loaded = Profile.load(path)
    warning = machine_warning(loaded, path, handler or model, mode=mode, threads=threads, batch=batch,
                              named=profile is not None)
    calibrated = best_calibrated(loaded, threads, batch)
    if calibrated is not None:
        config, row = calibrated
        return Choice(config, "calibrated", path,
                      f"calibrated best for T={threads}, B={batch} from {path}: {config} "
                      f"(measured p50 {row.measured_p50_ms:.2f} ms)", warning)
    config = solve(loaded, threads, batch)
    path_ms = loaded.path_cost_ms(batch)
    serving = (f" + {path_ms:.2f} ms serving path = {config.predicted_latency_ms + path_ms:.2f} ms"
               if path_ms is not None and config.predicted_latency_ms is not None else "")
    return Choice(config, "optimizer", path,
                  f"optimizer on {path} for T={threads}, B={batch}: {config} "
                  f"(predicted {config.predicted_latency_ms:.2f} ms per batch{serving}, "
                  f"{loaded.placement} profile)", warning)


def machine_warning(profile: Profile, path: Path, model: str, *, mode: str = "eager",
                    threads: int | None = None, batch: int | None = None,
                    here: MachineInfo | None = None, named: bool = True) -> str | None:
    """What to tell the operator when ``profile`` was measured on another kind of machine; None if not.

    Compares the CPU model and the cores per socket with ``here`` (default:
    this machine); a field either side does not know (a CSV import knows
    none) is no difference. The advice is a quick profile of the (T, B) being
    planned: written over ``path`` when the operator ``named`` that file;
    else (a profile found by the model's name) to the profiler's default,
    which keeps ``path`` for its own machine and writes this machine's profile
    beside it (``profiles/machines/<key>/``), where the next lookup here finds it.
    """
    if profile.machine is None:
        return None
    here = here or MachineInfo.current()
    differences = profile.machine.differences(here)
    if not differences:
        return None
    command = quick_profile_command(model, path if named else None, mode=mode, threads=threads, batch=batch)
    where = "" if named else f" (written to {machine_profile_path(profile.model, mode, here=here)}, kept beside {path})"
    return (
        f"warning: {path} was measured on another machine: {'; '.join(differences)} (profile vs this "
        f"machine). Its latencies may not hold here; serving from it anyway. To profile this machine "
        f"(minutes): {command}{where}"
    )


def graph_option(mode: str) -> str:
    """The command-line option that selects ``mode`` (`` --graph compile``; nothing for eager)."""
    return "" if mode == "eager" else f" --graph {mode}"


def quick_profile_command(model: str, output: Path | None = None, *, mode: str = "eager",
                          threads: int | None = None, batch: int | None = None) -> str:
    """``packrat-mq profile run --model M --quick ...``: the points the optimizer needs for (T, B).

    ``--threads-max T`` only when T is fewer than this machine's socket has,
    ``--max-batch B`` only past the default 32: the file is replaced, and a
    profile of B=1 alone would leave every later ``--batch`` without a plan,
    for little time saved. With ``output``, ``--fresh -o output``: points from
    another machine do not resume.
    """
    parts = ["packrat-mq profile run", f"--model {model}", "--quick"]
    if mode != "eager":
        parts.append(f"--graph {mode}")
    if threads is not None and threads < Topology.detect().max_cores_per_socket:
        parts.append(f"--threads-max {threads}")
    if batch is not None and batch > DEFAULT_MAX_BATCH:
        parts.append(f"--max-batch {batch}")
    if output is not None:
        parts.append(f"--fresh -o {output}")
    return " ".join(parts)


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
