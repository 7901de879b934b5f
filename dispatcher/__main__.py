"""``python -m dispatcher``: the dispatcher process the supervisor starts.

Its spec comes as JSON on stdin, never in argv: it holds the Redis URL with
its password, and ``/proc/<pid>/cmdline`` is readable by every user.
"""
from __future__ import annotations

import logging
import os
import sys

from pydantic import BaseModel

from dispatcher.dispatcher import run_dispatcher
from packrat_mq.settings import Settings


class DispatcherSpec(BaseModel):
    url: str
    settings: Settings
    model: str
    #: Profile JSON used to split partial batches by measured latency.
    profile: str | None = None
    #: The supervisor; the dispatcher stops when it is gone.
    parent_pid: int | None = None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = DispatcherSpec.model_validate_json(argv[0] if argv else sys.stdin.read())
    logging.basicConfig(
        level=os.environ.get("PACKRAT_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s dispatcher {spec.model} %(levelname)s %(message)s",
    )
    latency = None
    if spec.profile:
        from dispatcher.partitioning import latency_from_profile

        latency = latency_from_profile(spec.profile)
    run_dispatcher(spec.settings, spec.url, spec.model, latency=latency, parent_pid=spec.parent_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
