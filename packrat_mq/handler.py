"""The handler contract, as TorchServe users know it.

A handler is created once per worker instance; ``initialize(context)`` loads
the model, then every sub-batch goes ``preprocess -> inference ->
postprocess``. The framework (``run_batch``), not each handler, enforces the
contract: the output list must be as long as the input, a per-request
``validate`` failure rejects that request only, and an exception anywhere
else fails that batch only, each request getting an error reply.

``torch`` is imported lazily so that handlers that do not need it (``echo``,
``sleep``) start in milliseconds and the dispatcher never loads it.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Any

from packrat_mq import graph


class BadRequest(ValueError):
    """Raised for one request whose input the model cannot take.

    The message is sent to the producer as the reply's ``error`` field, so it
    should say what was wrong and what is expected.
    """


@dataclass
class Context:
    """What a handler may need to know about the instance it runs in."""

    model_name: str
    instance_id: str = "i0"
    threads: int = 1
    cores: tuple[int, ...] = ()
    batch_size: int = 1
    #: The graph backend the model is served with (``packrat_mq.graph.BACKENDS``); None in eager
    #: mode. True, as callers of the boolean setting wrote it, means the model's default backend.
    graph_mode: str | None = None
    model_dir: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.graph_mode = graph.backend_of(self.graph_mode, self.model_name)


@dataclass
class Input:
    """One request as the handler sees it: the decoded payload and its type."""

    id: str
    data: Any
    content_type: str


class BaseHandler:
    """Base class for handlers; override what your model needs.

    - ``load_model(context)`` returns the ``torch.nn.Module`` (or any callable).
    - ``example_batch(n)`` returns an input batch of ``n`` for warm-up,
      TorchScript tracing and profiling.
    - ``validate(item)`` raises :class:`BadRequest` for an input the model
      cannot take (checked per request, before batching); it may also
      replace ``item.data`` with what ``preprocess`` wants (a decoded image).
    - ``validate_all(items)`` validates a sub-batch's requests, one after the
      other; a handler whose ``validate`` is costly and releases the GIL may
      run them in threads.
    - ``preprocess(items)`` turns a list of inputs into the model's batch.
    - ``inference(batch)`` runs the model under ``torch.inference_mode()``.
    - ``postprocess(output)`` returns one JSON-able value, ``numpy`` array or
      ``bytes`` per request.

    ``.npy`` inputs arrive as read-only arrays over the request's own bytes
    (or over a worker's reusable buffer, for payloads in shared memory):
    copy what you change, and what you keep past the batch.
    """

    #: Whether ``initialize`` may build this handler's model as a graph (``context.graph_mode``).
    traceable: bool = True

    def __init__(self) -> None:
        self.context: Context | None = None
        self.model: Any = None
        self.initialized = False

    # --- lifecycle ----------------------------------------------------
    def initialize(self, context: Context) -> None:
        self.context = context
        self.model = self.prepare(self.load_model(context))
        self.initialized = True

    def rethread(self, context: Context) -> None:
        """The instance moves to other cores, thread count or batch size, with its model loaded.

        Called by a reconfiguration that re-uses a loaded (spare) instance
        instead of starting a process; torch's pools are already resized.
        The default keeps the model, except in graph mode when the batch
        size changes under a backend built for one size (``compile``,
        ``export``, ``aoti``: :data:`packrat_mq.graph.ANY_BATCH` says which
        are not): the model is loaded and built again at the new size (still
        cheaper than a new process). A TorchScript trace runs at any size and
        is kept: tracing ResNet-50 again took 2.7-4.3 s of a core while the
        old instances served on the same cores, and the trace at b=1 ran b=4
        in the same time as one traced at 4 (533.8 against 538.2 ms, same
        outputs; docs/decisions.md). Override it if the handler keeps
        anything that depends on the thread count.
        """
        old = self.context
        self.context = context
        backend = context.graph_mode
        if not backend or not self.traceable:
            return
        if (old is None or old.graph_mode != backend
                or (old.batch_size != context.batch_size and backend not in graph.ANY_BATCH)):
            self.model = self.prepare(self.load_model(context))

    def prepare(self, model: Any) -> Any:
        """The model as served: in eval mode, and in graph mode built at ``context.batch_size``.

        Called again with the eager model when the instance is made to serve
        another size (``workers.runtime.resize``); a handler whose inputs
        depend on the mode decides them here, before the example batch.
        """
        if hasattr(model, "eval"):
            model.eval()
        backend = self.context.graph_mode if self.context is not None else None
        if backend and self.traceable:
            return self.build_graph(model, backend)
        return model

    def load_model(self, context: Context) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement load_model()")

    def example_batch(self, n: int) -> list[Input]:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement example_batch()")

    # --- per batch ----------------------------------------------------
    def validate(self, item: Input) -> None:
        """Reject a single request (raise :class:`BadRequest`); default accepts all."""

    def validate_all(self, items: list[Input]) -> list[Exception | None]:
        """``validate`` each request: per request, the exception it raised, or None."""
        return [self.rejection(item) for item in items]

    def rejection(self, item: Input) -> Exception | None:
        """What ``validate`` raised for ``item``, or None if it accepted it."""
        try:
            self.validate(item)
        except Exception as exc:  # noqa: BLE001 - any rejection is the producer's to read
            return exc
        return None

    def preprocess(self, items: list[Input]) -> Any:
        return [item.data for item in items]

    def inference(self, batch: Any) -> Any:
        import torch

        with torch.inference_mode():
            return self._call_model(batch)

    def _call_model(self, batch: Any) -> Any:
        if isinstance(batch, dict):
            return self.model(**batch)
        if isinstance(batch, (tuple, list)):
            return self.model(*batch)
        return self.model(batch)

    def postprocess(self, output: Any) -> list[Any]:
        return list(output)

    def handle(self, items: list[Input]) -> list[Any]:
        return self.postprocess(self.inference(self.preprocess(items)))

    # --- graph mode ---------------------------------------------------
    def build_graph(self, model: Any, backend: str) -> Any:
        """``model`` built by ``backend`` (``packrat_mq.graph``) on an example batch of the serving size."""
        n = self.context.batch_size if self.context else 1
        batch = self.preprocess(self.example_batch(n))
        options = self.context.options if self.context else {}
        return graph.build(model, batch, backend, options)


@dataclass
class Outcome:
    """Result of one request in a batch: a value or an error message."""

    value: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class BatchResult:
    outcomes: list[Outcome]
    inference_ms: float


def run_batch(handler: BaseHandler, items: list[Input]) -> BatchResult:
    """Run one sub-batch through ``handler`` and enforce the contract.

    Requests that fail ``validate`` are answered with their own error and left
    out of the batch; the others run together. A handler exception or a
    wrong-length output fails every request of that batch and nothing else.
    ``inference_ms`` is the handler's whole time, validation included (where
    image files are decoded).
    """
    outcomes: list[Outcome | None] = [None] * len(items)
    valid: list[int] = []
    start = time.perf_counter()
    try:
        rejections = list(handler.validate_all(items))
        if len(rejections) != len(items):
            raise RuntimeError(f"handler {type(handler).__name__}.validate_all returned {len(rejections)} "
                               f"results for {len(items)} requests; it must return one per request")
    except Exception as exc:  # noqa: BLE001 - the batch fails, the worker lives on
        message = f"inference failed for this batch: {_describe(exc)}"
        elapsed = (time.perf_counter() - start) * 1000.0
        return BatchResult(outcomes=[Outcome(error=message) for _ in items], inference_ms=elapsed)
    for i, rejection in enumerate(rejections):
        if rejection is None:
            valid.append(i)
        else:
            outcomes[i] = Outcome(error=_describe(rejection))
    if valid:
        try:
            results = handler.handle([items[i] for i in valid])
            if not isinstance(results, (list, tuple)) or len(results) != len(valid):
                got = len(results) if isinstance(results, (list, tuple)) else type(results).__name__
                raise RuntimeError(
                    f"handler {type(handler).__name__} returned {got} results for a batch of "
                    f"{len(valid)}; it must return a list as long as its input"
                )
            for i, value in zip(valid, results):
                outcomes[i] = Outcome(error=_describe(value)) if isinstance(value, Exception) else Outcome(value=value)
        except Exception as exc:  # noqa: BLE001 - the batch fails, the worker lives on
            message = f"inference failed for this batch: {_describe(exc)}"
            for i in valid:
                outcomes[i] = Outcome(error=message)
    elapsed = (time.perf_counter() - start) * 1000.0
    return BatchResult(outcomes=[o or Outcome(error="no result") for o in outcomes], inference_ms=elapsed)


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, BadRequest) else f"{type(exc).__name__}: {text}"


#: The model zoo: handlers by short name; users name their own by ``module:Class``.
ZOO: dict[str, str] = {
    "echo": "packrat_mq.zoo.testing:EchoHandler",
    "sleep": "packrat_mq.zoo.testing:SleepHandler",
    "profiled": "packrat_mq.zoo.profiled:ProfiledHandler",
    "resnet50": "packrat_mq.zoo.vision:ResNet50Handler",
    "inception_v3": "packrat_mq.zoo.vision:InceptionV3Handler",
    "bert": "packrat_mq.zoo.language:BertHandler",
    "gpt2": "packrat_mq.zoo.language:GPT2Handler",
    "minilm": "packrat_mq.zoo.minilm:MiniLMHandler",
}


def _handler_path(spec: str) -> str:
    path = ZOO.get(spec, spec)
    module_name, colon, attr = path.partition(":")
    if not (colon and module_name and attr):
        known = ", ".join(sorted(ZOO))
        raise ValueError(f"unknown model {spec!r}: use one of {known} or an import path module:Class")
    return path


def handler_class(spec: str) -> type[BaseHandler]:
    """The handler class a zoo name (``resnet50``) or ``module:Class`` names; ``ValueError`` saying why not.

    Imports the module (a zoo model's imports torch).
    """
    path = _handler_path(spec)
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import handler module {module_name!r}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a module that fails as it loads: say how, in one line
        raise ValueError(f"cannot import handler module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    try:
        cls = getattr(module, attr)
    except AttributeError as exc:
        raise ValueError(f"module {module_name!r} has no handler {attr!r}") from exc
    # Check before calling: an arbitrary callable (a function, a module) is
    # neither run nor allowed to fail with an unrelated TypeError.
    if not (isinstance(cls, type) and issubclass(cls, BaseHandler)):
        raise ValueError(f"{path} is not a packrat_mq.handler.BaseHandler subclass")
    return cls


def check_handler(spec: str, *, here: bool = True) -> None:
    """Raise ``ValueError`` unless ``spec`` names a handler a worker can load, before any worker starts.

    A zoo name is taken as it is, without importing torch into the process
    that asks; ``module:Class`` is imported and checked here, as the worker
    will import it. ``here=False`` (a job for another node, whose modules
    may differ) checks only the form.
    """
    if spec in ZOO:
        return
    _handler_path(spec)
    if here:
        handler_class(spec)


def load_handler(spec: str) -> BaseHandler:
    """Instantiate a handler from a zoo name (``resnet50``) or ``module:Class``."""
    return handler_class(spec)()
