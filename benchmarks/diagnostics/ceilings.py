"""Stage ceilings on this machine: the rates every benchmark's bound is made of.

For one partition of float32 data on the chosen backend, prints what
``common.measure_ceilings`` measures in each benchmark's run (or, on ``timed``, models):
H2D and D2H between pinned and device memory, both directions at once, staging (pageable
into pinned) and fresh results (pinned into new arrays) with the runtime's copy threads,
and the kernel's seconds and iterations for ``--workload``. ``overlap.yaml``'s bandwidth
defaults come from such figures.

Example::

    python benchmarks/diagnostics/ceilings.py --backend host --partition 32MiB
"""

from __future__ import annotations

import os
import sys
from typing import Any

import dask

import dask_overlap
from dask_overlap.backends import resolve_backend

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (  # noqa: E402
    COLS,
    GB,
    WORKLOADS,
    add_backend,
    byte_count,
    device_name,
    measure_ceilings,
    parser,
    random_data,
    write_json,
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__)
    add_backend(p)
    p.add_argument("--partition", type=byte_count, default="256MiB", help="bytes measured")
    p.add_argument("--workload", default="balanced", choices=WORKLOADS)
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)

    backend = resolve_backend(args.backend)
    dask.config.set({"overlap.backend": backend})
    rt = dask_overlap.get_runtime(backend)
    block = random_data((max(1, args.partition // (4 * COLS)), COLS))
    ceilings, kernel_s, iterations = measure_ceilings(rt, block, args.workload)
    result = {
        "device": device_name(backend),
        "backend": backend,
        "partition_bytes": block.nbytes,
        "copy_threads": rt.copy_threads,
        "rates_gbps": {k: v / GB for k, v in ceilings.items() if k != "host_cores"},
        "kernel_seconds": kernel_s,
        "kernel_iterations": iterations,
    }
    print(f"{result['device']}, backend={backend}, {block.nbytes} bytes a partition:")
    for name, gbps in result["rates_gbps"].items():
        print(f"  {name:<8} {gbps:8.2f} GB/s")
    print(f"  kernel   {kernel_s * 1e3:8.2f} ms ({iterations} iterations, {args.workload})")
    write_json(args.json, result)
    dask_overlap.close_runtimes()
    return result


if __name__ == "__main__":
    main()
