"""Where a partition's sub-chunks lie: in its inputs, in its output and in ``block_info``.

Pure functions of the partition's arrays and its
:class:`~dask_overlap.pipeline.partition.PartitionSpec`: no backend, no threads. The runner
asks them once per partition (:func:`layout`) and once per sub-chunk
(:meth:`Layout.inputs`, :meth:`Layout.out_slice`, :meth:`Layout.block_info`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Any

import numpy as np

from .engine import Plan, plan_sub_chunks

__all__ = [
    "AUTO_IN_FLIGHT",
    "AUTO_MIN_BYTES",
    "AUTO_UNSTAGED_BYTES",
    "Layout",
    "along",
    "auto_sub_chunk_bytes",
    "layout",
    "own_axis",
    "whole",
]

#: ``sub-chunk-bytes: auto`` aims at this many sub-chunks in flight on a runtime in all...
AUTO_IN_FLIGHT = 4
#: ...and never cuts below this size (smaller sub-chunks cost more host work per byte).
AUTO_MIN_BYTES = 64 << 20
#: The largest sub-chunk of a partition whose inputs need no staging (pinned already),
#: except a batch of at most ``AUTO_MIN_BYTES`` (left whole): a cut then costs a copy and
#: a kernel launch more, not a staging copy, and finer cuts fill and drain the copy
#: engines sooner (H100, 4 GiB pinned, 256 MiB partitions, 4 threads: 0.918 of the
#: both-ways bound at 32 MiB, 0.896 at 64 MiB, 0.841 whole:
#: benchmarks/results/pinned-sub-chunk-sweep.json).
AUTO_UNSTAGED_BYTES = 32 << 20


def own_axis(axis: int, ndim: int, array_ndim: int) -> int:
    """The axis of an array of ``array_ndim`` dimensions that stands for ``axis`` of the
    inputs' index space of ``ndim`` (Dask aligns arrays at their last axes, as NumPy
    broadcasts); negative where the array lacks it.

    Examples
    --------
    >>> own_axis(1, 3, 2), own_axis(0, 3, 2)
    (0, -1)
    """
    return axis - (ndim - array_ndim)


def along(axis: int, start: int, stop: int) -> tuple[slice, ...]:
    """The index of rows ``[start, stop)`` along ``axis``."""
    return (slice(None),) * axis + (slice(start, stop),)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one partition is cut, and where each sub-chunk lies.

    ``axes`` maps each array argument's position to the axis it is cut along (``None``:
    passed whole to every sub-chunk, e.g. broadcast along the split axis).
    """

    plan: Plan
    axes: dict[int, int | None]
    out_axis: int | None  # the split axis in the output (``None``: not split)
    #: Whether the partition is cut into more than one sub-chunk (asked per partition and
    #: per sub-chunk: a field, not a call to ``len(plan)``).
    cut: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cut", len(self.plan.sub_chunks) > 1)

    def inputs(self, inputs: dict[int, Any], i: int) -> list[Any]:
        """Sub-chunk ``i``'s read window of each input (by argument position, in ``axes``
        order: :class:`~.inputs.Input` objects, or anything with ``part``)."""
        if not self.cut:
            return list(map(inputs.__getitem__, self.axes))
        sub = self.plan.sub_chunks[i]
        return [
            inputs[p] if ax is None else inputs[p].part(along(ax, sub.read_start, sub.read_stop))
            for p, ax in self.axes.items()
        ]

    def out_slice(self, out: Any, i: int) -> Any:
        """Sub-chunk ``i``'s part of the partition's output ``out`` (its write window)."""
        if not self.cut:
            return out
        sub = self.plan.sub_chunks[i]
        return out[along(self.out_axis, sub.start, sub.stop)]

    def out_shape(self, sub_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The partition's output shape, from one sub-chunk's result shape."""
        if self.out_axis is None or not self.cut:
            return tuple(sub_shape)
        shape = list(sub_shape)
        shape[self.out_axis] = self.plan.extent
        return tuple(shape)

    def expected_out_bytes(self, i: int, shape: tuple | None, dtype: Any) -> int | None:
        """Bytes of sub-chunk ``i``'s output, from what the array declares (``None``:
        not known: an extent or the dtype is unknown)."""
        if shape is None or None in shape:
            return None
        if self.out_axis is not None and self.cut:
            dims = list(shape)
            dims[self.out_axis] = self.plan.sub_chunks[i].extent
            shape = dims
        # (A dtype not known: as many bytes an element as any dtype takes.)
        return math.prod(shape) * (16 if dtype is None else np.dtype(dtype).itemsize)

    def block_info(self, info: dict | None, i: int) -> dict | None:
        """The partition's ``block_info``, narrowed to sub-chunk ``i``."""
        if not self.cut or info is None:
            return info
        sub = self.plan.sub_chunks[i]
        info = copy.deepcopy(info)
        for p, ax in self.axes.items():
            if ax is not None and p in info:
                lo, _ = info[p]["array-location"][ax]
                info[p]["array-location"][ax] = (lo + sub.start, lo + sub.stop)
        ax = self.out_axis
        if None in info and ax is not None:
            lo, _ = info[None]["array-location"][ax]
            info[None]["array-location"][ax] = (lo + sub.start, lo + sub.stop)
            shape = list(info[None]["chunk-shape"])
            shape[ax] = sub.extent
            info[None]["chunk-shape"] = tuple(shape)
        return info


