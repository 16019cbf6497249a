"""Where a small partition's host time goes: microseconds per 16 MiB partition on the GPU.

128 partitions of 16 MiB (2 GiB, already pinned), the benchmark's balanced kernel, best of
three runs of each:

- a bare CuPy loop (no Dask, no dask_overlap) on 1 and on 4 streams: the floor that one
  Python thread enqueuing H2D, kernel and D2H can reach;
- ``dask_overlap.map_blocks`` with the synchronous scheduler and 1 and 4 threads, then 4
  threads with a 0.1 ms GIL switch interval and with the garbage collector disabled;
- ``dask.array.map_blocks`` of ``b + 1`` on the host with 4 threads (this includes
  NumPy's own work on 16 MiB, so it is not a measure of Dask's overhead alone).

Run on the device: ``python3 benchmarks/small_partitions.py`` (figures in
``results/REPORT-cuda.md``).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable

import cupy as cp
import dask
import dask.array
import numpy as np

import dask_overlap

sys.path.insert(0, os.path.dirname(__file__))
from bench_overlap import array_of_views  # noqa: E402
from kernels import make_kernel  # noqa: E402

dask.config.set({"overlap.backend": "cuda", "overlap.pinned-pool-size": "6GiB"})
rt = dask_overlap.get_runtime("cuda")
P = 16 << 20
rows = (2 << 30) // 4096
blk = rt.backend.pinned.allocate(rows * 4096)
host = blk.view(np.float32).reshape(rows, 1024)
host[...] = 1
x = array_of_views(host, P // 4096)
n = x.npartitions
f = make_kernel(1961)  # the balanced kernel of the benchmark's 16 MiB case
y = dask_overlap.map_blocks(f, x, split_axis=0, dtype=np.float32)
dask.persist(y, scheduler="threads")


def per_part(label: str, fn: Callable[[], object]) -> None:
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    print(
        f"{label:<48} {best / n * 1e6:7.0f} us/partition  {2**31 / best / 1e9:6.2f} GB/s",
        flush=True,
    )


outs = [rt.backend.pinned.allocate(P).view(np.float32) for _ in range(4)]


def bare(streams: int = 1) -> None:
    ss = [cp.cuda.Stream(non_blocking=True) for _ in range(streams)]
    ev = []
    for k in range(n):
        st = ss[k % streams]
        with st:
            d = cp.empty((P // 4,), cp.float32)
            cp.cuda.runtime.memcpyAsync(d.data.ptr, host.ctypes.data + k * P, P, 1, st.ptr)
            r = f(d)
            cp.cuda.runtime.memcpyAsync(outs[k % 4].ctypes.data, r.data.ptr, P, 2, st.ptr)
            e = cp.cuda.Event(block=True, disable_timing=True)
            e.record(st)
            ev.append(e)
        if len(ev) > streams:
            ev.pop(0).synchronize()
    for e in ev:
        e.synchronize()


per_part("bare CuPy loop, 1 stream, no Dask", bare)
per_part("bare CuPy loop, 4 streams, no Dask", lambda: bare(4))
per_part("dask_overlap, sync scheduler", lambda: dask.persist(y, scheduler="sync"))
for t in (1, 4):
    per_part(
        f"dask_overlap, {t} threads",
        lambda t=t: dask.persist(y, scheduler="threads", num_workers=t),
    )
sys.setswitchinterval(1e-4)
per_part(
    "dask_overlap, 4 threads, switchinterval 0.1 ms",
    lambda: dask.persist(y, scheduler="threads", num_workers=4),
)
sys.setswitchinterval(0.005)
gc.disable()
per_part(
    "dask_overlap, 4 threads, gc disabled",
    lambda: dask.persist(y, scheduler="threads", num_workers=4),
)
gc.enable()
plain = dask.array.map_blocks(lambda b: b + 1, x, dtype=np.float32)
per_part(
    "plain dask.array.map_blocks (host b+1), 4 threads",
    lambda: dask.persist(plain, scheduler="threads", num_workers=4),
)
