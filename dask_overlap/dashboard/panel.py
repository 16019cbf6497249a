"""One worker's row of the ``/overlap`` page: its spans per stream, its H2D and D2H
throughput against the link's ceiling, its pools and window against their bounds, and
its numbers."""

from __future__ import annotations

import time
from typing import Any

from dask.utils import format_bytes

from ..pipeline.stages import COLORS, DISPLAY_NAMES, TRANSFER_LANE

__all__ = ["GB", "WorkerPanel", "format_rate"]

GB = 1e9  # link rates are decimal: 55 GB/s
_POOLS = ["pinned pool", "device pool", "window", "result pool"]


def format_rate(bps: float) -> str:
    """A rate in decimal units, as links are rated.

    Examples
    --------
    >>> format_rate(21.5e9), format_rate(3e6)
    ('21.50 GB/s', '3.00 MB/s')
    """
    return f"{bps / GB:.2f} GB/s" if bps >= 0.1 * GB else f"{bps / 1e6:.2f} MB/s"


def _legend_outside(fig: Any) -> None:
    legend = fig.legend[0]
    legend.location = "top_left"
    legend.border_line_alpha = 0
    legend.label_text_font_size = "10px"
    legend.glyph_height = legend.glyph_width = 12
    legend.spacing = 0
    fig.add_layout(legend, "right")


def _timeline_figure(address: str, x_range: Any, source: Any) -> Any:
    """Quads of ``source``'s rows of ``address``, one lane per stream."""
    from bokeh.models import CDSView, GroupFilter
    from bokeh.plotting import figure

    fig = figure(
        title=f"{address}: sub-chunks per stream",
        x_axis_type="datetime",
        x_range=x_range,
        height=220,
        sizing_mode="stretch_width",
        tools="xpan,xwheel_zoom,reset,hover",
        tooltips="@key #@sub_chunk @stage_name: @nbytes_text, @ms{0.000} ms",
    )
    only = CDSView(filter=GroupFilter(column_name="worker", group=address))
    fig.quad(
        left="left",
        right="right",
        bottom="bottom",
        top="top",
        color="color",
        legend_field="stage_name",
        source=source,
        view=only,
    )
    fig.yaxis.axis_label = "stream"
    _legend_outside(fig)
    return fig


def _throughput_figure(x_range: Any, source: Any, link_bandwidth: float) -> Any:
    """H2D and D2H of ``source`` (GB/s) under a dashed line at the link's ceiling."""
    from bokeh.models import Range1d
    from bokeh.models import Span as Rule  # Bokeh's line across a plot, not a timeline span
    from bokeh.plotting import figure

    fig = figure(
        title="H2D and D2H throughput (GB/s) against the link ceiling",
        x_axis_type="datetime",
        x_range=x_range,
        y_range=Range1d(0, link_bandwidth / GB * 1.15),
        height=170,
        sizing_mode="stretch_width",
        tools="xpan,xwheel_zoom,reset",
    )
    for stage in ("h2d", "d2h"):
        style = dict(source=source, color=COLORS[stage], legend_label=DISPLAY_NAMES[stage])
        fig.line("time", stage, line_width=2, **style)
        fig.scatter("time", stage, size=4, **style)  # a lone point shows too
    ceiling = Rule(location=link_bandwidth / GB, dimension="width", line_dash="dashed")
    ceiling.line_color = "#d62728"
    fig.add_layout(ceiling)
    _legend_outside(fig)
    return fig


def _pools_figure(source: Any) -> Any:
    """One bar per bound (pinned pool, device pool, window, result pool): its outline the
    bound, its fill the share in use (of the result pool: the share it holds idle, ready
    for the next results), with the figures written on it."""
    from bokeh.models import LabelSet, Range1d
    from bokeh.plotting import figure

    fig = figure(
        title="Use against bounds",
        y_range=list(reversed(_POOLS)),
        x_range=Range1d(0, 1.25),
        height=200,
        width=360,
        tools="",
        toolbar_location=None,
    )
    fig.hbar(y="name", right=1.0, height=0.6, fill_color=None, line_color="#555555", source=source)
    fig.hbar(y="name", right="used", height=0.6, color="#6baed6", source=source)
    labels = LabelSet(x=0.02, y="name", text="text", source=source, y_offset=-6)
    labels.text_font_size = "10px"
    fig.add_layout(labels)
    return fig


