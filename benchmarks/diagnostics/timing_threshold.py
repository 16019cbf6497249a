"""Small blocks joined into 64 MiB partitions (``batch="auto"``): are they slower when every
one of them is timed on the device? A/B in one process, run for run in turn.

The lean path times a one-sub-chunk partition's stages only now and then, unless it moves
``sampling.ALWAYS_TIMED_BYTES`` or more (see :mod:`dask_overlap.pipeline.sampling`). A
batch of small blocks makes partitions of 64 MiB, where the host, not the copies, sets the
pace (``benchmarks/bench_limits.py --cases small``). This runs the balanced kernel over
pinned input in 4 and 16 MiB blocks (1 and 2 GiB), all settings at their defaults, with
the threshold at each of ``--thresholds``, in turn, ``--repeat`` times, and prints each
threshold's best GB/s and the median ratio of run pairs to the first threshold; with
``--profile N``, the top N functions of the first case's runs on the synchronous
scheduler (every partition then runs on the profiled thread), by own and by total time.

On an H100 (2026-12-06, ``benchmarks/results/small-blocks.txt``) 128 MiB against 32 was
not faster: median pair 1.009 with 4 MiB blocks, 0.895 with 16 MiB; the threshold stayed.

Run on the device: ``python3 benchmarks/diagnostics/timing_threshold.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
from typing import Any

import dask
import numpy as np
from dask.utils import format_bytes, parse_bytes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import array_of_views, make_kernel, persist_timed, pinned_copy  # noqa: E402

import dask_overlap  # noqa: E402
from dask_overlap.pipeline import sampling  # noqa: E402

COLS = 1024


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cuda", help="cuda, or timed or host to try it")
    p.add_argument("--cases", default="4MiB=1GiB,16MiB=2GiB", help="BLOCK=TOTAL pairs")
    p.add_argument("--thresholds", default="32MiB,128MiB")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--iterations", type=int, default=1961, help="kernel iterations")
    p.add_argument("--out", default="pinned")
    p.add_argument("--profile", type=int, default=0, help="print the top N functions")
    args = p.parse_args(argv)
    dask.config.set({"overlap.backend": args.backend})
    rt = dask_overlap.get_runtime(args.backend)
    f = make_kernel(args.iterations)
    limits = [parse_bytes(t) for t in args.thresholds.split(",")]
    for case in args.cases.split(","):
        block, total = (parse_bytes(v) for v in case.split("="))
        host = pinned_copy(rt, np.ones((total // 4 // COLS, COLS), np.float32))
        x = array_of_views(host, block // 4 // COLS)
        arr = dask_overlap.map_blocks(f, x, split_axis=0, dtype=np.float32, out=args.out)
        seconds: dict[int, list[float]] = {t: [] for t in limits}
        for warm in (True, *([False] * args.repeat)):
            for t in limits:
                sampling.ALWAYS_TIMED_BYTES = t
                s, done = persist_timed(arr, scheduler="threads", num_workers=args.threads)
                del done
                if not warm:
                    seconds[t].append(s)
        first = seconds[limits[0]]
        for t in limits:
            ratios = [a / b for a, b in zip(first, seconds[t], strict=True)]
            print(
                f"{format_bytes(block)} blocks, out={args.out}, threshold {format_bytes(t)}: "
                f"best {total / min(seconds[t]) / 1e9:.2f} GB/s, "
                f"median pair over {format_bytes(limits[0])} {statistics.median(ratios):.3f} "
                f"({', '.join(f'{r:.3f}' for r in ratios)})",
                flush=True,
            )
        if args.profile and case == args.cases.split(",")[0]:
            profile(arr, args.repeat, args.profile)
        del arr, x, host


def profile(arr: Any, repeat: int, top: int) -> None:
    """``repeat`` persists of ``arr`` on the synchronous scheduler under cProfile."""
    persist_timed(arr, scheduler="sync")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeat):
        persist_timed(arr, scheduler="sync")
    prof.disable()
    for order in ("tottime", "cumulative"):
        pstats.Stats(prof).sort_stats(order).print_stats(top)


if __name__ == "__main__":
    main()
