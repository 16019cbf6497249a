"""Several blocks run as one partition (``map_blocks(..., batch=k)``).

Every partition costs a Dask task and this library's own host time, whatever its size:
on an H200, 4 MiB partitions reach about a sixth of the link's bound where 256 MiB ones
reach 0.8-0.9 (``benchmarks/diagnostics/small_partitions.py``). With ``batch=k`` the graph
hands each partition task ``k`` consecutive blocks along ``split_axis`` as one :class:`Pieces`, and
the task joins them into one array before its partition runs: pageable blocks into one
block of the pinned pool (the join *is* the staging copy: none follows), device blocks on
the device. Blocks already pinned are not joined on the host at all: they stay where they
are, as one :class:`PinnedBlocks`, and the copy-in puts each in its place in one device
array (one copy per block). Joining them on the host was one copy more, which cost more
than it saved once they were large (H200, pinned 16 MiB blocks: 27.2 GB/s unbatched, 21.4
with ``batch=4``). ``split_axis`` is what makes the join sound: it declares ``func``
independent along that axis, so ``func`` of the joined blocks is the join of ``func`` of
each. The output has one block per partition, ``k`` blocks' extent along the axis.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from .layout import along
from .results import refuse_block

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["PinnedBlocks", "Pieces", "gather", "join"]


class Pieces:
    """Consecutive blocks of one array along ``axis``, for one partition to join."""

    __slots__ = ("axis", "blocks")

    def __init__(self, axis: int, blocks: tuple[Any, ...]):
        self.axis = axis
        self.blocks = blocks

    def __reduce__(self) -> tuple[Any, ...]:
        return Pieces, (self.axis, self.blocks)

    def __repr__(self) -> str:
        return f"Pieces(axis={self.axis}, {len(self.blocks)} blocks)"


class PinnedBlocks:
    """Pinned, C-contiguous host blocks of one native dtype, consecutive along ``axis``,
    standing for rows ``[start, stop)`` along it of their join, which is never made on the
    host: the backend copies each block's part into its place in one device array
    (``Backend.copy_in_blocks``).

    To the runner it is an input like a pinned array: it has the ``shape``, ``dtype``,
    ``nbytes`` and ``ndim`` of the join, and the slices along ``axis`` that cut it into
    sub-chunks (:meth:`__getitem__`) are more of them.
    """

    __slots__ = ("axis", "blocks", "dtype", "nbytes", "ndim", "shape", "size", "start", "stop")

    def __init__(self, axis: int, blocks: tuple[np.ndarray, ...], start: int, stop: int):
        self.axis, self.blocks, self.start, self.stop = axis, blocks, start, stop
        first = blocks[0]
        shape = list(first.shape)
        shape[axis] = stop - start
        self.shape = tuple(shape)
        self.dtype = first.dtype
        self.ndim = first.ndim
        self.size = math.prod(shape)
        self.nbytes = self.size * self.dtype.itemsize

    @classmethod
    def of(cls, axis: int, blocks: tuple[np.ndarray, ...]) -> PinnedBlocks:
        """All of ``blocks``' join."""
        return cls(axis, blocks, 0, sum(b.shape[axis] for b in blocks))

    def __getitem__(self, index: Any) -> PinnedBlocks:
        """Rows ``[lo, hi)`` along ``axis`` (``along(axis, lo, hi)``, as a layout cuts a
        sub-chunk): the part of the blocks that holds them."""
        axis = self.axis
        if (
            type(index) is not tuple
            or len(index) != axis + 1
            or any(i != slice(None) for i in index[:axis])
            or type(index[axis]) is not slice
            or index[axis].step not in (None, 1)
        ):
            raise TypeError(f"PinnedBlocks are cut along their axis only; got {index!r}")
        lo, hi, _ = index[axis].indices(self.stop - self.start)
        return PinnedBlocks(axis, self.blocks, self.start + lo, self.start + max(lo, hi))

    @property
    def row_bytes(self) -> int:
        """Bytes of one row along ``axis`` and everything after it (one index along it)."""
        return math.prod(self.shape[self.axis + 1 :]) * self.dtype.itemsize

    def parts(self) -> list[tuple[np.ndarray, int, int, int]]:
        """``(block, lo, hi, at)`` for each block that holds some of the rows: its rows
        ``[lo, hi)`` along ``axis`` are rows ``[at, at + hi - lo)`` of this array."""
        out = []
        first = 0  # where the block starts in the join
        for b in self.blocks:
            n = b.shape[self.axis]
            lo, hi = max(self.start, first), min(self.stop, first + n)
            if lo < hi:
                out.append((b, lo - first, hi - first, lo - self.start))
            first += n
        return out

    def views(self) -> list[np.ndarray]:
        """The parts as views of the blocks (for a backend that joins them itself)."""
        return [b[along(self.axis, lo, hi)] for b, lo, hi, _ in self.parts()]

    def __repr__(self) -> str:
        return f"PinnedBlocks(axis={self.axis}, {len(self.blocks)} blocks, shape={self.shape})"


