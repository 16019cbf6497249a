"""Several blocks run as one partition (``map_blocks(..., batch=k)``).

Every partition costs a Dask task and this library's own host time, whatever its size:
on an H200, 4 MiB partitions reach about a sixth of the link's bound where 256 MiB ones
reach 0.8-0.9 (``benchmarks/small_partitions.py``). With ``batch=k`` the graph hands each
partition task ``k`` consecutive blocks along ``split_axis`` as one :class:`Pieces`, and
the task joins them into one array before its partition runs: host blocks into one block
of the pinned pool, device blocks on the device. For pageable blocks the join *is* the
staging copy (none follows); blocks already pinned are copied once more, which costs more
than it saves once they are large (H200, pinned 16 MiB blocks: 27.2 GB/s unbatched, 21.4
with ``batch=4``; 4 MiB ones: 6.7, and 13.7 with ``batch=8``). ``split_axis`` is what
makes the join sound: it declares ``func`` independent along that axis, so ``func`` of the
joined blocks is the join of ``func`` of each. The output has one block per partition,
``k`` blocks' extent along the axis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .infer import refuse_block

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["Pieces", "gather", "join"]


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


def gather(axis: int, *blocks: Any) -> Pieces:
    """The graph's task that gathers ``blocks`` (Dask passes each one's value)."""
    return Pieces(axis, blocks)


def join(rt: Runtime, p: Pieces, where: str) -> tuple[Any, int]:
    """``p``'s blocks as one array, and the host bytes copied to join them (``where``
    names the partition in an error).

    Device blocks are joined on the device (the backend's ``join_device``). Host blocks
    are copied, by the runtime's copy threads, into one block of the pinned pool when it
    has room: that array is pinned, so the partition copies it to the device directly;
    otherwise into ordinary memory, which the partition then stages as any other input.
    """
    blocks, axis = p.blocks, p.axis
    if len(blocks) == 1:
        return blocks[0], 0
    backend = rt.backend
    if any(backend.is_device(b) for b in blocks):
        return backend.join_device(blocks, axis), 0
    for b in blocks:
        if type(b) is not np.ndarray:
            refuse_block(b, where)  # a subclass whose meaning the join would lose
    blocks = tuple(np.asarray(b) for b in blocks)
    dtype = np.result_type(*blocks)
    shape = list(blocks[0].shape)
    shape[axis] = sum(b.shape[axis] for b in blocks)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = backend.pinned.allocate(nbytes) if nbytes else None
    out = raw.view(dtype).reshape(shape) if raw is not None else np.empty(shape, dtype)
    copies = []
    start = 0
    for b in blocks:
        where = [slice(None)] * len(shape)
        where[axis] = slice(start, start + b.shape[axis])
        start += b.shape[axis]
        copies.append((b, out[tuple(where)]))
    rt.copies.run(copies, backend.stage)
    return out, nbytes
