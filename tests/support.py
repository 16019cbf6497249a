"""Helpers shared by the test modules (imported as ``support``: tests/ is on sys.path)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any


def poll(condition: Callable[[], Any], timeout: float = 20.0) -> Any:
    """``condition()`` once it is truthy; fail after ``timeout`` s (a bound, not a timing)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.05)


def require_gpu() -> Any:
    """CuPy, or skip the calling module: no CuPy, no RMM or no visible CUDA GPU."""
    import pytest

    cp = pytest.importorskip("cupy")
    pytest.importorskip("rmm")
    if not cp.cuda.is_available():
        pytest.skip("no CUDA GPU is visible", allow_module_level=True)
    return cp


def kill_a_busy_worker(client: Any, future: Any) -> str:
    """SIGKILL a worker that holds finished partitions of ``future``'s computation.

    Waits until a worker's runtime has run two partitions (their results are lost with
    it), checks the computation is still running, kills the process by its PID and waits
    until the scheduler has seen it go. Returns the victim's address.
    """
    from dask_overlap import runtime_stats

    pids = client.run(os.getpid)
    victim = poll(
        lambda: next(
            (w for w, s in client.run(runtime_stats).items() if s["partitions"] >= 2), None
        )
    )
    assert not future.done()
    os.kill(pids[victim], signal.SIGKILL)
    poll(lambda: victim not in client.scheduler_info()["workers"], timeout=60)
    return victim


# What the GPU test modules run under: the cuda backend with small, bounded pools.
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
