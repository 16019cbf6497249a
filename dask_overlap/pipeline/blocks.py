"""A batch's blocks: which blocks a partition that joined several holds, and its results
one a block.

With ``batch="auto"`` a partition joins ``k`` small blocks along ``split_axis``, and its
output is cut back into them by a Dask task a block. A fused step that must see each block
as Dask would have given it (the first step of a reduction along the batches' axis, a
reduction whose partial is a dict, a step that is not elementwise) runs on each block's
piece of the batch's output instead (:class:`~.program.EachBlock`), and the partition's
result is then one result a block (:class:`PerBlock` on the device, a tuple once it is
back), of which the task for block ``j`` takes the ``j``-th. :class:`BatchBlocks` says
which blocks a partition's batch holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .layout import along

__all__ = [
    "BatchBlocks",
    "PerBlock",
    "cut",
    "fetched_dict",
    "foldable",
    "folded",
    "pieces",
    "unfolded",
]


class BatchBlocks(NamedTuple):
    """The blocks of a batched partition's output: along ``axis``, ``k`` blocks a batch, of
    ``extents`` along it as a task carries an axis (``("regular", size, last, n)`` or
    ``("each", sizes)``: see :func:`~.task.axis_extents`)."""

    axis: int
    k: int
    extents: tuple

    def of(self, batch: int) -> tuple[int, ...]:
        """The extents along ``axis`` of the blocks of batch ``batch``."""
        kind, *rest = self.extents
        if kind == "regular":
            size, last, n = rest
            blocks = range(batch * self.k, min(batch * self.k + self.k, n))
            return tuple(last if j == n - 1 else size for j in blocks)
        (sizes,) = rest
        return tuple(int(s) for s in sizes[batch * self.k : batch * self.k + self.k])


def pieces(value: Any, axis: int, extents: tuple[int, ...], name: str) -> list[Any]:
    """``value`` cut along ``axis`` into views of ``extents`` (a batch's output into its
    blocks' parts); ``name`` names the step for the error where they do not add up."""
    total = value.shape[axis] if getattr(value, "ndim", 0) > axis else None
    if total != sum(extents):
        raise ValueError(
            f"{name}: a batch of {len(extents)} blocks of extents {extents} along axis "
            f"{axis} was given an output of shape {getattr(value, 'shape', None)}"
        )
    out, start = [], 0
    for e in extents:
        out.append(value[along(axis, start, start + e)])
        start += e
    return out


def cut(value: Any, axis: int, extents: tuple[int, ...]) -> list[Any] | None:
    """``value`` (an array, or a dict of arrays: a reduction's partial over other axes
    than ``axis``) cut along ``axis`` into the blocks' parts of ``extents``, one a block;
    ``None`` where an array's extent along it is not theirs together."""
    if type(value) is dict:
        columns = {k: cut(v, axis, extents) for k, v in value.items()}
        if any(c is None for c in columns.values()):
            return None
        return [{k: c[i] for k, c in columns.items()} for i in range(len(extents))]
    if getattr(value, "ndim", 0) <= axis or value.shape[axis] != sum(extents):
        return None
    return pieces(value, axis, extents, "")


def foldable(value: Any, axis: int, extents: tuple[int, ...]) -> bool:
    """Whether :func:`folded` of ``value`` reduces each block as it would be reduced alone:
    blocks of one extent, each a C-contiguous piece of a C-contiguous batch (``axis`` is
    its first axis of more than one element), so that the fold leaves each block's memory
    as it was, and NumPy adds its elements in the same order (the fold is the outermost
    axis). Elsewhere (``axis`` 1 of a 2-D batch: each block a strided piece of it) NumPy
    may add them in another order, and the result would not be exactly Dask's."""
    if len(extents) < 2 or len(set(extents)) != 1 or getattr(value, "ndim", 0) <= axis:
        return False
    shape = value.shape
    return (
        shape[axis] == sum(extents)
        and all(d == 1 for d in shape[:axis])
        and bool(value.flags.c_contiguous)
    )


def folded(value: Any, axis: int, extents: tuple[int, ...]) -> Any:
    """``value`` (a batch of blocks of one extent along ``axis``) with its blocks folded
    into a new last axis (a view where ``value`` is contiguous): a step that reduces any
    of ``value``'s axes (``axis`` among them), with ``keepdims``, then reduces each block
    on its own, in one call."""
    n = len(extents)
    shape = value.shape
    stacked = value.reshape((*shape[:axis], n, extents[0], *shape[axis + 1 :]))
    return np.moveaxis(stacked, axis, -1)  # (NumPy's, or CuPy's for CuPy arrays)


def unfolded(value: Any, ndim: int, n: int) -> list[Any] | None:
    """A step's result on :func:`folded` blocks (an array, or a dict of arrays, with the
    ``n`` blocks along axis ``ndim``) as one result a block (views); ``None`` where it is
    not so."""
    if type(value) is dict:
        columns = {k: unfolded(v, ndim, n) for k, v in value.items()}
        if any(c is None for c in columns.values()):
            return None
        return [{k: c[i] for k, c in columns.items()} for i in range(n)]
    if getattr(value, "ndim", 0) <= ndim or value.shape[ndim] != n:
        return None
    return [value[(slice(None),) * ndim + (i,)] for i in range(n)]


class PerBlock:
    """The results of a step run on each block of a batch, on the device, in order
    (arrays, dicts of arrays: a reduction's partials, or anything the step returned)."""

    __slots__ = ("axis", "results")

    def __init__(self, results: list[Any], axis: int):
        self.results, self.axis = results, axis

    def fetched(self, is_device: Callable[[Any], bool], fetch: Callable[[Any], Any]) -> tuple:
        """The results on the host, as a tuple: device arrays fetched, in one copy where
        they can be joined along ``axis`` (joined on the device, the host's results views
        of the copy), dicts of the same keys key by key; anything else as it is."""
        results = self.results
        if results and all(type(r) is dict and r.keys() == results[0].keys() for r in results):
            columns = {k: _fetched([r[k] for r in results], self.axis, is_device, fetch)
                       for k in results[0]}  # fmt: skip
            return tuple({k: c[i] for k, c in columns.items()} for i in range(len(results)))
        if all(type(r) is not dict for r in results):
            return tuple(_fetched(list(results), self.axis, is_device, fetch))
        return tuple(_fetched([r], self.axis, is_device, fetch)[0] for r in results)

    def __len__(self) -> int:
        return len(self.results)


def _fetched(
    values: list[Any], axis: int, is_device: Callable[[Any], bool], fetch: Callable[[Any], Any]
) -> list[Any]:
    """``values`` on the host: device arrays of one dtype whose shapes differ only along
    ``axis`` in one copy (joined on the device, then cut into views), others one by one
    (a dict's values each)."""
    if len(values) == 1 and type(values[0]) is dict:
        return [fetched_dict(values[0], is_device, fetch)]
    on_device = [is_device(v) for v in values]
    if not any(on_device):
        return values
    if all(on_device) and len(values) > 1 and _joinable(values, axis):
        joined = fetch(np.concatenate(values, axis=axis))  # (CuPy's, for CuPy arrays)
        stops = np.cumsum([v.shape[axis] for v in values])[:-1]
        return list(np.split(joined, stops, axis=axis))
    return [fetch(v) if d else v for v, d in zip(values, on_device, strict=True)]


def fetched_dict(
    partial: dict, is_device: Callable[[Any], bool], fetch: Callable[[Any], Any]
) -> dict:
    """A dict partial (a fused ``mean``'s or ``var``'s first step) on the host, its device
    arrays fetched one by one."""
    return {k: fetch(v) if is_device(v) else v for k, v in partial.items()}


def _joinable(values: list[Any], axis: int) -> bool:
    first = values[0]
    if first.ndim <= axis:
        return False
    rest = first.shape[:axis] + first.shape[axis + 1 :]
    return all(
        v.dtype == first.dtype
        and v.ndim == first.ndim
        and v.shape[:axis] + v.shape[axis + 1 :] == rest
        for v in values
    )
