"""One runtime's numbers now: its counters, its pools against their bounds, the recent
copy rates and how much its stages overlap. The heartbeat entry, the timeline handler
and the Prometheus collector all report these."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..pipeline.meter import busy_unit
from . import timeline

if TYPE_CHECKING:
    from ..pipeline.runtime import Runtime

__all__ = ["RATE_SECONDS", "worker_metrics"]

#: Seconds of timeline behind the recent rates and the overlap efficiency.
RATE_SECONDS = 2.0


def worker_metrics(rt: Runtime, now: float | None = None) -> dict[str, Any]:
    """The runtime's counters, pools, recent rates and overlap.

    Keys: everything :meth:`Runtime.stats` gives, plus ``device_pool_size``,
    ``window_capacity`` (the sub-chunks the running partitions' windows admit, or the
    ``in_flight`` option when none runs), ``h2d_bytes_per_second`` and
    ``d2h_bytes_per_second`` (over the last :data:`RATE_SECONDS` of the timeline),
    ``overlap_efficiency`` (stage busy time over the wall time in which any stage was
    busy, same interval: 1 when the stages run one at a time, about 3 when copy-in,
    kernel and copy-out all overlap), ``busy_unit`` and ``time``.

    Examples
    --------
    >>> from dask_overlap import get_runtime
    >>> worker_metrics(get_runtime("host"))["overlap_efficiency"]
    0.0
    """
    now = time.time() if now is None else now
    out = rt.stats()
    spans = timeline.recent(list(rt.timeline), now, RATE_SECONDS)
    moved, busy, wall = timeline.window_totals(spans, now, RATE_SECONDS)
    out.update(
        device_pool_size=rt.options.device_pool_size,
        window_capacity=out["window_capacity"] or rt.options.in_flight,
        h2d_bytes_per_second=moved["h2d"] / RATE_SECONDS,
        d2h_bytes_per_second=moved["d2h"] / RATE_SECONDS,
        overlap_efficiency=(busy / wall) if wall > 0 else 0.0,
        busy_unit=busy_unit(rt.name),
        time=now,
    )
    out["busy_seconds"] = {k: float(v) for k, v in out["busy_seconds"].items()}
    return out
