"""The __main__ kernel trap (DESIGN.md), as the user writes it: run as a script.

``python cuda_trap_script.py MODE KIND``: MODE is ``plain`` (``dask.array.map_blocks``,
with no dask_overlap import: reproduces the trap), ``guarded`` (the same after
``guard_kernel_pickling()``) or ``overlap`` (``dask_overlap.map_blocks``: must work);
KIND is ``elementwise``, ``reduction``, ``raw`` or ``ufunc`` (``cupy.negative`` itself as
func, after it ran in the client: its compiled module pickled by value). Prints ``OK`` and
exits 0 when every result is right.
"""

from __future__ import annotations

import gc
import sys

import cupy as cp
import dask
import dask.array as da
import numpy as np

MODE, KIND = sys.argv[1], sys.argv[2]

# Module-level kernels in __main__: the form users write.
twice_plus_one = cp.ElementwiseKernel("T x", "T y", "y = 2 * x + 1", "twice_plus_one")
row_sum = cp.ReductionKernel("T x", "T y", "x", "a + b", "y = a", "0", "row_sum")
raw_twice = cp.RawKernel(
    r"""
extern "C" __global__ void raw_twice(const float* x, float* y, long long n) {
    long long i = (long long)blockDim.x * blockIdx.x + threadIdx.x;
    if (i < n) y[i] = 2 * x[i] + 1;
}
""",
    "raw_twice",
)


def func(b):
    if KIND == "ufunc":
        return -b
    if KIND == "elementwise":
        return twice_plus_one(b)
    if KIND == "reduction":
        return row_sum(b, axis=1, keepdims=True) * 0 + 2 * b + 1
    y = cp.empty_like(b)
    n = b.size
    raw_twice(((n + 255) // 256,), (256,), (cp.ascontiguousarray(b), y, cp.int64(n)))
    return y


def main() -> int:
    if MODE == "guarded":
        from dask_overlap.backends.kernel_pickling import guard_kernel_pickling

        guard_kernel_pickling()
    x_np = np.arange(64 * 1024, dtype=np.float32).reshape(256, 256)
    func(cp.asarray(x_np[:2]))  # the kernel is compiled and used in the client first
    want = -x_np if KIND == "ufunc" else 2 * x_np + 1
    x = da.from_array(x_np, chunks=(64, 256))
    for attempt in range(3):
        if MODE in ("plain", "guarded") and KIND == "ufunc":
            on_gpu = x.map_blocks(cp.asarray, meta=cp.empty((0, 0), np.float32))
            y = da.map_blocks(cp.negative, on_gpu).map_blocks(cp.asnumpy, meta=x._meta)
        elif MODE in ("plain", "guarded"):
            y = da.map_blocks(lambda b: cp.asnumpy(func(cp.asarray(b))), x, dtype=np.float32)
        else:
            import dask_overlap

            y = dask_overlap.map_blocks(
                cp.negative if KIND == "ufunc" else func,
                x,
                dtype=np.float32,
                split_axis=0,
                sub_chunk_bytes=16 * 1024,
            )
        got = y.compute(scheduler="threads")
        gc.collect()
        if not np.array_equal(got, want):
            print(f"WRONG attempt={attempt}")
            return 1
    # and the original kernel still works in this thread after the tasks' copies are gone
    gc.collect()
    assert np.array_equal(cp.asnumpy(func(cp.asarray(x_np))), want)
    dask.config.refresh()
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
