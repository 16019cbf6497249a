"""What a worker reports about its runtime: the heartbeat entry, the timeline handler and
the Prometheus series.

:func:`install_worker_metrics` puts :func:`heartbeat` in ``Worker.metrics["overlap"]``,
so every heartbeat carries it to the scheduler (``WorkerState.metrics["overlap"]``): the
counters and pools (:func:`~dask_overlap.metrics.summary.worker_metrics`) and a bounded
window of the newest spans (``recent``, packed by
:func:`~dask_overlap.metrics.timeline.pack`). The scheduler's ``/overlap`` page is fed
from these alone.

It also adds the worker handler :data:`TIMELINE_HANDLER`, which answers with every span
of a longer window (:func:`detail`) when someone asks for it explicitly
(``/overlap.json?detail=1``), and reports the runtime to the process's Prometheus
collector (:mod:`dask_overlap.metrics.prometheus`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from . import prometheus, timeline
from .summary import worker_metrics

if TYPE_CHECKING:
    from distributed import Worker

    from ..runtime import Runtime

__all__ = [
    "HEARTBEAT_IDLE_SECONDS",
    "HEARTBEAT_SPAN_LIMIT",
    "HEARTBEAT_SPAN_SECONDS",
    "METRICS_NAME",
    "TIMELINE_HANDLER",
    "TIMELINE_LIMIT",
    "detail",
    "heartbeat",
    "install_worker_metrics",
    "uninstall_worker_metrics",
]

#: Key of the heartbeat entry (``Worker.metrics`` and ``WorkerState.metrics``).
METRICS_NAME = "overlap"
#: Worker handler that answers :func:`detail` (metrics plus every recent span).
TIMELINE_HANDLER = "overlap_timeline"
#: A heartbeat carries the spans that ended in the last this many seconds of activity
#: (before the newest span's end), or of two heartbeat intervals where those are longer:
#: consecutive heartbeats overlap, so a reader that looks once per interval misses none
#: of what they carry...
HEARTBEAT_SPAN_SECONDS = 2.0
#: ...but at most this many (the newest): a heartbeat stays a few tens of KiB...
HEARTBEAT_SPAN_LIMIT = 400
#: ...and only for this many seconds after the newest span ended: a page opened just
#: after a run still shows its end, an idle worker's heartbeats soon carry none.
HEARTBEAT_IDLE_SECONDS = 10.0
#: At most this many spans per worker in a detailed timeline (the newest).
TIMELINE_LIMIT = 1500


def heartbeat(
    rt: Runtime,
    seconds: float = HEARTBEAT_SPAN_SECONDS,
    limit: int = HEARTBEAT_SPAN_LIMIT,
    now: float | None = None,
) -> dict[str, Any]:
    """:func:`~dask_overlap.metrics.summary.worker_metrics` plus ``recent``: the newest
    ``limit`` spans of the last ``seconds`` of activity, none when the newest span ended
    more than :data:`HEARTBEAT_IDLE_SECONDS` ago; packed
    (:func:`~dask_overlap.metrics.timeline.pack`)."""
    now = time.time() if now is None else now
    out = worker_metrics(rt, now)
    spans = list(rt.timeline)
    # In completion order: the newest end is among the last few appended.
    newest = max((s.end for s in spans[-limit:]), default=float("-inf"))
    if newest < now - HEARTBEAT_IDLE_SECONDS or limit <= 0:
        spans = []
    out["recent"] = timeline.pack(timeline.recent(spans, newest, seconds)[-limit:])
    return out


def detail(
    rt: Runtime, seconds: float = 10.0, limit: int = TIMELINE_LIMIT, now: float | None = None
) -> dict[str, Any]:
    """:func:`~dask_overlap.metrics.summary.worker_metrics` plus ``timeline``: the newest
    ``limit`` spans that ended in the last ``seconds``, as columns (``key`` a string,
    ``stream`` -1 for the copy threads)."""
    now = time.time() if now is None else now
    out = worker_metrics(rt, now)
    spans = timeline.recent(list(rt.timeline), now, seconds)
    out["timeline"] = timeline.columns(spans[-limit:] if limit > 0 else [])
    return out


def _heartbeat_seconds(worker: Worker) -> float:
    """How far back a heartbeat of ``worker`` reaches: two of its intervals, at least
    :data:`HEARTBEAT_SPAN_SECONDS` (the scheduler lengthens the interval on big clusters)."""
    callback = getattr(worker, "periodic_callbacks", {}).get("heartbeat")
    interval = callback.callback_time / 1000 if callback is not None else 0.0
    return max(HEARTBEAT_SPAN_SECONDS, 2 * interval)


def install_worker_metrics(worker: Worker, rt: Runtime) -> None:
    """Report ``rt`` through ``worker``: heartbeat entry, timeline handler, Prometheus.

    Called by :class:`~dask_overlap.OverlapPlugin` in ``setup``; undone by
    :func:`uninstall_worker_metrics`.
    """

    def entry(worker: Worker) -> dict[str, Any]:
        return heartbeat(rt, _heartbeat_seconds(worker))

    def handler(seconds: float = 10.0, limit: int = TIMELINE_LIMIT) -> dict[str, Any]:
        return detail(rt, float(seconds), int(limit))

    worker.metrics[METRICS_NAME] = entry
    worker.handlers[TIMELINE_HANDLER] = handler
    prometheus.report(str(worker.address), rt)


def uninstall_worker_metrics(worker: Worker) -> None:
    """Undo :func:`install_worker_metrics` (the collector stays, reporting the others)."""
    worker.metrics.pop(METRICS_NAME, None)
    worker.handlers.pop(TIMELINE_HANDLER, None)
    prometheus.forget(str(worker.address))
