"""What the assembly line reports: fine performance metrics, heartbeats, Prometheus, NVTX.

Four outlets, one source (the runtime's counters and its timeline of spans; a span is one
stage of one sub-chunk as it ran):

- **Fine performance metrics** of every partition task, through
  ``distributed.metrics.context_meter`` (:mod:`.task_meter`). A :class:`TaskMeter`
  gathers them while the partition runs and digests them when it ends, in the task's own
  thread: the meter is a ``ContextVar``, so a metric digested on a staging or stream
  thread would be lost. Labels (the *activity* of Dask's page
  ``/individual-fine-performance-metrics``, under the task's prefix and inside
  ``dask.distributed.span`` blocks, Dask's own grouping of computations) are
  ``overlap-<stage>`` with the unit saying what was measured:

  ==========================  ===============================================================
  unit                        meaning
  ==========================  ===============================================================
  ``seconds``                 the task's thread waited for that stage (part of the task's
                              wall time, so Dask subtracts it from ``thread-noncpu``);
                              ``overlap-backpressure`` is the wait for room in the window
  ``gpu-seconds``             busy time of the stage on the streams (``stream-seconds`` on
                              the host and timed backends); it overlaps the host's time, so
                              it has its own unit
  ``bytes``                   bytes staged, copied in (``overlap-h2d``), copied out
  ``count``                   ``overlap-pinned-fallback``: buffers that fell back to
                              ordinary memory because the pinned pool was exhausted
  ==========================  ===============================================================

- **Heartbeats** (:mod:`.worker`): counters, pools, recent rates
  (:mod:`.summary`) and a bounded window of the newest spans (:mod:`.timeline`) in
  ``WorkerState.metrics["overlap"]`` on the scheduler; the ``/overlap`` page reads them.
- **Prometheus** (:mod:`.prometheus`): ``<namespace>_overlap_*`` series on each worker's
  ``/metrics``.
- **NVTX** (:mod:`.nvtx`): ranges named after the Dask key and sub-chunk on the CUDA
  backend, so an Nsight timeline lines up with Dask's task stream.

This package's ``__init__`` imports only what a partition task needs (the meter and
NVTX), neither distributed nor prometheus_client: the partition runner imports it, and
tasks also run without distributed (the threaded scheduler).
"""

from __future__ import annotations

from ..pipeline.meter import TaskMeter, busy_unit
from ..pipeline.nvtx import nvtx_range

__all__ = ["TaskMeter", "busy_unit", "nvtx_range"]
