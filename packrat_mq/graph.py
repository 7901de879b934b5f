"""Graph mode: which backend turns a handler's model into a graph, and building it.

A graph mode is ``eager`` (the model as loaded) or one of the backends:

- ``torchscript``: ``torch.jit.trace`` + ``torch.jit.freeze`` (deprecated in
  this torch, kept selectable); the trace runs at any batch size.
- ``compile``: ``torch.compile(dynamic=False)`` with inductor freezing
  (weights folded in as constants), compiled at the instance's batch size
  by one example call before the instance takes traffic.
- ``export``: ``torch.export.export(...).module()``: an ATen graph run by
  PyTorch's own kernels, nothing compiled.
- ``aoti``: that exported program compiled ahead of time by AOTInductor
  (``aoti_compile_and_package``, C++ compiled with the machine's ``g++``)
  and loaded back.

``compile``, ``export`` and ``aoti`` are built for exactly the instance's
batch size b: a sub-batch of another size (a partial batch, a share changed
without a restart) is padded to b, or cut into pieces of b, by
:class:`_StaticBatch`, so no request waits for a recompilation.

``graph`` (``--graph`` alone, ``PACKRAT_GRAPH_MODE=true``) names the default
backend of the model: :func:`default_backend`, chosen from measurements
(docs/decisions.md, "Graph mode"). A backend that fails for a model fails the
instance's start with :class:`GraphModeError` naming the backend and the
other choices; nothing falls back silently, because the profile the
optimizer plans from is the backend's own.

``torch`` is imported only when a graph is built.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

#: The graph backends, in the order they are listed to users.
BACKENDS: tuple[str, ...] = ("torchscript", "compile", "export", "aoti")
#: Backends that compile C++ when an instance starts (tens of seconds for the zoo's models).
COMPILING: tuple[str, ...] = ("compile", "aoti")
#: Backends whose graph, built at one batch size, runs at any other as it is (a trace records the
#: operations, not the sizes); the others are built for one size (see :class:`_StaticBatch`).
ANY_BATCH: tuple[str, ...] = ("torchscript",)
#: Every concrete mode an instance can run in.
MODES: tuple[str, ...] = ("eager", *BACKENDS)
#: What ``--graph`` alone means: the backend measured fastest in steady state for every zoo model
#: (``benchmarks/bench_graph.py``; docs/figures.md "Graph backends", docs/decisions.md "Graph mode").
#: It is also the slowest to start: tens of seconds of compilation per instance.
DEFAULT_BACKEND = "compile"
#: Zoo models whose measured fastest backend differs from ``DEFAULT_BACKEND``: none did.
MODEL_DEFAULTS: dict[str, str] = {}

_EAGER_WORDS = {"", "eager", "none", "off", "false", "no", "0"}
_DEFAULT_WORDS = {"graph", "default", "true", "on", "yes", "1"}


class GraphModeError(ValueError):
    """A graph mode that does not exist, or a backend that cannot build this model."""


def choices() -> str:
    return "eager, graph (the model's default backend), " + ", ".join(BACKENDS)


def parse(value: object) -> str:
    """A graph mode as asked for: ``eager``, ``graph`` (the default backend, not yet resolved) or a backend.

    Booleans and their usual spellings are accepted, as the setting was a
    boolean: true means the default backend, false eager.
    """
    if value is None or value is False:
        return "eager"
    if value is True:
        return "graph"
    if not isinstance(value, str):
        raise GraphModeError(f"graph mode must be a string, got {type(value).__name__}: use {choices()}")
    word = value.strip().lower()
    if word in _EAGER_WORDS:
        return "eager"
    if word in _DEFAULT_WORDS:
        return "graph"
    if word in BACKENDS:
        return word
    raise GraphModeError(f"unknown graph mode {value!r}: use {choices()}")


def default_backend(handler: str | None = None) -> str:
    """The backend ``--graph`` alone serves ``handler`` (a zoo name or ``module:Class``) with."""
    return MODEL_DEFAULTS.get(handler or "", DEFAULT_BACKEND)


def resolve(value: object, handler: str | None = None) -> str:
    """The concrete mode (``eager`` or a backend) that ``value`` means for ``handler``."""
    mode = parse(value)
    return default_backend(handler) if mode == "graph" else mode


def backend_of(value: object, handler: str | None = None) -> str | None:
    """The backend ``value`` means for ``handler``; None for eager."""
    mode = resolve(value, handler)
    return None if mode == "eager" else mode


# ---------------------------------------------------------------------------
# building


def build(model: Any, batch: Any, backend: str, options: dict[str, Any] | None = None) -> Any:
    """``model`` as ``backend`` serves it, built on ``batch`` (a tensor, a tuple of them, or a dict by name).

    The result is called as the model is: positionally, or with keywords
    when ``batch`` is a dict. ``options`` (the handler's context options) may
    hold ``compile_mode`` (``torch.compile``'s ``mode``, default None) and
    ``compile_freezing`` (default true) for ``compile``. Any failure is a
    :class:`GraphModeError` that names the backend.
    """
    if backend not in BACKENDS:
        raise GraphModeError(f"unknown graph backend {backend!r}: use {', '.join(BACKENDS)}")
    names = list(batch) if isinstance(batch, dict) else None
    args = tuple(batch.values()) if isinstance(batch, dict) else batch
    if not isinstance(args, tuple):
        args = (args,)
    if backend != "torchscript":
        _batch_size(args)  # a static graph needs one batch dimension to pad and cut sub-batches along
    try:
        built = _BUILDERS[backend](model, args, dict(options or {}))
    except GraphModeError:
        raise
    except Exception as exc:  # noqa: BLE001 - any backend failure: one message naming the choices
        others = ", ".join(b for b in BACKENDS if b != backend)
        raise GraphModeError(
            f"graph backend {backend} cannot build {type(model).__name__}: {type(exc).__name__}: "
            f"{_first_line(exc)} (serve it eager, or with another backend: {others})"
        ) from exc
    return _KwargsToPositional(built, names) if names is not None else built


def _torchscript(model: Any, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
    import torch

    with torch.inference_mode(False), torch.no_grad():
        traced = torch.jit.trace(model, args, strict=False, check_trace=False)
        return torch.jit.freeze(traced.eval())


def _compile(model: Any, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
    import torch
    import torch._dynamo
    import torch._inductor.config

    # Dynamo caches compiled frames on the forward's code object, shared by every instance of the
    # class: a model built again at another batch size (the profiler's resize) would find the last
    # one's frozen graph behind the same guards, and recompiles beyond the limit fall back to eager.
    torch._dynamo.reset()
    freezing = _bool_option(options, "compile_freezing", True)
    compiled = torch.compile(model, dynamic=False, mode=options.get("compile_mode"))
    # Compiled here, by one call as served (inference mode), so the instance is ready when built.
    with torch._inductor.config.patch(freezing=freezing), torch.inference_mode():
        compiled(*args)
    return _StaticBatch(compiled, _batch_size(args))


def _export(model: Any, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
    import torch

    with torch.no_grad():
        program = torch.export.export(model, args)
    return _StaticBatch(program.module(), _batch_size(args))


def _aoti(model: Any, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
    import torch
    import torch._inductor

    if shutil.which("g++") is None and shutil.which("c++") is None:
        raise GraphModeError("graph backend aoti needs a C++ compiler (g++) on this machine")
    with torch.no_grad():
        program = torch.export.export(model, args)
    directory = tempfile.mkdtemp(prefix="packrat-aoti-")
    try:
        package = torch._inductor.aoti_compile_and_package(
            program, package_path=os.path.join(directory, "model.pt2"), inductor_configs={"freezing": True})
        loaded = torch._inductor.aoti_load_package(package)
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # loaded: the package file is not needed again
    return _StaticBatch(loaded, _batch_size(args))


_BUILDERS = {"torchscript": _torchscript, "compile": _compile, "export": _export, "aoti": _aoti}


def _batch_size(args: tuple[Any, ...]) -> int:
    sizes = {int(a.shape[0]) for a in args if hasattr(a, "shape") and len(a.shape) > 0}
    if len(sizes) != 1:
        raise GraphModeError(f"every input of the example batch must have the batch as its first dimension "
                             f"(sizes seen: {sorted(sizes) or 'none'})")
    return sizes.pop()


def _bool_option(options: dict[str, Any], name: str, default: bool) -> bool:
    value = options.get(name, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    raise GraphModeError(f"option {name} must be true or false, got {value!r}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__


class _StaticBatch:
    """Calls a graph built for exactly ``size`` rows with any number of rows.

    Fewer rows are padded with copies of the last one, and the extra rows
    of the output dropped; more are run in pieces of ``size``. Every input
    and output must have the batch as its first dimension (true of the zoo's
    models). A full sub-batch, the usual case, passes straight through.
    """

    def __init__(self, graph: Any, size: int) -> None:
        self.graph, self.size = graph, size

    def __call__(self, *args: Any) -> Any:
        import torch

        rows = _batch_size(args)
        if rows == self.size:
            return self.graph(*args)
        pieces = []
        for start in range(0, rows, self.size):
            part = [a[start:start + self.size] for a in args]
            short = self.size - int(part[0].shape[0])
            if short:
                part = [torch.cat([a, a[-1:].expand(short, *a.shape[1:])]) for a in part]
            pieces.append((self.graph(*part), self.size - short))
        return _join([_rows(out, kept) for out, kept in pieces])

    def eval(self) -> _StaticBatch:
        return self


def _rows(output: Any, kept: int) -> Any:
    if isinstance(output, (tuple, list)):
        return type(output)(_rows(o, kept) for o in output)
    return output[:kept]


def _join(parts: list[Any]) -> Any:
    import torch

    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, (tuple, list)):
        return type(first)(_join([p[i] for p in parts]) for i in range(len(first)))
    return torch.cat(parts)


class _KwargsToPositional:
    """Calls a graph built from positional inputs with the keyword batch it was built on."""

    def __init__(self, graph: Any, names: list[str]) -> None:
        self.graph, self.names = graph, names

    def __call__(self, **kwargs: Any) -> Any:
        return self.graph(*(kwargs[n] for n in self.names))

    def eval(self) -> _KwargsToPositional:
        return self
