"""``dask_overlap.map_overlap``: ``dask.array.map_overlap``, with its halos made in the pipeline.

The call is Dask's: the same normalisation of ``depth`` and ``boundary`` (Dask's own
``coerce_depth`` and ``coerce_boundary``), the same alignment, the same rechunking rule
and its words (``ensure_minimum_chunksize``), the same trim. Inside, no padded block is
built in Dask tasks: each partition gets its core block and its neighbours' edge slabs
(:mod:`.halo`), which the pipeline copies into one buffer, makes the boundary of on the
device and trims on the device after ``func`` (:mod:`dask_overlap.pipeline.halo`). The
partitions are ``dask_overlap.map_blocks`` partitions, with all of its options.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from numbers import Integral, Number
from typing import Any

import dask.array as da
import numpy as np
from dask.array.core import unify_chunks
from dask.array.overlap import (
    _get_overlap_rechunked_chunks,
    coerce_boundary,
    coerce_depth,
)
from toolz import concat

from ..pipeline.halo import HaloFunc
from .checks import as_list, check_func
from .halo import halo_array, sides
from .map_blocks import map_blocks

__all__ = ["map_overlap"]

#: The boundaries named by a string (any other value is a constant to pad with).
BOUNDARY_NAMES = ("reflect", "periodic", "nearest", "none")


def _each(spec: Any, arrays: Sequence[da.Array], name: str) -> list[Any]:
    """``depth`` or ``boundary`` for each array: a list gives one per array."""
    if not isinstance(spec, list):
        return [spec] * len(arrays)
    if len(spec) != len(arrays):
        raise ValueError(
            f"{name} given as a list must have one entry per array argument: "
            f"{len(arrays)} arrays, got {len(spec)} entries ({spec!r})"
        )
    return spec


def _check_one_depth(value: Any, where: str) -> None:
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(
                f"depth{where} given as a tuple must be (before, after), got {value!r}"
            )
        for v in value:
            _check_one_depth(v, where)
        return
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(
            f"depth{where} must be a non-negative integer (or a (before, after) pair of "
            f"them), got {value!r} of type {type(value).__name__}"
        )
    if value < 0:
        raise ValueError(f"depth{where} must be a non-negative integer, got {value}")


def _per_axis(
    value: Any, name: str, which: str, keys: int, ndim: int | None = None
) -> list[tuple[Any, str]]:
    """``value`` of parameter ``name`` (``depth`` or ``boundary``) as (entry, where) pairs
    to check one by one: a dict by axis (keys ``0 <= axis < keys``), a tuple per axis (of
    ``ndim`` entries, where ``ndim`` is given), or one value for every axis."""
    if isinstance(value, dict):
        for ax in value:
            if isinstance(ax, bool) or not isinstance(ax, Integral) or not 0 <= ax < keys:
                raise ValueError(
                    f"{name}{which} is keyed by axis: got key {ax!r} for arrays of at most "
                    f"{keys} dimension(s)"
                )
        return [(v, f"{which}[{ax}]") for ax, v in value.items()]
    if isinstance(value, tuple):
        if ndim is not None and len(value) != ndim:
            raise ValueError(
                f"{name}{which} given as a tuple must have one entry per axis ({ndim}), got "
                f"{value!r}"
            )
        return [(v, f"{which}[{ax}]") for ax, v in enumerate(value)]
    return [(value, which)]


def check_depth(depth: Any, ndim: int, which: str, keys: int) -> None:
    """One array's ``depth``: an integer, a tuple per axis, or a dict by axis."""
    if depth is not None:
        for d, where in _per_axis(depth, "depth", which, keys, ndim):
            _check_one_depth(d, where)


def _check_one_boundary(value: Any, where: str) -> None:
    if isinstance(value, str):
        if value not in BOUNDARY_NAMES:
            raise ValueError(
                f"boundary{where} must be one of {', '.join(map(repr, BOUNDARY_NAMES))} or a "
                f"constant value, got {value!r}"
            )
    elif isinstance(value, bool) or not isinstance(value, Number | np.generic):
        raise ValueError(
            f"boundary{where} must be one of {', '.join(map(repr, BOUNDARY_NAMES))} or a "
            f"constant (a number), got {value!r} of type {type(value).__name__}"
        )


