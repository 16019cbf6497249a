"""The ``timed`` backend: the host backend with a GPU's engines modelled in time.

Each operation takes at least its modelled time (bytes over the modelled bandwidth, or
the kernel's time), and the three engines of a GPU are exclusive, as on the hardware:
one H2D copy at a time across all streams, one kernel at a time, one D2H copy at a
time. Staging and unstaging copies run in parallel, one per copy thread. So the makespan of a run
can never beat its slowest engine, and the engine's overlap shows as how close it comes
to that bound, on any machine. The naive path holds one lock for its whole
copy-in/compute/copy-out, like work on CUDA's legacy default stream.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..config import TimedModel
from .host import HostBackend

__all__ = ["TimedBackend"]


class _Engine:
    """One exclusive engine, modelled as a queue in virtual time.

    An operation that arrives while the engine is busy starts, in the model, when the one
    before it ends, not when the host thread wakes up to release it: the host's wake-up
    latency (on a loaded machine, a GIL switch interval or more) is not the device's.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free_at = 0.0

    @contextlib.contextmanager
    def run(self, seconds: float) -> Iterator[None]:
        arrival = time.perf_counter()
        with self.lock:
            start = max(arrival, self.free_at)
            yield
            end = max(start + seconds, time.perf_counter())
            left = end - time.perf_counter()
            if left > 0:
                time.sleep(left)
            self.free_at = end


@contextlib.contextmanager
def _takes_at_least(seconds: float) -> Iterator[None]:
    """The body, taking no less than ``seconds`` (an engine of its own: copy threads)."""
    start = time.perf_counter()
    yield
    left = seconds - (time.perf_counter() - start)
    if left > 0:
        time.sleep(left)


class TimedBackend(HostBackend):
    """See the module docstring."""

    name = "timed"
    host_memory = False  # it models a device, whose results must be copied out
    sampled_timing = False  # its marks are the host clock

    def __init__(self, pinned_pool_size: int, model: TimedModel):
        super().__init__(pinned_pool_size)
        self.model = model
        self.h2d_engine = _Engine()
        self.compute_engine = _Engine()
        self.d2h_engine = _Engine()
        self.default_stream = _Engine()

    def host_copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        # Staging and unstaging alike: a host copy on the copy threads.
        with _takes_at_least(src.nbytes / self.model.staging_bandwidth):
            super().host_copy(src, dst)

    def copy_in(self, stream: Any, host: np.ndarray) -> np.ndarray:
        with self.h2d_engine.run(host.nbytes / self.model.h2d_bandwidth):
            # A device copy, as cupy.asarray makes: it keeps the input's layout.
            return np.array(host, copy=True)

    def copy_in_blocks(self, stream: Any, blocks: Any) -> np.ndarray:
        with self.h2d_engine.run(blocks.nbytes / self.model.h2d_bandwidth):
            return super().copy_in_blocks(stream, blocks)

    def compute(self, stream: Any, func: Callable[..., Any], args: list, kwargs: dict) -> Any:
        nbytes = sum(a.nbytes for a in args if isinstance(a, np.ndarray))
        with self.compute_engine.run(self.model.kernel_time(nbytes)):
            return super().compute(stream, func, args, kwargs)

    def copy_out(self, stream: Any, device: np.ndarray, out: np.ndarray) -> None:
        with self.d2h_engine.run(device.nbytes / self.model.d2h_bandwidth):
            super().copy_out(stream, device, out)

    def naive(self, func: Callable[..., Any], *blocks: np.ndarray, **kwargs: Any) -> np.ndarray:
        m = self.model
        nbytes = sum(b.nbytes for b in blocks)
        # One engine for the whole round trip: work on the legacy default stream takes turns.
        seconds = nbytes / m.pageable_h2d_bandwidth + m.kernel_time(nbytes)
        with self.default_stream.run(seconds + nbytes / m.pageable_d2h_bandwidth):
            dev = [np.array(b, copy=True) for b in blocks]
            out = func(*dev, **kwargs)
            return np.array(out, copy=True)
