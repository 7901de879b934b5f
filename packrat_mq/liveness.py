"""When a process's record in Redis can be believed.

Instances and dispatchers write their state with a heartbeat every
``interval`` seconds (the ``interval`` field of their hash). A record whose
heartbeat is older than :data:`STALE_AFTER` intervals belongs to a process
that is gone or hung, whatever its ``state`` field still says: ``status``
shows it as ``stale`` and the dispatcher sends it nothing.

Ages are measured with the reader's clock against the writer's: the
processes of one deployment are expected to share a clock (one host, or
NTP-synchronised hosts).
"""
from __future__ import annotations

#: Heartbeat intervals after which a record is stale.
STALE_AFTER = 3.0
#: States written by a live process that a stale heartbeat contradicts.
LIVE_STATES = ("starting", "ready")


def effective_state(state: str | None, heartbeat: float | None, interval: float | None, now: float,
                    default_interval: float = 1.0) -> str:
    """``state``, or ``stale`` when a live state's heartbeat is too old to believe."""
    if state is None:
        return "gone"
    if state in LIVE_STATES:
        beat_every = interval if interval and interval > 0 else default_interval
        if heartbeat is None or now - heartbeat > STALE_AFTER * beat_every:
            return "stale"
    return state


def decode_float(raw: bytes | str | None) -> float | None:
    """A numeric hash field, or ``None`` when missing or unreadable."""
    if raw is None:
        return None
    try:
        return float(raw)
    except (TypeError, ValueError):
        return None
