"""Result memory used again: a bounded pool of pageable buffers for partitions' results.

An ``out="host"`` result is an ordinary NumPy array that the copy threads fill from the
pinned ring. Made with ``np.empty``, a large one is fresh memory from the kernel
(glibc maps every allocation above 32 MiB on its own and unmaps it when freed), so
whoever writes it first pays a page fault and the kernel's zeroing for every page:
writing 256 MiB into fresh memory ran at half the rate of writing it into memory
touched before (6.2 against 12.9 GB/s on the 2-core CPU machine). A stream of results
that Dask lets go soon (a pipeline that stores them, a worker that runs job after job)
pays that on every block.

:class:`ResultPool` makes results over buffers it keeps: each result's memory belongs
to a :class:`_Lease`, at the end of the ``base`` chain of the result and of every view
of it, and when the last of them goes the buffer comes back to the pool, already
touched. The pool keeps at most ``capacity`` bytes of buffers that no result uses;
beyond that, a buffer given back is freed (the oldest first), so what the process holds
is the results alive plus at most ``capacity``. ``capacity`` 0 turns it off
(``np.empty`` as before).

The pool serves results that Dask lets go while later ones are made: a worker that runs
job after job, each job's results let go before the next. On an H100 (8 GiB of pageable
float32 in 256 MiB partitions, persisted run after run, each run's results let go before
the next), a pool of 8 GiB made the runs 1.17 (``split_axis=0``) and 1.25 (whole
partitions) times as fast as fresh memory, median of three pairs in turn
(``benchmarks/diagnostics/result_reuse.py``). Where something else sets the pace (a
store target that takes each block with one thread's copy) it changes nothing.

``overlap.result-pool-size: auto`` (:func:`result_pool_bytes`) is at most 4 GiB and at
most an eighth of the memory the process may use: a distributed worker's memory limit,
else the machine's (as distributed reads it, within a cgroup's limit). Idle buffers are
memory that Dask counts as unmanaged, so a worker keeps them well under its pause
threshold, and the runtime frees them once it has run no partition for a few seconds
(``runtime.RESULTS_IDLE_SECONDS``): a worker paused for its memory gets them back.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import Any

import numpy as np

__all__ = [
    "AUTO_POOL_BYTES",
    "AUTO_POOL_SHARE",
    "MIN_RECYCLED_BYTES",
    "ResultPool",
    "result_pool_bytes",
]

#: Smaller results are made with ``np.empty``: glibc's heap reuses their memory itself.
MIN_RECYCLED_BYTES = 1 << 20
#: ``result-pool-size: auto`` keeps at most this many bytes idle...
AUTO_POOL_BYTES = 4 << 30
#: ...and at most this fraction (one over it) of the memory the process may use.
AUTO_POOL_SHARE = 8


def result_pool_bytes(setting: int | str, memory_limit: int | None = None) -> int:
    """The capacity of a runtime's pool for ``overlap.result-pool-size`` = ``setting``:
    a number of bytes as it is; ``auto`` at most :data:`AUTO_POOL_BYTES` and at most an
    :data:`AUTO_POOL_SHARE`-th of ``memory_limit`` (a distributed worker's), or where
    there is none, of the memory distributed finds for this process (the machine's, or
    a cgroup's limit).

    Examples
    --------
    >>> GiB = 2**30
    >>> result_pool_bytes("auto", 64 * GiB) // GiB, result_pool_bytes("auto", 8 * GiB) // GiB
    (4, 1)
    >>> result_pool_bytes(0, 64 * GiB), result_pool_bytes(123)
    (0, 123)
    """
    if setting != "auto":
        return int(setting)
    if not memory_limit:
        from distributed.system import MEMORY_LIMIT

        memory_limit = MEMORY_LIMIT
    return int(min(AUTO_POOL_BYTES, memory_limit // AUTO_POOL_SHARE))


class _Lease:
    """The owner of one pooled buffer while results use it: an array made over it
    (``np.asarray``) and every view of that array keep it alive through their ``base``
    chain, and when the last of them goes, the buffer goes back to its pool."""

    __slots__ = ("__array_interface__", "_pool", "_raw")

    def __init__(self, pool: ResultPool, raw: np.ndarray):
        self._pool, self._raw = pool, raw
        self.__array_interface__ = raw.__array_interface__

    def __del__(self) -> None:
        try:
            self._pool.give_back(self._raw)
        except Exception:  # pragma: no cover - interpreter shutdown: the memory is freed
            pass


class ResultPool:
    """A bounded pool of pageable buffers that results are made in (see the module
    docstring). Safe to use from any thread; buffers come back from whichever thread
    drops a result's last reference."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        # Idle buffers by size, and every idle buffer in the order it came back (the
        # oldest is freed first when the pool is over its capacity).
        self._idle: dict[int, list[np.ndarray]] = collections.defaultdict(list)
        self._order: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self.idle_bytes = 0
        self.closed = False  # closed: buffers given back are freed, none kept
        self.returned_at = 0.0  # time.monotonic() of the last buffer given back
        self.reused = 0  # results made over a buffer used before
        self.fresh = 0  # results that needed a new buffer
        # Re-entrant: a lease can be collected (and give its buffer back) while this
        # thread holds the lock.
        self._lock = threading.RLock()

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype``, over a buffer of the pool
        where one of its size is idle (else a new one, which comes back to the pool when
        the array and its views go)."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_RECYCLED_BYTES or nbytes > self.capacity or dtype.hasobject:
            return np.empty(shape, dtype)
        raw = None
        with self._lock:
            idle = self._idle.get(nbytes)
            if idle:
                raw = idle.pop()
                del self._order[id(raw)]
                self.idle_bytes -= nbytes
                self.reused += 1
            else:
                self.fresh += 1
        if raw is None:
            raw = np.empty(nbytes, np.uint8)
        return np.asarray(_Lease(self, raw)).view(dtype).reshape(shape)

    def give_back(self, raw: np.ndarray) -> None:
        """Keep ``raw`` (no result uses it any more) for a later result of its size, and
        free the oldest idle buffers while the pool holds more than its capacity."""
        with self._lock:
            if self.closed:
                return
            self.returned_at = time.monotonic()
            self._idle[raw.nbytes].append(raw)
            self._order[id(raw)] = raw
            self.idle_bytes += raw.nbytes
            while self.idle_bytes > self.capacity and self._order:
                _, old = self._order.popitem(last=False)
                self._idle[old.nbytes].remove(old)
                self.idle_bytes -= old.nbytes

    def clear(self) -> None:
        """Free every idle buffer (results in use keep theirs)."""
        with self._lock:
            self._idle.clear()
            self._order.clear()
            self.idle_bytes = 0

    def close(self) -> None:
        """Free every idle buffer, and from now on each buffer given back too (its
        runtime is closed; results still alive keep their memory until they go)."""
        with self._lock:
            self.closed = True
            self.clear()
