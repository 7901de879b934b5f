"""Latency profiles: what one model measured on one machine, ``L[t, b]`` in milliseconds.

A profile is the optimizer's only input about the world. It records, for each
measured pair (threads ``t``, batch ``b``), the latency of one instance running
a batch of ``b`` requests on ``t`` pinned cores, plus the machine it was measured
on, because a profile from a 16-core server stays valid for planning that
server from a 2-core laptop (and :meth:`MachineInfo.differences` says when a
profile is used on another kind of machine than its own).

Its ``placement`` says what surrounded each instance while it was timed:
``co-located`` (the profiler's default) ran ``copies`` instances of the same
``(t, b)`` side by side on the socket's cores and recorded the slowest, the
latency an instance delivers in a packed machine; ``isolated`` ran one
instance alone. Files older than format 2 do not say, and were isolated.

Profiles are pretty-printed JSON (``Profile.save``/``Profile.load``) so that
they diff well in review; ``Profile.from_csv`` imports measurements made
elsewhere. Every problem with the data surfaces as ``ProfileError`` with a
message that names the file, line or entry at fault.
"""
from __future__ import annotations

import csv
import hashlib
import importlib.metadata
import json
import math
import os
import re
import socket
import tempfile
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from packrat_mq.graph import MODES
from packrat_mq.instances import Configuration, ConfigurationError
from packrat_mq.keys import check_model_name
from packrat_mq.topology import DEFAULT_SYSFS_CPU, Topology, parse_cpulist

#: Bumped when a change to the JSON layout would make older code misread a file.
#: 2: ``placement`` and each entry's ``copies`` (a version 1 file reads as isolated).
#: 3: ``path_ms``, the serving path's cost per batch size (older files have none).
FORMAT_VERSION = 3

#: What surrounded each instance while it was timed (see the module docstring).
Placement = Literal["co-located", "isolated"]

#: How the model ran when measured: eager, or a graph backend (``packrat_mq.graph.MODES``).
#: Files written before the backends had names say ``graph``, which was TorchScript.
Mode = Literal["eager", "torchscript", "compile", "export", "aoti"]
#: Where TorchScript profiles were written before the backends had names (``--graph`` was TorchScript).
LEGACY_TORCHSCRIPT = "{model}.graph.json"

#: The largest batch size a profile measures unless told otherwise (``profile run --max-batch``).
DEFAULT_MAX_BATCH = 32

#: Columns ``Profile.from_csv`` needs; any other column is ignored.
CSV_COLUMNS = ("threads", "batch_size", "latency_ms")

