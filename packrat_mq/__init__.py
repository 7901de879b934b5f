"""packrat-mq: Packrat-style CPU inference serving over Redis streams.

Several small model instances, each pinned to its own cores, serve one
aggregated batch side by side instead of one instance using every core.
"""
from __future__ import annotations

__version__ = "0.1.0"
