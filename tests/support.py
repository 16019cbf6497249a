"""Helpers shared by the test modules (imported as ``support``: tests/ is on sys.path)."""

from __future__ import annotations

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


# What the GPU test modules run under: the cuda backend with small, bounded pools.
GPU_POOL = 64 * 2**20
GPU_CONFIG = {
    "overlap.backend": "cuda",
    "overlap.pinned-pool-size": GPU_POOL,
    "overlap.device-pool-size": "4GiB",
    "overlap.sub-chunk-bytes": "256KiB",
}
