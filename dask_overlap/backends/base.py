"""The backend interface: what the partition runner asks of a device, and nothing more.

A backend provides ordered *streams* (a CUDA stream, or a thread standing in for one), a
bounded *pinned host pool*, and four operations: ``stage`` (host copy into pinned memory),
``copy_in``, ``compute`` and ``copy_out``. The runner calls ``copy_in``, ``compute`` and
``copy_out`` only through :meth:`Stream.submit`, so they run in the stream's order.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

__all__ = ["Backend", "HostPool", "Stream", "requested_bytes"]

OnDone = Callable[[Any, "BaseException | None"], None]


class Stream(Protocol):
    """An ordered queue of device work."""

    def submit(self, fn: Callable[[], Any], on_done: OnDone) -> None:
        """Run ``fn`` in this stream's order; then call ``on_done(result, error)``.

        For a CUDA stream ``fn`` only *enqueues* work, on the caller's thread, and
        ``on_done`` is called when it has been enqueued: later work on the same stream
        is ordered after it. For the host stand-in ``fn`` runs on the stream's thread.
        """

    def on_complete(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once all work submitted so far has *completed*.

        The callback may run on a foreign thread (a CUDA driver thread): it must only
        hand the news on (put it in a queue), never touch the device or free memory.
        """

    def close(self) -> None:
        """Stop the stream's thread once its queued work is done.

        Work submitted and callbacks asked for afterwards (by a partition still running
        under a closed runtime) still run, on the caller's thread: nothing waits forever.
        """


class Backend(Protocol):
    """One device's operations (see the module docstring)."""

    name: str
    pinned: HostPool

    def make_stream(self) -> Stream: ...

    def is_device(self, x: Any) -> bool:
        """Whether ``x`` is already a device array (no copy-in needed)."""

    def is_pinned(self, x: np.ndarray) -> bool:
        """Whether host array ``x`` lives in pinned memory (no staging needed)."""

    def stage(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Host copy of pageable ``src`` into pinned ``dst`` (runs on a staging thread)."""

    def copy_in(self, stream: Stream, host: np.ndarray) -> Any:
        """Device copy of ``host``; called in ``stream``'s order."""

    def compute(self, stream: Stream, func: Callable[..., Any], args: list, kwargs: dict) -> Any:
        """``func(*args, **kwargs)`` on ``stream``; returns a device array."""

    def copy_out(self, stream: Stream, device: Any, out: np.ndarray) -> None:
        """Copy ``device`` into host array ``out`` (pinned or not)."""

    def as_result(self, x: Any) -> Any | None:
        """``x`` as this backend's device array, or ``None`` if it is not an array."""

    def empty_device(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """An uninitialised device array (``out="device"``); called in a stream's order."""

    def wait(self, stream: Stream, mark: Any) -> None:
        """Order ``stream``'s next work after ``mark`` (made by :meth:`mark` on another)."""

    def place(self, stream: Stream, device: Any, out: Any) -> None:
        """Copy device array ``device`` into device array ``out``, in ``stream``'s order."""

    def naive(self, func: Callable[..., Any], *blocks: np.ndarray, **kwargs: Any) -> np.ndarray:
        """What the usual code does: copy in, compute, copy out, one step at a time."""

    def mark(self, stream: Stream) -> Any:
        """A point in ``stream``'s order (called in stream order, around each operation)."""

    def resolve(self, marks: list[Any]) -> list[float]:
        """The ``time.time()`` at which each mark was reached on the device.

        Called only after the marks' stream work has completed (for CUDA: events).
        """

    def device_bytes_in_use(self) -> int | None:
        """Bytes the device pool holds, when the backend can tell (else ``None``)."""

    def describe_oom(self, error: BaseException) -> str | None:
        """What ran out and how much was asked, if ``error`` is an out-of-memory error."""

    def close(self) -> None: ...


def requested_bytes(error: BaseException) -> int | None:
    """The bytes an out-of-memory ``error`` says were asked for, when it says.

    Examples
    --------
    >>> requested_bytes(MemoryError("Out of memory allocating 1,024 bytes."))
    1024
    >>> requested_bytes(MemoryError()) is None
    True
    """
    # Set by the cuda backend's allocator; NumPy's _ArrayMemoryError keeps its size here.
    for attr in ("requested_bytes", "_total_size"):
        nbytes = getattr(error, attr, None)
        if isinstance(nbytes, int):
            return nbytes
    found = re.search(r"allocat\w* ([\d,]+) bytes", str(error))  # CuPy's message
    return int(found.group(1).replace(",", "")) if found else None


class HostPool:
    """A bounded pool of host buffers, handed out as ``uint8`` NumPy arrays.

    ``allocate`` returns ``None`` when the bound would be exceeded (the caller falls back
    to ordinary memory and counts it), so a full pool never blocks and never deadlocks.
    A buffer returns to the pool when the last NumPy view of it is garbage collected,
    which is how a pinned output handed to Dask stays alive exactly as long as Dask holds
    it. Subclasses provide the memory itself in :meth:`_raw`.
    """

    def __init__(self, limit: int):
        self.limit = int(limit)
        self._lock = threading.Lock()
        self.in_use = 0
        self.peak = 0
        self.allocations = 0
        # id(owner) -> owner, to recognise arrays that live in this pool
        self._owners: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()

    def _raw(self, nbytes: int) -> tuple[np.ndarray, Callable[[], None] | None]:
        """A ``uint8`` array of ``nbytes`` and a function that gives its memory back."""
        return np.empty(nbytes, dtype=np.uint8), None

    def allocate(self, nbytes: int) -> np.ndarray | None:
        nbytes = int(nbytes)
        with self._lock:
            if self.in_use + nbytes > self.limit:
                return None
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            self.allocations += 1
        try:
            owner, give_back = self._raw(nbytes)
        except MemoryError:
            with self._lock:
                self.in_use -= nbytes
            return None
        self._owners[id(owner)] = owner
        weakref.finalize(owner, self._release, nbytes, give_back)
        return owner

    def _release(self, nbytes: int, give_back: Callable[[], None] | None) -> None:
        if give_back is not None:
            give_back()
        with self._lock:
            self.in_use -= nbytes

    def owns(self, x: np.ndarray) -> bool:
        """Whether ``x`` is (a view of) a buffer of this pool."""
        a: Any = x
        while isinstance(a, np.ndarray):
            if self._owners.get(id(a)) is a:
                return True
            a = a.base
        return False

    def close(self) -> None:
        """Nothing to free eagerly: buffers go back as their views are collected."""
