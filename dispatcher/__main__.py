"""``python -m dispatcher``: the dispatcher process the supervisor starts.

Its spec comes as JSON on stdin (see :mod:`workers.launch` for why not argv).
"""
from __future__ import annotations

import sys

from dispatcher.dispatcher import run_dispatcher
from dispatcher.partitioning import latency_from_profile
from dispatcher.spec import DispatcherSpec
from packrat_mq import logs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = DispatcherSpec.model_validate_json(argv[0] if argv else sys.stdin.readline())
    logs.configure(spec.settings, f"dispatcher {spec.model}")
    latency = latency_from_profile(spec.profile) if spec.profile else None
    run_dispatcher(spec.settings, spec.url, spec.model, latency=latency, parent_pid=spec.parent_pid,
                   profile=spec.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
