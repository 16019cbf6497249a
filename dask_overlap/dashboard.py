"""The ``/overlap`` page of the scheduler's dashboard, and its JSON twin ``/overlap.json``.

:class:`OverlapSchedulerPlugin` attaches its own Bokeh application to the scheduler's
HTTP application (``scheduler.http_application``, the router Dask's own pages live in),
under the dashboard's prefix, and adds an "Overlap" tab to the navigation bar that every
dashboard page renders. It asks each worker that carries an
:class:`~dask_overlap.OverlapPlugin` for a snapshot (its metrics and the recent timeline,
see :func:`dask_overlap.metrics.snapshot`) through the worker handler that plugin adds,
at most once per poll interval whatever the number of open pages.

The page shows, for each worker: the recent sub-chunks on each stream (H2D, kernel and
D2H in three colours; staging in grey and unstaging in brown, on the copy threads' lane)
over time, the H2D and D2H throughput against the link's ceiling
(``overlap.link-bandwidth``), pinned and device pool occupancy and window use against
their bounds, and the backpressure. :func:`render_html` renders the same
page from a saved ``/overlap.json``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from typing import TYPE_CHECKING, Any

import dask.config
from distributed.diagnostics.plugin import SchedulerPlugin

from .config import check_bytes
from .metrics.worker import METRICS_NAME, TIMELINE_HANDLER, TIMELINE_LIMIT

if TYPE_CHECKING:
    from distributed import Client, Scheduler

__all__ = [
    "OverlapSchedulerPlugin",
    "OverlapView",
    "register",
    "register_with_scheduler",
    "render_html",
]

logger = logging.getLogger(__name__)

PAGE = "overlap"
COLORS = {
    "stage": "#bdbdbd",
    "h2d": "#1f77b4",
    "compute": "#2ca02c",
    "d2h": "#ff7f0e",
    "unstage": "#8c564b",
}
STAGE_NAMES = {
    "stage": "staging",
    "h2d": "H2D",
    "compute": "kernel",
    "d2h": "D2H",
    "unstage": "unstaging",
}
_BINS = 40  # throughput bins over the timeline's time span
_GB = 1e9


def _link_bandwidth(value: Any = None) -> float:
    value = dask.config.get("overlap.link-bandwidth") if value is None else value
    if isinstance(value, float) and value > 0:  # as a snapshot carries it
        return value
    return float(check_bytes("link_bandwidth", value))


# -- the view: Bokeh models built from snapshots ----------------------------------------
def _throughput(timeline: dict[str, list], lo: float, hi: float) -> dict[str, list]:
    """H2D and D2H GB/s in ``_BINS`` bins over [lo, hi], each copy spread over its span."""
    import numpy as np

    edges = np.linspace(lo, hi, _BINS + 1)
    width = (hi - lo) / _BINS
    rates = {}
    for stage in ("h2d", "d2h"):
        acc = np.zeros(_BINS)
        for st, a, b, n in zip(
            timeline["stage"], timeline["start"], timeline["end"], timeline["nbytes"], strict=True
        ):
            if st != stage or not n:
                continue
            b = max(b, a + 1e-9)
            overlap = np.clip(np.minimum(edges[1:], b) - np.maximum(edges[:-1], a), 0, None)
            acc += n * overlap / (b - a)
        rates[stage] = (acc / width / _GB).tolist()
    mid = ((edges[:-1] + edges[1:]) / 2 * 1000).tolist()
    return {"time": mid, "h2d": rates["h2d"], "d2h": rates["d2h"]}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _fmt_rate(bps: float) -> str:
    return f"{bps / _GB:.2f} GB/s" if bps >= 0.1 * _GB else f"{bps / 1e6:.2f} MB/s"


def _legend_outside(fig: Any) -> None:
    legend = fig.legend[0]
    legend.location = "top_left"
    legend.border_line_alpha = 0
    legend.label_text_font_size = "10px"
    legend.glyph_height = legend.glyph_width = 12
    legend.spacing = 0
    fig.add_layout(legend, "right")


class _WorkerPanel:
    """One worker's row: timeline and throughput over time, pools and window, numbers."""

    def __init__(self, view: OverlapView, address: str):
        from bokeh.layouts import column, row
        from bokeh.models import (
            CDSView,
            ColumnDataSource,
            Div,
            GroupFilter,
            LabelSet,
            Range1d,
            Span,
        )
        from bokeh.plotting import figure

        self.address = address
        only = CDSView(filter=GroupFilter(column_name="worker", group=address))
        self.timeline = figure(
            title=f"{address}: sub-chunks per stream",
            x_axis_type="datetime",
            x_range=view.x_range,
            height=220,
            sizing_mode="stretch_width",
            tools="xpan,xwheel_zoom,reset,hover",
            tooltips="@key #@sub_chunk @stage_name: @nbytes_text, @ms{0.000} ms",
        )
        self.timeline.quad(
            left="left",
            right="right",
            bottom="bottom",
            top="top",
            color="color",
            legend_field="stage_name",
            source=view.timeline_source,
            view=only,
        )
        self.timeline.yaxis.axis_label = "stream"
        _legend_outside(self.timeline)
        self.throughput = figure(
            title="H2D and D2H throughput (GB/s) against the link ceiling",
            x_axis_type="datetime",
            x_range=view.x_range,
            y_range=Range1d(0, view.link_bandwidth / _GB * 1.15),
            height=170,
            sizing_mode="stretch_width",
            tools="xpan,xwheel_zoom,reset",
        )
        # Its own source: Bokeh cannot filter a line's points through a view.
        self.rate_source = ColumnDataSource({"time": [], "h2d": [], "d2h": []})
        for stage in ("h2d", "d2h"):
            self.throughput.line(
                "time",
                stage,
                source=self.rate_source,
                color=COLORS[stage],
                line_width=2,
                legend_label=STAGE_NAMES[stage],
            )
        self.throughput.add_layout(
            Span(
                location=view.link_bandwidth / _GB,
                dimension="width",
                line_dash="dashed",
                line_color="#d62728",
            )
        )
        _legend_outside(self.throughput)
        self.pools_source = ColumnDataSource(
            {"name": ["pinned pool", "device pool", "window"], "used": [0.0] * 3, "text": [""] * 3}
        )
        self.pools = figure(
            title="Use against bounds",
            y_range=["window", "device pool", "pinned pool"],
            x_range=Range1d(0, 1.25),
            height=170,
            width=360,
            tools="",
            toolbar_location=None,
        )
        self.pools.hbar(
            y="name",
            right=1.0,
            height=0.6,
            fill_color=None,
            line_color="#555555",
            source=self.pools_source,
        )
        self.pools.hbar(
            y="name", right="used", height=0.6, color="#6baed6", source=self.pools_source
        )
        self.pools.add_layout(
            LabelSet(
                x=0.02,
                y="name",
                text="text",
                source=self.pools_source,
                text_font_size="10px",
                y_offset=-6,
            )
        )
        self.numbers = Div(width=360)
        self.root = row(
            column(self.timeline, self.throughput, sizing_mode="stretch_width"),
            column(self.pools, self.numbers),
            sizing_mode="stretch_width",
        )
        self._last: tuple[float, float] | None = None

    def update(self, w: dict[str, Any], lanes: list[int]) -> None:
        from bokeh.models import FixedTicker

        names = {j: ("copy threads" if j < 0 else f"stream {j}") for j in lanes}
        self.timeline.yaxis.ticker = FixedTicker(ticks=lanes)
        self.timeline.height = max(200, 70 + 15 * len(lanes))
        self.timeline.yaxis.major_label_overrides = names
        pinned = w.get("pinned_bytes_in_use", 0)
        pinned_max = w.get("pinned_pool_size", 0) or 1
        device = w.get("device_bytes_in_use", 0)
        device_max = w.get("device_pool_size", 0) or 1
        window, capacity = w.get("in_flight", 0), w.get("window_capacity", 0) or 1
        self.pools_source.data = {
            "name": ["pinned pool", "device pool", "window"],
            "used": [
                min(1.2, pinned / pinned_max),
                min(1.2, device / device_max),
                window / capacity,
            ],
            "text": [
                f"{_fmt_bytes(pinned)} / {_fmt_bytes(pinned_max)}",
                f"{_fmt_bytes(device)} / {_fmt_bytes(device_max)}",
                f"{window} / {capacity} sub-chunks",
            ],
        }
        bp = float(w.get("backpressure_seconds", 0.0))
        t = float(w.get("time", time.time()))
        recent = ""
        if self._last is not None and t > self._last[0]:
            recent = f" ({(bp - self._last[1]) / (t - self._last[0]):.2f} s/s now)"
        self._last = (t, bp)
        busy = w.get("busy_seconds", {})
        unit = w.get("busy_unit", "seconds")
        self.numbers.text = (
            f"<b>{w.get('name', self.address)}</b> ({w.get('backend', '?')})<br>"
            f"H2D {_fmt_rate(w.get('h2d_bytes_per_second', 0))}, "
            f"D2H {_fmt_rate(w.get('d2h_bytes_per_second', 0))} (last 2 s)<br>"
            f"overlap efficiency {w.get('overlap_efficiency', 0):.2f} "
            f"(stages busy at once)<br>"
            f"backpressure {bp:.2f} s{recent}<br>"
            f"moved in {_fmt_bytes(w.get('bytes_h2d', 0))}, "
            f"out {_fmt_bytes(w.get('bytes_d2h', 0))}<br>"
            f"partitions {w.get('partitions', 0)} ({w.get('partitions_active', 0)} running), "
            f"sub-chunks {w.get('sub_chunks', 0)}<br>"
            f"pinned fallbacks {w.get('pinned_fallbacks', 0)}<br>"
            + ", ".join(f"{STAGE_NAMES.get(k, k)} {v:.2f}" for k, v in busy.items())
            + f" {unit} busy"
        )


