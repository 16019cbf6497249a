"""``<namespace>_overlap_*`` series on a worker's ``/metrics``, the way distributed adds its own.

:class:`OverlapCollector` is a :class:`distributed.http.prometheus.PrometheusCollector`
with the subsystem ``overlap``: its series are named ``<namespace>_overlap_<name>``,
``<namespace>`` being ``distributed.dashboard.prometheus.namespace`` (``dask`` by
default; read, as distributed reads it, when the collector is made: at the first
:func:`report` in a process). Like distributed's own collectors it is registered once
per process with ``prometheus_client.REGISTRY``, which every worker's ``/metrics``
serves. A process may run several workers (``LocalCluster(processes=False)``), so the
collector reports each worker :func:`report` named, under a ``worker`` label; a worker
whose runtime is closed is left out.

Series (counters get prometheus_client's ``_total`` suffix): ``partitions``,
``partitions_failed``, ``sub_chunks``, ``sub_chunks_estimated``, ``pinned_fallbacks``,
``backpressure_seconds``,
``bytes`` (label ``direction``: staged, h2d, d2h, unstaged), ``busy_seconds`` (label
``stage``); gauges ``partitions_active``, ``in_flight``, ``window_capacity``,
``pinned_in_use_bytes``, ``pinned_pool_size_bytes``, ``device_in_use_bytes``,
``device_pool_size_bytes``, ``result_idle_bytes``, ``stage_overlap_ratio`` (the
runtime's ``overlap_efficiency``), ``throughput_bytes_per_second`` (label ``direction``:
h2d, d2h).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from distributed.http.prometheus import PrometheusCollector

from ..process import Registry
from .summary import worker_metrics

if TYPE_CHECKING:
    from ..pipeline.runtime import Runtime

__all__ = ["COUNTERS", "GAUGES", "OverlapCollector", "forget", "report"]

#: Counter series: help text.
COUNTERS = {
    "partitions": "Partition tasks run",
    "partitions_failed": "Partition tasks that failed",
    "sub_chunks": "Sub-chunks run",
    "sub_chunks_estimated": "Sub-chunks whose stage times were estimated, not timed on the device",
    "pinned_fallbacks": "Buffers that fell back to ordinary memory (pinned pool exhausted)",
    "backpressure_seconds": "Seconds partition tasks waited for room in their window",
}
#: Gauge series: the runtime's key, and the series' name (a unit last, as Prometheus
#: names go) and help text.
GAUGES = {
    "partitions_active": ("partitions_active", "Partition tasks running now"),
    "in_flight": ("in_flight", "Sub-chunks in flight now"),
    "window_capacity": ("window_capacity", "Sub-chunks the running partitions' windows admit"),
    "pinned_bytes_in_use": ("pinned_in_use_bytes", "Bytes of the pinned host pool in use"),
    "pinned_pool_size": ("pinned_pool_size_bytes", "Bound of the pinned host pool"),
    "device_bytes_in_use": ("device_in_use_bytes", "Device bytes in use"),
    "device_pool_size": ("device_pool_size_bytes", "Bound of the device pool"),
    "result_bytes_idle": ("result_idle_bytes", "Bytes of result memory kept for reuse, unused"),
    "overlap_efficiency": (
        "stage_overlap_ratio",
        "Stage busy time over the wall time any stage was busy, recent (1: one at a time)",
    ),
}

# The runtimes the collector reports, by worker address (forgotten in a forked child,
# whose workers, if any, report their own).
_reported: Registry[str, Runtime] = Registry("runtimes on /metrics, by worker address")
# The process's collector: made and registered once. Not in a Registry on purpose: after
# a fork the child's prometheus_client.REGISTRY still holds it, so it must not be made
# and registered a second time.
_collector: OverlapCollector | None = None
_collector_lock = threading.Lock()


class OverlapCollector(PrometheusCollector):
    """The ``overlap`` subsystem's series of every reported worker of this process.

    ``server`` is ``None``: one collector serves every worker of the process (see the
    module's documentation), so it reads the reported runtimes, not one server.

    Examples
    --------
    >>> OverlapCollector().build_name("in_flight")  # with the default namespace
    'dask_overlap_in_flight'
    """

    def __init__(self) -> None:
        super().__init__(server=None)
        self.subsystem = "overlap"

    def describe(self) -> list:
        # No names up front: prometheus_client then neither checks them against the other
        # collectors' nor calls collect() at registration.
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        counters = {
            k: CounterMetricFamily(self.build_name(k), h, labels=["worker"])
            for k, h in COUNTERS.items()
        }
        gauges = {
            k: GaugeMetricFamily(self.build_name(name), h, labels=["worker"])
            for k, (name, h) in GAUGES.items()
        }
        moved = CounterMetricFamily(
            self.build_name("bytes"), "Bytes moved, by direction", labels=["worker", "direction"]
        )
        rate = GaugeMetricFamily(
            self.build_name("throughput_bytes_per_second"),
            "Recent copy throughput, by direction",
            labels=["worker", "direction"],
        )
        busy = CounterMetricFamily(
            self.build_name("busy_seconds"), "Busy time of each stage", labels=["worker", "stage"]
        )
        with _reported.lock:
            reported = sorted(_reported.items.items())
        for address, rt in reported:
            if rt.closed:
                continue
            try:
                m = worker_metrics(rt)
            except Exception:  # a runtime closing under us: skip it this scrape
                continue
            for k, family in (*counters.items(), *gauges.items()):
                family.add_metric([address], m[k])
            for d in ("staged", "h2d", "d2h", "unstaged"):
                moved.add_metric([address, d], m[f"bytes_{d}"])
            rate.add_metric([address, "h2d"], m["h2d_bytes_per_second"])
            rate.add_metric([address, "d2h"], m["d2h_bytes_per_second"])
            for stage, s in m["busy_seconds"].items():
                busy.add_metric([address, stage], s)
        yield from counters.values()
        yield from gauges.values()
        yield from (moved, rate, busy)


def report(address: str, rt: Runtime) -> None:
    """Report ``rt`` under ``worker=address`` (registers the collector on first use)."""
    with _reported.lock:
        _reported.items[address] = rt
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # prometheus_client is optional (the dashboard extra)
        return
    global _collector
    with _collector_lock:
        if _collector is None:
            _collector = OverlapCollector()
            REGISTRY.register(_collector)


def forget(address: str) -> None:
    """Stop reporting the worker at ``address``."""
    with _reported.lock:
        _reported.items.pop(address, None)
