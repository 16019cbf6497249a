"""A pipeline, not one call: chained stages, elementwise steps, a reduction, a store.

Pageable float32 input of rows of 4096 (``--size``, in blocks of ``--block``), the
threaded scheduler, no ``overlap.*`` settings, every figure until every output chunk
exists, GB/s of input. Each case beside its reference, in one run:

- **chain**: three row-wise stages (detrend ``b - b.mean(axis=1, keepdims=True)``, power
  spectrum ``abs(rfft(b, axis=1))**2``, ``log10``), each its own
  ``dask_overlap.map_blocks(..., split_axis=0)`` call (``chain_default``), against the
  three fused by hand into one function (``chain_fused_by_hand``) and the naive Dask +
  CuPy path (``chain_naive``);
- **reduce**: ``dask_overlap.map_blocks(lambda b: b * b, x, split_axis=0).mean(axis=0)``
  against the partial sum written into the function by hand, then Dask's sum;
- **elementwise**: a stage then ``* 2 + 1``, against the same in one function;
- **store**: a stage stored into a NumPy array (``da.store``), against the same stage
  persisted.

Example::

    python benchmarks/bench_pipeline.py --size 4GiB --block 256MiB --record
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import dask
import dask.array as da
import numpy as np

import dask_overlap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    GB,
    add_backend,
    add_output,
    add_repeat,
    best_of,
    byte_count,
    device_name,
    naive_block,
    parser,
    persist_chunks,
    random_data,
    save,
)

BENCHMARK = "pipeline"
COLS = 4096


def xp(b: Any) -> Any:
    """The array module of ``b``: CuPy on the GPU, NumPy on the host backends."""
    return sys.modules["cupy"] if type(b).__module__.startswith("cupy") else np


def detrend(b: Any) -> Any:
    return b - b.mean(axis=1, keepdims=True)


def spectrum(b: Any) -> Any:
    return (abs(xp(b).fft.rfft(b, axis=1)) ** 2).astype(b.dtype)


def log(b: Any) -> Any:
    return xp(b).log10(b + 1e-12)


def chain_by_hand(b: Any) -> Any:
    return log(spectrum(detrend(b)))


def square(b: Any) -> Any:
    return b * b


def partial_sum(b: Any) -> Any:
    return (b * b).sum(axis=0, keepdims=True)


def detrend_twice_plus_one(b: Any) -> Any:
    return detrend(b) * 2 + 1


def cases(x: da.Array, backend: str) -> dict[str, da.Array]:
    """Every case's array, by name (see the module docstring)."""
    spec_chunks = (x.chunks[0], (COLS // 2 + 1,))

    def stage(fn: Any, arr: da.Array, **kw: Any) -> da.Array:
        return dask_overlap.map_blocks(fn, arr, split_axis=0, dtype=np.float32, **kw)

    def naive(fn: Any, arr: da.Array, **kw: Any) -> da.Array:
        return arr.map_blocks(naive_block, fn, backend, dtype=np.float32, **kw)

    rows = x.shape[0]
    return {
        "chain_naive": naive(log, naive(spectrum, naive(detrend, x), chunks=spec_chunks)),
        "chain_fused_by_hand": stage(chain_by_hand, x, chunks=spec_chunks),
        "chain_default": stage(log, stage(spectrum, stage(detrend, x), chunks=spec_chunks)),
        "reduce_naive": naive(square, x).mean(axis=0),
        "reduce_partial_by_hand": dask_overlap.map_blocks(
            partial_sum, x, dtype=np.float32, chunks=((1,) * x.numblocks[0], (COLS,))
        ).sum(axis=0)
        / rows,
        "reduce_default": stage(square, x).mean(axis=0),
        "elementwise_by_hand": stage(detrend_twice_plus_one, x),
        "elementwise_default": stage(detrend, x) * 2 + 1,
        "store_persist": stage(detrend, x),
    }


def timed_store(y: da.Array) -> tuple[float, list[np.ndarray]]:
    """Seconds to store ``y`` into a NumPy array (fresh, as a persisted result's chunks
    are), and the array as one chunk."""
    target = np.empty(y.shape, y.dtype)
    t0 = time.perf_counter()
    da.store(y, target, lock=False)
    return time.perf_counter() - t0, [target]


def close(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    """Whether two results agree (float32 FFTs on one device: to rounding)."""
    x, y = np.concatenate([np.asarray(c) for c in a]), np.concatenate([np.asarray(c) for c in b])
    return x.shape == y.shape and bool(np.allclose(x, y, rtol=1e-4, atol=1e-4))


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--size", type=byte_count, default="4GiB", help="input bytes (float32)")
    p.add_argument("--block", type=byte_count, default="256MiB", help="bytes per input block")
    add_backend(p)
    add_repeat(p, 2)
    p.add_argument("--cases", default="", help="comma list of cases to run (default: all)")
    add_output(p)
    args = p.parse_args(argv)
    dask.config.set({"overlap.backend": args.backend})
    rows_per_block = max(1, args.block // (4 * COLS))
    rows = max(rows_per_block, args.size // (4 * COLS) // rows_per_block * rows_per_block)
    host = random_data((rows, COLS))
    x = da.from_array(host, chunks=(rows_per_block, COLS))
    nbytes = host.nbytes
    arrays = cases(x, args.backend)
    if args.cases:  # a subset, each with what it is compared to (to find a failing one)
        arrays = {k: v for k, v in arrays.items() if k in args.cases.split(",")}
    seconds, got = {}, {}
    for name, arr in arrays.items():
        print(f"  running {name}", flush=True)
        dask.persist(arr if arr.ndim == 1 else arr[:rows_per_block])  # warm-up
        seconds[name], got[name] = best_of(lambda a=arr: persist_chunks(a), args.repeat)
    if "store_persist" in arrays:
        print("  running store_default", flush=True)
        y = arrays["store_persist"]
        da.store(y[:rows_per_block], np.empty((rows_per_block, *y.shape[1:]), y.dtype))  # warm-up
        seconds["store_default"], got["store_default"] = best_of(
            lambda: timed_store(arrays["store_persist"]), args.repeat
        )
    if args.cases:
        for name, s in seconds.items():
            print(f"  {name:<24} {nbytes / s / GB:7.2f} GB/s")
        return {}
    gbps = {name: nbytes / s / GB for name, s in seconds.items()}
    correct = (
        close(got["chain_default"], got["chain_naive"])
        and close(got["chain_fused_by_hand"], got["chain_naive"])
        and close(got["reduce_default"], got["reduce_naive"])
        and close(got["reduce_partial_by_hand"], got["reduce_naive"])
        and close(got["elementwise_default"], got["elementwise_by_hand"])
        and close(got["store_default"], got["store_persist"])
    )
    result = {
        "device": device_name(dask_overlap.get_runtime().name),
        "size_bytes": nbytes,
        "block_bytes": rows_per_block * COLS * 4,
        **{f"{name}_gbps": v for name, v in gbps.items()},
        "chain_over_hand": gbps["chain_default"] / gbps["chain_fused_by_hand"],
        "reduce_over_hand": gbps["reduce_default"] / gbps["reduce_partial_by_hand"],
        "elementwise_over_hand": gbps["elementwise_default"] / gbps["elementwise_by_hand"],
        "store_over_persist": gbps["store_default"] / gbps["store_persist"],
        "fused": "\n".join(  # one at a time: a stage two cases share is read twice
            dask_overlap.explain(a)
            for a in (
                arrays["chain_default"],
                arrays["reduce_default"],
                arrays["elementwise_default"],
                da.store(arrays["store_persist"], np.empty(0), compute=False),
            )
        ),
        "correct": correct,
    }
    width = max(map(len, gbps))
    print(f"{result['device']}: {nbytes / 2**30:.2f} GiB float32 in blocks of "
          f"{result['block_bytes'] / 2**20:.0f} MiB, rows of {COLS}")  # fmt: skip
    for name, v in gbps.items():
        print(f"  {name:<{width}} {v:7.2f} GB/s")
    for key in ("chain_over_hand", "reduce_over_hand", "elementwise_over_hand"):
        print(f"  {key}: {result[key]:.2f}")
    print(f"  store_over_persist: {result['store_over_persist']:.2f}; correct={correct}")
    print("  " + result["fused"].replace("\n", "\n  "))
    figures = {k: v for k, v in result.items() if k not in ("fused",)}
    save(args, BENCHMARK, result, figures, result["device"])
    return result


if __name__ == "__main__":
    main()
