"""Calibration: close the gap between predicted and measured latency.

Profiles are measured one instance at a time; instances side by side share
caches, memory bandwidth and the Redis/dispatcher path, so the predicted best
can lose in practice. Calibration serves the top-k predicted configurations
for real, exactly as ``packrat-mq up`` would (embedded or given Redis,
dispatcher, pinned instances), sends aggregated batches of B through the
wire format, and measures the batch latency the client sees: from sending the
first request of a batch to receiving its last reply.

The measured figures are stored in the profile (``calibrations``), and
``optimizer.planning.selection.best_calibrated`` lets later choices (``up``,
``optimize``) use the measured best for the same (T, B) instead of the
prediction.

This module is the part that serves for real; which candidates to measure
(``optimizer.planning.selection.candidates``) is pure planning and lives there.
"""
from __future__ import annotations

import base64
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optimizer.planning.profile import Calibration, Profile
from optimizer.planning.selection import candidates
from optimizer.planning.solving import InfeasibleError
from packrat_mq import protocol
from packrat_mq.client import Client
from packrat_mq.connection import connect
from packrat_mq.handler import Context, load_handler, run_batch
from packrat_mq.instances import Configuration
from packrat_mq.settings import Settings
from packrat_mq.topology import Topology
from workers.supervisor import Supervisor


@dataclass
class Measured:
    """Batch latencies of one configuration served for real."""

    configuration: Configuration
    predicted_ms: float | None
    latencies_ms: list[float] = field(default_factory=list)
    #: Per batch, the handler's own time (the slowest reply's ``inference_ms``).
    handler_ms: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def p50_ms(self) -> float:
        return float(np.percentile(self.latencies_ms, 50))

    @property
    def handler_p50_ms(self) -> float | None:
        """The p50 of the batches' slowest ``inference_ms`` (None before a batch was timed)."""
        return float(np.percentile(self.handler_ms, 50)) if self.handler_ms else None

    @property
    def p99_ms(self) -> float:
        return float(np.percentile(self.latencies_ms, 99))

    @property
    def mean_ms(self) -> float:
        return float(statistics.fmean(self.latencies_ms))

    @property
    def spread_ms(self) -> float:
        return float(statistics.pstdev(self.latencies_ms)) if len(self.latencies_ms) > 1 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "configuration": str(self.configuration),
            "instances": self.configuration.grouped(),
            "predicted_ms": self.predicted_ms,
        }
        if self.error:
            d["error"] = self.error
        elif self.latencies_ms:
            q = np.percentile(self.latencies_ms, [10, 50, 90, 99])
            d.update(measured_p50_ms=float(q[1]), measured_p10_ms=float(q[0]), measured_p90_ms=float(q[2]),
                     measured_p99_ms=float(q[3]), measured_mean_ms=self.mean_ms, rounds=len(self.latencies_ms))
        if self.handler_ms:
            # What the instances' handlers took as served, beside what the caller saw: a miss of the
            # prediction is then the handler (against its profile) or the path (the rest), not a guess.
            d["handler_p50_ms"] = self.handler_p50_ms
        return d


def example_payloads(model: str, n: int) -> list[tuple[bytes, str]]:
    """``n`` wire payloads from the handler's own example inputs."""
    items = load_handler(model).example_batch(n)
    return [protocol.encode_payload(item.data) for item in items]


def measure_configuration(
    url: str,
    settings: Settings,
    model: str,
    configuration: Configuration,
    *,
    rounds: int = 15,
    warmup: int = 3,
    options: dict[str, Any] | None = None,
    payloads: list[tuple[bytes, str]] | None = None,
) -> Measured:
    """Serve ``configuration`` for real and time ``rounds`` aggregated batches of B."""
    batch = configuration.batch
    payloads = payloads or example_payloads(model, batch)
    # A generous timeout: the batch is sent at once, so it is always full; the
    # timeout only guards against a read that splits the pipelined XADDs.
    settings = settings.model_copy(update={"batch_timeout_ms": 50.0})
    r = connect(url)
    result = Measured(configuration=configuration, predicted_ms=configuration.predicted_latency_ms)
    with Supervisor(r, settings, url, model, configuration, options=options):
        client = Client(connect(url), prefix=settings.prefix)
        try:
            time_batches(client, model, payloads, result, rounds=rounds, warmup=warmup)
        finally:
            client.close()
    return result


