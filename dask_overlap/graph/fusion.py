"""Fusion: a pipeline's steps around a partition run in the partition, on the device.

Where a ``dask_overlap.map_blocks`` stage reads the blocks of another, or an elementwise
Dask step (``y * 2 + 1``, ``da.sqrt(y)``, ``y.astype(...)``), or the first step of a
reduction (``y.sum(axis=0)``, ``y.mean()``), sits next to a partition layer, the two
become one partition layer whose ``func`` is a :class:`~dask_overlap.pipeline.program.
Program`: each sub-chunk goes through every step on the device, with one copy in and one
copy out, and the intermediate exists neither on the host nor as a Dask key.

This runs when Dask optimizes an array graph (``dask.config``'s ``array_optimize``, the
extension point Dask offers: see :func:`install`), so it sees the whole graph and the
keys asked for, as Dask's own blockwise fusion does: a layer that something else also
reads, or whose keys are asked for, is left as it is. So are layers that cannot be run
on device arrays as they are (a function that is neither a NumPy ufunc nor an operator,
NumPy function or Dask chunk function), layers whose annotations differ from the
partition's (a user's ``dask.annotate``), and everything when ``overlap.fuse`` is false.
A step is taken only where its blocks are the partition's blocks, one to one.

The store step of ``da.store`` (and ``to_zarr``) after a partition ends it too: the
partition writes its result into the target (see :mod:`~dask_overlap.pipeline.store`).

A reduction's step ends the partition's program and makes it one whole sub-chunk (its
partial of a sub-chunk would not be the partial of the partition); so does any step that
does not work element by element (``np.sort``, ``np.cumsum``: see :data:`_ELEMENTWISE`),
and a partition stage whose ``split_axis`` differs from the one before. Such a step is
not taken into a partition that joins several blocks (``batch``), nor through the cut
after one: it would run on the batch, not on each block.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable
from typing import Any

import dask
import numpy as np
from dask.array import chunk
from dask.array.core import load_store_chunk
from dask.blockwise import Blockwise
from dask.core import flatten
from dask.highlevelgraph import HighLevelGraph
from dask.layers import ArraySliceDep
from dask.utils import funcname

from ..config import Options
from ..pipeline.program import PREVIOUS, Call, Program, Template
from ..pipeline.store import Store, known
from ..pipeline.task import PartitionTask
from .batch import CutBack
from .rewrite import (
    PARTITION_ANNOTATION,
    is_task_node,
    layer_of,
    rerouted,
    retargeted,
    with_argument,
)

__all__ = ["explain", "fuse", "install", "optimize"]

#: Modules whose functions run on CuPy arrays as they are: Dask's own chunk functions
#: (written for NumPy and CuPy alike) and NumPy's (which hand CuPy arrays to CuPy).
_DEVICE_MODULES = ("_operator", "operator", "dask.array.chunk", "dask.array.reductions")


def _device_safe(fn: Any) -> bool:
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
_ELEMENTWISE = frozenset(
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


def _elementwise(task: Any) -> bool:
    """Whether ``task`` (a Dask layer's task) works element by element, so that it may run
    on pieces of its blocks (see :data:`_ELEMENTWISE`)."""
    fn = task.func
    while isinstance(fn, functools.partial):
        fn = fn.func
    return isinstance(fn, np.ufunc) or fn in _ELEMENTWISE


def partition_task(layer: Any) -> PartitionTask | None:
    """The partition task of ``layer`` if it is a partition layer (made by ``map_blocks``
    and rewritten by :func:`.rewrite.partition_layer`), else ``None``."""
    if not isinstance(layer, Blockwise) or PARTITION_ANNOTATION not in (layer.annotations or {}):
        return None
    for value, index in layer.indices:
        if index is None and isinstance(value, PartitionTask):
            return value
    return None


def _own_annotations(layer: Any) -> dict:
    return {k: v for k, v in (layer.annotations or {}).items() if k != PARTITION_ANNOTATION}


def _grid(layer: Blockwise) -> tuple[int, ...]:
    return tuple(layer.dims[i] for i in layer.output_indices)


def _reads_blockwise(layer: Blockwise, name: str, grid: tuple[int, ...]) -> bool:
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


def _stage_of_partition(layer: Blockwise, name: str, task: PartitionTask) -> Call | None:
    """``layer`` (a partition layer reading ``name``) as a step of a program: its
    ``func`` called with the value where it read ``name``; ``None`` where it cannot be."""
    if task.func_block_id or task.func_block_info:
        return None
    kwargs = layer.task.kwargs
    if any(is_task_node(v) for v in kwargs.values()):
        return None  # a keyword Dask computes (a delayed object): left as it is
    args = []
    for value, index in layer.indices:
        if value is task or (index is None and isinstance(value, tuple)):
            continue  # the task itself, and the names of the keywords Dask passes it
        if index is not None and value in layer.io_deps:
            continue  # block_id's values
        if index is None and is_task_node(value):
            return None
        args.append(PREVIOUS if value == name else value)
    return Call(task.key_name, task.func, tuple(args), kwargs)


def _stage_of_template(layer: Blockwise, name: str) -> Template | None:
    """``layer`` (a Dask elementwise or reduction step reading ``name``) as a step: its
    task template, evaluated with the value for ``name``'s block."""
    task = layer.task
    if not _device_safe(task.func):
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


def _argument_positions(layer: Blockwise, task: PartitionTask) -> dict[str, int]:
    """The arrays ``layer`` (a partition layer) reads, by name, with the position of the
    argument each is to the partition's ``func`` (as :func:`_stage_of_partition` counts)."""
    positions, n = {}, 0
    for value, index in layer.indices:
        if value is task or (index is None and isinstance(value, tuple)):
            continue
        if index is not None and value in layer.io_deps:
            continue
        if index is not None:
            positions[value] = n
        n += 1
    return positions


def _elementwise_input(layer: Any) -> str | None:
    """The one array ``layer`` reads where it is an elementwise Dask step that can run on
    a partition's device blocks (block for block, the same grid, no axis), else ``None``."""
    if not isinstance(layer, Blockwise) or partition_task(layer) is not None or layer.io_deps:
        return None
    if layer.concatenate or layer.new_axes or "axis" in layer.task.kwargs:
        return None
    arrays = [(v, i) for v, i in layer.indices if i is not None]
    grid = _grid(layer)
    if len(arrays) != 1 or arrays[0][1] != layer.output_indices:
        return None
    if tuple(layer.numblocks.get(arrays[0][0], ())) != grid:
        return None
    return arrays[0][0]


def _take_before(
    layers: dict, name: str, layer: Blockwise, task: PartitionTask, producer: str
) -> Blockwise | None:
    """``layer`` (a partition layer) with the elementwise step ``producer`` (which only
    it reads) taken in, run on the device before its ``func``; ``None`` where it cannot."""
    step_layer = layers.get(producer)
    source = _elementwise_input(step_layer)
    if source is None or _own_annotations(step_layer) != _own_annotations(layer):
        return None
    position = _argument_positions(layer, task).get(producer)
    if position is None or [v for v, _ in layer.indices].count(producer) != 1:
        return None
    step = _stage_of_template(step_layer, source)
    if step is None:
        return None
    whole = not _elementwise(step_layer.task)  # (np.sort: on the block, not a piece of it)
    if whole and task.batch != 1:
        return None  # it would run on the batch the partition joins
    fused = task.preceded(position, step, whole)
    return rerouted(layer, task, fused, producer, source)


def _probe(step: Template, task: PartitionTask) -> Any:
    """``step``'s output on one element of NumPy like the partition's blocks (as Dask infers
    a meta), or ``None`` where that says nothing (no dtype known before it, an error)."""
    if task.out_dtype is None or task.out_chunks is None:
        return None
    try:
        with np.errstate(all="ignore"):
            return step(np.ones((1,) * len(task.out_chunks), dtype=task.out_dtype))
    except Exception:
        return None


def _result_dtype(step: Template, task: PartitionTask) -> Any:
    """The dtype of ``step``'s output on blocks of the partition's, or ``None`` where not
    known (see :func:`_probe`; a partial that is not an array has none)."""
    return getattr(_probe(step, task), "dtype", None)


def _reduced_axes(layer: Blockwise) -> tuple:
    """The axes a Dask step reduces (a reduction's first step), ``()`` for none."""
    axis = layer.task.kwargs.get("axis", ())
    return tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)


