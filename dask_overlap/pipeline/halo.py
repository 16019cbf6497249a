"""Halos on the worker: a block with its neighbours' edge slabs, and a ``func`` that trims.

``dask_overlap.map_overlap`` (:mod:`dask_overlap.graph.map_overlap`) hands each partition
a :class:`HaloBlock` per array: its core block and the edge slabs of its neighbours
(views of their blocks, made by Dask as slices), with a :class:`HaloSpec` that says where
each lies in the padded block and which sides are made on the device (the external
boundary: ``reflect``, ``nearest``, a constant). No padded block is ever built on the
host outside the pipeline: the input (:class:`~.inputs.HaloInput`) copies core and slabs
into one buffer (the staging copy into the pinned ring, or one copy each into the device
buffer), and :func:`fill` makes the boundary there. :class:`HaloFunc` runs the user's
``func`` and trims its result on the device, so only the core is copied back.

The padded block of dask's ``map_overlap`` is, on every axis, ``boundaries`` (applied
axis after axis) then the neighbours' slabs; padding along one axis spans the other axes'
halos, so the corners come out as Dask's do when the fills run in axis order.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from dask.utils import funcname

from ..backends import tokenize_kept

__all__ = ["HALO_KWARG", "HaloBlock", "HaloFunc", "HaloSpec", "fill", "halo_block"]

#: The keyword through which the runner tells :class:`HaloFunc` each array argument's
#: margins in the block it was given (they differ per sub-chunk at the array's edges).
HALO_KWARG = "_overlap_margins"

#: A side of an axis: the start (0) or the end (1).
LO, HI = 0, 1


@dataclasses.dataclass(frozen=True)
class HaloSpec:
    """Where a block's pieces lie in its padded block (picklable, made on the client).

    ``depth``: per axis, the halo asked for, ``(before, after)``; ``margins``: what this
    block gets (0 on a side with no neighbour and boundary ``none``); ``core`` and
    ``shape``: the core's shape and the padded block's; ``regions``: where each piece
    (the core first, then each slab) lies in the padded block; ``fills``: ``(axis, side,
    kind, value)`` made on the device, in axis order (``kind``: ``reflect``, ``nearest``
    or ``constant``).
    """

    depth: tuple[tuple[int, int], ...]
    margins: tuple[tuple[int, int], ...]
    core: tuple[int, ...]
    shape: tuple[int, ...]
    regions: tuple[tuple[slice, ...], ...]
    fills: tuple[tuple[int, int, str, Any], ...]

    def joined(self, others: list[HaloSpec], axis: int) -> HaloSpec:
        """This block's spec with ``others`` after it along ``axis``, which has no halo."""
        regions, at = list(self.regions), self.core[axis]
        for o in others:
            regions += [_shifted(r, axis, at) for r in o.regions]
            at += o.core[axis]
        core = (*self.core[:axis], at, *self.core[axis + 1 :])
        shape = (*self.shape[:axis], at, *self.shape[axis + 1 :])
        return dataclasses.replace(self, core=core, shape=shape, regions=tuple(regions))


def _shifted(region: tuple[slice, ...], axis: int, by: int) -> tuple[slice, ...]:
    r = region[axis]
    return (*region[:axis], slice(r.start + by, r.stop + by), *region[axis + 1 :])


