"""What the assembly line reports: fine performance metrics, heartbeats, Prometheus, NVTX.

Four outlets, one source (the runtime's counters and its timeline of stage spans):

- **Fine performance metrics** of every partition task, through
  ``distributed.metrics.context_meter``. A :class:`TaskMeter` gathers them while the
  partition runs and digests them when it ends, in the task's own thread: the meter is a
  ``ContextVar``, so a metric digested on a staging or stream thread would be lost. Labels
  (the *activity* of Dask's page ``/individual-fine-performance-metrics``, under the task's
  prefix and inside ``dask.distributed.span`` blocks) are ``overlap-<stage>`` with the unit
  saying what was measured:

  ==========================  ===============================================================
  unit                        meaning
  ==========================  ===============================================================
  ``seconds``                 the task's thread blocked waiting for that stage (part of the
                              task's wall time, so Dask subtracts it from ``thread-noncpu``);
                              ``overlap-backpressure`` is the wait for a free window slot
  ``gpu-seconds``             busy time of the stage on the streams (``stream-seconds`` on
                              the host and timed backends); it overlaps the host's time, so
                              it has its own unit
  ``bytes``                   bytes staged, copied in (``overlap-h2d``), copied out
  ``count``                   ``overlap-pinned-fallback``: buffers that fell back to
                              ordinary memory because the pinned pool was exhausted
  ==========================  ===============================================================

- **Heartbeat metrics**: :func:`install_worker_metrics` puts :func:`worker_metrics` in
  ``Worker.metrics["overlap"]``, so each heartbeat carries them to the scheduler
  (``WorkerState.metrics["overlap"]``), and adds the worker handler
  ``overlap_snapshot`` that the dashboard calls for the recent timeline.
- **Prometheus**: one collector per process adds ``dask_overlap_*`` series to the
  worker's ``/metrics``.
- **NVTX**: :func:`nvtx_range` names ranges after the Dask key and sub-chunk on the CUDA
  backend, so an Nsight timeline lines up with Dask's task stream.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from .process import Registry

if TYPE_CHECKING:
    from distributed import Worker

    from .runtime import Runtime, Span

__all__ = [
    "METRICS_NAME",
    "SNAPSHOT_HANDLER",
    "TaskMeter",
    "busy_unit",
    "install_worker_metrics",
    "nvtx_range",
    "snapshot",
    "uninstall_worker_metrics",
    "worker_metrics",
]

#: Key of the heartbeat entry (``Worker.metrics`` and ``WorkerState.metrics``).
METRICS_NAME = "overlap"
#: Worker handler that answers :func:`snapshot` (metrics plus the recent timeline).
SNAPSHOT_HANDLER = "overlap_snapshot"
#: Seconds of timeline behind the recent rates and the overlap efficiency.
RATE_WINDOW = 2.0
#: At most this many spans per worker in a snapshot (the newest).
TIMELINE_LIMIT = 1500

# Stage names as the runtime's timeline writes them, and as metric labels show them.
STAGES = ("stage", "h2d", "compute", "d2h", "unstage")
_LABEL = {
    "stage": "staging",
    "h2d": "h2d",
    "compute": "compute",
    "d2h": "d2h",
    "unstage": "unstaging",
}


def busy_unit(backend: str) -> str:
    """The unit of stream busy time for ``backend``: never ``seconds`` (see module doc).

    Examples
    --------
    >>> busy_unit("cuda"), busy_unit("host")
    ('gpu-seconds', 'stream-seconds')
    """
    return "gpu-seconds" if backend == "cuda" else "stream-seconds"


def label(stage: str) -> str:
    """The metric label of a stage (``"h2d"`` -> ``"overlap-h2d"``)."""
    return f"overlap-{_LABEL.get(stage, stage)}"


# -- fine performance metrics -----------------------------------------------------------
class TaskMeter:
    """The fine performance metrics of one partition task.

    The partition's driver loop (the task's thread) reports each wait and each finished
    sub-chunk's spans; staging threads may report fallbacks. :meth:`task` digests the
    totals through ``context_meter`` when the partition ends, in the task's thread, and
    opens an NVTX range for the partition meanwhile.

    Parameters
    ----------
    key
        The partition's Dask key.
    backend
        Name of the runtime's backend (``"cuda"``, ``"host"``, ``"timed"``).

    Examples
    --------
    >>> m = TaskMeter(("x", 0), "host")
    >>> m.waited("h2d", 0.5, blocked=False)
    >>> m.spans([("h2d", 1.0, 1.25, 100), ("d2h", 1.25, 1.5, 80)])
    >>> sorted(m.metrics())[:3]  # doctest: +NORMALIZE_WHITESPACE
    [('overlap-d2h', 'bytes', 80), ('overlap-d2h', 'stream-seconds', 0.25),
     ('overlap-h2d', 'bytes', 100)]
    """

    def __init__(self, key: Any, backend: str):
        self.key = key
        self.backend = backend
        self.blocked: dict[str, float] = {}
        self.busy: dict[str, float] = {}
        self.nbytes: dict[str, int] = {}
        self.backpressure = 0.0
        self._fallbacks = 0

    def waited(self, stage: Any, seconds: float, blocked: bool) -> None:
        """The task's thread waited ``seconds`` for ``stage`` (or, ``blocked``, for a slot)."""
        if blocked:
            self.backpressure += seconds
            return
        name = getattr(stage, "name", stage)
        name = str(name).lower()
        self.blocked[name] = self.blocked.get(name, 0.0) + seconds

    def spans(self, spans: Iterable[tuple[str, float, float, int]]) -> None:
        """One sub-chunk's completed stage spans: ``(stage, start, end, nbytes)``."""
        for stage, start, end, n in spans:
            self.busy[stage] = self.busy.get(stage, 0.0) + max(0.0, end - start)
            self.nbytes[stage] = self.nbytes.get(stage, 0) + n

    def fallback(self, n: int = 1) -> None:
        """``n`` buffers fell back to ordinary memory."""
        self._fallbacks += n

    def metrics(self) -> list[tuple[str, str, float]]:
        """``(label, unit, value)`` of every non-zero metric so far."""
        unit = busy_unit(self.backend)
        out: list[tuple[str, str, float]] = []
        for stage, s in self.blocked.items():
            out.append((label(stage), "seconds", s))
        if self.backpressure:
            out.append(("overlap-backpressure", "seconds", self.backpressure))
        for stage, s in self.busy.items():
            out.append((label(stage), unit, s))
        for stage, n in self.nbytes.items():
            if n and stage != "compute":  # bytes moved, not bytes a kernel read
                out.append((label(stage), "bytes", n))
        if self._fallbacks:
            out.append(("overlap-pinned-fallback", "count", self._fallbacks))
        return [m for m in out if m[2]]

    def digest(self) -> None:
        """Hand the metrics to ``context_meter``; call it in the task's own thread."""
        # Without distributed loaded there is no listener (the threaded scheduler), and
        # importing it here would configure its logging.
        if "distributed.metrics" not in sys.modules:
            return
        from distributed.metrics import context_meter

        listeners = getattr(context_meter, "_callbacks", None)  # a ContextVar of a dict
        if listeners is not None and not listeners.get():
            return  # nobody listens here (not in a worker's task): spare building them
        for lab, unit, value in self.metrics():
            context_meter.digest_metric(lab, value, unit)

    @contextlib.contextmanager
    def task(self) -> Iterator[TaskMeter]:
        """Around a partition's driver loop: an NVTX range, then :meth:`digest`, in this
        thread (``context_meter`` is a ContextVar)."""
        try:
            with nvtx_range(self.backend, self.key):
                yield self
        finally:
            self.digest()


