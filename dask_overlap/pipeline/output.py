"""A partition's output: where each sub-chunk's result lands, made on first use.

The first result decides the output's shape and dtype (checked against what the Dask
array declares for the block); later sub-chunks must match it. By ``out`` mode, the
output is an ordinary NumPy array (``"host"``, filled by unstaging or by direct copies),
a block of the pinned pool (``"pinned"``, bounded: past its bound an ordinary array,
counted as a fallback), or device memory (``"device"``). A partition of one sub-chunk
whose result can be handed on as it is (on the device; or on a backend whose device
memory is host memory, when it holds no block of the ring) has no separate output. A
partition that ends in a fused store fills the target's region instead (see
:mod:`.store`).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from ..backends.base import Backend
from .layout import Layout
from .recycle import ResultPool
from .results import check_declared, check_like_first

__all__ = ["PartitionOutput"]


class PartitionOutput:
    """The output of one partition (see the module docstring); safe to use from the
    threads that enqueue its sub-chunks."""

    __slots__ = ("_lock", "array", "backend", "fallbacks", "lay", "ready", "results", "spec")

    def __init__(self, backend: Backend, lay: Layout, spec: Any, results: ResultPool):
        self.backend = backend
        self.results = results
        self.lay = lay
        self.spec = spec
        self.array: Any = None
        self.ready: Any = None  # out="device": a mark made after allocating the array
        self.fallbacks = 0  # out="pinned" past the pool's bound for held results
        self._lock = threading.Lock()

    def slot(self, i: int, result: Any, stream: Any, direct: bool) -> Any:
        """Where sub-chunk ``i``'s ``result`` goes in the output; ``None`` when the
        result is the output itself (see the module docstring)."""
        spec = self.spec
        with self._lock:
            if self.array is not None:
                check_like_first(
                    spec.func_name,
                    result,
                    self.array,
                    spec.out_split_axis,
                    self.lay.plan.sub_chunks[i],
                    self.lay.cut,
                    spec.key,
                )
                return self.lay.out_slice(self.array, i)
            shape = self.lay.out_shape(result.shape)
            check_declared(
                spec.func_name, shape, result.dtype, spec.out_shape, spec.out_dtype, spec.key
            )
            into = spec.into  # a fused store's region of its target: filled in place
            if into is not None and into.shape == shape and into.dtype == result.dtype:
                self.array = into
                return self.lay.out_slice(into, i)
            host_memory = self.backend.host_memory
            if not self.lay.cut and (
                (
                    spec.out == "device"
                    # Where device memory is host memory, a result that is (a view of) its
                    # input staged in the ring would hold a ring block for as long as Dask
                    # holds the result, past the pool's bound for held results: copied.
                    and (not host_memory or direct or not self.backend.is_pinned(result))
                )
                or (
                    spec.out == "host"
                    and direct
                    and host_memory
                    and type(result) is np.ndarray  # an ordinary array, as out="host" says
                )
            ):
                self.array = result
                return None
            self.array = self._allocate(shape, result.dtype, stream)
            return self.lay.out_slice(self.array, i)

    def _allocate(self, shape: tuple[int, ...], dtype: np.dtype, stream: Any) -> Any:
        if self.spec.out == "device":
            array = self.backend.empty_device(shape, dtype)
            # The other sub-chunks write into it from their own streams, after this mark.
            self.ready = self.backend.mark(stream)
            return array
        if self.spec.out == "pinned":
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            block = self.backend.pinned.allocate(nbytes) if nbytes else None
            if block is not None:
                return block.view(dtype).reshape(shape)
            if nbytes:
                self.fallbacks += 1  # past the pool's bound for held results
        # Memory of results Dask let go where the pool has some; else fresh memory,
        # untouched until the copy threads write it (they fault its pages in, in parallel).
        return self.results.empty(shape, dtype)
