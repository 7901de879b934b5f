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

from packrat_mq import protocol, replies
from packrat_mq.instances import Configuration, ConfigurationError
from packrat_mq.keys import Keys, check_model_name
from packrat_mq.streams import ensure_group

#: What a control message may ask for.
COMMANDS = ("reconfigure", "register", "unregister")
#: The control stream keeps about this many messages (XADD MAXLEN ~).
STREAM_MAXLEN = 1000
#: Largest B a message may ask for (the optimizer decides whether it fits).
MAX_BATCH = 1 << 16
_FIELDS = ("id", "command", "model", "reply_to", "batch", "instances", "adaptive", "reason", "origin", "decided",
           "handler", "node", "threads")
#: Longest handler spec (``module:Class``) and options document accepted.
MAX_HANDLER_LEN = 300
MAX_OPTIONS_LEN = 16_384


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
    # --- register: what to serve, where ---------------------------------
    #: Zoo name or ``module:Class``.
    handler: str | None = None
    #: The node whose pool serves it (``packrat-mq node --node NAME``).
    node: str | None = None
    #: T for the optimizer (default: the cores the node has free).
    threads: int | None = Field(default=None, ge=1, le=4096)
    #: Handler options (``-o key=value``), a JSON object on the wire.
    options: dict[str, Any] = Field(default_factory=dict)

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
        if self.options:
            out["options"] = json.dumps(self.options)
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
    node = text.get("node") or None
    if node is not None:
        try:
            check_model_name(node)  # a node name is a key segment too
        except ValueError:
            raise fail(f"node name {node[:80]!r} must be 1-128 letters, digits, '.', '_' or '-'") from None
    common = dict(id=message_id, command=command, model=model, reply_to=reply_to, node=node,
                  reason=text.get("reason", "operator")[:200], origin=text.get("origin", "client")[:64],
                  entry_id=eid)
    if command == "unregister":
        return ControlMessage(**common, decided=protocol.entry_ms(eid) / 1000.0)
    batch_text, instances = text.get("batch"), text.get("instances")
    if command == "reconfigure" and (batch_text is None) == (instances is None):
        raise fail("reconfigure needs exactly one of batch (the optimizer plans it) or instances (e.g. 2*1x4)")
    if batch_text is not None and instances is not None:
        raise fail("give batch (the optimizer plans it) or instances (e.g. 2*1x4), not both")
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
    if adaptive and instances is not None and command == "reconfigure":
        raise fail("adaptive needs batch, not instances: the estimator changes B and the optimizer plans it")
    decided = None
    if "decided" in text:
        try:
            decided = float(text["decided"])
        except ValueError:
            raise fail(f"decided must be a time in seconds since the epoch, not {text['decided'][:40]!r}") from None
    extra: dict[str, Any] = {}
    if command == "register":
        handler = text.get("handler", "")
        if not handler or len(handler) > MAX_HANDLER_LEN:
            raise fail(f"register needs handler: a zoo name or module:Class (at most {MAX_HANDLER_LEN} characters)")
        extra["handler"] = handler
        if node is None:
            raise fail("register needs node: the node whose pool serves the model")
        threads_text = text.get("threads")
        if threads_text is not None:
            if not threads_text.isdigit() or not 1 <= int(threads_text) <= 4096:
                raise fail(f"threads must be an integer between 1 and 4096, not {threads_text[:40]!r}")
            extra["threads"] = int(threads_text)
        raw_options = text.get("options")
        if raw_options is not None:
            if len(raw_options) > MAX_OPTIONS_LEN:
                raise fail(f"options must be at most {MAX_OPTIONS_LEN} characters of JSON")
            try:
                options = json.loads(raw_options)
            except ValueError as exc:
                raise fail(f"options are not JSON: {exc}") from None
            if not isinstance(options, dict):
                raise fail("options must be a JSON object")
            extra["options"] = options
    return ControlMessage(
        **common, batch=batch, instances=instances, adaptive=adaptive,
        decided=decided if decided is not None else protocol.entry_ms(eid) / 1000.0, **extra,
    )


def send(r: redis.Redis | redis.client.Pipeline, keys: Keys, message: ControlMessage) -> Any:
    """XADD ``message`` to the control stream (kept to about :data:`STREAM_MAXLEN` entries)."""
    return r.xadd(keys.control(), message.fields(), maxlen=STREAM_MAXLEN, approximate=True)


def read(r: redis.Redis, keys: Keys, group: str, consumer: str, *, count: int = 10,
         block_ms: int | None = None) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """New control messages for ``group``, acknowledged as they are read.

    Acknowledged when read: a message is carried out by this reader or not
    at all (a reader that dies mid-way is restarted with its own
    configuration). A group lost to a Redis restart is created again, from
    now on. Never blocks unless ``block_ms`` is given.
    """
    try:
        resp = r.xreadgroup(group, consumer, {keys.control(): ">"}, count=count, block=block_ms)
    except redis.ResponseError as exc:
        if "NOGROUP" not in str(exc):
            raise
        ensure_group(r, keys.control(), group, start="$")
        return []
    entries = resp[0][1] if resp else []
    if entries:
        r.xack(keys.control(), group, *(entry_id for entry_id, _ in entries))
    return entries


def answer(r: redis.Redis, message: ControlMessage, *, ttl_s: int, who: str,
           result: dict[str, Any] | None = None, error: str | None = None) -> None:
    """Reply to ``message`` on its ``reply_to`` (nothing when it has none)."""
    if message.reply_to:
        deliver(r, message.reply_to, reply_fields(message.id, result=result, error=error, model=message.model,
                                                  command=message.command), ttl_s=ttl_s, who=who)


def refuse(r: redis.Redis, keys: Keys, entry_id: bytes, exc: ControlError, *, claimant: str, ttl_s: int,
           who: str) -> None:
    """Answer a message that cannot be read; every reader sees it, the first to claim it answers."""
    if exc.reply_to and r.set(keys.lock(f"control:{entry_id.decode()}"), claimant, nx=True, ex=300):
        deliver(r, exc.reply_to, reply_fields(exc.message_id, error=str(exc)), ttl_s=ttl_s, who=who)


def deliver(r: redis.Redis, reply_to: str, fields: dict[str, Any], *, ttl_s: int, who: str) -> None:
    """Write one control reply (through :mod:`packrat_mq.replies`, as every reply is written)."""
    with r.pipeline(transaction=True) as pipe:
        delivery = replies.queue(r, pipe, [(reply_to, fields)], ttl_s=ttl_s)
        replies.execute(pipe, who, delivery)


def new_id() -> str:
    return f"ctl-{uuid.uuid4().hex[:16]}"


def reply_fields(message_id: str, *, result: dict[str, Any] | None = None, error: str | None = None,
                 model: str = "", command: str = "reconfigure") -> dict[str, Any]:
    """A control reply: ``payload`` is the result as JSON; ``status`` error with ``error`` set."""
    if error is not None:
        return protocol.error_reply(message_id, error, model=model, command=command)
    return protocol.reply_fields(message_id, payload=json.dumps(result or {}).encode(), content_type=protocol.JSON,
                                 model=model, command=command)


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