class HaloBlock:
    """A core block and its neighbours' edge slabs, as one partition receives them.

    Shape, size and bytes are the core's: the partition's sub-chunks are cut along the
    core's rows; each sub-chunk's read window is its rows widened by the depth."""

    __slots__ = ("pieces", "spec")

    def __init__(self, spec: HaloSpec, pieces: tuple[Any, ...]):
        self.spec, self.pieces = spec, tuple(pieces)

    def __reduce__(self) -> tuple:
        return HaloBlock, (self.spec, self.pieces)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.core

    @property
    def ndim(self) -> int:
        return len(self.spec.core)

    @property
    def size(self) -> int:
        return math.prod(self.spec.core)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def dtype(self) -> Any:
        return self.pieces[0].dtype

    def __array_function__(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        # Dask joins the blocks of an axis a call drops (drop_axis): along an axis with no
        # halo, their pieces are those of one padded block, still not joined on the host.
        blocks = list(args[0]) if func is np.concatenate else []
        axis = kwargs.get("axis", args[1] if len(args) > 1 else 0)
        if not blocks or any(type(b) is not HaloBlock for b in blocks):
            return NotImplemented
        if len(blocks) == 1:
            return blocks[0]
        axis %= blocks[0].ndim
        if any(b.spec.margins[axis] != (0, 0) for b in blocks):
            raise NotImplementedError(
                "map_overlap cannot join the padded blocks of several chunks along an axis "
                f"it drops (drop_axis) that has a halo (axis {axis}): give it depth 0 or "
                "rechunk it to one chunk first"
            )
        spec = blocks[0].spec.joined([b.spec for b in blocks[1:]], axis)
        return HaloBlock(spec, tuple(p for b in blocks for p in b.pieces))

    def rows_needed(self, axis: int) -> int:
        """The fewest rows a sub-chunk cut along ``axis`` may have: a reflected boundary
        reads as many rows as the depth, inside the sub-chunk's window."""
        return max(1, *self.spec.depth[axis])

    def __repr__(self) -> str:
        return f"HaloBlock(core={self.shape}, pieces={len(self.pieces)}, {self.spec.margins})"


def halo_block(spec: HaloSpec, *pieces: Any) -> HaloBlock:
    """The graph's task for one block (Dask gives it the core and the slabs' views)."""
    return HaloBlock(spec, pieces)


def _along(axis: int, index: slice) -> tuple[slice, ...]:
    return (slice(None),) * axis + (index,)


def fill(buf: Any, fills: tuple) -> None:
    """Make the external boundary in ``buf`` (NumPy or CuPy: slicing only, so on CuPy a
    kernel on the current stream), each side from rows already in ``buf``, in axis order
    (a later axis's padding spans the earlier ones', as Dask's ``boundaries`` does).

    ``fills``: ``(axis, side, kind, value, width)``, ``width`` the rows of that side's
    padding in ``buf`` (fewer than the depth in a sub-chunk's window that ends in it)."""
    for axis, side, kind, value, width in fills:
        n = buf.shape[axis]
        if not width:
            continue
        if side == LO:
            dst = slice(0, width)
            src = slice(width, 2 * width) if kind == "reflect" else slice(width, width + 1)
        else:
            dst = slice(n - width, n)
            src = (
                slice(n - 2 * width, n - width)
                if kind == "reflect"
                else slice(n - width - 1, n - width)
            )
        target = _along(axis, dst)
        if kind == "constant":
            buf[target] = value
        elif kind == "reflect":
            buf[target] = buf[_along(axis, src)][_along(axis, slice(None, None, -1))]
        else:  # nearest: the edge row, repeated (broadcast)
            buf[target] = buf[_along(axis, src)]


class HaloFunc:
    """The user's ``func`` on a padded block, its result trimmed to the core.

    Parameters
    ----------
    func
        The user's function.
    trim
        Whether to trim (``map_overlap``'s ``trim``).
    ref
        Which array argument's margins the output is trimmed by (Dask's rule: the one of
        highest rank, the first of those).
    out_axes
        For each output axis, the axis of that array it stands for (``None``: a new axis,
        not trimmed).
    """

    def __init__(
        self,
        func: Callable[..., Any],
        trim: bool,
        ref: int,
        out_axes: tuple[int | None, ...],
        free_shape: bool = False,
        chunks: tuple | None = None,
    ):
        self.func, self.trim, self.ref, self.out_axes = func, trim, ref, tuple(out_axes)
        self.free_shape = free_shape  # chunks= given: func may change the shape (as Dask)
        # Per array, each block's halo (before, after) per axis: block_info as Dask's,
        # which describes the padded arrays Dask's overlap builds.
        self.chunks = chunks
        self.__name__ = funcname(func)

    @property
    def __signature__(self) -> Any:
        # What ``has_keyword`` reads: the user's func's (block_id, block_info).
        return inspect.signature(self.func)

    def __reduce__(self) -> tuple:
        args = (self.func, self.trim, self.ref, self.out_axes, self.free_shape, self.chunks)
        return HaloFunc, args

    def __dask_tokenize__(self) -> Any:
        return (
            "HaloFunc",
            tokenize_kept(self.func),
            self.trim,
            self.ref,
            self.out_axes,
            self.free_shape,
            self.chunks,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        margins = kwargs.pop(HALO_KWARG, None)
        info = kwargs.get("block_info")
        if isinstance(info, dict) and margins is not None and self.chunks is not None:
            kwargs["block_info"] = self.block_info(info, margins)
        result = self.func(*args, **kwargs)
        if not self.trim or margins is None:
            return result  # (also Dask's meta inference, on empty blocks)
        return self.trimmed(result, margins[self.ref], args)

    def block_info(self, info: dict, margins: tuple) -> dict:
        """Dask's ``block_info`` of the core blocks (narrowed to a sub-chunk's rows), as
        Dask's ``map_overlap`` gives it: of the padded arrays, the window widened by
        ``margins``; the output's too where ``trim`` (it is then the padded output)."""
        out = {}
        for key, entry in info.items():
            entry = dict(entry)
            if key is None:
                if self.trim:  # (with chunks= too: they declare the padded output)
                    axes = [(o, ax) for o, ax in enumerate(self.out_axes) if ax is not None]
                    entry = _padded_entry(entry, self.chunks[self.ref], margins[self.ref], axes)
            elif isinstance(key, int) and key < len(self.chunks):
                axes = [(a, a) for a in range(len(margins[key]))]
                entry = _padded_entry(entry, self.chunks[key], margins[key], axes)
            out[key] = entry
        return out

    def trimmed(self, result: Any, margins: tuple[tuple[int, int], ...], args: tuple) -> Any:
        """``result`` less the margins of the reference array, on the output's axes; a
        ``func`` that did not keep the padded extents there is refused (the trim would cut
        the wrong rows), with an error that names ``trim``."""
        shape = getattr(result, "shape", None)
        given = tuple(args[self.ref].shape)
        if shape is None or (len(shape) != len(self.out_axes) and not self.free_shape):
            raise ValueError(
                f"trim=True requires {self.__name__} to return an array of "
                f"{len(self.out_axes)} dimensions (those of the block it is given, less "
                f"dropped and plus new axes); it was given a block of shape {given} and "
                f"returned {_shape_of(result)}. Pass trim=False if func trims its result itself"
            )
        index = []
        for o, ax in enumerate(self.out_axes[: len(shape)]):
            lo, hi = (0, 0) if ax is None else margins[ax]
            if lo + hi and shape[o] != given[ax] and not self.free_shape:
                raise ValueError(
                    f"trim=True requires {self.__name__} to keep the shape of the block it is "
                    f"given along the overlapped axes: it was given a block of shape {given} "
                    f"and returned shape {tuple(shape)}. Pass trim=False if func trims its "
                    "result itself"
                )
            index.append(slice(lo, shape[o] - hi))
        return result[tuple(index)]


def _padded_entry(entry: dict, chunks: tuple, margins: tuple, axes: list) -> dict:
    """One ``block_info`` entry moved from the core array to the padded one, on ``axes``
    (pairs of the entry's axis and the array's); ``chunks``: per axis, each block's halo
    before and after it."""
    before, after = chunks
    shape, location = list(entry["shape"]), list(entry["array-location"])
    chunk_shape = list(entry.get("chunk-shape", ()))
    for e, a in axes:
        j = entry["chunk-location"][e]
        start, stop = location[e]
        at = sum(before[a][:j]) + sum(after[a][:j]) + before[a][j]  # core -> padded
        location[e] = (start + at - margins[a][0], stop + at + margins[a][1])
        shape[e] += sum(before[a]) + sum(after[a])
        if chunk_shape:
            chunk_shape[e] = location[e][1] - location[e][0]
    entry.update({"shape": tuple(shape), "array-location": location})
    if chunk_shape:
        entry["chunk-shape"] = tuple(chunk_shape)
    return entry


def _shape_of(x: Any) -> str:
    shape = getattr(x, "shape", None)
    return f"shape {tuple(shape)}" if shape is not None else type(x).__name__
