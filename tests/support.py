"""Helpers shared by the test modules (imported as ``support``: tests/ is on sys.path).

Worker processes import it too (spawned workers inherit sys.path), so functions a test
hands to a cluster may use it.
"""

from __future__ import annotations

import gc
import importlib.metadata
import os
import re
import signal
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import dask
import numpy as np
import pytest
from distributed.utils_test import poll_for

import dask_overlap
from dask_overlap import OverlapPlugin


def _installed() -> bool:
    try:
        importlib.metadata.distribution("dask_overlap")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


#: For tests that run ``python -m dask overlap``: dask finds that command through the
#: package's ``dask_cli`` entry point, which only an installed package has. The README's
#: test command installs it; the GPU machine's runs put the checkout on ``PYTHONPATH``
#: instead (../shared/gpu/README.md). An installed package without the command fails them.
needs_install = pytest.mark.skipif(
    not _installed(),
    reason="dask_overlap is not installed (its dask_cli entry point makes `dask overlap`): "
    "pip install -e .",
)


# -- bounded waits ----------------------------------------------------------------------
def poll(condition: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """``condition()`` once it is truthy; fail after ``timeout`` s (a bound, not a timing)."""
    value: list[Any] = [None]

    def met() -> bool:
        value[0] = condition()
        return bool(value[0])

    def fail() -> None:
        raise AssertionError(f"{what} not met within {timeout} s (last: {value[0]!r})")

    poll_for(met, timeout=timeout, fail_func=fail)
    return value[0]


def wait_until_idle(timeout: float = 10.0) -> dict[str, Any]:
    """Wait (bounded) until no partition task of this process is running; return the stats.

    Dask raises a task's exception as soon as it arrives, while other partitions of the
    same graph may still be running; they finish on their own.
    """

    def idle() -> dict[str, Any] | None:
        stats = dask_overlap.runtime_stats()
        return stats if stats["partitions_active"] == 0 else None

    return poll(idle, timeout, what="no partition active")


def pinned_in_use_once_collected(timeout: float = 10.0) -> int:
    """Pinned bytes still held once unreachable cycles are gone (bounded wait; 0 or fail).

    After a failure, the threaded scheduler's worker threads still hand finished
    partitions' results to a queue that only a reference cycle keeps (in Dask, not in
    this package), so the pool's blocks come back at a garbage collection after those
    threads are done, rather than at once.
    """

    def in_use() -> int:
        gc.collect()
        return dask_overlap.runtime_stats()["pinned_bytes_in_use"]

    poll(lambda: in_use() == 0, timeout, what="no pinned bytes in use")
    return 0  # (it failed above otherwise)


# -- gates: a func on a worker held until the test lets it go ----------------------------
# One threading.Event per name in each worker process. The test closes a gate on the
# workers there are (``client.run(hold, name)``) and opens it again (``client.run(release,
# name)``); a process that never held it (a worker started later, as the nanny's
# replacement of a killed one) lets everything through.
_gates: dict[str, threading.Event] = {}
_gates_lock = threading.Lock()


def hold(name: str) -> None:
    """Close gate ``name`` in this process."""
    with _gates_lock:
        _gates[name] = threading.Event()


def release(name: str) -> None:
    """Open gate ``name`` in this process (and forget it)."""
    with _gates_lock:
        gate = _gates.pop(name, None)
    if gate is not None:
        gate.set()


def wait_at(name: str, timeout: float) -> bool:
    """Wait until gate ``name`` is open here, at most ``timeout`` s; False if it stayed shut."""
    with _gates_lock:
        gate = _gates.get(name)
    return gate is None or gate.wait(timeout)


# -- data, functions and checks ---------------------------------------------------------
class Boom(Exception):
    """What a test's func raises: nothing else raises it."""


def rows_data(rows: int = 24, cols: int = 4, dtype: Any = np.float64) -> np.ndarray:
    """Each row holds its own index, so a function can tell which rows it was given."""
    return np.repeat(np.arange(rows, dtype=dtype)[:, None], cols, axis=1)


def failing_at(row: int) -> Callable[[Any], Any]:
    """Twice its block, except that it raises :class:`Boom` in the block holding ``row``
    (of :func:`rows_data`; NumPy and CuPy blocks alike)."""

    def func(b: Any) -> Any:
        if b.size and bool((b[:, 0] == row).any()):
            raise Boom(f"row {row} is cursed")
        return b * 2

    return func


def same_bits(got: np.ndarray, expected: np.ndarray) -> None:
    """Equal bit for bit: dtype, shape and bytes."""
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(expected).tobytes()


# -- clusters ---------------------------------------------------------------------------
CLUSTER_KW: dict[str, Any] = dict(dashboard_address=None, worker_dashboard_address=None)

# What the GPU tests run under: the cuda backend with small, bounded pools.
GPU_POOL = 64 * 2**20
GPU_CONFIG = {
    "overlap.backend": "cuda",
    "overlap.pinned-pool-size": GPU_POOL,
    "overlap.device-pool-size": "4GiB",
    "overlap.sub-chunk-bytes": "256KiB",
    # The tests' arrays are small: through the ring all the same (test_cuda tests the
    # direct path on its own).
    "overlap.direct-bytes": 0,
}

# The plugin options cluster tests start from, by backend: small bounded pools, and the
# tests' small arrays through the ring all the same (direct_bytes=0).
PLUGIN_OPTIONS: dict[str, dict[str, Any]] = {
    "host": dict(backend="host", pinned_pool_size=2**20, in_flight=2, streams=2, direct_bytes=0),
    "cuda": dict(
        backend="cuda",
        pinned_pool_size=GPU_POOL,
        device_pool_size="4GiB",
        in_flight=3,
        direct_bytes=0,
    ),
}


def compute_on_two_worker_processes(collection: Any) -> tuple[Any, dict[str, dict]]:
    """``collection`` computed on a real ``LocalCluster`` of two worker processes of two
    threads each, and each worker's runtime stats afterwards (by worker address)."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            processes=True,
            n_workers=2,
            threads_per_worker=2,
            dashboard_address=":0",
            worker_dashboard_address=":0",
        ) as cluster,
        Client(cluster) as client,
    ):
        got = collection.compute()
        return got, client.run(dask_overlap.runtime_stats)


def plugin(backend: str = "host", **options: Any) -> OverlapPlugin:
    """A plugin of :data:`PLUGIN_OPTIONS` for ``backend``, with ``options`` changed."""
    return OverlapPlugin(**{**PLUGIN_OPTIONS[backend], **options})


def kill_a_busy_worker(client: Any, future: Any) -> str:
    """SIGKILL a worker that holds finished partitions of ``future``'s computation.

    Waits until a worker's runtime has run two partitions (their results are lost with
    it), checks the computation is still running, kills the process by its PID and waits
    until the scheduler has seen it go. Returns the victim's address.
    """
    pids = client.run(os.getpid)
    victim = poll(
        lambda: next(
            (w for w, s in client.run(dask_overlap.runtime_stats).items() if s["partitions"] >= 2),
            None,
        ),
        what="a worker with two partitions done",
    )
    assert not future.done()
    os.kill(pids[victim], signal.SIGKILL)
    poll(lambda: victim not in client.scheduler_info()["workers"], 60, what="the worker gone")
    return victim


def require_gpu() -> Any:
    """CuPy, or skip the caller: no CuPy, no RMM or no visible CUDA GPU."""
    import pytest

    cp = pytest.importorskip("cupy")
    pytest.importorskip("rmm")
    if not cp.cuda.is_available():
        pytest.skip("no CUDA GPU is visible", allow_module_level=True)
    return cp


def task_prefixes(collection: Any) -> Counter:
    """How many tasks of each name prefix (``"overlap-unbatch"`` of
    ``("overlap-unbatch-<token>", 3)``) the optimized graph of ``collection`` has."""
    (opt,) = dask.optimize(collection)
    keys = [k for k in dict(opt.__dask_graph__()) if isinstance(k, tuple)]
    return Counter(k[0].rsplit("-", 1)[0] for k in keys)


#: Distributed's own log records, at a cluster's close on a busy machine, that are not the
#: example's: a worker whose last heartbeat met a scheduler already closing.
_SHUTDOWN_NOISE = ("Failed to communicate with scheduler during heartbeat",)


def without_shutdown_noise(stderr: str) -> str:
    """``stderr`` without distributed's log records of :data:`_SHUTDOWN_NOISE` (each with
    the traceback that follows it, up to the next record)."""
    kept, skipping = [], False
    for line in stderr.splitlines(keepends=True):
        if re.match(r"\d{4}-\d\d-\d\d ", line):  # a new log record
            skipping = any(n in line for n in _SHUTDOWN_NOISE)
        if not skipping:
            kept.append(line)
    return "".join(kept)