def gather(axis: int, *blocks: Any) -> Pieces:
    """The graph's task that gathers ``blocks`` (Dask passes each one's value)."""
    return Pieces(axis, blocks)


def join(rt: Runtime, p: Pieces, where: str) -> tuple[Any, int]:
    """``p``'s blocks as one array, and the host bytes copied to join them (``where``
    names the partition in an error).

    Blocks that are consecutive slices of one array along ``axis`` (the blocks of an
    earlier ``batch="auto"`` stage, or of ``from_array``, are) are already joined: one
    view of them, no copy. Other device blocks are joined on the device (the backend's
    ``join_device``). Pinned, C-contiguous host blocks of one native dtype are not joined
    here: they come back as :class:`PinnedBlocks`, copied to the device block by block.
    Other host blocks are copied, by the runtime's copy threads, into one block of the
    pinned pool when it has room: that array is pinned, so the partition copies it to the
    device directly; otherwise into ordinary memory, which the partition then stages as
    any other input.
    """
    blocks, axis = p.blocks, p.axis
    if len(blocks) == 1:
        return blocks[0], 0
    backend = rt.backend
    if any(backend.is_device(b) for b in blocks):
        whole = _one_view(blocks, axis)
        return (backend.join_device(blocks, axis) if whole is None else whole), 0
    for b in blocks:
        if type(b) is not np.ndarray:
            refuse_block(b, where)  # a subclass whose meaning the join would lose
    blocks = tuple(np.asarray(b) for b in blocks)
    whole = _one_view(blocks, axis)
    if whole is not None:
        return whole, 0
    dtype = np.result_type(*blocks)
    if (
        dtype.isnative
        and all(b.dtype == dtype and b.nbytes and b.flags.c_contiguous for b in blocks)
        and all(map(backend.is_pinned, blocks))
    ):
        return PinnedBlocks.of(axis, blocks), 0
    shape = list(blocks[0].shape)
    shape[axis] = sum(b.shape[axis] for b in blocks)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    # Into the pinned pool, where pinned memory is what the copy to the device wants; on a
    # backend whose device memory is host memory, into ordinary memory.
    pooled = nbytes and not backend.host_memory
    raw = backend.pinned.allocate(nbytes) if pooled else None
    out = raw.view(dtype).reshape(shape) if raw is not None else np.empty(shape, dtype)
    copies = []
    start = 0
    for b in blocks:
        where = [slice(None)] * len(shape)
        where[axis] = slice(start, start + b.shape[axis])
        start += b.shape[axis]
        copies.append((b, out[tuple(where)]))
    rt.copies.run(copies, backend.host_copy)
    return out, nbytes


def _address(x: Any) -> int:
    """Where ``x``'s first element lies (a device or a host array)."""
    interface = getattr(x, "__cuda_array_interface__", None) or x.__array_interface__
    return int(interface["data"][0])


def _same_across(shape: tuple[int, ...], other: tuple[int, ...], axis: int) -> bool:
    """Whether two blocks' shapes agree in every axis but ``axis``."""
    return shape[:axis] == other[:axis] and shape[axis + 1 :] == other[axis + 1 :]


def _one_view(blocks: tuple[Any, ...], axis: int) -> Any | None:
    """``blocks`` as one view of the memory they are all views of, when each begins where
    the one before ends along ``axis`` (with the same strides and the same extents across
    it); else ``None``. The view covers exactly the blocks' elements."""
    first = blocks[0]
    base, strides = first.base, first.strides
    if base is None:
        return None
    at = _address(first)
    for b in blocks:
        if (
            b.base is not base
            or b.dtype != first.dtype
            or b.strides != strides
            or _address(b) != at
            or not _same_across(b.shape, first.shape, axis)
        ):
            return None
        at += b.shape[axis] * strides[axis]
    shape = list(first.shape)
    shape[axis] = sum(b.shape[axis] for b in blocks)
    xp = sys.modules[type(first).__module__.partition(".")[0]]  # numpy or cupy: imported
    return xp.lib.stride_tricks.as_strided(first, shape=tuple(shape), strides=strides)
