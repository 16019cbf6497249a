"""What the scheduler's HTTP server answers: ``/overlap.json`` (a tornado handler) and the
``/overlap`` page (a Bokeh document, updated once per interval)."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Protocol

from tornado import web

from .view import OverlapView

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["OverlapJSONHandler", "Snapshots", "overlap_document"]

logger = logging.getLogger(__name__)


class Snapshots(Protocol):
    """Where the handlers get their data (:class:`~dask_overlap.OverlapSchedulerPlugin`)."""

    link_bandwidth: float
    interval_ms: int

    def snapshot(self) -> dict[str, Any]: ...

    async def detailed_snapshot(self) -> dict[str, Any]: ...


class OverlapJSONHandler(web.RequestHandler):
    """``GET /overlap.json``: the plugin's snapshot, from the workers' heartbeats.

    ``?detail=1`` asks every overlap worker once, over RPC, for all its spans of the last
    ``timeline_seconds`` instead (:meth:`~dask_overlap.OverlapSchedulerPlugin.detailed_snapshot`).
    """

    def initialize(self, plugin: Snapshots) -> None:
        self.plugin = plugin

    async def get(self) -> None:
        detail = self.get_argument("detail", "0").lower() in ("1", "true", "yes")
        data = await self.plugin.detailed_snapshot() if detail else self.plugin.snapshot()
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(data, default=str))


def overlap_document(plugin: Snapshots, scheduler: Scheduler, extra: dict, doc: Any) -> None:
    """Fill Bokeh document ``doc`` with the ``/overlap`` page, in the dashboard's template
    (``extra``: the variables every page's navigation bar reads). Dask's
    ``BokehApplication`` calls it with ``scheduler``, ``extra`` and ``doc``; the page reads
    ``plugin``'s snapshots only."""
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    view = OverlapView(plugin.link_bandwidth)

    def update() -> None:
        try:
            view.update(plugin.snapshot())
        except Exception:  # pragma: no cover - keep the page alive, say why once per update
            logger.exception("dask_overlap: /overlap update failed")

    doc.add_next_tick_callback(update)
    doc.add_periodic_callback(update, plugin.interval_ms)
    doc.title = "Dask: overlap"
    doc.add_root(view.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME
