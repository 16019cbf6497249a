"""What ``func`` will be handed and will return, settled before any partition runs.

- Inputs: array subclasses whose meaning lives beside the data (a masked array's mask,
  ``np.matrix``'s shapes) would be lost by the copies to the device, so they are refused
  with a ``TypeError`` that names the argument (the rule is the worker's,
  :func:`dask_overlap.pipeline.results.refusal`, which refuses such a block at run time).
- The output's blocks: a ``meta`` given, or what ``func`` returns on empty blocks where
  Dask infers one, must be a NumPy or CuPy array; a sparse or pandas one (which Dask
  would map as such) would not survive the copies, so it is refused with a ``TypeError``
  that says what it is (:func:`refuse_meta`).
- The output's dtype, when not given: Dask calls ``func`` on tiny NumPy blocks. A ``func``
  written for the GPU may only accept CuPy arrays (any ``cupyx.scipy`` call), so where the
  backend resolves to ``cuda`` in this process a failed NumPy attempt is retried on CuPy
  blocks. What ``func`` returns must be an array: a list or a string is reported as such,
  not as an unsupported dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import dask.array as da
import numpy as np
from dask.utils import funcname

from ..pipeline.results import refusal

__all__ = ["infer_dtype", "refuse_meta", "refuse_subclasses"]


def refuse_subclasses(arrays: Sequence[Any], positions: Sequence[int]) -> None:
    """Raise ``TypeError`` for an input whose blocks are a subclass that copies would strip.

    Examples
    --------
    >>> x = da.ma.masked_invalid(da.from_array(np.array([1.0, np.nan])))
    >>> refuse_subclasses([x], [0])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: arrays[0] is a masked array: dask_overlap copies only data, ...
    """
    for i in positions:
        why = refusal(getattr(arrays[i], "_meta", None))
        if why is not None:
            raise TypeError(f"arrays[{i}] is {why}")


def _dense(x: Any) -> bool:
    """A NumPy array or scalar, or a CuPy one (known by its module: CuPy is not imported)."""
    return isinstance(x, (np.ndarray, np.generic)) or type(x).__module__.split(".")[0] == "cupy"


def refuse_meta(meta: Any, what: str) -> None:
    """Raise ``TypeError`` where ``meta`` says the output's blocks are arrays of another
    library than NumPy or CuPy (sparse, pandas...), which dask_overlap cannot return;
    ``what`` names it in the message. A ``meta`` that is no array at all (``None``, a
    Python scalar) says nothing and passes, and so does a NumPy subclass, whose data come
    back as an ordinary array.

    Examples
    --------
    >>> refuse_meta(np.ma.masked_array([]), "meta")
    >>> class Frame:
    ...     shape, dtype = (0,), np.dtype("f8")
    >>> refuse_meta(Frame(), "meta")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: meta is a ...Frame, expected a NumPy or CuPy array: ...
    """
    if _dense(meta) or not (hasattr(meta, "shape") and hasattr(meta, "dtype")):
        return
    kind = f"{type(meta).__module__}.{type(meta).__qualname__}"
    raise TypeError(
        f"{what} is a {kind}, expected a NumPy or CuPy array: dask_overlap's blocks are "
        "dense arrays, copied between host and device as such; use dask.array.map_blocks "
        "for sparse, pandas or other kinds of blocks"
    )


def _ones(a: da.Array, xp: Any) -> Any:
    return xp.ones((1,) * a.ndim, dtype=a.dtype)


def infer_dtype(
    func: Callable[..., Any], arrays: Sequence[Any], kwargs: dict, on_gpu: bool
) -> np.dtype:
    """The dtype ``func`` returns on blocks of ones: NumPy blocks first, then (``on_gpu``)
    CuPy blocks.

    Examples
    --------
    >>> infer_dtype(lambda b: b * 0.5, [da.ones(4, dtype="i4")], {}, on_gpu=False)
    dtype('float64')
    >>> infer_dtype(lambda b: b.tolist(), [da.ones(4)], {}, on_gpu=False)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: lambda must return an array, got list (from a call on blocks of ones, ...)
    """
    modules: list[Any] = [np]
    if on_gpu:
        import cupy

        modules.append(cupy)
    errors = []
    for xp in modules:
        args = [_ones(a, xp) if isinstance(a, da.Array) else a for a in arrays]
        try:
            with np.errstate(all="ignore"):
                raw = func(*args, **kwargs)
        except Exception as e:
            errors.append(f"on {xp.__name__} blocks: {type(e).__name__}: {e}")
            continue
        if not (hasattr(raw, "dtype") and hasattr(raw, "shape")):
            raise TypeError(
                f"{funcname(func)} must return an array, got {type(raw).__name__} (from a "
                "call on blocks of ones, to infer the output dtype)"
            )
        return np.dtype(raw.dtype)
    raise ValueError(
        f"`dtype` inference failed in `map_blocks`: {funcname(func)} raised "
        + "; ".join(errors)
        + ". Please specify the dtype explicitly using the `dtype` kwarg."
    )
