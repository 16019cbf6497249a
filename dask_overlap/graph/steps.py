"""Dask layers as the steps of a fused partition's program, and which may run where.

The fusion pass (:mod:`.fusion`) asks this module what a layer next to a partition layer
is: a partition layer (:func:`partition_task`), a following stage
(:func:`stage_of_partition`), a Dask elementwise or reduction step
(:func:`stage_of_template`), a store (:func:`store_of`); and what may be done with it:
whether its function runs on device arrays as it does on NumPy's (:func:`device_safe`),
whether it works element by element, so that it may run on any piece of its blocks, a
sub-chunk or a batch of blocks (:func:`elementwise`), which axes it reduces
(:func:`reduced_axes`), and what it makes of the partition's blocks (:func:`probe`).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import numpy as np
from dask.array import chunk
from dask.array.core import _pass_extra_kwargs, load_store_chunk
from dask.blockwise import Blockwise
from dask.layers import ArraySliceDep

from ..pipeline.program import PREVIOUS, Call, Template
from ..pipeline.store import Store, known
from ..pipeline.task import PartitionTask
from .placement import placement
from .rewrite import PARTITION_ANNOTATION, is_partition_template, is_task_node

__all__ = [
    "ELEMENTWISE",
    "argument_positions",
    "device_safe",
    "elementwise",
    "elementwise_input",
    "grid",
    "own_annotations",
    "partition_task",
    "probe",
    "reads",
    "reads_blockwise",
    "reduced_axes",
    "reduces_to_one",
    "result_dtype",
    "stage_of_partition",
    "stage_of_template",
    "step_axes",
    "store_of",
    "store_target",
]

#: Modules whose functions run on CuPy arrays as they are: Dask's own chunk functions
#: (written for NumPy and CuPy alike) and NumPy's (which hand CuPy arrays to CuPy).
_DEVICE_MODULES = ("_operator", "operator", "dask.array.chunk", "dask.array.reductions")


def device_safe(fn: Any) -> bool:
    """Whether ``fn`` (a Dask layer's function) runs on device arrays as it does on NumPy's."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, np.ufunc):
        return True
    module = getattr(fn, "__module__", None) or ""
    return module in _DEVICE_MODULES or module == "numpy" or module.startswith("numpy.")


#: Functions that work element by element (so they may run on any piece of a block, a
#: sub-chunk or a batch of blocks) beside NumPy's ufuncs and the operators below: Dask's
#: ``astype`` and the NumPy functions Dask's elementwise methods use. Any other function
#: (``np.sort``, ``np.cumsum``, a reduction's step) runs on whole partitions' blocks.
ELEMENTWISE = frozenset(
    [
        *(getattr(np, n) for n in ("clip", "round", "around", "nan_to_num", "real", "imag")),
        *(getattr(np, n) for n in ("angle", "fix", "isreal", "iscomplex", "sinc", "where")),
        np.i0,
        *(getattr(operator, n) for n in ("add", "sub", "mul", "truediv", "floordiv", "mod")),
        *(getattr(operator, n) for n in ("pow", "neg", "pos", "abs", "invert", "and_", "or_")),
        *(getattr(operator, n) for n in ("xor", "lshift", "rshift", "lt", "le", "eq", "ne")),
        *(getattr(operator, n) for n in ("ge", "gt")),
        chunk.astype,
    ]
)


def elementwise(task: Any) -> bool:
    """Whether ``task`` (a Dask layer's task) works element by element, so that it may run
    on pieces of its blocks (see :data:`ELEMENTWISE`)."""
    fn = task.func
    while isinstance(fn, functools.partial):
        fn = fn.func
    return isinstance(fn, np.ufunc) or fn in ELEMENTWISE


def partition_task(layer: Any) -> PartitionTask | None:
    """The partition task of ``layer`` if it is a partition layer (made by ``map_blocks``
    and rewritten by :func:`.rewrite.partition_layer`), else ``None``."""
    if not isinstance(layer, Blockwise) or not is_partition_template(layer.task):
        return None
    for value, index in layer.indices:
        if index is None and isinstance(value, PartitionTask):
            return value
    return None


def own_annotations(layer: Any) -> dict:
    """``layer``'s annotations but the one that keeps a partition layer apart (the user's)."""
    return {k: v for k, v in (layer.annotations or {}).items() if k != PARTITION_ANNOTATION}


def grid(layer: Blockwise) -> tuple[int, ...]:
    """How many blocks ``layer`` makes along each axis."""
    return tuple(layer.dims[i] for i in layer.output_indices)


def reads(layer: Blockwise, name: str) -> int:
    """How many times ``layer`` reads the array ``name`` (not its constants: a store's
    target, taken in as a constant, is an array that ``==`` would compare element-wise)."""
    return sum(1 for value, index in layer.indices if index is not None and value == name)


def reads_blockwise(layer: Blockwise, name: str, grid: tuple[int, ...]) -> bool:
    """Whether ``layer`` reads ``name`` (of blocks on ``grid``) once, block for block (the
    same index, the same grid), and no other array."""
    arrays = [(v, i) for v, i in layer.indices if i is not None and v not in layer.io_deps]
    return (
        len(arrays) == 1
        and arrays[0] == (name, layer.output_indices)
        and tuple(layer.numblocks.get(name, ())) == grid
        and not layer.concatenate
        and not layer.new_axes
    )


def _arguments(layer: Blockwise, task: PartitionTask) -> list[tuple[Any, Any]]:
    """The (value, index) pairs of ``layer`` (a partition layer) that are arguments of the
    partition's ``func``, in order: not the task itself, nor the names of the keywords
    Dask passes it (``_pass_extra_kwargs``' second argument, and only that one: a user's
    constant may be a tuple too), nor ``block_id``'s values."""
    names_at = 1 if getattr(layer.task, "func", None) is _pass_extra_kwargs else None
    return [
        (value, index)
        for i, (value, index) in enumerate(layer.indices)
        if value is not task
        and i != names_at
        and not (index is not None and value in layer.io_deps)
    ]


def stage_of_partition(layer: Blockwise, name: str, task: PartitionTask) -> Call | None:
    """``layer`` (a partition layer reading ``name``) as a step of a program: its
    ``func`` called with the value where it read ``name``; ``None`` where it cannot be."""
    if task.func_block_id or task.func_block_info:
        return None
    kwargs = layer.task.kwargs
    if any(is_task_node(v) for v in kwargs.values()):
        return None  # a keyword Dask computes (a delayed object): left as it is
    args = []
    for value, index in _arguments(layer, task):
        if index is None and is_task_node(value):
            return None
        args.append(PREVIOUS if index is not None and value == name else value)
    return Call(task.key_name, task.func, tuple(args), kwargs)


def stage_of_template(layer: Blockwise, name: str) -> Template | None:
    """``layer`` (a Dask elementwise or reduction step reading ``name``) as a step: its
    task template, evaluated with the value for ``name``'s block."""
    task = layer.task
    if not device_safe(task.func):
        return None
    token, constants = None, {}
    for i, (value, index) in enumerate(layer.indices):
        key = f"__dask_blockwise__{i}"
        if index is None:
            constants[key] = value
        else:
            token = key
    if token is None or task.dependencies - {token, *constants}:
        return None
    return Template(layer.output, task, token, constants)


def argument_positions(layer: Blockwise, task: PartitionTask) -> dict[str, int]:
    """The arrays ``layer`` (a partition layer) reads, by name, with the position of the
    argument each is to the partition's ``func`` (as :func:`stage_of_partition` counts)."""
    return {
        value: n for n, (value, index) in enumerate(_arguments(layer, task)) if index is not None
    }


def elementwise_input(layer: Any) -> str | None:
    """The one array ``layer`` reads where it is an elementwise Dask step that can run on
    a partition's device blocks (block for block, the same grid, no axis), else ``None``."""
    if not isinstance(layer, Blockwise) or partition_task(layer) is not None or layer.io_deps:
        return None
    if layer.concatenate or layer.new_axes or "axis" in layer.task.kwargs:
        return None
    arrays = [(v, i) for v, i in layer.indices if i is not None]
    if len(arrays) != 1 or arrays[0][1] != layer.output_indices:
        return None
    if tuple(layer.numblocks.get(arrays[0][0], ())) != grid(layer):
        return None
    return arrays[0][0]


def probe(step: Template, task: PartitionTask, extent: int = 1) -> Any:
    """``step``'s output on a block of NumPy like the partition's blocks, ``extent``
    elements along each axis (one, as Dask infers a meta), or ``None`` where that says
    nothing (no dtype known before it, an error)."""
    if task.out_dtype is None or task.out_chunks is None:
        return None
    try:
        with np.errstate(all="ignore"):
            return step(np.ones((extent,) * len(task.out_chunks), dtype=task.out_dtype))
    except Exception:
        return None


def reduces_to_one(step: Template, task: PartitionTask, axes: tuple[int, ...]) -> bool:
    """Whether ``step`` leaves one element along each of ``axes`` of a block with more,
    as a reduction's first step does (``da.topk``'s is called as one is, with ``axis=``
    and ``keepdims=True``, and keeps k). A step may give a dict of arrays (``mean``'s
    sum and count): each must."""
    out = probe(step, task, extent=2)
    parts = list(out.values()) if isinstance(out, dict) else [out]
    shapes = [getattr(part, "shape", None) for part in parts]
    return all(s is not None and all(s[a] == 1 for a in axes) for s in shapes)


def result_dtype(step: Template, task: PartitionTask) -> Any:
    """The dtype of ``step``'s output on blocks of the partition's, or ``None`` where not
    known (see :func:`probe`; a partial that is not an array has none)."""
    return getattr(probe(step, task), "dtype", None)


def step_axes(layer: Blockwise) -> tuple[int, ...]:
    """The axes a Dask step's ``axis=`` names, as given (``()`` for none, or where they
    are not integers)."""
    axis = layer.task.kwargs.get("axis")
    axes = (axis,) if isinstance(axis, int) else axis
    if not isinstance(axes, (tuple, list)) or not all(isinstance(a, int) for a in axes):
        return ()
    return tuple(axes)


def reduced_axes(layer: Blockwise) -> tuple[int, ...]:
    """The axes a Dask step reduces, ``()`` for none. A reduction's first step is called
    with ``axis=`` and ``keepdims=True`` (Dask's ``reduction`` normalises ``axis`` into a
    tuple); other steps that take ``axis=`` keep their blocks' dimensions as they are
    (``np.cumsum``) or change them in ways a layer does not say (``np.diff``)."""
    if layer.task.kwargs.get("keepdims") is not True:
        return ()
    axes = step_axes(layer)
    # As positive axes (a user's step may say -2): what the partition's shape is told.
    ndim = len(layer.output_indices)
    if not all(-ndim <= a < ndim for a in axes):
        return ()
    return tuple(a % ndim for a in axes)


def store_target(layer: Blockwise) -> tuple[bool, Any]:
    """Whether ``layer`` is the store step of ``da.store`` (Dask's ``load_store_chunk`` on
    each block, the block's slice from an ``ArraySliceDep``), and the value it gives as
    the target: a constant, or a reference to the key that holds it (Dask puts a large
    array, or a ``Delayed`` target, in a key of its own)."""
    t = layer.task
    if t.func is not load_store_chunk or len(t.args) < 2:
        return False, None
    slices = [v for v, i in layer.indices if i is not None and v in layer.io_deps]
    if len(slices) != 1 or not isinstance(layer.io_deps[slices[0]], ArraySliceDep):
        return False, None
    ref = getattr(t.args[1], "key", "")
    if not isinstance(ref, str) or not ref.startswith("__dask_blockwise__"):
        return False, None
    value, index = layer.indices[int(ref.removeprefix("__dask_blockwise__"))]
    return index is None, value


def store_of(layer: Blockwise, task: PartitionTask) -> PartitionTask | None:
    """The partition task that also does ``layer``'s work where ``layer`` is a store step
    (see :func:`store_target`) whose options are given as they are; else ``None``, and
    where every partition runs on the host backend (:mod:`.placement`): there the store
    saves no copy, and taken in, it would keep the partition's input alive through the
    write, which Dask frees before it (a one-chunk Zarr pipeline on 2 cores ran 5-10 %
    slower for it)."""
    is_store, _ = store_target(layer)
    kw = layer.task.kwargs
    if not is_store or task.out_mode == "device" or not known(task.out_chunks):
        return None
    if any(is_task_node(v) for v in kw.values()) or placement(task.backend).on_host:
        return None
    store = Store(kw["region"], kw["lock"], kw["return_stored"], kw["load_stored"])
    return task.stored(store, layer.output)
