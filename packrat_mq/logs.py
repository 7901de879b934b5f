"""Logging, configured once per process from :class:`~packrat_mq.settings.Settings`.

Every process (``up``, a worker instance, the dispatcher, a profiling child)
calls :func:`configure` once at start with its settings and a label that
says which process a line came from; nothing else calls ``basicConfig``.
"""
from __future__ import annotations

import logging

from packrat_mq.settings import Settings


def configure(settings: Settings, who: str = "", level: str | None = None) -> None:
    """Send log records to stderr at ``settings.log_level`` (or ``level``), each line labelled ``who``."""
    label = f"{who} " if who else ""
    logging.basicConfig(
        level=level or settings.log_level,
        format=f"%(asctime)s {label}%(name)s %(levelname)s %(message)s",
        force=True,
    )