# -- NVTX -------------------------------------------------------------------------------
_COLORS = {  # ARGB, as the task stream and the dashboard colour the stages
    None: 0xFF7F7F7F,
    "stage": 0xFFBDBDBD,
    "h2d": 0xFF1F77B4,
    "compute": 0xFF2CA02C,
    "d2h": 0xFFFF7F0E,
    "unstage": 0xFF9E9E9E,
}


@functools.cache
def _nvtx() -> tuple[Callable[[str, int], Any], Callable[[], Any]] | None:
    """Push and pop functions of ``nvtx`` or ``cupy.cuda.nvtx``; ``None`` if neither works."""
    try:
        import nvtx  # type: ignore[import-not-found]

        def push(message: str, color: int) -> None:
            nvtx.push_range(message, color=color & 0xFFFFFF, domain="dask_overlap")

        return push, functools.partial(nvtx.pop_range, domain="dask_overlap")
    except Exception:
        pass
    try:
        from cupy.cuda import nvtx as cupy_nvtx  # type: ignore[import-not-found]

        if not getattr(cupy_nvtx, "available", True):
            return None

        def cupy_push(message: str, color: int) -> None:
            # CuPy 14's RangePush takes no colour keyword (seen on the H200): RangePushC
            # takes an ARGB colour; plain RangePush is the fallback.
            try:
                cupy_nvtx.RangePushC(message, color)
            except (AttributeError, TypeError):
                cupy_nvtx.RangePush(message)

        return cupy_push, cupy_nvtx.RangePop
    except Exception:
        return None


