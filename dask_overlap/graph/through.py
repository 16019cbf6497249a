"""Fusion through a batched stage's batches: steps after a ``batch="auto"`` stage run on
its batches before the cut back into blocks; steps before a batched stage run on the batch
it joins.

With ``batch="auto"`` a partition joins ``k`` small blocks along ``split_axis`` and a
:class:`~.batch.CutBack` layer cuts its output back into the blocks. A step that reads
those blocks, one for one, runs in the partition instead (:func:`fuse_through`):

- on the batch, where that is running it on each of its blocks: an elementwise step, or
  a reduction's first step over axes other than the cut's whose partial is an array. The
  cut then cuts the step's output;
- on each block's piece of the batch (:class:`~dask_overlap.pipeline.program.EachBlock`)
  where it is not: the first step of a reduction along the cut's axis, one whose partial
  is a dict (``mean``, ``var``), a step that is not elementwise (``np.sort``). The
  partition's result is then one a block, and the cut's task for a block takes its own
  (:meth:`~.batch.CutBack.picking`); nothing more is taken through it;
- a store: the partition writes its batch's region of the target, and returns what the
  store step would have returned for each block.

The cut is then named as the step was. Before a batched stage, the join of its blocks
(a :class:`~.batch.Gathered` layer) hides the step that made them; an elementwise one is
taken into the partition, run on the joined batch, and the join of batches an earlier
auto stage made and cut is not made at all (:func:`take_through_gather`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from dask.base import tokenize
from dask.blockwise import Blockwise

from ..pipeline.blocks import BatchBlocks
from ..pipeline.program import Template
from ..pipeline.task import PartitionTask, axis_extents
from .batch import CutBack, Gathered
from .rewrite import rerouted, retargeted, with_argument
from .steps import (
    argument_positions,
    elementwise,
    elementwise_input,
    grid,
    own_annotations,
    partition_task,
    probe,
    reads,
    reads_blockwise,
    reduced_axes,
    reduces_to_one,
    stage_of_template,
    step_axes,
    store_of,
    store_target,
)

__all__ = ["fuse_through", "take_through_gather"]


def _absorb_through(
    consumer: Any, cut_name: str, cut: CutBack, layer: Blockwise, task: PartitionTask
) -> tuple[PartitionTask, Any] | None:
    """The partition task of ``layer`` (whose batches ``cut`` cuts back into blocks) with
    ``consumer``'s Dask step taken in (see the module docstring), and the meta of its
    blocks after it (``None``: its results are one a block); ``None`` where it cannot be."""
    if not isinstance(consumer, Blockwise) or partition_task(consumer) is not None:
        return None
    if own_annotations(consumer) != own_annotations(layer):
        return None
    if not reads_blockwise(consumer, cut_name, grid(consumer)):
        return None
    blocks = _blocks_of(cut)
    if consumer.io_deps:  # a store step
        stored = store_of(consumer, task)
        if stored is None or blocks is None:
            return None
        return task.each_stored(stored.store, stored.key_name, blocks), None
    step = stage_of_template(consumer, cut_name)
    if step is None:
        return None
    reduces = reduced_axes(consumer)
    if reduces and not reduces_to_one(step, task, reduces):
        return None  # called as a reduction's step (da.topk's), but it keeps more than one
    found = probe(step, task)
    on_batch = elementwise(consumer.task) or (reduces and cut.axis not in reduces)
    if on_batch and isinstance(found, np.ndarray):  # (a mean's partial is a dict: not cut)
        fused = task.absorbed(step, None, bool(reduces), found.dtype, reduces)
        return fused, cut.meta.astype(found.dtype)
    if blocks is None:
        return None
    # (A fold adds a last axis: a step that names its axes from the end would then reduce
    # another one; such a step runs on each block.)
    folds = cut.axis in reduces and not any(a < 0 for a in step_axes(consumer))
    how = "batch" if on_batch and type(found) is dict else "fold" if folds else "each"
    return task.each_block(step, blocks, how), None


def _blocks_of(cut: CutBack) -> BatchBlocks | None:
    """The blocks of ``cut``'s batches as a partition task carries them; ``None`` where
    their extents are not known or too many to carry (see ``axis_extents``)."""
    extents = axis_extents(cut.blocks)
    if extents is None or extents[0] == "each" and any(math.isnan(e) for e in extents[1]):
        return None
    return BatchBlocks(cut.axis, cut.k, extents)


def fuse_through(
    layers: dict, deps: dict, readers: dict, wanted: set, name: str, cut_name: str
) -> bool:
    """Take the one reader of ``cut_name`` (a :class:`CutBack` of the batched partition
    layer ``name``) into the partitions, before the cut, which is then named as that reader
    was; whether it was taken (``layers`` and ``deps`` changed in place)."""
    cut, layer = layers[cut_name], layers[name]
    if cut.per_block or cut.batched != name or cut_name in wanted:
        return False
    if len(readers.get(cut_name, ())) != 1:
        return False
    (consumer,) = readers[cut_name]
    task = partition_task(layer)
    taken = _absorb_through(layers[consumer], cut_name, cut, layer, task)
    if taken is None:
        return False
    fused_task, meta = taken
    fused_task.key_name = name  # (the partitions keep their keys: the cut takes the step's)
    fused = retargeted(layer, task, fused_task, name, own_annotations(layer))
    if fused_task.store is not None:  # its target: one more argument (see .steps.store_of)
        fused = with_argument(fused, store_target(layers[consumer])[1])
        if fused is None:  # pragma: no cover - another Dask
            return False
        deps[name] |= deps[consumer] - {cut_name}
    layers[name] = fused
    layers[consumer] = cut.picking(consumer) if meta is None else cut.renamed(consumer, meta)
    deps[consumer] = {name}
    del layers[cut_name], deps[cut_name]
    return True


def take_through_gather(layers: dict, deps: dict, readers: dict, wanted: set, name: str) -> bool:
    """Take into the batched partition layer ``name`` what the blocks one of its gathers
    (a :class:`~.batch.Gathered` only it reads) joins were made by, where that can run on
    the joined batch: an elementwise Dask step (run before ``func``, the gather then
    gathers the blocks that step read), or the cut-back of a stage whose batches line up
    with the gather's (the same axis and ``k``: the partition reads those batches as they
    are, and the cut and the join are never made). Whether one was (``layers`` and
    ``deps`` changed in place)."""
    layer = layers[name]
    task = partition_task(layer)
    for gathered in deps.get(name, ()):
        gather = layers[gathered]
        if not isinstance(gather, Gathered) or gathered in wanted:
            continue
        if readers.get(gathered) != {name} or reads(layer, gathered) != 1:
            continue
        source = gather.source
        if source is None or source in wanted or source not in layers:
            continue
        made = layers[source]
        if isinstance(made, CutBack):
            batched = _lined_up(made, gather, tuple(layer.numblocks[gathered]))
            if batched is None:
                continue
            layers[name] = rerouted(layer, task, task, gathered, batched)
            deps[name] = (deps[name] - {gathered}) | {batched}
            del layers[gathered], deps[gathered]
            if readers.get(source) == {gathered}:
                del layers[source], deps[source]
            return True
        if readers.get(source) != {gathered}:
            continue
        step = _elementwise_step(made, layer)
        if step is None:
            continue
        position = argument_positions(layer, task)[gathered]
        renamed = "overlap-batch-" + tokenize(gathered, step.token, made.output)
        layers[renamed] = gather.regathered(renamed, elementwise_input(made))
        deps[renamed] = set(deps.pop(source))
        layers[name] = rerouted(layer, task, task.preceded(position, step), gathered, renamed)
        deps[name] = (deps[name] - {gathered}) | {renamed}
        del layers[gathered], deps[gathered], layers[source]
        return True
    return False


def _lined_up(cut: CutBack, gather: Gathered, grid: tuple[int, ...]) -> str | None:
    """The batched layer whose blocks ``gather`` would join anew from ``cut``'s blocks, where
    each batch it gathers is one of the cut's batches (the same axis, ``k`` and grid)."""
    if cut.per_block or (cut.axis, cut.k) != (gather.axis, gather.k):
        return None
    if tuple(len(c) for c in cut.chunks) != grid:
        return None
    return cut.batched


def _elementwise_step(made: Any, layer: Blockwise) -> Template | None:
    """``made`` as a step that may run on a joined batch, before the partition of ``layer``:
    an elementwise Dask step of the partition's annotations; else ``None``."""
    source = elementwise_input(made)
    if source is None or not elementwise(made.task):
        return None  # (np.sort of a batch is not the join of np.sort of its blocks)
    if own_annotations(made) != own_annotations(layer):
        return None
    return stage_of_template(made, source)