def auto_sub_chunk_bytes(
    partition_bytes: int, running: int, staged: bool = True, batch: bool = False
) -> int:
    """The sub-chunk size of ``sub-chunk-bytes: auto`` for a partition of ``partition_bytes``
    while ``running`` partitions (this one included) share the runtime; ``staged``: whether
    its inputs go through the pinned ring; ``batch``: whether it is a batch of small blocks
    (``batch=``: several of Dask's blocks joined into one partition).

    A staged partition is cut only as far as the runtime needs sub-chunks in flight:
    partitions that run at once already overlap each other's copies and kernels, and each
    cut adds host work, a staging copy more (measured on the H200: see ``overlap.yaml``).
    A partition whose inputs are pinned already is cut into even pieces of about
    ``AUTO_UNSTAGED_BYTES`` however many run (its cuts cost no staging). A batch of at most
    ``AUTO_MIN_BYTES`` is the exception: it is not cut. Its call is short of host time
    (a task a block, besides the batch's), and a cut hands its stages to the stream and
    copy threads (H100, pinned input in 64 MiB batches: 4 MiB blocks 19.9 GB/s whole
    against 18.9 cut in two on 4 threads, 28.0 against 22.9 on 8). A partition of one
    block of the same size is cut: whole, 64 MiB blocks ran 14.6 GB/s against 20.3 cut in
    two on one thread, 34.0 against 39.6 on four.

    Examples
    --------
    >>> MiB = 2**20
    >>> [auto_sub_chunk_bytes(256 * MiB, n) // MiB for n in (1, 2, 3, 4, 16)]
    [64, 128, 128, 256, 256]
    >>> auto_sub_chunk_bytes(16 * MiB, 1) // MiB  # never below 64 MiB
    64
    >>> [auto_sub_chunk_bytes(n * MiB, 16, staged=False) // MiB for n in (256, 96, 64, 16)]
    [32, 32, 32, 16]
    >>> [auto_sub_chunk_bytes(n * MiB, 4, staged=False, batch=True) // MiB for n in (96, 64)]
    [32, 64]
    """
    if not staged:
        if batch and partition_bytes <= AUTO_MIN_BYTES:
            return max(1, int(partition_bytes))
        cuts = max(1, -(-int(partition_bytes) // AUTO_UNSTAGED_BYTES))
        return max(1, -(-int(partition_bytes) // cuts))
    cuts = -(-AUTO_IN_FLIGHT // max(1, running))
    return max(AUTO_MIN_BYTES, -(-int(partition_bytes) // cuts))


def _halo(a: Any, axis: int | None) -> bool:
    return axis is not None and hasattr(a, "rows_needed")


@functools.lru_cache(maxsize=256)
def _whole(extent: int, positions: tuple[int, ...]) -> Layout:
    """The layout of a partition that is not cut (one per extent, made once: it is
    frozen, and a task of small partitions would otherwise spend microseconds on it)."""
    return Layout(plan_sub_chunks(extent, 0, 0, None), dict.fromkeys(positions), None)


def whole(args: list[Any], positions: tuple[int, ...]) -> Layout:
    """The layout of a partition that is not cut (no ``split_axis``): nothing to size and
    nothing that can fail, so no name for errors either."""
    first = args[positions[0]] if positions else None
    return _whole(first.shape[0] if first is not None and first.ndim else 1, positions)


def layout(
    args: list[Any],
    positions: tuple[int, ...],
    ndim: int,
    split_axis: int | None,
    out_axis: int | None,
    sub_chunk_bytes: int,
    where: str,
) -> Layout:
    """Cut a partition: ``split_axis`` is in the index space of the inputs (the highest
    input ``ndim``, as Dask aligns them); ``where`` names the partition in errors."""
    if split_axis is None:
        return whole(args, positions)
    k = split_axis
    # Dask aligns blocks by position, not shape: inputs may disagree along k. Only an
    # extent of 1 broadcasts; any other mismatch cannot be cut into common sub-chunks.
    extents: dict[int, int] = {}
    for p in positions:
        a = args[p]
        ax = own_axis(k, ndim, a.ndim)
        if ax >= 0 and a.shape[ax] != 1:
            extents[p] = a.shape[ax]
    if len(set(extents.values())) > 1:
        found = ", ".join(f"arrays[{p}]: {e}" for p, e in extents.items())
        raise ValueError(
            f"split_axis={k} requires the array inputs to have the same extent along it "
            f"(or 1, to broadcast); {where} has extents {found}"
        )
    extent = next(iter(extents.values()), 1)
    axes: dict[int, int | None] = {}
    row_bytes = 0
    for p in positions:
        a = args[p]
        ax = own_axis(k, ndim, a.ndim)
        if ax < 0 or (a.shape[ax] == 1 and extent != 1):
            axes[p] = None  # broadcast along the split axis: every sub-chunk gets it whole
        else:
            axes[p] = ax
            if extent:
                row_bytes += a.nbytes // extent
    if any(args[p].size == 0 for p in positions):
        row_bytes = 0  # nothing to pipeline: one sub-chunk
    # A halo's block (map_overlap) reads a window of its rows widened by the depth, and a
    # reflected boundary reads as many rows as the depth inside it: no fewer rows a cut.
    rows = max((args[p].rows_needed(axes[p]) for p in axes if _halo(args[p], axes[p])), default=1)
    sub_chunk_bytes = max(sub_chunk_bytes, rows * row_bytes)
    plan = plan_sub_chunks(extent, row_bytes, sub_chunk_bytes, k)
    return Layout(plan, axes, out_axis)
