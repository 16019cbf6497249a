"""The benchmark's kernel: elementwise, of adjustable length, one launch on the GPU.

On NumPy it is a loop of vectorised passes. On CuPy it is one fused ``ElementwiseKernel``
whose length is an argument: a Python loop of CuPy operations would measure the host's
kernel-launch rate (tens of microseconds a launch), not the GPU, and a real workload that
cares about throughput launches few, long kernels. The CuPy kernel lives in this
importable module, created on first use (a CuPy kernel defined in __main__ is copied when
Dask pickles the task: see dask_overlap/backends/cuda.py, "the __main__ kernel trap").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["make_kernel"]


@functools.cache
def _fused() -> Any:
    import cupy

    return cupy.ElementwiseKernel(
        "float32 x, int32 n",
        "float32 y",
        """
        float v = x * 1.0001f + 0.5f;
        for (int k = 0; k < n; ++k) {
            v = v * 0.9999f + 0.25f;
        }
        y = v;
        """,
        "dask_overlap_bench_kernel",
    )


def make_kernel(iterations: int) -> Callable[[Any], Any]:
    """The kernel with ``iterations`` extra multiply-adds per element."""

    def kernel(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            y = x * np.float32(1.0001) + np.float32(0.5)
            for _ in range(iterations):
                y = y * np.float32(0.9999) + np.float32(0.25)
            return y
        return _fused()(x, np.int32(iterations))

    kernel.__name__ = f"kernel{iterations}"
    return kernel
