"""Every Redis key and group name packrat-mq uses, built from one prefix.

Keys follow ``<prefix>:<kind>:<name...>``. Nothing else in the code base
formats a key by hand, so a different prefix (several deployments sharing
one Redis) or a renamed kind is a one-line change here.

On Redis Cluster (``Keys(prefix, cluster=True)``, what a ``redis+cluster://``
URL gives) the model segment of every key of one model is a hash tag,
``<prefix>:<kind>:{<model>}[:<name>...]``: the request stream, the instance
queues, the fence, the deployment, the records and the counters of one model
hash to one slot, so the fan-out and the finish transactions stay single-slot
MULTI/EXECs, while different models spread over the masters. Keys of no one
model (the control stream, the registry, the index of models, locks, reply
streams) stay untagged and land wherever they hash. On one Redis nothing
changes: a tag there would only change the wire format for producers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

#: What a model name may be: it is one key segment, so no ':' and no spaces.
MODEL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


def check_model_name(name: str) -> str:
    """Return ``name`` if it can be a model name, else raise ``ValueError`` saying why."""
    if not MODEL_NAME.match(name):
        raise ValueError(
            f"model name {name!r} must be 1-128 letters, digits, '.', '_' or '-' "
            "(it is a segment of Redis keys; to serve a handler class, give its import path as "
            "--model module:Class and the name to serve it under as --name)"
        )
    return name

#: Consumer group the dispatcher of a model reads the request stream with.
DISPATCHER_GROUP = "dispatchers"
#: Consumer group a worker instance reads its own queue with.
WORKER_GROUP = "workers"


def control_group(model: str, node: str) -> str:
    """The consumer group one supervisor reads the control stream with.

    One group per supervisor (model and node), so every supervisor sees every
    control message (a broadcast); each acts on the messages about its own
    model and acknowledges the rest.
    """
    return f"supervisor:{model}:{node}"


def node_group(node: str) -> str:
    """The consumer group a node pool reads the control stream with (register, unregister)."""
    return f"node:{node}"


def request_owner(instance_id: str) -> str:
    """The consumer (in ``DISPATCHER_GROUP``) owning the requests fanned out to one instance.

    The dispatcher XCLAIMs each request it hands to an instance to this name,
    so the stream's pending list says who holds each request, and the
    dispatcher's own pending entries are only those it read and has not
    handed out (what it must re-read after a crash).
    """
    return f"instance:{instance_id}"


@dataclass(frozen=True)
class Keys:
    """Key builder for one prefix (default ``packrat``); ``cluster``: a model's keys carry its hash tag."""

    prefix: str = "packrat"
    cluster: bool = False

    def _key(self, kind: str, *names: str) -> str:
        return ":".join((self.prefix, kind, *names))

    def _model_key(self, kind: str, model: str, *names: str) -> str:
        """A key of one model: on Redis Cluster its model segment is the hash tag ``{<model>}``."""
        return self._key(kind, self._tag(model), *names)

    def _tag(self, model: str) -> str:
        """The model segment of the model's keys: ``{<model>}`` on Redis Cluster, else the name."""
        return f"{{{model}}}" if self.cluster else model

    # --- request path -------------------------------------------------
    def requests(self, model: str) -> str:
        """Stream producers XADD requests to; its length is the backlog."""
        return self._model_key("requests", model)

    def request_streams(self) -> str:
        """SCAN pattern of every request stream name of this prefix, tagged or not."""
        return self._key("requests", "*")

    def model_of(self, request_stream: bytes) -> tuple[str, bool]:
        """(model name, whether the name has this mode's form) of a key matching :meth:`request_streams`.

        A producer may write to any name: on Redis Cluster ``<prefix>:requests:echo``
        (no tag) is not model ``echo``'s stream, and on one Redis
        ``<prefix>:requests:{echo}`` is not either; both come back with
        ``False`` and the bare name, so the sweep can say where to write.
        """
        head = self._key("requests", "").encode()
        segment = request_stream[len(head):].decode("utf-8", "replace")
        tagged = len(segment) > 2 and segment[0] == "{" and segment[-1] == "}"
        name = segment[1:-1] if tagged else segment
        return name, tagged == self.cluster

    def queue(self, model: str, instance_id: str) -> str:
        """Stream of sub-batches for one worker instance."""
        return self._model_key("queue", model, instance_id)

    def wakeup(self, model: str) -> str:
        """List a worker pushes a token to when it finishes a sub-batch.

        The dispatcher blocks on it (BLPOP) while every instance is busy,
        instead of polling queue lengths.
        """
        return self._model_key("wakeup", model)

    def replies(self, client_id: str) -> str:
        """Default reply stream of one client (any stream key may be used)."""
        return self._key("replies", client_id)

    # --- control plane ------------------------------------------------
    def config(self, model: str) -> str:
        """JSON document: the configuration a model is served with now."""
        return self._model_key("config", model)

    def deployment(self, model: str) -> str:
        """Hash of a model's deployment by node: node -> that node's part (JSON, a ``Deployment``).

        Each node's supervisor writes its own field; ``config`` is their merge,
        rewritten in the same transaction (see :mod:`packrat_mq.deployment`).
        """
        return self._model_key("deployment", model)

    def fence(self, model: str, instance_id: str) -> str:
        """Set when a dispatcher hands a dead instance's requests back: that instance may no longer reply.

        Every write of the worker's reply transaction checks it (``workers.acks``), so a
        request re-dispatched elsewhere is answered once (see ``dispatcher.reclaiming``).
        """
        return self._model_key("fence", model, instance_id)

    def control(self) -> str:
        """Stream of control messages (reconfigure a model); see docs/protocol.md."""
        return f"{self.prefix}:control"

    def registry(self) -> str:
        """Hash of registered models: name -> JSON (handler, options, node, configuration)."""
        return self._key("registry", "models")

    def node(self, node: str) -> str:
        """Hash describing one node pool (pid, the models it serves, its cores)."""
        return self._key("node", node)

    def reconfigurations(self, model: str) -> str:
        """List of a model's last reconfigurations (JSON, newest first, at most 10)."""
        return self._model_key("reconfigurations", model)

    def instance(self, model: str, instance_id: str) -> str:
        """Hash describing one running instance (pid, cores, heartbeat)."""
        return self._model_key("instance", model, instance_id)

    def dispatcher(self, model: str) -> str:
        """Hash describing the model's dispatcher (pid, host, state, heartbeat)."""
        return self._model_key("dispatcher", model)

    def supervisor(self, model: str, node: str) -> str:
        """Hash describing the supervisor of one model on one node (pid, generation, instances)."""
        return self._model_key("supervisor", model, node)

    def stats(self, model: str) -> str:
        """Hash of counters (requests, batches, rejected, errors)."""
        return self._model_key("stats", model)

    def profile_result(self, model: str, node: str) -> str:
        """Profile JSON written by an enqueued (RQ) profiling job."""
        return self._model_key("profile", model, node)

    def lock(self, name: str) -> str:
        """A short-lived mutual-exclusion key (SET NX PX)."""
        return self._key("lock", name)

    # --- discovery indexes (one set per kind) -------------------------
    def models(self) -> str:
        """Set of model names being served."""
        return self._key("index", "models")

    def instances(self, model: str) -> str:
        """Set of instance ids of one model."""
        return self._key("index", "instances", self._tag(model))

    def nodes(self) -> str:
        """Set of the node pools (``packrat-mq node``) on this Redis."""
        return self._key("index", "nodes")

    def supervisors(self, model: str) -> str:
        """Set of the nodes supervising instances of one model."""
        return self._key("index", "supervisors", self._tag(model))
