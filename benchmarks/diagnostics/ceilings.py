"""Stage ceilings for the benchmark's bound, measured (or modelled) in the same run.

``measure_ceilings(rt, block, workload, ratio, make_kernel)`` returns the rates in bytes
per second (``h2d``, ``d2h``, ``both`` when the two directions were measured together,
``staging`` for pageable input into the ring, ``fresh`` for results out of it into new
arrays, both with the copy threads on at least 64 MiB), the kernel's seconds for one
partition, and the kernel iterations chosen so that the kernel takes ``ratio`` times one
partition's H2D copy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = ["measure_ceilings", "parallel_copy_rate"]


def _best(fn: Callable[[], Any], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _iterations(one_pass: float, base: float, target: float) -> int:
    """Iterations of the kernel loop so that ``base + n * one_pass`` is about ``target``."""
    if target <= base or one_pass <= 0:
        return 0
    return max(0, round((target - base) / one_pass))


#: Host copy rates are measured on at least this many bytes: the rate of the many copies
#: a run makes, not one small copy's hand-off latency.
PROBE_BYTES = 64 << 20


def parallel_copy_rate(
    src: np.ndarray, dst: np.ndarray | None, threads: int, repeat: int = 3
) -> float:
    """Bytes per second of ``threads`` threads copying ``src`` into ``dst`` in slices
    (the best of ``repeat``). ``dst`` ``None``: into a new array each time, whose pages
    the copy faults in, as it does a partition's fresh result."""
    parts = np.array_split(np.arange(src.shape[0]), threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(repeat):
            out = np.empty_like(src) if dst is None else dst

            def copy(idx: np.ndarray, out: np.ndarray = out) -> None:
                if len(idx):
                    np.copyto(out[idx[0] : idx[-1] + 1], src[idx[0] : idx[-1] + 1])

            t0 = time.perf_counter()
            list(ex.map(copy, parts))
            best = min(best, time.perf_counter() - t0)
            del out
    return src.nbytes / best


def _host_rates(pinned: np.ndarray, threads: int) -> dict[str, float]:
    """``staging`` (pageable into the ring) and ``fresh`` (the ring into a new result)
    rates, on ``pinned``, a ring block of at least :data:`PROBE_BYTES`."""
    flat = pinned.view(np.uint8)
    pageable = np.ones_like(flat)
    return {
        "staging": parallel_copy_rate(pageable, flat, threads),
        "fresh": parallel_copy_rate(flat, None, threads),
    }


def _timed(rt: Any, block: np.ndarray, ratio: float) -> tuple[dict, float, int]:
    m = rt.backend.model
    ceilings = {
        "h2d": m.h2d_bandwidth,
        "d2h": m.d2h_bandwidth,
        "staging": m.staging_bandwidth * rt.copy_threads,
    }
    return ceilings, m.kernel_time(block.nbytes), 0


def _host(rt: Any, block: np.ndarray, ratio: float, make_kernel: Callable) -> tuple:
    dst = np.empty_like(block)
    copy = block.nbytes / _best(lambda: np.copyto(dst, block))
    ceilings = {"h2d": copy, "d2h": copy, "host_cores": float(os.cpu_count() or 1)}
    ceilings.update(_host_rates(np.empty(max(block.nbytes, PROBE_BYTES), np.uint8), 1))
    base = _best(lambda: make_kernel(0)(block))
    one = _best(lambda: make_kernel(1)(block)) - base
    iterations = _iterations(one, base, ratio * block.nbytes / copy)
    return ceilings, _best(lambda: make_kernel(iterations)(block)), iterations


def _cuda(rt: Any, block: np.ndarray, ratio: float, make_kernel: Callable) -> tuple:
    import cupy as cp

    pool = rt.backend.pinned
    n = block.nbytes
    pin_in = pool.allocate(n)
    pin_out = pool.allocate(n)
    if pin_in is None or pin_out is None:
        raise RuntimeError("the pinned pool cannot hold two partitions for the ceilings")
    pin_in = pin_in.view(block.dtype).reshape(block.shape)
    pin_out = pin_out.view(block.dtype).reshape(block.shape)
    pin_in[...] = block
    dev_a = cp.empty(block.shape, block.dtype)
    dev_b = cp.empty(block.shape, block.dtype)
    s1 = cp.cuda.Stream(non_blocking=True)
    s2 = cp.cuda.Stream(non_blocking=True)

    def timed(fn: Callable[[], None]) -> float:
        best = float("inf")
        for _ in range(5):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            fn()
            cp.cuda.Device().synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    h2d = n / timed(lambda: dev_a.set(pin_in, stream=s1))
    d2h = n / timed(lambda: dev_b.get(stream=s2, out=pin_out, blocking=False))

    def both() -> None:
        dev_a.set(pin_in, stream=s1)
        dev_b.get(stream=s2, out=pin_out, blocking=False)

    both_rate = 2 * n / timed(both)
    probe = pool.allocate(max(n, PROBE_BYTES))
    if probe is None:
        raise RuntimeError("the pinned pool cannot hold the host copies' probe")
    host = _host_rates(probe, rt.copy_threads)
    del probe

    def kernel_seconds(iterations: int) -> float:
        k = make_kernel(iterations)
        k(dev_a)  # compile
        return timed(lambda: k(dev_a))

    # The fused kernel's cost per iteration is small (one multiply-add per element):
    # probe with enough iterations to rise clear of the memory-bound base time.
    base = kernel_seconds(0)
    probe = 1024
    one = (kernel_seconds(probe) - base) / probe
    iterations = _iterations(one, base, ratio * n / h2d)
    ceilings = {"h2d": h2d, "d2h": d2h, "both": both_rate, **host}
    return ceilings, kernel_seconds(iterations), iterations


def measure_ceilings(
    rt: Any, block: np.ndarray, workload: str, ratio: float, make_kernel: Callable
) -> tuple[dict, float, int]:
    """See the module docstring; ``block`` is one partition of the input."""
    name = rt.backend.name
    if name == "timed":
        return _timed(rt, block, ratio)
    if name == "cuda":
        return _cuda(rt, block, ratio, make_kernel)
    return _host(rt, block, ratio, make_kernel)
