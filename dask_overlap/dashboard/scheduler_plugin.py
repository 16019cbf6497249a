"""The scheduler plugin that serves ``/overlap`` and ``/overlap.json``."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from numbers import Real
from typing import TYPE_CHECKING, Any

import dask.config
from distributed.diagnostics.plugin import SchedulerPlugin

from ..config import check_positive_int
from ..metrics.worker import METRICS_NAME, TIMELINE_HANDLER, TIMELINE_LIMIT
from .handlers import OverlapJSONHandler, overlap_document
from .history import Histories
from .view import resolve_link_bandwidth

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["PAGE", "OverlapSchedulerPlugin"]

logger = logging.getLogger(__name__)

PAGE = "overlap"
_DETAIL_TIMEOUT = 5.0  # seconds a worker has to answer a detailed snapshot


def _dashboard_prefix(scheduler: Scheduler) -> str:
    """The prefix Dask's dashboard runs under (``--dashboard-prefix``/``http_prefix``)."""
    for app in getattr(scheduler.http_application, "applications", []):
        prefix = getattr(app, "prefix", None)  # Dask's BokehTornado
        if isinstance(prefix, str):
            return prefix.strip("/")
    return str(dask.config.get("distributed.dashboard.prefix", "") or "").strip("/")


class OverlapSchedulerPlugin(SchedulerPlugin):
    """Adds the ``/overlap`` page and ``/overlap.json`` to the scheduler's dashboard.

    Both read what the workers' heartbeats already bring (``WorkerState.metrics``): no
    request to a worker is made for them. Only ``/overlap.json?detail=1`` asks each
    worker, once per request (:meth:`detailed_snapshot`).

    Parameters
    ----------
    link_bandwidth
        Ceiling of one direction of the host-device link (bytes per second, or a
        string such as ``"55GB"``), drawn on the throughput plots; default
        ``overlap.link-bandwidth``.
    timeline_seconds
        Seconds of recent timeline to keep and show.
    interval
        Milliseconds between updates of an open page.
    timeline_limit
        At most this many of the newest spans per worker.

    Examples
    --------
    >>> from dask_overlap import OverlapSchedulerPlugin
    >>> client.register_plugin(OverlapSchedulerPlugin())  # doctest: +SKIP
    """

    name = "overlap-dashboard"
    idempotent = True

    def __init__(
        self,
        link_bandwidth: float | str | None = None,
        timeline_seconds: float = 10.0,
        interval: int = 1000,
        timeline_limit: int = TIMELINE_LIMIT,
    ):
        self.link_bandwidth = resolve_link_bandwidth(link_bandwidth)
        if (
            isinstance(timeline_seconds, bool)
            or not isinstance(timeline_seconds, Real)
            or not 0 < timeline_seconds < math.inf
        ):
            raise ValueError(
                f"timeline_seconds must be a positive number of seconds, got {timeline_seconds!r}"
            )
        self.timeline_seconds = float(timeline_seconds)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 50:
            raise ValueError(f"interval must be an int of at least 50 (ms), got {interval!r}")
        self.interval_ms = interval
        self.timeline_limit = check_positive_int("timeline_limit", timeline_limit)
        self._state()

    def _state(self) -> None:
        self.scheduler: Any = None
        self.app: Any = None
        self.histories = Histories(self.timeline_seconds, self.timeline_limit)

    def __getstate__(self) -> dict[str, Any]:
        keep = ("link_bandwidth", "timeline_seconds", "interval_ms", "timeline_limit")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._state()

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        http = getattr(scheduler, "http_application", None)
        if http is None:
            logger.warning("dask_overlap: the scheduler serves no HTTP; no /overlap page")
            return
        prefix = _dashboard_prefix(scheduler)
        root = f"/{prefix}" if prefix else ""
        json_route = (rf"{root}/{PAGE}\.json", OverlapJSONHandler, {"plugin": self})
        try:
            self.app = self._page(scheduler, prefix, json_route)
        except ImportError as e:
            # The JSON needs no bokeh: serve it on the scheduler's own HTTP server.
            http.add_handlers(r".*", [json_route])
            # Where bokeh is not installed (an install without the dashboard extra, which
            # has no Dask dashboard pages either) this is said at debug level, not on every
            # cluster a client starts; a bokeh that is there but fails to load is warned of.
            absent = isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "bokeh"
            logger.log(
                logging.DEBUG if absent else logging.WARNING,
                "dask_overlap: no /overlap page without bokeh (%s); /overlap.json is served "
                "(pip install bokeh, or the dashboard extra, for the page)",
                e,
            )

    def _page(self, scheduler: Scheduler, prefix: str, json_route: tuple) -> Any:
        """A Bokeh application of the page (and the JSON route), started, with an
        "Overlap" tab in every page's navigation bar; ImportError without bokeh."""
        from distributed.dashboard.core import BokehApplication
        from distributed.dashboard.scheduler import template_variables
        from tornado.ioloop import IOLoop

        variables = template_variables(scheduler)  # the dict every page's navbar reads
        if PAGE not in variables["pages"]:
            variables["pages"].append(PAGE)
        app = BokehApplication(
            {f"/{PAGE}": functools.partial(overlap_document, self)},
            scheduler,
            prefix=prefix,
            template_variables=variables,
        )
        app.add_handlers(r".*", [json_route])
        scheduler.http_application.add_application(app)
        app.initialize(IOLoop.current())
        app.start()
        return app

    async def close(self) -> None:
        app, self.app = self.app, None
        if app is None:
            return
        apps = self.scheduler.http_application.applications
        if app in apps:
            apps.remove(app)
        from distributed.dashboard.scheduler import template_variables

        pages = template_variables(self.scheduler)["pages"]
        if PAGE in pages:
            pages.remove(PAGE)
        # Bokeh >= 3.10 refuses a synchronous stop inside a running event loop (seen on
        # the GPU machine, bokeh 3.10.2); older versions have only the synchronous one.
        stop_async = getattr(app, "stop_async", None)
        if stop_async is not None:
            await stop_async()
        else:
            app.stop()

    def snapshot(self) -> dict[str, Any]:
        """``/overlap.json``: every overlap worker's latest heartbeat, with the spans and
        rates its heartbeats brought since the page was first read.

        Per worker (by address): the heartbeat's numbers
        (:func:`dask_overlap.metrics.summary.worker_metrics`), ``name``, ``timeline``
        (columns: ``key``, ``sub_chunk``, ``stream``, ``stage``, ``start``, ``end``,
        ``nbytes``), ``rates`` (``time``, ``h2d``, ``d2h``, one point per heartbeat) and
        ``timeline_source`` (``"heartbeats"``).
        """
        workers = {}
        for ws, history in self.histories.update(self.scheduler.workers.values()):
            w = {k: v for k, v in ws.metrics[METRICS_NAME].items() if k != "recent"}
            w.update(
                name=str(ws.name),
                timeline=history.timeline(),
                rates=history.rates(),
                timeline_source="heartbeats",
            )
            workers[ws.address] = w
        return {
            "time": time.time(),
            "timeline_seconds": self.timeline_seconds,
            "link_bandwidth": self.link_bandwidth,
            "detail": False,
            "workers": workers,
        }

    async def detailed_snapshot(self) -> dict[str, Any]:
        """``/overlap.json?detail=1``: :meth:`snapshot`, with each worker's numbers and
        timeline as the worker itself answers now (every span of the last
        ``timeline_seconds``, at most ``timeline_limit``), over one RPC per worker.

        Such a worker has no ``rates``: its timeline holds every copy, so the page derives
        the throughput from it. A worker that does not answer within 5 s keeps what its
        heartbeats brought, and its ``timeline_source`` says so (``"heartbeats"``, not
        ``"worker"``).
        """
        snap = self.snapshot()
        snap["detail"] = True
        addresses = list(snap["workers"])
        answers = await asyncio.gather(*(self._ask(a) for a in addresses))
        for address, answer in zip(addresses, answers, strict=True):
            if answer is not None:
                w = snap["workers"][address]
                w.update(answer, timeline_source="worker")
                # Its timeline is complete: the page bins the copies in it instead.
                del w["rates"]
        return snap

    async def _ask(self, address: str) -> dict[str, Any] | None:
        try:
            call = getattr(self.scheduler.rpc(addr=address), TIMELINE_HANDLER)
            return await asyncio.wait_for(
                call(seconds=self.timeline_seconds, limit=self.timeline_limit),
                timeout=_DETAIL_TIMEOUT,
            )
        except Exception as e:  # the worker is going, or its plugin is
            logger.info("dask_overlap: no detailed timeline from %s: %s", address, e)
            return None
