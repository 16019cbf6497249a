"""The ``/overlap`` page of the scheduler's dashboard, and its JSON twin ``/overlap.json``.

:class:`OverlapSchedulerPlugin` (:mod:`.scheduler_plugin`) attaches its own Bokeh
application to the scheduler's HTTP application (``scheduler.http_application``, the
router Dask's own pages live in), under the dashboard's prefix, and adds an "Overlap" tab
to the navigation bar that every dashboard page renders.

Both read what each worker with an :class:`~dask_overlap.OverlapPlugin` already sends in
its heartbeats (``WorkerState.metrics["overlap"]``): its counters, pools and recent rates,
and a bounded window of its newest spans (:mod:`dask_overlap.metrics.worker`). The
scheduler merges those windows into each worker's recent past (:mod:`.history`); nothing
is asked of a worker for the page. ``/overlap.json?detail=1`` is the one exception: it
asks every worker once, over RPC, for all its spans of the last ``timeline_seconds``.

The page (:mod:`.view`, a row per worker in :mod:`.panel`) shows, for each worker: the
recent sub-chunks on each stream (H2D, kernel and D2H in three colours; staging in grey
and unstaging in brown, on the copy threads' lane) over time, the H2D and D2H throughput
its heartbeats report against the link's ceiling (``overlap.link-bandwidth``), pinned and
device pool occupancy and window use against their bounds, and the backpressure.
:func:`render_html` renders the same page from a saved ``/overlap.json``.
:mod:`.handlers` holds the JSON handler and the page's Bokeh document;
:mod:`.registration` sets a cluster up (:func:`register`).
"""

from __future__ import annotations

from .registration import register, register_with_scheduler
from .scheduler_plugin import OverlapSchedulerPlugin
from .view import OverlapView, render_html

__all__ = [
    "OverlapSchedulerPlugin",
    "OverlapView",
    "register",
    "register_with_scheduler",
    "render_html",
]
