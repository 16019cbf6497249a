"""Peak memory of a partition: dask_overlap against plain ``dask.array.map_blocks``.

Small blocks (4 MiB by default) of ``b * 2 + 1``, persisted input, the synchronous
scheduler (one partition at a time): host memory is traced (``tracemalloc``, which sees
NumPy's allocations), and a partition's peak is what the run allocated beyond what it
keeps (the results) plus one partition's output. Printed beside plain Dask's, as a
multiple of a partition's input bytes: ``batch="auto"`` joins the blocks into partitions
of up to 64 MiB, which must stay within the stated multiple
(``dask_overlap.graph.batch.PEAK_MULTIPLE``). On a GPU the device pool's peak (RMM's
statistics) is printed too, and pinned memory (a fixed pool) is not host growth.

Example::

    python benchmarks/peak_memory.py --size 512MiB --block 4MiB
"""

from __future__ import annotations

import gc
import os
import sys
import tracemalloc
from typing import Any

import dask
import dask.array as da
import numpy as np

import dask_overlap
from dask_overlap.backends import resolve_backend
from dask_overlap.graph.batch import PEAK_MULTIPLE, auto_batch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_backend, add_output, byte_count, device_name, parser, save  # noqa: E402

BENCHMARK = "peak-memory"


def f(b: Any) -> Any:
    return b * 2 + 1


def _device_peak(run: Any, on_device: bool) -> int | None:
    """``run()``'s peak device pool bytes, where the partitions run on the device and RMM
    can tell (else ``None``, and ``run`` is not called: RMM installed on a machine that
    shows no GPU raises as soon as it is asked)."""
    if not on_device:
        return None
    try:
        import rmm.statistics
    except ImportError:
        return None
    with rmm.statistics.statistics():
        run()
        stats = rmm.statistics.get_statistics()
    return None if stats is None else int(stats.peak_bytes)


def peak(y: da.Array, partitions: int, on_device: bool) -> dict[str, float]:
    """Host bytes ``y``'s persist allocated at its peak beyond what it keeps, plus one
    partition's output: the peak of one partition (the synchronous scheduler runs them
    one at a time); and the device pool's peak where there is one."""
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    start = tracemalloc.get_traced_memory()[0]
    kept: list[Any] = []
    device = _device_peak(lambda: kept.extend(dask.persist(y, scheduler="sync")), on_device)
    if device is None and not kept:
        kept.extend(dask.persist(y, scheduler="sync"))
    now, top = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out_per_partition = (now - start) / partitions
    kept.clear()
    return {"host": top - now + out_per_partition, "device": device or 0}


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--size", type=byte_count, default="512MiB", help="input bytes (float32)")
    p.add_argument("--block", type=byte_count, default="4MiB", help="bytes per input block")
    add_backend(p)
    add_output(p)
    args = p.parse_args(argv)
    dask.config.set({"overlap.backend": args.backend})
    on_device = resolve_backend(args.backend) == "cuda"
    cols = 256
    rows = max(1, args.block // (4 * cols))
    n = max(1, args.size // (rows * cols * 4))
    x = da.random.default_rng(9).random((rows * n, cols), dtype="f4", chunks=(rows, cols))
    x = x.persist(scheduler="sync")
    block = rows * cols * 4
    k = auto_batch(False, [x], (0,), 2, 0, None, None)  # what batch="auto" joins here
    parts = {
        "dask": (x.map_blocks(f, dtype=x.dtype), n, block),
        "overlap_batch_1": (dask_overlap.map_blocks(f, x, split_axis=0, batch=1), n, block),
    }
    parts["overlap_auto"] = (dask_overlap.map_blocks(f, x, split_axis=0), -(-n // k), block * k)
    dask.persist(*(y[:rows] for y, _, _ in parts.values()), scheduler="sync")  # warm-up
    result: dict[str, Any] = {"backend": args.backend, "block_bytes": block, "auto_batch": k}
    for name, (y, partitions, nbytes) in parts.items():
        got = peak(y, partitions, on_device)
        result[f"{name}_partition_bytes"] = nbytes
        result[f"{name}_host_peak_bytes"] = got["host"]
        result[f"{name}_host_peak_ratio"] = got["host"] / nbytes
        if got["device"]:
            result[f"{name}_device_peak_bytes"] = got["device"]
            result[f"{name}_device_peak_ratio"] = got["device"] / nbytes
    result["stated_multiple"] = PEAK_MULTIPLE
    print(f"{n} blocks of {block / 2**20:.1f} MiB, b * 2 + 1, synchronous scheduler")
    for name, (_, _, nbytes) in parts.items():
        line = (
            f"  {name:<16} partition {nbytes / 2**20:6.1f} MiB  host peak "
            f"{result[f'{name}_host_peak_bytes'] / 2**20:7.1f} MiB "
            f"({result[f'{name}_host_peak_ratio']:.2f}x)"
        )
        if f"{name}_device_peak_bytes" in result:
            line += (
                f"  device peak {result[f'{name}_device_peak_bytes'] / 2**20:7.1f} MiB "
                f"({result[f'{name}_device_peak_ratio']:.2f}x)"
            )
        print(line)
    figures = {k: v for k, v in result.items() if k.endswith("ratio") or k == "auto_batch"}
    save(args, BENCHMARK, result, figures, device_name(args.backend))
    return result


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
