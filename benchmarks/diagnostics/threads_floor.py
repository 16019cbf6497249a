"""How partitions of one Dask thread each can keep a GPU busy: bare CuPy floors.

16 MiB partitions (2 GiB pinned input, results into pinned blocks), the benchmark's
balanced kernel. Each line prints GB/s and the process's CPU time per partition:

- one thread, a window of 4 partitions in flight on 4 streams (the deep pipeline);
- N threads, each synchronous per partition on its own stream (what a Dask task that
  must return a finished result does), with a blocking-sync or a spinning event;
- plain Dask on N threads with a no-op func (Dask's own cost per task: a floor no
  per-task library can go under) and with the same work written by hand in the task;
- dask_overlap.map_blocks on N threads.

Run on the device: ``python3 benchmarks/diagnostics/threads_floor.py [--cases dask4,hand4,ours4]``
(``PART`` sets the partition bytes, 16 MiB by default).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import cupy as cp
import cupyx
import dask
import numpy as np

import dask_overlap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import array_of_views, make_kernel  # noqa: E402

P = int(os.environ.get("PART", 16 << 20))
TOTAL = 2 << 30
n = TOTAL // P
host = cupyx.empty_pinned((TOTAL // 4,), np.float32)
host[...] = 1
outs = cupyx.empty_pinned((TOTAL // 4,), np.float32)
f = make_kernel(int(os.environ.get("ITER", 1961)))


def one(k: int, st: cp.cuda.Stream, ev: cp.cuda.Event) -> None:
    e = P // 4
    with st:
        d = cp.empty((e,), cp.float32)
        cp.cuda.runtime.memcpyAsync(d.data.ptr, host[k * e :].ctypes.data, P, 1, st.ptr)
        r = f(d)
        cp.cuda.runtime.memcpyAsync(outs[k * e :].ctypes.data, r.data.ptr, P, 2, st.ptr)
        ev.record(st)


def deep() -> None:
    ss = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    evs = [cp.cuda.Event(block=True, disable_timing=True) for _ in range(4)]
    for k in range(n):
        if k >= 4:
            evs[k % 4].synchronize()
        one(k, ss[k % 4], evs[k % 4])
    for e in evs:
        e.synchronize()


def threaded(t: int, block: bool) -> None:
    todo = iter(range(n))
    lock = threading.Lock()

    def worker() -> None:
        st = cp.cuda.Stream(non_blocking=True)
        ev = cp.cuda.Event(block=block, disable_timing=True)
        while True:
            with lock:
                k = next(todo, None)
            if k is None:
                return
            one(k, st, ev)
            ev.synchronize()

    ts = [threading.Thread(target=worker) for _ in range(t)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()


def show(label: str, fn) -> None:
    fn()
    best, cpu = 1e9, 0.0
    for _ in range(int(os.environ.get("FLOOR_REPEAT", 2))):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        s = time.perf_counter() - t0
        if s < best:
            best, cpu = s, time.process_time() - c0
    gbps, us = TOTAL / best / 1e9, cpu / n * 1e6
    wall = best / n * 1e6
    print(f"{label:<56} {gbps:6.2f} GB/s  wall {wall:5.0f}  cpu {us:5.0f} us/part", flush=True)


_streams = threading.local()


def by_hand(block: np.ndarray) -> np.ndarray:
    """What a user writes in a plain Dask task: the block in, the kernel, the result out
    into pinned memory, on a stream of this thread's own, finished before returning."""
    st = getattr(_streams, "stream", None)
    if st is None:
        st = _streams.stream = cp.cuda.Stream(non_blocking=True)
    with st:
        d = cp.empty(block.shape, block.dtype)
        cp.cuda.runtime.memcpyAsync(d.data.ptr, block.ctypes.data, block.nbytes, 1, st.ptr)
        r = f(d)
        out = cupyx.empty_pinned(block.shape, block.dtype)
        cp.cuda.runtime.memcpyAsync(out.ctypes.data, r.data.ptr, block.nbytes, 2, st.ptr)
        st.synchronize()
    return out


def without_marks(fn):
    """``fn()`` with the runner's device timing marks off (every sub-chunk's stages
    estimated, as an untimed small partition's are): what they cost."""
    from dask_overlap.pipeline.work import PartitionWork

    timed = PartitionWork.timed
    PartitionWork.timed = lambda self, i: False
    try:
        return fn()
    finally:
        PartitionWork.timed = timed


def without_caches(fn):
    """``fn()`` with the cuda backend's caches off: every device allocation from RMM (no
    scratch cache), every pinned block back to RMM when given back (none kept)."""
    import contextlib

    from dask_overlap.backends import cuda

    scratch, keep = cuda.CudaBackend.scratch, cuda.PinnedPool._keep
    cuda.CudaBackend.scratch = lambda self: contextlib.nullcontext()
    cuda.PinnedPool._keep = lambda self, nbytes, ptr: self.mr.deallocate(ptr, nbytes, self._stream)
    try:
        return fn()
    finally:
        cuda.CudaBackend.scratch, cuda.PinnedPool._keep = scratch, keep


