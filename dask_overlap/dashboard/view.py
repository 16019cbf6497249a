"""The ``/overlap`` page as Bokeh models, built from a snapshot (what ``/overlap.json``
returns), and the same page as a standalone HTML file (:func:`render_html`)."""

from __future__ import annotations

import math
import time
from typing import Any

import dask.config
from dask.utils import format_bytes

from ..config import check_bytes
from ..metrics.timeline import COLUMNS
from ..pipeline.stages import COLORS, DISPLAY_NAMES, OTHER_COLOR
from .panel import GB, WorkerPanel

__all__ = ["OverlapView", "render_html", "resolve_link_bandwidth"]

_BINS = 40  # throughput bins over the interval the timeline covers


def resolve_link_bandwidth(value: Any = None) -> float:
    """The link's ceiling in bytes/s: ``value`` (bytes/s or a string such as ``"55GB"``),
    or ``overlap.link-bandwidth`` when ``None``."""
    value = dask.config.get("overlap.link-bandwidth") if value is None else value
    if isinstance(value, float) and 0 < value < math.inf:  # as a snapshot carries it
        return value
    return float(check_bytes("link_bandwidth", value))


def binned_throughput(timeline: dict[str, list], lo: float, hi: float) -> dict[str, list]:
    """H2D and D2H bytes/s in ``_BINS`` bins over [lo, hi] (``time``: the bins' middles,
    seconds), each copy's bytes spread evenly from its start to its end.

    For snapshots without ``rates``: every ``/overlap.json?detail=1`` (whose timeline is
    complete, so the rates are worked out from it) and saved snapshots of older versions."""
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
            inside = np.clip(np.minimum(edges[1:], b) - np.maximum(edges[:-1], a), 0, None)
            acc += n * inside / (b - a)
        rates[stage] = (acc / width).tolist()
    return {"time": ((edges[:-1] + edges[1:]) / 2).tolist(), **rates}


def _empty_rows() -> dict[str, list]:
    cols = ("worker", "key", "sub_chunk", "stage", "stage_name", "left", "right")
    cols += ("bottom", "top", "color", "nbytes_text", "ms")
    return {c: [] for c in cols}


def _add_rows(rows: dict[str, list], address: str, timeline: dict[str, list]) -> None:
    """Append one worker's spans to the page's timeline source, one quad each."""
    for k, sub, j, st, a, b, n in zip(*(timeline[c] for c in COLUMNS), strict=True):
        rows["worker"].append(address)
        rows["key"].append(k)
        rows["sub_chunk"].append(sub)
        rows["stage"].append(st)
        rows["stage_name"].append(DISPLAY_NAMES.get(st, st))
        rows["left"].append(a * 1000)
        rows["right"].append(max(b, a) * 1000)
        rows["bottom"].append(j - 0.4)
        rows["top"].append(j + 0.4)
        rows["color"].append(COLORS.get(st, OTHER_COLOR))
        rows["nbytes_text"].append(format_bytes(int(n)))
        rows["ms"].append((b - a) * 1000)


def _time_range(snap: dict[str, Any]) -> tuple[float, float]:
    """The interval the page shows: every span and every rate point of every worker; the
    last ``timeline_seconds`` before the snapshot's time when there are none."""
    starts, ends = [], []
    for w in snap.get("workers", {}).values():
        rates = w.get("rates") or {"time": []}
        starts += [*w["timeline"]["start"], *rates["time"]]
        ends += [*w["timeline"]["end"], *rates["time"]]
    now = float(snap.get("time", time.time()))
    lo = min(starts) if starts else now - float(snap.get("timeline_seconds", 10.0))
    return lo, max(max(ends) if ends else now, lo + 1e-3)


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
    >>> view.update({"time": 0.0, "timeline_seconds": 10.0, "workers": {}})
    >>> view.timeline_source.name
    'overlap-timeline'
    """

    def __init__(self, link_bandwidth: float):
        from bokeh.layouts import column
        from bokeh.models import ColumnDataSource, Div, Range1d

        self.link_bandwidth = link_bandwidth
        self.timeline_source = ColumnDataSource(_empty_rows(), name="overlap-timeline")
        self.x_range = Range1d(0, 1)
        self.header = Div(sizing_mode="stretch_width")
        self.root = column(self.header, sizing_mode="stretch_width")
        self.panels: dict[str, WorkerPanel] = {}

    def update(self, snap: dict[str, Any]) -> None:
        """Show ``snap`` (what ``/overlap.json`` returns)."""
        workers: dict[str, dict[str, Any]] = snap.get("workers", {})
        for gone in set(self.panels) - set(workers):
            self.root.children.remove(self.panels.pop(gone).root)
        lo, hi = _time_range(snap)
        rows = _empty_rows()
        for address in sorted(workers):
            w = workers[address]
            t = w["timeline"]
            lanes = sorted(set(t["stream"]) | {-1, *range(int(w.get("streams", 0) or 0))})
            _add_rows(rows, address, t)
            if address not in self.panels:
                self.panels[address] = WorkerPanel(
                    address, self.x_range, self.timeline_source, self.link_bandwidth
                )
                self.root.children.append(self.panels[address].root)
            self.panels[address].update(w, lanes, w.get("rates") or binned_throughput(t, lo, hi))
        self.timeline_source.data = rows
        self.x_range.start, self.x_range.end = lo * 1000, hi * 1000
        self.header.text = self._header(len(workers), len(rows["worker"]), snap)

    def _header(self, n_workers: int, n_spans: int, snap: dict[str, Any]) -> str:
        legend = ", ".join(
            f'<span style="color:{c}">■ {DISPLAY_NAMES[s]}</span>' for s, c in COLORS.items()
        )
        source = "every worker, asked once" if snap.get("detail") else "the workers' heartbeats"
        return (
            f"<h3>dask_overlap: the assembly line</h3>{n_workers} worker(s) with an "
            f"OverlapPlugin; {n_spans} recent stage spans shown, from {source}. "
            f"Colours: {legend}. Dashed line: link ceiling {self.link_bandwidth / GB:.1f} GB/s."
        )


def render_html(snap: dict[str, Any], path: str, link_bandwidth: float | None = None) -> str:
    """Write the ``/overlap`` page for snapshot ``snap`` as a standalone HTML file.

    Bokeh's JavaScript is inlined, so the file opens with no network. Returns ``path``.

    Examples
    --------
    >>> import json
    >>> render_html(json.load(open("overlap.json")), "overlap.html")  # doctest: +SKIP
    'overlap.html'
    """
    from bokeh.embed import file_html
    from bokeh.resources import INLINE

    # An explicit ceiling wins over the one the snapshot carries.
    given = snap.get("link_bandwidth") if link_bandwidth is None else link_bandwidth
    view = OverlapView(resolve_link_bandwidth(given))
    view.update(snap)
    with open(path, "w") as f:
        f.write(file_html(view.root, INLINE, "dask_overlap: /overlap"))
    return path
