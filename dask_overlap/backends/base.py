"""The backend interface: what the partition runner asks of a device, and nothing more.

A backend has four concerns, each a small protocol here, and :class:`Backend` is all of
them:

- **streams and transfers** (:class:`Transfers`): ordered *streams* (a CUDA stream, or a
  thread standing in for one) and the work put on them: the copy to the device, ``func``,
  the copy back; the runner calls them only through :meth:`Stream.submit` or
  :meth:`Stream.run`, so they run in the stream's order;
- **host copies** (:meth:`Transfers.host_copy`): one copy between host arrays, which the
  copy threads run to stage pageable input into the pinned ring and to unstage results
  out of it;
- **memory** (:class:`Memory`): a bounded *pinned host pool* (:class:`HostPool`), what is
  already on the device or pinned, the device memory a partition borrows, and what an
  out-of-memory error means;
- **clock** (:class:`Clock`): marks in a stream's order, resolved into host times once
  their work has completed (the timeline's spans).

The backends also offer a ``naive(func, *blocks)``: what the usual code does, one step at
a time. It is the benchmarks' and the demo's point of comparison, which the runner never
calls, so it is not part of this interface.
"""

from __future__ import annotations

import contextlib
import re
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

__all__ = [
    "Backend",
    "Clock",
    "HostPool",
    "Memory",
    "Reservation",
    "Stream",
    "Transfers",
    "requested_bytes",
]

OnDone = Callable[[Any, "BaseException | None"], None]