class WorkerPanel:
    """One worker's row: timeline and throughput over time, pools and window, numbers.

    Parameters
    ----------
    address
        The worker's address: its rows of ``timeline_source`` are those with this
        ``worker``.
    x_range
        The time axis every panel shares.
    timeline_source
        The page's ``overlap-timeline`` source (every worker's spans).
    link_bandwidth
        Ceiling of one direction of the link, bytes per second.
    """

    def __init__(self, address: str, x_range: Any, timeline_source: Any, link_bandwidth: float):
        from bokeh.layouts import column, row
        from bokeh.models import ColumnDataSource, Div

        self.address = address
        # Its own source: Bokeh cannot filter a line's points through a view.
        self.rate_source = ColumnDataSource({"time": [], "h2d": [], "d2h": []})
        self.pools_source = ColumnDataSource(
            {"name": _POOLS, "used": [0.0] * len(_POOLS), "text": [""] * len(_POOLS)}
        )
        self.timeline = _timeline_figure(address, x_range, timeline_source)
        self.throughput = _throughput_figure(x_range, self.rate_source, link_bandwidth)
        self.pools = _pools_figure(self.pools_source)
        self.numbers = Div(width=360)
        self.root = row(
            column(self.timeline, self.throughput, sizing_mode="stretch_width"),
            column(self.pools, self.numbers),
            sizing_mode="stretch_width",
        )
        self._last_backpressure: tuple[float, float] | None = None  # (time, seconds)

    def update(self, w: dict[str, Any], lanes: list[int], rates: dict[str, list]) -> None:
        """Show worker snapshot ``w`` with a lane per stream in ``lanes`` (-1: the copy
        threads, -2: transfers from other workers) and ``rates`` (``time`` in seconds,
        ``h2d`` and ``d2h`` in bytes/s)."""
        from bokeh.models import FixedTicker

        self.timeline.yaxis.ticker = FixedTicker(ticks=lanes)
        self.timeline.height = max(200, 70 + 15 * len(lanes))
        self.timeline.yaxis.major_label_overrides = {j: _lane_name(j) for j in lanes}
        self.rate_source.data = {
            "time": [t * 1000 for t in rates["time"]],
            "h2d": [r / GB for r in rates["h2d"]],
            "d2h": [r / GB for r in rates["d2h"]],
        }
        self.pools_source.data = _pool_bars(w)
        self.numbers.text = self._numbers(w)

    def _numbers(self, w: dict[str, Any]) -> str:
        bp = float(w.get("backpressure_seconds", 0.0))
        t = float(w.get("time", time.time()))
        now = ""
        last = self._last_backpressure
        if last is not None and t > last[0]:
            now = f" ({(bp - last[1]) / (t - last[0]):.2f} s/s now)"
        self._last_backpressure = (t, bp)
        busy = ", ".join(
            f"{DISPLAY_NAMES.get(k, k)} {v:.2f}" for k, v in w.get("busy_seconds", {}).items()
        )
        return (
            f"<b>{w.get('name', self.address)}</b> ({w.get('backend', '?')})<br>"
            f"H2D {format_rate(w.get('h2d_bytes_per_second', 0))}, "
            f"D2H {format_rate(w.get('d2h_bytes_per_second', 0))} (last 2 s)<br>"
            f"overlap efficiency {w.get('overlap_efficiency', 0):.2f} "
            f"(stages busy at once)<br>"
            f"backpressure {bp:.2f} s{now}<br>"
            f"moved in {format_bytes(int(w.get('bytes_h2d', 0)))}, "
            f"out {format_bytes(int(w.get('bytes_d2h', 0)))}<br>"
            f"partitions {w.get('partitions', 0)} ({w.get('partitions_active', 0)} running), "
            f"sub-chunks {w.get('sub_chunks', 0)}<br>"
            f"pinned fallbacks {w.get('pinned_fallbacks', 0)}<br>"
            f"results made in reused memory {w.get('results_reused', 0)}, "
            f"in fresh {w.get('results_fresh', 0)}<br>"
            f"{busy} {w.get('busy_unit', 'seconds')} busy"
        )


def _lane_name(lane: int) -> str:
    """The label of a timeline lane: a stream, the copy threads or the transfers in."""
    if lane == TRANSFER_LANE:
        return "transfers in"
    return "copy threads" if lane < 0 else f"stream {lane}"


def _pool_bars(w: dict[str, Any]) -> dict[str, list]:
    """The bars of :func:`_pools_figure` for worker snapshot ``w``.

    >>> bars = _pool_bars({"result_bytes_idle": 2**30, "result_pool_size": 4 * 2**30})
    >>> bars["used"][3], bars["text"][3]
    (0.25, '1.00 GiB idle / 4.00 GiB')
    >>> _pool_bars({"result_pool_size": 0})["text"][3]  # overlap.result-pool-size: 0
    'off'
    """
    pinned = int(w.get("pinned_bytes_in_use") or 0)
    pinned_max = int(w.get("pinned_pool_size") or 0) or 1
    device = int(w.get("device_bytes_in_use") or 0)
    device_max = int(w.get("device_pool_size") or 0) or 1
    window, capacity = w.get("in_flight", 0), w.get("window_capacity", 0) or 1
    idle, results_max = int(w.get("result_bytes_idle") or 0), int(w.get("result_pool_size") or 0)
    return {
        "name": _POOLS,
        "used": [
            min(1.2, pinned / pinned_max),
            min(1.2, device / device_max),
            window / capacity,
            min(1.2, idle / (results_max or 1)),
        ],
        "text": [
            f"{format_bytes(pinned)} / {format_bytes(pinned_max)}",
            f"{format_bytes(device)} / {format_bytes(device_max)}",
            f"{window} / {capacity} sub-chunks",
            f"{format_bytes(idle)} idle / {format_bytes(results_max)}" if results_max else "off",
        ],
    }
