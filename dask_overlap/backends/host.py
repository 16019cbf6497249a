"""The ``host`` backend: NumPy arrays stand in for device memory, threads for streams.

Each stream is one thread that runs its queue in order, so the stages of different
sub-chunks really run at the same time, as on a GPU, and the same engine, runner and
pools run and are tested on machines with no GPU.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .base import HostPool, OnDone, requested_bytes

__all__ = ["HostBackend", "HostStream"]

logger = logging.getLogger(__name__)
_STOP = object()
_NO_CACHE = contextlib.nullcontext()


def _run(fn: Callable[[], Any], on_done: OnDone, exclusive: Any) -> None:
    """``fn()`` holding ``exclusive``, then ``on_done(result, error)``; nothing that either
    raises escapes (a stream's thread must outlive any one piece of work)."""
    try:
        with exclusive:
            result = fn()
    except BaseException as e:  # handed to the runner, which re-raises it
        result, error = None, e
    else:
        error = None
    try:
        on_done(result, error)
    except BaseException:
        # The runner's callbacks fail their own sub-chunk (executors._callback), so this
        # is a bug of a callback's own: said, and the stream goes on.
        logger.exception("a host stream's completion callback raised")
    finally:
        # The error's traceback holds this frame, and so the error: without this, the
        # cycle kept what fn's frames held (a sub-chunk's buffers) until the collector
        # ran, where a partition drops every failure but its first.
        del result, error


class HostStream:
    """A thread that runs submitted work in order: the host's stand-in for a stream."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        # One piece of work at a time, whichever thread runs it: the stream is exclusive,
        # as a device's in-order stream is (run() executes on the caller's thread).
        self._busy = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, on_done = item
            # Drop the references after each item: an idle thread must not keep the last
            # sub-chunk's buffers (and through them pinned blocks) alive.
            del item
            _run(fn, on_done, self._busy)
            del fn, on_done

    def submit(self, fn: Callable[[], Any], on_done: OnDone) -> None:
        with self._lock:
            if not self._closed and self._thread.is_alive():
                self._queue.put((fn, on_done))
                return
        # Closed (a runtime closed under a partition still running), or the thread is
        # gone: run it here, after everything queued before, rather than queue it where
        # no thread will ever run it.
        if threading.current_thread() is not self._thread:
            self._thread.join()
        _run(fn, on_done, self._busy)

    def run(self, fn: Callable[[], Any]) -> Any:
        # Host work is synchronous: done when fn returns.
        with self._busy:
            return fn()

    def on_complete(self, callback: Callable[[BaseException | None], None]) -> None:
        # Work on this stream is synchronous, so "completed" is "reached in the queue".
        self.submit(lambda: callback(None), lambda result, error: None)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join()


class HostBackend:
    """NumPy everywhere; see the module docstring."""

    name = "host"
    host_memory = True
    device_id = 0
    sampled_timing = False  # a mark reads the host clock

    def __init__(self, pinned_pool_size: int):
        self.pinned = HostPool(pinned_pool_size)
        self._streams = 0

    def make_stream(self) -> HostStream:
        self._streams += 1
        return HostStream(f"overlap-{self.name}-stream-{self._streams - 1}")

    def is_device(self, x: Any) -> bool:
        return False

    def scratch(self) -> contextlib.AbstractContextManager[None]:
        return _NO_CACHE  # device memory is host memory here: nothing to cache

    def trim(self) -> None:
        pass

    def is_pinned(self, x: np.ndarray) -> bool:
        return self.pinned.owns(x)

    def host_copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        np.copyto(dst, src)

    def copy_in(self, stream: Any, host: np.ndarray) -> np.ndarray:
        # Device memory is host memory: func gets the block itself, as with
        # dask.array.map_blocks (a copy would serve no device, and cost its size again).
        return host

    def copy_in_blocks(self, stream: Any, blocks: Any) -> np.ndarray:
        return np.concatenate(blocks.views(), axis=blocks.axis)

    def compute(self, stream: Any, func: Callable[..., Any], args: list, kwargs: dict) -> Any:
        return func(*args, **kwargs)

    def copy_out(self, stream: Any, device: np.ndarray, out: np.ndarray) -> None:
        np.copyto(out, device)

    def empty_device(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.empty(shape, dtype)

    def join_device(self, blocks: tuple[Any, ...], axis: int) -> np.ndarray:
        return np.concatenate(blocks, axis=axis)

    def wait(self, stream: Any, mark: Any) -> None:
        pass  # host streams run their work synchronously: what was marked has happened

    def place(self, stream: Any, device: np.ndarray, out: np.ndarray) -> None:
        np.copyto(out, device)

    def fetch(self, stream: Any, device: Any) -> np.ndarray:
        return np.asarray(device)

    def as_result(self, x: Any) -> np.ndarray | None:
        if isinstance(x, np.ndarray):
            return x
        if isinstance(x, np.generic):
            return np.asarray(x)
        return None

    def naive(self, func: Callable[..., Any], *blocks: np.ndarray, **kwargs: Any) -> np.ndarray:
        return np.asarray(func(*[np.array(b, copy=True) for b in blocks], **kwargs))

    def mark(self, stream: Any) -> float:
        # Host streams run their work synchronously: the host clock is the device clock.
        return time.time()

    def resolve(self, marks: list[Any]) -> list[float]:
        return list(marks)

    def device_bytes_in_use(self) -> int | None:
        return None

    def describe_oom(self, error: BaseException) -> str | None:
        if not isinstance(error, MemoryError):
            return None
        nbytes = requested_bytes(error)
        asked = "an unknown number of bytes" if nbytes is None else f"{nbytes:,} bytes"
        return f"host memory exhausted when {asked} were asked for"

    def close(self) -> None:
        self.pinned.close()