class Stream(Protocol):
    """An ordered queue of device work."""

    def submit(self, fn: Callable[[], Any], on_done: OnDone) -> None:
        """Run ``fn`` in this stream's order; then call ``on_done(result, error)``.

        For a CUDA stream ``fn`` only *enqueues* work, on the caller's thread, and
        ``on_done`` is called when it has been enqueued: later work on the same stream
        is ordered after it. For the host stand-in ``fn`` runs on the stream's thread.
        """

    def run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in this stream's order and wait, on the calling thread, until the
        work it enqueued has completed; return its result or raise its (or the device's)
        error. The lean path of a partition of one sub-chunk: no thread hand-off."""

    def on_complete(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(error)`` once all work submitted so far has *completed*.

        ``error`` is ``None``, or the device error the stream's work ended with (a sticky
        CUDA error): the work cannot be trusted, and the callback must say so. The
        callback runs on another thread: it must only hand the news on (put it in a
        queue), never touch the device or free memory.
        """

    def close(self) -> None:
        """Stop the stream's thread once its queued work is done.

        Work submitted and callbacks asked for afterwards (by a partition still running
        under a closed runtime) still run, on the caller's thread: nothing waits forever.
        """


class Transfers(Protocol):
    """Streams, and the work the runner puts on them (see the module docstring)."""

    def make_stream(self) -> Stream: ...

    def host_copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Host copy of ``src`` into ``dst`` (one piece of a staging or unstaging copy; runs
        on a copy thread)."""

    def copy_in(self, stream: Stream, host: np.ndarray) -> Any:
        """Device copy of ``host``; called in ``stream``'s order."""

    def copy_in_blocks(self, stream: Stream, blocks: Any) -> Any:
        """Device copy of the join of pinned host blocks (a ``pieces.PinnedBlocks``: its
        ``shape``, ``dtype``, ``axis`` and ``parts()``), each part copied into its place;
        called in ``stream``'s order."""

    def compute(self, stream: Stream, func: Callable[..., Any], args: list, kwargs: dict) -> Any:
        """``func(*args, **kwargs)`` on ``stream``; returns a device array."""

    def copy_out(self, stream: Stream, device: Any, out: np.ndarray) -> None:
        """Copy ``device`` into host array ``out`` (pinned or not)."""

    def as_result(self, x: Any) -> Any | None:
        """``x`` as this backend's device array, or ``None`` if it is not an array."""

    def empty_device(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """An uninitialised device array (``out="device"``); called in a stream's order."""

    def join_device(self, blocks: tuple[Any, ...], axis: int) -> Any:
        """``blocks`` (some on the device) joined along ``axis`` into one device array,
        ordered so that a partition's copy-in of a device input waits for it."""

    def place(self, stream: Stream, device: Any, out: Any) -> None:
        """Copy device array ``device`` into device array ``out``, in ``stream``'s order."""

    def fetch(self, stream: Stream, device: Any) -> np.ndarray:
        """A small device array as a new host array, once ``stream``'s work before it has
        completed (a reduction's partial; called in ``stream``'s order, and waits)."""


class Memory(Protocol):
    """Where data lives, and the pools it is borrowed from."""

    pinned: HostPool
    #: Whether device memory is ordinary host memory (a result there is already an
    #: ordinary NumPy array, and a copy to "the device" would serve nothing).
    host_memory: bool
    #: The device this backend runs on (0 where there is one device, or none).
    device_id: int

    def is_device(self, x: Any) -> bool:
        """Whether ``x`` is already a device array (no copy-in needed)."""

    def is_pinned(self, x: np.ndarray) -> bool:
        """Whether host array ``x`` lives in pinned memory (no staging needed)."""

    def scratch(self) -> contextlib.AbstractContextManager[None]:
        """Entered around stream work whose device memory is all let go of when its
        partition ends: the backend may serve it from a cache (emptied by :meth:`trim`)."""

    def trim(self) -> None:
        """Give cached device memory back to the device pool (no partition runs now)."""

    def device_bytes_in_use(self) -> int | None:
        """Bytes the device pool holds, when the backend can tell (else ``None``)."""

    def describe_oom(self, error: BaseException) -> str | None:
        """What ran out and how much was asked, if ``error`` is an out-of-memory error."""


class Clock(Protocol):
    """Marks in a stream's order, and the host times they stand for."""

    #: Whether marks are dear enough (driver calls) that a partition of one sub-chunk
    #: is timed only now and then (see :mod:`dask_overlap.pipeline.sampling`).
    sampled_timing: bool

    def mark(self, stream: Stream) -> Any:
        """A point in ``stream``'s order (called in stream order, around each operation)."""

    def wait(self, stream: Stream, mark: Any) -> None:
        """Order ``stream``'s next work after ``mark`` (made by :meth:`mark` on another)."""

    def resolve(self, marks: list[Any]) -> list[float]:
        """The ``time.time()`` at which each mark was reached on the device.

        Called only after the marks' stream work has completed (for CUDA: events).
        """


class Backend(Transfers, Memory, Clock, Protocol):
    """One device's operations: the four concerns of the module docstring."""

    name: str

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

    The pool is the pipeline's *working set* (the pinned ring): every sub-chunk reserves
    what it will stage in and copy out before it is admitted (:meth:`reserve`, which never
    blocks), takes its buffers from that reservation, and gives them back when its
    copies have completed. A partition that finds no room holds nothing while it waits
    (:meth:`wait_for_room`), so waiting never deadlocks.

    Blocks that somebody keeps (:meth:`allocate`: pinned *results* with ``out="pinned"``,
    pinned input a user loads into the pool) are bounded by ``hold_limit``, half the pool,
    so that they can never take the ring's other half: a reservation of at most
    :attr:`ring_limit` bytes always fits once the other reservations are given back.

    A buffer returns to the pool when the last NumPy view of it is garbage collected.
    Subclasses provide the memory itself in :meth:`_raw`, and may round sizes up in
    :meth:`charge` (what a block really takes from the pool).
    """

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.hold_limit = self.limit // 2
        # Re-entrant: a block's finalizer gives its bytes back under this lock, and the
        # collector may run it in a thread that holds the lock already (a pass at any
        # allocation, wait_for_room's predicate included): with a plain Lock, that thread
        # waited on itself and the whole pool behind it.
        self._cond = threading.Condition(threading.RLock())
        self.in_use = 0  # bytes charged: blocks handed out plus reservations not yet taken
        self.held = 0  # bytes of kept blocks (allocate())
        self.peak = 0
        self.allocations = 0
        self.waits = 0  # wait_for_room calls that had to wait
        # blocks the allocator refused although the budget had room for them (a fixed-size
        # pool that is fragmented): each is a fallback, counted by the caller as well
        self.refused = 0
        # id(owner) -> owner, to recognise arrays that live in this pool
        self._owners: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()

    # -- what subclasses provide -----------------------------------------------------------
    def _raw(self, nbytes: int) -> tuple[np.ndarray, Callable[[], None] | None]:
        """A ``uint8`` array of ``nbytes`` and a function that gives its memory back."""
        return np.empty(nbytes, dtype=np.uint8), None

    def charge(self, nbytes: int) -> int:
        """The bytes a block of ``nbytes`` takes from the pool."""
        return int(nbytes)

    # -- the budget --------------------------------------------------------------------
    def _try_charge(self, charged: int, held: bool = False) -> bool:
        with self._cond:
            if self.in_use + charged > self.limit or (
                held and self.held + charged > self.hold_limit
            ):
                return False
            self.in_use += charged
            if held:
                self.held += charged
            self.peak = max(self.peak, self.in_use)
            return True

    def _uncharge(self, charged: int, held: bool = False) -> None:
        if not charged:
            return
        with self._cond:
            self.in_use -= charged
            if held:
                self.held -= charged
            self._cond.notify_all()

    def _block(self, nbytes: int, charged: int, held: bool) -> np.ndarray | None:
        """A block for bytes already charged. On any failure the charge is given back
        (not only on MemoryError: nothing leaks); ``None`` when memory was short."""
        try:
            owner, give_back = self._raw(nbytes)
            self._owners[id(owner)] = owner
            weakref.finalize(owner, self._release, charged, held, give_back)
        except MemoryError:
            self._uncharge(charged, held)
            with self._cond:
                self.refused += 1
            return None  # out of memory (or fragmented): the caller falls back, counted
        except BaseException:
            self._uncharge(charged, held)
            raise
        with self._cond:
            self.allocations += 1
        return owner

    def _release(self, charged: int, held: bool, give_back: Callable[[], None] | None) -> None:
        try:
            if give_back is not None:
                give_back()
        finally:
            self._uncharge(charged, held)

    def _take(self, nbytes: int, held: bool) -> np.ndarray | None:
        charged = self.charge(nbytes)
        if not self._try_charge(charged, held):
            return None
        return self._block(nbytes, charged, held)

    # -- the API -------------------------------------------------------------------------
    @property
    def ring_limit(self) -> int:
        """The bytes the ring can always have: what kept blocks can never take."""
        return self.limit - self.hold_limit

    def allocate(self, nbytes: int) -> np.ndarray | None:
        """A block to keep (a pinned result or input), or ``None`` when the pool, or its
        ``hold_limit`` for kept blocks, has no room. Never waits."""
        return self._take(nbytes, held=True)

    def reserve(self, nbytes: int) -> Reservation | None:
        """``nbytes`` of room, charged now and taken later; ``None`` when there is none now."""
        charged = self.charge(nbytes)
        if not self._try_charge(charged):
            return None
        return Reservation(self, charged)

    def wait_for_room(self, nbytes: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until ``nbytes`` would fit; whether they would.

        Only a caller that holds nothing of the pool may wait (see the class docstring).
        """
        charged = self.charge(nbytes)
        with self._cond:
            if self.in_use + charged <= self.limit:
                return True
            self.waits += 1
            return self._cond.wait_for(lambda: self.in_use + charged <= self.limit, timeout)

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


class Reservation:
    """Room in a :class:`HostPool`, charged up front and taken as blocks (one owner)."""

    __slots__ = ("_pool", "left")

    def __init__(self, pool: HostPool, charged: int):
        self._pool = pool
        self.left = charged

    def take(self, nbytes: int) -> np.ndarray | None:
        """A block of ``nbytes`` from the reserved room (or, past it, from free room now);
        ``None`` when neither has it."""
        pool = self._pool
        charged = pool.charge(nbytes)
        if charged <= self.left:
            self.left -= charged
        elif pool._try_charge(charged - self.left):
            self.left = 0
        else:
            return None
        return pool._block(nbytes, charged, False)

    def close(self) -> None:
        """Give back the room not taken. Idempotent."""
        left, self.left = self.left, 0
        self._pool._uncharge(left)
