"""Diagnostics for the cuda backend: N partitions at once, engine utilisation from the
runtime's stage timeline. ``python benchmarks/diag_cuda.py --variant pool --json out.json``"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import dask
import numpy as np
from dask.utils import parse_bytes

import dask_overlap
import dask_overlap.backends.cuda as cuda_backend

sys.path.insert(0, os.path.dirname(__file__))
from bench_overlap import array_of_views, make_kernel  # noqa: E402


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -1e30
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", default="pool")
    p.add_argument("--parts", type=int, default=16)
    p.add_argument("--partition", default="256MiB")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--iterations", type=int, default=7)
    p.add_argument("--in-flight", type=int, default=None)
    p.add_argument("--sub-chunk", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    for v in a.variant.split(","):
        if v == "async":
            cuda_backend.DEVICE_MR = "async"
        if v == "nowait":
            cuda_backend.WAIT_LEGACY = False
    rows = parse_bytes(a.partition) // 4096
    n = rows * 4096 * a.parts
    dask.config.set({"overlap.backend": "cuda", "overlap.pinned-pool-size": int(2.2 * n)})
    rt = dask_overlap.get_runtime("cuda")
    block = rt.backend.pinned.allocate(n)
    host = block.view(np.float32).reshape(-1, 1024)
    host[...] = 1.0
    func = make_kernel(a.iterations)
    if "fused" in a.variant:
        import cupy as cp

        k = cp.ElementwiseKernel(
            "T x, int32 n",
            "T y",
            "T v = x * (T)1.0001 + (T)0.5; for (int i = 0; i < n; ++i) v = v * (T)0.9999"
            " + (T)0.25; y = v;",
            "fused_loop",
        )

        def func(b, k=k, n=a.iterations):  # noqa: F811
            return k(b, n)

    sub = parse_bytes(a.sub_chunk) if a.sub_chunk else None

    def run() -> float:
        y = dask_overlap.map_blocks(
            func,
            array_of_views(host, rows),
            split_axis=0,
            sub_chunk_bytes=sub,
            in_flight=a.in_flight,
            dtype=np.float32,
        )
        t0 = time.perf_counter()
        (d,) = dask.persist(y, scheduler="threads", num_workers=a.threads)
        return time.perf_counter() - t0

    run(), run()
    rt.timeline.clear()
    seconds = run()
    spans = list(rt.timeline)
    t0 = min(s.start for s in spans)
    make = max(s.end for s in spans) - t0
    util = {
        st: union([(s.start, s.end) for s in spans if s.stage == st]) / make
        for st in ("stage", "h2d", "compute", "d2h")
    }
    print(
        f"variant={a.variant} parts={a.parts} threads={a.threads} in_flight={a.in_flight} "
        f"iters={a.iterations}: {n / seconds / 1e9:.2f} GB/s ({seconds * 1e3:.1f} ms); "
        f"last-run makespan {make * 1e3:.1f} ms; engine busy fraction "
        + " ".join(f"{k}={v:.2f}" for k, v in util.items())
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump([s._asdict() | {"key": str(s.key)} for s in spans], f)
    dask_overlap.close_runtimes()


if __name__ == "__main__":
    main()
