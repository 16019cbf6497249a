"""Host time per partition: dask_overlap against plain ``dask.array.map_blocks``.

Tiny partitions (64 KiB by default) and a trivial function, so that what is timed is the
per-partition path itself, not the data: on the host backend, on Dask's synchronous
scheduler (one thread, no scheduling noise), in one process, best of ``--repeat``. Prints
µs per partition for both and the ratio (issue 12's target: at most 1.3), and plain Dask
with its low-level fusion off: Dask's bare per-task cost, which dask_overlap's tasks (not
fused) pay too.

Example::

    python benchmarks/host_overhead.py --partitions 2000
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

import dask
import dask.array as da
import numpy as np

import dask_overlap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_output, add_repeat, byte_count, device_name, parser, save  # noqa: E402

BENCHMARK = "host-overhead"


def best_us(*runs: tuple[da.Array, bool], repeat: int) -> list[float]:
    """Per (array, fuse) run, the best µs per partition of computing all its blocks
    (synchronous scheduler), with Dask's low-level fusion on or off. The runs take turns
    in each round, so that a slow spell of a shared machine hits them alike."""
    best = [float("inf")] * len(runs)
    for _ in range(repeat):
        for k, (arr, fuse) in enumerate(runs):
            with dask.config.set({"optimization.fuse.active": fuse}):
                t0 = time.perf_counter()
                dask.persist(arr, scheduler="sync")
                best[k] = min(best[k], time.perf_counter() - t0)
    return [b / arr.npartitions * 1e6 for b, (arr, _) in zip(best, runs, strict=True)]


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--partitions", type=int, default=2000)
    p.add_argument(
        "--partition", type=byte_count, default="64KiB", help="bytes per partition (float64)"
    )
    add_repeat(p, 5, "of each")
    p.add_argument("--split", action="store_true", help="dask_overlap with split_axis=0")
    p.add_argument("--profile", type=int, default=0, help="print the top N functions")
    add_output(p)
    args = p.parse_args(argv)

    dask.config.set({"overlap.backend": "host"})
    cols = 64
    rows = max(1, args.partition // (8 * cols))
    x = da.ones((rows * args.partitions, cols), chunks=(rows, cols)).persist(scheduler="sync")
    plain = da.map_blocks(np.negative, x, dtype=x.dtype)
    # A partition a block (batch=1), as plain Dask's: with split_axis the default would
    # join the blocks, and this measures what each partition costs.
    ours = dask_overlap.map_blocks(
        np.negative, x, dtype=x.dtype, split_axis=0 if args.split else None, batch=1
    )
    dask.persist(ours[: 4 * rows], plain[: 4 * rows], scheduler="sync")  # warm-up
    # Dask fuses each block's input into plain Dask's task and runs the pair as a
    # subgraph (dask.order on every run); dask_overlap's tasks opt out of that fusion.
    # Plain Dask with fusion off is Dask's bare per-task cost: the floor under both.
    plain_us, ours_us, unfused_us = best_us(
        (plain, True), (ours, True), (plain, False), repeat=args.repeat
    )
    result = {
        "backend": "host",
        "partitions": args.partitions,
        "partition_bytes": rows * cols * 8,
        "dask_us_per_partition": plain_us,
        "overlap_us_per_partition": ours_us,
        "ratio": ours_us / plain_us,
        "dask_unfused_us_per_partition": unfused_us,
        "overlap_over_unfused": ours_us / unfused_us,
    }
    print(
        f"{args.partitions} partitions of {rows * cols * 8} bytes, synchronous scheduler: "
        f"plain Dask {plain_us:.0f} µs, dask_overlap {ours_us:.0f} µs per partition "
        f"({result['ratio']:.2f}x); plain Dask unfused {unfused_us:.0f} µs "
        f"(dask_overlap {result['overlap_over_unfused']:.2f}x of it)"
    )
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        dask.persist(ours, scheduler="sync")
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    figures = {k: v for k, v in result.items() if k != "backend"}
    save(args, BENCHMARK, result, figures, device_name("host"))
    return result


if __name__ == "__main__":
    main()
