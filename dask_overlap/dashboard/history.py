"""The recent past of each worker on the scheduler, gathered from heartbeats.

Each heartbeat of a worker with an :class:`~dask_overlap.OverlapPlugin` carries its
numbers and the newest spans of its last few seconds of activity
(:func:`dask_overlap.metrics.worker.heartbeat`). Consecutive heartbeats carry overlapping
windows; a :class:`WorkerHistory` merges them, each span once, into the spans of the
last ``seconds`` (at most ``limit``, the newest), and keeps the copy rates each heartbeat
reported. Histories grow when they are read (:meth:`Histories.update`, whenever the page
or ``/overlap.json`` asks): a heartbeat that nobody read before the next replaced it is
not merged, so the page's past begins about when someone opened it; a first read shows
what the latest heartbeat carries (the newest spans of the last two seconds of activity,
for ten seconds after it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..metrics.summary import RATE_SECONDS
from ..metrics.timeline import COLUMNS, empty, unpack
from ..metrics.worker import METRICS_NAME

__all__ = ["Histories", "WorkerHistory"]

_END = COLUMNS.index("end")


class WorkerHistory:
    """One worker's recent spans and copy rates, merged from its heartbeats.

    Parameters
    ----------
    seconds
        Keep the spans that ended at most this long before the newest one, and the rates
        of the heartbeats in that interval (times on the worker's clock).
    limit
        Keep at most this many spans (the newest).

    Examples
    --------
    >>> h = WorkerHistory(seconds=10.0, limit=100)
    >>> beat = {"time": 5.0, "h2d_bytes_per_second": 1e9, "d2h_bytes_per_second": 0.0}
    >>> beat["recent"] = {"keys": ["x"], "key": [0], "sub_chunk": [0], "stream": [0],
    ...     "stage": ["h2d"], "start": [4.0], "end": [4.5], "nbytes": [8]}
    >>> h.merge(beat)
    >>> h.merge(beat)  # the same heartbeat again: nothing new
    >>> h.timeline()["end"], h.rates()["h2d"]
    ([4.5], [1000000000.0])
    """

    def __init__(self, seconds: float, limit: int):
        self.seconds = seconds
        self.limit = limit
        # Span rows (in COLUMNS order) by identity: key, sub-chunk, stage and start name
        # one span, however many heartbeats carried it.
        self._rows: dict[tuple, tuple] = {}
        self._rates: list[tuple[float, float, float]] = []  # (time, h2d, d2h)
        self.beat: float | None = None  # ``time`` of the last heartbeat merged

    def merge(self, entry: dict[str, Any]) -> None:
        """Merge one heartbeat entry (``WorkerState.metrics["overlap"]``)."""
        now = entry.get("time")
        if now is None or now == self.beat:
            return
        self.beat = now
        recent = entry.get("recent")
        if recent:
            cols = unpack(recent)
            for row in zip(*(cols[c] for c in COLUMNS), strict=True):
                self._rows.setdefault((row[0], row[1], row[3], row[4]), row)
        self._rates.append(
            (now, entry.get("h2d_bytes_per_second", 0.0), entry.get("d2h_bytes_per_second", 0.0))
        )
        # The last ``seconds`` of activity, not of the clock: what a page open during a run
        # gathered stays on it afterwards, until newer spans push it out.
        horizon = max((row[_END] for row in self._rows.values()), default=now)
        cutoff = horizon - self.seconds
        kept = sorted(
            (kv for kv in self._rows.items() if kv[1][_END] >= cutoff), key=lambda kv: kv[1][_END]
        )
        self._rows = dict(kept[-self.limit :] if self.limit > 0 else [])
        # Rates after the horizon by more than the workers' averaging interval are zeros
        # that say nothing the timeline does not: dropped, so an idle history stays bounded.
        last = horizon + RATE_SECONDS
        self._rates = [r for r in self._rates if cutoff <= r[0] <= last]

    def timeline(self) -> dict[str, list]:
        """The spans kept, as columns (``key`` a string), oldest end first."""
        out = empty()
        for row in self._rows.values():
            for c, v in zip(COLUMNS, row, strict=True):
                out[c].append(v)
        return out

    def rates(self) -> dict[str, list]:
        """The copy rates heartbeats reported: ``time`` (seconds), ``h2d``, ``d2h``
        (bytes/s, each averaged by the worker over its last few seconds)."""
        return {
            "time": [r[0] for r in self._rates],
            "h2d": [r[1] for r in self._rates],
            "d2h": [r[2] for r in self._rates],
        }


class Histories:
    """A :class:`WorkerHistory` per worker that reports overlap metrics.

    Parameters
    ----------
    seconds, limit
        As for :class:`WorkerHistory`.
    """

    def __init__(self, seconds: float, limit: int):
        self.seconds = seconds
        self.limit = limit
        self._by_address: dict[str, WorkerHistory] = {}

    def update(self, workers: Iterable[Any]) -> list[tuple[Any, WorkerHistory]]:
        """Merge the latest heartbeat of each of ``workers`` (the scheduler's
        ``WorkerState`` objects) that carries overlap metrics; return ``(ws, history)``
        for those, by address, and forget the histories of workers gone or without them."""
        live = {ws.address: ws for ws in workers if METRICS_NAME in ws.metrics}
        for gone in set(self._by_address) - set(live):
            del self._by_address[gone]
        out = []
        for address in sorted(live):
            ws = live[address]
            history = self._by_address.get(address)
            if history is None:
                history = self._by_address[address] = WorkerHistory(self.seconds, self.limit)
            history.merge(ws.metrics[METRICS_NAME])
            out.append((ws, history))
        return out
