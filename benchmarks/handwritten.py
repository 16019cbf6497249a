"""A hand-written pipeline of the default path, with no Dask and no dask_overlap: the anchor.

Pageable input in, fresh ordinary NumPy arrays out, as a user has them. One loop over
chunks of ``rows_per_chunk`` rows, ``in_flight`` slots, each a pinned input buffer, a
pinned output buffer and a stream. For each chunk, in order:

1. wait until the slot's previous chunk has been unstaged;
2. stage: ``threads`` threads copy the pageable chunk into the slot's pinned input;
3. on the slot's stream: H2D, the kernel, D2H into the slot's pinned output, an event;
4. unstage, off the loop: a waiter thread waits for the event, then the same threads copy
   the pinned output into a fresh ``np.empty`` chunk (first touch in parallel).

So staging of chunk i+1 overlaps the GPU work of chunk i and the unstaging of chunk i−1.
CUDA only (CuPy); the loop is what a careful engineer writes by hand in an afternoon.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

__all__ = ["run_handwritten"]

_PIECE = 4 << 20


def _pieces(rows: int, row_bytes: int, threads: int) -> list[tuple[int, int]]:
    n = max(1, min(threads, rows * row_bytes // _PIECE, rows))
    bounds = [rows * k // n for k in range(n + 1)]
    return list(zip(bounds, bounds[1:], strict=False))


def run_handwritten(
    host: np.ndarray, rows_per_chunk: int, func: Callable[[Any], Any], in_flight: int, threads: int
) -> tuple[float, list[np.ndarray]]:
    """Seconds until every output chunk exists, and the chunks (fresh NumPy arrays)."""
    import cupy as cp
    import cupyx

    shape = (rows_per_chunk, *host.shape[1:])
    row_bytes = host[:1].nbytes
    slots = [
        {
            "pin_in": cupyx.empty_pinned(shape, host.dtype),
            "pin_out": cupyx.empty_pinned(shape, host.dtype),
            "dev": cp.empty(shape, host.dtype),
            "stream": cp.cuda.Stream(non_blocking=True),
            "done": None,  # futures of the slot's last unstaging
        }
        for _ in range(in_flight)
    ]
    copies = ThreadPoolExecutor(threads)
    waiter = ThreadPoolExecutor(1)
    outputs: list[np.ndarray] = []

    def unstage(event: Any, src: np.ndarray, dst: np.ndarray) -> list[Future]:
        event.synchronize()
        return [
            copies.submit(np.copyto, dst[lo:hi], src[lo:hi])
            for lo, hi in _pieces(len(src), row_bytes, threads)
        ]

    start = time.perf_counter()
    for c, lo in enumerate(range(0, host.shape[0], rows_per_chunk)):
        hi = min(lo + rows_per_chunk, host.shape[0])
        slot = slots[c % in_flight]
        if slot["done"] is not None:
            wait(slot["done"].result())
        src = host[lo:hi]
        pin_in, pin_out = slot["pin_in"][: hi - lo], slot["pin_out"][: hi - lo]
        wait(
            [
                copies.submit(np.copyto, pin_in[a:b], src[a:b])
                for a, b in _pieces(hi - lo, row_bytes, threads)
            ]
        )
        stream = slot["stream"]
        with stream:
            dev = slot["dev"][: hi - lo]
            dev.set(pin_in, stream=stream)
            out = func(dev)
            out.get(stream=stream, out=pin_out, blocking=False)
            event = stream.record()
        result = np.empty(pin_out.shape, pin_out.dtype)
        outputs.append(result)
        slot["done"] = waiter.submit(unstage, event, pin_out, result)
    for slot in slots:
        if slot["done"] is not None:
            wait(slot["done"].result())
    seconds = time.perf_counter() - start
    copies.shutdown()
    waiter.shutdown()
    return seconds, outputs