class OverlapView:
    """The ``/overlap`` page as Bokeh models, updated from snapshots (``/overlap.json``).

    The timeline of every worker lives in one data source named ``overlap-timeline`` (one
    row per span, with a ``worker`` column), so a browser can check what it renders.

    Parameters
    ----------
    link_bandwidth
        Ceiling of one direction of the link, bytes per second.

    Examples
    --------
    >>> view = OverlapView(55e9)
    >>> view.update({"time": 0.0, "window": 10.0, "workers": {}})
    >>> view.timeline_source.name
    'overlap-timeline'
    """

    def __init__(self, link_bandwidth: float):
        from bokeh.layouts import column
        from bokeh.models import ColumnDataSource, Div, Range1d

        self.link_bandwidth = link_bandwidth
        self.timeline_source = ColumnDataSource(self._empty_timeline(), name="overlap-timeline")
        self.x_range = Range1d(0, 1)
        self.header = Div(sizing_mode="stretch_width")
        self.root = column(self.header, sizing_mode="stretch_width")
        self.panels: dict[str, _WorkerPanel] = {}

    @staticmethod
    def _empty_timeline() -> dict[str, list]:
        cols = ("worker", "key", "sub_chunk", "stage", "stage_name", "left", "right")
        cols += ("bottom", "top", "color", "nbytes_text", "ms")
        return {c: [] for c in cols}

    def update(self, snap: dict[str, Any]) -> None:
        """Show ``snap`` (what ``/overlap.json`` returns)."""
        workers: dict[str, dict[str, Any]] = snap.get("workers", {})
        for gone in set(self.panels) - set(workers):
            self.root.children.remove(self.panels.pop(gone).root)
        tl = self._empty_timeline()
        starts = [s for w in workers.values() for s in w["timeline"]["start"]]
        ends = [e for w in workers.values() for e in w["timeline"]["end"]]
        now = float(snap.get("time", time.time()))
        lo = min(starts) if starts else now - float(snap.get("window", 10.0))
        hi = max(ends) if ends else now
        hi = max(hi, lo + 1e-3)
        for address in sorted(workers):
            w = workers[address]
            t = w["timeline"]
            lanes = sorted(set(t["stream"]) | {-1, *range(int(w.get("streams", 0) or 0))})
            for k, j, st, a, b, n, sub in zip(
                t["key"],
                t["stream"],
                t["stage"],
                t["start"],
                t["end"],
                t["nbytes"],
                t["sub_chunk"],
                strict=True,
            ):
                tl["worker"].append(address)
                tl["key"].append(k)
                tl["sub_chunk"].append(sub)
                tl["stage"].append(st)
                tl["stage_name"].append(STAGE_NAMES.get(st, st))
                tl["left"].append(a * 1000)
                tl["right"].append(max(b, a) * 1000)
                tl["bottom"].append(j - 0.4)
                tl["top"].append(j + 0.4)
                tl["color"].append(COLORS.get(st, "#7f7f7f"))
                tl["nbytes_text"].append(_fmt_bytes(n))
                tl["ms"].append((b - a) * 1000)
            if address not in self.panels:
                self.panels[address] = _WorkerPanel(self, address)
                self.root.children.append(self.panels[address].root)
            self.panels[address].rate_source.data = _throughput(t, lo, hi)
            self.panels[address].update(w, lanes)
        self.timeline_source.data = tl
        self.x_range.start, self.x_range.end = lo * 1000, hi * 1000
        n = len(tl["worker"])
        self.header.text = (
            f"<h3>dask_overlap: the assembly line</h3>{len(workers)} worker(s) with an "
            f"OverlapPlugin; {n} recent stage spans shown. Colours: "
            + ", ".join(
                f'<span style="color:{c}">■ {STAGE_NAMES[s]}</span>' for s, c in COLORS.items()
            )
            + f". Dashed line: link ceiling {self.link_bandwidth / _GB:.1f} GB/s."
        )


