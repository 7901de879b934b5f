"""The instance runtime and how its process is launched: environment, pinning, torch pools."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from workers import runtime
from workers.launch import instance_env, spawn, thread_env
from workers.runtime import RuntimeSpec


def test_thread_env() -> None:
    env = thread_env(4)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "4"
    assert all(isinstance(v, str) for v in env.values())
    with pytest.raises(ValueError):
        thread_env(0)


def test_wait_policy_and_spin_times_are_settings() -> None:
    from packrat_mq.settings import Settings

    env = thread_env(2, Settings(omp_wait_policy="PASSIVE", gomp_spincount=1000, kmp_blocktime_ms=0))
    assert (env["OMP_WAIT_POLICY"], env["GOMP_SPINCOUNT"], env["KMP_BLOCKTIME"]) == ("PASSIVE", "1000", "0")
    assert "OMP_WAIT_POLICY" not in thread_env(2, Settings())


def test_instance_env_keeps_model_loading_offline_unless_told_otherwise() -> None:
    env = instance_env(2, base={"PATH": "/bin", "HF_HUB_OFFLINE": "0"})
    assert "OMP_WAIT_POLICY" not in env  # the library's default unless a setting says otherwise
    assert env["PATH"] == "/bin" and env["OMP_NUM_THREADS"] == "2"
    assert env["HF_HUB_OFFLINE"] == "0"  # the operator's choice stands
    assert env["TRANSFORMERS_OFFLINE"] == "1"


def test_instances_keep_their_freed_batch_buffers_unless_told_otherwise() -> None:
    from packrat_mq.settings import Settings

    env = instance_env(2, Settings(), base={"PATH": "/bin"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456"
    # The operator's own tunables stay, and win for the names they set.
    theirs = instance_env(2, Settings(malloc_retain_mb=64),
                          base={"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1:glibc.malloc.arena_max=2"})
    assert theirs["GLIBC_TUNABLES"] == ("glibc.malloc.trim_threshold=1:glibc.malloc.arena_max=2:"
                                        "glibc.malloc.mmap_threshold=33554432")
    assert "GLIBC_TUNABLES" not in instance_env(2, Settings(malloc_retain_mb=0), base={})
    assert "GLIBC_TUNABLES" not in instance_env(2, base={})  # no settings: glibc's own policy
    with pytest.raises(ValueError):
        Settings(malloc_retain_mb=-1)


_MALLINFO = """
import ctypes, json
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2().hblks
bufs = [bytearray(602240) for _ in range(8)]  # a sub-batch of ImageNet .npy payloads
mapped = libc.mallinfo2().hblks - before
del bufs
print(json.dumps({"mapped": mapped, "kept_free": libc.mallinfo2().fordblks}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_the_tunables_take_batch_sized_buffers_from_the_heap_and_keep_them() -> None:
    from packrat_mq.settings import Settings

    def child(settings: Settings | None) -> dict:
        env = instance_env(1, settings)
        out = subprocess.run([sys.executable, "-c", _MALLINFO], env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    plain, tuned = child(None), child(Settings())
    assert plain["mapped"] >= 1  # mapped on their own (8 in a fresh interpreter), and unmapped at free
    assert tuned["mapped"] == 0 and tuned["kept_free"] >= 8 * 602240  # from the heap, and kept when freed


def _run_child(code: str, spec: dict, threads: int = 1) -> str:
    """Start ``python -c code`` the way instances start: spec on stdin, thread env set."""
    proc = subprocess.Popen([sys.executable, "-c", code], env=instance_env(threads), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(json.dumps(spec) + "\n", timeout=120)
    assert proc.returncode == 0, out
    return out.strip()


def test_start_pins_and_initialises_an_instance_in_a_child() -> None:
    """The parent sets the environment, the child pins itself and loads: as workers and the profiler do."""
    cpu = min(os.sched_getaffinity(0))
    code = (
        "import os, sys, json; from workers import runtime; from workers.launch import read_spec; "
        "spec = runtime.RuntimeSpec.model_validate_json(read_spec([])); h = runtime.start(spec); "
        "print(json.dumps([sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'], "
        "h.initialized, h.context.batch_size, 'torch' in sys.modules]))"
    )
    spec = RuntimeSpec(model="echo", handler="echo", instance_id="t0", threads=1, batch=2, cpus=[cpu])
    assert json.loads(_run_child(code, spec.model_dump())) == [[cpu], "1", True, 2, False]


@pytest.mark.slow
def test_start_sizes_torch_pools_when_the_handler_uses_torch() -> None:
    pytest.importorskip("torch")
    cpu = min(os.sched_getaffinity(0))
    code = (
        "import torch; from workers import runtime; from workers.launch import read_spec; "
        "spec = runtime.RuntimeSpec.model_validate_json(read_spec([])); runtime.pin(spec.cpus); "
        "print(runtime.size_torch(spec.threads), torch.get_num_threads(), torch.get_num_interop_threads())"
    )
    spec = RuntimeSpec(model="m", handler="echo", instance_id="t0", threads=1, cpus=[cpu])
    assert _run_child(code, spec.model_dump()).split() == ["True", "1", "1"]


def test_pin_moves_every_thread_of_the_process_not_only_the_caller() -> None:
    """A spare rebound to other cores already runs threads (OpenMP's, torch's, its heartbeat): they move too."""
    import threading

    allowed = sorted(os.sched_getaffinity(0))
    started, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def idle() -> None:
        tid.append(threading.get_native_id())
        started.set()
        done.wait(10.0)

    t = threading.Thread(target=idle)
    t.start()
    started.wait(10.0)
    try:
        runtime.pin(allowed[-1:])
        assert os.sched_getaffinity(0) == {allowed[-1]}
        assert os.sched_getaffinity(tid[0]) == {allowed[-1]}
    finally:
        runtime.pin(allowed)
        done.set()
        t.join()
    assert os.sched_getaffinity(0) == set(allowed)


def test_size_torch_never_imports_torch() -> None:
    code = "import sys; from workers import runtime; print(runtime.size_torch(2), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_pin_to_no_cpu_is_an_error() -> None:
    with pytest.raises(ValueError):
        runtime.pin([])


def test_spawn_passes_the_spec_on_stdin_not_argv() -> None:
    proc = spawn("json.tool", '{"secret": "pw"}', stdout=subprocess.PIPE)
    assert proc.stdout is not None
    out = proc.stdout.read()
    assert proc.wait(30) == 0
    assert json.loads(out) == {"secret": "pw"}
    assert "pw" not in " ".join(proc.args)


def test_resize_retargets_a_loaded_handler_without_reloading() -> None:
    handler = runtime.start(RuntimeSpec(model="echo", handler="echo", instance_id="t0", batch=1), warm_up=False)
    eager = handler.model
    runtime.resize(handler, eager, 8, graph_mode=False)
    assert handler.context is not None and handler.context.batch_size == 8
    assert handler.model is eager


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "rebuilt"), [("export", True), ("torchscript", False)])
def test_rebind_repins_rethreads_and_retraces_a_loaded_instance(backend: str, rebuilt: bool) -> None:
    """A spare moved in place: new cpus, torch's intra-op pool resized, a graph built for one size built
    again at the new B; a TorchScript trace, which runs at any size, kept."""
    pytest.importorskip("torch")
    cpus = sorted(os.sched_getaffinity(0))
    code = (
        "import os, json, torch; from workers import runtime; from workers.launch import read_spec; "
        "spec = runtime.RuntimeSpec.model_validate_json(read_spec([])); h = runtime.start(spec); "
        "before = (torch.get_num_threads(), h.context.batch_size, id(h.model)); "
        f"new = spec.model_copy(update={{'threads': {len(cpus)}, 'batch': 3, 'cpus': {cpus!r}}}); "
        "runtime.rebind(h, new); "
        "out = h.handle(h.example_batch(3)); "
        "print(json.dumps([before[:2], torch.get_num_threads(), sorted(os.sched_getaffinity(0)), "
        "h.context.batch_size, h.context.threads, id(h.model) != before[2], len(out)]))"
    )
    spec = RuntimeSpec(model="tiny", handler="tests.supervisor_handlers:TinyTorch", instance_id="t0", threads=1,
                       batch=2, cpus=[cpus[0]], graph_mode=backend)
    got = json.loads(_run_child(code, spec.model_dump()))
    assert got == [[1, 2], len(cpus), cpus, 3, len(cpus), rebuilt, 3]


def test_a_spare_warms_ahead_and_a_rebind_to_a_warmed_size_skips_the_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pre-started spare runs one batch at each (threads, batch) its supervisor's plans have, at other thread
    counts by a rebind it undoes after; a ``serve`` order at one of them then takes no warm-up, at any other
    size it does."""
    import fakeredis

    from packrat_mq.settings import Settings
    from workers import rebinding
    from workers.worker import Worker, WorkerSpec

    warmed: list[int] = []
    rebinds: list[tuple[int, int, bool]] = []
    monkeypatch.setattr(runtime, "warm", lambda handler, b: warmed.append(b))
    monkeypatch.setattr(runtime, "rebind", lambda handler, spec, warm_up=True:
                        rebinds.append((spec.threads, spec.batch, warm_up)))
    r = fakeredis.FakeRedis()
    spec = WorkerSpec(url="redis://unused", settings=Settings(prefix="wa"), model="m", handler="echo",
                      instance_id="s1", spare=True, warm_at=[(1, 1), (1, 2), (1, 4), (4, 1)], pin=False)
    worker = Worker(r, spec, handler=object())  # type: ignore[arg-type]
    worker.warm_ahead()
    assert warmed == [2, 4]  # b=1 was its start's warm-up
    assert rebinds == [(4, 1, True), (1, 1, False)]  # warmed at 4 threads, then back to its own
    rebinds.clear()
    for threads, batch in ((1, 4), (4, 1), (1, 8)):
        rebinding.send(r, worker.queue, rebinding.Order(role="serve", threads=threads, batch=batch, cpus=[0],
                                                        pin=False))
        (entry_id, fields), = r.xrange(worker.queue)
        worker.rebind(entry_id, fields)
        r.xtrim(worker.queue, maxlen=0)
    assert rebinds == [(1, 4, False), (4, 1, False), (1, 8, True)]
    # Its own thread count after another one: it moves back to warm there, not at the other's threads.
    warmed.clear()
    rebinds.clear()
    Worker(r, spec.model_copy(update={"warm_at": [(4, 1), (4, 2), (1, 2)]}),
           handler=object()).warm_ahead()  # type: ignore[arg-type]
    assert warmed == [2]  # (4, 2), at 4 threads
    assert rebinds == [(4, 1, True), (1, 2, True), (1, 1, False)]
    # Not a spare, or a backend built for one size: nothing warmed ahead.
    warmed.clear()
    Worker(r, spec.model_copy(update={"spare": False}), handler=object()).warm_ahead()  # type: ignore[arg-type]
    Worker(r, spec.model_copy(update={"graph_mode": "compile"}), handler=object()).warm_ahead()  # type: ignore[arg-type]
    assert warmed == []
