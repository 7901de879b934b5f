"""Profiling as RQ jobs: profile a fleet of nodes from one place.

``packrat-mq profile run --enqueue`` queues one job per model and node on the
queue ``packrat-profile-<node>``; an RQ worker on that node (see
:func:`worker_command`) runs the same profiler as a local run and stores the
profile both in Redis (``Keys(prefix).profile_result``) and in its profile
store. RQ's registries show what ran and what failed. RQ costs ~2 ms a job,
which does not matter for runs of minutes; it is never on the request path.

Jobs are serialized as JSON, never pickled: RQ's default serializer is pickle,
and a worker that unpickles what it reads from a shared Redis runs whatever
code anyone who can write to that Redis put there. So the job's arguments and
its return value are plain JSON (dicts, lists, strings, numbers), and the
worker must be started with the same serializer (``--serializer``), else it
would unpickle.
"""
from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

from optimizer.planning.profile import profile_filename
from optimizer.profiling.options import ProfilingError, ProfilingOptions, default_output, profile_name
from optimizer.profiling.scheduler import profile_model
from packrat_mq.keys import Keys

if TYPE_CHECKING:
    import redis
    from rq.job import Job

#: RQ serializer of profiling jobs, as a dotted path for ``rq worker --serializer``.
SERIALIZER = "rq.serializers.JSONSerializer"


def result_name(options: ProfilingOptions) -> str:
    """Model part of the Redis result key: ``<model>`` or ``<model>.<backend>``."""
    return profile_filename(profile_name(options.model), options.graph).removesuffix(".json")


def profile_queue_name(node: str) -> str:
    """The RQ queue a node's profiling worker listens on."""
    return f"packrat-profile-{node}"


def worker_command(queue: str, url: str) -> str:
    """The command that starts the profiling worker of ``queue`` on its node."""
    return f"rq worker {queue} --serializer {SERIALIZER} --url {url}"


def profile_job(
    options: dict[str, Any],
    *,
    node: str | None = None,
    prefix: str = "packrat",
    store_dir: str = "profiles",
    fresh: bool = False,
) -> dict[str, Any]:
    """RQ job: profile on the worker's node, store the JSON in Redis and in ``store_dir``.

    ``options`` is :class:`ProfilingOptions` as a JSON dict (the jobs' serializer
    carries no Python objects). The Redis key is
    ``Keys(prefix).profile_result(model, node)`` (model ``<model>.<backend>`` in
    a graph mode), ``node`` being the node the job was queued for (default: the
    host it runs on), so several nodes' profiles of one model sit side by
    side. The result, a JSON dict, also says which host it ran on.
    """
    from rq import get_current_job

    profiling = ProfilingOptions.model_validate(options)
    host = socket.gethostname()
    node = node or host
    path = default_output(profiling.model, profiling.graph, store_dir)
    report = profile_model(profiling, path, fresh=fresh, progress=False)
    if report.interrupted:
        raise ProfilingError(f"profiling {profiling.model} on {host} was interrupted")
    key = Keys(prefix).profile_result(result_name(profiling), node)
    job = get_current_job()
    if job is not None:
        job.connection.set(key, report.profile.model_dump_json(exclude_none=True))
    return {"node": node, "host": host, "key": key, "path": str(path.resolve()), "summary": report.summary(),
            **{k: v for k, v in report.as_dict().items() if k not in ("path",)}}


def enqueue_profile(
    connection: redis.Redis,
    options: ProfilingOptions,
    *,
    node: str,
    queue: str | None = None,
    prefix: str = "packrat",
    store_dir: str = "profiles",
    fresh: bool = False,
    job_timeout_s: int = 6 * 3600,
) -> Job:
    """Queue :func:`profile_job`, JSON-serialized, for the profiling worker of ``node``."""
    from rq import Queue

    q = Queue(queue or profile_queue_name(node), connection=connection, serializer=SERIALIZER)
    return q.enqueue_call(
        "optimizer.profiling.jobs.profile_job",
        kwargs={"options": options.model_dump(mode="json"), "node": node, "prefix": prefix,
                "store_dir": store_dir, "fresh": fresh},
        timeout=job_timeout_s,
        result_ttl=7 * 24 * 3600,
        description=f"profile {options.model} ({options.mode}) on {node}",
    )