#: Set in a process that Nsight Systems or Nsight Compute runs (their injection libraries).
PROFILER_VARIABLES = ("NVTX_INJECTION64_PATH", "CUDA_INJECTION64_PATH")


@functools.cache
def _profiled() -> bool:
    """Whether a profiler is attached: without one an NVTX range does nothing, but its
    name would still be formatted, per partition and per sub-chunk."""
    return any(os.environ.get(v) for v in PROFILER_VARIABLES)


def nvtx_range(
    backend: str, key: Any, sub_chunk: int | None = None, stage: str | None = None
) -> contextlib.AbstractContextManager[None]:
    """An NVTX range named after the Dask ``key`` (and ``sub_chunk`` and ``stage``).

    Only on the ``cuda`` backend, only under a profiler (:data:`PROFILER_VARIABLES`), and
    only where ``nvtx`` or ``cupy.cuda.nvtx`` imports; a no-op otherwise. The range is
    pushed and popped on the calling thread, around the host calls that enqueue the work,
    so Nsight projects it onto the stream's GPU work.

    Examples
    --------
    >>> with nvtx_range("host", ("x", 0), 3, "h2d"):  # no-op off the cuda backend
    ...     pass
    """
    if backend != "cuda" or not _profiled() or _nvtx() is None:
        return _NO_RANGE  # as cheap as a context manager gets: called per sub-chunk
    return _range(key, sub_chunk, stage)


_NO_RANGE = contextlib.nullcontext()


@contextlib.contextmanager
def _range(key: Any, sub_chunk: int | None, stage: str | None) -> Iterator[None]:
    fns = _nvtx()
    name = str(key) if sub_chunk is None else f"{key} #{sub_chunk} {stage}"
    fns[0](name, _COLORS.get(stage, _COLORS[None]))
    try:
        yield
    finally:
        fns[1]()


