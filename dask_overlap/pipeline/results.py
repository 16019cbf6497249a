"""What a partition may be handed and what ``func`` must return: checks with errors that
name the partition and the mismatch.

A block whose dtype or shape differs from what the dask array declares would make Dask's
array lie about its own chunks, so every sub-chunk's result is checked before it is
copied out; the messages say what ``func`` returned and what was expected. The checks
take the partition's Dask key and name it (:func:`partition_name`) only in an error: a
small partition's whole run costs a few times what formatting its name would.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .engine import SubChunk

__all__ = [
    "check_declared",
    "check_like_first",
    "check_split_extent",
    "not_an_array",
    "partition_name",
    "refusal",
    "refuse_block",
]


def partition_name(key: Any) -> str:
    """How errors name the partition of Dask key ``key``.

    Examples
    --------
    >>> partition_name(("negative-1f2e", 3, 0))
    "partition ('negative-1f2e', 3, 0)"
    """
    return f"partition {key!r}"


def not_an_array(func_name: str, raw: Any, where: str) -> TypeError:
    return TypeError(f"{func_name} must return an array, got {type(raw).__name__} for {where}")


def check_split_extent(
    func_name: str, split_axis: int, out_axis: int, result: Any, sub: SubChunk, key: Any
) -> None:
    """A row-independent ``func`` keeps the extent of the split axis."""
    got = result.shape[out_axis] if result.ndim > out_axis else None
    if got != sub.extent:
        raise ValueError(
            f"split_axis={split_axis} requires {func_name} to keep the extent of output axis "
            f"{out_axis}: sub-chunk rows [{sub.start}:{sub.stop}] of {partition_name(key)} gave "
            f"an output of shape {tuple(result.shape)}, expected extent {sub.extent} along axis "
            f"{out_axis}"
        )


def check_declared(
    func_name: str,
    shape: tuple[int, ...],
    dtype: Any,
    want_shape: tuple[int | None, ...] | None,
    want_dtype: Any,
    key: Any,
) -> None:
    """The output block must be what the dask array says it is, or Dask's array lies."""
    dtype_ok = want_dtype is None or dtype == want_dtype or np.dtype(dtype) == np.dtype(want_dtype)
    shape_ok = (
        want_shape is None
        or tuple(shape) == want_shape  # the usual case: every extent known, and equal
        or (
            len(shape) == len(want_shape)
            and all(w is None or w == g for w, g in zip(want_shape, shape, strict=True))
        )
    )
    if dtype_ok and shape_ok:
        return
    shown = "?" if want_shape is None else tuple("?" if w is None else w for w in want_shape)
    raise ValueError(
        f"{func_name} returned dtype {np.dtype(dtype)} and shape {shape} for "
        f"{partition_name(key)}, but the output array declares dtype "
        f"{'?' if want_dtype is None else np.dtype(want_dtype)} and shape {shown} for "
        "this block: pass dtype= and chunks= (or meta=) to map_blocks as func returns them"
    )


def check_like_first(
    func_name: str,
    result: Any,
    out: Any,
    out_axis: int | None,
    sub: SubChunk,
    split: bool,
    key: Any,
) -> None:
    """Every sub-chunk's result matches the partition's output (made from the first one)."""
    expected = list(out.shape)
    got = list(result.shape)
    if split and out_axis is not None:
        expected[out_axis] = got[out_axis] = sub.extent
    if result.dtype != out.dtype or got != expected:
        raise ValueError(
            f"{func_name} returned dtype {result.dtype} and shape {tuple(result.shape)} for "
            f"sub-chunk rows [{sub.start}:{sub.stop}] of {partition_name(key)}, but another "
            f"sub-chunk gave dtype {out.dtype} and shape {tuple(expected)}"
        )


def refusal(x: Any) -> str | None:
    """What is wrong with ``x`` (a meta or a block) as an input, if anything."""
    if isinstance(x, np.ma.MaskedArray):
        return (
            "a masked array: dask_overlap copies only data, so its mask would be lost; fill "
            "it first (x.filled(...)), or pass da.ma.getdata(x) and da.ma.getmaskarray(x) as "
            "two inputs, or use dask.array.map_blocks"
        )
    if isinstance(x, np.matrix):
        return "an np.matrix, whose shapes are not an ndarray's: pass np.asarray blocks"
    return None


def refuse_block(x: Any, where: str) -> None:
    """Raise ``TypeError`` for a block :func:`refusal` refuses, at run time (a meta can say
    less than its blocks), naming the partition (``where``)."""
    why = refusal(x)
    if why is not None:
        raise TypeError(f"{where} got a block that is {why}")
