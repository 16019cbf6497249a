"""Fusion through a ``batch="auto"`` cut-back: steps after a stage that joined its small
blocks run on its batches, before the cut.

With ``batch="auto"`` a partition joins ``k`` small blocks along ``split_axis`` and a
:class:`~.batch.CutBack` layer cuts its output back into the blocks. A step that reads
those blocks, one for one, runs in the partition instead, on each batch, where running it
on the batch is running it on each of its blocks: an elementwise step, or a reduction's
first step over axes other than the cut's whose partial is an array. The cut then cuts
the step's output, and is named as the step was.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from dask.base import tokenize
from dask.blockwise import Blockwise

from ..pipeline.task import PartitionTask
from .batch import CutBack, Gathered
from .rewrite import rerouted, retargeted
from .steps import (
    argument_positions,
    elementwise,
    elementwise_input,
    grid,
    own_annotations,
    partition_task,
    probe,
    reads_blockwise,
    reduced_axes,
    stage_of_template,
)

__all__ = ["fuse_through", "take_through_gather"]


def _absorb_through(
    consumer: Any, cut_name: str, cut: CutBack, layer: Blockwise, task: PartitionTask
) -> tuple[PartitionTask, np.dtype] | None:
    """The partition task of ``layer`` (whose batches ``cut`` cuts back into blocks) with
    ``consumer``'s Dask step taken in, run on each batch before the cut, and the dtype of
    its output; ``None`` where the step is not one that can be (an elementwise step, or a
    reduction's first step over axes other than the cut's, whose partial is an array)."""
    if not isinstance(consumer, Blockwise) or partition_task(consumer) is not None:
        return None
    if consumer.io_deps or own_annotations(consumer) != own_annotations(layer):
        return None
    if not reads_blockwise(consumer, cut_name, grid(consumer)):
        return None
    step = stage_of_template(consumer, cut_name)
    reduces = reduced_axes(consumer)
    if step is None or cut.axis in reduces or None in reduces:
        return None
    if not reduces and not elementwise(consumer.task):
        return None  # (np.sort on a batch is not np.sort on each of its blocks)
    found = probe(step, task)
    if not isinstance(found, np.ndarray):
        return None  # (a mean's partial is a dict: it cannot be cut)
    return task.absorbed(step, None, bool(reduces), found.dtype, reduces), found.dtype


def fuse_through(
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
    layers[name] = retargeted(layer, task, fused_task, name, own_annotations(layer))
    layers[consumer] = cut.renamed(consumer, cut.meta.astype(dtype))
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
        if readers.get(gathered) != {name} or [v for v, _ in layer.indices].count(gathered) != 1:
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
    if (cut.axis, cut.k) != (gather.axis, gather.k):
        return None
    if tuple(len(c) for c in cut.chunks) != grid:
        return None
    return cut.batched


def _elementwise_step(made: Any, layer: Blockwise) -> Any:
    """``made`` as a step that may run on a joined batch, before the partition of ``layer``:
    an elementwise Dask step of the partition's annotations; else ``None``."""
    source = elementwise_input(made)
    if source is None or not elementwise(made.task):
        return None  # (np.sort of a batch is not the join of np.sort of its blocks)
    if own_annotations(made) != own_annotations(layer):
        return None
    return stage_of_template(made, source)
