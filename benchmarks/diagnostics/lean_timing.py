"""Where a lean partition's time goes on the GPU: wall and CPU (this thread) per step.

Wraps the runner's steps (building the run, the backend's copy-in, compute and
copy-out, the pinned pool's allocation, the stream's run and the whole partition) with
timers, runs 16 MiB partitions (pinned input) on the synchronous scheduler (or, with
``--threads N``, Dask's threaded one, where each step's figures are summed over the
threads), and prints µs per partition of wall and of the calling thread's CPU time for
each. A step whose CPU time is close to its wall time while it waits for the GPU is
spinning; on several threads, a step whose wall grows with the threads while its CPU
does not waits for a lock or the GIL.

Run on the device: ``python3 benchmarks/diagnostics/lean_timing.py [--out pinned] [--threads 4]``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time

import cupyx
import dask
import numpy as np

import dask_overlap
from dask_overlap.backends import cuda
from dask_overlap.pipeline import executors, output, task, work

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import array_of_views, make_kernel  # noqa: E402

WALL: collections.Counter = collections.Counter()
CPU: collections.Counter = collections.Counter()


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        w, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            WALL[name] += time.perf_counter() - w
            CPU[name] += time.thread_time() - c

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="pinned")
    p.add_argument("--partition", type=int, default=16 << 20)
    p.add_argument("--threads", type=int, default=0, help="Dask threads (0: synchronous)")
    args = p.parse_args()
    dask.config.set({"overlap.backend": "cuda", "overlap.pinned-pool-size": "6GiB"})
    total = 1 << 30
    host = cupyx.empty_pinned((total // 4,), np.float32)
    host[...] = 1
    x = array_of_views(host.reshape(-1, 1024), args.partition // 4096)
    f = make_kernel(1961)
    rt = dask_overlap.get_runtime("cuda")
    timed_names = (
        (cuda.CudaBackend, ("copy_in", "compute", "copy_out", "mark", "resolve", "is_pinned")),
        (cuda.CudaStream, ("run",)),
        (cuda.PinnedPool, ("allocate", "reserve")),
        (
            work.PartitionWork,
            ("__init__", "settle", "drop", "admit", "device_done", "record"),
        ),
        (executors.InlineExecutor, ("start",)),
        (output.PartitionOutput, ("slot",)),
        (type(rt), ("acquire_stream", "release_stream", "record_spans")),
    )
    for cls, names in timed_names:
        for name in names:
            setattr(cls, name, timed(f"{cls.__name__}.{name}", getattr(cls, name)))
    task.run_partition = timed("run_partition", task.run_partition)  # the task's call
    scheduler = {"num_workers": args.threads} if args.threads else {"scheduler": "sync"}
    y = dask_overlap.map_blocks(f, x, dtype=np.float32, out=args.out)
    dask.persist(y, **scheduler)  # warm
    WALL.clear()
    CPU.clear()
    n = x.npartitions
    w0, c0 = time.perf_counter(), time.process_time()
    dask.persist(y, **scheduler)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    print(
        f"out={args.out}, threads={args.threads or 'sync'}: {n} partitions, "
        f"{wall / n * 1e6:.0f} us wall and "
        f"{cpu / n * 1e6:.0f} us process CPU per partition ({total / wall / 1e9:.2f} GB/s)"
    )
    for name in sorted(WALL, key=WALL.get, reverse=True):
        print(
            f"  {name:<36} wall {WALL[name] / n * 1e6:7.0f} us   cpu {CPU[name] / n * 1e6:7.0f} us"
        )
    del rt


if __name__ == "__main__":
    main()