def _as_dtype(boundary: Any, dtype: np.dtype) -> Any:
    """A constant ``boundary`` cast to the array's ``dtype`` as Dask's padding casts it
    (``full_like``: unsafe, with NumPy's warnings), so that the device fills it as is; a
    named boundary as it is.

    >>> _as_dtype(2.7, np.dtype("int32")), _as_dtype("reflect", np.dtype("int32"))
    (np.int32(2), 'reflect')
    """
    if isinstance(boundary, str):
        return boundary
    return np.full_like(np.empty((), dtype), boundary)[()]


def check_boundary(boundary: Any, ndim: int, which: str, keys: int) -> None:
    """One array's ``boundary``: a name or constant, a tuple per axis, or a dict by axis."""
    if boundary is not None:
        for b, where in _per_axis(boundary, "boundary", which, keys, ndim):
            _check_one_boundary(b, where)


def _rechunked(x: da.Array, depth: dict, allow_rechunk: bool) -> da.Array:
    """Dask's rule: every chunk at least as large as the depth, by rechunking (Dask's own
    arithmetic and errors) or, without ``allow_rechunk``, Dask's error."""
    if allow_rechunk:
        return x.rechunk(_get_overlap_rechunked_chunks(x, depth))  # (a no-op when it fits)
    depths = [max(d) if isinstance(d, tuple) else d for d in depth.values()]
    if any(min(c) < d for d, c in zip(depths, x.chunks, strict=True)):
        raise ValueError(  # Dask's words (dask.array.overlap.overlap)
            "Overlap depth is larger than smallest chunksize.\n"
            "Please set allow_rechunk=True to rechunk automatically.\n"
            f"Overlap depths required: {depths}\n"
            f"Input chunks: {x.chunks}\n"
        )
    return x


def _out_axes(
    ndim: int, drop_axis: Any, new_axis: Any, chunks: Any = None
) -> tuple[int | None, ...]:
    """For each output axis, the reference array's axis it stands for, ``None`` for a
    new one: placed as ``dask.array.map_blocks`` places them (new axes inserted in
    sorted order at their positions in the output, or, with ``chunks`` of more axes and
    no ``new_axis``, the first ones).

    >>> _out_axes(2, None, 2), _out_axes(2, None, [2, 0]), _out_axes(2, 1, None, ((1,), (9,)))
    ((0, 1, None), (None, 0, None, 1), (None, 0))
    """
    dropped = {d % ndim for d in as_list(drop_axis)}
    out: list[int | None] = [ax for ax in range(ndim) if ax not in dropped]
    new = as_list(new_axis)
    if new_axis is None and chunks is not None and len(out) < len(chunks):
        new = list(range(len(chunks) - len(out)))
    for axis in sorted(new):
        out.insert(axis, None)
    return tuple(out)


def _chunks_per_block(chunks: Sequence[Any], out_axes: tuple, numblocks: tuple) -> tuple:
    """``chunks=`` (each output axis: a block's extent, the same for every block, or each
    block's) as each block's extents along each output axis."""
    out = []
    for c, ax in zip(chunks, out_axes, strict=False):
        if isinstance(c, Integral):
            c = (c,) * (1 if ax is None else numblocks[ax])
        out.append(tuple(c))
    return tuple(out)


def _check_dropped_halos(args: list[da.Array], depths: list[dict], drop_axis: Any) -> None:
    """A dropped axis (``drop_axis``) of several chunks must have no halo: its padded
    blocks would be joined on the host (refused when the graph is built, not at compute)."""
    ndim = max(x.ndim for x in args)  # (drop_axis names axes of the output: of those)
    for x, depth in zip(args, depths, strict=True):
        for axis in {d % ndim for d in as_list(drop_axis)} if x.ndim == ndim else ():
            if x.numblocks[axis] > 1 and sides(depth[axis]) != (0, 0):
                raise NotImplementedError(
                    "map_overlap cannot join the padded blocks of several chunks along an "
                    f"axis it drops (drop_axis) that has a halo (axis {axis}): give it depth "
                    "0 or rechunk it to one chunk first"
                )


def _trimmed_chunks(chunks: Any, out_axes: tuple, depth: dict, boundary: dict) -> tuple:
    """Given output ``chunks`` of the padded blocks, the chunks after the trim (the
    arithmetic of Dask's ``trim_internal``)."""
    out = []
    for o, bd in enumerate(chunks):
        ax = out_axes[o] if o < len(out_axes) else None
        lo, hi = (0, 0) if ax is None else sides(depth[ax])
        none = ax is None or boundary[ax] == "none"
        n = len(bd)
        out.append(
            tuple(
                d - (lo if (j or not none) else 0) - (hi if (j != n - 1 or not none) else 0)
                for j, d in enumerate(bd)
            )
        )
    return tuple(out)


