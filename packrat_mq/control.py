"""Control messages: asking the supervisors of a model to reconfigure it.

One stream per deployment, ``<prefix>:control``; any Redis client can write
to it (the wire format is in docs/protocol.md)::

    XADD <prefix>:control * id <id> command reconfigure model <model> reply_to <stream>
         (batch <B> | instances <SPEC>) [adaptive 0|1] [reason <text>]

Every supervisor reads the whole stream with a consumer group of its own
(:func:`packrat_mq.keys.control_group`) and acts on the messages about the
model it serves. When the change is done, or has failed, the supervisor
XADDs one reply to ``reply_to`` in the format of request replies (``id``,
``status``, ``payload`` JSON, ``error``). A message that cannot be read gets
an error reply (when its ``reply_to`` can be written) and changes nothing.
Fields are text, never pickled, as for requests.

The dispatcher's estimator writes the same messages (``origin estimator``,
``decided`` its decision time) when the load asks for another B, so an
operator's reconfiguration and an automatic one take the same path.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

import redis
from pydantic import BaseModel, Field

from packrat_mq import protocol
from packrat_mq.instances import Configuration, ConfigurationError
from packrat_mq.keys import Keys, check_model_name

#: What a control message may ask for.
COMMANDS = ("reconfigure",)
#: The control stream keeps about this many messages (XADD MAXLEN ~).
STREAM_MAXLEN = 1000
#: Largest B a message may ask for (the optimizer decides whether it fits).
MAX_BATCH = 1 << 16
_FIELDS = ("id", "command", "model", "reply_to", "batch", "instances", "adaptive", "reason", "origin", "decided")


class ControlError(ValueError):
    """A control message that cannot be carried out; ``reply_to`` is set when it can be answered."""

    def __init__(self, message: str, *, message_id: str = "", reply_to: str | None = None) -> None:
        super().__init__(message)
        self.message_id = message_id
        self.reply_to = reply_to


class ControlMessage(BaseModel):
    """One control message, read and checked."""

    id: str
    command: str = "reconfigure"
    model: str
    reply_to: str | None = None
    #: The aggregated batch to serve: the optimizer plans the instances for it.
    batch: int | None = Field(default=None, ge=1, le=MAX_BATCH)
    #: The instances to serve, by hand (``2*1x4``), instead of ``batch``.
    instances: str | None = None
    #: True: estimate B from the load from now on; False: pin it; None: as it was.
    adaptive: bool | None = None
    reason: str = "operator"
    #: Who asked: ``cli``, ``estimator`` or any name a client gives.
    origin: str = "client"
    #: When the decision was taken (epoch s); the message's own time when not given.
    decided: float | None = None
    #: The control stream's entry id.
    entry_id: str = ""

    @property
    def configuration(self) -> Configuration | None:
        return Configuration.parse(self.instances) if self.instances else None

    def fields(self) -> dict[str, str]:
        """The stream fields of this message."""
        out: dict[str, str] = {}
        for name in _FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            out[name] = str(int(value)) if isinstance(value, bool) else str(value)
        return out


def parse(entry_id: bytes | str, fields: dict[bytes, bytes], prefix: str) -> ControlMessage:
    """Check one control stream entry; raises :class:`ControlError` saying what is wrong."""
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    text: dict[str, str] = {}
    for key, value in fields.items():
        name = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
        try:
            text[name] = value.decode("utf-8") if isinstance(value, bytes) else str(value)
        except UnicodeDecodeError:
            text[name] = "\ufffd"
    message_id = text.get("id", "")[: protocol.MAX_ID_LEN]
    reply_to = text.get("reply_to")
    if reply_to is not None and protocol.reply_to_problem(reply_to, prefix):
        reply_to = None

    def fail(why: str) -> ControlError:
        return ControlError(why, message_id=message_id, reply_to=reply_to)

    if not message_id:
        raise fail("missing id field")
    command = text.get("command", "")
    if command not in COMMANDS:
        raise fail(f"unknown command {command!r}: use one of {', '.join(COMMANDS)}")
    try:
        model = check_model_name(text.get("model", ""))
    except ValueError as exc:
        raise fail(str(exc)) from None
    batch_text, instances = text.get("batch"), text.get("instances")
    if (batch_text is None) == (instances is None):
        raise fail("reconfigure needs exactly one of batch (the optimizer plans it) or instances (e.g. 2*1x4)")
    batch = None
    if batch_text is not None:
        if not batch_text.isdigit() or not 1 <= int(batch_text) <= MAX_BATCH:
            raise fail(f"batch must be an integer between 1 and {MAX_BATCH}, not {batch_text[:40]!r}")
        batch = int(batch_text)
    if instances is not None:
        try:
            Configuration.parse(instances)
        except ConfigurationError as exc:
            raise fail(f"instances: {exc}") from None
    adaptive: bool | None = None
    if "adaptive" in text:
        if text["adaptive"] not in ("0", "1"):
            raise fail(f"adaptive must be 0 or 1, not {text['adaptive'][:40]!r}")
        adaptive = text["adaptive"] == "1"
    if adaptive and instances is not None:
        raise fail("adaptive needs batch, not instances: the estimator changes B and the optimizer plans it")
    decided = None
    if "decided" in text:
        try:
            decided = float(text["decided"])
        except ValueError:
            raise fail(f"decided must be a time in seconds since the epoch, not {text['decided'][:40]!r}") from None
    return ControlMessage(
        id=message_id, command=command, model=model, reply_to=reply_to, batch=batch, instances=instances,
        adaptive=adaptive, reason=text.get("reason", "operator")[:200], origin=text.get("origin", "client")[:64],
        decided=decided if decided is not None else protocol.entry_ms(eid) / 1000.0, entry_id=eid,
    )


def send(r: redis.Redis | redis.client.Pipeline, keys: Keys, message: ControlMessage) -> Any:
    """XADD ``message`` to the control stream (kept to about :data:`STREAM_MAXLEN` entries)."""
    return r.xadd(keys.control(), message.fields(), maxlen=STREAM_MAXLEN, approximate=True)


def new_id() -> str:
    return f"ctl-{uuid.uuid4().hex[:16]}"


def reply_fields(message_id: str, *, result: dict[str, Any] | None = None, error: str | None = None,
                 model: str = "") -> dict[str, Any]:
    """A control reply: ``payload`` is the result as JSON; ``status`` error with ``error`` set."""
    if error is not None:
        return protocol.error_reply(message_id, error, model=model, command="reconfigure")
    return protocol.reply_fields(message_id, payload=json.dumps(result or {}).encode(), content_type=protocol.JSON,
                                 model=model, command="reconfigure")


def wait_reply(r: redis.Redis, reply_to: str, message_id: str, timeout_s: float) -> dict[bytes, bytes] | None:
    """Block until the reply to ``message_id`` arrives on ``reply_to`` (None at the timeout)."""
    deadline = time.monotonic() + timeout_s
    last = "0"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        resp = r.xread({reply_to: last}, count=10, block=max(1, int(min(left, 1.0) * 1000)))
        for _, entries in resp or []:
            for eid, fields in entries:
                last = eid
                if fields.get(b"id", b"").decode("utf-8", "replace") == message_id:
                    return fields