class ProfileError(ValueError):
    """A profile that is missing, unreadable or inconsistent."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class MachineInfo(BaseModel):
    """The machine a profile was measured on; every field may be unknown (CSV imports)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    cpu_model: str | None = None
    #: Which CPU design, beyond its name: x86 vendor, family, model and stepping, or an ARM core's
    #: implementer and part. A cloud VM's "AMD EPYC" names Zen 2 to Zen 5 alike.
    cpu_id: str | None = None
    #: The vector extensions that torch's CPU kernels choose between (AVX2, AVX-512 and its VNNI and
    #: BF16, AMX; SVE, dot product, BF16 on ARM), as the kernel lists them.
    cpu_isa: tuple[str, ...] | None = None
    sockets: int | None = Field(default=None, ge=1)
    physical_cores: int | None = Field(default=None, ge=1)
    logical_cpus: int | None = Field(default=None, ge=1)
    torch_version: str | None = None
    hostname: str | None = None
    date: str | None = None

    @classmethod
    def current(cls) -> MachineInfo:
        """Describe this machine without importing torch (its import costs seconds)."""
        topology = _machine_topology()
        sockets = len(topology.sockets) if topology is not None else None
        physical = topology.physical_cores if topology is not None else None
        if physical is None:
            try:
                import psutil

                physical = psutil.cpu_count(logical=False)
            except ImportError:  # psutil is a core dependency, but the reading must not fail
                physical = None
        try:
            torch_version: str | None = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch_version = None
        cpuinfo = _cpuinfo()
        cpu_id, cpu_isa = _cpu_design(cpuinfo)
        return cls(
            cpu_model=_cpu_model(cpuinfo),
            cpu_id=cpu_id,
            cpu_isa=cpu_isa,
            sockets=sockets,
            physical_cores=physical,
            logical_cpus=os.cpu_count(),
            torch_version=torch_version,
            hostname=socket.gethostname(),
            date=_now(),
        )

    @property
    def cores_per_socket(self) -> int | None:
        """Physical cores of one socket (of the largest, if they differ), when both counts are known."""
        if not self.sockets or not self.physical_cores:
            return None
        return -(-self.physical_cores // self.sockets)

    def differences(self, other: MachineInfo) -> list[str]:
        """How ``other`` differs from this machine in what a profile depends on.

        The CPU (its model name, its design, its vector extensions) and the
        cores per socket. A field unknown on either side (a CSV import knows
        none, profiles before 2026-12-02 no design) is no difference. Host
        names, dates and torch versions are not compared: a profile moved to
        an identical machine is still its profile. The name alone is not
        enough: two VMs both called "AMD EPYC" ran ResNet-50 at B=1 on two
        threads in 42.6 and 120.7 ms (their profiles of 2026-12-02).
        """
        out = []
        if self.cpu_model and other.cpu_model and self.cpu_model != other.cpu_model:
            out.append(f"CPU {self.cpu_model!r} vs {other.cpu_model!r}")
        elif self.cpu_id and other.cpu_id and self.cpu_id != other.cpu_id:
            out.append(f"CPU design {self.cpu_id!r} vs {other.cpu_id!r}")
        if self.cpu_isa is not None and other.cpu_isa is not None and set(self.cpu_isa) != set(other.cpu_isa):
            only_mine = sorted(set(self.cpu_isa) - set(other.cpu_isa))
            only_theirs = sorted(set(other.cpu_isa) - set(self.cpu_isa))
            out.append("vector extensions " + ", ".join([f"{x} only in the profile" for x in only_mine]
                                                        + [f"{x} only here" for x in only_theirs]))
        mine, theirs = self.cores_per_socket, other.cores_per_socket
        if mine and theirs and mine != theirs:
            out.append(f"{mine} vs {theirs} cores per socket")
        return out

    def matches(self, other: MachineInfo) -> bool:
        """Whether ``other`` is known to be this kind of machine: the CPU named, and no difference."""
        return bool(self.cpu_model or self.cpu_id) and not self.differences(other)

    @property
    def key(self) -> str:
        """A directory name for this kind of machine: ``amd-epyc-25-1-2c-4d1f0e``.

        What :meth:`differences` compares, readable where it can be (the CPU's
        name, family and model, cores per socket) and a short digest of the
        whole (the design with its stepping, the vector extensions), so two
        VMs of one name and family that differ in AVX-512 get two directories.
        Lookups never trust the name: they compare the machine inside the file.
        """
        name = re.sub(r"[^a-z0-9]+", "-", (self.cpu_model or "unknown-cpu").lower())
        name = re.sub(r"-(r|tm|processor|cpu)(?=-|$)", "", name).strip("-")[:32].strip("-") or "cpu"
        numbers = re.findall(r"(?:family|model|part|implementer) (\w+)", self.cpu_id or "")
        cores = self.cores_per_socket
        whole = json.dumps([self.cpu_model, self.cpu_id, sorted(self.cpu_isa or ()), cores])
        digest = hashlib.sha1(whole.encode()).hexdigest()[:6]
        parts = [name, *numbers[:2], f"{cores}c" if cores else "", digest]
        return "-".join(p for p in parts if p)

    def summary(self) -> str:
        """One line for humans, e.g. ``Intel Xeon ... 2 sockets, 32 cores, 64 CPUs``."""
        parts = [(self.cpu_model or "unknown CPU") + (f" ({' '.join(self.cpu_isa)})" if self.cpu_isa else "")]
        if self.sockets:
            parts.append(f"{self.sockets} socket{'s' if self.sockets > 1 else ''}")
        if self.physical_cores:
            parts.append(f"{self.physical_cores} cores")
        if self.logical_cpus:
            parts.append(f"{self.logical_cpus} CPUs")
        if self.torch_version:
            parts.append(f"torch {self.torch_version}")
        if self.hostname:
            parts.append(f"on {self.hostname}")
        return ", ".join(parts)


def _cpuinfo() -> str | None:
    """/proc/cpuinfo, read once for the model name and the design; None where there is none."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def _cpu_model(text: str | None) -> str | None:
    """The CPU's model name from /proc/cpuinfo's ``text`` ("model name", or "Model" on ARM); None if unknown."""
    if text is None:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("model name", "Model") and value.strip():
            return value.strip()
    return None


#: Vector extensions from /proc/cpuinfo's flags (x86) or Features (ARM) that change which kernels torch runs.
CPU_ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                 "amx_int8", "sve", "sve2", "asimddp", "bf16", "i8mm")


def _cpu_design(text: str | None) -> tuple[str | None, tuple[str, ...] | None]:
    """(the CPU's design, its vector extensions) from the first processor of /proc/cpuinfo's ``text``; None if unknown.

    x86: ``"AuthenticAMD family 25 model 1 stepping 1"``; ARM: ``"ARM implementer 0x41 part 0xd0c
    variant 0x3"``.
    """
    if text is None:
        return None, None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    design: str | None = None
    if "cpu family" in fields and "model" in fields:
        design = (f"{fields.get('vendor_id', 'x86')} family {fields['cpu family']} model {fields['model']}"
                  + (f" stepping {fields['stepping']}" if fields.get("stepping") else ""))
    elif "CPU implementer" in fields and "CPU part" in fields:
        design = (f"ARM implementer {fields['CPU implementer']} part {fields['CPU part']}"
                  + (f" variant {fields['CPU variant']}" if fields.get("CPU variant") else ""))
    listed = fields.get("flags", fields.get("Features"))
    isa = tuple(flag for flag in CPU_ISA_FLAGS if flag in set(listed.split())) if listed is not None else None
    return design, isa


def _machine_topology(root: str | os.PathLike[str] = DEFAULT_SYSFS_CPU) -> Topology | None:
    """The whole machine's sockets and cores, as ``packrat_mq.topology`` reads them.

    Every online CPU counts, not only this process's cpuset: a profile records
    the machine. None when sysfs has no topology: the fallback's "every CPU
    is a core" is a guess, not a count worth recording in a profile.
    """
    try:
        online: list[int] | None = parse_cpulist(Path(root, "online").read_text()) or None
    except (OSError, ValueError):
        online = None  # then the process's cpuset
    try:
        topology = Topology.from_sysfs(root, allowed=online)
    except (OSError, ValueError):
        return None
    return topology if topology.source == "sysfs" else None


class ProfileEntry(BaseModel):
    """One measured point: ``threads`` cores running a batch of ``batch`` requests.

    Only ``threads``, ``batch`` and ``mean_ms`` are required, so a CSV with a single
    latency column imports; the profiler fills in the distribution as well.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    threads: int = Field(ge=1)
    batch: int = Field(ge=1)
    mean_ms: float = Field(gt=0, allow_inf_nan=False)
    p50_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    p99_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    min_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    std_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    iterations: int | None = Field(default=None, ge=1)
    #: Instances of this (threads, batch) timed together (the slowest is the
    #: sample): ``T // threads`` in a co-located profile, 1 isolated; None if unknown.
    copies: int | None = Field(default=None, ge=1)
    #: The mean of each pass, where the point was measured in several (``profile run --passes``):
    #: ``mean_ms`` is their mean, and their spread is how much the host moved between passes.
    #: None: one pass. The distribution fields above are of the samples of the last run's passes.
    pass_means_ms: list[float] | None = Field(default=None, min_length=2)

    @property
    def pass_spread(self) -> float | None:
        """(max - min) / mean of the pass means; None for one pass."""
        if not self.pass_means_ms:
            return None
        return (max(self.pass_means_ms) - min(self.pass_means_ms)) / self.mean_ms


class Calibration(BaseModel):
    """A configuration that was run end to end, to compare prediction with reality.

    Filled by the optimizer's calibration step; ``spread_ms`` is the standard
    deviation of the measured batch latency.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    configuration: str
    threads: int = Field(ge=1, description="Core budget T the configuration was planned for.")
    batch: int = Field(ge=1, description="Aggregated batch B.")
    predicted_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    measured_p50_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    measured_mean_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    measured_p99_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    spread_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    date: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Calibration:
        try:
            config = Configuration.parse(self.configuration)
        except ConfigurationError as exc:
            raise ProfileError(f"calibration {self.configuration!r}: {exc}") from None
        if config.batch != self.batch:
            raise ProfileError(
                f"calibration {self.configuration!r} serves batch {config.batch}, not {self.batch}"
            )
        if config.threads > self.threads:
            raise ProfileError(
                f"calibration {self.configuration!r} uses {config.threads} threads, "
                f"more than its budget of {self.threads}"
            )
        return self


class LatencyTable(NamedTuple):
    """``latency_ms[i, j]`` is L at ``threads[i]``, ``batches[j]``; NaN where not measured.

    ``threads`` and ``batches`` are sorted, unique, positive int64 arrays; the
    arrays of a table from ``Profile.table`` are read-only because they are cached.
    """

    threads: np.ndarray
    batches: np.ndarray
    latency_ms: np.ndarray


def as_table(threads: Sequence[int] | np.ndarray, batches: Sequence[int] | np.ndarray,
             latency_ms: Sequence[Sequence[float]] | np.ndarray) -> LatencyTable:
    """Check and normalise raw arrays into a ``LatencyTable`` (sorted axes, float64, read-only).

    NaN or +inf marks an unmeasured point; anything else must be a positive latency.
    """
    t = np.asarray(threads)
    b = np.asarray(batches)
    lat = np.asarray(latency_ms, dtype=np.float64)
    for name, axis in (("threads", t), ("batches", b)):
        if axis.ndim != 1 or axis.size == 0:
            raise ProfileError(f"{name} must be a non-empty 1-D array, got shape {axis.shape}")
        if not np.issubdtype(axis.dtype, np.integer):
            if not (np.issubdtype(axis.dtype, np.floating) and np.all(axis == np.round(axis))):
                raise ProfileError(f"{name} must be integers, got {axis.tolist()}")
        if np.any(axis < 1):
            raise ProfileError(f"{name} must all be >= 1, got {axis.tolist()}")
        if np.unique(axis).size != axis.size:
            raise ProfileError(f"{name} has duplicates: {axis.tolist()}")
    if lat.shape != (t.size, b.size):
        raise ProfileError(
            f"latency table has shape {lat.shape}, expected (len(threads), len(batches)) = "
            f"{(t.size, b.size)}"
        )
    measured = ~np.isnan(lat)
    if np.any(lat[measured] <= 0) or np.any(np.isneginf(lat)):
        raise ProfileError("latencies must be positive (NaN marks an unmeasured point)")
    if not np.any(np.isfinite(lat)):
        raise ProfileError("latency table has no measured point")
    ti, bi = np.argsort(t, kind="stable"), np.argsort(b, kind="stable")
    table = LatencyTable(
        t[ti].astype(np.int64), b[bi].astype(np.int64), np.ascontiguousarray(lat[np.ix_(ti, bi)])
    )
    for arr in table:
        arr.setflags(write=False)
    return table


def table_fingerprint(table: LatencyTable) -> bytes:
    """A 16-byte digest of a table's axes and latencies: equal tables, equal digests."""
    h = hashlib.blake2b(digest_size=16)
    for arr in table:
        h.update(str(arr.shape).encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.digest()


class Profile(BaseModel):
    """The latency profile of one model in one mode and one placement on one machine.

    ``entries`` is a tuple of frozen entries, kept sorted by (threads, batch), so
    that ``table()`` can cache its arrays safely: any change goes through
    ``upsert``/``merge`` or assigns a new tuple, which invalidates the cache.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    format_version: int = FORMAT_VERSION
    model: str
    mode: Mode = "eager"
    #: ``isolated`` for files that do not say (format 1, CSV imports by default).
    placement: Placement = "isolated"
    machine: MachineInfo | None = None
    entries: tuple[ProfileEntry, ...] = ()
    calibrations: list[Calibration] = Field(default_factory=list)
    #: What the service adds to a batch of b of this model's example requests, in ms: the batch's
    #: latency through Redis, the dispatcher and a worker running a no-op handler (``packrat-mq
    #: profile path``). Added to a plan's predicted latency by :meth:`service_latency_ms`.
    path_ms: dict[int, float] = Field(default_factory=dict)

    _table: tuple[tuple[ProfileEntry, ...], LatencyTable, bytes] | None = PrivateAttr(default=None)

    @field_validator("format_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v < 1 or v > FORMAT_VERSION:
            raise ProfileError(
                f"format_version {v} is not understood by this packrat-mq "
                f"(it reads 1..{FORMAT_VERSION}); upgrade packrat-mq or re-profile"
            )
        # Read in any known version, held (and saved again) in the current one:
        # what an older version left out has its default (format 1: isolated).
        return FORMAT_VERSION

    @field_validator("mode", mode="before")
    @classmethod
    def _legacy_mode(cls, v: object) -> object:
        return "torchscript" if v == "graph" else v

    @field_validator("model")
    @classmethod
    def _model_name(cls, v: str) -> str:
        try:
            return check_model_name(v)
        except ValueError as exc:
            raise ProfileError(str(exc)) from None

    @field_validator("entries")
    @classmethod
    def _sorted_unique(cls, v: tuple[ProfileEntry, ...]) -> tuple[ProfileEntry, ...]:
        entries = tuple(sorted(v, key=lambda e: (e.threads, e.batch)))
        for prev, cur in zip(entries, entries[1:]):
            if (prev.threads, prev.batch) == (cur.threads, cur.batch):
                raise ProfileError(
                    f"two entries for threads={cur.threads}, batch={cur.batch}; "
                    f"keep one (Profile.upsert replaces)"
                )
        return entries

    # ----------------------------------------------------------------- files

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """Read a profile saved by ``save`` (or written by hand)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ProfileError(f"no profile at {path}") from None
        except OSError as exc:
            raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
        if not isinstance(data, dict):
            raise ProfileError(f"{path}: expected a JSON object, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ProfileError(f"{path}: {_explain(exc, data)}") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write pretty JSON atomically (temp file + rename) so a crash never leaves half a file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = self.model_dump_json(indent=2, exclude_none=True) + "\n"
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def from_csv(
        cls,
        path: str | os.PathLike[str],
        model: str | None = None,
        *,
        mode: Mode = "eager",
        duplicates: Literal["mean", "error"] = "mean",
        placement: Placement = "isolated",
    ) -> Profile:
        """Import ``threads,batch_size,latency_ms`` rows (header required, other columns ignored).

        Repeated (threads, batch_size) rows are averaged by default, because a
        CSV usually collects repeated runs of the same measurement; pass
        ``duplicates="error"`` to reject them instead. ``model`` defaults to the
        file's stem.
        """
        path = Path(path)
        model = model if model is not None else path.stem
        try:
            f = path.open(newline="", encoding="utf-8-sig")
        except FileNotFoundError:
            raise ProfileError(f"no CSV file at {path}") from None
        except OSError as exc:
            raise ProfileError(f"cannot read {path}: {exc.strerror or exc}") from None
        rows: dict[tuple[int, int], list[float]] = {}
        first_line: dict[tuple[int, int], int] = {}
        with f:
            reader = csv.reader(f)
            header = next((r for r in reader if any(c.strip() for c in r)), None)
            if header is None:
                raise ProfileError(f"{path}: empty file; expected a header {','.join(CSV_COLUMNS)}")
            names = [c.strip().lower() for c in header]
            missing = [c for c in CSV_COLUMNS if c not in names]
            if missing:
                raise ProfileError(
                    f"{path} line {reader.line_num}: header lacks {', '.join(missing)}; "
                    f"expected columns {','.join(CSV_COLUMNS)} (found: {','.join(names)})"
                )
            col = {c: names.index(c) for c in CSV_COLUMNS}
            for row in reader:
                if not any(c.strip() for c in row):
                    continue
                where = f"{path} line {reader.line_num}"
                values = {}
                for name, i in col.items():
                    if i >= len(row) or not row[i].strip():
                        raise ProfileError(f"{where}: no value for {name}")
                    values[name] = row[i].strip()
                t = _positive_int(values["threads"], "threads", where)
                b = _positive_int(values["batch_size"], "batch_size", where)
                try:
                    lat = float(values["latency_ms"])
                except ValueError:
                    raise ProfileError(
                        f"{where}: latency_ms must be a number, got {values['latency_ms']!r}"
                    ) from None
                if not math.isfinite(lat) or lat <= 0:
                    raise ProfileError(f"{where}: latency_ms must be positive and finite, got {lat}")
                key = (t, b)
                if key in rows and duplicates == "error":
                    raise ProfileError(
                        f"{where}: duplicate threads={t}, batch_size={b} "
                        f"(first on line {first_line[key]})"
                    )
                rows.setdefault(key, []).append(lat)
                first_line.setdefault(key, reader.line_num)
        if not rows:
            raise ProfileError(f"{path}: header but no data rows")
        entries = tuple(
            ProfileEntry(threads=t, batch=b, mean_ms=sum(v) / len(v)) for (t, b), v in rows.items()
        )
        try:
            return cls(model=model, mode=mode, placement=placement, entries=entries)
        except ValidationError as exc:
            raise ProfileError(f"{path}: {_explain(exc)}") from None

    # ------------------------------------------------------------ the table

    def table(self) -> LatencyTable:
        """``(threads, batches, L)`` with NaN where not measured; cached until the entries change."""
        cached = self._table
        if cached is not None and cached[0] is self.entries:
            return cached[1]
        return self._build_table()[1]

    def fingerprint(self) -> bytes:
        """A digest of the table's contents, the solver's cache key; cached like ``table()``."""
        cached = self._table
        if cached is not None and cached[0] is self.entries:
            return cached[2]
        return self._build_table()[2]

    def _build_table(self) -> tuple[tuple[ProfileEntry, ...], LatencyTable, bytes]:
        if not self.entries:
            raise ProfileError(f"profile {self.model!r} has no entries")
        entries = self.entries
        threads = np.unique(np.fromiter((e.threads for e in entries), np.int64, len(entries)))
        batches = np.unique(np.fromiter((e.batch for e in entries), np.int64, len(entries)))
        lat = np.full((threads.size, batches.size), np.nan, dtype=np.float64)
        ti = np.searchsorted(threads, [e.threads for e in entries])
        bi = np.searchsorted(batches, [e.batch for e in entries])
        lat[ti, bi] = [e.mean_ms for e in entries]
        table = LatencyTable(threads, batches, lat)
        for arr in table:
            arr.setflags(write=False)
        self._table = (entries, table, table_fingerprint(table))
        return self._table

    def path_cost_ms(self, batch: int) -> float | None:
        """The serving path's cost for a batch of ``batch``, None when it was not measured.

        Linear between measured batch sizes, and beyond them along the
        nearest two (one measured size: that value).
        """
        if not self.path_ms:
            return None
        sizes = sorted(self.path_ms)
        values = [self.path_ms[b] for b in sizes]
        if len(sizes) == 1:
            return values[0]
        if batch <= sizes[0]:
            lo, hi = 0, 1
        elif batch >= sizes[-1]:
            lo, hi = len(sizes) - 2, len(sizes) - 1
        else:
            hi = next(k for k, b in enumerate(sizes) if b >= batch)
            lo = hi - 1
        slope = (values[hi] - values[lo]) / (sizes[hi] - sizes[lo])
        return max(0.0, values[lo] + slope * (batch - sizes[lo]))

    def service_latency_ms(self, predicted_ms: float | None, batch: int) -> float | None:
        """A plan's predicted latency as a caller sees it: the slowest instance plus the serving path."""
        if predicted_ms is None:
            return None
        return predicted_ms + (self.path_cost_ms(batch) or 0.0)

    def entry(self, threads: int, batch: int) -> ProfileEntry | None:
        """The measurement at (threads, batch), or None; the profiler uses it to resume."""
        for e in self.entries:
            if e.threads == threads and e.batch == batch:
                return e
        return None

    def latency(self, threads: int, batch: int) -> float:
        """Measured mean latency in ms at (threads, batch); KeyError if not measured."""
        e = self.entry(threads, batch)
        if e is None:
            raise KeyError(f"profile {self.model!r} has no measurement for threads={threads}, batch={batch}")
        return e.mean_ms

    @property
    def max_threads(self) -> int:
        """Largest profiled thread count (0 for an empty profile)."""
        return max((e.threads for e in self.entries), default=0)

    @property
    def batch_sizes(self) -> list[int]:
        return sorted({e.batch for e in self.entries})

    # -------------------------------------------------------------- updates

    def upsert(self, entries: ProfileEntry | Iterable[ProfileEntry]) -> None:
        """Add measurements, replacing any earlier one at the same (threads, batch)."""
        new = [entries] if isinstance(entries, ProfileEntry) else list(entries)
        by_key = {(e.threads, e.batch): e for e in self.entries}
        by_key.update({(e.threads, e.batch): e for e in new})
        self.entries = tuple(by_key.values())

    def merge(self, other: Profile) -> None:
        """Take ``other``'s entries (they win on conflicts) and calibrations; same model, mode and placement only."""
        if (other.model, other.mode, other.placement) != (self.model, self.mode, self.placement):
            raise ProfileError(
                f"cannot merge profile of {other.model!r} ({other.mode}, {other.placement}) into "
                f"{self.model!r} ({self.mode}, {self.placement})"
            )
        self.upsert(other.entries)
        self.calibrations = [*self.calibrations, *other.calibrations]
        if self.machine is None:
            self.machine = other.machine


def _positive_int(text: str, name: str, where: str) -> int:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value.is_integer() or value < 1:
        raise ProfileError(f"{where}: {name} must be a positive integer, got {text!r}")
    return int(value)


def _explain(exc: ValidationError, data: object = None) -> str:
    """Turn pydantic's report into ``entries[3] (threads=4, batch=8): mean_ms must be > 0``-style lines."""
    lines = []
    for err in exc.errors():
        loc = list(err.get("loc", ()))
        where = ".".join(str(p) for p in loc) or "profile"
        if len(loc) >= 2 and loc[0] == "entries" and isinstance(loc[1], int):
            where = f"entries[{loc[1]}]"
            try:
                raw = data["entries"][loc[1]]  # type: ignore[index]
                where += f" (threads={raw.get('threads')}, batch={raw.get('batch')})"
            except (TypeError, KeyError, IndexError, AttributeError):
                pass
            if len(loc) > 2:
                where += "." + ".".join(str(p) for p in loc[2:])
        msg = err.get("msg", "invalid")
        if "ctx" in err and isinstance(err["ctx"].get("error"), ProfileError):
            msg = str(err["ctx"]["error"])
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)


def profile_filename(model: str, mode: str = "eager") -> str:
    """A profile's file name: ``<model>.json`` (eager) or ``<model>.<backend>.json`` (a graph backend).

    The one naming rule for profile files: the profiler, ``profile import`` and
    every lookup (``resolve_profile_path``) use it. ``model`` is the profile's
    model name (``ProfileError`` if it cannot be one), ``mode`` one of
    :data:`MODES`. A TorchScript profile written before the backends had
    names is ``<model>.graph.json`` (:data:`LEGACY_TORCHSCRIPT`), which
    lookups still find.
    """
    try:
        check_model_name(model)
    except ValueError as exc:
        raise ProfileError(str(exc)) from None
    if mode not in MODES:
        raise ProfileError(f"unknown profile mode {mode!r}: one of {', '.join(MODES)}")
    return f"{model}.json" if mode == "eager" else f"{model}.{mode}.json"


#: Beside a directory's profiles, other machines' profiles of the same models:
#: ``<dir>/machines/<MachineInfo.key>/<model>.json`` (see :func:`resolve_profile_path`).
MACHINES_DIR = "machines"


def profile_path(model: str, mode: str = "eager", directory: str | os.PathLike[str] = "profiles") -> Path:
    """``<directory>/<model>.json``, or ``<directory>/<model>.<backend>.json`` for a graph backend."""
    return Path(directory) / profile_filename(model, mode)


def machine_profile_path(model: str, mode: str = "eager", directory: str | os.PathLike[str] = "profiles",
                         here: MachineInfo | None = None) -> Path:
    """Where a new profile of ``model`` measured on ``here`` (default: this machine) goes.

    The directory's own file (:func:`profile_path`) while it is free or holds
    this machine's profile; once it holds another machine's, this machine's
    own slot, ``<directory>/machines/<key>/<file>``, so profiling a second
    kind of machine does not overwrite the first one's profile, and each
    machine's lookup (:func:`resolve_profile_path`) finds its own.
    """
    default = profile_path(model, mode, directory)
    here = here or MachineInfo.current()
    own = Path(directory) / MACHINES_DIR / here.key / default.name
    if own.is_file():
        return own
    if not default.is_file():
        return default
    machine = profile_machine(default)
    return default if machine is None or not machine.differences(here) else own


def profile_machine(path: Path) -> MachineInfo | None:
    """The machine recorded in the profile at ``path``, without validating the rest; None if unknown or unreadable."""
    try:
        data = json.loads(path.read_text())
        return MachineInfo.model_validate(data["machine"]) if data.get("machine") else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ValidationError):
        return None


def unique_paths(paths: Iterable[Path]) -> list[Path]:
    """``paths`` in their order, each file or directory once however it is spelled (``./profiles``, absolute)."""
    seen: set[Path] = set()
    unique: list[Path] = []
    for path in paths:
        if path.resolve() not in seen:
            seen.add(path.resolve())
            unique.append(path)
    return unique


def default_profile_dirs() -> list[Path]:
    """Where model names are looked up: ./profiles, then the repository's profiles/."""
    return unique_paths([Path.cwd() / "profiles", Path(__file__).resolve().parents[2] / "profiles"])


def profile_candidates(model: str, search_dirs: Sequence[Path] | None = None, *, mode: str = "eager") -> list[Path]:
    """Every profile file of ``model`` in ``mode`` in ``search_dirs``, in the order lookups prefer them.

    Each directory's own file first (``<model>.json``; for ``torchscript``
    also the older ``<model>.graph.json``), directory by directory, then the
    files of other machines (``<dir>/machines/*/``).
    """
    dirs = list(search_dirs) if search_dirs is not None else default_profile_dirs()
    filename = profile_filename(model, mode)
    names = [filename] + ([LEGACY_TORCHSCRIPT.format(model=model)] if mode == "torchscript" else [])
    found: list[Path] = []
    for name in names:
        found += [d / name for d in dirs if (d / name).is_file()]
    for name in names:
        for d in dirs:
            found += sorted(p for p in (d / MACHINES_DIR).glob(f"*/{name}") if p.is_file())
    return unique_paths(found)


def resolve_profile_path(
    name_or_path: str | os.PathLike[str], search_dirs: Sequence[Path] | None = None, *, mode: str = "eager",
    here: MachineInfo | None = None,
) -> Path:
    """An existing file path as given, else a model name resolved to its profile in ``search_dirs``.

    A model name finds ``profiles/<model>.json``, or ``profiles/<model>.<backend>.json``
    for a graph backend (see ``profile_filename``; for ``torchscript`` also the
    older ``<model>.graph.json``); another mode's file is never taken instead.
    Where several machines' profiles of the model are kept (``profiles/machines/*/``,
    see :func:`machine_profile_path`), the first measured on a machine like
    ``here`` (default: this one) is taken; when none is, the directory's own
    file, and the caller's machine check says so. A path is used as given,
    whatever mode it records.

    Why keep several: a profile is only valid for its kind of machine, and one
    fleet, or one cloud instance type, lands on several (this project's own
    development VM has been three CPU designs in two days).
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    text = str(name_or_path)
    dirs = list(search_dirs) if search_dirs is not None else default_profile_dirs()
    looks_like_path = os.sep in text or "/" in text or text.endswith(".json")
    if looks_like_path:
        raise ProfileError(f"no profile file at {path}")
    filename = profile_filename(text, mode)
    candidates = profile_candidates(text, dirs, mode=mode)
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        here = here or MachineInfo.current()
        for candidate in candidates:
            machine = profile_machine(candidate)
            if machine is not None and machine.matches(here):
                return candidate
        return candidates[0]
    known = sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.json")})
    raise ProfileError(
        f"no {'' if mode == 'eager' else mode + ' '}profile for model {text!r} ({filename}) "
        f"in {', '.join(str(d) for d in dirs)}"
        + (f" (available: {', '.join(known)})" if known else " (no profiles there yet)")
    )
