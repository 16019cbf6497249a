"""The runtime's timeline as it travels: recent spans, as columns.

A span is one stage of one sub-chunk as it ran (:class:`dask_overlap.pipeline.runtime.Span`:
key, sub-chunk, stream, stage, start, end, bytes; times in ``time.time()`` seconds).
:func:`columns` lays spans out as a dict of equal-length lists (``key`` as a string);
:func:`pack` does the same with each key listed once, for heartbeats, and :func:`unpack`
undoes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..pipeline.runtime import Span

__all__ = [
    "COLUMNS",
    "busy_wall_seconds",
    "columns",
    "empty",
    "pack",
    "recent",
    "unpack",
    "window_totals",
]

#: The columns of a timeline, in the order of a span's fields.
COLUMNS = ("key", "sub_chunk", "stream", "stage", "start", "end", "nbytes")


def recent(spans: Sequence[Span], now: float, seconds: float) -> list[Span]:
    """The spans that ended within ``seconds`` of ``now``, oldest first.

    ``spans`` is in completion order (a sub-chunk's spans are kept when it completes), so
    the scan stops at the first span that ended well before the cut-off.
    """
    cutoff = now - seconds
    out = []
    for s in reversed(spans):
        if s.end >= cutoff:
            out.append(s)
        elif s.end < cutoff - 2 * seconds:
            break  # older ones will not qualify either
    out.reverse()
    return out


def window_totals(
    spans: Sequence[Span], now: float, seconds: float
) -> tuple[dict[str, float], float, float]:
    """What ``spans`` did within the last ``seconds`` before ``now``: the bytes each copy
    stage moved there (a copy's bytes spread evenly from its start to its end, as the
    page's throughput bins spread them), the stages' busy seconds there, and the wall
    seconds in which any stage was busy there. Only the part of a span inside the
    window counts: a 10 s kernel that ended just now was busy for 2 s of the last 2.

    Examples
    --------
    >>> from dask_overlap.pipeline.runtime import Span
    >>> copy = Span(("x", 0), 0, 0, "h2d", 0.0, 10.0, 100)  # 100 bytes over 10 s
    >>> spans = [copy, Span(("x", 0), 0, 0, "compute", 9.0, 10.0, 0)]
    >>> moved, busy, wall = window_totals(spans, now=10.0, seconds=2.0)
    >>> moved["h2d"], busy, wall
    (20.0, 3.0, 2.0)
    """
    cut = now - seconds
    moved = {"h2d": 0.0, "d2h": 0.0}
    busy, inside = 0.0, []
    for s in spans:
        start, end = max(s.start, cut), min(s.end, now)
        if end < start:
            continue
        busy += end - start
        inside.append((start, end))
        if s.stage in moved:
            length = s.end - s.start
            moved[s.stage] += s.nbytes * (end - start) / length if length > 0 else s.nbytes
    return moved, busy, busy_wall_seconds(inside)


def busy_wall_seconds(intervals: list[tuple[float, float]]) -> float:
    """Wall time covered by at least one of ``intervals`` (their union's length).

    Examples
    --------
    >>> busy_wall_seconds([(0, 2), (1, 3), (5, 6)])
    4.0
    """
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def empty() -> dict[str, list]:
    """A timeline of no spans."""
    return {c: [] for c in COLUMNS}


def columns(spans: Sequence[Span]) -> dict[str, list]:
    """``spans`` as columns, the key as a string."""
    out = empty()
    for s in spans:
        out["key"].append(str(s.key))
        out["sub_chunk"].append(s.sub_chunk)
        out["stream"].append(s.stream)
        out["stage"].append(s.stage)
        out["start"].append(s.start)
        out["end"].append(s.end)
        out["nbytes"].append(s.nbytes)
    return out


def pack(spans: Sequence[Span]) -> dict[str, list]:
    """:func:`columns`, with each distinct key listed once under ``keys`` and ``key``
    holding indices into it: a partition's many spans share its key.

    Examples
    --------
    >>> from dask_overlap.pipeline.runtime import Span
    >>> packed = pack([Span(("x", 0), 0, 1, "h2d", 1.0, 2.0, 8)] * 2)
    >>> packed["keys"], packed["key"]
    (["('x', 0)"], [0, 0])
    >>> unpack(packed)["key"]
    ["('x', 0)", "('x', 0)"]
    """
    out = columns(spans)
    index: dict[str, int] = {}
    out["key"] = [index.setdefault(k, len(index)) for k in out["key"]]
    out["keys"] = list(index)
    return out


def unpack(packed: dict[str, Any]) -> dict[str, list]:
    """The columns :func:`pack` packed."""
    keys = packed["keys"]
    out = {c: list(packed[c]) for c in COLUMNS}
    out["key"] = [keys[i] for i in packed["key"]]
    return out
