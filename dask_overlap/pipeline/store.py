"""A partition that ends in a store: its result written into the target's region.

``da.store(y, target)`` (and ``y.store``, ``y.to_zarr`` built on it) adds a step after a
stage that writes each block into ``target[index]``. When the graph's fusion
(:mod:`dask_overlap.graph.fusion`) gives that step to the partition, the partition's
output *is* the target's region where it can be (a NumPy target, basic slices, the
region C-contiguous and of the result's dtype): each sub-chunk is copied from the pinned
ring straight into the target, and no result block is made. Any other target (Zarr,
h5py, a memory map whose region is strided) gets the partition's result written into it
as Dask's own ``load_store_chunk`` writes it, with the user's lock.

A NumPy target written in place is written without the lock: each partition writes only
its own region, which is safe for a NumPy array without one.

A partition that joined several blocks (``batch="auto"``) writes its batch's region, the
regions of its blocks side by side, and then returns what the store step would have
returned for each block, one a block (:meth:`Store.finish_each`); a target not filled in
place is written block by block, as Dask writes it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from dask.array.core import load_store_chunk
from dask.array.optimization import fuse_slice

from .layout import along

__all__ = ["Store", "block_index", "known"]


def known(chunks: tuple[tuple | None, ...] | None) -> bool:
    """Whether every block's place can be told from ``chunks`` (as the task carries them)."""
    if chunks is None:
        return False
    for axis in chunks:
        if axis is None or (axis[0] == "each" and any(math.isnan(c) for c in axis[1])):
            return False
    return True


def block_index(chunks: tuple[tuple | None, ...], block_id: tuple[int, ...]) -> tuple | None:
    """The slices of block ``block_id`` in the whole array, from its chunks as the task
    carries them (:func:`~.task.axis_extents`); ``None`` where an extent is not known."""
    index = []
    for axis, i in zip(chunks, block_id, strict=True):
        if axis is None:
            return None
        if axis[0] == "regular":
            start = i * axis[1]
            stop = start + (axis[2] if i == axis[3] - 1 else axis[1])
        else:
            extents = axis[1][: i + 1]
            if any(math.isnan(c) for c in extents):
                return None
            stop = int(sum(extents))
            start = stop - int(extents[-1])
        index.append(slice(start, stop))
    return tuple(index)


class Store:
    """What ``load_store_chunk`` was given besides the block and the target (which the
    partition task gets as its last argument, as Dask gave it to ``load_store_chunk``:
    a target in the graph is not copied into every task); see the module docstring."""

    __slots__ = ("load_stored", "lock", "region", "return_stored")

    def __init__(self, region: Any, lock: Any, return_stored: bool, load_stored: bool):
        self.region, self.lock = region, lock
        self.return_stored, self.load_stored = return_stored, load_stored

    def index(self, chunks: tuple[tuple | None, ...] | None, block_id: tuple) -> tuple | None:
        """Where block ``block_id`` goes in the target (the region's offset added)."""
        if chunks is None:
            return None
        index = block_index(chunks, block_id)
        if index is not None and self.region:
            index = fuse_slice(self.region, index)
        return index

    def into(self, target: Any, index: tuple | None) -> np.ndarray | None:
        """``target``'s region at ``index`` as an array the partition can fill, or
        ``None`` where the result must be written in by ``load_store_chunk``."""
        if index is None or not isinstance(target, np.ndarray):
            return None
        if not all(isinstance(s, slice) and s.step in (None, 1) for s in index):
            return None
        view = target[index]
        if not view.flags.writeable or not view.flags.c_contiguous:
            return None
        return view

    def indexes(
        self, chunks: tuple[tuple | None, ...], block_id: tuple, axis: int, extents: tuple
    ) -> list[tuple]:
        """Where each block of a batch goes in the target (the region's offset added): the
        batch ``block_id`` of an array of ``chunks``, its blocks of ``extents`` along
        ``axis``."""
        batch = block_index(chunks, block_id)
        out, start = [], batch[axis].start
        for e in extents:
            index = list(batch)
            index[axis] = slice(start, start + e)
            out.append(fuse_slice(self.region, tuple(index)) if self.region else tuple(index))
            start += e
        return out

    def finish_each(
        self,
        result: Any,
        target: Any,
        into: np.ndarray | None,
        indexes: list[tuple],
        axis: int,
        extents: tuple[int, ...],
    ) -> tuple:
        """:meth:`finish` for each block of a batch (of ``extents`` along ``axis``, going
        to ``indexes``): a tuple, one a block; written block by block, as Dask writes
        them, unless the batch was written in place."""
        written = into is not None and result is into
        out, start = [], 0
        for index, e in zip(indexes, extents, strict=True):
            block = None if written else result[along(axis, start, start + e)]
            out.append(self._stored(block, written, target, index))
            start += e
        return tuple(out)

    def finish(self, result: Any, target: Any, into: np.ndarray | None, index: tuple) -> Any:
        """What Dask's ``load_store_chunk`` returns, after writing ``result`` into
        ``target`` unless it was written in place (``result is into``)."""
        written = into is not None and result is into
        return self._stored(result, written, target, index)

    def _stored(self, result: Any, written: bool, target: Any, index: tuple) -> Any:
        return load_store_chunk(
            None if written else result,
            target,
            index,
            None,  # (the region is in index already)
            False if written else self.lock,
            self.return_stored,
            self.load_stored,
        )
