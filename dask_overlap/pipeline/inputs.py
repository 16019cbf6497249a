"""A partition's inputs as the pipeline moves them: bytes that reach the device on a stream.

Each array argument of a partition is one :class:`Input`, whatever it is: a host array
(:class:`HostInput`: staged into the pinned ring first, unless it is pinned already), a
batch's pinned blocks that are never joined on the host (:class:`BlocksInput`: each block
copied into its place on the device), or an array already on the device
(:class:`DeviceInput`: no copy). The runner asks an input only what this interface says:
its bytes, a slice of it along an axis (a sub-chunk's read window), whether it must be
staged, and its copy to the device on a stream. A halo's block with its neighbours'
edge slabs is one more (:class:`HaloInput`): its pieces are copied into one buffer,
in the ring when staged, on the device otherwise, where its boundary is made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .halo import HaloBlock, fill
from .pieces import PinnedBlocks

__all__ = ["BlocksInput", "DeviceInput", "HaloInput", "HostInput", "Input", "as_input"]


class _Pinned:
    """Whether an argument lives in pinned memory, asked of the backend once (on CUDA, a
    driver call) and only if a sub-chunk goes through the ring; its slices share it."""

    __slots__ = ("_answer", "_array", "_is_pinned")

    def __init__(self, array: np.ndarray, is_pinned: Callable[[np.ndarray], bool] | None):
        self._array = array
        self._is_pinned = is_pinned
        self._answer: bool | None = None if is_pinned is not None else True

    def __call__(self) -> bool:
        if self._answer is None:
            self._answer = self._array.nbytes > 0 and self._is_pinned(self._array)
            self._array = None  # asked: the answer is all that is kept
        return self._answer


_ALWAYS = _Pinned(np.empty(0), None)  # a block of the ring: pinned


class HostInput:
    """A host array (see the module docstring)."""

    __slots__ = ("array", "pinned_memory")
    on_device = False

    def __init__(self, array: np.ndarray, pinned_memory: _Pinned):
        self.array = array
        self.pinned_memory = pinned_memory

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def ndim(self) -> int:
        return self.array.ndim

    @property
    def size(self) -> int:
        return self.array.size

    def part(self, index: tuple[slice, ...]) -> HostInput:
        return HostInput(self.array[index], self.pinned_memory)

    @property
    def needs_staging(self) -> bool:
        """Whether the copy to the device must go through the ring: pageable memory, or
        pinned memory the copy cannot take in one piece of rows."""
        if not self.array.nbytes:
            return False
        return not (self.array.flags.c_contiguous and self.pinned_memory())

    def staged(self, block: np.ndarray) -> HostInput:
        """This input as ``block`` of the ring holds it (after the staging copy)."""
        return HostInput(block.view(self.array.dtype).reshape(self.array.shape), _ALWAYS)

    def staging_copies(self, staged: HostInput) -> list[tuple[Any, Any]]:
        """The host copies that fill ``staged`` (this input's block of the ring)."""
        return [(self.array, staged.array)]

    def to_device(self, backend: Any, stream: Any) -> Any:
        return backend.copy_in(stream, self.array)


class BlocksInput:
    """A batch's pinned blocks, joined only on the device (see the module docstring)."""

    __slots__ = ("blocks",)
    on_device = False
    needs_staging = False

    def __init__(self, blocks: PinnedBlocks):
        self.blocks = blocks

    def __getattr__(self, name: str) -> Any:  # shape, ndim, size, nbytes of the join
        return getattr(self.blocks, name)

    def part(self, index: tuple[slice, ...]) -> BlocksInput:
        return BlocksInput(self.blocks[index])

    def to_device(self, backend: Any, stream: Any) -> Any:
        return backend.copy_in_blocks(stream, self.blocks)


class DeviceInput:
    """An array already on the device: no copy (see the module docstring)."""

    __slots__ = ("array",)
    on_device = True
    needs_staging = False

    def __init__(self, array: Any):
        self.array = array

    def __getattr__(self, name: str) -> Any:  # shape, ndim, size, nbytes
        return getattr(self.array, name)

    def part(self, index: tuple[slice, ...]) -> DeviceInput:
        return DeviceInput(self.array[index])

    def to_device(self, backend: Any, stream: Any) -> Any:
        # The backend orders the stream after the work that made it (see copy_in).
        return backend.copy_in(stream, self.array)


class HaloInput:
    """A padded block, as its pieces (core and slabs, each a :class:`HostInput` or a
    :class:`DeviceInput`) and the sides made on the device (see :mod:`.halo`).

    ``shape`` is the padded block's (of this read window); ``margins`` say, per axis,
    how much of it is halo on each side (what :class:`~.halo.HaloFunc` trims); ``depth``
    is what a read window is widened by. ``nbytes`` counts the padded block: what goes
    to the device and what the ring holds when it is staged."""

    __slots__ = ("depth", "dtype", "fills", "margins", "pieces", "shape")

    def __init__(
        self,
        shape: Any,
        dtype: Any,
        pieces: Any,
        fills: Any,
        margins: Any,
        depth: tuple[tuple[int, int], ...],
    ):
        self.shape, self.dtype, self.pieces = tuple(shape), dtype, tuple(pieces)
        self.fills, self.margins, self.depth = tuple(fills), tuple(margins), depth

    @classmethod
    def of(cls, backend: Any, block: HaloBlock) -> HaloInput:
        spec = block.spec
        pieces = [
            (r, as_input(backend, a)) for r, a in zip(spec.regions, block.pieces, strict=True)
        ]
        # Each side made on the device, with its rows in the padded block.
        fills = [(*f, spec.margins[f[0]][f[1]]) for f in spec.fills]
        return cls(spec.shape, block.dtype, pieces, fills, spec.margins, spec.depth)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    @property
    def on_device(self) -> bool:
        return all(x.on_device for _, x in self.pieces)

    @property
    def needs_staging(self) -> bool:
        """Staged (assembled in the ring) when any piece would be: then one copy to the
        device takes the whole padded block."""
        return any(x.needs_staging for _, x in self.pieces)

    def part(self, index: tuple[slice, ...]) -> HaloInput:
        """The read window of the core rows ``index`` selects along one axis (the write
        window): those rows widened by the depth, within the padded block."""
        ax = len(index) - 1
        s, t = index[ax].start, index[ax].stop
        lo, (dl, dh) = self.margins[ax][0], self.depth[ax]
        extent = self.shape[ax]
        a, b = max(0, s + lo - dl), min(extent, t + lo + dh)
        pieces = []
        for region, x in self.pieces:
            r = region[ax].indices(extent)
            i0, i1 = max(r[0], a), min(r[1], b)
            if i0 < i1:
                local = x.part(_along(ax, i0 - r[0], i1 - r[0]))
                pieces.append((_replaced(region, ax, slice(i0 - a, i1 - a)), local))
        fills = []
        for f in self.fills:  # a side along ax: the rows of it the window holds
            if f[0] == ax:
                width = max(0, f[4] - a) if f[1] == 0 else max(0, b - (extent - f[4]))
                f = (*f[:4], width)
            if f[4]:
                fills.append(f)
        margins = list(self.margins)
        margins[ax] = (s + lo - a, b - t - lo)
        shape = list(self.shape)
        shape[ax] = b - a
        return HaloInput(shape, self.dtype, pieces, fills, margins, self.depth)

    def staged(self, block: np.ndarray) -> HaloInput:
        """This input as ``block`` of the ring holds it, once its pieces are copied in;
        the sides made on the device are made there still."""
        whole = (slice(None),) * len(self.shape)
        padded = HostInput(block.view(self.dtype).reshape(self.shape), _ALWAYS)
        return HaloInput(
            self.shape, self.dtype, [(whole, padded)], self.fills, self.margins, self.depth
        )

    def staging_copies(self, staged: HaloInput) -> list[tuple[Any, Any]]:
        """Each piece into its place in the ring's padded block (``staged``)."""
        buf = staged.pieces[0][1].array
        return [(x.array, buf[region]) for region, x in self.pieces if x.array.size]

    def to_device(self, backend: Any, stream: Any) -> Any:
        """The padded block on the device: one copy when it was assembled in the ring (or
        has no halo), else a copy of each piece into its place; then the boundary."""
        if len(self.pieces) == 1 and self.pieces[0][1].shape == self.shape:
            dev = self.pieces[0][1].to_device(backend, stream)
        else:
            dev = backend.empty_device(self.shape, self.dtype)
            for region, x in self.pieces:
                if x.size:
                    backend.place(stream, x.to_device(backend, stream), dev[region])
        if self.fills:
            fill(dev, self.fills)
        return dev


def _along(axis: int, start: int, stop: int) -> tuple[slice, ...]:
    return (slice(None),) * axis + (slice(start, stop),)


def _replaced(index: tuple[slice, ...], axis: int, new: slice) -> tuple[slice, ...]:
    return (*index[:axis], new, *index[axis + 1 :])


Input = HostInput | BlocksInput | DeviceInput | HaloInput


def as_input(backend: Any, block: Any) -> Input:
    """``block`` (a plain array, a device array, a batch's :class:`PinnedBlocks`, or a
    halo's :class:`~.halo.HaloBlock`) as the input the runner moves."""
    if type(block) is PinnedBlocks:
        return BlocksInput(block)
    if type(block) is HaloBlock:
        return HaloInput.of(backend, block)
    if backend.is_device(block):
        return DeviceInput(block)
    return HostInput(block, _Pinned(block, backend.is_pinned))
