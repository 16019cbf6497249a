"""Partition tasks that depend on the blocks an alias layer stands for, not on its aliases.

``da.concatenate``, ``x.blocks[...]`` and other reorderings make a graph layer whose every
task is an alias: block ``i`` of the new array *is* block ``j`` of another. Distributed
runs each alias as a task of its own, on the worker that holds its target, so a partition
that reads a concatenated or reordered array waits a scheduling round more (the alias
finishes, the scheduler hears of it, then assigns the partition), and only then fetches
what it needs from another worker. On one H200, stage 2 of ``benchmarks/bench_cross.py``
(4 GiB of device chunks, all local) took 55 ms through such a layer against 33 ms
without it; with the layer seen through, 25 ms; and crossing workers went from 0.47 of
the local stage to 0.60-0.69 (``benchmarks/results/cross-worker.json``).

:func:`skip_aliases` rewrites one layer, the partition layer (or the layer that gathers
blocks for a batch), so that its tasks name the aliases' targets directly: the alias
layers are then needed by nothing and culled. Only layers made wholly of aliases are
seen through (chains of them followed), so what is resolved is exactly what Dask would
have moved unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import dask.array as da
from dask.core import iskey
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

try:  # Dask's task objects (2024.12 onwards)
    from dask._task_spec import Alias, GraphNode
except ImportError:  # pragma: no cover - an older Dask: aliases stay tasks
    Alias = GraphNode = None

__all__ = ["alias_targets", "layer_of", "skip_aliases"]


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


def skip_aliases(result: da.Array) -> da.Array:
    """``result`` with the tasks of its own layer depending on what the alias layers
    among their dependencies stand for; ``result`` itself when there are none.

    The layer becomes a materialized one (its tasks are built here, once, with the keys
    replaced); its class of task, annotations and keys are kept, and the graph keeps only
    the layers it still reaches.
    """
    if GraphNode is None:  # pragma: no cover - an older Dask
        return result
    graph = result.dask
    name = result.name
    deps = graph.dependencies.get(name, set())
    subs = alias_targets(graph, deps)
    if not subs:
        return result
    layer = graph.layers[name]
    tasks = dict(layer)
    if not all(isinstance(t, GraphNode) for t in tasks.values()):
        return result  # pragma: no cover - a layer of legacy tuples: left as Dask made it
    skipped = {layer_of(k) for k in subs}
    targets = {layer_of(t) for t in subs.values()}
    layers = dict(graph.layers)
    layers[name] = MaterializedLayer(
        {k: t.substitute(subs) for k, t in tasks.items()}, annotations=layer.annotations
    )
    dependencies = dict(graph.dependencies)
    dependencies[name] = (set(deps) - skipped) | targets
    # Only the layers the rewritten one still reaches: Dask's own cull can keep an alias
    # layer nothing needs (it keeps a legacy layer whole when the keys asked of it are as
    # many as its own, whichever they are).
    graph = HighLevelGraph(layers, dependencies).cull_layers([name])
    return da.Array(graph, name, result.chunks, meta=result._meta)
