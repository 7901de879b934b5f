"""How a process that will run a model is started: its environment and its spec.

Every such process (a worker instance, a profiling child, the dispatcher) is
spawned, never forked, with ``python -m <module>``: a forked torch runtime
shares thread pools with its parent. OpenMP and MKL read their thread counts
once, when they load, so the parent puts them in the child's environment
(:func:`instance_env`) before the child imports torch; the child pins itself
(:mod:`workers.runtime`).

The spec goes to the child as JSON on stdin, never in argv: it holds the
Redis URL with its password, and ``/proc/<pid>/cmdline`` is readable by every
user of the machine.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

from packrat_mq.settings import Settings

#: Thread-count variables read by OpenMP, MKL, OpenBLAS and friends at load time.
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "RAYON_NUM_THREADS",
)

#: Model loading must stay offline, and its progress bars are noise in a server's log.
_OFFLINE_ENV = (
    ("HF_HUB_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
    ("TRANSFORMERS_VERBOSITY", "error"),
    ("TOKENIZERS_PARALLELISM", "false"),
)


def thread_env(threads: int, settings: Settings | None = None) -> dict[str, str]:
    """The thread variables of a child that will run ``threads`` intra-op threads.

    How idle OpenMP threads wait is a setting (``omp_wait_policy``,
    ``gomp_spincount``, ``kmp_blocktime_ms``); unset, the library's default
    stands. Instances own their cores, so passive waiting protects no
    neighbour, and on small batches it cost about 30% on one machine (see
    docs/figures.md and ``benchmarks/bench_threads.py``).
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    env = {name: str(threads) for name in THREAD_ENV_VARS}
    if settings is not None:
        for name, value in (("OMP_WAIT_POLICY", settings.omp_wait_policy),
                            ("GOMP_SPINCOUNT", settings.gomp_spincount),
                            ("KMP_BLOCKTIME", settings.kmp_blocktime_ms)):
            if value is not None:
                env[name] = str(value)
    return env


#: glibc's largest mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``): blocks up to it can come
#: from the heap, and only larger ones are mapped (and unmapped at free) one by one.
MMAP_THRESHOLD_MAX = 32 << 20


def malloc_env(settings: Settings, base: Mapping[str, str]) -> dict[str, str]:
    """``GLIBC_TUNABLES`` that keep an instance's freed batch buffers for the next batch (``malloc_retain_mb``).

    glibc hands a freed block back to the OS when it was mapped on its own
    (above the mmap threshold, 128 KiB until a larger block is freed) or
    when the free top of the heap passes the trim threshold (twice the
    mmap threshold): a sub-batch of eight 602 KB payloads, freed together,
    passes it. The next batch then faults every page in again: reading
    eight 602 KB entries in one ``XRANGE`` took 12.0 ms, and 5.3 ms with
    both thresholds raised (the same process, 80 reads each, interleaved;
    one entry 0.39 against 0.41 ms). An instance reaches its peak memory
    every batch, so keeping it costs resident memory only between batches.
    Set by the parent, as the thread variables are: glibc reads tunables
    once, at start. Names the operator already set in ``GLIBC_TUNABLES``
    stay theirs.
    """
    if settings.malloc_retain_mb <= 0:
        return {}
    existing = [item for item in base.get("GLIBC_TUNABLES", "").split(":") if item]
    named = {item.split("=", 1)[0] for item in existing}
    ours = [f"{name}={value}" for name, value in (("glibc.malloc.mmap_threshold", MMAP_THRESHOLD_MAX),
                                                  ("glibc.malloc.trim_threshold", settings.malloc_retain_mb << 20))
            if name not in named]
    return {"GLIBC_TUNABLES": ":".join(existing + ours)} if ours else {}


def instance_env(threads: int, settings: Settings | None = None,
                 base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a model-running child: ``base`` (default ours) plus threads, malloc and offline loading.

    Without ``settings`` (benchmarks of one library setting) glibc's malloc keeps its own policy.
    """
    env = dict(os.environ if base is None else base)
    env.update(thread_env(threads, settings))
    if settings is not None:
        env.update(malloc_env(settings, env))
    for name, value in _OFFLINE_ENV:
        env.setdefault(name, value)
    return env


def spawn(
    module: str,
    spec_json: str,
    env: Mapping[str, str] | None = None,
    *,
    keep_stdin: bool = False,
    stdout: int | None = None,
    stderr: object = None,
) -> subprocess.Popen[bytes]:
    """Start ``python -m module`` with its spec as the first line of its stdin.

    ``keep_stdin`` leaves the pipe open after the spec (the profiling child
    takes its requests there, one JSON line each); otherwise it is closed, so
    the child reads the spec to EOF.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", module],
        env=dict(env) if env is not None else None,
        stdin=subprocess.PIPE,
        stdout=stdout,
        stderr=stderr,  # type: ignore[arg-type]
        # Its own session: Ctrl-C reaches the supervisor only, which stops
        # its children in order.
        start_new_session=True,
    )
    assert proc.stdin is not None
    try:
        proc.stdin.write(spec_json.encode() + b"\n")
        if keep_stdin:
            proc.stdin.flush()
        else:
            proc.stdin.close()
    except BrokenPipeError:
        pass  # it died at once; whoever started it sees the exit code
    return proc


def read_spec(argv: list[str] | None = None) -> str:
    """The child's side: its spec from the first line of stdin, or ``argv[0]`` when given (tests).

    ``argv`` defaults to the process's own arguments.
    """
    argv = sys.argv[1:] if argv is None else argv
    return argv[0] if argv else sys.stdin.readline()
