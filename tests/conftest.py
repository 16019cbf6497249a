"""Shared fixtures: every test gets a runtime built from its own ``dask.config``."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any

import dask
import pytest

import dask_overlap


@pytest.fixture
def ring_only() -> Iterator[None]:
    """Every sub-chunk through the pinned ring, however small (``direct-bytes: 0``): for
    tests of the ring that use tiny arrays, which would otherwise skip it."""
    with dask.config.set({"overlap.direct-bytes": 0}):
        yield


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


def pinned_in_use_once_collected(timeout: float = 10.0) -> int:
    """Pinned bytes still held once unreachable cycles are gone (bounded wait).

    After a failure, the threaded scheduler's worker threads still hand finished
    partitions' results to a queue that only a reference cycle keeps (in Dask, not in
    this package), so the pool's blocks come back at a garbage collection after those
    threads are done, rather than at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        in_use = dask_overlap.runtime_stats()["pinned_bytes_in_use"]
        if in_use == 0 or time.monotonic() > deadline:
            return in_use
        time.sleep(0.02)
