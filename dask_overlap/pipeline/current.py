"""Which runtime serves the calling code: its worker's, else this process's own.

On a distributed worker with an :class:`~dask_overlap.OverlapPlugin`, partition tasks
share the runtime the plugin built in ``setup``; everywhere else (the threaded or the
synchronous scheduler, a plain worker) they share this process's own runtime of their
backend (:func:`dask_overlap.pipeline.runtime.process_runtime`).

The pipeline knows nothing of distributed's workers: the plugin hands this module its
lookup (:func:`serve_worker_runtimes`) when it sets a worker up, so where no plugin ever
ran a partition task asks nothing more than this process's own runtimes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..backends import resolve_backend
from ..config import Options
from .runtime import Runtime, idle_stats, process_runtime, process_runtimes

__all__ = ["get_runtime", "runtime_backend", "runtime_stats", "serve_worker_runtimes"]

#: The plugin's lookup of the current worker's runtime for a backend (``None`` where it has
#: none to offer), once a plugin has set a worker up in this process.
WorkerLookup = Callable[[str | None], Runtime | None]
_worker_lookup: WorkerLookup | None = None


def serve_worker_runtimes(lookup: WorkerLookup) -> None:
    """Ask ``lookup`` first for the runtime of a task (the worker plugin's, from its setup)."""
    global _worker_lookup
    _worker_lookup = lookup


def _plugin_runtime(backend: str | None) -> Runtime | None:
    lookup = _worker_lookup
    return None if lookup is None else lookup(backend)


def get_runtime(backend: str | None = None) -> Runtime:
    """This process's runtime for ``backend`` (default: ``overlap.backend``), made on first use.

    On a distributed worker with an :class:`~dask_overlap.OverlapPlugin`, the plugin's
    runtime instead, when ``backend`` is ``None``, ``"auto"`` or the plugin's backend.

    Examples
    --------
    >>> import dask_overlap
    >>> dask_overlap.get_runtime("host").name
    'host'
    """
    rt = _plugin_runtime(backend)
    if rt is not None:
        return rt
    return process_runtime(backend if backend is not None else Options.from_config().backend)


def runtime_backend(backend: str | None = None) -> str:
    """The backend that :func:`get_runtime` would serve ``backend`` with in this process
    (the plugin's, or ``backend`` resolved), without building a runtime.

    Examples
    --------
    >>> runtime_backend("host")
    'host'
    """
    rt = _plugin_runtime(backend)
    if rt is not None:
        return rt.name
    return resolve_backend(backend if backend is not None else Options.from_config().backend)


def runtime_stats(backend: str | None = None) -> dict[str, Any]:
    """Counters and pool occupancy of this process's runtime.

    With no argument: the runtime of ``overlap.backend`` if it exists, else the only one
    that exists. Includes ``backend``, ``partitions``, ``sub_chunks``, ``bytes_staged``,
    ``bytes_h2d``, ``bytes_d2h``, ``bytes_unstaged``, ``in_flight``,
    ``pinned_bytes_in_use``, ``pinned_bytes_held`` (pinned results), ``ring_waits``,
    ``device_bytes_in_use``, ``pinned_fallbacks``, ``pinned_refused`` (of those fallbacks,
    the blocks the pool's allocator refused although its budget had room: a fixed-size
    pool that is fragmented) and ``backpressure_seconds``. Zeros when
    no runtime exists yet. On a worker with an :class:`~dask_overlap.OverlapPlugin`, the
    plugin's runtime (``client.run(dask_overlap.runtime_stats)`` asks every worker).

    Examples
    --------
    >>> import dask_overlap
    >>> dask_overlap.runtime_stats()["in_flight"]
    0
    """
    plugin_rt = _plugin_runtime(backend)
    if plugin_rt is not None:
        return plugin_rt.stats()
    runtimes = process_runtimes()
    if backend is not None:
        rt = runtimes.get(resolve_backend(backend))
    else:
        configured = Options.from_config().backend
        rt = runtimes.get(configured) if configured != "auto" else None
        if rt is None and len(runtimes) == 1:
            rt = next(iter(runtimes.values()))
        elif rt is None and configured == "auto":
            rt = runtimes.get(resolve_backend("auto"))
    if rt is not None:
        return rt.stats()
    return idle_stats(resolve_backend(backend or Options.from_config().backend))