def spinning(fn):
    """``fn()`` with the lean path's completion events spinning (as ``cudaStreamSynchronize``
    does by default) instead of blocking-sync ones, whose waiter sleeps in the kernel."""
    from dask_overlap.backends import cuda

    free: dict[int, list] = {}

    def run(self, work):
        with self._device, self.cupy:
            result = work()
            events = free.setdefault(id(self), [])
            event = events.pop() if events else cp.cuda.Event(block=False, disable_timing=True)
            with self._lock:
                event.record(self.cupy)
                keep, self._keep = self._keep, []
        event.synchronize()
        events.append(event)
        del keep
        return result

    run_before = cuda.CudaStream.run
    cuda.CudaStream.run = run
    try:
        return fn()
    finally:
        cuda.CudaStream.run = run_before


def spinning_without_marks(fn):
    """``fn()`` with spinning completion events and no stage marks."""
    return spinning(lambda: without_marks(fn))


def every_partition_timed(fn):
    """``fn()`` with the lean path timing every partition's stages on the device (no
    sampling: see dask_overlap/pipeline/sampling.py)."""
    rt = dask_overlap.get_runtime("cuda")
    sampler, rt.sampler = rt.sampler, None
    try:
        return fn()
    finally:
        rt.sampler = sampler


def unfused(fn):
    """``fn()`` with Dask's low-level task fusion off."""
    with dask.config.set({"optimization.fuse.active": False}):
        return fn()


def cases() -> dict:
    dask.config.set({"overlap.backend": "cuda", "overlap.pinned-pool-size": "6GiB"})
    x = array_of_views(host.reshape(-1, 1024), P // 4096)
    got: dict = {"deep": ("bare: 1 thread, 4 in flight on 4 streams", deep)}
    for t in (1, 4, 8):
        got[f"bare{t}"] = (
            f"bare: {t} threads, synchronous each, blocking event",
            lambda t=t: threaded(t, True),
        )
    got["spin4"] = ("bare: 4 threads, synchronous each, spinning event", lambda: threaded(4, False))
    for t in (4, 8):
        # Dask's own cost per task: a func that does nothing, on the same chunks.
        noop = x.map_blocks(lambda b: b, dtype=np.float32)
        got[f"dask{t}"] = (
            f"plain dask, no-op func, {t} threads",
            lambda t=t, y=noop: dask.persist(y, num_workers=t),
        )
        hand = x.map_blocks(by_hand, dtype=np.float32)
        got[f"hand{t}"] = (
            f"plain dask + CuPy by hand per task, {t} threads",
            lambda t=t, y=hand: dask.persist(y, num_workers=t),
        )
    for t in (1, 4, 8):
        y = dask_overlap.map_blocks(f, x, dtype=np.float32, out="pinned")
        got[f"ours{t}"] = (
            f"dask_overlap out=pinned, {t} threads",
            lambda t=t, y=y: dask.persist(y, num_workers=t),
        )
    # Dask's low-level fusion makes each partition's task a subgraph of its input and the
    # task, which Dask orders (dask.order) every time it runs one: without fusion.
    for name, y in (
        ("dask", x.map_blocks(lambda b: b, dtype=np.float32)),
        ("hand", x.map_blocks(by_hand, dtype=np.float32)),
        ("ours", dask_overlap.map_blocks(f, x, dtype=np.float32, out="pinned")),
    ):
        got[f"{name}4nf"] = (
            f"{got[name + '4'][0]}, unfused",
            lambda y=y: unfused(lambda: dask.persist(y, num_workers=4)),
        )
    # dask_overlap out=pinned on 4 threads, with one part of it changed (for A/Bs in one
    # process): name, what changes, the wrapper that changes it around the run.
    y = dask_overlap.map_blocks(f, x, dtype=np.float32, out="pinned")
    for name, change, wrap in (
        ("nomarks4", "no stage marks", without_marks),
        ("timeall4", "every partition timed", every_partition_timed),
        ("nocache4", "no device or pinned caches", without_caches),
        ("ourspin4", "spinning completion events", spinning),
        ("ourspinnomarks4", "spinning, no stage marks", spinning_without_marks),
    ):
        got[name] = (
            f"dask_overlap out=pinned, 4 threads, {change}",
            lambda y=y, wrap=wrap: wrap(lambda: dask.persist(y, num_workers=4)),
        )
    y = dask_overlap.map_blocks(f, x, dtype=np.float32)
    got["host4"] = ("dask_overlap out=host, 4 threads", lambda y=y: dask.persist(y, num_workers=4))
    return got


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="", help="a comma list of case names (default: all)")
    args = p.parse_args()
    table = cases()
    for name in [c for c in args.cases.split(",") if c] or list(table):
        show(*table[name])
