"""Two chained stages over small blocks, by default: the first leaves its blocks on the
device (``out="device"``), the second copies its result back.

``dask_overlap.map_blocks(g, dask_overlap.map_blocks(f, x, split_axis=0, out="device"),
split_axis=0)`` on pinned input of ``--size`` bytes in ``--block`` blocks, persisted on
Dask's threaded scheduler in this process, best of ``--repeat``. Both stages join their
blocks (``batch="auto"``); the first stage's blocks are cut back, and the second takes
its partitions' outputs as they are. ``--batch K`` runs the same chain beside it with
``batch=K`` in the first stage (joined outputs kept, nothing cut) and a partition per
joined block in the second. Prints GB/s of
input, the tasks of the optimized graph by kind, and whether the result is right.

Example (on the GPU machine)::

    python3 benchmarks/diagnostics/chained_stages.py --size 2GiB --block 4MiB --batch 16
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask.utils import format_bytes

import dask_overlap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (  # noqa: E402
    COLS,
    add_output,
    add_repeat,
    array_of_views,
    best_of,
    byte_count,
    device_name,
    parser,
    persist_timed,
    pinned_copy,
    save,
)


def f(b: Any) -> Any:
    return b * 2 + 1


def g(b: Any) -> Any:
    return b - 1


def chain(x: da.Array, batch: int | str) -> da.Array:
    """The two stages; with ``batch=K`` the first joins K blocks and keeps them joined,
    and the second runs a partition per joined block."""
    first = dask_overlap.map_blocks(f, x, split_axis=0, out="device", batch=batch)
    return dask_overlap.map_blocks(g, first, split_axis=0, batch=1 if batch != "auto" else batch)


def tasks(arr: da.Array) -> dict[str, int]:
    (opt,) = dask.optimize(arr)
    keys = [k for k in dict(opt.__dask_graph__()) if isinstance(k, tuple)]
    return dict(Counter(k[0].rsplit("-", 1)[0] for k in keys))


def best_seconds(arr: da.Array, repeat: int, threads: int) -> tuple[float, np.ndarray]:
    """The best seconds of persisting ``arr`` (threaded scheduler), and its last result."""
    best, done = best_of(
        lambda: persist_timed(arr, scheduler="threads", num_workers=threads), repeat
    )
    return best, done.compute(scheduler="sync")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__)
    p.add_argument("--size", type=byte_count, default="2GiB", help="input bytes (float32)")
    p.add_argument("--block", type=byte_count, default="4MiB", help="input block bytes")
    p.add_argument("--threads", type=int, default=8, help="Dask threads")
    add_repeat(p, 3, "of each chain")
    p.add_argument("--batch", default=None, help="also run batch=K in the first stage, kept joined")
    add_output(p)
    args = p.parse_args(argv)
    rt = dask_overlap.get_runtime()
    rows_per_block = max(1, args.block // (4 * COLS))
    rows = max(1, args.size // (4 * COLS)) // rows_per_block * rows_per_block
    host = pinned_copy(rt, np.random.default_rng(0).random((rows, COLS), dtype=np.float32))
    x = array_of_views(host, rows_per_block)
    want = g(f(host))
    results: dict[str, Any] = {
        "backend": rt.name,
        "size_bytes": host.nbytes,
        "block_bytes": rows_per_block * COLS * 4,
        "blocks": x.numblocks[0],
        "threads": args.threads,
        "runs": {},
    }
    cases = ["auto"] + ([int(args.batch)] if args.batch else [])
    for batch in cases:
        arr = chain(x, batch)
        best_seconds(arr, 1, args.threads)  # warm-up: compilation, pools
        seconds, got = best_seconds(arr, args.repeat, args.threads)
        r = {
            "gbps": host.nbytes / seconds / 1e9,
            "seconds": seconds,
            "tasks": tasks(arr),
            "correct": bool(np.array_equal(got, want)),
        }
        results["runs"][str(batch)] = r
        print(
            f"batch={batch}: {r['gbps']:.2f} GB/s ({format_bytes(host.nbytes)} in "
            f"{x.numblocks[0]} blocks of {format_bytes(rows_per_block * COLS * 4)}), "
            f"tasks {r['tasks']}, correct={r['correct']}",
            flush=True,
        )
    figures = {k: results[k] for k in ("size_bytes", "block_bytes", "threads")}
    for batch, r in results["runs"].items():
        figures[f"batch={batch}"] = {"gbps": r["gbps"], "correct": r["correct"]}
    save(args, "chained-stages", results, figures, device_name(rt.name))
    return results


if __name__ == "__main__":
    main()
