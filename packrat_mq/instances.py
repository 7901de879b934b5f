"""Configurations: which instances serve a model, with how many threads and requests.

A configuration is the list of instances ``(t_j, b_j)``: instance ``j`` runs
with ``t_j`` intra-op threads on ``t_j`` physical cores and takes ``b_j``
requests of every aggregated batch, so ``B = sum(b_j)``. Instances may differ
(one 4-thread instance taking 8 and two 2-thread instances taking 4 each).
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ConfigurationError(ValueError):
    """A configuration string or document that cannot be used."""


class InstanceSpec(BaseModel):
    """One instance of a configuration: ``threads`` cores, ``batch`` requests."""

    model_config = ConfigDict(frozen=True)

    threads: int = Field(ge=1)
    batch: int = Field(ge=1)

    def __str__(self) -> str:
        return f"{self.threads}x{self.batch}"


class Configuration(BaseModel):
    """The instances serving one model; ``batch`` is their summed share B."""

    model_config = ConfigDict(frozen=True)

    instances: tuple[InstanceSpec, ...]
    predicted_latency_ms: float | None = None

    @model_validator(mode="after")
    def _non_empty(self) -> Configuration:
        if not self.instances:
            raise ConfigurationError("a configuration needs at least one instance")
        return self

    @property
    def batch(self) -> int:
        return sum(i.batch for i in self.instances)

    @property
    def threads(self) -> int:
        return sum(i.threads for i in self.instances)

    def __str__(self) -> str:
        return ",".join(str(i) for i in self.instances)

    def grouped(self) -> list[dict[str, int]]:
        """Instances as ``[{"threads", "batch", "count"}]``, largest first."""
        counts = Counter((i.threads, i.batch) for i in self.instances)
        return [
            {"threads": t, "batch": b, "count": n}
            for (t, b), n in sorted(counts.items(), key=lambda kv: (-kv[0][0], -kv[0][1]))
        ]

    def compact(self) -> str:
        """Repeated instances counted, largest first: the form ``parse`` (and so ``--instances``) reads.

        >>> Configuration.parse("2x4,4x8,2x4").compact()
        '4x8,2*2x4'
        """
        return ",".join(
            f"{g['count']}*{g['threads']}x{g['batch']}" if g["count"] > 1 else f"{g['threads']}x{g['batch']}"
            for g in self.grouped()
        )

    @classmethod
    def parse(cls, text: str) -> Configuration:
        """Parse ``"TxB,TxB,..."``; ``"NxTxB"`` or ``"N*TxB"`` repeats an instance N times.

        >>> str(Configuration.parse("4x8,2*2x4"))
        '4x8,2x4,2x4'
        """
        specs: list[InstanceSpec] = []
        for raw in text.replace(" ", "").split(","):
            if not raw:
                continue
            m = re.fullmatch(r"(?:(\d+)[*x])?(\d+)x(\d+)", raw)
            if not m:
                raise ConfigurationError(
                    f"cannot read instance {raw!r}: expected THREADSxBATCH, e.g. 4x8 "
                    f"(or COUNT*THREADSxBATCH, e.g. 2*2x4)"
                )
            count = int(m.group(1) or 1)
            t, b = int(m.group(2)), int(m.group(3))
            if count < 1 or t < 1 or b < 1:
                raise ConfigurationError(f"instance {raw!r}: counts, threads and batch must be >= 1")
            specs.extend(InstanceSpec(threads=t, batch=b) for _ in range(count))
        if not specs:
            raise ConfigurationError(f"no instances in {text!r}")
        return cls(instances=tuple(specs))

    @classmethod
    def uniform(cls, count: int, threads: int, batch: int) -> Configuration:
        return cls(instances=tuple(InstanceSpec(threads=threads, batch=batch) for _ in range(count)))


@dataclass(frozen=True)
class ChangePlan:
    """Indexes into the current instances and the target's instance specs."""

    #: (current index, new share) for each instance kept.
    kept: tuple[tuple[int, int], ...]
    #: Target specs of the instances to start.
    start: tuple[InstanceSpec, ...]
    #: Current indexes of the instances to stop.
    stop: tuple[int, ...]

    @property
    def kind(self) -> str:
        if not self.start and not self.stop:
            return "reshare"
        if not self.start or not self.stop:
            return "scale"
        return "active-passive"


def plan_change(current: list[tuple[int, int]], target: Configuration) -> ChangePlan:
    """How to go from ``current`` instances ``(threads, batch)`` to ``target``.

    Instances are matched by thread count, in order: the first current
    instances with ``t`` threads take the target's shares for ``t`` threads.
    """
    free: dict[int, list[int]] = {}
    for index, (threads, _) in enumerate(current):
        free.setdefault(threads, []).append(index)
    kept: list[tuple[int, int]] = []
    start: list[InstanceSpec] = []
    for spec in target.instances:
        pool = free.get(spec.threads)
        if pool:
            kept.append((pool.pop(0), spec.batch))
        else:
            start.append(spec)
    stop = sorted(i for pool in free.values() for i in pool)
    return ChangePlan(kept=tuple(kept), start=tuple(start), stop=tuple(stop))
