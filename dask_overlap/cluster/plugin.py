"""The worker plugin: each distributed worker's runtime, built in ``setup``, closed in ``teardown``.

A partition task finds its worker's runtime through :func:`worker_runtime`, which the
plugin hands :func:`~dask_overlap.get_runtime` in ``setup``
(:func:`dask_overlap.pipeline.current.serve_worker_runtimes`), so every partition a
worker runs shares that worker's streams and pools, and the pools' bounds hold for the
whole worker. Where there is no distributed worker (the threaded scheduler) tasks use the
per-process runtime instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any

from distributed import WorkerPlugin
from distributed.worker import get_worker

from ..config import Options
from ..metrics.worker import install_worker_metrics, uninstall_worker_metrics
from ..pipeline.current import serve_worker_runtimes
from ..pipeline.runtime import Runtime
from ..process import Registry
from .ucx import device_memory_resource

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["OverlapPlugin", "resolve_options", "worker_runtime"]

# The runtimes that plugins built in this process, by worker address: one per worker,
# since a worker holds at most one plugin of a given name; a process may run several
# workers (see dask_overlap.process).
_live: Registry[str, Runtime] = Registry("worker plugins' runtimes, by worker address")
# Workers whose plugin's runtime is being torn down or set up now, by address (how many
# of the two are under way): a partition task there waits for the new runtime rather than
# falling back to a per-process one, which a re-registration's gap between the two once
# built from the worker's own configuration (pools outside the plugin's bounds, never
# closed, seen by no runtime_stats).
_swapping: Registry[str, int] = Registry("workers whose plugin's runtime is being swapped")

#: The longest a partition task waits for its worker's runtime to be set up again.
SWAP_WAIT_SECONDS = 60.0
_SWAP_POLL_SECONDS = 0.01


def _swap(address: str, by: int) -> None:
    with _swapping.lock:
        n = _swapping.items.get(address, 0) + by
        if n > 0:
            _swapping.items[address] = n
        else:
            _swapping.items.pop(address, None)


def _plugin_runtime_of(address: str) -> Runtime | None:
    """The runtime of the worker at ``address``, waiting (up to ``SWAP_WAIT_SECONDS``)
    while its plugin's runtime is being swapped."""
    deadline = None  # (a partition's lookup: no clock read unless it must wait)
    while True:
        with _live.lock:
            rt = _live.items.get(address)
        if (rt is not None and not rt.closed) or address not in _swapping.items:
            return rt
        if deadline is None:
            deadline = time.monotonic() + SWAP_WAIT_SECONDS
        elif time.monotonic() > deadline:
            return rt
        time.sleep(_SWAP_POLL_SECONDS)


def resolve_options(options: Options | None = None, **overrides: Any) -> Options:
    """``options`` (or ``Options.from_config()``) with non-``None`` ``overrides`` applied.

    Every value is validated by :meth:`Options.from_config`, so the plugin, the cluster
    and the CLI resolve options the same way and fail on the client, before any worker
    starts.

    Examples
    --------
    >>> resolve_options(in_flight=2).in_flight
    2
    >>> resolve_options(resolve_options(backend="host"), streams=3).backend
    'host'
    """
    if not isinstance(options, Options | None):
        raise TypeError(f"options must be a dask_overlap.Options, got {type(options).__name__}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if "fuse" in given:
        raise ValueError(
            "fuse is read where a graph is optimized, in the client's process, not by a "
            "worker: set overlap.fuse there (dask.config.set({'overlap.fuse': False})); "
            f"got fuse={given['fuse']!r} for the workers"
        )
    if options is None:
        return Options.from_config(**given)
    if not given:
        return options
    values = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    return Options.from_config(**{**values, **given})


def _serves(rt: Runtime, backend: str | None) -> bool:
    return backend in (None, "auto", rt.options.backend, rt.name)


def worker_runtime(backend: str | None = None) -> Runtime | None:
    """The runtime an :class:`OverlapPlugin` built for the current worker, if it serves ``backend``.

    Inside a task, the runtime of the worker running it. Outside a task (``client.run``,
    a thread a task started) the runtime of this process's only plugin-bearing worker.
    ``None`` when there is none, or when ``backend`` names a backend other than the
    plugin's (``None`` and ``"auto"`` accept the plugin's backend).

    Examples
    --------
    >>> worker_runtime() is None  # no distributed worker here
    True
    """
    try:
        worker = get_worker()
    except ValueError:
        worker = None
    if worker is not None:
        rt = _plugin_runtime_of(worker.address)
    else:
        with _live.lock:
            rt = next(iter(_live.items.values())) if len(_live.items) == 1 else None
    if rt is None or rt.closed or not _serves(rt, backend):
        return None
    return rt


class OverlapPlugin(WorkerPlugin):
    """Gives each worker its own runtime: streams, pinned and device pools, staging threads.

    The options are resolved and validated here, on the client, and travel with the
    plugin, so every worker gets the same ones whatever its own configuration says. The
    runtime is built in :meth:`setup` (off the worker's event loop, since allocating
    pinned memory can take seconds) and closed in :meth:`teardown`, when the plugin is
    unregistered or the worker closes. Partition tasks whose backend is ``"auto"`` or the
    plugin's use it; others fall back to the per-process runtime.

    Parameters
    ----------
    options
        Resolved options; ``Options.from_config()`` when omitted.
    **overrides
        Option values (the fields of :class:`~dask_overlap.Options`) that override
        ``options`` or the configuration.

    Examples
    --------
    >>> from dask_overlap import OverlapPlugin
    >>> plugin = OverlapPlugin(backend="host", in_flight=2)
    >>> plugin.options.in_flight
    2
    >>> client.register_plugin(plugin)  # doctest: +SKIP
    """

    name = "overlap"

    def __init__(self, options: Options | None = None, **overrides: Any):
        self.options = resolve_options(options, **overrides)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.options.backend!r})"

    async def setup(self, worker: Worker) -> None:
        _swap(worker.address, +1)
        try:
            await self._setup(worker)
        finally:
            _swap(worker.address, -1)

    async def _setup(self, worker: Worker) -> None:
        options = self.options  # "auto" device memory: what this worker's protocol can send
        resource = device_memory_resource(options.device_memory_resource, worker.address)
        if resource != options.device_memory_resource:
            options = dataclasses.replace(options, device_memory_resource=resource)
        # result-pool-size: auto takes a share of this worker's memory limit
        limit = worker.memory_manager.memory_limit
        rt = await asyncio.to_thread(Runtime, options, limit)
        serve_worker_runtimes(worker_runtime)
        with _live.lock:
            old = _live.items.pop(worker.address, None)
            _live.items[worker.address] = rt
        if old is not None:  # pragma: no cover - a worker removes its old plugin first
            await asyncio.to_thread(old.close)
        if rt.name == "cuda":  # CuPy over TCP through its pinned pool (imports CuPy: here)
            from .serialize import register as register_serializers

            register_serializers(rt)
        install_worker_metrics(worker, rt)  # heartbeat entry, dashboard handler, /metrics
        worker.log_event(self.name, {"action": "setup", "backend": rt.name})

    async def teardown(self, worker: Worker) -> None:
        _swap(worker.address, +1)
        try:
            await self._teardown(worker)
        finally:
            # Said done one turn of the event loop later: a re-registration's setup, which
            # follows at once, says it is under way first (no task falls in between).
            asyncio.get_running_loop().call_soon(_swap, worker.address, -1)

    async def _teardown(self, worker: Worker) -> None:
        with _live.lock:
            rt = _live.items.pop(worker.address, None)
        if rt is None:
            return
        uninstall_worker_metrics(worker)
        stats = await asyncio.to_thread(_drain_and_close, rt)
        try:
            worker.log_event(self.name, {"action": "teardown", "closed": rt.closed, **stats})
        except Exception:  # the worker may be closing and its stream to the scheduler gone
            pass

    def runtime(self, worker: Worker) -> Runtime | None:
        """The runtime this plugin built for ``worker`` (``None`` before setup, after teardown)."""
        with _live.lock:
            return _live.items.get(worker.address)


def _drain_and_close(rt: Runtime) -> dict[str, Any]:
    rt.drain()
    stats = rt.stats()  # before close: a closed backend need not answer
    rt.close()
    keys = ("backend", "partitions", "in_flight", "pinned_bytes_in_use", "device_bytes_in_use")
    return {k: stats[k] for k in keys}
