"""Does using result memory again lift the default path? (issue 31's "beyond the anchors")

An ``out="host"`` result made with ``np.empty`` is fresh memory, and its first write
pays a page fault and the kernel's zeroing per page (``dask_overlap.pipeline.recycle``).
With ``overlap.result-pool-size`` the runtime makes results over buffers of results that
Dask let go. This runs, in one process, on the same data (float32, pageable, the
default path's balanced kernel, no other setting), each variant in turn with the others,
``--repeat`` rounds:

1. **persisted** (the path users run, ``bench_default.py``'s): ``split_axis=0`` and
   whole partitions, with no pool and with one of ``--persist-pool`` bytes (a run's
   results come back to it when the next round lets them go: a worker that runs job
   after job); beside them the hand-written pipeline (CUDA only), 8 in flight, 16 copy
   threads, which makes fresh arrays as the default path does without a pool;
2. **stored** (a stream of results that Dask frees soon): ``da.store`` into a target that
   is not a NumPy array (its ``__setitem__`` copies the block into memory of its own, as
   a Zarr or h5py target would take it), so each partition makes a result, the store
   writes it and Dask lets it go; with no pool and with one of ``--stream-pool`` bytes;
3. **long run**: ``--long`` more stores with the pool, the process's resident memory
   after each (it must not grow), and the pool's idle bytes (at most its capacity).

The runtime's pool is swapped between runs (``rt.results``), as the setting makes it
when the runtime is built, so that the pinned pool and the copy threads stay warm.

Example (CPU, small)::

    python3 benchmarks/diagnostics/result_reuse.py --size 512MiB --partition 32MiB
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask.utils import format_bytes

import dask_overlap
from dask_overlap.pipeline.recycle import ResultPool

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (  # noqa: E402
    COLS,
    GB,
    add_output,
    add_repeat,
    byte_count,
    default_input,
    device_name,
    handwritten_runs,
    pair_ratios,
    parser,
    persist_chunks,
    rss,
    same_chunks,
    save,
)

BENCHMARK = "result-reuse"


class Sink:
    """A store target that is not a NumPy array: each block is copied into memory of its
    own (touched once, up front), as a Zarr or h5py target would take it."""

    def __init__(self, shape: tuple[int, ...], dtype: Any):
        self.data = np.zeros(shape, dtype)

    def __setitem__(self, index: Any, block: np.ndarray) -> None:
        self.data[index] = block


def stored_seconds(arr: da.Array, sink: Sink) -> float:
    """Seconds of ``da.store(arr, sink)`` on the threaded scheduler."""
    t0 = time.perf_counter()
    da.store(arr, sink, lock=False)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--size", type=byte_count, default="8GiB", help="input bytes (float32)")
    p.add_argument("--partition", type=byte_count, default="256MiB", help="bytes per partition")
    p.add_argument(
        "--persist-pool", type=byte_count, default="8GiB", help="pool of the persisted runs"
    )
    p.add_argument("--stream-pool", type=byte_count, default="1GiB", help="pool of the stored runs")
    p.add_argument("--long", type=int, default=12, help="stores of the long run")
    add_repeat(p, 3, "of each variant")
    add_output(p)
    args = p.parse_args(argv)

    rt = dask_overlap.get_runtime()
    backend = rt.name
    data = default_input(rt, args.size, args.partition)
    host, rows_per_part, x, func = data.host, data.rows_per_part, data.x, data.func
    nbytes = host.nbytes
    arrays = {
        "split": dask_overlap.map_blocks(func, x, split_axis=0, dtype=np.float32),
        "whole": dask_overlap.map_blocks(func, x, dtype=np.float32),
    }
    pools = {"none": ResultPool(0), "pool": ResultPool(args.persist_pool)}
    _, want = persist_chunks(arrays["whole"])  # warm: compilation, pools, first touch

    # 1. persisted, each variant in turn
    seconds: dict[str, list[float]] = {}
    correct = True
    for _ in range(args.repeat):
        for name, arr in arrays.items():
            for pool_name, pool in pools.items():
                rt.results = pool
                s, got = persist_chunks(arr)
                seconds.setdefault(f"{name}_{pool_name}", []).append(s)
                correct = correct and same_chunks(want, got)
                del got
    rt.results = pools["none"]
    persisted = {k: nbytes / min(v) / GB for k, v in seconds.items()}
    # how fast the runs with the pool were against those without, pair by pair
    pool_over_none = {
        name: pair_ratios(seconds[f"{name}_pool"], seconds[f"{name}_none"]) for name in arrays
    }
    hand = []
    if backend == "cuda":
        hand = handwritten_runs(host, func, want, [8], [16], args.repeat)
    pools["pool"].clear()

    # 2. stored, each variant in turn
    sink = Sink(host.shape, np.float32)
    stream_pools = {"none": ResultPool(0), "pool": ResultPool(args.stream_pool)}
    stored_runs: dict[str, list[float]] = {k: [] for k in stream_pools}
    for _ in range(args.repeat):
        for pool_name, pool in stream_pools.items():
            rt.results = pool
            stored_runs[pool_name].append(stored_seconds(arrays["whole"], sink))
    stored = {k: nbytes / min(v) / GB for k, v in stored_runs.items()}
    # the stored blocks against the persisted run's, block by block (no third run)
    stored_correct = same_chunks(want, [sink.data[s] for s in da.core.slices_from_chunks(x.chunks)])
    del want

    # 3. long run with the pool: resident memory after each store
    pool = stream_pools["pool"]
    rt.results = pool
    long_rss, long_idle = [], []
    for _ in range(args.long):
        stored_seconds(arrays["whole"], sink)
        long_rss.append(rss())
        long_idle.append(pool.idle_bytes)
    rt.results = stream_pools["none"]

    result = {
        "device": device_name(backend),
        "backend": backend,
        "size_bytes": nbytes,
        "partition_bytes": rows_per_part * COLS * 4,
        "persist_pool_bytes": args.persist_pool,
        "stream_pool_bytes": args.stream_pool,
        "persisted_gbps": persisted,
        "persisted_pool_over_none": pool_over_none,
        "handwritten_gbps": max((h["gbps"] for h in hand), default=None),
        "stored_gbps": stored,
        "stored_pool_over_none": pair_ratios(stored_runs["pool"], stored_runs["none"]),
        "pool_reused": pool.reused,
        "pool_fresh": pool.fresh,
        "long_rss_bytes": long_rss,
        "long_rss_growth_bytes": long_rss[-1] - long_rss[len(long_rss) // 2] if long_rss else 0,
        "long_idle_max_bytes": max(long_idle, default=0),
        "correct": bool(correct and stored_correct),
    }
    print(
        f"backend={backend} {format_bytes(nbytes)} in {x.numblocks[0]} partitions of "
        f"{format_bytes(rows_per_part * COLS * 4)}"
    )
    for k, v in persisted.items():
        print(f"  persisted {k:12s} {v:7.2f} GB/s")
    if result["handwritten_gbps"]:
        print(f"  hand-written           {result['handwritten_gbps']:7.2f} GB/s")
    for k, v in pool_over_none.items():
        print(f"  {k}: pool over none, median of pairs {v['median']:.3f} {v['pairs']}")
    for k, v in stored.items():
        print(f"  stored {k:6s} {v:7.2f} GB/s")
    print(f"  stored: pool over none {result['stored_pool_over_none']}")
    print(
        f"  long run: RSS {[format_bytes(r) for r in long_rss]}, idle at most "
        f"{format_bytes(result['long_idle_max_bytes'])} of {format_bytes(args.stream_pool)}; "
        f"reused {pool.reused} fresh {pool.fresh}; correct={result['correct']}"
    )
    figures = {
        k: result[k]
        for k in (
            "persisted_gbps",
            "persisted_pool_over_none",
            "stored_pool_over_none",
            "handwritten_gbps",
            "stored_gbps",
            "long_rss_growth_bytes",
            "correct",
        )
    }
    save(args, BENCHMARK, result, figures, result["device"])
    return result


if __name__ == "__main__":
    with dask.config.set(scheduler="threads"):
        main()
