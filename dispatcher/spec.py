"""What the supervisor tells a dispatcher process it starts (as JSON on its stdin)."""
from __future__ import annotations

from pydantic import BaseModel

from packrat_mq.settings import Settings


class DispatcherSpec(BaseModel):
    url: str
    settings: Settings
    model: str
    #: Profile JSON used to split partial batches by measured latency.
    profile: str | None = None
    #: The supervisor; the dispatcher stops when it is gone.
    parent_pid: int | None = None
