"""Shared fixtures: every test gets a runtime built from its own ``dask.config``; tests
marked ``gpu`` are skipped where no CUDA GPU is visible (``pytest -m gpu`` on the device)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Iterator
from typing import Any

import dask
import pytest

# Helpers live in support.py; these two are still imported from here by other modules.
from support import pinned_in_use_once_collected, wait_until_idle  # noqa: F401

import dask_overlap
from dask_overlap import backends


@functools.cache
def _why_no_gpu() -> str | None:
    """Why the ``gpu`` tests cannot run here, or ``None`` when they can."""
    for module in ("cupy", "rmm"):
        if importlib.util.find_spec(module) is None:
            return f"needs {module} (the cuda12 or cuda13 extra)"
    import cupy

    return None if cupy.cuda.is_available() else "no CUDA GPU is visible"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Collect every ``gpu`` test, and skip it where there is no GPU to run it on."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    reason = _why_no_gpu() if gpu_items else None
    if reason is not None:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def ring_only() -> Iterator[None]:
    """Every sub-chunk through the pinned ring, however small (``direct-bytes: 0``): for
    tests of the ring that use tiny arrays, which would otherwise skip it."""
    with dask.config.set({"overlap.direct-bytes": 0}):
        yield


@pytest.fixture
def as_on_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``batch="auto"``, ``sub-chunk-bytes: auto`` and the fusion of a store as they are
    where a device runs the partitions, on the host backend: small blocks joined,
    partitions cut, stores taken in. For tests of the joining, the cutting and the fused
    stores, which run on the host backend here, where none is done.

    The graph is built in this process (its placement is a device's, whatever runs the
    partitions); the cut applies to partitions that run in this process too (the threaded
    scheduler): a cluster of worker processes cuts as the host backend does.
    """
    import dask_overlap.graph.map_blocks as map_blocks_module
    import dask_overlap.graph.steps as steps_module
    import dask_overlap.pipeline.partition as partition_module

    placement = map_blocks_module.placement

    def on_a_device(backend: str) -> Any:
        return dataclasses.replace(placement(backend), backends=frozenset({"cuda"}))

    monkeypatch.setattr(map_blocks_module, "placement", on_a_device)
    monkeypatch.setattr(steps_module, "placement", on_a_device)
    monkeypatch.setattr(partition_module, "AUTO_CUTS_HOST_MEMORY", True)


@pytest.fixture(autouse=True)
def fresh_runtime(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Close this process's runtimes around each test.

    A runtime reads ``overlap.*`` once, when it is built on first use; closing them
    makes the next partition task build one from the config the test has set. The
    threaded scheduler is the default here; tests that want a cluster start their own.

    A test not marked ``gpu`` is a test of a machine with no GPU (``backend: auto`` is the
    host backend there, ``LocalGPUCluster(allow_cpu=True)`` starts CPU workers): where a
    GPU is visible it is shown none, in this process (:func:`.backends.gpu_available`)
    and in the processes it starts (``CUDA_VISIBLE_DEVICES`` empty), so that the README's
    test command passes on a GPU machine too.
    """
    if request.node.get_closest_marker("gpu") is None and _why_no_gpu() is None:
        monkeypatch.setattr(backends, "gpu_available", lambda: False)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    dask_overlap.close_runtimes()
    with dask.config.set(scheduler="threads"):
        yield
    dask_overlap.close_runtimes()
