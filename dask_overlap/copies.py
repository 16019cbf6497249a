"""Host copies in parallel: staging into the pinned ring and unstaging out of it.

One thread's ``memcpy`` reaches about a third of what several reach (H200 host: 9.6 GB/s
on one thread, 32–35 GB/s on 8–16), and a fresh result array is first touched by whoever
writes it first, so both directions are cut into pieces that a shared pool of threads
copies at once. NumPy releases the GIL while it copies.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = ["Copier", "auto_threads", "pieces"]

#: Copies are cut into pieces of at least this many bytes. On the H200 host (8 GiB through
#: the ring, 16 threads), 16 MiB pieces were 5-20 % faster than 4 MiB ones.
PIECE_BYTES = 16 << 20
#: A copy of at most this many bytes runs on the caller's thread (two thread hand-offs
#: cost more than the copy).
INLINE_BYTES = 4 << 20
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
    src: np.ndarray, dst: np.ndarray, threads: int, piece_bytes: int = PIECE_BYTES
) -> list[tuple[Any, Any]]:
    """``(src, dst)`` row ranges that together copy ``src`` into ``dst``.

    Examples
    --------
    >>> a = np.zeros((64, 1 << 18), np.float32)  # 64 MiB
    >>> [p[0].shape[0] for p in pieces(a, a.copy(), 4)]
    [16, 16, 16, 16]
    """
    rows = src.shape[0] if src.ndim else 1
    n = max(1, min(threads, src.nbytes // piece_bytes, rows))
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
        Copies are cut into pieces of at least this size.
    """

    def __init__(self, threads: int, name: str, piece_bytes: int = PIECE_BYTES):
        self.threads = threads
        self.piece_bytes = piece_bytes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)

    def copy(
        self,
        copies: list[tuple[np.ndarray, np.ndarray]],
        fn: Callable[[np.ndarray, np.ndarray], None],
        on_done: Callable[[BaseException | None], None],
        inline: bool = True,
    ) -> None:
        """``fn(src, dst)`` for every pair, in pieces, then ``on_done(first error or None)``.

        With ``inline``, small copies (or none) run on the calling thread, before this
        returns; otherwise ``on_done`` runs on the thread that finished the last piece.
        A caller with other work to overlap (the next sub-chunk) passes ``inline=False``.
        """
        total = sum(src.nbytes for src, _ in copies)
        if not copies or (inline and total <= INLINE_BYTES):
            try:
                for src, dst in copies:
                    fn(src, dst)
            except Exception as e:
                on_done(e)
                return
            on_done(None)
            return
        work = [p for src, dst in copies for p in pieces(src, dst, self.threads, self.piece_bytes)]
        left = [len(work)]
        errors: list[BaseException] = []
        lock = threading.Lock()

        def piece(src: np.ndarray, dst: np.ndarray) -> None:
            try:
                fn(src, dst)
            except Exception as e:
                with lock:
                    errors.append(e)
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                on_done(errors[0] if errors else None)

        for src, dst in work:
            self._pool.submit(piece, src, dst)

    def run(
        self,
        copies: list[tuple[np.ndarray, np.ndarray]],
        fn: Callable[[np.ndarray, np.ndarray], None],
    ) -> None:
        """:meth:`copy`, waited for: returns once every piece is done; raises the first error.

        For a caller with nothing else to do meanwhile (a partition of one sub-chunk).
        """
        if not copies or sum(src.nbytes for src, _ in copies) <= INLINE_BYTES:
            for src, dst in copies:
                fn(src, dst)
            return
        done = threading.Event()
        errors: list[BaseException | None] = []

        def on_done(error: BaseException | None) -> None:
            errors.append(error)
            done.set()

        self.copy(copies, fn, on_done, inline=False)
        done.wait()
        if errors[0] is not None:
            raise errors[0]

    def close(self) -> None:
        """Finish the copies already submitted, then stop the threads."""
        self._pool.shutdown(wait=True)