def _absorb_through(
    consumer: Any, cut_name: str, cut: CutBack, layer: Blockwise, task: PartitionTask
) -> tuple[PartitionTask, np.dtype] | None:
    """The partition task of ``layer`` (whose batches ``cut`` cuts back into blocks) with
    ``consumer``'s Dask step taken in, run on each batch before the cut, and the dtype of
    its output; ``None`` where the step is not one that can be (an elementwise step, or a
    reduction's first step over axes other than the cut's, whose partial is an array)."""
    if not isinstance(consumer, Blockwise) or partition_task(consumer) is not None:
        return None
    if consumer.io_deps or _own_annotations(consumer) != _own_annotations(layer):
        return None
    if not _reads_blockwise(consumer, cut_name, _grid(consumer)):
        return None
    step = _stage_of_template(consumer, cut_name)
    reduces = _reduced_axes(consumer)
    if step is None or cut.axis in reduces or None in reduces:
        return None
    if not reduces and not _elementwise(consumer.task):
        return None  # (np.sort on a batch is not np.sort on each of its blocks)
    probe = _probe(step, task)
    if not isinstance(probe, np.ndarray):
        return None  # (a mean's partial is a dict: it cannot be cut)
    return task.absorbed(step, None, bool(reduces), probe.dtype, reduces), probe.dtype