def _halos(x: da.Array, depth: dict, boundary: dict) -> tuple:
    """Each block's halo before and after it, per axis (what Dask's overlap adds)."""
    before, after = [], []
    for a, n in enumerate(x.numblocks):
        lo, hi = sides(depth[a])
        none = boundary[a] == "none"
        before.append(tuple(0 if (none and j == 0) else lo for j in range(n)))
        after.append(tuple(0 if (none and j == n - 1) else hi for j in range(n)))
    return tuple(before), tuple(after)


def _normalised(
    args: tuple, depth: Any, boundary: Any, align_arrays: bool
) -> tuple[list[da.Array], list[dict], list[dict]]:
    """Checked, coerced (Dask's ``coerce_depth``/``coerce_boundary``) and aligned."""
    if not args or not all(isinstance(x, da.Array) for x in args):
        raise TypeError(
            "map_overlap's positional arguments after func must all be dask arrays, got "
            f"{[type(x).__name__ for x in args]}"
        )
    depths, bounds = _each(depth, args, "depth"), _each(boundary, args, "boundary")
    for i, (x, d, b) in enumerate(zip(args, depths, bounds, strict=True)):
        which = f" (array {i})" if len(args) > 1 else ""
        # (A dict's keys may name axes of the arrays of most dimensions: Dask ignores,
        # for each array, those it has not.)
        check_depth(d, x.ndim, which, max(y.ndim for y in args))
        check_boundary(b, x.ndim, which, max(y.ndim for y in args))
    depths = [coerce_depth(x.ndim, d) for x, d in zip(args, depths, strict=True)]
    bounds = [
        {a: _as_dtype(v, x.dtype) for a, v in coerce_boundary(x.ndim, b).items()}
        for x, b in zip(args, bounds, strict=True)
    ]
    if align_arrays:  # (as Dask: reversed, so that blocks broadcast)
        inds = [list(reversed(range(x.ndim))) for x in args]
        _, args = unify_chunks(*list(concat(zip(args, inds, strict=True))), warn=False)
    return list(args), depths, bounds


def _deprecated_signature(x: da.Array, args: tuple, depth: Any, boundary: Any, trim: Any) -> tuple:
    """``map_overlap(array, func, depth, boundary, trim)``, as Dask still takes it (with
    Dask's warning)."""
    warnings.warn(
        "The use of map_overlap(array, func, **kwargs) is deprecated since dask 2.17.0 "
        "and will be an error in a future release. To silence this warning, use the syntax "
        "map_overlap(func, array0,[ array1, ...,] **kwargs) instead.",
        FutureWarning,
        stacklevel=3,
    )
    rest = list(args[1:])
    depth = rest[0] if len(rest) > 0 else depth
    boundary = rest[1] if len(rest) > 1 else boundary
    trim = rest[2] if len(rest) > 2 else trim
    return args[0], (x,), depth, boundary, trim


