"""A partition's inputs as the pipeline moves them: bytes that reach the device on a stream.

Each array argument of a partition is one :class:`Input`, whatever it is: a host array
(:class:`HostInput`: staged into the pinned ring first, unless it is pinned already), a
batch's pinned blocks that are never joined on the host (:class:`BlocksInput`: each block
copied into its place on the device), or an array already on the device
(:class:`DeviceInput`: no copy). The runner asks an input only what this interface says:
its bytes, a slice of it along an axis (a sub-chunk's read window), whether it must be
staged, and its copy to the device on a stream. A new kind of input (a halo's edge
slabs) is a new class here, not a new branch in the runner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .pieces import PinnedBlocks

__all__ = ["BlocksInput", "DeviceInput", "HostInput", "Input", "as_input"]


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


Input = HostInput | BlocksInput | DeviceInput


def as_input(backend: Any, block: Any) -> Input:
    """``block`` (a plain array, a device array, or a batch's :class:`PinnedBlocks`) as
    the input the runner moves."""
    if type(block) is PinnedBlocks:
        return BlocksInput(block)
    if backend.is_device(block):
        return DeviceInput(block)
    return HostInput(block, _Pinned(block, backend.is_pinned))