def _absorb(
    consumer: Any, name: str, layer: Blockwise, task: PartitionTask
) -> PartitionTask | None:
    """The partition task of ``layer`` with ``consumer``'s step added to its program;
    ``None`` where ``consumer`` is not such a step (see the module docstring)."""
    if not isinstance(consumer, Blockwise) or _own_annotations(consumer) != _own_annotations(layer):
        return None
    if not _reads_blockwise(consumer, name, _grid(layer)):
        return None
    next_task = partition_task(consumer)
    if next_task is not None:
        step = _stage_of_partition(consumer, name, next_task)
        if step is None or next_task.backend != task.backend:
            return None
        fused = task.absorbed(step, next_task, next_task.split_axis != task.split_axis)
        return fused
    if consumer.io_deps:
        return _store_of(consumer, task)
    step = _stage_of_template(consumer, name)
    if step is None:
        return None
    reduces = _reduced_axes(consumer)  # a reduction's first step: its axes
    dtype = _result_dtype(step, task)
    whole = bool(reduces) or not _elementwise(consumer.task)
    return task.absorbed(step, None, whole, dtype, reduces)


def _store_target(layer: Blockwise) -> tuple[bool, Any]:
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


def _store_of(layer: Blockwise, task: PartitionTask) -> PartitionTask | None:
    """The partition task that also does ``layer``'s work where ``layer`` is a store step
    (see :func:`_store_target`) whose options are given as they are; else ``None``."""
    is_store, _ = _store_target(layer)
    kw = layer.task.kwargs
    if not is_store or task.out_mode == "device" or not known(task.out_chunks):
        return None
    if any(is_task_node(v) for v in kw.values()):
        return None
    store = Store(kw["region"], kw["lock"], kw["return_stored"], kw["load_stored"])
    return task.stored(store, layer.output)


def fuse(graph: HighLevelGraph, keys: Iterable[Any]) -> HighLevelGraph:
    """``graph`` with every partition layer given the steps it can take from its one
    reader (repeatedly, so a chain becomes one partition layer); ``graph`` itself when
    there is none (or ``overlap.fuse`` is false)."""
    if not Options.from_config().fuse:
        return graph
    layers = dict(graph.layers)
    if not any(partition_task(layer) is not None for layer in layers.values()):
        return graph
    deps = {k: set(v) for k, v in graph.dependencies.items()}
    wanted = {layer_of(k) for k in flatten(keys)}
    changed = True
    while changed:
        changed = False
        readers: dict[str, set[str]] = {}
        for name, needs in deps.items():
            for dep in needs:
                readers.setdefault(dep, set()).add(name)
        for name, layer in list(layers.items()):
            task = partition_task(layer)
            if task is None:
                continue
            for producer in deps.get(name, ()):
                if producer in wanted or readers.get(producer) != {name}:
                    continue
                fused_layer = _take_before(layers, name, layer, task, producer)
                if fused_layer is not None:
                    layers[name] = fused_layer
                    deps[name] = (deps[name] - {producer}) | deps.pop(producer)
                    del layers[producer]
                    changed = True
                    break
            if changed:
                break  # the readers changed: look again
            if name in wanted or len(readers.get(name, ())) != 1:
                continue
            (reader,) = readers[name]
            if isinstance(layers[reader], CutBack):
                changed = _fuse_through(layers, deps, readers, wanted, name, reader)
                if changed:
                    break
                continue
            fused = _absorb(layers[reader], name, layer, task)
            if fused is None:
                continue
            fused_layer = retargeted(layer, task, fused, reader, _own_annotations(layer))
            if fused.store is not None and task.store is None:  # its target: one more argument
                fused_layer = with_argument(fused_layer, _store_target(layers[reader])[1])
                if fused_layer is None:  # pragma: no cover - another Dask
                    continue
            layers[reader] = fused_layer
            deps[reader] = deps.pop(name) | (deps[reader] - {name})  # (a store's target)
            del layers[name]
            changed = True
            break  # the readers changed: look again
    return HighLevelGraph(layers, deps)


