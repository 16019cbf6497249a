"""The demo (the README's main job): a real array through a real cluster, checked.

It starts a :class:`~dask_overlap.LocalGPUCluster` on this machine (one worker per GPU;
on a machine with no GPU, CPU workers on the host backend), makes a float32 array on the
workers, runs the usual Dask + CuPy code (``cp.asnumpy(f(cp.asarray(block)))``) and then
``dask_overlap.map_blocks`` with ``split_axis=0`` and no tuning over it, checks every
element against plain ``dask.array.map_blocks``, and prints both throughputs side by side,
the backend used and the dashboard address. ``python -m dask_overlap demo --help`` lists
the knobs.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from dask.utils import format_bytes, parse_bytes

__all__ = ["main", "naive_scale_shift", "scale_shift"]


def scale_shift(block: Any, scale: float, shift: float, rounds: int) -> Any:
    """An elementwise kernel that runs on NumPy and CuPy blocks alike (row-independent)."""
    out = block * block.dtype.type(scale) + block.dtype.type(shift)
    for _ in range(rounds):
        out = out * block.dtype.type(0.5) + block
    return out


def naive_scale_shift(block: Any, **kw: Any) -> Any:
    """The usual Dask + CuPy code: copy in, compute, copy out, one step at a time (on the
    CPU path, just the kernel)."""
    from dask_overlap.backends import gpu_available

    if not gpu_available():
        return scale_shift(block, **kw)
    import cupy

    return cupy.asnumpy(scale_shift(cupy.asarray(block), **kw))


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit status (0 when the result is right)."""
    p = argparse.ArgumentParser(
        prog="dask overlap demo",
        description="Run dask_overlap.map_blocks on a local cluster and check it against Dask.",
    )
    p.add_argument("--size", default=None, help="input bytes (default 256MiB; 4GiB on a GPU)")
    p.add_argument("--partition", default=None, help="bytes per partition (default size/16)")
    p.add_argument("--sub-chunk", default=None, help="bytes per sub-chunk (8MiB; 64MiB on a GPU)")
    p.add_argument("--workers", type=int, default=None, help="default: one per GPU, or 2 CPU")
    p.add_argument(
        "--threads", type=int, default=None, help="partitions in flight per worker (2; 4 on a GPU)"
    )
    p.add_argument("--rounds", type=int, default=2, help="kernel length (elementwise passes)")
    p.add_argument(
        "--keep-open",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep the cluster (and its dashboard) up this long after the run",
    )
    args = p.parse_args(argv)

    import dask.array as da
    from distributed import Client, wait

    import dask_overlap
    from dask_overlap.backends import gpu_available

    gpu = gpu_available()
    size = parse_bytes(args.size or ("4GiB" if gpu else "256MiB"))
    part = parse_bytes(args.partition) if args.partition else max(size // 16, 1 << 20)
    cols = 1024
    rows, rows_per_part = max(1, size // (4 * cols)), max(1, part // (4 * cols))
    nbytes = rows * cols * 4
    sub_chunk = args.sub_chunk or (None if gpu else "8MiB")  # None: overlap.sub-chunk-bytes
    threads = args.threads or (4 if gpu else 2)

    print(
        f"dask_overlap demo: {format_bytes(nbytes)} float32 in partitions of "
        f"{format_bytes(rows_per_part * cols * 4)}, on {'the GPU' if gpu else 'the CPU'}"
    )
    with (
        dask_overlap.LocalGPUCluster(
            n_workers=args.workers,
            threads_per_worker=threads,
            allow_cpu=True,
        ) as cluster,
        Client(cluster) as client,
    ):
        page = cluster.dashboard_link.rsplit("/", 1)[0] + "/overlap"
        stays = (
            f"up while the demo runs and {args.keep_open:.0f} s after"
            if args.keep_open > 0
            else "up while the demo runs; --keep-open SECONDS keeps it up after"
        )
        print(f"dashboard: {cluster.dashboard_link}; the assembly line: {page} ({stays})")
        x = da.random.default_rng(42).random(
            (rows, cols), chunks=(rows_per_part, cols), dtype=np.float32
        )
        x = x.persist()
        wait(x)
        kw = {"scale": 2.5, "shift": 1.0, "rounds": args.rounds}
        naive = da.map_blocks(naive_scale_shift, x, **kw)
        y = dask_overlap.map_blocks(scale_shift, x, split_axis=0, sub_chunk_bytes=sub_chunk, **kw)
        # Warm-up on two partitions each: kernel compilation and pools stay out of the times.
        wait([naive[: 2 * rows_per_part].persist(), y[: 2 * rows_per_part].persist()])
        t0 = time.perf_counter()
        naive = naive.persist()
        wait(naive)
        naive_seconds = time.perf_counter() - t0
        del naive
        t0 = time.perf_counter()
        y = y.persist()
        wait(y)
        seconds = time.perf_counter() - t0
        ref = da.map_blocks(scale_shift, x, **kw)
        # On the GPU the kernel may round differently from NumPy's by an ulp.
        same = bool(da.allclose(y, ref, rtol=0 if not gpu else 1e-6, atol=0).compute())
        stats = client.run(dask_overlap.runtime_stats)
        backends = sorted({s["backend"] for s in stats.values()})
        print(f"backend: {', '.join(backends)} on {len(stats)} worker(s)")
        naive_name = "Dask + CuPy, naive" if gpu else "plain Dask (NumPy)"
        print(
            f"throughput, until every chunk exists: {naive_name} "
            f"{nbytes / naive_seconds / 1e9:.2f} GB/s; dask_overlap "
            f"{nbytes / seconds / 1e9:.2f} GB/s ({naive_seconds / seconds:.1f}x)"
        )
        moved_in = sum(s["bytes_h2d"] for s in stats.values())
        moved_out = sum(s["bytes_d2h"] for s in stats.values())
        ring_full = sum(s["ring_full"] for s in stats.values())
        subs = sum(s["sub_chunks"] for s in stats.values())
        waited = sum(s["backpressure_seconds"] for s in stats.values())
        fallbacks = sum(s["pinned_fallbacks"] for s in stats.values())
        print(
            f"moved: {format_bytes(moved_in)} in, {format_bytes(moved_out)} out, "
            f"{subs} sub-chunks, backpressure {waited:.2f} s (pinned ring full {ring_full} "
            f"times), pinned fallbacks {fallbacks}"
        )
        print(f"result equals plain Dask: {same}")
        if args.keep_open > 0:
            print(f"keeping the cluster up for {args.keep_open:.0f} s")
            time.sleep(args.keep_open)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
