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

Both also carry the worker's incoming transfers (:func:`transfer_spans`: what Dask moved
to it from other workers, read from distributed's own ``Worker.transfer_incoming_log``),
as spans of stage ``transfer`` on a lane of their own, so the page shows a partition's
move beside the streams that then work on it. Their time and bytes are in Dask's own fine
performance metrics already (activity ``gather-dep``), and in its Prometheus series.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..pipeline.runtime import Span
from ..pipeline.stages import TRANSFER, TRANSFER_LANE
from . import prometheus, timeline
from .summary import worker_metrics

if TYPE_CHECKING:
    from distributed import Worker

    from ..pipeline.runtime import Runtime

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
    "transfer_spans",
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


def transfer_spans(log: Iterable[Mapping[str, Any]]) -> list[Span]:
    """Distributed's transfer log (``Worker.transfer_incoming_log``: one entry per gather
    from one worker, with ``start``, ``stop``, ``keys`` and ``total`` bytes) as spans of
    stage ``transfer`` on lane :data:`~dask_overlap.pipeline.stages.TRANSFER_LANE`, in the
    log's (completion) order. A span's key is the first key moved, its ``sub_chunk`` the
    number of keys.

    Examples
    --------
    >>> log = [{"start": 1.0, "stop": 1.5, "keys": {("y", 3): 64, ("y", 4): 64}, "total": 128}]
    >>> transfer_spans(log)
    [Span(key=('y', 3), sub_chunk=2, stream=-2, stage='transfer', start=1.0, end=1.5, nbytes=128)]
    """
    out = []
    for entry in log:
        keys = entry.get("keys") or {}
        key = next(iter(keys), entry.get("who", ""))
        out.append(
            Span(
                key if isinstance(key, tuple) else (key,),
                len(keys),
                TRANSFER_LANE,
                TRANSFER,
                float(entry["start"]),
                float(entry["stop"]),
                int(entry.get("total", 0)),
            )
        )
    return out


def _merged(*groups: Sequence[Span]) -> list[Span]:
    """Spans of several sources (each oldest first) in one list, by end."""
    return sorted(itertools.chain(*groups), key=lambda s: s.end)


def heartbeat(
    rt: Runtime,
    seconds: float = HEARTBEAT_SPAN_SECONDS,
    limit: int = HEARTBEAT_SPAN_LIMIT,
    now: float | None = None,
    transfers: Sequence[Span] = (),
) -> dict[str, Any]:
    """:func:`~dask_overlap.metrics.summary.worker_metrics` plus ``recent``: the newest
    ``limit`` spans of the last ``seconds`` of activity, ``transfers`` among them, none
    when the newest span ended more than :data:`HEARTBEAT_IDLE_SECONDS` ago; packed
    (:func:`~dask_overlap.metrics.timeline.pack`)."""
    now = time.time() if now is None else now
    out = worker_metrics(rt, now)
    spans = list(rt.timeline)
    # In completion order: the newest end is among the last few appended.
    newest = max(
        (s.end for s in itertools.chain(spans[-limit:], transfers[-limit:])), default=float("-inf")
    )
    if newest < now - HEARTBEAT_IDLE_SECONDS or limit <= 0:
        spans, transfers = [], ()
    shown = _merged(
        timeline.recent(spans, newest, seconds), timeline.recent(transfers, newest, seconds)
    )
    out["recent"] = timeline.pack(shown[-limit:])
    return out


def detail(
    rt: Runtime,
    seconds: float = 10.0,
    limit: int = TIMELINE_LIMIT,
    now: float | None = None,
    transfers: Sequence[Span] = (),
) -> dict[str, Any]:
    """:func:`~dask_overlap.metrics.summary.worker_metrics` plus ``timeline``: the newest
    ``limit`` spans that ended in the last ``seconds``, ``transfers`` among them, as
    columns (``key`` a string, ``stream`` -1 for the copy threads, -2 for transfers)."""
    now = time.time() if now is None else now
    out = worker_metrics(rt, now)
    spans = _merged(
        timeline.recent(list(rt.timeline), now, seconds), timeline.recent(transfers, now, seconds)
    )
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

    def transfers() -> list[Span]:
        return transfer_spans(getattr(worker, "transfer_incoming_log", ()))

    def entry(worker: Worker) -> dict[str, Any]:
        return heartbeat(rt, _heartbeat_seconds(worker), transfers=transfers())

    def handler(seconds: float = 10.0, limit: int = TIMELINE_LIMIT) -> dict[str, Any]:
        return detail(rt, float(seconds), int(limit), transfers=transfers())

    # A new dict, never a change of the one there: a heartbeat that is iterating it stays
    # on the old one. Where RMM is installed, distributed awaits its own ``rmm`` (and
    # ``gpu``) metric in the middle of that iteration, and a key added or taken then
    # raised "dictionary changed size during iteration" and closed the worker.
    worker.metrics = {**worker.metrics, METRICS_NAME: entry}
    worker.handlers[TIMELINE_HANDLER] = handler
    prometheus.report(str(worker.address), rt)


def uninstall_worker_metrics(worker: Worker) -> None:
    """Undo :func:`install_worker_metrics` (the collector stays, reporting the others)."""
    worker.metrics = {k: v for k, v in worker.metrics.items() if k != METRICS_NAME}
    worker.handlers.pop(TIMELINE_HANDLER, None)
    prometheus.forget(str(worker.address))
