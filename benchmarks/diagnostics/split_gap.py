"""Where does ``split_axis=0`` lose to whole partitions on the default path? (issue 31)

The path users run (``bench_default.py``'s: pageable float32 in 256 MiB partitions, the
balanced kernel, no setting), ``split_axis=0`` and whole partitions persisted in turn,
``--repeat`` rounds. Beside each run's seconds, what the runtime counted over it alone:
partitions and sub-chunks (a partition cut by ``sub-chunk-bytes: auto`` runs more than
one), each stage's busy seconds, the seconds its tasks waited on the window
(backpressure), how often the pinned ring was full, and results made in reused and in
fresh memory. A stage whose busy seconds grow with the split, or cut partitions, names
what the split path pays that whole partitions do not.

Example (CPU, small)::

    python3 benchmarks/diagnostics/split_gap.py --size 512MiB --partition 32MiB
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
from dask.utils import format_bytes

import dask_overlap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (  # noqa: E402
    COLS,
    GB,
    add_output,
    add_repeat,
    byte_count,
    counted,
    default_input,
    device_name,
    naive,
    parser,
    persist_chunks,
    same_chunks,
    save,
    warm_up,
)

BENCHMARK = "split-gap"


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--size", type=byte_count, default="8GiB", help="input bytes (float32)")
    p.add_argument("--partition", type=byte_count, default="256MiB", help="bytes per partition")
    add_repeat(p, 3, "of each path")
    add_output(p)
    args = p.parse_args(argv)

    rt = dask_overlap.get_runtime()  # the defaults: no overlap.* setting is touched
    data = default_input(rt, args.size, args.partition)
    x, func, nbytes = data.x, data.func, data.host.nbytes
    arrays = {
        "split": dask_overlap.map_blocks(func, x, split_axis=0, dtype=np.float32),
        "whole": dask_overlap.map_blocks(func, x, dtype=np.float32),
    }
    warm_up(*arrays.values())
    ref = persist_chunks(naive(x, func))[1]  # every run is checked against the naive path's
    correct = True
    runs: list[dict[str, Any]] = []
    for i in range(args.repeat):
        for name, arr in arrays.items():
            before = rt.stats()
            seconds, got = persist_chunks(arr)
            row = {"round": i, "case": name, "gbps": nbytes / seconds / GB}
            row.update(counted(before, rt.stats()))
            correct = correct and same_chunks(ref, got)
            del got  # the run's results go before the next run (back to the result pool)
            runs.append(row)
            busy = ", ".join(f"{k} {v:.2f}" for k, v in row["busy_seconds"].items())
            print(
                f"  {i} {name:5s} {row['gbps']:6.2f} GB/s  partitions {row['partitions']} "
                f"sub-chunks {row['sub_chunks']}  backpressure {row['backpressure_seconds']:.2f} s "
                f"ring full {row['ring_full']}  results reused {row['results_reused']} fresh "
                f"{row['results_fresh']}  busy: {busy}",
                flush=True,
            )
    best = {n: max(r["gbps"] for r in runs if r["case"] == n) for n in arrays}
    pairs = [s["gbps"] / w["gbps"] for s, w in zip(runs[0::2], runs[1::2], strict=True)]
    result = {
        "device": device_name(rt.name),
        "backend": rt.name,
        "size_bytes": nbytes,
        "partition_bytes": data.rows_per_part * COLS * 4,
        "correct": correct,
        "runs": runs,
        "split_gbps": best["split"],
        "nosplit_gbps": best["whole"],
        "split_over_nosplit_pairs": pairs,
    }
    print(
        f"{format_bytes(nbytes)} in {x.numblocks[0]} partitions: split {best['split']:.2f}, "
        f"whole {best['whole']:.2f} GB/s; pairs {', '.join(f'{r:.3f}' for r in pairs)}; "
        f"correct {correct}"
    )
    figures = {k: result[k] for k in ("size_bytes", "split_gbps", "nosplit_gbps", "correct")}
    save(args, BENCHMARK, result, figures, result["device"])
    return result


if __name__ == "__main__":
    main()
