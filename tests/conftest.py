"""Shared fixtures: every test gets a runtime built from its own ``dask.config``."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any

import dask
import pytest

import dask_overlap


@pytest.fixture(autouse=True)
def fresh_runtime() -> Iterator[None]:
    """Close this process's runtimes around each test.

    A runtime reads ``overlap.*`` once, when it is built on first use; closing them
    makes the next partition task build one from the config the test has set. The
    threaded scheduler is the default here; tests that want a cluster start their own.
    """
    dask_overlap.close_runtimes()
    with dask.config.set(scheduler="threads"):
        yield
    dask_overlap.close_runtimes()


def wait_until_idle(timeout: float = 10.0) -> dict[str, Any]:
    """Wait (bounded) until no partition task of this process is running; return the stats.

    Dask raises a task's exception as soon as it arrives, while other partitions of the
    same graph may still be running; they finish on their own.
    """
    deadline = time.monotonic() + timeout
    while True:
        stats = dask_overlap.runtime_stats()
        if stats["partitions_active"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"partitions still active after {timeout} s: {stats}")
        time.sleep(0.01)


def pinned_in_use_after_gc() -> int:
    """Pinned bytes still held once unreachable cycles are gone.

    The threaded scheduler keeps finished partitions' results in frames that a raised
    exception's traceback refers to (a reference cycle in Dask, not in this package), so
    the pool's blocks come back at the next garbage collection rather than at once.
    """
    gc.collect()
    return dask_overlap.runtime_stats()["pinned_bytes_in_use"]