def map_overlap(
    func: Callable[..., Any],
    *args: Any,
    depth: Any = None,
    boundary: Any = None,
    trim: bool = True,
    align_arrays: bool = True,
    allow_rechunk: bool = True,
    split_axis: int | None = None,
    **kwargs: Any,
) -> da.Array:
    """Map ``func`` over blocks with halos, each partition as an assembly line.

    The same call as :func:`dask.array.map_overlap`, with the same result; ``func``
    receives each block padded with its neighbours' edges (CuPy arrays on the GPU, NumPy
    on the host path). Nothing padded is built on the host: each partition copies its
    core and its neighbours' edge slabs into one device buffer (through the pinned ring,
    as any block), makes the external boundary on the device, runs ``func`` and, with
    ``trim=True``, trims on the device, so only the core is copied back.

    Parameters
    ----------
    func
        Called on each padded block (one per array argument).
    *args
        Dask arrays, aligned as Dask aligns them (``align_arrays``).
    depth, boundary, trim, align_arrays, allow_rechunk
        As in :func:`dask.array.map_overlap`: ``depth`` an integer, a tuple or dict per
        axis, ``(before, after)`` pairs for asymmetric halos (with boundary ``"none"``),
        or a list of those per array; ``boundary`` ``"reflect"``, ``"periodic"``,
        ``"nearest"``, ``"none"`` (the default) or a constant, per axis or per array
        likewise. A depth larger than a chunk is met by rechunking (or, without
        ``allow_rechunk``, Dask's error).
    split_axis
        As in :func:`dask_overlap.map_blocks`: ``func`` is independent along this axis
        but for its halo, so each partition is cut along it into sub-chunks whose read
        windows overlap by the depth (the halo does not force whole partitions).
    **kwargs
        ``dtype``, ``meta``, ``chunks``, ``drop_axis``, ``new_axis``, ``name``,
        ``token`` and keywords for ``func``, as in :func:`dask.array.map_overlap`; and
        ``dask_overlap.map_blocks``'s options ``sub_chunk_bytes``, ``in_flight``,
        ``out``. ``batch`` may be ``"auto"`` or 1 (a partition is one block and its halo).

    Returns
    -------
    dask.array.Array

    Examples
    --------
    >>> import dask.array as da, dask_overlap, numpy as np
    >>> x = da.from_array(np.array([1, 1, 2, 3, 3, 3, 2, 1, 1]), chunks=5)
    >>> y = dask_overlap.map_overlap(np.gradient, x, depth=1, boundary="none", dtype=float)
    >>> y.compute().tolist()
    [0.0, 0.5, 1.0, 0.5, 0.0, -0.5, -1.0, -0.5, 0.0]
    """
    if isinstance(func, da.Array) and args and callable(args[0]):
        func, args, depth, boundary, trim = _deprecated_signature(func, args, depth, boundary, trim)
    check_func(func)
    flags = {"trim": trim, "align_arrays": align_arrays, "allow_rechunk": allow_rechunk}
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    args, depths, bounds = _normalised(args, depth, boundary, align_arrays)
    batch = kwargs.pop("batch", "auto")
    if batch not in ("auto", 1) or isinstance(batch, bool):
        raise ValueError(
            "batch must be 'auto' or 1 with map_overlap (a partition is one block with its "
            f"halo); got {batch!r}"
        )
    if all(all(v == 0 for v in d.values()) for d in depths):
        # Dask escapes to map_blocks too (the same result, no halo).
        return map_blocks(func, *args, split_axis=split_axis, **kwargs)
    for i, x in enumerate(args):
        for j in range(x.ndim):
            if isinstance(depths[i][j], tuple) and bounds[i][j] != "none":
                raise NotImplementedError(  # Dask's words
                    "Asymmetric overlap is currently only implemented "
                    "for boundary='none', however boundary for dimension "
                    f"{j} in array argument {i} is {bounds[i][j]}"
                )
        if any(np.isnan(c) for cc in x.chunks for c in cc):
            raise ValueError(
                f"map_overlap needs the chunk sizes of every array; array {i} has unknown "
                "chunk sizes (call compute_chunk_sizes() first)"
            )
    args = [_rechunked(x, d, allow_rechunk) for x, d in zip(args, depths, strict=True)]
    ref = sorted(enumerate(args), key=lambda v: (v[1].ndim, -v[0]))[-1][0]
    chunks = kwargs.get("chunks")
    out_axes = _out_axes(args[ref].ndim, kwargs.get("drop_axis"), kwargs.get("new_axis"), chunks)
    _check_dropped_halos(args, depths, kwargs.get("drop_axis"))
    if chunks is not None and trim:
        if not isinstance(chunks, Sequence) or callable(chunks):
            raise TypeError(
                "chunks must be a tuple of each output axis's extents (an int, or one per "
                f"block) with map_overlap's trim=True, got {chunks!r}"
            )
        padded = _chunks_per_block(chunks, out_axes, args[ref].numblocks)
        kwargs["chunks"] = _trimmed_chunks(padded, out_axes, depths[ref], bounds[ref])
    halos_of = tuple(_halos(x, d, b) for x, d, b in zip(args, depths, bounds, strict=True))
    free = kwargs.get("chunks") is not None
    wrapped = HaloFunc(func, trim, ref, out_axes, free_shape=free, chunks=halos_of)
    halos = [halo_array(x, d, b) for x, d, b in zip(args, depths, bounds, strict=True)]
    return map_blocks(wrapped, *halos, split_axis=split_axis, batch=1, **kwargs)