#: Warm-up lasts at least this long whatever the number of warm-up rounds: two batches of a 7 ms model
#: left its first measured ones slow (MiniLM at B=1 measured 9.5 ms after 2 warm-up rounds, 7.8 after 30).
WARMUP_S = 0.5


def time_batches(client: Client, model: str, payloads: list[tuple[bytes, str]], result: Measured, *,
                 rounds: int, warmup: int, timeout: float = 600, warmup_s: float = WARMUP_S,
                 measure_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> Measured:
    """Send batches of ``payloads`` at once: ``warmup`` rounds, then ``rounds`` timed; record each one's latency.

    Warm-up runs at least ``warmup_s`` seconds and the timed rounds at
    least ``measure_s``, so a small model is measured warm and over more
    than a few dozen milliseconds, while a large one's rounds already
    exceed both. Each batch is timed by ``Client.time_batch``: from sending
    the first request to receiving the last reply, what a caller waiting
    for the whole batch sees.
    """
    content_type = payloads[0][1]
    if any(ctype != content_type for _, ctype in payloads):
        raise ValueError("example payloads of one batch must share a content type")
    phase, done, began = "warmup", 0, clock()
    while True:
        wanted, floor_s = (warmup, warmup_s) if phase == "warmup" else (rounds, measure_s)
        if done >= wanted and clock() - began >= floor_s:
            if phase == "measure":
                return result
            phase, done, began = "measure", 0, clock()
            continue
        latency_ms, replies = client.time_batch(model, [p for p, _ in payloads], content_type=content_type,
                                                timeout=timeout)
        failed = [rep.error for rep in replies if not rep.ok]
        if failed:
            result.error = f"{len(failed)} requests failed: {failed[0]}"
            return result
        done += 1
        if phase == "measure":
            result.latencies_ms.append(latency_ms)
            result.handler_ms.append(max(rep.inference_ms for rep in replies))


def calibrate(
    profile: Profile,
    url: str,
    settings: Settings,
    threads: int,
    batch: int,
    *,
    k: int = 3,
    rounds: int = 15,
    warmup: int = 3,
    progress: Callable[[str], None] | None = None,
) -> tuple[Configuration, list[Measured]]:
    """Measure the top-``k`` candidates; record them in ``profile``; return the measured best."""
    configs = candidates(profile, threads, batch, k)
    if not configs:
        raise InfeasibleError(f"no configuration covers batch {batch} within {threads} threads")
    payloads = example_payloads(profile.model, batch)
    results: list[Measured] = []
    for config in configs:
        if progress:
            progress(f"measuring {config} (predicted {config.predicted_latency_ms or float('nan'):.2f} ms)")
        try:
            m = measure_configuration(url, settings, profile.model, config, rounds=rounds, warmup=warmup,
                                      payloads=payloads)
        except Exception as exc:  # noqa: BLE001 - one candidate failing (e.g. too many cores) is reported
            m = Measured(configuration=config, predicted_ms=config.predicted_latency_ms, error=str(exc))
        results.append(m)
    measured = [m for m in results if m.latencies_ms and not m.error]
    if not measured:
        raise RuntimeError("no candidate could be measured: " + "; ".join(m.error or "?" for m in results))
    date = time.strftime("%Y-%m-%dT%H:%M:%S")
    kept = [c for c in profile.calibrations if not (c.threads == threads and c.batch == batch)]
    for m in measured:
        kept.append(Calibration(
            configuration=str(m.configuration), threads=threads, batch=batch, predicted_ms=m.predicted_ms,
            measured_p50_ms=m.p50_ms, measured_mean_ms=m.mean_ms, measured_p99_ms=m.p99_ms,
            spread_ms=m.spread_ms, date=date,
        ))
    profile.calibrations = kept
    best = min(measured, key=lambda m: m.p50_ms)
    return best.configuration.model_copy(update={"predicted_latency_ms": best.predicted_ms}), results


#: The no-op handler the serving path is measured with: it accepts any payload, sleeps 0 ms and
#: answers each request with the model's own example reply (:func:`example_reply`).
PATH_HANDLER = "sleep"


def example_reply(model: str, options: dict[str, Any] | None = None) -> tuple[bytes, str]:
    """The wire payload (and content type) of the model's reply to its first example request.

    A reply is encoded by the worker after the handler's time and decoded
    by the caller, so its size and kind are part of the path: a MiniLM
    embedding (384 floats) takes 0.15 ms to encode as JSON with the
    standard library, a batch of 32 of them 4.9 ms, where the stand-in's
    reply of a few bytes took nothing. The model is loaded here, in eager
    mode, and runs one batch of one; nothing of this process is pinned or
    sized (its torch thread pools are left as they are).
    """
    handler = load_handler(model)
    handler.initialize(Context(model_name=model, instance_id="path-reply", options=dict(options or {})))
    result = run_batch(handler, handler.example_batch(1))
    outcome = result.outcomes[0]
    if not outcome.ok:
        raise RuntimeError(f"{model}'s example request failed: {outcome.error}")
    return protocol.encode_payload(outcome.value)


def _stand_in_options(model: str, options: dict[str, Any] | None,
                      progress: Callable[[str], None] | None) -> dict[str, Any]:
    """The no-op stand-in's options: no sleep, and the model's own reply where it can give one."""
    stand_in: dict[str, Any] = {"base_ms": 0}
    try:
        payload, content_type = example_reply(model, options)
    except Exception as exc:  # noqa: BLE001 - the path is still worth measuring, and this says how
        if progress:
            progress(f"{model} could not answer its example request ({type(exc).__name__}: {exc}); "
                     "the path is measured with the stand-in's reply of a few bytes")
    else:
        stand_in.update(reply=base64.b64encode(payload).decode("ascii"), reply_content_type=content_type)
        if progress:
            progress(f"replies as {model}'s own: {len(payload)} bytes of {content_type}")
    return stand_in


def measure_path(
    url: str,
    settings: Settings,
    model: str,
    batches: list[int],
    *,
    rounds: int = 15,
    warmup: int = 3,
    progress: Callable[[str], None] | None = None,
    options: dict[str, Any] | None = None,
    stand_in: bool = False,
    threads: int | None = None,
) -> dict[int, float]:
    """What the service adds to a batch of each size of ``model``'s example requests, in ms.

    The profile times ``handler.handle`` alone; a caller also waits for the
    requests' XADDs, the dispatcher, the worker's payload fetch and decode,
    the replies and their reads. That is measured here by serving the
    model's own example payloads (their size and content type are what
    costs): the median, over the rounds, of each batch's latency (as
    :func:`time_batches` measures it) less its handler's reported time.

    By default the model itself serves, one instance of ``threads`` (the
    socket's cores). That is the path as it runs after a real batch: the
    dispatcher, Redis and the caller wake on cores the model has just
    filled with its own memory, and each request gets its own reply.
    Measured with the no-op stand-in instead, MiniLM's served batches spent
    0.3-1.7 ms more beyond the handler than the stand-in's path said, 5-10%
    of its 6-20 ms batches, in four runs of ``bench_configs --profile-now``
    (docs/figures.md).

    ``stand_in``: one 1-thread instance of a handler that does nothing
    (``PATH_HANDLER``) but answer each request with the model's own reply
    (:func:`example_reply`, the model built with ``options``; the
    stand-in's few bytes if it cannot answer). Quicker (no model runs:
    GPT-2's batch of 32 takes 3 s), and it serves where the model cannot.
    With it: 1.2-3.3 ms for MiniLM's text batches of 1 to 32, 1.5-17 ms
    for ResNet-50's images (docs/figures.md).
    """
    settings = settings.model_copy(update={"batch_timeout_ms": 50.0})
    r = connect(url)
    out: dict[int, float] = {}
    if stand_in:
        handler: str | None = PATH_HANDLER
        instance_threads = 1
        served_options = _stand_in_options(model, options, progress)
    else:
        handler, served_options = None, dict(options or {})
        instance_threads = threads or Topology.detect().max_cores_per_socket
        if progress:
            progress(f"served by {model} itself: one instance of {instance_threads} threads")
    with Supervisor(r, settings, url, model, Configuration.uniform(1, instance_threads, max(batches)),
                    handler=handler, options=served_options) as service:
        client = Client(connect(url), prefix=settings.prefix)
        try:
            for b in sorted(batches):
                config = Configuration.uniform(1, instance_threads, b)
                service.reshare(config)
                m = time_batches(client, model, example_payloads(model, b), Measured(config, None),
                                 rounds=rounds, warmup=warmup, timeout=120)
                if m.error:
                    raise RuntimeError(f"measuring the serving path of {model} at batch {b}: {m.error}")
                out[b] = float(np.median([lat - h for lat, h in zip(m.latencies_ms, m.handler_ms)]))
                if progress:
                    progress(f"batch {b}: serving path {out[b]:.2f} ms")
        finally:
            client.close()
    return out
