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
A step is taken only where its blocks are the partition's blocks, one to one. What a
layer is as a step, and where it may run, is :mod:`.steps`'; fusion through the batches
of a batched stage (the join before it, the cut after a ``batch="auto"`` one) is
:mod:`.through`'s.

The store step of ``da.store`` (and ``to_zarr``) after a partition ends it too: the
partition writes its result into the target (see :mod:`~dask_overlap.pipeline.store`).

A reduction's step ends the partition's program and makes it one whole sub-chunk (its
partial of a sub-chunk would not be the partial of the partition); so does any step that
does not work element by element (``np.sort``, ``np.cumsum``: see
:data:`.steps.ELEMENTWISE`), and a partition stage whose ``split_axis`` differs from the
one before. Such a step never runs on a batch of joined blocks: before a batched stage it
is left as it is; after an auto one it runs on each block of the batch (see
:mod:`.through`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import dask
import numpy as np
from dask.blockwise import Blockwise
from dask.core import flatten, reverse_dict
from dask.highlevelgraph import HighLevelGraph
from dask.utils import funcname

from ..config import Options
from ..pipeline.pieces import gather
from ..pipeline.program import Program
from ..pipeline.task import PartitionTask
from .batch import CutBack, with_data_gathered
from .rewrite import (
    aliases_seen_through,
    asked_keys,
    inlined_data,
    is_partition_template,
    kept_apart,
    layer_of,
    rerouted,
    retargeted,
    with_argument,
)
from .steps import (
    argument_positions,
    elementwise,
    elementwise_input,
    grid,
    own_annotations,
    partition_task,
    reads,
    reads_blockwise,
    reduced_axes,
    reduces_to_one,
    result_dtype,
    stage_of_partition,
    stage_of_template,
    store_of,
    store_target,
)
from .through import fuse_through, take_through_gather

__all__ = ["explain", "fuse", "install", "optimize"]


def _take_before(
    layers: dict, name: str, layer: Blockwise, task: PartitionTask, producer: str
) -> Blockwise | None:
    """``layer`` (a partition layer) with the elementwise step ``producer`` (which only
    it reads) taken in, run on the device before its ``func``; ``None`` where it cannot."""
    step_layer = layers.get(producer)
    source = elementwise_input(step_layer)
    if source is None or own_annotations(step_layer) != own_annotations(layer):
        return None
    position = argument_positions(layer, task).get(producer)
    if position is None or reads(layer, producer) != 1:
        return None
    step = stage_of_template(step_layer, source)
    if step is None:
        return None
    whole = not elementwise(step_layer.task)  # (np.sort: on the block, not a piece of it)
    if whole and task.batch != 1:
        return None  # it would run on the batch the partition joins
    fused = task.preceded(position, step, whole)
    return rerouted(layer, task, fused, producer, source)


def _absorb(
    consumer: Any, name: str, layer: Blockwise, task: PartitionTask
) -> PartitionTask | None:
    """The partition task of ``layer`` with ``consumer``'s step added to its program;
    ``None`` where ``consumer`` is not such a step (see the module docstring)."""
    if not isinstance(consumer, Blockwise) or own_annotations(consumer) != own_annotations(layer):
        return None
    if not reads_blockwise(consumer, name, grid(layer)):
        return None
    next_task = partition_task(consumer)
    if next_task is not None:
        step = stage_of_partition(consumer, name, next_task)
        if step is None or next_task.backend != task.backend:
            return None
        fused = task.absorbed(step, next_task, next_task.split_axis != task.split_axis)
        return fused
    if consumer.io_deps:
        return store_of(consumer, task)
    step = stage_of_template(consumer, name)
    if step is None:
        return None
    reduces = reduced_axes(consumer)  # a reduction's first step: its axes
    if reduces and not reduces_to_one(step, task, reduces):
        return None  # called as one (da.topk's step), but it keeps more than one
    dtype = result_dtype(step, task)
    kept = elementwise(consumer.task)  # (np.sort: on whole blocks, and np.diff's extents
    whole = bool(reduces) or not kept  # are not the layer's to say: left unchecked)
    return task.absorbed(step, None, whole, dtype, reduces, shaped=kept or bool(reduces))


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
        readers = reverse_dict(deps)
        for name, layer in list(layers.items()):
            task = partition_task(layer)
            if task is None:
                continue
            if take_through_gather(layers, deps, readers, wanted, name):
                changed = True
                break  # (a batched stage's joined input: see .through)
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
                changed = fuse_through(layers, deps, readers, wanted, name, reader)
                if changed:
                    break
                continue
            fused = _absorb(layers[reader], name, layer, task)
            if fused is None:
                continue
            fused_layer = retargeted(layer, task, fused, reader, own_annotations(layer))
            if fused.store is not None and task.store is None:  # its target: one more argument
                fused_layer = with_argument(fused_layer, store_target(layers[reader])[1])
                if fused_layer is None:  # pragma: no cover - another Dask
                    continue
            layers[reader] = fused_layer
            deps[reader] = deps.pop(name) | (deps[reader] - {name})  # (a store's target)
            del layers[name]
            changed = True
            break  # the readers changed: look again
    return HighLevelGraph(layers, deps)


def optimize(dsk: Any, keys: Any, **kwargs: Any) -> Any:
    """Dask's array optimization (or the one set before :func:`install`), after
    :func:`fuse`, :func:`.rewrite.kept_apart` and :func:`.batch.with_data_gathered`, then
    the blocks of data only a gather or a partition reads put into it
    (:func:`.rewrite.inlined_data`): what :func:`install` sets as ``array_optimize``."""
    asked = asked_keys(keys)  # (flattened once, for the passes of ours that ask)
    if isinstance(dsk, HighLevelGraph):
        dsk = kept_apart(fuse(dsk, asked))
        partitions = [n for n, layer in dsk.layers.items() if partition_task(layer) is not None]
        if partitions:  # (after fusion: a layer seen through is a materialized one)
            dsk = aliases_seen_through(dsk, partitions, {layer_of(k) for k in asked})
        dsk = with_data_gathered(dsk, asked)
    dsk = (_previous or _dask_optimize)(dsk, keys, **kwargs)
    return inlined_data(dsk, asked, _reads_blocks)


def _reads_blocks(task: Any) -> bool:
    """Whether ``task`` (one of Dask's task objects) is a batch's gather or a partition:
    a task of this library's that reads blocks once (see :func:`.rewrite.inlined_data`)."""
    return task.func is gather or is_partition_template(task)


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
        lines.append(f"{name}: {n} partitions of {what}{how}{whole + _each(task) if how else ''}")
    return "\n".join(lines)


def _each(task: PartitionTask) -> str:
    """What ``task``'s partitions run on each block of their batches, for :func:`explain`."""
    if task.blocks is None:
        return ""
    each = task.func.per_block if isinstance(task.func, Program) else []
    parts = [
        f"{s.label}'s partial cut into the blocks'"
        if s.how == "batch"
        else f"{s.label} on each block"
        for s in each
    ]
    if task.store is not None:
        parts.append("each block stored in its region")
    return f", batches of {task.blocks.k} blocks: {'; '.join(parts)}"