def render_html(snap: dict[str, Any], path: str, link_bandwidth: float | None = None) -> str:
    """Write the ``/overlap`` page for snapshot ``snap`` as a standalone HTML file.

    Bokeh's JavaScript is inlined, so the file opens with no network. Returns ``path``.
    """
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    view = OverlapView(_link_bandwidth(snap.get("link_bandwidth", link_bandwidth)))
    view.update(snap)
    with open(path, "w") as f:
        f.write(file_html(view.root, INLINE, "dask_overlap: /overlap"))
    return path


# -- the scheduler plugin ---------------------------------------------------------------
def _dashboard_prefix(scheduler: Scheduler) -> str:
    """The prefix Dask's dashboard runs under (``--dashboard-prefix``/``http_prefix``)."""
    for app in getattr(scheduler.http_application, "applications", []):
        prefix = getattr(app, "prefix", None)  # Dask's BokehTornado
        if isinstance(prefix, str):
            return prefix.strip("/")
    return str(dask.config.get("distributed.dashboard.prefix", "") or "").strip("/")


@functools.cache
def _json_handler() -> type:
    from tornado import web

    class OverlapJSONHandler(web.RequestHandler):
        def initialize(self, plugin: OverlapSchedulerPlugin) -> None:
            self.plugin = plugin

        async def get(self) -> None:
            data = await self.plugin.snapshot()
            self.set_header("Content-Type", "application/json")
            self.write(json.dumps(data, default=str))

    return OverlapJSONHandler