# -- worker metrics: heartbeat, snapshot, Prometheus -------------------------------------
def _recent(spans: list[Span], now: float, window: float) -> list[Span]:
    """The spans that ended within ``window`` seconds of ``now`` (newest last)."""
    cutoff = now - window
    out = []
    for s in reversed(spans):
        if s.end >= cutoff:
            out.append(s)
        elif s.end < cutoff - 2 * window:
            break  # the timeline is in completion order: older ones will not qualify
    out.reverse()
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def worker_metrics(rt: Runtime, now: float | None = None) -> dict[str, Any]:
    """The runtime's heartbeat metrics: counters, pools, recent rates, overlap.

    Keys: everything :meth:`Runtime.stats` gives, plus ``device_pool_size``,
    ``window_capacity`` (the sub-chunks the running partitions' windows admit, or the
    ``in_flight`` option when none runs), ``h2d_bytes_per_second`` and
    ``d2h_bytes_per_second`` (over the last ``RATE_WINDOW`` seconds of the timeline),
    ``overlap_efficiency`` (stage busy time over the wall time in which any stage was
    busy, same window: 1 when the stages run one at a time, about 3 when copy-in, kernel
    and copy-out all overlap), ``busy_unit`` and ``time``.

    Examples
    --------
    >>> from dask_overlap import get_runtime
    >>> worker_metrics(get_runtime("host"))["overlap_efficiency"]
    0.0
    """
    now = time.time() if now is None else now
    out = rt.stats()
    spans = _recent(list(rt.timeline), now, RATE_WINDOW)
    moved = {"h2d": 0, "d2h": 0}
    busy = 0.0
    for s in spans:
        if s.stage in moved:
            moved[s.stage] += s.nbytes
        busy += max(0.0, s.end - s.start)
    wall = _union([(max(s.start, now - RATE_WINDOW), s.end) for s in spans])
    out.update(
        device_pool_size=rt.options.device_pool_size,
        window_capacity=out["window_capacity"] or rt.options.in_flight,
        h2d_bytes_per_second=moved["h2d"] / RATE_WINDOW,
        d2h_bytes_per_second=moved["d2h"] / RATE_WINDOW,
        overlap_efficiency=(busy / wall) if wall > 0 else 0.0,
        busy_unit=busy_unit(rt.name),
        time=now,
    )
    out["busy_seconds"] = {k: float(v) for k, v in out["busy_seconds"].items()}
    return out


def snapshot(
    rt: Runtime, window: float = 10.0, limit: int = TIMELINE_LIMIT, now: float | None = None
) -> dict[str, Any]:
    """:func:`worker_metrics` plus the recent timeline, as columns (small enough to poll).

    ``timeline`` holds the newest ``limit`` spans that ended in the last ``window``
    seconds: ``key`` (the Dask key as a string), ``sub_chunk``, ``stream`` (``-1`` for
    the staging threads), ``stage``, ``start``, ``end`` (``time.time()`` seconds) and
    ``nbytes``.
    """
    now = time.time() if now is None else now
    out = worker_metrics(rt, now)
    spans = _recent(list(rt.timeline), now, window)[-limit:] if limit > 0 else []
    out["timeline"] = {
        "key": [str(s.key) for s in spans],
        "sub_chunk": [s.sub_chunk for s in spans],
        "stream": [s.stream for s in spans],
        "stage": [s.stage for s in spans],
        "start": [s.start for s in spans],
        "end": [s.end for s in spans],
        "nbytes": [s.nbytes for s in spans],
    }
    return out


# Workers of this process that carry metrics, by id: (weak reference, runtime).
# The runtime whose metrics each worker reports, by id(worker) (see dask_overlap.process).
_installed: Registry[int, tuple[weakref.ref, Runtime]] = Registry(
    "runtimes whose metrics workers report, by id(worker)"
)
_collector: Any = None


def install_worker_metrics(worker: Worker, rt: Runtime) -> None:
    """Report ``rt`` through ``worker``: heartbeat entry, snapshot handler, Prometheus.

    Called by :class:`~dask_overlap.OverlapPlugin` in ``setup``; undone by
    :func:`uninstall_worker_metrics`.
    """
    worker.metrics[METRICS_NAME] = lambda _worker: worker_metrics(rt)

    def handler(window: float = 10.0, limit: int = TIMELINE_LIMIT) -> dict[str, Any]:
        return snapshot(rt, float(window), int(limit))

    worker.handlers[SNAPSHOT_HANDLER] = handler
    with _installed.lock:
        _installed.items[id(worker)] = (weakref.ref(worker), rt)
    _register_collector()


