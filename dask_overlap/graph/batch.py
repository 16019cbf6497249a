"""Batches: small blocks joined into partitions (``batch=k`` and ``batch="auto"``).

Every partition costs a Dask task and this library's own host time, whatever its size, so
blocks along ``split_axis`` are gathered ``k`` at a time into one partition task
(:func:`joined`: one :class:`~dask_overlap.pipeline.pieces.Pieces` per array and
partition, joined on the worker), and with ``batch="auto"`` the partitions' outputs are
cut back into the blocks (:func:`unbatched`), so that the array returned has the input's
chunks. :func:`auto_batch` says how many blocks make a partition.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.core import reverse_dict
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from ..pipeline.layout import AUTO_MIN_BYTES, along, own_axis
from ..pipeline.pieces import gather
from .checks import as_list
from .placement import distributed_workers
from .rewrite import alias_targets, asked_keys, block_data, keyed_task, layer_of

__all__ = [
    "AUTO_MIN_PARTITIONS",
    "PEAK_MULTIPLE",
    "CutBack",
    "Gathered",
    "auto_batch",
    "joined",
    "split_arrays",
    "unbatched",
    "with_data_gathered",
    "worker_budget",
]


def split_arrays(
    arrays: Sequence[Any], positions: tuple[int, ...], ndim: int, split_axis: int
) -> list[tuple[int, Any, int]]:
    """``(position, array, its own axis)`` of each dask array with more than one block
    along ``split_axis`` (in the inputs' index space): those a batch joins. The others
    lack the axis or have one block along it, and are broadcast as they are."""
    found = []
    for i in positions:
        x = arrays[i]
        ax = own_axis(split_axis, ndim, x.ndim)
        if ax >= 0 and x.numblocks[ax] > 1:
            found.append((i, x, ax))
    return found


#: ``batch="auto"`` leaves at least this many partitions (where there were as many).
AUTO_MIN_PARTITIONS = 8


def auto_batch(
    asks_which_block: bool,
    arrays: Sequence[Any],
    positions: tuple[int, ...],
    ndim: int,
    split_axis: int | None,
    chunks: Any,
    drop_axis: Any,
    budget: int | None = None,
) -> int:
    """``batch="auto"``: how many blocks along ``split_axis`` make a partition of about
    ``AUTO_MIN_BYTES`` in (less where a worker's memory says so: ``budget``), counting the
    arrays that would be joined (those with more than one block along it); 1 where joining
    is not sound (no ``split_axis``, ``chunks=``, ``drop_axis``), where ``func`` asks which
    block it has (``asks_which_block``: it takes ``block_id`` or ``block_info``, and a
    batch's would not be the output block's), where a block's size is not known, or where
    blocks are that large.

    The size is the one below which a partition is never cut into sub-chunks, and on the
    H200 partitions of it ran at 0.77-0.82 of the bound where 4 and 16 MiB ones ran at
    0.15-0.49 (``benchmarks/diagnostics/small_partitions.py``). It never leaves fewer than
    ``AUTO_MIN_PARTITIONS`` partitions: a small array's blocks stay spread over the
    cluster's workers and a worker's threads.

    ``budget`` is the host memory one partition may take on the smallest worker
    (:func:`worker_budget`): a partition's peak is about :data:`PEAK_MULTIPLE` times its
    size, so partitions are kept to ``budget / PEAK_MULTIPLE`` (never below one block).
    """
    if split_axis is None or chunks is not None or as_list(drop_axis):
        return 1
    if asks_which_block:
        return 1
    per_block, along_axis, across = 0, 1, 1
    for _, x, ax in split_arrays(arrays, positions, ndim, split_axis):
        if any(math.isnan(c) for cs in x.chunks for c in cs):
            return 1  # an extent Dask does not know yet
        per_block += math.prod(max(cs) for cs in x.chunks) * x.dtype.itemsize
        along_axis = max(along_axis, x.numblocks[ax])
        across = max(across, x.npartitions // x.numblocks[ax])  # partitions beside each
    if per_block == 0:
        return 1
    batches = -(-AUTO_MIN_PARTITIONS // across)  # along the axis, for enough in all
    target = AUTO_MIN_BYTES if budget is None else min(AUTO_MIN_BYTES, budget // PEAK_MULTIPLE)
    return max(1, min(target // per_block, along_axis // batches))


#: A partition's peak host memory, as a multiple of its bytes in: its input joined (1x:
#: blocks that are not views of one array), ``func``'s result (1x) and a temporary of
#: ``func``'s own (1x). Measured by ``benchmarks/peak_memory.py``: on the host backend a
#: batch of ``b * 2 + 1`` peaked at 2x beyond its result, 3x in all.
PEAK_MULTIPLE = 3


def _memory_headroom() -> float:
    """The fraction of a worker's memory limit that its running tasks may still take once
    it stops starting new ones: from Dask's ``pause`` threshold (or ``spill``, ``target``)
    to its ``terminate`` one (0.8 to 0.95 by default: 0.15). A task past it gets its
    worker killed, whatever Dask spills meanwhile."""
    memory = dask.config.get("distributed.worker.memory", {}) or {}
    terminate = memory.get("terminate") or 1.0
    pause = memory.get("pause") or memory.get("spill") or memory.get("target") or 0.8
    return max(0.05, float(terminate) - float(pause))


def worker_budget(workers: dict[str, dict[str, Any]] | None = None) -> int | None:
    """Host bytes one partition may peak at on the smallest worker of the distributed
    client this graph will run on: the worker's memory limit over its threads (each runs
    a partition at once), times :func:`_memory_headroom`. ``workers``: their
    ``scheduler_info()`` entries, as :func:`.placement.distributed_workers` gives them
    (asked here when not given). ``None`` where there is no such bound to respect: no
    default distributed client (the threaded scheduler, a client not set as default), an
    asynchronous client (whose cached identity lists no workers), no workers yet, or no
    memory limit.
    """
    if workers is None:
        workers = distributed_workers()
    if not workers:
        return None
    per_thread = [
        w["memory_limit"] / max(1, w.get("nthreads") or 1)
        for w in workers.values()
        if w.get("memory_limit")
    ]
    if not per_thread:
        return None
    return int(min(per_thread) * _memory_headroom())


class Gathered(MaterializedLayer):
    """The layer of :func:`joined`'s gather tasks, which also says what it gathers: the
    blocks of ``source`` (``None`` where they are other layers' blocks, seen through
    aliases), ``k`` at a time along its ``axis``; ``gathers`` maps each key to the keys of
    the blocks it gathers. (Plain data, as :class:`CutBack`.)"""

    def __init__(self, gathers: dict, source: str | None, axis: int, k: int):
        super().__init__(
            {
                key: keyed_task(key, gather, axis, *blocks, refs=range(1, len(blocks) + 1))
                for key, blocks in gathers.items()
            }
        )
        self.gathers, self.source, self.axis, self.k = gathers, source, axis, k

    def regathered(self, name: str, source: str) -> Gathered:
        """The same gathers, named ``name``, of the blocks of ``source`` where they were of
        ``self.source`` (an array of the same grid: the one an elementwise step read)."""
        gathers = {
            (name, *key[1:]): [(source, *block[1:]) for block in blocks]
            for key, blocks in self.gathers.items()
        }
        return Gathered(gathers, source, self.axis, self.k)


def with_data_gathered(graph: HighLevelGraph, keys: Any) -> HighLevelGraph:
    """``graph`` with each :class:`Gathered` layer whose blocks are data held in the graph
    (a persisted array's: see :func:`.rewrite.block_data`), in a layer that nothing else
    reads and none of whose keys is asked for (``keys``), given those blocks as values,
    and that layer of data dropped; ``graph`` itself where there is none.

    Done before Dask's own optimization, which then handles a key a batch rather than a
    key a block more (culling, linear fusion): on the 2-core CPU machine, 256 blocks in
    16 batches went from 2.6 to 1.4 ms there. (:func:`.rewrite.inlined_data` does the
    same after it for what this leaves: blocks read through aliases, partitions that read
    blocks themselves.)
    """
    names = [
        name
        for name, layer in graph.layers.items()
        if isinstance(layer, Gathered) and layer.source in graph.layers
    ]
    if not names:
        return graph
    readers = reverse_dict(graph.dependencies)
    asked = asked_keys(keys)
    layers, deps = dict(graph.layers), dict(graph.dependencies)
    for name in names:
        layer: Gathered = graph.layers[name]
        source = graph.layers[layer.source]
        if type(source) is not MaterializedLayer or readers.get(layer.source) != {name}:
            continue
        if any(b not in source for blocks in layer.gathers.values() for b in blocks):
            continue  # (a layer that does not hold every block gathered: left as it is)
        if not asked.isdisjoint(source):
            continue
        values = {key: block_data(key, value) for key, value in source.items()}
        if any(v is None for v in values.values()):
            continue
        layers[name] = MaterializedLayer(
            {
                key: keyed_task(key, gather, layer.axis, *(values[b] for b in blocks))
                for key, blocks in layer.gathers.items()
            },
            annotations=layer.annotations,
        )
        deps[name] = deps[name] - {layer.source}
        del layers[layer.source], deps[layer.source]
    if len(layers) == len(graph.layers):
        return graph
    return HighLevelGraph(layers, deps)


class CutBack(MaterializedLayer):
    """The layer of :func:`unbatched`'s slice tasks, named ``name``, which also says what
    it cuts: the layer ``batched`` (the partitions' outputs, of ``chunks`` and ``meta``),
    along ``axis``, ``k`` blocks a batch, the blocks of extents ``blocks`` along it. A next
    ``batch="auto"`` stage that joins the same ``k`` blocks along that axis takes
    ``batched``'s blocks as they are (:func:`joined`): the slices, and the join of them,
    are then never run. Where fusion gave the partitions a step run on each block
    (:meth:`picking`), their results are one a block and each task takes its own
    (``per_block``). (Plain data: the graph holds the layer, and the layer holds no
    graph; its tasks are made from what it says.)"""

    def __init__(
        self,
        name: str,
        batched: str,
        chunks: tuple,
        meta: Any,
        axis: int,
        k: int,
        blocks: tuple[int, ...],
        per_block: bool = False,
    ):
        super().__init__(_cut_tasks(name, batched, chunks, axis, k, blocks, per_block))
        self.batched, self.chunks, self.meta = batched, chunks, meta
        self.axis, self.k, self.blocks, self.per_block = axis, k, blocks, per_block

    def renamed(self, name: str, meta: Any) -> CutBack:
        """The same cut, its keys named ``name``, of a batched layer whose blocks are now
        like ``meta`` (the layer a step was taken into: the same name, the same grid)."""
        return CutBack(
            name, self.batched, self.chunks, meta, self.axis, self.k, self.blocks, self.per_block
        )

    def picking(self, name: str) -> CutBack:
        """The cut of batches whose results are one a block (a tuple: a step was run on
        each block of a batch), its keys named ``name``: block ``j``'s task takes the
        ``j``-th of its batch's, where it sliced the batch."""
        return CutBack(
            name, self.batched, self.chunks, self.meta, self.axis, self.k, self.blocks, True
        )

    def batches(self, graph: HighLevelGraph) -> da.Array:
        """The batched array, from ``graph`` (a graph that holds this layer holds it)."""
        return da.Array(
            graph.cull_layers([self.batched]), self.batched, self.chunks, meta=self.meta
        )


def _cut_tasks(
    name: str,
    batched: str,
    chunks: tuple,
    axis: int,
    k: int,
    blocks: tuple[int, ...],
    per_block: bool,
) -> dict:
    """A :class:`CutBack`'s tasks: for each block, its slice of its batch's output (a view)
    or, ``per_block``, the result of its own in its batch's tuple of them."""
    grid = [len(blocks) if d == axis else len(c) for d, c in enumerate(chunks)]
    offsets = [0] * len(blocks)  # where each block starts in its batch
    for j in range(len(blocks)):
        if j % k:
            offsets[j] = offsets[j - 1] + blocks[j - 1]
    dsk: dict = {}
    for idx in np.ndindex(*grid):
        j = idx[axis]
        key = (name, *idx)
        source = (batched, *idx[:axis], j // k, *idx[axis + 1 :])
        what = j % k if per_block else along(axis, offsets[j], offsets[j] + blocks[j])
        dsk[key] = keyed_task(key, operator.getitem, source, what, refs=(0,))
    return dsk


def unbatched(
    y: da.Array, axis: int, chunks: tuple[int, ...], k: int, name: str | None
) -> da.Array:
    """``y``, whose blocks along ``axis`` are batches of ``k`` blocks of extents ``chunks``,
    cut back into those blocks (named ``name``, if given): one slice task a block, a view
    of its batch's output. (Dask's ``rechunk`` makes the same cut with a copy a block.)"""
    name = name or "overlap-unbatch-" + tokenize(y.name, axis, chunks, k)
    out_chunks = list(y.chunks)
    out_chunks[axis] = tuple(chunks)
    layer = CutBack(name, y.name, y.chunks, y._meta, axis, k, tuple(chunks))
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[y])
    return da.Array(graph, name, tuple(out_chunks), meta=y._meta)


def joined(arrays: Sequence[Any], positions: tuple[int, ...], ndim: int, axis: int, k: int) -> list:
    """``arrays`` with every dask array's blocks gathered ``k`` at a time along ``axis``
    (in the inputs' index space): the partition tasks then get one :class:`Pieces` per
    array and partition. An array without that axis, or with one block along it, is
    broadcast as it is."""
    out = list(arrays)
    for i, x, ax in split_arrays(arrays, positions, ndim, axis):
        cut = x.dask.layers.get(x.name)
        if isinstance(cut, CutBack) and not cut.per_block and (cut.axis, cut.k) == (ax, k):
            out[i] = cut.batches(x.dask)  # an auto stage's blocks, batched as they were made
            continue
        # A concatenated or reordered x: gather the blocks its aliases stand for.
        subs = alias_targets(x.dask, [x.name])
        n = x.numblocks[ax]
        starts = range(0, n, k)
        name = "overlap-batch-" + tokenize(x.name, ax, k)
        grid = [len(starts) if d == ax else nb for d, nb in enumerate(x.numblocks)]
        gathers: dict = {}
        for idx in np.ndindex(*grid):
            first = idx[ax] * k
            keys = [(x.name, *idx[:ax], j, *idx[ax + 1 :]) for j in range(first, min(first + k, n))]
            gathers[(name, *idx)] = [subs.get(key, key) for key in keys]
        chunks = list(x.chunks)
        chunks[ax] = tuple(sum(x.chunks[ax][s : s + k]) for s in starts)
        deps = {layer_of(t) for t in subs.values()} if subs else {x.name}
        layer = Gathered(gathers, None if subs else x.name, ax, k)
        graph = HighLevelGraph(
            {**x.dask.layers, name: layer},
            {**x.dask.dependencies, name: deps},
        ).cull_layers([name])
        out[i] = da.Array(graph, name, tuple(chunks), meta=x._meta)
    return out
