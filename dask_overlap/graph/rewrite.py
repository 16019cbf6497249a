"""The one rewrite of a partition layer that Dask built: where Dask's own graph handling
does not do what a partition layer needs.

``map_blocks`` lets ``dask.array.map_blocks`` build the partition layer (so alignment,
broadcasting and naming are Dask's), then :func:`partition_layer` makes, from it, the
layer the graph keeps; the layer Dask built is not changed:

- **the task knows its array**: the partition task in the layer is replaced by one that
  knows the array's name, chunks and dtype (``PartitionTask.declared``), so that every
  partition checks what ``func`` returns against what the array declares;
- **each partition stays its own task** through Dask's two fusions (see
  :func:`unfused_task`);
- **alias layers are seen through** when the graph is optimized, after fusion
  (:func:`aliases_seen_through`).

And once Dask has optimized a graph, blocks of data that only a gather or a partition
reads are put into that task (:func:`inlined_data`).

This module is where dask_overlap touches Dask's private task objects
(``dask._task_spec``) and the inside of a ``Blockwise`` layer (:func:`retargeted`, which
fusion uses too): Dask offers no public way to keep a layer out of its fusions, to tell
an alias from a task, or to give a layer another task. Nowhere else in the package does.

**Aliases.** ``da.concatenate``, ``x.blocks[...]`` and other reorderings make a graph
layer whose every task is an alias: block ``i`` of the new array *is* block ``j`` of
another. Distributed runs each alias as a task of its own, on the worker that holds its
target, so a partition that reads a concatenated or reordered array waits a scheduling
round more (the alias finishes, the scheduler hears of it, then assigns the partition),
and only then fetches what it needs from another worker. On one H200, stage 2 of
``benchmarks/bench_cross.py`` (4 GiB of device chunks, all local) took 55 ms through such
a layer against 33 ms without it; with the layer seen through, 25 ms; and crossing
workers went from 0.47 of the local stage to 0.60-0.69 (``benchmarks/results/cross-
worker.json``).

:func:`aliases_seen_through` rewrites the partition layers (a batch's gather resolves its
own, through :func:`alias_targets`), so that their tasks name the aliases' targets
directly: the alias layers are then needed by nothing and culled. Only layers made
wholly of aliases are seen through (chains of them followed), so what is resolved is
exactly what Dask would have moved unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import dask.array as da
from dask.blockwise import Blockwise
from dask.core import flatten, iskey, reverse_dict
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

try:  # Dask's task objects (2024.12 onwards): private, see the module docstring
    from dask._task_spec import Alias, DataNode, GraphNode, TaskRef
    from dask._task_spec import Task as _DaskTask
except ImportError:  # pragma: no cover - an older Dask: aliases stay tasks, tasks fusable
    Alias = DataNode = GraphNode = TaskRef = _DaskTask = None

__all__ = [
    "PARTITION_ANNOTATION",
    "alias_targets",
    "aliases_seen_through",
    "asked_keys",
    "block_data",
    "is_partition_template",
    "is_task_node",
    "inlined_data",
    "keyed_task",
    "kept_apart",
    "layer_of",
    "partition_layer",
    "rerouted",
    "with_argument",
    "retargeted",
    "unfused_task",
]


def layer_of(key: Any) -> str | None:
    """The layer name a key belongs to in an array graph: ``key[0]`` of a tuple key."""
    if isinstance(key, tuple) and key and isinstance(key[0], str):
        return key[0]
    return key if isinstance(key, str) else None


def _target(value: Any) -> Any:
    """What ``value`` (a task of a materialized layer) would be an alias of, or ``None``."""
    if Alias is not None and isinstance(value, Alias):
        return value.target
    if isinstance(value, tuple) and iskey(value):  # Dask's legacy spelling of an alias
        return value
    return None


def _aliases_of(layer: Mapping, is_key: Callable[[Any], bool]) -> dict[Any, Any] | None:
    """``layer``'s keys and their targets, if it is materialized and every task in it is
    an alias of a key (``is_key``); otherwise ``None``."""
    if not isinstance(layer, MaterializedLayer):  # a Blockwise layer computes something
        return None
    out = {}
    for key, value in layer.items():
        target = _target(value)
        if target is None or target == key or not is_key(target):
            return None
        out[key] = target
    return out or None


def alias_targets(graph: HighLevelGraph, names: Iterable[str]) -> dict[Any, Any]:
    """For each layer in ``names`` made only of aliases, its keys and the keys they stand
    for, through chains of such layers.

    Examples
    --------
    >>> import dask.array as da
    >>> x = da.ones(4, chunks=2)
    >>> y = da.concatenate([x.blocks[1], x.blocks[0]])
    >>> subs = alias_targets(y.dask, [y.name])
    >>> subs[(y.name, 0)] == (x.name, 1), subs[(y.name, 1)] == (x.name, 0)
    (True, True)
    """
    layers: dict[str, dict[Any, Any] | None] = {}
    keys: dict[str, Any] = {}

    def is_key(key: Any) -> bool:
        """Whether ``key`` is a key of the layer named for it (the rule of an array's
        graph, by which the partition layer's dependencies are then written). A layer's
        keys are listed once, without building its tasks."""
        name = layer_of(key)
        if name not in graph.layers:
            return False
        if name not in keys:
            keys[name] = graph.layers[name].get_output_keys()
        return key in keys[name]

    def aliases(name: str) -> dict[Any, Any] | None:
        if name not in layers:
            layer = graph.layers.get(name)
            layers[name] = None if layer is None else _aliases_of(layer, is_key)
        return layers[name]

    out: dict[Any, Any] = {}
    for name in names:
        for key, target in (aliases(name) or {}).items():
            seen = {key}
            while (further := aliases(layer_of(target) or "")) and target in further:
                if target in seen:  # pragma: no cover - a cycle is no graph Dask makes
                    break
                seen.add(target)
                target = further[target]
            out[key] = target
    return out


def _seen_through(graph: HighLevelGraph, name: str) -> HighLevelGraph | None:
    """``graph`` with the tasks of layer ``name`` depending on what the alias layers among
    their dependencies stand for (the layer materialized, its class of task, annotations
    and keys kept); ``None`` where there is nothing to see through."""
    if GraphNode is None:  # pragma: no cover - an older Dask
        return None
    deps = graph.dependencies.get(name, set())
    subs = alias_targets(graph, deps)
    if not subs:
        return None
    layer = graph.layers[name]
    tasks = dict(layer)
    if not all(isinstance(t, GraphNode) for t in tasks.values()):
        return None  # pragma: no cover - a layer of legacy tuples: left as Dask made it
    skipped = {layer_of(k) for k in subs}
    targets = {layer_of(t) for t in subs.values()}
    layers = dict(graph.layers)
    layers[name] = MaterializedLayer(
        {k: t.substitute(subs) for k, t in tasks.items()}, annotations=layer.annotations
    )
    dependencies = dict(graph.dependencies)
    dependencies[name] = (set(deps) - skipped) | targets
    return HighLevelGraph(layers, dependencies)


def aliases_seen_through(
    graph: HighLevelGraph, names: Iterable[str], keep: Iterable[str]
) -> HighLevelGraph:
    """``graph`` with the alias layers that layers ``names`` read seen through (see the
    module docstring), and only the layers that those in ``keep`` still reach: Dask's own
    cull can keep an alias layer nothing needs (it keeps a legacy layer whole when the
    keys asked of it are as many as its own, whichever they are). ``graph`` itself where
    nothing is seen through.

    It runs when a graph is optimized, after fusion (:func:`.fusion.optimize`): a
    partition layer seen through is a materialized one, which fusion no longer reads, so
    a stage over a concatenated or reordered array took in no following step."""
    changed = False
    for name in names:
        seen = _seen_through(graph, name)
        if seen is not None:
            graph, changed = seen, True
    return graph.cull_layers([n for n in keep if n in graph.layers]) if changed else graph


if _DaskTask is not None:

    class _UnfusedTask(_DaskTask):
        """A partition task that Dask's linear fusion leaves alone.

        Dask fuses a one-dependency chain (a ``from_array`` slice, then this partition)
        into one task that runs the chain as a subgraph, ordering it anew
        (``dask.order``) on every run: on small partitions that costs more than this
        library's own per-partition path (``benchmarks/host_overhead.py``), and on a
        worker it holds the GIL the stream threads need. Distributed's P2P tasks opt
        out the same way."""

        __slots__ = ()

        @property
        def block_fusion(self) -> bool:
            return True


#: The annotation that keeps Dask's blockwise fusion off a partition layer (its value is the
#: layer's name, so that two partition layers differ too). It is given where Dask's
#: optimization runs (:func:`kept_apart`, from :func:`.fusion.optimize`), not when the
#: layer is built: a graph handed to Dask's ``optimize_blockwise`` by hand fuses as Dask's
#: own ``map_blocks`` layers do.
PARTITION_ANNOTATION = "overlap_partition"


def is_partition_template(task: Any) -> bool:
    """Whether ``task`` (a ``Blockwise`` layer's task template) is a partition layer's (see
    :func:`unfused_task`)."""
    return _DaskTask is not None and isinstance(task, _UnfusedTask)


def retargeted(
    layer: Blockwise, task: Any, new_task: Any, name: str, annotations: dict | None
) -> Blockwise:
    """A copy of the partition layer ``layer`` that calls ``new_task`` where it called
    ``task``, named ``name`` (its keys), with ``annotations`` (the user's); ``layer``
    itself is left as it is."""
    new = copy.copy(layer)  # Blockwise keeps its state in plain attributes...
    new.__dict__.pop("_cached_dict", None)  # ...and the tasks it made, for the old ones
    new.output = name
    new.indices = tuple((new_task if v is task else v, i) for v, i in layer.indices)
    new.task = unfused_task(layer.task, name)
    new.annotations = dict(annotations) if annotations else None
    return new


def _annotated(layer: Blockwise, name: str) -> Blockwise:
    new = copy.copy(layer)  # (the annotations change nothing in the tasks it made)
    new.annotations = {**(layer.annotations or {}), PARTITION_ANNOTATION: name}
    return new


def kept_apart(graph: HighLevelGraph) -> HighLevelGraph:
    """``graph`` as Dask's blockwise fusion, which runs next, should see it: every partition
    layer given :data:`PARTITION_ANNOTATION`, so that no neighbour is merged into its tasks
    (each would become a subgraph a block: see :func:`unfused_task`), but for a layer that
    makes blocks from nothing (``da.ones``, ``da.zeros``, ``da.full``: a ``Blockwise`` layer
    that depends on no other), read by that partition layer alone, with the same
    annotations: it gets the same mark, and is merged in as Dask merges it into any reader
    (one task a block, where its blocks are made and used). The layers are copies; those of
    ``graph`` are left as they are."""
    partitions = [
        name
        for name, layer in graph.layers.items()
        if isinstance(layer, Blockwise) and is_partition_template(layer.task)
    ]
    if not partitions:
        return graph  # (every array graph of a process that called map_blocks comes here)
    layers = dict(graph.layers)
    readers = reverse_dict(graph.dependencies)
    for name in partitions:
        layer = graph.layers[name]
        layers[name] = _annotated(layer, name)
        for dep in graph.dependencies.get(name, ()):
            made = graph.layers.get(dep)
            if (
                isinstance(made, Blockwise)
                and not graph.dependencies.get(dep)
                and readers.get(dep) == {name}
                and not is_partition_template(made.task)
                and (made.annotations or {}) == (layer.annotations or {})
            ):
                layers[dep] = _annotated(made, name)
    return HighLevelGraph(layers, graph.dependencies)


def with_argument(layer: Blockwise, value: Any) -> Blockwise | None:
    """A copy of the partition layer ``layer`` whose task gets ``value`` (a constant, or a
    reference to a key: Dask computes it first) as one more positional argument, the
    last; ``None`` where its task is not one of Dask's task objects. ``layer`` itself is
    left as it is."""
    t = layer.task
    if _DaskTask is None or not isinstance(t, _DaskTask):  # pragma: no cover - another Dask
        return None
    copied = copy.copy(layer)
    for cached in ("_cached_dict", "_dims"):
        copied.__dict__.pop(cached, None)
    arg = TaskRef(f"__dask_blockwise__{len(layer.indices)}")
    copied.indices = (*layer.indices, (value, None))
    copied.task = type(t)(t.key, t.func, *t.args, arg, _data_producer=t.data_producer, **t.kwargs)
    return copied


def rerouted(layer: Blockwise, task: Any, new_task: Any, old: str, new: str) -> Blockwise:
    """A copy of the partition layer ``layer`` that calls ``new_task`` where it called
    ``task`` and reads the blocks of ``new`` where it read those of ``old`` (the same grid:
    the array an elementwise step it took in read); ``layer`` itself is left as it is."""
    copied = copy.copy(layer)
    for cached in ("_cached_dict", "_dims"):
        copied.__dict__.pop(cached, None)
    copied.indices = tuple(
        # Only an array read (an index) is compared: a constant may be an ndarray.
        (new_task if v is task else new if i is not None and v == old else v, i)
        for v, i in layer.indices
    )
    numblocks = dict(layer.numblocks)
    numblocks[new] = numblocks.pop(old)
    copied.numblocks = numblocks
    return copied


def unfused_task(template: Any, key: str) -> Any:
    """``template`` (a partition layer's task) as an :class:`_UnfusedTask` for ``key``.

    With the annotation :func:`kept_apart` gives its layer where Dask's optimization runs,
    it keeps every task of a partition layer its own task through Dask's two fusions:

    - linear fusion: its task template is an :class:`_UnfusedTask` (``Task.substitute``
      keeps the class);
    - blockwise fusion, which merges neighbouring ``Blockwise`` layers (an elementwise
      ``x * 2`` before the partitions, or one after them, or a reduction's first step)
      into one task per block, run as a subgraph. It merges two layers only where their
      annotations allow it, and one of a key of its own (:data:`PARTITION_ANNOTATION`)
      never does. On the host backend's synchronous path (2,000 partitions of 64 KiB, on
      a 2-core CPU machine), a partition fused with ``* 1`` after it cost about 740 µs
      against 340-420 µs as tasks of their own; one fused with ``x * 1`` before it, 625
      against 440-530. What does belong in a partition is taken into it by
      dask_overlap's own fusion (:mod:`.fusion`), which runs before Dask's; a layer that
      makes blocks from nothing is let into it (see :func:`kept_apart`).
    """
    t = template
    if _DaskTask is None or not isinstance(t, _DaskTask):  # pragma: no cover - another Dask
        return t
    return _UnfusedTask(key, t.func, *t.args, _data_producer=t.data_producer, **t.kwargs)


def keyed_task(key: Any, func: Callable[..., Any], *args: Any, refs: Iterable[int] = ()) -> Any:
    """The task ``key = func(*args)``, where the arguments at positions ``refs`` are keys
    Dask computes first, as one of Dask's task objects: a graph of them needs no
    conversion where Dask optimizes and schedules it (Dask's converter took about 1.2 ms
    of a 4.5 ms optimization for 256 legacy slice tuples, on a 2-core CPU machine). A
    legacy tuple on an older Dask.

    >>> import operator
    >>> t = keyed_task(("y", 0), operator.getitem, ("x", 0), 1, refs=(0,))
    >>> t({("x", 0): [5, 6]})
    6
    """
    at = set(refs)
    if _DaskTask is None:  # pragma: no cover - an older Dask: its legacy spelling
        return (func, *args)
    return _DaskTask(key, func, *(TaskRef(a) if i in at else a for i, a in enumerate(args)))


def inlined_data(dsk: Any, keys: Iterable[Any], reads: Callable[[Any], bool]) -> Any:
    """``dsk`` (a graph Dask optimized, a dict of task objects) with each block of data in
    it (a literal value: a persisted array's block) that only one task reads, a task that
    ``reads`` says is one of this library's, put into that task and dropped as a key of
    its own; ``dsk`` itself where there is none (or where it is not such a dict).

    A gather of a batch reads its blocks once, and on Dask's threaded scheduler each key
    costs its ordering and its place in the scheduler's state whether it is computed or
    given: on the H100 machine's host, 256 blocks of 4 MiB took about 30 ms to order and
    optimize, against a 1 GiB batch stage's 25 ms at the card's bound. Inlined, the graph
    a ``batch="auto"`` stage over them hands the scheduler has half the keys (on the
    2-core CPU machine, ordering went from 6.1 to 2.4 ms and the persist from 20.8 to
    16.5). A value that several tasks read, or that is asked for (``keys``), stays a key.

    >>> import operator
    >>> g = {"a": DataNode("a", 5), "b": keyed_task("b", operator.neg, "a", refs=(0,))}
    >>> out = inlined_data(g, ["b"], lambda t: True)
    >>> sorted(out), out["b"]({})
    (['b'], -5)
    """
    if DataNode is None or not isinstance(dsk, dict):
        return dsk
    ours = [k for k, t in dsk.items() if isinstance(t, _DaskTask) and reads(t)]
    if not ours or not all(isinstance(t, GraphNode) for t in dsk.values()):
        return dsk  # (legacy tuples: an optimization set before ours left them)
    readers: dict[Any, int] = {}
    for t in dsk.values():
        for dep in t.dependencies:
            readers[dep] = readers.get(dep, 0) + 1
    asked = asked_keys(keys)
    out = None
    for key in ours:
        t = dsk[key]
        subs = {
            dep: dsk[dep]
            for dep in t.dependencies
            if readers.get(dep) == 1 and dep not in asked and _plain_data(dsk.get(dep))
        }
        if subs:
            if out is None:
                out = dict(dsk)
            out[key] = t.substitute(subs)
            for dep in subs:
                del out[dep]
    return dsk if out is None else out


def asked_keys(keys: Any) -> set | frozenset:
    """The keys asked of a graph's optimization (``keys``, nested lists as
    ``__dask_keys__`` gives them, or a set) as a set.

    >>> sorted(asked_keys([[("x", 0)], [("x", 1)]]))
    [('x', 0), ('x', 1)]
    """
    return keys if isinstance(keys, (set, frozenset)) else set(flatten(keys))


def block_data(key: Any, value: Any) -> Any:
    """``value``, the entry for ``key`` of a layer of data (a persisted array's), as one of
    Dask's data nodes where it is an array held in the graph (NumPy, CuPy or anything with
    their array interfaces); ``None`` where it is a task, an alias, a future or something
    else (or on an older Dask).

    >>> import numpy as np
    >>> block_data(("x", 0), np.ones(2)).value, block_data(("x", 0), ("y", 0))
    (array([1., 1.]), None)
    """
    if DataNode is None:  # pragma: no cover - an older Dask
        return None
    if isinstance(value, GraphNode):
        return value if _plain_data(value) else None
    if not (hasattr(value, "__array_interface__") or hasattr(value, "__cuda_array_interface__")):
        return None
    return DataNode(key, value)


def _plain_data(node: Any) -> bool:
    """Whether ``node`` is a block of data held in the graph, not a future (a cluster's
    result that a scheduler resolves by its key)."""
    if type(node) is not DataNode:
        return False
    value = node.value
    return not isinstance(value, TaskRef) and not getattr(value, "__dask_future__", False)


def is_task_node(value: Any) -> bool:
    """Whether ``value`` is one of Dask's task objects (a reference to another key, a
    task), rather than a plain value."""
    return GraphNode is not None and isinstance(value, GraphNode)


def partition_layer(result: da.Array, task: Any) -> da.Array:
    """``result`` (what ``dask.array.map_blocks`` built around the partition ``task``) with
    its layer rewritten as the module docstring says; a new array, with the same name,
    chunks and meta."""
    graph, name = result.dask, result.name
    layer = graph.layers.get(name)
    if not isinstance(layer, Blockwise) or not any(v is task for v, _ in layer.indices):
        raise RuntimeError(  # pragma: no cover - a Dask that builds map_blocks otherwise
            f"dask.array.map_blocks built the partition layer {name!r} as a "
            f"{type(layer).__name__} that does not hold the partition task as a constant; "
            "this version of dask_overlap expects a Blockwise layer"
        )
    declared = task.declared(name, result.chunks, result.dtype)
    new = retargeted(layer, task, declared, name, layer.annotations)
    layers = {**graph.layers, name: new}
    result = da.Array(
        HighLevelGraph(layers, graph.dependencies), name, result.chunks, meta=result._meta
    )
    # Alias layers it reads are seen through when the graph is optimized, after fusion
    # (aliases_seen_through): a materialized layer here would take in no following step.
    return result
