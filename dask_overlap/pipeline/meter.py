"""The fine performance metrics of one partition task, digested through Dask's
``context_meter`` in the task's own thread."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from .nvtx import nvtx_range
from .stages import label

__all__ = ["TaskMeter", "busy_unit"]


def busy_unit(backend: str) -> str:
    """The unit of stream busy time for ``backend``: never ``seconds``.

    Dask subtracts every ``seconds`` metric from the task's thread time; stream busy time
    overlaps the thread's, so it has a unit of its own.

    Examples
    --------
    >>> busy_unit("cuda"), busy_unit("host")
    ('gpu-seconds', 'stream-seconds')
    """
    return "gpu-seconds" if backend == "cuda" else "stream-seconds"


class TaskMeter:
    """The fine performance metrics of one partition task.

    The partition's driver loop (the task's thread) reports each wait and each finished
    sub-chunk's spans (a span: one stage of one sub-chunk as it ran), and its pinned
    fallbacks when it ends. :meth:`task` digests the totals through ``context_meter`` when the
    partition ends, in the task's thread, and opens an NVTX range for the partition
    meanwhile.

    Attributes
    ----------
    waits
        Seconds the task's thread waited for each stage (``seconds``).
    busy
        Busy seconds of each stage on the streams (:func:`busy_unit`).
    nbytes
        Bytes each stage moved.
    backpressure
        Seconds the task's thread waited for room (a window slot, ring space).

    Parameters
    ----------
    key
        The partition's Dask key.
    backend
        Name of the runtime's backend (``"cuda"``, ``"host"``, ``"timed"``).

    Examples
    --------
    >>> m = TaskMeter(("x", 0), "host")
    >>> m.waited("h2d", 0.5, for_room=False)
    >>> m.spans([("h2d", 1.0, 1.25, 100), ("d2h", 1.25, 1.5, 80)])
    >>> sorted(m.metrics())[:3]  # doctest: +NORMALIZE_WHITESPACE
    [('overlap-d2h', 'bytes', 80), ('overlap-d2h', 'stream-seconds', 0.25),
     ('overlap-h2d', 'bytes', 100)]
    """

    def __init__(self, key: Any, backend: str):
        self.key = key
        self.backend = backend
        self.waits: dict[str, float] = {}
        self.busy: dict[str, float] = {}
        self.nbytes: dict[str, int] = {}
        self.backpressure = 0.0
        self._fallbacks = 0

    def waited(self, stage: Any, seconds: float, for_room: bool) -> None:
        """The task's thread waited ``seconds`` for ``stage`` or, ``for_room``, for room
        in its window or the ring (backpressure, whatever event ended the wait)."""
        if for_room:
            self.backpressure += seconds
            return
        name = str(getattr(stage, "name", stage)).lower()
        self.waits[name] = self.waits.get(name, 0.0) + seconds

    def spans(self, spans: Iterable[tuple[str, float, float, int]]) -> None:
        """One sub-chunk's finished spans: ``(stage, start, end, nbytes)``."""
        for stage, start, end, n in spans:
            self.busy[stage] = self.busy.get(stage, 0.0) + max(0.0, end - start)
            self.nbytes[stage] = self.nbytes.get(stage, 0) + n

    def fallback(self, n: int = 1) -> None:
        """``n`` buffers fell back to ordinary memory."""
        self._fallbacks += n

    def metrics(self) -> list[tuple[str, str, float]]:
        """``(label, unit, value)`` of every non-zero metric so far."""
        unit = busy_unit(self.backend)
        out: list[tuple[str, str, float]] = []
        for stage, s in self.waits.items():
            out.append((label(stage), "seconds", s))
        if self.backpressure:
            out.append(("overlap-backpressure", "seconds", self.backpressure))
        for stage, s in self.busy.items():
            out.append((label(stage), unit, s))
        for stage, n in self.nbytes.items():
            if n and stage != "compute":  # bytes moved, not bytes a kernel read
                out.append((label(stage), "bytes", n))
        if self._fallbacks:
            out.append(("overlap-pinned-fallback", "count", self._fallbacks))
        return [m for m in out if m[2]]

    def digest(self) -> None:
        """Hand the metrics to ``context_meter``; call it in the task's own thread."""
        # Without distributed loaded there is no listener (the threaded scheduler), and
        # importing it here would configure its logging.
        if "distributed.metrics" not in sys.modules:
            return
        from distributed.metrics import context_meter

        listeners = getattr(context_meter, "_callbacks", None)  # a ContextVar of a dict
        if listeners is not None and not listeners.get():
            return  # nobody listens here (not in a worker's task): spare building them
        for lab, unit, value in self.metrics():
            context_meter.digest_metric(lab, value, unit)

    @contextlib.contextmanager
    def task(self) -> Iterator[TaskMeter]:
        """Around a partition's driver loop: an NVTX range, then :meth:`digest`, in this
        thread (``context_meter`` is a ContextVar)."""
        try:
            with nvtx_range(self.backend, self.key):
                yield self
        finally:
            self.digest()
