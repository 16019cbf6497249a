"""Host copies in parallel: staging into the pinned ring and unstaging out of it.

One thread's ``memcpy`` reaches about a third of what several reach (H200 host: 9.6 GB/s
on one thread, 32–35 GB/s on 8–16), and a fresh result array is first touched by whoever
writes it first (a page fault per page), so both directions are cut into pieces that a
shared pool of threads copies at once. NumPy releases the GIL while it copies.

A copy is cut into at least one piece per copy thread that is idle when it arrives, so
that a partition copying alone gets every thread, and into pieces of at most 16 MiB, so
that a large copy arriving while the threads are busy still spreads over them as they
free up.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = ["Copier", "auto_threads", "pieces"]

#: Pieces are never smaller than this (a hand-off to a thread costs tens of µs)...
MIN_PIECE_BYTES = 1 << 20
#: ...nor larger than this. On the H200 host (8 GiB through the ring, 16 threads, every
#: thread busy) 16 MiB pieces were 5-20 % faster than 4 MiB ones.
PIECE_BYTES = 16 << 20
#: ``staging-threads: auto`` takes this process's cores, within these bounds.
AUTO_MIN, AUTO_MAX = 2, 16


def auto_threads() -> int:
    """Copy threads for ``staging-threads: auto``: the cores this process may run on.

    On a worker pinned to the cores near its GPU (a CPU affinity), that is the cores per
    GPU; at least 2, at most 16 (more did not help on a 16-core H200 host).

    Examples
    --------
    >>> 2 <= auto_threads() <= 16
    True
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(AUTO_MIN, min(AUTO_MAX, cores))


def pieces(
    src: np.ndarray, dst: np.ndarray, idle: int, piece_bytes: int = PIECE_BYTES
) -> list[tuple[Any, Any]]:
    """``(src, dst)`` row ranges that together copy ``src`` into ``dst``: one per ``idle``
    thread, in pieces of at most ``piece_bytes`` and at least :data:`MIN_PIECE_BYTES`.

    Examples
    --------
    >>> a = np.zeros((64, 1 << 18), np.float32)  # 64 MiB
    >>> [p[0].shape[0] for p in pieces(a, a.copy(), 4)]  # four threads idle
    [16, 16, 16, 16]
    >>> [p[0].shape[0] for p in pieces(a, a.copy(), 1)]  # one: still 16 MiB pieces
    [16, 16, 16, 16]
    >>> len(pieces(a[:8], a[:8].copy(), 16))  # 8 MiB, 16 threads idle: 1 MiB pieces
    8
    """
    rows = src.shape[0] if src.ndim else 1
    n = max(1, min(rows, src.nbytes // MIN_PIECE_BYTES, max(idle, -(-src.nbytes // piece_bytes))))
    if n == 1:
        return [(src, dst)]
    bounds = [rows * k // n for k in range(n + 1)]
    return [(src[lo:hi], dst[lo:hi]) for lo, hi in zip(bounds, bounds[1:], strict=False)]


class Copier:
    """A bounded pool of threads that runs host copies in pieces.

    Parameters
    ----------
    threads
        How many copies run at once.
    name
        Prefix of the threads' names.
    piece_bytes
        Copies are cut into pieces of at most this size (see :func:`pieces`).
    """

    def __init__(self, threads: int, name: str, piece_bytes: int = PIECE_BYTES):
        self.threads = threads
        self.piece_bytes = piece_bytes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._busy = 0  # pieces handed to the threads and not yet done
        self._lock = threading.Lock()

    def _cut(self, copies: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[Any, Any]]:
        """The pieces of ``copies``: each cut for the threads idle now (at least one)."""
        with self._lock:
            idle = max(1, self.threads - self._busy)
        return [p for src, dst in copies for p in pieces(src, dst, idle, self.piece_bytes)]

    def _submit(
        self,
        work: list[tuple[Any, Any]],
        fn: Callable[[np.ndarray, np.ndarray], None],
        on_done: Callable[[BaseException | None], None],
    ) -> None:
        """Every piece of ``work`` on the threads; ``on_done(first error or None)`` from the
        thread that finished the last one."""
        left = [len(work)]
        errors: list[BaseException] = []
        lock = threading.Lock()

        def piece(src: np.ndarray, dst: np.ndarray) -> None:
            try:
                fn(src, dst)
            except Exception as e:
                with lock:
                    errors.append(e)
            with self._lock:
                self._busy -= 1
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                on_done(errors[0] if errors else None)

        with self._lock:
            self._busy += len(work)
        for src, dst in work:
            self._pool.submit(piece, src, dst)

    def copy(
        self,
        copies: list[tuple[np.ndarray, np.ndarray]],
        fn: Callable[[np.ndarray, np.ndarray], None],
        on_done: Callable[[BaseException | None], None],
    ) -> None:
        """``fn(src, dst)`` for every pair, in pieces on the threads, then ``on_done(first
        error or None)`` on the thread that finished the last piece (at once, on this
        thread, when there is nothing to copy). For a caller with other work to overlap."""
        if not any(src.nbytes for src, _ in copies):
            on_done(None)
            return
        self._submit(self._cut(copies), fn, on_done)

    def run(
        self,
        copies: list[tuple[np.ndarray, np.ndarray]],
        fn: Callable[[np.ndarray, np.ndarray], None],
    ) -> None:
        """:meth:`copy`, waited for, with the caller copying a piece itself: returns once
        every piece is done; raises the first error. A copy of one piece runs on the
        caller's thread alone (no hand-off). For a caller with nothing else to do meanwhile
        (a partition of one sub-chunk)."""
        work = self._cut(copies)
        if len(work) <= 1:
            for src, dst in work:
                fn(src, dst)
            return
        done = threading.Event()
        errors: list[BaseException | None] = []

        def on_done(error: BaseException | None) -> None:
            errors.append(error)
            done.set()

        self._submit(work[1:], fn, on_done)
        try:
            fn(*work[0])
        finally:
            done.wait()  # the threads' pieces write into the same buffers: wait for them
        if errors[0] is not None:
            raise errors[0]

    def close(self) -> None:
        """Finish the copies already submitted, then stop the threads."""
        self._pool.shutdown(wait=True)
