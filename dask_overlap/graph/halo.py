"""The halo arrays of ``map_overlap``: each block with its neighbours' edge slabs.

:func:`halo_array` makes, from a dask array, an array of the same chunks whose block is a
:class:`~dask_overlap.pipeline.halo.HaloBlock`: the core block and a view of each
neighbour's edge slab (a slice task: Dask makes no copy), with where each lies in the
padded block and which sides the device makes (the external boundary). Dask's own
``overlap`` builds every padded block by concatenation instead, a copy of the data in
Dask tasks on the host; here the pieces are copied only by the pipeline, into one buffer.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from ..pipeline.halo import HI, LO, HaloSpec, halo_block

__all__ = ["block_spec", "halo_array", "sides"]

#: The boundaries a device makes from rows it already has (any other value: a constant).
MADE_ON_DEVICE = ("reflect", "nearest")


def sides(depth: Any) -> tuple[int, int]:
    """A coerced depth of one axis as ``(before, after)``."""
    return (int(depth[0]), int(depth[1])) if isinstance(depth, tuple) else (depth, depth)


def _side(i: int, n: int, side: int, width: int, boundary: Any) -> tuple[int, Any]:
    """One side of block ``i`` of ``n`` along an axis: its margin, and where it comes from
    (the neighbour's index, or ``("fill", kind, value)``, or ``None``: no halo)."""
    if not width:
        return 0, None
    j = i - 1 if side == LO else i + 1
    if 0 <= j < n:
        return width, j
    if boundary == "periodic":
        return width, j % n
    if isinstance(boundary, str) and boundary == "none":
        return 0, None
    kind = boundary if isinstance(boundary, str) and boundary in MADE_ON_DEVICE else "constant"
    return width, ("fill", kind, None if kind != "constant" else boundary)


def block_spec(
    idx: tuple[int, ...], chunks: tuple[tuple[int, ...], ...], depth: dict, boundary: dict
) -> tuple[HaloSpec, list[tuple[tuple[int, ...], tuple[slice, ...]]]]:
    """Block ``idx``'s :class:`HaloSpec`, and each piece's source block and slice (the
    core first: the offsets' product starts with no offset at all)."""
    ndim = len(idx)
    numblocks = tuple(map(len, chunks))
    margins, sources, fills = [], [], []
    for a in range(ndim):
        width = sides(depth[a])
        got = [_side(idx[a], numblocks[a], s, width[s], boundary[a]) for s in (LO, HI)]
        margins.append((got[LO][0], got[HI][0]))
        sources.append((got[LO][1], got[HI][1]))
        for s in (LO, HI):
            if isinstance(got[s][1], tuple):
                fills.append((a, s, got[s][1][1], got[s][1][2]))
    choices = []
    for a in range(ndim):
        options = [0]
        if margins[a][0]:
            options.append(-1)
        if margins[a][1]:
            options.append(1)
        choices.append(options)
    core = tuple(chunks[a][idx[a]] for a in range(ndim))
    regions, slabs = [], []
    for offset in itertools.product(*choices):
        src, index, region = [], [], []
        for a, o in enumerate(offset):
            lo, hi = margins[a]
            if o == 0:
                src.append(idx[a])
                index.append(slice(None))
                region.append(slice(lo, lo + core[a]))
                continue
            origin = sources[a][LO if o < 0 else HI]
            if isinstance(origin, tuple):
                break  # made on the device: a filled side
            src.append(origin)
            index.append(slice(-lo, None) if o < 0 else slice(0, hi))
            region.append(slice(0, lo) if o < 0 else slice(lo + core[a], lo + core[a] + hi))
        else:
            regions.append(tuple(region))
            slabs.append((tuple(src), tuple(index)))
    shape = tuple(lo + n + hi for (lo, hi), n in zip(margins, core, strict=True))
    depth_sides = tuple(sides(depth[a]) for a in range(ndim))
    spec = HaloSpec(depth_sides, tuple(margins), core, shape, tuple(regions), tuple(fills))
    return spec, slabs


def halo_array(x: da.Array, depth: dict, boundary: dict) -> da.Array:
    """``x`` with each block a :class:`HaloBlock` (see the module docstring); its chunks
    are ``x``'s (the core's)."""
    name = "overlap-halo-" + tokenize(x.name, depth, boundary)
    dsk: dict = {}
    for idx in np.ndindex(*x.numblocks):
        spec, pieces = block_spec(idx, x.chunks, depth, boundary)
        views = [(operator.getitem, (x.name, *src), index) for src, index in pieces[1:]]
        dsk[(name, *idx)] = (halo_block, spec, (x.name, *idx), *views)
    graph = HighLevelGraph.from_collections(name, MaterializedLayer(dsk), dependencies=[x])
    return da.Array(graph, name, x.chunks, meta=x._meta)
