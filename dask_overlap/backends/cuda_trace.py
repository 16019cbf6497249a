"""Timing events around every copy and kernel of the cuda backend, for pictures of the
assembly line (``benchmarks/diagnostics/timeline_cuda.py``): off unless started, and then one pair
of events per copy or kernel, read once the trace is stopped.

The runner's own stage timings (a few marks per sub-chunk, for the timeline and the
metrics) are the backend's ``mark``/``resolve``; this is the finer, opt-in view.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import cupy

__all__ = ["EventTrace"]

_UNTRACED = contextlib.nullcontext()


class EventTrace:
    """Events around the backend's copies and kernels while started.

    Parameters
    ----------
    device
        The ``cupy.cuda.Device`` whose events these are.
    """

    def __init__(self, device: Any):
        self._device = device
        self.on = False
        self._spans: list[tuple[str, str, Any, Any]] = []
        self._lock = threading.Lock()

    def span(self, stream: Any, stage: str) -> contextlib.AbstractContextManager[None]:
        """Events around ``stage``'s work on ``stream`` (a runner stream, or a CuPy one)
        when started; a shared null context otherwise (this is called per copy)."""
        return self._traced(stream, stage) if self.on else _UNTRACED

    @contextlib.contextmanager
    def _traced(self, stream: Any, stage: str) -> Iterator[None]:
        cs = getattr(stream, "cupy", stream)  # a runner's CudaStream wraps a CuPy stream
        name = getattr(stream, "name", "default")
        start = cupy.cuda.Event()
        start.record(cs)
        try:
            yield
        finally:
            end = cupy.cuda.Event()
            end.record(cs)
            with self._lock:
                self._spans.append((stage, name, start, end))

    def start(self) -> None:
        """Record timing events around every copy and kernel from now on."""
        with self._lock:
            self._spans = []
        self.on = True

    def stop(self) -> list[dict[str, Any]]:
        """Stop; the spans seen, in seconds from the first one's start.

        Returns
        -------
        list of dict
            ``{"stage", "stream", "start", "end"}`` per copy or kernel.
        """
        self.on = False
        with self._lock:
            spans, self._spans = self._spans, []
        if not spans:
            return []
        with self._device:
            for _, _, _, end in spans:
                end.synchronize()
            t0 = min(spans, key=lambda s: cupy.cuda.get_elapsed_time(spans[0][2], s[2]))[2]
            return [
                {
                    "stage": stage,
                    "stream": name,
                    "start": cupy.cuda.get_elapsed_time(t0, start) / 1e3,
                    "end": cupy.cuda.get_elapsed_time(t0, end) / 1e3,
                }
                for stage, name, start, end in spans
            ]
