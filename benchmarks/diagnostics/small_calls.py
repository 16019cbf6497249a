"""Where a call over small blocks spends its wall, and what its pieces cost (GPU).

Pinned input of 4 MiB blocks (1 GiB) and 16 MiB blocks (2 GiB), the benchmarks' balanced
kernel, ``out="pinned"``, ``split_axis=0``, Dask's threaded scheduler on ``--threads``:

- ``auto``: every setting at its default (``batch="auto"``: 64 MiB batches, each cut back
  into its blocks), with each partition's start and end on the host clock: the lead
  before the first partition (Dask's optimization and ordering), the span of the
  partitions, the tail after the last, and how many ran at once on average;
- ``cut in two``: the same with 32 MiB sub-chunks (what ``sub-chunk-bytes: auto`` did to
  pinned 64 MiB partitions before 2051313);
- ``no cut back``: ``batch=k`` given, the batches' outputs as they are (no slice task a
  block: what Dask's task a block costs);
- ``chunksize 8``: ``auto`` with Dask's ``chunksize=8`` (tasks sent to the threads eight at
  a time: what the scheduler's round trip a task costs);
- ``dask no-op``: ``dask.array.map_blocks`` of a function that returns its block, on the
  same blocks (Dask's floor for a task a block).

Variants run in turn, best of ``--rounds`` after one untimed round. Run on the device:
``python3 benchmarks/diagnostics/small_calls.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

import cupyx
import dask
import numpy as np

import dask_overlap
import dask_overlap.pipeline.task as partition_tasks

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import array_of_views, make_kernel  # noqa: E402

SIZES = ((4 << 20, 1 << 30, 16), (16 << 20, 2 << 30, 4))  # block, input, blocks a batch
SPANS: list[tuple[int, float, float]] = []  # (thread, start, end) of each partition


def _timed_run_partition(run: Any) -> Any:
    def timed(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return run(*args)
        finally:
            SPANS.append((threading.get_ident(), t0, time.perf_counter()))

    return timed


def spans_line(t0: float, t1: float, spans: list) -> str:
    if not spans:
        return ""
    first, last = min(s[1] for s in spans), max(s[2] for s in spans)
    busy = sum(s[2] - s[1] for s in spans)
    return (
        f"; {len(spans)} partitions: lead {1e3 * (first - t0):5.2f} ms, span "
        f"{1e3 * (last - first):6.2f}, tail {1e3 * (t1 - last):5.2f}, "
        f"{busy / max(last - first, 1e-9):4.2f} at once"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="4", help="a comma list of Dask thread counts")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds of every variant")
    args = p.parse_args()
    partition_tasks.run_partition = _timed_run_partition(partition_tasks.run_partition)
    dask.config.set({"overlap.backend": "cuda", "overlap.pinned-pool-size": "6GiB"})
    f = make_kernel(1961)
    for block, total, k in SIZES:
        host = cupyx.empty_pinned((total // 4,), np.float32)
        host[...] = 1
        x = array_of_views(host.reshape(-1, 1024), block // 4096)

        def ours(x: Any = x, **kw: Any) -> Any:
            return dask_overlap.map_blocks(f, x, dtype=np.float32, out="pinned", split_axis=0, **kw)

        variants = {
            "auto": (ours(), {}),
            "cut in two": (ours(sub_chunk_bytes="32MiB"), {}),
            f"no cut back (batch={k})": (ours(batch=k), {}),
            "chunksize 8": (ours(), {"chunksize": 8}),
            "dask no-op": (x.map_blocks(lambda b: b, dtype=np.float32), {}),
        }
        for threads in (int(t) for t in args.threads.split(",")):
            best: dict[str, tuple] = {}
            for rnd in range(args.rounds + 1):
                for name, (y, kw) in variants.items():
                    SPANS.clear()
                    c0, t0 = time.process_time(), time.perf_counter()
                    dask.persist(y, num_workers=threads, **kw)
                    t1 = time.perf_counter()
                    cpu = time.process_time() - c0
                    if rnd and t1 - t0 < best.get(name, (float("inf"),))[0]:
                        best[name] = (t1 - t0, cpu, spans_line(t0, t1, list(SPANS)))
            for name, (s, cpu, spans) in best.items():
                print(
                    f"{block >> 20:2d} MiB blocks, {threads} threads, {name:24s}: "
                    f"{total / s / 1e9:6.2f} GB/s, wall {1e3 * s:6.2f} ms, "
                    f"CPU {1e3 * cpu:6.2f} ms{spans}",
                    flush=True,
                )
        del host, x, variants


if __name__ == "__main__":
    main()
