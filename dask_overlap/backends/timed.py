"""The ``timed`` backend: the host backend with a GPU's engines modelled in time.

Each operation takes at least its modelled time (bytes over the modelled bandwidth, or
the kernel's time), and the three engines of a GPU are exclusive, as on the hardware:
one H2D copy at a time across all streams, one kernel at a time, one D2H copy at a
time. Staging copies run in parallel, one per staging thread. So the makespan of a run
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


@contextlib.contextmanager
def _takes_at_least(seconds: float, lock: threading.Lock | None = None) -> Iterator[None]:
    """Hold ``lock`` (if any) while the body runs, for no less than ``seconds``."""
    with lock if lock is not None else contextlib.nullcontext():
        start = time.perf_counter()
        yield
        left = seconds - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)


class TimedBackend(HostBackend):
    """See the module docstring."""

    name = "timed"

    def __init__(self, pinned_pool_size: int, model: TimedModel):
        super().__init__(pinned_pool_size)
        self.model = model
        self.h2d_engine = threading.Lock()
        self.compute_engine = threading.Lock()
        self.d2h_engine = threading.Lock()
        self.default_stream = threading.Lock()

    def stage(self, src: np.ndarray, dst: np.ndarray) -> None:
        with _takes_at_least(src.nbytes / self.model.staging_bandwidth):
            super().stage(src, dst)

    def copy_in(self, stream: Any, host: np.ndarray) -> np.ndarray:
        with _takes_at_least(host.nbytes / self.model.h2d_bandwidth, self.h2d_engine):
            return super().copy_in(stream, host)

    def compute(self, stream: Any, func: Callable[..., Any], args: list, kwargs: dict) -> Any:
        nbytes = sum(a.nbytes for a in args if isinstance(a, np.ndarray))
        with _takes_at_least(self.model.kernel_time(nbytes), self.compute_engine):
            return super().compute(stream, func, args, kwargs)

    def copy_out(self, stream: Any, device: np.ndarray, out: np.ndarray) -> None:
        with _takes_at_least(device.nbytes / self.model.d2h_bandwidth, self.d2h_engine):
            super().copy_out(stream, device, out)

    def naive(self, func: Callable[..., Any], *blocks: np.ndarray, **kwargs: Any) -> np.ndarray:
        m = self.model
        nbytes = sum(b.nbytes for b in blocks)
        with self.default_stream:
            with _takes_at_least(nbytes / m.pageable_h2d_bandwidth):
                dev = [np.array(b, copy=True) for b in blocks]
            with _takes_at_least(m.kernel_time(nbytes)):
                out = func(*dev, **kwargs)
            with _takes_at_least(np.asarray(out).nbytes / m.pageable_d2h_bandwidth):
                return np.array(out, copy=True)