def uninstall_worker_metrics(worker: Worker) -> None:
    """Undo :func:`install_worker_metrics` (the Prometheus collector stays, reporting none)."""
    worker.metrics.pop(METRICS_NAME, None)
    worker.handlers.pop(SNAPSHOT_HANDLER, None)
    with _installed.lock:
        _installed.items.pop(id(worker), None)


def _live_workers() -> list[tuple[str, Runtime]]:
    with _installed.lock:
        items = list(_installed.items.items())
    out = []
    for _, (ref, rt) in items:
        worker = ref()
        if worker is not None and not rt.closed:
            out.append((str(getattr(worker, "address", None) or id(worker)), rt))
    return out


class _Collector:
    """``dask_overlap_*`` series of every worker of this process that carries metrics."""

    def describe(self) -> list:
        return []  # no duplicate check at registration, and no collect() then

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p = "dask_overlap_"
        counters = {
            "partitions": ("Partition tasks run", "partitions"),
            "partitions_failed": ("Partition tasks that failed", "partitions_failed"),
            "sub_chunks": ("Sub-chunks run", "sub_chunks"),
            "pinned_fallbacks": (
                "Buffers that fell back to ordinary memory (pinned pool exhausted)",
                "pinned_fallbacks",
            ),
            "backpressure_seconds": (
                "Seconds partition tasks waited for a free slot of their window",
                "backpressure_seconds",
            ),
        }
        gauges = {
            "partitions_active": "Partition tasks running now",
            "in_flight": "Sub-chunks in flight now",
            "window_capacity": "Sub-chunks the running partitions' windows admit",
            "pinned_bytes_in_use": "Bytes of the pinned host pool in use",
            "pinned_pool_size": "Bound of the pinned host pool, bytes",
            "device_bytes_in_use": "Device bytes in use",
            "device_pool_size": "Bound of the device pool, bytes",
            "overlap_efficiency": "Stage busy time over busy wall time, recent",
        }
        fams = {
            k: CounterMetricFamily(p + k, doc, labels=["worker"])
            for k, (doc, _) in counters.items()
        }
        fams.update(
            {k: GaugeMetricFamily(p + k, doc, labels=["worker"]) for k, doc in gauges.items()}
        )
        moved = CounterMetricFamily(
            p + "bytes", "Bytes moved, by direction", labels=["worker", "direction"]
        )
        rate = GaugeMetricFamily(
            p + "throughput_bytes_per_second",
            "Recent copy throughput, by direction",
            labels=["worker", "direction"],
        )
        busy = CounterMetricFamily(
            p + "busy_seconds", "Busy time of each stage", labels=["worker", "stage"]
        )
        for address, rt in _live_workers():
            try:
                m = worker_metrics(rt)
            except Exception:  # a runtime closing under us: skip it this scrape
                continue
            for k, (_, field) in counters.items():
                fams[k].add_metric([address], m[field])
            for k in gauges:
                fams[k].add_metric([address], m[k])
            for d in ("staged", "h2d", "d2h", "unstaged"):
                moved.add_metric([address, d], m[f"bytes_{d}"])
            rate.add_metric([address, "h2d"], m["h2d_bytes_per_second"])
            rate.add_metric([address, "d2h"], m["d2h_bytes_per_second"])
            for stage, s in m["busy_seconds"].items():
                busy.add_metric([address, stage], s)
        yield from fams.values()
        yield from (moved, rate, busy)


def _register_collector() -> None:
    """Register the collector with the process-wide registry, once."""
    global _collector
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # prometheus_client is optional (the dashboard extra)
        return
    with _installed.lock:
        if _collector is not None:
            return
        _collector = _Collector()
    REGISTRY.register(_collector)