def _overlap_doc(
    plugin: OverlapSchedulerPlugin, scheduler: Scheduler, extra: dict, doc: Any
) -> None:
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    view = OverlapView(plugin.link_bandwidth)

    async def update() -> None:
        try:
            view.update(await plugin.snapshot())
        except Exception:  # pragma: no cover - keep the page alive, say why once per poll
            logger.exception("dask_overlap: /overlap update failed")

    doc.add_next_tick_callback(update)
    doc.add_periodic_callback(update, plugin.interval_ms)
    doc.title = "Dask: overlap"
    doc.add_root(view.root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


class OverlapSchedulerPlugin(SchedulerPlugin):
    """Adds the ``/overlap`` page and ``/overlap.json`` to the scheduler's dashboard.

    Parameters
    ----------
    link_bandwidth
        Ceiling of one direction of the host-device link (bytes per second, or a
        string such as ``"55GB"``), drawn on the throughput plots; default
        ``overlap.link-bandwidth``.
    window
        Seconds of recent timeline to show.
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
        window: float = 10.0,
        interval: int = 1000,
        timeline_limit: int = TIMELINE_LIMIT,
    ):
        self.link_bandwidth = _link_bandwidth(link_bandwidth)
        if not window > 0:
            raise ValueError(f"window must be a positive number of seconds, got {window!r}")
        self.window = float(window)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 50:
            raise ValueError(f"interval must be an int of at least 50 (ms), got {interval!r}")
        self.interval_ms = interval
        self.timeline_limit = int(timeline_limit)
        self._state()

    def _state(self) -> None:
        self.scheduler: Any = None
        self.app: Any = None
        self._cache: dict[str, Any] | None = None
        self._cache_time = 0.0
        self._lock: asyncio.Lock | None = None

    def __getstate__(self) -> dict[str, Any]:
        keep = ("link_bandwidth", "window", "interval_ms", "timeline_limit")
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
        json_route = (rf"{root}/{PAGE}\.json", _json_handler(), {"plugin": self})
        try:
            from distributed.dashboard.core import BokehApplication
            from distributed.dashboard.scheduler import template_variables
            from tornado.ioloop import IOLoop
        except ImportError as e:
            # The JSON needs no bokeh: serve it on the scheduler's own HTTP server.
            http.add_handlers(r".*", [json_route])
            logger.warning(
                "dask_overlap: no /overlap page without bokeh (%s); /overlap.json is served "
                "(pip install bokeh, or the dashboard extra, for the page)",
                e,
            )
            return
        variables = template_variables(scheduler)  # the dict every page's navbar reads
        if PAGE not in variables["pages"]:
            variables["pages"].append(PAGE)
        app = BokehApplication(
            {f"/{PAGE}": functools.partial(_overlap_doc, self)},
            scheduler,
            prefix=prefix,
            template_variables=variables,
        )
        app.add_handlers(r".*", [json_route])
        http.add_application(app)
        app.initialize(IOLoop.current())
        app.start()
        self.app = app

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

    async def snapshot(self) -> dict[str, Any]:
        """Every overlap worker's snapshot (``/overlap.json``); cached for one interval."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            now = time.time()
            if self._cache is not None and now - self._cache_time < self.interval_ms / 2000:
                return self._cache
            wss = [ws for ws in self.scheduler.workers.values() if METRICS_NAME in ws.metrics]
            got = await asyncio.gather(*(self._fetch(ws) for ws in wss))
            self._cache = {
                "time": now,
                "window": self.window,
                "link_bandwidth": self.link_bandwidth,
                "workers": {ws.address: w for ws, w in zip(wss, got, strict=True)},
            }
            self._cache_time = now
            return self._cache

    async def _fetch(self, ws: Any) -> dict[str, Any]:
        try:
            call = getattr(self.scheduler.rpc(addr=ws.address), TIMELINE_HANDLER)
            out = await asyncio.wait_for(
                call(seconds=self.window, limit=self.timeline_limit), timeout=5
            )
        except Exception:  # the worker is going, or its plugin is: its last heartbeat
            out = dict(ws.metrics[METRICS_NAME])
            out["timeline"] = {
                k: [] for k in ("key", "sub_chunk", "stream", "stage", "start", "end", "nbytes")
            }
        out["name"] = str(ws.name)
        return out


def register(
    client: Client, options: Any = None, *, dashboard: bool = True, **overrides: Any
) -> None:
    """Set a cluster up for dask_overlap: the worker plugin, and the ``/overlap`` page.

    Registers an :class:`~dask_overlap.OverlapPlugin` (built from ``options`` and
    ``overrides``) on every worker, and, with ``dashboard``, an
    :class:`OverlapSchedulerPlugin` on the scheduler (a no-op if one is there already).
    :class:`~dask_overlap.LocalGPUCluster` and ``dask overlap worker`` do this themselves.

    Examples
    --------
    >>> import dask_overlap
    >>> dask_overlap.register(client, in_flight=2)  # doctest: +SKIP
    """
    from .plugin import OverlapPlugin

    client.register_plugin(OverlapPlugin(options, **overrides))
    if dashboard:
        client.register_plugin(OverlapSchedulerPlugin())


async def register_with_scheduler(address: str, connection_args: dict | None = None) -> bool:
    """Add the ``/overlap`` page to the scheduler at ``address`` (idempotent), over RPC.

    For processes that reach a scheduler without a client (``dask overlap worker``).
    Returns ``False``, with a warning, if the scheduler refuses (e.g. it cannot import
    dask_overlap).
    """
    from distributed.core import rpc
    from distributed.protocol.pickle import dumps

    plugin = OverlapSchedulerPlugin()
    try:
        async with rpc(address, connection_args=connection_args or {}) as scheduler:
            await scheduler.register_scheduler_plugin(
                plugin=dumps(plugin), name=plugin.name, idempotent=True
            )
    except Exception as e:
        logger.warning(
            "dask_overlap: could not add /overlap to the scheduler at %s: %s", address, e
        )
        return False
    return True