def _fuse_through(
    layers: dict, deps: dict, readers: dict, wanted: set, name: str, cut_name: str
) -> bool:
    """Take the one reader of ``cut_name`` (a :class:`CutBack` of the batched partition
    layer ``name``) into the partitions, before the cut, which is then named as that reader
    was; whether it was taken (``layers`` and ``deps`` changed in place)."""
    cut, layer = layers[cut_name], layers[name]
    if cut.batched != name or cut_name in wanted or len(readers.get(cut_name, ())) != 1:
        return False
    (consumer,) = readers[cut_name]
    task = partition_task(layer)
    fused = _absorb_through(layers[consumer], cut_name, cut, layer, task)
    if fused is None:
        return False
    fused_task, dtype = fused
    layers[name] = retargeted(layer, task, fused_task, name, _own_annotations(layer))
    layers[consumer] = cut.renamed(consumer, cut.meta.astype(dtype))
    deps[consumer] = {name}
    del layers[cut_name], deps[cut_name]
    return True


def optimize(dsk: Any, keys: Any, **kwargs: Any) -> Any:
    """Dask's array optimization (or the one set before :func:`install`), after
    :func:`fuse`: what :func:`install` sets as ``array_optimize``."""
    if isinstance(dsk, HighLevelGraph):
        dsk = fuse(dsk, keys)
    return (_previous or _dask_optimize)(dsk, keys, **kwargs)


def _dask_optimize(dsk: Any, keys: Any, **kwargs: Any) -> Any:
    from dask.array.optimization import optimize as dask_optimize

    return dask_optimize(dsk, keys, **kwargs)


_previous: Any = None  # the array_optimize before ours, if one was set


def install() -> None:
    """Make :func:`optimize` Dask's array optimization (``array_optimize``), keeping one set
    before as what it then calls. Called by ``dask_overlap.map_blocks`` (importing the
    package changes nothing); idempotent; left alone where a user turned Dask's
    optimization off (``array_optimize: False``)."""
    global _previous
    current = dask.config.get("array_optimize", None)
    if current is optimize or current is False:
        return
    _previous = current
    dask.config.set(array_optimize=optimize)


def explain(*collections: Any) -> str:
    """What fusion makes of ``collections``' graph: one line per partition layer, with the
    steps it runs (a fused one, several).

    Examples
    --------
    >>> import dask.array as da, dask_overlap
    >>> def twice(b):
    ...     return b * 2
    >>> y = dask_overlap.map_blocks(twice, da.ones(8, chunks=4), split_axis=0)
    >>> print(dask_overlap.explain(y + 1))  # doctest: +ELLIPSIS
    add-...: 2 partitions of twice -> add (fused: 2 steps, one copy in and one out)
    """
    graph = HighLevelGraph.merge(*(c.__dask_graph__() for c in collections))
    keys = [c.__dask_keys__() for c in collections]
    lines = []
    for name, layer in fuse(graph, keys).layers.items():
        task = partition_task(layer)
        if task is None:
            continue
        steps = task.func.names if isinstance(task.func, Program) else [funcname(task.func)]
        if task.store is not None:
            steps = [*steps, "store"]
        n = int(np.prod([layer.dims[i] for i in layer.output_indices]))
        what = " -> ".join(steps)
        how = f" (fused: {len(steps)} steps, one copy in and one out)" if len(steps) > 1 else ""
        whole = "" if task.split_axis is not None else ", whole partitions"
        lines.append(f"{name}: {n} partitions of {what}{how}{whole if how else ''}")
    return "\n".join(lines)
