"""``packrat-mq profile``: import, inspect and plot latency profiles.

Measuring lives with the profiler; these commands only move profiles in
(``import`` from CSV) and look at them (``show``), so they never need torch.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import click
import numpy as np

from optimizer.planning.profile import (
    MACHINES_DIR,
    LatencyTable,
    MODES,
    MachineInfo,
    Mode,
    Placement,
    Profile,
    ProfileError,
    default_profile_dirs,
    profile_path,
    resolve_profile_path,
    unique_paths,
)
from optimizer.planning.selection import quick_profile_command


def load_profile(ref: str) -> tuple[Path, Profile]:
    """Resolve a path or model name and load it, turning domain errors into CLI errors."""
    try:
        path = resolve_profile_path(ref)
        return path, Profile.load(path)
    except ProfileError as exc:
        raise click.ClickException(str(exc)) from None


@click.group("profile")
def profile() -> None:
    """Measure, import, show and plot latency profiles L[threads, batch].

    \b
    Examples:
      packrat-mq profile import measurements.csv -o profiles/resnet50.json --model resnet50
      packrat-mq profile show resnet50 --plot resnet50.png
      packrat-mq profile list
    """


@profile.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON array, an object per profile file.")
def list_profiles(as_json: bool) -> None:
    """List every profile file that lookups by model name can find, and which one this machine uses.

    Profiles sit in ./profiles and the installation's profiles/, each
    directory's own files first and other machines' profiles of the same
    models in profiles/machines/<machine>/ (a profile run on a second kind of
    machine writes there instead of over the first one's). For each model and
    mode, the file marked "used" is the one `up`, `optimize` and `profile
    show MODEL` take on this machine: the first measured on a machine like
    this one, else the directory's own file (with a warning where it is used).

    \b
    Examples:
      packrat-mq profile list
      packrat-mq profile list --json | jq '.[] | select(.used) | .path'
    """
    here = MachineInfo.current()
    rows = []
    # The file each (model, mode) resolves to here: one lookup each, not one per file of it.
    chosen: dict[tuple[str, str], Path | None] = {}
    for path in sorted(all_profile_files(), key=lambda p: (p.name, str(p))):
        try:
            prof = Profile.load(path)
        except ProfileError as exc:
            rows.append({"path": str(path), "error": str(exc)})
            continue
        if (prof.model, prof.mode) not in chosen:
            try:
                chosen[prof.model, prof.mode] = resolve_profile_path(prof.model, mode=prof.mode, here=here).resolve()
            except ProfileError:
                chosen[prof.model, prof.mode] = None
        used = chosen[prof.model, prof.mode] == path.resolve()
        machine = prof.machine
        rows.append({
            "path": str(path), "model": prof.model, "mode": prof.mode, "placement": prof.placement,
            "machine": machine.model_dump() if machine else None,
            "machine_key": machine.key if machine else None,
            # null when the file does not say which machine it was measured on
            "matches_this_machine": None if machine is None else machine.matches(here),
            "used": used, "points": len(prof.entries), "path_measured": bool(prof.path_ms),
        })
    if as_json:
        click.echo(json.dumps(rows))
        return
    if not rows:
        click.echo("no profiles in " + ", ".join(str(d) for d in default_profile_dirs()))
        return
    click.echo(f"this machine: {here.summary()} [{here.key}]")
    for row in rows:
        if "error" in row:
            click.echo(f"  !  {row['path']}: {row['error']}")
            continue
        machine = row["machine"] or {}
        where = (f"{machine.get('cpu_model') or 'unknown CPU'}, {machine.get('cpu_id') or 'design unknown'}, "
                 f"measured {str(machine.get('date') or '?')[:16]}")
        match = {True: "this machine", False: "another machine", None: "machine unknown"}[row["matches_this_machine"]]
        mark = "*" if row["used"] else " "
        click.echo(f"  {mark}  {row['model']} ({row['mode']}, {row['points']} points) {row['path']}\n"
                   f"       {match}: {where}")
    click.echo("* the file used on this machine for its model and mode")


def all_profile_files() -> list[Path]:
    """Every profile file in the lookup directories, their own and other machines' (``machines/*/``)."""
    return unique_paths(path for d in default_profile_dirs()
                        for path in [*d.glob("*.json"), *(d / MACHINES_DIR).glob("*/*.json")] if path.is_file())


@profile.command("import")
@click.argument("csv_file", metavar="FILE.csv", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="Profile to write [default: profiles/<model>.json; profiles/<model>.<backend>.json for a graph backend].",
)
@click.option("--model", default=None, help="Model name [default: the CSV file's stem].")
@click.option(
    "--mode", type=click.Choice(list(MODES)), default="eager", show_default=True,
    help="How the model was run when measured: eager or a graph backend.",
)
@click.option(
    "--placement", type=click.Choice(["isolated", "co-located"]), default="isolated", show_default=True,
    help="How each point was measured: one instance alone, or beside copies of itself filling the socket.",
)
@click.option(
    "--on-duplicate", "duplicates", type=click.Choice(["mean", "error"]), default="mean",
    show_default=True, help="Average repeated (threads, batch_size) rows, or reject them.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
def import_csv(
    csv_file: Path, output: Path | None, model: str | None, mode: Mode,
    placement: Placement, duplicates: Literal["mean", "error"], force: bool,
) -> None:
    """Import a CSV of measurements into a JSON profile.

    The CSV needs a header with the columns threads, batch_size and latency_ms
    (milliseconds per batch); other columns are ignored.

    \b
    Example:
      packrat-mq profile import resnet50.csv -o profiles/resnet50.json --model resnet50
    """
    try:
        prof = Profile.from_csv(csv_file, model=model, mode=mode, duplicates=duplicates, placement=placement)
    except ProfileError as exc:
        raise click.ClickException(str(exc)) from None
    # Same file names as the profiler, so `optimize -p <model>` finds either.
    output = output or profile_path(prof.model, prof.mode)
    if output.exists() and not force:
        raise click.ClickException(f"{output} exists; pass --force to overwrite it")
    prof.save(output)
    click.echo(
        f"imported {len(prof.entries)} measurements of {prof.model} "
        f"(threads {_span(prof.table().threads)}, batch sizes "
        f"{','.join(str(b) for b in prof.batch_sizes)}) -> {output}"
    )


@profile.command("show")
@click.argument("profile_ref", metavar="PROFILE")
@click.option("--json", "as_json", is_flag=True, help="Print the table as one JSON object.")
@click.option(
    "--plot", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE.png",
    help="Also draw a heatmap of L[t, b] and the speed-up per batch size (needs matplotlib).",
)
def show(profile_ref: str, as_json: bool, plot: Path | None) -> None:
    """Print a profile as a threads x batch-size table of latencies (ms).

    PROFILE is a path or a model name looked up as profiles/<model>.json (this machine's own
    from profiles/machines/ where another machine's holds that name; `profile list` shows all).
    The header says how the points were measured (co-located or isolated)
    and whether the profile's machine is this one.

    \b
    Examples:
      packrat-mq profile show resnet50
      packrat-mq profile show profiles/bert.json --json
      packrat-mq profile show resnet50 --plot resnet50.png
    """
    path, prof = load_profile(profile_ref)
    try:
        table = prof.table()
    except ProfileError as exc:
        raise click.ClickException(f"{path}: {exc}") from None
    here = MachineInfo.current()
    differences = prof.machine.differences(here) if prof.machine else None
    if as_json:
        click.echo(json.dumps({
            "model": prof.model,
            "mode": prof.mode,
            "placement": prof.placement,
            "machine": prof.machine.model_dump() if prof.machine else None,
            # null when the profile does not say which machine it was measured on
            "matches_this_machine": None if differences is None else not differences,
            "threads": table.threads.tolist(),
            "batches": table.batches.tolist(),
            "latency_ms": [[None if math.isnan(v) else v for v in row] for row in table.latency_ms.tolist()],
            # Per point, how far its passes' means spread ((max - min) / mean); null where measured once.
            "pass_spread": [[None if (e := prof.entry(int(t), int(b))) is None else e.pass_spread
                             for b in table.batches] for t in table.threads],
        }))
    else:
        click.echo(_describe(prof, path, here, named=Path(profile_ref).is_file()))
        click.echo(format_table(table))
    if plot is not None:
        plot_profile(table, f"{prof.model} ({prof.mode})", plot)
        click.echo(f"wrote {plot}", err=True)


def _span(values: np.ndarray) -> str:
    lo, hi = int(values.min()), int(values.max())
    return str(lo) if lo == hi else f"{lo}..{hi}"


def _describe(prof: Profile, path: Path, here: MachineInfo, *, named: bool = True) -> str:
    if prof.machine is None:
        machine = "unknown machine (cannot tell whether it is this one)"
    else:
        differences = prof.machine.differences(here)
        if differences:
            verdict = (f"NOT this machine: {'; '.join(differences)} (profile vs this machine)"
                       f"\n  profile this one: {quick_profile_command(prof.model, path if named else None, mode=prof.mode)}")
        elif prof.machine.cpu_id:
            verdict = "matches this machine (CPU model, design and vector extensions, cores per socket)"
        else:
            verdict = ("matches this machine (CPU model and cores per socket; the profile does not record the "
                       "CPU's design, so a machine of the same name may still differ)")
        machine = f"{prof.machine.summary()}\n  {verdict}"
    copies = sorted({e.copies for e in prof.entries if e.copies})
    placement = {
        "co-located": "co-located: each point timed beside copies of itself filling the socket's cores, "
                      "the slowest taken" + (f" ({', '.join(map(str, copies))} copies)" if copies else ""),
        "isolated": "isolated: each point timed with one instance alone on the machine",
    }[prof.placement]
    lines = [
        f"{prof.model} ({prof.mode}) from {path}",
        f"placement: {placement}",
        f"machine: {machine}",
        f"{len(prof.entries)} measurements, {len(prof.calibrations)} calibrations",
        ("serving path (ms per batch, `profile path`): "
         + ", ".join(f"b={b} {ms:.2f}" for b, ms in sorted(prof.path_ms.items()))
         if prof.path_ms else "serving path: not measured (`packrat-mq profile path --model M`)"),
        "mean latency (ms) per batch; rows: threads, columns: batch size",
    ]
    spreads = sorted(((e.pass_spread, e.threads, e.batch, len(e.pass_means_ms or []))
                      for e in prof.entries if e.pass_spread is not None), reverse=True)
    if spreads:
        worst, t, b, _ = spreads[0]
        passes = sorted({n for *_, n in spreads})
        lines.insert(-1, f"passes: {'/'.join(map(str, passes))} ({len(spreads)} of {len(prof.entries)} points); "
                         f"their means spread by a median {100 * spreads[len(spreads) // 2][0]:.1f}%, "
                         f"at most {100 * worst:.1f}% (t={t} b={b})")
    return "\n".join(lines)


def format_table(table: LatencyTable) -> str:
    """Right-aligned text table, ``-`` where not measured."""
    head = ["threads", *(str(int(b)) for b in table.batches)]
    rows = [
        [str(int(t)), *("-" if math.isnan(v) else f"{v:.2f}" for v in row)]
        for t, row in zip(table.threads, table.latency_ms.tolist())
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head, *rows])


def plot_profile(table: LatencyTable, title: str, path: Path) -> None:
    """Heatmap of L[t, b] and speed-up L[t0, b] / L[t, b] against t (t0: fewest threads measured).

    matplotlib is optional, so it is imported here; a bare ``Figure`` with an
    Agg canvas draws without pyplot and without touching the global backend.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import LogNorm
        from matplotlib.figure import Figure
    except ImportError:
        raise click.ClickException(
            "--plot needs matplotlib; install it with: pip install 'packrat-mq[plot]'"
        ) from None
    threads, batches, lat = table
    fig = Figure(figsize=(13, 5), layout="constrained")
    FigureCanvasAgg(fig)
    heat, curves = fig.subplots(1, 2)

    image = heat.imshow(
        np.ma.masked_invalid(lat), aspect="auto", origin="lower", cmap="viridis", norm=LogNorm(),
        interpolation="nearest",
    )
    heat.set_xticks(range(batches.size), [str(int(b)) for b in batches])
    ticks = np.unique(np.linspace(0, threads.size - 1, min(threads.size, 16)).round().astype(int))
    heat.set_yticks(ticks, [str(int(threads[i])) for i in ticks])
    heat.set_xlabel("batch size b")
    heat.set_ylabel("threads t")
    heat.set_title(f"{title}: latency L[t, b]")
    fig.colorbar(image, ax=heat, label="ms (log scale)")

    for j, b in enumerate(batches):
        measured = np.isfinite(lat[:, j])
        if not measured.any():
            continue
        t, col = threads[measured], lat[measured, j]
        note = "" if t[0] == 1 else f" (vs t={int(t[0])})"
        curves.plot(t, col[0] / col, marker=".", label=f"b={int(b)}{note}")
    curves.plot(threads, threads / threads[0], "k--", linewidth=1, label="linear")
    curves.set_xlabel("threads t")
    curves.set_ylabel("speed-up L[1, b] / L[t, b]")
    curves.set_title("speed-up per batch size")
    curves.legend(fontsize="small", ncol=2)
    curves.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=110)
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot write plot {path}: {exc}") from None
