"""What the lean path's CUDA-side calls cost the calling thread, alone and four at once.

Issue 12: on four Dask threads a small partition's path is bound by host time (most of it
with the GIL held), and its steps cost more than a hand-written task's. Each case below is
one call of the kind a partition makes, timed over ``--calls`` calls per thread, with the
thread's own runtime stream current (as in a partition), on 1 and on ``--threads``
threads at once. Printed: µs of wall per call per thread, and of the process's CPU per
call (all threads). A call whose wall grows with the threads while its CPU per call does
not waits for a lock (the GIL, the driver's, RMM's).

Run on the device: ``python3 benchmarks/diagnostics/call_costs.py [--bytes 16MiB]``.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from typing import Any

import cupy
import cupyx
import numpy as np
from dask.utils import parse_bytes
from rmm.allocators.cupy import rmm_cupy_allocator

import dask_overlap


def cases(rt: Any, nbytes: int) -> dict[str, Callable[[Any, dict], None]]:
    """name -> fn(stream, state): one call of each kind."""
    backend = rt.backend
    n = nbytes // 4
    host = cupyx.empty_pinned((n,), np.float32)
    async_pool = cupy.cuda.MemoryAsyncPool()
    cupy_pool = cupy.cuda.MemoryPool()

    def empty(allocator: Callable | None) -> Callable[[Any, dict], None]:
        def fn(stream: Any, state: dict) -> None:
            if allocator is None:
                a = cupy.empty((n,), np.float32)
            else:
                with cupy.cuda.using_allocator(allocator):
                    a = cupy.empty((n,), np.float32)
            del a

        return fn

    def scratch(stream: Any, state: dict) -> None:
        with backend.scratch():  # the runner's scope for out="host" and "pinned"
            a = cupy.empty((n,), np.float32)
        del a

    def pinned_block(stream: Any, state: dict) -> None:
        block = backend.pinned.allocate(nbytes)
        del block  # back to the pool (weakref.finalize)

    def empty_pinned(stream: Any, state: dict) -> None:
        block = cupyx.empty_pinned((n,), np.float32)
        del block

    def record(stream: Any, state: dict) -> None:
        state.setdefault("event", cupy.cuda.Event()).record(stream.cupy)

    def marks(stream: Any, state: dict) -> None:
        got = [backend.mark(stream) for _ in range(4)]
        stream.cupy.synchronize()
        backend.resolve(got)

    def h2d(stream: Any, state: dict) -> None:
        dev = state.get("dev")
        if dev is None:
            dev = state["dev"] = cupy.empty((n,), np.float32)
        cupy.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, nbytes, 1, stream.ptr)
        stream.cupy.synchronize()

    def copy_in(stream: Any, state: dict) -> None:
        dev = backend.copy_in(stream, host)
        stream.cupy.synchronize()
        del dev

    def legacy_done(stream: Any, state: dict) -> None:
        _ = cupy.cuda.Stream.null.done

    def device_ctx(stream: Any, state: dict) -> None:
        with stream._device:
            pass

    def run_noop(stream: Any, state: dict) -> None:
        stream.run(lambda: None)

    return {
        "cupy.empty, our allocator": empty(None),
        "cupy.empty, our scratch cache": scratch,
        "cupy.empty, rmm_cupy_allocator": empty(rmm_cupy_allocator),
        "cupy.empty, CuPy MemoryAsyncPool": empty(async_pool.malloc),
        "cupy.empty, CuPy MemoryPool": empty(cupy_pool.malloc),
        "pinned pool block + give back": pinned_block,
        "cupyx.empty_pinned (CuPy's pool)": empty_pinned,
        "Event.record": record,
        "4 marks + sync + resolve": marks,
        "memcpyAsync H2D + sync": h2d,
        "backend.copy_in + sync": copy_in,
        "legacy stream .done": legacy_done,
        "with device (enter/exit)": device_ctx,
        "stream.run(no-op) (event + sync)": run_noop,
    }


def measure(rt: Any, fn: Callable[[Any, dict], None], threads: int, calls: int) -> tuple:
    """Mean wall µs per call per thread, and process CPU µs per call."""
    barrier = threading.Barrier(threads + 1)
    walls: list[float] = []

    def body() -> None:
        stream = rt.acquire_stream()
        state: dict = {}
        try:
            with stream._device, stream.cupy:
                fn(stream, state)  # warm
                barrier.wait()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(stream, state)
                walls.append(time.perf_counter() - t0)
                stream.cupy.synchronize()
        finally:
            rt.release_stream(stream)

    workers = [threading.Thread(target=body) for _ in range(threads)]
    for w in workers:
        w.start()
    barrier.wait()
    c0 = time.process_time()
    for w in workers:
        w.join()
    cpu = time.process_time() - c0
    return sum(walls) / len(walls) / calls * 1e6, cpu / (threads * calls) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", default="16MiB")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--threads", type=int, default=4)
    args = p.parse_args()
    nbytes = parse_bytes(args.bytes)
    rt = dask_overlap.get_runtime("cuda")
    table = cases(rt, nbytes)
    print(f"{args.bytes} per call; us per call: wall per thread / process CPU")
    print(f"{'case':<36}{'1 thread':>20}{f'{args.threads} threads':>22}")
    for name, fn in table.items():
        one = measure(rt, fn, 1, args.calls)
        many = measure(rt, fn, args.threads, args.calls)
        print(f"{name:<36}{one[0]:>9.1f} /{one[1]:>8.1f}{many[0]:>11.1f} /{many[1]:>8.1f}")


if __name__ == "__main__":
    main()
