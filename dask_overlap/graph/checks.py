"""Checks of a ``map_blocks`` call, made on the client before anything runs.

Each names the parameter, what was expected and what was given (see STYLE.md); they run
in ``map_blocks`` in the order its docstring gives, before ``func`` is called at all.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Sequence
from numbers import Integral
from typing import Any

import dask.array as da
import numpy as np

from ..pipeline.layout import own_axis
from ..pipeline.partition import OUT_MODES
from .infer import refuse_meta, refuse_subclasses

__all__ = [
    "array_positions",
    "as_list",
    "check_axes",
    "check_batch",
    "check_dtype",
    "check_func",
    "check_inputs",
    "check_numblocks",
    "check_out_mode",
    "check_output_axes",
    "check_split_axis",
]

_NUMERIC_KINDS = "biufc"


def check_dtype(what: str, dtype: Any) -> None:
    dt = np.dtype(dtype)
    if dt.kind not in _NUMERIC_KINDS:
        raise TypeError(
            f"{what} must have a numeric or boolean dtype "
            f"(bool, integer, float or complex), got {dt}"
        )


def as_list(axes: int | Sequence[int] | None) -> list[int]:
    if axes is None:
        return []
    if isinstance(axes, Integral):
        return [int(axes)]
    return [int(a) for a in axes]


def check_axes(name: str, axes: Any, ndim: int | None = None) -> list[int]:
    """``drop_axis`` or ``new_axis``: ``None``, an integer or a sequence of integers (in
    ``[-ndim, ndim)`` where ``ndim`` is given), as a list.

    >>> check_axes("drop_axis", 1.5, 2)
    Traceback (most recent call last):
    ...
    TypeError: drop_axis must be an integer or a sequence of integers, got 1.5
    """
    if axes is None:
        return []
    if isinstance(axes, (bool, str, bytes)) or not isinstance(axes, Integral | Iterable):
        items = None
    else:
        items = [axes] if isinstance(axes, Integral) else list(axes)  # (an ndarray too)
    if items is None or any(isinstance(a, bool) or not isinstance(a, Integral) for a in items):
        raise TypeError(f"{name} must be an integer or a sequence of integers, got {axes!r}")
    if ndim is not None and any(not -ndim <= a < ndim for a in items):
        raise ValueError(
            f"{name} must be in [{-ndim}, {ndim}) for inputs of {ndim} dimension(s), got {axes!r}"
        )
    return [int(a) for a in items]


def check_output_axes(chunks: Any, kept_ndim: int, new: list[int], new_axis: Any) -> None:
    """Dask's rules for the output's axes, said before ``func`` is called to infer a meta:
    ``new_axis`` (``new`` as a list) names axes of the output, of ``kept_ndim``, and
    ``chunks=`` has as many axes (more where they say its new axes, with no ``new_axis``)."""
    if new and max(new) >= kept_ndim:
        raise ValueError(
            f"new_axis must name axes of the output ({kept_ndim} dimension(s)): New_axis "
            f"values do not fill in all dimensions; got {new_axis!r}"
        )
    if chunks is None or not isinstance(chunks, Sequence):
        return
    if len(chunks) < kept_ndim or (new_axis is not None and len(chunks) != kept_ndim):
        raise ValueError(  # Dask's words (dask.array.map_blocks)
            f"Provided chunks have {len(chunks)} dims; expected {kept_ndim} dims"
        )


def check_func(func: Any) -> None:
    if not callable(func):
        raise TypeError(
            f"func must be callable, got {reprlib.repr(func)} of type {type(func).__name__}"
        )


def check_out_mode(out: Any) -> None:
    if out not in OUT_MODES:
        raise ValueError(f"out must be one of {', '.join(map(repr, OUT_MODES))}; got {out!r}")


def array_positions(arrays: Sequence[Any], chunks: Any) -> tuple[int, ...]:
    """Where the dask arrays are among ``arrays``; the rest are passed through as they are."""
    positions = tuple(i for i, a in enumerate(arrays) if isinstance(a, da.Array))
    if not positions and chunks is None:
        raise ValueError(
            "map_blocks needs at least one dask array in arrays, or chunks= to build the "
            f"output from; got {len(arrays)} positional argument(s) and no dask array"
        )
    return positions


def check_inputs(
    arrays: Sequence[Any], positions: tuple[int, ...], enforce_ndim: Any, meta: Any
) -> None:
    """``enforce_ndim`` is a bool; the arrays' blocks are plain arrays that a copy keeps
    whole, ``meta`` a NumPy or CuPy array, both of a dtype a device array can hold."""
    if not isinstance(enforce_ndim, bool):
        raise TypeError(f"enforce_ndim must be True or False, got {enforce_ndim!r}")
    refuse_subclasses(arrays, positions)
    for i in positions:
        check_dtype(f"arrays[{i}]", arrays[i].dtype)
    refuse_meta(meta, "meta")
    if meta is not None and hasattr(meta, "dtype"):
        check_dtype("meta", meta.dtype)


def check_split_axis(split_axis: Any, ndim: int, drop_axis: int | Sequence[int] | None) -> int:
    """``split_axis`` as a non-negative axis of the inputs, which the output keeps."""
    if isinstance(split_axis, bool) or not isinstance(split_axis, Integral):
        raise TypeError(f"split_axis must be an integer or None, got {split_axis!r}")
    if not -ndim <= split_axis < ndim:
        raise ValueError(
            f"split_axis must be in [{-ndim}, {ndim}) for inputs of {ndim} dimension(s), "
            f"got {split_axis}"
        )
    split_axis = int(split_axis) % ndim
    if split_axis in {d % ndim for d in as_list(drop_axis)}:
        raise ValueError(
            f"split_axis={split_axis} is also in drop_axis={drop_axis}: the output must "
            "keep the split axis"
        )
    return split_axis


def check_numblocks(arrays: Sequence[Any], positions: tuple[int, ...], ndim: int) -> None:
    """Blocks are paired by position (Dask 2026.8's map_blocks does not rechunk to align
    them): along each axis the arrays need the same number of blocks, or one, to broadcast.
    Dask itself fails only at compute, with "Shapes do not align"; say so here, naming the
    arrays."""
    for k in range(ndim):
        counts = {}
        for i in positions:
            ax = own_axis(k, ndim, arrays[i].ndim)
            if ax >= 0 and arrays[i].numblocks[ax] != 1:
                counts[i] = arrays[i].numblocks[ax]
        if len(set(counts.values())) > 1:
            found = ", ".join(f"arrays[{i}]: {n}" for i, n in counts.items())
            raise ValueError(
                "map_blocks pairs the arrays' blocks by position, so they need the same number "
                f"of blocks along each axis (or 1, to broadcast); along axis {k} {found} "
                "blocks: rechunk them alike first (e.g. b.rechunk(a.chunks))"
            )


def check_batch(batch: Any, split_axis: int | None, chunks: Any, drop_axis: Any) -> int | str:
    """``batch`` as a positive int or ``"auto"``, and a number only where joining blocks
    is sound (``"auto"`` joins none where it is not: see :func:`auto_batch`)."""
    if batch == "auto" and type(batch) is str:
        return batch
    if isinstance(batch, bool) or not isinstance(batch, Integral):
        raise TypeError(f"batch must be a positive integer or 'auto', got {batch!r}")
    if batch < 1:
        raise ValueError(f"batch must be at least 1 (1: one block per partition), got {batch}")
    if batch > 1 and split_axis is None:
        raise ValueError(
            f"batch={batch} joins {batch} blocks along split_axis into one partition, so it "
            "needs split_axis (the axis func is independent along); got split_axis=None"
        )
    if batch > 1 and chunks is not None:
        raise ValueError(
            f"batch={batch} gives each output block {batch} blocks' extent along split_axis, "
            "which chunks= would contradict: leave chunks out"
        )
    if batch > 1 and as_list(drop_axis):
        # Dask joins the blocks along a dropped axis itself, before the task, and cannot
        # join the gathered blocks a batch hands the task.
        raise ValueError(
            f"batch={batch} cannot be combined with drop_axis={drop_axis}: Dask joins the "
            "blocks along a dropped axis itself; rechunk that axis to one block instead"
        )
    return int(batch)
